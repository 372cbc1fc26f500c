"""Speculative decoding through the engine: the output is the same with and without it,
token for token (greedy and seeded sampling, every sampling parameter), alone and in any
batch; drafts are proposed and accepted along the way (checked, so the comparison is not
vacuous)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.attention.kv_format import kv_bytes_per_vector
from llmserve.config import default_block_size
from llmserve.errors import ModelLoadError
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.spec_decode import StepCost
from llmserve.spec_decode.draft import DraftProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# Rows cost nothing: the planner then speculates in any batch (the identity must hold
# whatever the planner decides; this makes it decide "speculate" as often as possible).
FREE_ROWS = StepCost([(1, 1.0), (1 << 20, 1.0)])


def speculate_always(speculator) -> None:
    """Rows, draft-model passes and a draft model's catch-up on a history cost nothing, any
    expected gain is taken, and the guard stands aside: every proposal found is verified,
    however rarely drafts are accepted."""
    speculator.cost = FREE_ROWS
    speculator.guard = False
    speculator.MIN_GAIN = speculator.MODEL_GAIN = 1.0
    speculator.proposer.step_seconds = 0.0
    if hasattr(speculator.proposer, "prefill_token_seconds"):
        speculator.proposer.prefill_token_seconds = 0.0


def _params(rng: random.Random, i: int) -> SamplingParams:
    kind = i % 5
    common = dict(max_tokens=rng.randint(1, 40), ignore_eos=True)
    if kind == 0:
        return SamplingParams(temperature=0, **common)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_k=20, seed=i, logprobs=2, **common)
    if kind == 2:
        return SamplingParams(temperature=0, frequency_penalty=0.5, repetition_penalty=1.2,
                              logit_bias={rng.randrange(17, 49152): 2.0}, **common)
    if kind == 3:
        return SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, n=2,
                              presence_penalty=0.3, **common)
    return SamplingParams(temperature=0, min_tokens=3, max_tokens=rng.randint(3, 40),
                          stop_token_ids=[rng.randrange(17, 49152)], logprobs=1)


def _workload(n: int = 50):
    """Prompts with repeated stretches (something to copy) and without."""
    rng = random.Random(7)
    prompts = []
    for i in range(n):
        piece = [rng.randrange(17, 49152) for _ in range(rng.randint(1, 12))]
        noise = [rng.randrange(17, 49152) for _ in range(rng.randint(0, 30))]
        prompts.append(noise + piece * rng.randint(1, 6) if i % 3 else noise + piece)
    return prompts, [_params(rng, i) for i in range(n)]


def _run(model, prompts, params, speculative, alone: bool, inspect=None, **kw):
    llm = LLM(str(model), max_model_len=512, num_kv_blocks=512, speculative_config=speculative,
              **kw)
    if llm.engine.speculator is not None:
        speculate_always(llm.engine.speculator)
    if alone:
        outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    llm.engine.kv_manager.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    if inspect is not None:
        inspect(llm)
    result = [[(c.token_ids, c.text, c.finish_reason,
                None if c.logprobs is None else [{t: round(lp.logprob, 4) for t, lp in d.items()}
                                                 for d in c.logprobs])
               for c in o.outputs] for o in outs]
    return result, llm.engine.stats()


_REFERENCE: dict = {}


def _reference(path, fmt: dict):
    """Each of the 50 requests alone without speculation (computed once per format)."""
    key = (str(path), tuple(sorted(fmt.items())))
    if key not in _REFERENCE:
        prompts, params = _workload()
        _REFERENCE[key] = _run(path, prompts, params, None, alone=True, **fmt)[0]
    return _REFERENCE[key]


@pytest.mark.parametrize("fmt", [pytest.param({}, id="float32"),
                                 pytest.param({"quantization": "int4"}, id="int4")])
def test_output_identical_with_and_without_speculation(tiny_model_dir, fmt):
    path, _ = tiny_model_dir("llama-gqa")
    prompts, params = _workload()
    reference = _reference(path, fmt)
    batched, stats = _run(path, prompts, params, NGRAM, alone=False,
                          max_num_batched_tokens=96, max_num_seqs=16, **fmt)
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    for i, (got, want) in enumerate(zip(batched, reference)):
        assert got == want, f"request {i}: {params[i]}"
    alone, stats = _run(path, prompts, params, NGRAM, alone=True, **fmt)
    assert stats.spec_accepted_tokens > 0
    assert alone == reference


def test_suffix_output_identical_with_drafts_from_other_requests(tiny_model_dir):
    """``suffix``: drafts from the request's own history and from requests that ended
    before it; the output is still the reference's, alone and batched."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, params = _workload()
    reference = _reference(path, {})
    config = {**NGRAM, "method": "suffix"}
    hits: list[int] = []

    def shared_hits(llm) -> None:
        hits.append(llm.engine.speculator.proposer.shared.hits)

    alone, stats = _run(path, prompts, params, config, alone=True, inspect=shared_hits)
    assert stats.spec_accepted_tokens > 0 and hits[-1] > 0  # other requests' tokens drafted
    assert alone == reference
    batched, _ = _run(path, prompts, params, config, alone=False, inspect=shared_hits,
                      max_num_batched_tokens=96, max_num_seqs=16)
    assert batched == reference


