"""Asynchronous scheduling: a step planned and launched before the one before is read.

On a CPU nothing overlaps (each kernel returns when done), but the plan is the same as on
a GPU: the step after is scheduled with placeholders for the tokens the running step
samples, and the runner takes them from that step's sampled ids. The output must be what
the synchronous engine gives, token for token, whatever stops, aborts or admissions fall
between the two steps, and every block must come back.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig, SchedulerConfig, SpeculativeConfig, default_block_size


def _llm(path: str, asynchronous: bool, **kw) -> LLM:
    return LLM(path, max_model_len=512, seed=3, async_scheduling=asynchronous, **kw)


def _mixed(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded requests of many lengths, some stopping on a stop token (the
    random model's own frequent tokens), some with logprobs or a logit bias."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(17, 49152) for _ in range(rng.randint(1, 120))]
               for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 4
        params.append(SamplingParams(
            temperature=0 if kind in (0, 2) else 0.9,
            seed=None if kind in (0, 2) else 100 + i,
            max_tokens=rng.randint(1, 40),
            logprobs=2 if kind == 2 else None,
            logit_bias={rng.randrange(17, 49152): 5.0} if kind == 3 else None,
            ignore_eos=True))
    return prompts, params


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    llm.engine.kv_manager.check_integrity()
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
             [lp and sorted(lp.items()) for lp in (o.outputs[0].logprobs or [])])
            for o in outs]


def _with_stops(llm: LLM, prompts, params) -> list[SamplingParams]:
    """The same requests, each stopped by a token its synchronous run emits midway (so that
    the step launched ahead of the stop decodes in vain)."""
    first = llm.generate(prompts, params)
    out = []
    for o, p in zip(first, params):
        ids = o.outputs[0].token_ids
        stop = [ids[len(ids) // 2]] if len(ids) > 2 else []
        out.append(dataclasses.replace(p, stop_token_ids=stop))
    return out


def check_async_equals_sync(path: str, **fmt) -> LLM:
    """24 mixed requests through 8 sequence slots, with and without async scheduling: the
    same tokens, finish reasons and logprobs; returns the asynchronous LLM."""
    prompts, params = _mixed(0, 24)
    sync = _llm(path, False, max_num_batched_tokens=64, max_num_seqs=8, **fmt)
    ahead = _llm(path, True, max_num_batched_tokens=64, max_num_seqs=8, **fmt)
    assert not sync.engine.async_scheduling and ahead.engine.async_scheduling
    params = _with_stops(sync, prompts, params)
    reference = _run(sync, prompts, params)
    got = _run(ahead, prompts, params)
    assert got == reference
    assert ahead.engine.steps_ahead > 0
    assert sync.engine.steps_ahead == 0
    stopped = sum(r[1] == "stop" for r in reference)
    assert stopped >= 8, f"only {stopped} requests stopped on a stop token"
    return ahead


def test_async_scheduling_gives_the_synchronous_output(tiny_model_dir):
    check_async_equals_sync(str(tiny_model_dir("llama-gqa")[0]))


def test_async_scheduling_under_preemption_and_prefix_caching(tiny_model_dir):
    """A small pool: the step ahead never preempts (it is not launched when a request
    does not fit), the synchronous schedule that follows does."""
    path = str(tiny_model_dir("llama-gqa")[0])
    rng = random.Random(1)
    system = [rng.randrange(17, 49152) for _ in range(64)]
    prompts = [system + [rng.randrange(17, 49152) for _ in range(rng.randint(1, 60))]
               for _ in range(16)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 48), ignore_eos=True)
              for _ in prompts]
    reference = _run(_llm(path, False, num_kv_blocks=1024), prompts, params)
    small = _llm(path, True, num_kv_blocks=640 // default_block_size("cpu"),  # 640 tokens
                 max_num_batched_tokens=128, max_num_seqs=16)
    assert _run(small, prompts, params) == reference
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and small.engine.steps_ahead > 0
    cached = _llm(path, True, num_kv_blocks=1024, max_num_batched_tokens=96)
    assert _run(cached, prompts, params) == reference
    assert cached.engine.stats().prefix_hits > 0


def test_async_scheduling_with_families_priorities_stop_strings_and_eos(tiny_model_dir):
    """n = 2 families (siblings admitted once their lead's prompt is in), the priority
    policy under a small pool, stop strings (the frontend aborts the request after the step
    ahead was launched) and EOS left on: the synchronous output, every sequence of it."""
    path = str(tiny_model_dir("llama-gqa")[0])
    rng = random.Random(5)
    prompts = [[rng.randrange(17, 49152) for _ in range(rng.randint(4, 90))]
               for _ in range(12)]
    sync = _llm(path, False)
    texts = [o.outputs[0].text for o in sync.generate(prompts, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))]
    params = []
    for i, text in enumerate(texts):
        stop = (text[len(text) // 2:len(text) // 2 + 3],) if i % 3 == 0 and len(text) > 6 else ()
        params.append(SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=24,
                                     n=2 if i % 4 == 1 else 1, stop=stop))
    priority = [i % 3 for i in range(len(prompts))]

    def run(asynchronous: bool) -> list:
        llm = LLM(path, max_model_len=256, seed=3, async_scheduling=asynchronous,
                  num_kv_blocks=320 // default_block_size("cpu"), max_num_seqs=6,
                  max_num_batched_tokens=64,
                  policy="priority")
        outs = llm.generate(prompts, params, priority=priority)
        llm.engine.kv_manager.check_integrity()
        assert llm.engine.stats().kv_blocks_used == 0
        return llm, [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs]

    _, reference = run(False)
    ahead, got = run(True)
    assert got == reference
    assert ahead.engine.steps_ahead > 0 and ahead.engine.stats().num_preemptions > 0
    assert sum(c[1] == "stop" for o in reference for c in o) >= 3


def test_no_step_ahead_for_requests_that_read_their_tokens(tiny_model_dir):
    """Penalties and min_tokens read the host copy of a request's tokens: while such a
    request runs, every step is planned after the one before is read."""
    path = str(tiny_model_dir("llama-gqa")[0])
    prompts, _ = _mixed(2, 6)
    params = [SamplingParams(temperature=0, max_tokens=12, frequency_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=4)]
    for p in params:
        reference = _run(_llm(path, False), prompts, [p] * len(prompts))
        ahead = _llm(path, True)
        assert _run(ahead, prompts, [p] * len(prompts)) == reference
        assert ahead.engine.steps_ahead == 0


def test_abort_while_a_step_runs_ahead(tiny_model_dir):
    """Requests aborted while a step that holds them runs ahead: that step's tokens for them
    are dropped, their blocks come back, the others go on as alone."""
    path = str(tiny_model_dir("llama-gqa")[0])
    engine = _llm(path, True).engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": [20 + i] * (5 + i) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}

    def step() -> None:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)

    while engine._ahead is None:
        step()
    engine.abort("r1")
    engine.abort("r2")
    cut = {rid: len(got[rid]) for rid in ("r1", "r2")}
    while engine.has_unfinished():
        step()
    engine.kv_manager.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    assert {rid: len(got[rid]) for rid in ("r1", "r2")} == cut
    alone = _llm(path, False)
    for rid in ("r0", "r3"):
        assert got[rid] == alone.generate([prompts[rid]], params)[0].outputs[0].token_ids


def test_a_request_id_held_by_a_step_in_flight_is_refused(tiny_model_dir):
    """An id whose request ended while a step that holds it runs ahead: that step's token
    would be taken for a new request of the same id."""
    engine = _llm(str(tiny_model_dir("llama-gqa")[0]), True).engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("r", [20] * 6, params)
    while engine._ahead is None:
        engine.step()
    engine.abort("r")
    with pytest.raises(ValueError, match="still held by a step in flight"):
        engine.add_request("r", [21] * 6, params)
    assert engine.has_unfinished()
    engine.reset_prefix_cache()  # reads the leftover step first
    assert not engine.has_unfinished()
    engine.add_request("r", [21] * 6, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv_blocks_used == 0


def test_async_scheduling_config():
    with pytest.raises(ValueError, match="async_scheduling must be"):
        SchedulerConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="cannot be combined with speculative decoding"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True),
                     speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
