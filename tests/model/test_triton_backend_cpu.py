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


@pytest.fixture
def gpu_layers(monkeypatch):
    """The layers' GPU kernels (``triton_ops``) for CPU tensors, under the interpreter: the
    CPU kernels off (weights not packed for them), ``gpu_ops_for`` answering for CPU."""
    from llmserve.layers import activation, norm, triton_ops
    from llmserve.layers.quantization import dense
    from llmserve.models import llama

    for module in (activation, norm, dense):
        monkeypatch.setattr(module, "cpu_ops", lambda: None)
    for module in (activation, norm, dense, llama):
        monkeypatch.setattr(module, "gpu_ops_for", lambda x: triton_ops)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_the_stream_through_the_linears_gives_the_norm_kernels_bits(tiny_model_dir, name,
                                                                     gpu_layers, monkeypatch):
    """The GPU's decoder layers (``forward_stream``: each norm read by the projection after
    it, each block output added by the projection that makes it), run by the interpreter:
    the logits of the norms' own kernels (``forward``), bit for bit, whether the linears
    normalise the rows themselves or the norm's kernel runs first; Qwen2's projections have
    biases. tests/model/test_cuda.py checks the same on a GPU."""
    from llmserve.layers import triton_linear, triton_ops
    from llmserve.models import llama

    path, _ = tiny_model_dir(name)
    model = load_model(str(path), "cpu", quantization="none").model
    assert hasattr(model.model.layers[0].mlp.down_proj, "weight")  # not packed for the CPU
    norms = []  # the norm kernel's launches: by the layers, and by the linears
    for module in (triton_ops, triton_linear):
        monkeypatch.setattr(module, "rms_norm", lambda *a, _f=module.rms_norm, **k:
                            norms.append(1) or _f(*a, **k))
    ids = list(range(100, 108))  # 8 rows: the linears normalise them themselves
    layers = len(model.model.layers)
    logits = {}
    for stream, norm_rows, launches in ((False, 0, 2 * layers + 1), (True, 0, 2 * layers + 1),
                                        (True, 1 << 30, 1)):
        monkeypatch.setattr(llama, "STREAM_THROUGH_LINEARS", stream)
        monkeypatch.setattr(triton_linear, "NORM_MAX_ROWS", norm_rows)
        norms.clear()
        logits[stream, norm_rows] = sequence_logits(model, ids, backend="triton_paged")
        assert len(norms) == launches, (stream, norm_rows)
    first = logits[False, 0]
    for key, got in logits.items():
        assert torch.equal(got, first), key
    monkeypatch.undo()  # the reference: PyTorch's attention, the CPU kernels' layers
    ref = sequence_logits(load_model(str(path), "cpu", quantization="none").model, ids,
                          backend="torch_paged")
    assert float((first - ref).norm() / ref.norm()) < 1e-5