def test_stop_strings_cut_an_accepted_run(tiny_model_dir):
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256)
    prompt = [rng_tok for rng_tok in range(300, 340)] * 3
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    assert stop.strip(), free.text
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    want = llm.generate([prompt], params)[0].outputs[0]
    spec = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=NGRAM)
    speculate_always(spec.engine.speculator)
    got = spec.generate([prompt], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert spec.engine.stats().spec_draft_tokens > 0


OWN_KV = {"draft_kv_from_target": False}


@pytest.mark.parametrize("draft", [pytest.param({}, id="same-model"),
                                   pytest.param({"draft_num_layers": 1}, id="first-layer"),
                                   pytest.param(OWN_KV, id="same-model-own-kv"),
                                   pytest.param({"draft_num_layers": 1, **OWN_KV},
                                                id="first-layer-own-kv"),
                                   pytest.param({"quantization": "int4"}, id="int4-copy")])
def test_draft_model_output_identical(tiny_model_dir, draft):
    """A draft model proposes; the output is the target's, token for token. The target as
    its own draft proposes exactly what greedy requests then emit."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, params = (x[:20] for x in _workload())
    reference = _reference(path, {})[:20]
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 3, **draft}
    copies = []
    batched, stats = _run(path, prompts, params, config, alone=False,
                          inspect=lambda llm: copies.append(
                              llm.engine.speculator.proposer.target_kv is not None),
                          max_num_batched_tokens=96, max_num_seqs=16)
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    assert copies == ["draft_kv_from_target" not in draft]
    for i, (got, want) in enumerate(zip(batched, reference)):
        assert got == want, f"request {i}: {params[i]}"


def _drafted_equals_plain(path, config: dict, max_tokens: int, draft_blocks: int = 0,
                          **kw):
    """8 greedy requests with the draft ``config`` (speculating every step) and without:
    the same tokens. ``draft_blocks``: the draft's cache cut to that many blocks. Returns the
    speculating LLM and its stats."""
    prompts, _ = _workload(8)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=config,
              **kw)
    speculate_always(llm.engine.speculator)
    if draft_blocks:
        proposer = llm.engine.speculator.proposer
        proposer._free, proposer.num_blocks = proposer._free[-draft_blocks:], draft_blocks
    want = LLM(str(path), max_model_len=512, num_kv_blocks=256, **kw).generate(prompts,
                                                                              params)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    return llm, llm.engine.stats()


@pytest.mark.parametrize("name,extra,kv", [("llama-gqa", {}, "auto"),
                                           ("llama-gqa", {}, "fp8_e4m3"),
                                           ("llama-gqa", OWN_KV, "auto"),
                                           ("gemma3", {}, "auto")])
def test_the_target_as_its_own_draft_is_always_accepted(tiny_model_dir, name, extra, kv):
    """With the history's KV copied from the target's cache (also fp8 blocks), and with the
    draft's own. Gemma 3 too (its own: the target's sliding-window groups release blocks
    while drafts are verified and rolled back; window 32, sequences of up to 90 tokens)."""
    path, _ = tiny_model_dir(name)
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 4, **extra}
    llm, stats = _drafted_equals_plain(path, config, max_tokens=30, kv_cache_dtype=kv)
    assert (llm.engine.speculator.proposer.target_kv is not None) == (
        name == "llama-gqa" and not extra)
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert not llm.engine.speculator.proposer._seqs  # every request's draft blocks freed
    assert len(llm.engine.speculator.proposer._free) == llm.engine.speculator.proposer.num_blocks


def _one_step_in_three_plain(path, extra: dict):
    """The target as its own draft, speculating in two steps of three (between speculating
    steps the target emits tokens the draft has not seen: the bonus token, plain steps),
    against plain decoding: the same tokens, every draft accepted (any misplaced KV would
    show as a rejected draft). Returns the requests, the stats, the draft's history writes
    and its proposal passes."""
    prompts, _ = _workload(8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 3, **extra}
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=config)
    speculator = llm.engine.speculator
    speculate_always(speculator)
    proposer = speculator.proposer
    prepare, steps = speculator.prepare, itertools.count()

    def one_step_in_three_plain(running, waiting):
        if next(steps) % 3 == 1:
            for r in running:
                r.draft_token_ids = []
            return 0
        return prepare(running, waiting)

    speculator.prepare = one_step_in_three_plain
    writes, passes = [], []
    write_kv, forward = proposer.runner.write_kv, proposer.runner.forward_logits
    proposer.runner.write_kv = lambda sched: writes.append(sched) or write_kv(sched)
    proposer.runner.forward_logits = lambda sched: passes.append(sched) or forward(sched)
    want = LLM(str(path), max_model_len=512, num_kv_blocks=256).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert not proposer._seqs and len(proposer._free) == proposer.num_blocks
    return got, stats, writes, passes


def test_the_draft_catches_up_inside_its_first_proposal_pass(tiny_model_dir):
    """With its own KV, the draft's first pass takes the tokens it has not seen with the
    last token, and only a prompt is written ahead of the proposal passes."""
    path, _ = tiny_model_dir("llama-gqa")
    got, stats, writes, passes = _one_step_in_three_plain(path, OWN_KV)
    # Prompts only: each written once, before the request's first proposal.
    written = [s for sched in writes for s in sched.scheduled]
    assert sorted({s.request_id for s in written}) == sorted(r.request_id for r in got)
    assert all(s.start_pos == 0 for s in written)
    assert len(writes) < stats.spec_num_drafts / 8
    assert max(s.num_tokens - s.num_draft_tokens for p in passes for s in p.scheduled) > 1


def test_the_draft_reads_its_history_from_the_target_cache(tiny_model_dir):
    """A draft of the target's own model computes no history: its prompt and every token
    it has not seen come from the target's cache, and each pass carries one token of a
    request (and the lookup's guesses after it). Every draft accepted shows the copied KV
    in the right slots."""
    path, _ = tiny_model_dir("llama-gqa")
    _, _, writes, passes = _one_step_in_three_plain(path, {})
    assert not writes
    assert all(s.num_tokens == 1 + s.num_draft_tokens for p in passes for s in p.scheduled)


def test_a_copying_draft_makes_room_by_dropping_idle_copies(tiny_model_dir):
    """A draft cache of 192 tokens for 8 requests of up to 90 tokens (two at a time): the
    copies of requests not proposed for are dropped to make room, and copied again when
    needed; the target as its own draft still has every draft accepted."""
    blocks = 192 // default_block_size("cpu")
    path, _ = tiny_model_dir("llama-gqa")
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 4}
    evictions = []
    evict = DraftProposer._evict

    def counted(self, keep):
        freed = evict(self, keep)
        evictions.append(freed)
        return freed

    DraftProposer._evict = counted
    try:
        llm, stats = _drafted_equals_plain(path, config, max_tokens=30, draft_blocks=blocks)
    finally:
        DraftProposer._evict = evict
    assert any(evictions)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    proposer = llm.engine.speculator.proposer
    assert not proposer._seqs and len(proposer._free) == proposer.num_blocks == blocks


def test_a_draft_reading_the_target_cache_takes_its_format_in_its_own_memory(tiny_model_dir):
    """The int4 copy drafting for float32: its cache holds float32 blocks (copied as they
    are), as many as fit in the bytes its own int8 cache would have taken."""
    path, _ = tiny_model_dir("llama-gqa")
    config = {"method": "draft", "model": str(path), "quantization": "int4",
              "num_speculative_tokens": 2}
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=128, speculative_config=config)
    proposer = llm.engine.speculator.proposer
    head_dim = llm.engine.loaded.arch_config.head_dim
    assert proposer.target_kv is not None
    assert proposer.runner.kv_caches[0].key.dtype == torch.float32
    assert proposer.num_blocks == 128 * kv_bytes_per_vector("int8", head_dim) \
        // kv_bytes_per_vector("float32", head_dim)
    # Never fewer than one request of the longest context (and its drafts) needs.
    block = default_block_size("cpu")
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=1024 // block,
              speculative_config=config)
    assert llm.engine.speculator.proposer.num_blocks == -(-(512 + 2) // block)


def test_draft_kv_from_target_says_why_it_cannot(tiny_model_dir):
    """Asked for where it cannot be had, an error that says why; left unset, the draft
    computes its own KV there."""
    gemma, _ = tiny_model_dir("gemma3")
    other, _ = tiny_model_dir("llama-gqa")
    for path, draft, words in [(gemma, gemma, "sliding-window"),
                               (other, tiny_model_dir("llama-tied")[0], "not the target's own")]:
        config = {"method": "draft", "model": str(draft), "num_speculative_tokens": 2}
        with pytest.raises(ModelLoadError, match=words):
            LLM(str(path), max_model_len=128, num_kv_blocks=128,
                speculative_config=config | {"draft_kv_from_target": True})
        llm = LLM(str(path), max_model_len=128, num_kv_blocks=128, speculative_config=config)
        assert llm.engine.speculator.proposer.target_kv is None


def test_prompt_only_requests_beside_speculating_ones(tiny_model_dir):
    """max_tokens 0 requests (scoring prompts) end after their prefill while others
    speculate: the same outputs and prompt logprobs as without, every draft block freed."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, _ = _workload(8)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=1) if i % 2 else
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=config)
    speculate_always(llm.engine.speculator)
    want = LLM(str(path), max_model_len=512, num_kv_blocks=256).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [(o.outputs[0].token_ids, o.prompt_logprobs) for o in got] == [
        (o.outputs[0].token_ids, o.prompt_logprobs) for o in want]
    assert all(o.outputs[0].token_ids == [] for o in got[1::2])
    assert llm.engine.stats().spec_draft_tokens > 0
    proposer = llm.engine.speculator.proposer
    assert not proposer._seqs and len(proposer._free) == proposer.num_blocks
    llm.engine.kv_manager.check_integrity()


