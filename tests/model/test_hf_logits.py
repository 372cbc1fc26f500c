"""llmserve's forward pass against transformers' own, on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

from llmserve.models.loader import load_model
from llmserve.runner.scoring import sequence_logits
from tests.helpers.tiny_models import TINY_CONFIGS

ATOL = 1e-4


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(17, 49152, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_logits_match_transformers(tiny_model_dir, name, cpu_kernels):
    path, hf = tiny_model_dir(name)
    ours = load_model(str(path)).model
    ids = _prompt(100)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    got = sequence_logits(ours, ids)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff < ATOL, f"{name}: max abs logit difference {diff}"


def test_sharded_safetensors_load_identically(tiny_model_dir):
    path, hf = tiny_model_dir("llama-gqa", max_shard_size="2MB")
    assert len(list(path.glob("*.safetensors"))) > 1, "expected a sharded checkpoint"
    ours = load_model(str(path)).model
    ids = _prompt(30)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (sequence_logits(ours, ids) - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied", "qwen2", "qwen3", "gemma3"])
def test_greedy_continuation_matches_transformers(tiny_model_dir, name, cpu_kernels):
    from llmserve import LLM, SamplingParams

    path, hf = tiny_model_dir(name)
    prompt = _prompt(12, seed=5)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          min_new_tokens=64, pad_token_id=2)[0, len(prompt):].tolist()
    llm = LLM(str(path), num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref
