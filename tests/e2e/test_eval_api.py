"""What evaluation harnesses and usage accounting need from the API, through the official
openai client: echo (with logprobs, streamed or not, prompts as text or token ids),
max_tokens 0, vLLM's prompt_logprobs, cached_tokens and GET /v1/models/{id}."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.v1, api_key=API_KEY, max_retries=0, timeout=60)


def _stream(client: openai.OpenAI, **kw) -> list:
    return list(client.completions.create(**kw, stream=True,
                                          stream_options={"include_usage": True}))


def _joined(chunks: list, index: int = 0) -> tuple[str, dict[str, list]]:
    """A streamed choice put back together: its text and its logprobs lists."""
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                       "text_offset": []}
    for c in chunks:
        for choice in c.choices:
            if choice.index != index:
                continue
            text += choice.text
            if choice.logprobs is not None:
                for key, values in lists.items():
                    values.extend(getattr(choice.logprobs, key))
    return text, lists


def test_echo_returns_the_prompt_then_the_completion(client, tiny_server):
    kw = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.completion_tokens == 6
    chunks = _stream(client, **kw, echo=True)
    first = next(c for c in chunks if c.choices)
    assert first.choices[0].text.startswith(PROMPT)
    assert _joined(chunks)[0] == PROMPT + plain


def test_echo_with_logprobs_covers_prompt_then_generated_tokens(client, tiny_server,
                                                                smol_tokenizer):
    ids = smol_tokenizer.encode(PROMPT)
    kw = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=4, temperature=0,
              logprobs=3)
    plain = client.completions.create(**kw).choices[0].logprobs
    full = client.completions.create(**kw, echo=True).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(ids) + 4
    assert lp.tokens[:len(ids)] == [smol_tokenizer.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(0 < len(top) <= 4 for top in lp.top_logprobs[1:])  # the top 3 and the token
    assert all(top[tok] == x for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                    lp.top_logprobs[1:]))
    assert lp.tokens[len(ids):] == plain.tokens
    assert lp.token_logprobs[len(ids):] == plain.token_logprobs
    assert lp.top_logprobs[len(ids):] == plain.top_logprobs
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == full.text
    # A top-1 entry holds the token itself exactly when it is the model's first choice.
    for tok, lp_, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        best = max(top.values())
        assert lp_ <= best + 1e-6
        if tok in top:
            assert top[tok] == lp_

    chunks = _stream(client, **kw, echo=True)
    text, lists = _joined(chunks)
    assert text == full.text
    for key, values in lists.items():
        assert values == getattr(lp, key), key
    first = next(c for c in chunks if c.choices).choices[0]
    assert len(first.logprobs.tokens) == len(ids) + 1  # the prompt with the first token
    assert chunks[-1].usage.completion_tokens == 4


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, tiny_server,
                                                        smol_tokenizer):
    ids = smol_tokenizer.encode(PROMPT)
    kw = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    out = client.completions.create(**kw)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    longer = client.completions.create(**{**kw, "max_tokens": 2}).choices[0].logprobs
    assert choice.logprobs.token_logprobs == longer.token_logprobs[:len(ids)]
    assert choice.logprobs.top_logprobs == longer.top_logprobs[:len(ids)]

    chunks = _stream(client, **kw)
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) == 1 and with_choices[0].choices[0].finish_reason == "length"
    text, lists = _joined(chunks)
    assert text == PROMPT and lists["token_logprobs"] == choice.logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0

    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH,
                   json={"model": tiny_server.model, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "max_completion_tokens": 0,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_echo_of_token_id_prompts_each_choice_its_own(client, tiny_server, smol_tokenizer):
    prompts = [smol_tokenizer.encode("One two three"), smol_tokenizer.encode("Red green")]
    out = client.completions.create(model=tiny_server.model, prompt=prompts, max_tokens=3,
                                    n=2, echo=True, logprobs=0, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        ids = prompts[c.index // 2]
        prompt_text = smol_tokenizer.decode(ids)
        assert c.text.startswith(prompt_text) and len(c.text) > len(prompt_text)
        assert len(c.logprobs.tokens) == len(ids) + 3
        assert c.logprobs.token_logprobs[0] is None
        # logprobs 0: the sampled (or echoed) token alone, as OpenAI and vLLM return it
        assert all(top == {tok: lp} for tok, lp, top in zip(
            c.logprobs.tokens[1:], c.logprobs.token_logprobs[1:], c.logprobs.top_logprobs[1:]))
    single = client.completions.create(model=tiny_server.model, prompt=prompts[0],
                                       max_tokens=0, echo=True, logprobs=0)
    by_index = {c.index: c for c in out.choices}
    n_prompt = len(prompts[0])
    for i in (0, 1):  # both sequences of a prompt echo the same prompt logprobs
        assert (by_index[i].logprobs.token_logprobs[:n_prompt]
                == single.choices[0].logprobs.token_logprobs)
    chunks = _stream(client, model=tiny_server.model, prompt=prompts, max_tokens=3, n=2,
                     echo=True, temperature=1.0, seed=3)
    for index, c in by_index.items():
        assert _joined(chunks, index)[0] == c.text


def test_echoed_logprobs_equal_the_models_own(client, tiny_server, tiny_model_dir,
                                             smol_tokenizer):
    """The reference: transformers' forward pass of the same tiny model."""
    _, hf = tiny_model_dir("llama-gqa")
    ids = smol_tokenizer.encode(PROMPT + " Rome, and the capital of Spain is Madrid.")
    out = client.completions.create(model=tiny_server.model, prompt=ids, max_tokens=0,
                                    echo=True, logprobs=5)
    lp = out.choices[0].logprobs
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        top = torch.topk(ref[j - 1], 5)
        want = {smol_tokenizer.token_text(t): v for t, v in zip(top.indices.tolist(),
                                                                  top.values.tolist())}
        # The prompt's own token too, when it is not among the 5 (OpenAI's "up to k + 1").
        assert set(lp.top_logprobs[j]) == set(want) | {lp.tokens[j]}
        for tok, value in lp.top_logprobs[j].items():
            assert value == pytest.approx(want.get(tok, lp.token_logprobs[j]), abs=1e-4)