def test_rejected_drafts_roll_back_inside_sliding_windows(tiny_model_dir):
    """Gemma 3 with its first layer as the draft: most drafts are rejected, and the rolled
    back positions stay inside the blocks the sliding-window groups still hold."""
    path, _ = tiny_model_dir("gemma3")
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 4,
              "draft_num_layers": 1}
    llm, stats = _drafted_equals_plain(path, config, max_tokens=40)
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens
    llm.engine.kv_manager.check_integrity()
    assert stats.kv_blocks_used == 0


def _recorded_draft_run(path, config: dict, prompts, params):
    """Output of a speculating-always run with ``config``, every proposal made, how many
    request shares the draft's passes held, and its prompt-lookup guesses: checked, kept."""
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=config)
    speculate_always(llm.engine.speculator)
    proposer = llm.engine.speculator.proposer
    proposals, passes = [], []
    propose, forward = proposer.propose, proposer.runner.forward_logits

    def recorded_propose(requests, counts):
        proposals.append(propose(requests, counts))
        return proposals[-1]

    def recorded_forward(sched):
        passes.append(sched)
        return forward(sched)

    proposer.propose, proposer.runner.forward_logits = recorded_propose, recorded_forward
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert not proposer._seqs and len(proposer._free) == proposer.num_blocks
    shares = sum(len(sched.scheduled) for sched in passes)
    return out, proposals, shares, proposer.guessed, proposer.guesses_kept


