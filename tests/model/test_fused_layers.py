"""The decoder stack as one compiled call (models/fused.py, csrc/decoder_layer.cpp) gives
bitwise the logits of the module-by-module path, its reference, in every weight and KV
cache format, through chunked prefills, mixed batches and decodes."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from llmserve.csrc import cpu_ops
from llmserve.models.loader import load_model
from llmserve.runner import ModelRunner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import ScheduledRequest, SchedulerOutput
from tests.helpers.tiny_models import WEIGHT_AND_KV_FORMATS

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="compiled CPU kernels unavailable")

GREEDY = SamplingParams(temperature=0)
BS = 16

FORMATS = WEIGHT_AND_KV_FORMATS  # (quantization, dtype, KV cache dtype)


def _steps(seed: int) -> list[SchedulerOutput]:
    """Prefills (one in two chunks) beside decodes, then decode-only steps."""
    rng = random.Random(seed)

    def item(rid, tokens, start, blocks, sample=True):
        return ScheduledRequest(rid, tokens, start, [blocks], sample, GREEDY)

    prompts = {f"r{i}": [rng.randrange(17, 49152) for _ in range(rng.randint(3, 60))]
               for i in range(5)}
    blocks = {rid: list(range(8 * i, 8 * i + 8)) for i, rid in enumerate(prompts)}
    a, b, c, d, e = prompts
    steps = [
        SchedulerOutput([item(a, prompts[a], 0, blocks[a]), item(b, prompts[b][:2], 0,
                                                                  blocks[b], False)]),
        SchedulerOutput([item(b, prompts[b][2:], 2, blocks[b]), item(a, [7], len(prompts[a]),
                                                                     blocks[a])]),
        SchedulerOutput([item(r, prompts[r], 0, blocks[r]) for r in (c, d, e)]),
    ]
    for t in range(3):  # decodes of all five
        steps.append(SchedulerOutput([item(r, [9 + t], len(p) + (r == a) + t, blocks[r])
                                      for r, p in prompts.items()]))
    return steps


def _logits(model, kv: str, fused: bool, team: bool = True) -> list[torch.Tensor]:
    model.model.model.fused.enabled = fused
    model.model.model.fused.team = team
    runner = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS,
                         kv_cache_dtype=kv)
    out = [runner.forward_logits(step) for step in _steps(0)]
    assert model.model.model.fused.last_step_fused is fused
    return out


# Every format on Llama; Qwen2 (q/k/v biases), Qwen3 (QK-norm) and Mistral in two.
CASES = [("llama-gqa", *f) for f in FORMATS] + [
    (name, *f) for name in ("qwen2", "qwen3", "mistral") for f in (FORMATS[0], FORMATS[4])]


@pytest.mark.parametrize(("name", "quantization", "dtype", "kv"), CASES, ids=lambda v: v)
def test_fused_stack_equals_modules_bitwise(tiny_model_dir, name, quantization, dtype, kv):
    path, _ = tiny_model_dir(name)
    model = load_model(str(path), quantization=quantization, dtype=dtype)
    fused = _logits(model, kv, True)
    modules = _logits(model, kv, False)
    for i, (f, m) in enumerate(zip(fused, modules, strict=True)):
        assert torch.equal(f, m), f"step {i}: fused logits differ by {(f - m).abs().max()}"


@pytest.mark.parametrize(("quantization", "dtype", "kv"), [FORMATS[0], FORMATS[4]], ids=str)
def test_one_region_a_step_gives_the_bits_of_one_a_kernel(tiny_model_dir, quantization, dtype,
                                                           kv):
    """The stack's kernels split over its team (csrc/team.h) as over at::parallel_for's
    regions: the same logits, on two threads."""
    path, _ = tiny_model_dir("qwen2")  # its biases are added through the team too
    model = load_model(str(path), quantization=quantization, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        team = _logits(model, kv, True, team=True)
        regions = _logits(model, kv, True, team=False)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(team, regions, strict=True)):
        assert torch.equal(a, b), f"step {i}: logits differ by {(a - b).abs().max()}"


def test_other_backends_and_models_keep_the_module_path(tiny_model_dir):
    """torch_paged attention and Gemma 3's layers run module by module."""
    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path))
    runner = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS,
                         attention_backend="torch_paged")
    runner.forward_logits(_steps(1)[0])
    assert not model.model.model.fused.last_step_fused
    path, _ = tiny_model_dir("gemma3")
    gemma = load_model(str(path))
    assert not hasattr(gemma.model.model, "fused")


def test_one_model_serves_two_runners(tiny_model_dir):
    """A model drafting for itself runs two KV caches: each runner gets its own stack, and
    their outputs stay those of runners of their own."""
    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path), quantization="int4")
    steps = _steps(2)
    alone = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS)
    ref = [alone.forward_logits(s) for s in steps]
    one = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS)
    two = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS)
    for i, step in enumerate(steps):
        assert torch.equal(one.forward_logits(step), ref[i])
        assert torch.equal(two.forward_logits(step), ref[i])
    assert model.model.model.fused.last_step_fused


def test_a_stack_goes_with_its_runner(tiny_model_dir):
    """The stack holds its runner's KV cache tensors: it must not keep them once the runner
    is gone (an engine restarted on the same loaded model would hold two caches)."""
    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path))
    fused = model.model.model.fused
    runner = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS)
    runner.forward_logits(_steps(3)[0])
    assert fused.last_step_fused and len(fused._stacks) == 1
    del runner
    gc.collect()
    assert len(fused._stacks) == 0


def test_a_family_with_its_own_forward_keeps_the_module_path(tiny_model_dir):
    """A subclass that overrides a module's forward is not what the C++ layer computes."""
    from llmserve.models.llama import LlamaMLP

    class DoubledMLP(LlamaMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    path, _ = tiny_model_dir("llama-gqa")
    model = load_model(str(path))
    model.model.model.layers[1].mlp.__class__ = DoubledMLP
    runner = ModelRunner(model.model, model.arch_config, num_blocks=64, block_size=BS)
    runner.forward_logits(_steps(4)[0])
    assert not model.model.model.fused.last_step_fused