def test_prompt_logprobs_are_returned_as_vllm_does(client, tiny_server, smol_tokenizer):
    ids = smol_tokenizer.encode(PROMPT)
    kw = dict(model=tiny_server.model, prompt=PROMPT, max_tokens=2, temperature=0)
    out = client.completions.create(**kw, extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    echoed = client.completions.create(**kw, echo=True, logprobs=1).choices[0].logprobs
    for j in range(1, len(ids)):
        entry = plp[j]
        own = entry[str(ids[j])]  # the prompt's own token comes first
        assert next(iter(entry)) == str(ids[j])
        assert own["logprob"] == echoed.token_logprobs[j]
        assert own["decoded_token"] == smol_tokenizer.token_text(ids[j])
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[j]))
        assert ranks == [1, 2][:len(ranks)] and len(entry) in (2, 3)
        assert (own["rank"] <= 2) == (len(entry) == 2)
    assert out.choices[0].logprobs is None  # prompt_logprobs alone adds no logprobs
    chunks = _stream(client, **kw, extra_body={"prompt_logprobs": 2})
    first = next(c for c in chunks if c.choices).choices[0]
    assert first.prompt_logprobs == plp
    later = [c.choices[0] for c in chunks if c.choices][1:]
    assert later and all(getattr(c, "prompt_logprobs", None) is None for c in later)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=tiny_server.model, messages=messages,
                                          max_tokens=2, extra_body={"prompt_logprobs": 1})
    chat_ids = smol_tokenizer.encode_chat(messages)
    assert len(chat.prompt_logprobs) == len(chat_ids) and chat.prompt_logprobs[0] is None
    assert str(chat_ids[-1]) in chat.prompt_logprobs[-1]
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "messages": messages, "stream": True,
                         "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_cached_tokens_count_prefix_cache_hits(client, tiny_server, smol_tokenizer):
    # Unique text, so that no earlier test's blocks are in the cache.
    prompt = f"{uuid.uuid4()} " + "A long shared context about many things. " * 20
    n = len(smol_tokenizer.encode(prompt))
    kw = dict(model=tiny_server.model, prompt=prompt, max_tokens=2, temperature=0)
    cold = client.completions.create(**kw)
    assert cold.usage.prompt_tokens == n
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = client.completions.create(**kw)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    block = httpx.get(f"{tiny_server.url}/console/api/info", headers=AUTH).json()["kv_block_size"]
    assert block == 32  # the CPU's default (config.default_block_size)
    assert 0 < cached < n and cached == (n - 1) // block * block  # full blocks but the last
    chunks = _stream(client, **kw)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    two = client.completions.create(**{**kw, "prompt": [prompt, prompt]})
    assert two.usage.prompt_tokens_details.cached_tokens == 2 * cached

    messages = [{"role": "user", "content": prompt}]
    chat_kw = dict(model=tiny_server.model, messages=messages, max_tokens=2)
    client.chat.completions.create(**chat_kw)
    chat = client.chat.completions.create(**chat_kw)
    chat_cached = chat.usage.prompt_tokens_details.cached_tokens
    assert chat_cached > 0
    streamed = list(client.chat.completions.create(**chat_kw, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == chat_cached


def test_retrieve_a_model(client, tiny_server):
    model = client.models.retrieve(tiny_server.model)
    listed = client.models.list().data[0]
    assert model.id == tiny_server.model and model.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(f"{tiny_server.v1}/models/org/some-model", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