def test_prompt_lookup_guesses_save_draft_passes(tiny_model_dir):
    """The draft checks what a prompt lookup expects next in the rows of its passes and
    skips a pass for each guess it confirms: the same proposals and output as without, with
    one request's share of a pass fewer for each confirmed guess."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, _ = _workload(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 4,
              "draft_num_layers": 1, "prompt_lookup_min": 1}
    out_off, proposals_off, shares_off, guessed_off, _ = _recorded_draft_run(
        path, config | {"draft_prompt_lookup": False}, prompts, params)
    out_on, proposals_on, shares_on, guessed, kept = _recorded_draft_run(
        path, config, prompts, params)
    assert out_on == out_off
    assert proposals_on == proposals_off
    assert guessed_off == 0 and guessed > kept > 0  # confirmed guesses and refuted ones
    assert shares_on == shares_off - kept


def test_prompt_lookup_guesses_stay_within_the_token_budget(tiny_model_dir):
    """Guesses ride in a pass only while the engine's token budget has room: with a budget
    of barely one token per request, every pass stays within it and the output is still
    the target's."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts, _ = _workload(8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 4,
              "draft_num_layers": 1, "prompt_lookup_min": 1}
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=256, speculative_config=config)
    speculate_always(llm.engine.speculator)
    proposer = llm.engine.speculator.proposer
    proposer.budget = len(prompts) + 2
    sizes, forward = [], proposer.runner.forward_logits

    def recorded_forward(sched):
        sizes.append(sched.num_batched_tokens)
        return forward(sched)

    proposer.runner.forward_logits = recorded_forward
    want = LLM(str(path), max_model_len=512, num_kv_blocks=256).generate(prompts, params)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert proposer.guessed > 0 and max(sizes) <= proposer.budget


