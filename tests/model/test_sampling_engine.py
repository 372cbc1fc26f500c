"""The sampling contract through the engine, on a tiny random-weight model."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.validation import ContextLengthError
from llmserve.runner.scoring import sequence_logits


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    return LLM(str(path), num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=256)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(17, 49152) for _ in range(n)]


def test_seeded_request_same_alone_and_in_a_batch_of_16(llm):
    rng = random.Random(0)
    target = _prompt(rng, 30)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = [_prompt(rng, rng.randint(1, 120)) for _ in range(16)]
    other_params = [SamplingParams(temperature=rng.choice([0, 0.5, 1.2]), seed=rng.choice(
        [None, 7, 99]), max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in others]
    outs = llm.generate([*others[:8], target, *others[8:]], [*other_params[:8], params,
                                                               *other_params[8:]])
    assert outs[8].outputs[0].token_ids == alone
    unseeded = llm.generate([target], SamplingParams(temperature=0.9, max_tokens=24,
                                                     ignore_eos=True))[0]
    assert unseeded.outputs[0].token_ids != alone  # the seed, not luck, made them equal


def test_n_sequences_share_the_prompt_prefill(llm):
    rng = random.Random(1)
    prompt = _prompt(rng, 100)
    kv = llm.engine.kv_manager
    hits_before = kv.prefix_hits
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # Siblings reuse every full block of the prompt: 3 blocks of 32 = 96 tokens each.
    assert kv.block_size == 32
    assert kv.prefix_hits - hits_before == 3 * 96
    # Sequence i is the request with seed 5 + i: seeds differ, so do the sequences.
    for i, c in enumerate(out.outputs):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8,
                                                       ignore_eos=True))[0]
        assert c.token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    kv.check_integrity()


def test_n_sequences_share_blocks_without_prefix_caching(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), num_kv_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    prompt = _prompt(random.Random(2), 64)
    llm.generate([prompt], SamplingParams(max_tokens=2))  # would be a hit with caching on
    kv = llm.engine.kv_manager
    assert kv.prefix_hits == 0
    llm.generate([prompt], SamplingParams(n=2, max_tokens=2, temperature=0))
    # Only the sibling shared: 1 of the prompt's 2 blocks of 32 (the last one holds the token
    # that is computed again to give the sibling its logits).
    assert kv.prefix_hits == 32


def test_logprobs_and_prompt_logprobs_match_the_model(llm):
    rng = random.Random(3)
    prompt = _prompt(rng, 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    out = llm.generate([prompt], params)[0]
    tokens = out.outputs[0].token_ids
    model = llm.engine.loaded.model
    ref = sequence_logits(model, prompt + tokens).log_softmax(-1)
    for i, (tok, lps) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert next(iter(lps)) == tok and lps[tok].rank == 1  # greedy picks rank 1
        assert lps[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert list(lps) == torch.topk(row, 5).indices.tolist()  # chosen is the top-1
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        entry = plp[j]
        assert prompt[j] in entry
        assert entry[prompt[j]].logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
        assert len(entry) <= 4


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm):
    """A prompt-only request (lm-evaluation-harness's scoring): the same prompt logprobs as
    a request that goes on to generate, no token, finish reason "length", blocks freed;
    with n = 2 the second sequence reuses the first's blocks instead of recomputing."""
    prompt = _prompt(random.Random(6), 40)
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    generated = llm.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=2,
                                                      temperature=0))[0]
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert scored.outputs[0].finish_reason == "length"
    assert len(scored.prompt_logprobs) == 40 and scored.prompt_logprobs[0] is None
    assert scored.prompt_logprobs == generated.prompt_logprobs
    kv = llm.engine.kv_manager
    hits = kv.prefix_hits
    two = llm.generate([prompt], SamplingParams(n=2, max_tokens=0, prompt_logprobs=2))[0]
    assert [(c.index, c.token_ids, c.finish_reason) for c in two.outputs] == [
        (0, [], "length"), (1, [], "length")]
    assert two.prompt_logprobs == scored.prompt_logprobs
    assert kv.prefix_hits - hits == 32  # the sibling: 2 full blocks (16 each) of 40 tokens
    assert two.num_cached_tokens == 0  # the prompt itself was computed
    full = llm.generate([[7] * 1024], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert len(full.prompt_logprobs) == 1024  # a prompt may fill the window when scored
    with pytest.raises(ContextLengthError, match="no room left to generate"):
        llm.generate([[7] * 1024], SamplingParams(max_tokens=1))
    assert llm.engine.stats().kv_blocks_used == 0
    kv.check_integrity()


def test_stop_string_ends_generation_through_the_engine(llm):
    rng = random.Random(4)
    prompt = _prompt(rng, 10)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True))[0].outputs[0]
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)
    assert llm.engine.stats().kv_blocks_used == 0


def test_stop_token_ids(llm):
    prompt = _prompt(random.Random(5), 10)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_context_window_is_enforced(llm):
    with pytest.raises(ContextLengthError, match=r"plus max_tokens \(100\) exceeds the context "
                                                 r"window of 1024 tokens"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="logit_bias has token id 60000"):
        llm.generate([[5]], SamplingParams(logit_bias={60000: 1.0}))
    assert not llm.engine.has_unfinished()


def test_logit_bias_forces_a_token(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={1234: 100.0}))[0]
    assert out.outputs[0].token_ids == [1234] * 4
