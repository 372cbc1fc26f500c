"""The official openai client against live servers: chat, completions, stream or not."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import API_KEY


def _client(server, key: str | None = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key or "none", max_retries=0, timeout=60)


def _completion_roundtrip(client: openai.OpenAI, model: str, tokenize) -> None:
    kw = dict(model=model, prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=42)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len(tokenize("Once upon a time"))
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


# SmolLM2-135M answers this with "The capital of France is Paris." in every format. Asked
# "What is the capital of France?" its first token is a near-tie (float32: "The" ahead of
# "L" by 0.08 logits) that int4 with one activation level, like llama.cpp on the same
# file, resolves to "L'Étoile, ...".
CAPITAL = [{"role": "user", "content": "Tell me the capital of France."}]


def _chat_roundtrip(client: openai.OpenAI, model: str) -> str:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                          temperature=0.7, seed=7)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            temperature=0.7, seed=7, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    return full.choices[0].message.content


def test_tiny_completions_and_chat(tiny_server, smol_tokenizer):
    client = _client(tiny_server)
    _completion_roundtrip(client, tiny_server.model, smol_tokenizer.encode)
    _chat_roundtrip(client, tiny_server.model)


@pytest.mark.slow
def test_real_model_completions_and_chat(real_server, smol_tokenizer):
    client = _client(real_server, None)
    _completion_roundtrip(client, real_server.model, smol_tokenizer.encode)
    _chat_roundtrip(client, real_server.model)
    answer = client.chat.completions.create(
        model=real_server.model, temperature=0, max_tokens=20, messages=CAPITAL)
    assert "Paris" in answer.choices[0].message.content
    usage = answer.usage
    prompt_ids = smol_tokenizer.encode_chat(CAPITAL)
    assert usage.prompt_tokens == len(prompt_ids)


def test_models_tokenize_detokenize(tiny_server, smol_tokenizer):
    import httpx

    client = _client(tiny_server)
    assert [m.id for m in client.models.list().data] == [tiny_server.model]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "Hello world"},
                   headers=headers)
    assert r.json()["tokens"] == smol_tokenizer.encode("Hello world")
    r = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": r.json()["tokens"]},
                   headers=headers)
    assert r.json()["prompt"] == "Hello world"
    # Special tokens round-trip, as in vLLM.
    ids = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "<|im_start|>user"},
                     headers=headers).json()["tokens"]
    r = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": ids}, headers=headers)
    assert r.json()["prompt"] == "<|im_start|>user"


def test_tokenize_counts_the_prompt_chat_bills(tiny_server):
    """Tools and a tool-call history are rendered as chat completions render them."""
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    for body in ({"messages": messages}, {"messages": messages[:1], "tools": tools},
                 {"messages": messages, "tools": tools}):
        counted = httpx.post(f"{tiny_server.url}/tokenize", json=body, headers=headers).json()
        chat = httpx.post(f"{tiny_server.v1}/chat/completions", headers=headers, json={
            "model": tiny_server.model, "max_tokens": 1, **body}).json()
        assert counted["count"] == chat["usage"]["prompt_tokens"], body
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "x", "tools": tools},
                   headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    # What chat refuses is refused here too (it was ignored, and the count was another's).
    r = httpx.post(f"{tiny_server.url}/tokenize", headers=headers, json={
        "messages": messages[:1], "chat_template": "{{ messages[0].content }}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    r = httpx.post(f"{tiny_server.url}/tokenize", headers=headers,
                   json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert "".join(r["token_strs"]) == "Hello world" and len(r["token_strs"]) == r["count"]


def test_long_texts_are_tokenized_alike_in_the_worker(tiny_server, smol_tokenizer):
    """Past 16K characters the server tokenizes in a worker process: the same ids."""
    import httpx

    from llmserve.server.tokenizing import INLINE_CHARS

    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = "The quick brown fox jumps over the lazy dog. " * (INLINE_CHARS // 40)
    assert len(text) > INLINE_CHARS
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": text}, headers=headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == smol_tokenizer.encode(text)
    messages = [{"role": "user", "content": text}]
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages},
                   headers=headers, timeout=60)
    assert r.json()["tokens"] == smol_tokenizer.encode_chat(messages)


def test_n_logprobs_stop_and_extras(tiny_server):
    client = _client(tiny_server)
    out = client.completions.create(model=tiny_server.model, prompt="abc", max_tokens=8, n=3,
                                    temperature=1.0, seed=1, logprobs=3,
                                    extra_body={"top_k": 20, "min_p": 0.01,
                                                "repetition_penalty": 1.1})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        assert all(len(t) <= 4 for t in c.logprobs.top_logprobs)  # the top 3, the token
    chat = client.chat.completions.create(model=tiny_server.model, max_completion_tokens=6,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes is not None for e in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    free = client.completions.create(model=tiny_server.model, prompt="xyz", max_tokens=20,
                                     temperature=0)
    stop = free.choices[0].text[5:8]
    cut = client.completions.create(model=tiny_server.model, prompt="xyz", max_tokens=20,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == free.choices[0].text[:free.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