def test_the_warm_up_request_is_not_taken_for_a_users(tiny_model_dir):
    """The engine's warm-up request (2 tokens) leaves no output length behind: taken for
    what requests generate, it made a draft model's first request look about to end, and
    it ran without drafts from its second token to its last."""
    path, _ = tiny_model_dir("llama-gqa")
    config = {"method": "draft", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=64, speculative_config=config)
    speculator = llm.engine.speculator
    llm.engine.warm_up()
    assert not speculator.lengths
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert list(speculator.lengths) == [9]


def test_a_request_whose_grammar_failed_is_not_taken_for_an_output_length(tiny_model_dir):
    """A request that failed (its grammar gave up while generating) ended short of what it
    would have generated: like an abort, it leaves no output length behind."""
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=64, speculative_config=NGRAM)
    speculator = llm.engine.speculator
    bad = SamplingParams(temperature=0, max_tokens=9,
                         structured_outputs=StructuredOutputsParams(regex="a{1000000}"))
    with pytest.raises(ValueError, match="could not be enforced"):
        llm.generate([[5, 6, 7]], bad)
    assert not speculator.lengths
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert list(speculator.lengths) == [9]


def test_a_completed_grammar_keeps_its_end_of_sequence_mask_for_every_draft(tiny_model_dir):
    """Once a grammar is complete only the end of the sequence is allowed; with ignore_eos
    the request goes on emitting it. n-gram drafts of that run are verified against masks
    that allow only it too: the rows after the first had been left unconstrained, and the
    output went on with free text ('625-9414 dismantling()))...')."""
    path, _ = tiny_model_dir("llama-gqa")
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    want = LLM(str(path), max_model_len=256, num_kv_blocks=64).generate([[5000]], sp)
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64,
              speculative_config={**NGRAM, "prompt_lookup_max": 2})
    speculate_always(llm.engine.speculator)
    got = llm.generate([[5000]], sp)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_a_draft_model_starts_beside_a_small_kv_pool(tiny_model_dir):
    """The draft times a 64-token history write at start in its last free blocks: with a
    pool of five it took one block for 64 tokens (a slice from the wrong end) and start-up
    failed with an IndexError."""
    path, _ = tiny_model_dir("llama-gqa")
    llm = LLM(str(path), block_size=16, num_kv_blocks=5, max_model_len=76,
              max_num_batched_tokens=64,
              speculative_config={"method": "draft", "model": str(path),
                                  "num_speculative_tokens": 1,
                                  "draft_kv_from_target": False})  # writes its histories
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(path), block_size=16, num_kv_blocks=5, max_model_len=76).generate([[7, 8]], sp)
    assert llm.generate([[7, 8]], sp)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
