"""Gemma 3's sliding-window layers in the paged cache: they keep only the blocks their window
can still reach, the output stays transformers' own, and a cached prefix longer than the
window is resumed exactly."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.kv_cache import blocks_per_sequence

BS = 16  # two blocks to the tiny model's window of 32 (not the CPU's default of 32)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(17, 49152) for _ in range(n)]


def test_sliding_layers_hold_their_window_and_the_output_is_transformers(tiny_model_dir,
                                                                        cpu_kernels):
    """100-token prompt in chunks of 48, then 80 tokens one at a time; window 32."""
    path, hf = tiny_model_dir("gemma3")
    prompt = _prompt(100, seed=3)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False,
                          min_new_tokens=80, pad_token_id=2)[0, len(prompt):].tolist()
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=48, block_size=BS)
    engine = llm.engine
    groups = engine.kv_spec.groups
    assert len(groups) == 6 and sum(g.window is None for g in groups) == 1
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=80,
                                                    ignore_eos=True))
    tokens, most = [], 0
    while engine.has_unfinished():
        held = engine.kv_manager.num_held_blocks("a")  # before the step's release
        for out in engine.step():
            tokens += out.new_token_ids
        request = engine.scheduler.requests.get("a")
        if request is not None:
            held = engine.kv_manager.num_held_blocks("a")
            bound = blocks_per_sequence(groups, request.num_computed_tokens, BS, step_tokens=48)
            assert held <= bound
            most = max(most, held)
        engine.kv_manager.check_integrity()
    assert tokens == ref
    # At 179 tokens every layer global would hold 6 x 12 blocks; the windows keep 3 each.
    assert engine.kv_manager.num_free_blocks == 128
    assert most < 6 * 12 and blocks_per_sequence(groups, 179, BS, step_tokens=1) == 12 + 5 * 3


def test_a_cached_prefix_longer_than_the_window_gives_the_same_tokens(tiny_model_dir,
                                                                      cpu_kernels):
    """A 120-token system prompt (the window is 32) shared by requests that arrive after it
    is cached, in chunks and in batches: every output equals the request run alone."""
    path, _ = tiny_model_dir("gemma3")
    system = _prompt(120, seed=7)
    prompts = [system + _prompt(n, seed=20 + n) for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = LLM(str(path), num_kv_blocks=128, enable_prefix_caching=False, block_size=BS)
    reference = [alone.generate([p], params)[0].outputs[0].token_ids for p in prompts]

    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=64, block_size=BS)
    first = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], params)]
    assert [first, *rest] == reference
    stats = llm.engine.stats()
    assert stats.prefix_hits >= 3 * 112  # the system prompt's 7 full blocks, 3 times
    llm.engine.kv_manager.check_integrity()
    assert stats.kv_blocks_used == 0


def test_a_cache_too_small_for_one_block_per_group_is_refused(tiny_model_dir):
    path, _ = tiny_model_dir("gemma3")
    with pytest.raises(ValueError, match="6 KV cache groups need a block each"):
        LLM(str(path), num_kv_blocks=5)
