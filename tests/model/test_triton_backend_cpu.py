"""The GPU attention backend's plumbing in the engine, on any machine: the tiny models run
on CPU with ``triton_paged`` under Triton's interpreter (their layers stay on the CPU
kernels). Logits match the PyTorch backend; greedy output is the same batched and alone,
through chunked prefill, preemption and the prefix cache, and with speculative drafts.

On a GPU machine these are skipped: ``tests/model/test_cuda.py`` runs the real thing.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # read when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.attention import backend as attention_backend  # noqa: E402
from llmserve.config import default_block_size  # noqa: E402
from llmserve.models.loader import load_model  # noqa: E402
from llmserve.runner.scoring import sequence_logits  # noqa: E402
from tests.model.test_batch_equivalence import _workload  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA, reason="on a GPU, tests/model/test_cuda.py runs it")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "gemma3"])
def test_logits_match_the_pytorch_backend(tiny_model_dir, name):
    path, _ = tiny_model_dir(name)
    model = load_model(str(path), "cpu", quantization="none").model
    ids = list(range(100, 170))
    ref = sequence_logits(model, ids, backend="torch_paged")
    got = sequence_logits(model, ids, backend="triton_paged")
    assert float((got - ref).norm() / ref.norm()) < 1e-5


@pytest.fixture
def triton_engine(monkeypatch):
    monkeypatch.setattr(attention_backend, "_auto_backend", lambda device, block: "triton_paged")


def _generate(path, prompts, params, **kw):
    llm = LLM(str(path), max_model_len=256, quantization="none", **kw)
    assert llm.engine.runner.backend.name == "triton_paged"
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.kv_manager.check_integrity()
    return outs, llm.engine.stats()


def test_batched_equals_alone(tiny_model_dir, triton_engine):
    path, _ = tiny_model_dir("llama-gqa")
    prompts, params = _workload(5, 8, 120, 12)
    alone = [_generate(path, [p], sp, num_kv_blocks=64, enable_prefix_caching=False)[0][0]
             for p, sp in zip(prompts, params)]
    batched, stats = _generate(path, prompts, params,
                               num_kv_blocks=384 // default_block_size("cpu"),  # 384 tokens
                               max_num_batched_tokens=64)
    assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    assert batched == alone
    shared = [prompts[2] + p[:5] for p in prompts[:4]]  # a prefix from the cache
    alone = [_generate(path, [p], params[0], num_kv_blocks=64, enable_prefix_caching=False
                       )[0][0] for p in shared]
    batched, stats = _generate(path, shared, params[0], num_kv_blocks=128)
    assert batched == alone and stats.prefix_hits > 0


def test_speculative_verification_rows(tiny_model_dir, triton_engine):
    """n-gram drafts verified k + 1 rows a request in the same pass as everyone else."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [[7, 8, 9, 10] * 6, [11, 12, 13] * 8, list(range(200, 230))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain, _ = _generate(path, prompts, params, num_kv_blocks=64)
    spec, _ = _generate(path, prompts, params, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert spec == plain
