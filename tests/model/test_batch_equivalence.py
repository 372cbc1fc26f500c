"""Greedy output is token-identical however requests are batched.

Each request run alone (whole prompt in one step, no prefix cache) is the reference; the
batched runs mix chunked prefills and decodes under a small token budget, force preemption
with a small KV pool, and share a long system prompt through the prefix cache. Batch
invariance (MKL's strict reproducibility mode for float32 matrix products, exact integer
sums for int8, a row-at-a-time kernel for int4, per-token KV scales, row-independent
attention) makes the identity exact, for every weight and KV cache format.
"""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import default_block_size
from llmserve.models.loader import DEFAULT_MODEL


def _workload(seed: int, n: int, max_prompt: int, max_out: int):
    rng = random.Random(seed)
    lengths = [1, 2, max_prompt] + [rng.randint(1, max_prompt) for _ in range(n - 3)]
    prompts = [[rng.randrange(17, 49152) for _ in range(k)] for k in lengths]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, max_out), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def _alone(model: str, prompts, params, fmt, blocks: int = 128) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=blocks, max_num_batched_tokens=4096,
              enable_prefix_caching=False, max_model_len=1024, **fmt)
    return [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def _batched(model: str, prompts, params, **kw):
    llm = LLM(model, max_model_len=1024, **kw)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    llm.engine.kv_manager.check_integrity()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    return [o.outputs[0].token_ids for o in outs], stats


def _check_equivalence(model: str, max_out: int, block_layers: int = 1, **fmt):
    """``block_layers``: how many times more blocks the model's KV cache groups need than
    one group holding every layer (a block then holds fewer layers)."""
    prompts, params = _workload(0, 32, 600, max_out)
    reference = _alone(model, prompts, params, fmt, 128 * block_layers)

    got, stats = _batched(model, prompts, params, num_kv_blocks=2048 * block_layers,
                          max_num_batched_tokens=96, max_num_seqs=32, **fmt)
    assert got == reference
    assert stats.num_preemptions == 0

    small_pool = 2048 // default_block_size("cpu")  # 2,048 tokens
    got, stats = _batched(model, prompts, params, num_kv_blocks=small_pool,
                          max_num_batched_tokens=128, max_num_seqs=32, **fmt)
    assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == reference

    rng = random.Random(1)
    system = [rng.randrange(17, 49152) for _ in range(200)]
    shared = [system + p[: rng.randint(1, 60)] for p in prompts[:16]]
    shared_params = params[:16]
    reference = _alone(model, shared, shared_params, fmt, 128 * block_layers)
    for caching in (True, False):
        got, stats = _batched(model, shared, shared_params, num_kv_blocks=1024 * block_layers,
                              max_num_batched_tokens=256, enable_prefix_caching=caching, **fmt)
        assert got == reference, f"prefix caching {'on' if caching else 'off'}"
        assert (stats.prefix_hits > 0) == caching


FORMATS = [
    pytest.param({}, id="float32"),
    pytest.param({"quantization": "int4"}, id="int4"),
    pytest.param({"quantization": "int8"}, id="int8", marks=pytest.mark.slow),
    pytest.param({"quantization": "w8a8"}, id="w8a8", marks=pytest.mark.slow),
    pytest.param({"dtype": "bfloat16"}, id="bfloat16", marks=pytest.mark.slow),
    pytest.param({"kv_cache_dtype": "fp8_e4m3"}, id="kv-fp8", marks=pytest.mark.slow),
    pytest.param({"quantization": "int8", "kv_cache_dtype": "int8"}, id="int8-kv-int8",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_equals_alone_tiny_model(tiny_model_dir, fmt):
    path, _ = tiny_model_dir("llama-gqa")
    _check_equivalence(str(path), max_out=48, **fmt)


@pytest.mark.parametrize("fmt", FORMATS[:2])
def test_batched_equals_alone_sliding_windows(tiny_model_dir, fmt):
    """Gemma 3's sliding-window layers (window 32) release blocks as sequences grow, under
    preemption, and resume the 200-token shared prompt from the prefix cache."""
    path, _ = tiny_model_dir("gemma3")
    _check_equivalence(str(path), max_out=48, block_layers=6, **fmt)


@pytest.mark.slow
def test_batched_equals_alone_smollm2():
    """The embedded model in its default format (int4 layers from its Q4_1 file)."""
    _check_equivalence(DEFAULT_MODEL, max_out=24)
