"""The layers' row-wise Triton kernels (norm, rotary, KV store) against PyTorch, and
programmatic dependent launch against launching one after another (the linear kernel:
test_triton_linear.py).

Without a GPU they run under Triton's interpreter on CPU tensors (see
test_triton_attention.py); on a GPU the same tests run on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:  # read when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llmserve.layers import triton_launch, triton_linear, triton_ops  # noqa: E402
from llmserve.layers.rotary import RotaryEmbedding  # noqa: E402
from llmserve.models.arch_config import RopeScaling  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_the_fused_residual_add(dtype):
    x, delta = randn(9, 200, dtype=dtype), randn(9, 200, dtype=dtype, seed=1)
    w = randn(200, seed=2)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    ref = F.rms_norm(x.float(), (200,), w, 1e-5)
    assert rel_err(triton_ops.rms_norm(x, w, 1e-5), ref) < tol
    residual = x.clone()
    out = triton_ops.rms_norm(delta, w, 1e-5, residual=residual)
    summed = (x.float() + delta.float()).to(dtype)
    if CUDA or dtype == torch.float32:
        assert torch.equal(residual, summed)
    else:  # the interpreter narrows float32 to bfloat16 by truncating, not rounding
        assert rel_err(residual, summed) < 1e-2
    assert rel_err(out, F.rms_norm(summed.float(), (200,), w, 1e-5)) < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_pytorch_path(dtype):
    rope = RotaryEmbedding(64, 512, 10000.0, RopeScaling()).to(DEVICE)
    qkv = randn(7, (6 + 2 * 2) * 64, dtype=dtype)  # q, k, v side by side, as in a layer
    q = qkv[:, :384].view(7, 6, 64)
    k = qkv[:, 384:512].view(7, 2, 64)
    positions = torch.tensor([0, 1, 5, 100, 300, 301, 511], device=DEVICE)
    cos = rope.cos.index_select(0, positions).unsqueeze(1)
    sin = rope.sin.index_select(0, positions).unsqueeze(1)
    from llmserve.layers.rotary import _rotate

    ref_q, ref_k = _rotate(q.clone(), cos, sin), _rotate(k.clone(), cos, sin)
    v_before = qkv[:, 512:].clone()
    triton_ops.rotary_(q, k, positions, rope.cos[:, 0], rope.sin[:, 1])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(q, ref_q) < tol and rel_err(k, ref_k) < tol
    assert torch.equal(qkv[:, 512:], v_before)  # v untouched



@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rotary_and_kv_store_in_one_launch_give_the_two_kernels_bits(cache_dtype, head_dim):
    """q rotated in place, and the rotated keys and the values written at their slots: the
    bits of rotary_ then store_kv, with k itself left as it was."""
    rope = RotaryEmbedding(head_dim, 512, 10000.0, RopeScaling()).to(DEVICE)
    cos, sin = rope.kernel_tables()
    qkv = randn(5, (6 + 2 * 2) * head_dim, dtype=torch.bfloat16, seed=9)
    positions = torch.tensor([0, 3, 77, 300, 511], device=DEVICE)
    slots = torch.tensor([0, 17, 18, 40, 63], device=DEVICE)

    def views(t):
        return (t[:, :6 * head_dim].view(5, 6, head_dim),
                t[:, 6 * head_dim:8 * head_dim].view(5, 2, head_dim),
                t[:, 8 * head_dim:].view(5, 2, head_dim))

    caches = [torch.zeros(4, 16, 2, head_dim, dtype=cache_dtype, device=DEVICE)
              for _ in range(4)]
    two = qkv.clone()
    q, k, v = views(two)
    triton_ops.rotary_(q, k, positions, cos, sin)
    triton_ops.store_kv(k, v, caches[0], caches[1], slots)
    one = qkv.clone()
    q1, k1, v1 = views(one)
    triton_ops.rotary_and_store_kv(q1, k1, v1, positions, cos, sin, caches[2], caches[3],
                                   slots)
    assert torch.equal(q1, q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(one[:, 6 * head_dim:], qkv[:, 6 * head_dim:])  # k and v untouched
    assert caches[2].view(-1, 2, head_dim)[slots].any()

def test_store_kv_writes_each_token_at_its_slot():
    kc = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kv = randn(5, 3, 2, 32, dtype=torch.bfloat16)  # k and v interleaved: strided views
    slots = torch.tensor([0, 17, 18, 40, 63], device=DEVICE)
    triton_ops.store_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 32)[slots], kv[:, 0])
    assert torch.equal(vc.view(-1, 2, 32)[slots], kv[:, 1])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not kc.view(-1, 2, 32)[untouched.to(DEVICE)].any()


PDL_GPU = CUDA and torch.cuda.get_device_capability()[0] >= 9


def _layer_kernels(x, w_qkv, w_o, norm_w, cos, sin, positions, kc, vc, slots):
    """The layer's kernels in a step's order: norm, split and whole-tile linears, rotary,
    KV store, SiLU, the residual add."""
    h = triton_ops.rms_norm(x, norm_w, 1e-5)
    qkv = triton_ops.linear(h, w_qkv)  # [T, 192]: q 4 heads, k and v 1 head of 32
    q, k, v = qkv[:, :128].view(-1, 4, 32), qkv[:, 128:160].view(-1, 1, 32), qkv[:, 160:]
    triton_ops.rotary_(q, k, positions, cos, sin)
    triton_ops.store_kv(k, v.view(-1, 1, 32), kc, vc, slots)
    act = triton_ops.silu_and_mul(q.reshape(-1, 128))
    delta = triton_ops.linear(act, w_o)
    residual = x.clone()
    return triton_ops.rms_norm(delta, norm_w, 1e-5, residual=residual), residual, qkv


@pytest.mark.skipif(not PDL_GPU, reason="programmatic dependent launch needs a GPU of "
                    "compute capability 9.0 or later (Hopper); run where one is lent")
def test_programmatic_dependent_launch_gives_the_same_bits(monkeypatch):
    """With PDL each kernel may start while the one before finishes, and waits for it
    before it touches memory: the same bits as launching one after another, eagerly and
    replayed from a CUDA graph (where the launches become programmatic edges)."""
    x = randn(5, 512, dtype=torch.bfloat16)
    w_qkv = randn(192, 512, dtype=torch.bfloat16, seed=1)  # split over its inputs
    w_o = randn(512, 64, dtype=torch.bfloat16, seed=2)
    assert triton_linear.linear_config(192, 512)[3] > 1
    norm_w = randn(512, seed=3)
    rope = RotaryEmbedding(32, 64, 10000.0, RopeScaling()).to(DEVICE)
    positions = torch.tensor([0, 3, 7, 20, 63], device=DEVICE)
    slots = torch.tensor([0, 9, 17, 40, 63], device=DEVICE)

    def run():
        kc = torch.zeros(4, 16, 1, 32, dtype=torch.bfloat16, device=DEVICE)
        vc = torch.zeros_like(kc)
        out = _layer_kernels(x, w_qkv, w_o, norm_w, rope.cos[:, 0], rope.sin[:, 1],
                             positions, kc, vc, slots)
        return (*out, kc, vc)

    monkeypatch.setattr(triton_launch, "PDL", False)
    reference = run()
    monkeypatch.setattr(triton_launch, "PDL", True)
    assert triton_launch.pdl_for(x)
    for got, want in zip(run(), reference):
        assert torch.equal(got, want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture (kernels compiled, counters allocated)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, reference):
            assert torch.equal(got, want)

