"""The layers' Triton kernels against PyTorch, and the linear kernel's batch invariance.

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

from llmserve.layers import triton_ops  # noqa: E402
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
@pytest.mark.parametrize("n,k", [(96, 200), (48, 64), (700, 33), (100, 1100)])
def test_linear_matches_a_float64_product(dtype, n, k):
    x, w = randn(37, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    out = triton_ops.linear(x, w)
    assert out.dtype == dtype and out.shape == (37, n)
    tol = 2e-3 if dtype == torch.float32 else 1e-2  # float32 on GPUs: tf32 products
    assert rel_err(out, x.double() @ w.double().T) < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gives_each_row_the_same_bits_in_any_batch(dtype):
    """The tiles come from the weight's shape, never the number of rows."""
    w = randn(160, 600, dtype=dtype, seed=2)  # split over K: 5 tiles of 128 inputs
    assert triton_ops.linear_config(160, 600)[3] > 1
    x = randn(130, 600, dtype=dtype, seed=3)  # more than one tile of rows
    together = triton_ops.linear(x, w)
    for rows in ([0], [5, 6], list(range(64, 67)), [129]):
        assert torch.equal(triton_ops.linear(x[rows], w), together[rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(64, 1024), (192, 2048), (100, 1100)])
def test_split_linear_sums_its_parts_in_one_launch_with_the_same_bits(dtype, n, k, monkeypatch):
    """The last program of each output tile adds the parts, in the order of the second
    kernel (LLMSERVE_SPLITK_REDUCE=kernel): the same bits, and its counters back at 0."""
    assert triton_ops.linear_config(n, k)[3] > 1
    w = randn(n, k, dtype=dtype, seed=4)
    for m in (1, 3, 17, 70):  # 70 rows: two tiles of rows, and tiles of counters
        x = randn(m, k, dtype=dtype, seed=5 + m)
        monkeypatch.setattr(triton_ops, "SPLITK_REDUCE", "fused")
        fused = triton_ops.linear(x, w)
        monkeypatch.setattr(triton_ops, "SPLITK_REDUCE", "kernel")
        two_kernels = triton_ops.linear(x, w)
        assert torch.equal(fused, two_kernels), m
        tol = 2e-3 if dtype == torch.float32 else 1e-2
        assert rel_err(fused, x.double() @ w.double().T) < tol
        for counters in triton_ops._COUNTERS[x.device]:
            assert not counters.any()


@pytest.fixture
def few_multiprocessors(monkeypatch):
    """linear_config as for a GPU of 8 multiprocessors: small weights split into parts of
    several tiles of inputs (an H100's parts, at shapes the interpreter runs quickly)."""
    monkeypatch.setattr(triton_ops, "_SMS", 8)
    triton_ops.linear_config.cache_clear()
    yield
    monkeypatch.undo()
    triton_ops.linear_config.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(256, 1024), (200, 1000)])  # parts of 2 tiles of inputs
def test_split_linear_sums_its_parts_in_one_program_with_the_same_bits(
        dtype, n, k, monkeypatch, few_multiprocessors):
    """With rows enough to fill the GPU, one program per tile sums the parts one after
    another: the bits of one program per part and their fold, without the partials."""
    _, _, bk, splits = triton_ops.linear_config(n, k)
    assert 1 < splits < -(-k // bk)  # parts of several tiles: their sums are not the tiles'
    w = randn(n, k, dtype=dtype, seed=11)
    for m in (1, 3, 70):
        x = randn(m, k, dtype=dtype, seed=12 + m)
        monkeypatch.setattr(triton_ops, "IN_ORDER_TILES", 1 << 30)  # one program per part
        parts = triton_ops.linear(x, w)
        monkeypatch.setattr(triton_ops, "IN_ORDER_TILES", 1)  # one program per tile
        in_order = triton_ops.linear(x, w)
        assert torch.equal(in_order, parts), m
        tol = 2e-3 if dtype == torch.float32 else 1e-2
        assert rel_err(in_order, x.double() @ w.double().T) < tol


def test_split_linears_sum_in_order_once_the_tiles_fill_the_gpu():
    """The choice is of launch, not arithmetic: it may follow the row count."""
    threshold = triton_ops.IN_ORDER_TILES
    assert not triton_ops.in_order(48, 6)  # a decode of the 1B model's QKV: 48 tiles
    assert not triton_ops.in_order(threshold - 1, 6)
    assert triton_ops.in_order(threshold, 6)
    assert triton_ops.in_order(64 * 48, 6)  # that QKV's 4096-row prefill
    assert not triton_ops.in_order(10 * threshold, 1)  # not split
    if CUDA:  # rows alone (parts in parallel) against a batch past the threshold (in order)
        w = randn(3072, 2048, dtype=torch.bfloat16, seed=2)  # 6 parts of 3 tiles of inputs
        _, bn, bk, splits = triton_ops.linear_config(3072, 2048)
        assert 1 < splits < 2048 // bk
        rows = 64 * -(-threshold // (3072 // bn))
        x = randn(rows, 2048, dtype=torch.bfloat16, seed=3)
        together = triton_ops.linear(x, w)
        for r in ([0], [5, 6], [rows - 1]):
            assert torch.equal(triton_ops.linear(x[r], w), together[r]), r


def test_split_linear_counters_grow_and_keep_their_predecessors(monkeypatch):
    """A call of more tiles than the counters hold grows them (zeroed); the old buffer is
    kept, since a captured CUDA graph may still count in it."""
    monkeypatch.setattr(triton_ops, "SPLITK_REDUCE", "fused")
    w = randn(64, 1024, seed=6)
    x = randn(1, 1024, seed=7)
    key = x.device
    before = list(triton_ops._COUNTERS.get(key, []))
    try:
        triton_ops._COUNTERS[key] = [torch.zeros(1, dtype=torch.int32, device=DEVICE)]
        small = triton_ops._COUNTERS[key][0]
        out = triton_ops.linear(x, w)  # one tile of rows, one of columns: fits
        assert triton_ops._COUNTERS[key] == [small]
        x2 = torch.cat([x, randn(64, 1024, seed=8)])  # two tiles of rows
        out2 = triton_ops.linear(x2, w)
        grown = triton_ops._COUNTERS[key]
        assert len(grown) == 2 and grown[0] is small
        assert grown[1].numel() >= triton_ops._MIN_COUNTERS and not grown[1].any()
        assert not small.any()
        assert torch.equal(out2[:1], out)
        assert rel_err(out2, x2.double() @ w.double().T) < 2e-3
    finally:
        triton_ops._COUNTERS[key] = before


def test_linear_config_depends_on_the_weight_alone():
    assert triton_ops.linear_config(49152, 2048) == (64, 128, 128, 1)  # 384 output tiles
    assert triton_ops.linear_config(2048, 8192) == (64, 64, 128, 8)  # 32 tiles x 8 parts
    assert triton_ops.linear_config(576, 32) == (64, 64, 32, 1)  # one tile of inputs
    for n, k in ((3072, 2048), (960, 576), (2048, 2048)):
        _, _, bk, splits = triton_ops.linear_config(n, k)
        k_tiles = -(-k // bk)
        per_part = -(-k_tiles // splits)
        assert (splits - 1) * per_part < k_tiles  # every part holds inputs


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

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,k", [(96, 200), (100, 1100), (40, 64)])
def test_gate_up_product_with_its_activation_gives_the_two_kernels_bits(
        dtype, d, k, monkeypatch, few_multiprocessors):
    """One launch writes silu(gate) * up of a gate/up weight: the bits of the product
    followed by silu_and_mul, whether the weight splits over its inputs (parts added by
    the last program, or in one program per tile) or not, alone and in any batch. So the
    row count may choose between them (``GATED_MAX_ROWS``)."""
    monkeypatch.setattr(triton_ops, "GATED_MAX_ROWS", 1 << 30)
    w = randn(2 * d, k, dtype=dtype, seed=21)
    x = randn(70, k, dtype=dtype, seed=22)
    splits = triton_ops.linear_config(2 * d, k)[3]
    for ordered in ((False, True) if splits > 1 else (False,)):
        monkeypatch.setattr(triton_ops, "IN_ORDER_TILES", 1 if ordered else 1 << 30)
        two = triton_ops.silu_and_mul(triton_ops.linear(x, w))
        one = triton_ops.linear_silu_and_mul(x, w)
        assert one.shape == (70, d) and torch.equal(one, two), (splits, ordered)
        for rows in ([0], [3, 4, 5], [69]):
            assert torch.equal(triton_ops.linear_silu_and_mul(x[rows], w), one[rows]), rows
        for counters in triton_ops._COUNTERS.get(x.device, []):
            assert not counters.any()
    ref = x.double() @ w.double().T
    ref = F.silu(ref[:, :d]) * ref[:, d:]
    assert rel_err(one, ref) < (2e-3 if dtype == torch.float32 else 2e-2)


def test_gate_up_product_past_the_row_limit_runs_two_kernels(monkeypatch):
    """Past GATED_MAX_ROWS rows the product and silu_and_mul run as two kernels (counted
    here); the bits are the same either way."""
    w = randn(128, 256, dtype=torch.bfloat16, seed=25)
    x = randn(9, 256, dtype=torch.bfloat16, seed=26)
    launched, silu_and_mul = [], triton_ops.silu_and_mul
    monkeypatch.setattr(triton_ops, "silu_and_mul",
                        lambda y: launched.append(y.shape) or silu_and_mul(y))
    monkeypatch.setattr(triton_ops, "GATED_MAX_ROWS", 8)
    past = triton_ops.linear_silu_and_mul(x, w)
    within = triton_ops.linear_silu_and_mul(x[:8], w)
    assert launched == [(9, 128)]
    assert torch.equal(within, past[:8])


def test_gate_up_product_with_two_kernels_when_the_parts_add_in_a_kernel(monkeypatch):
    """LLMSERVE_SPLITK_REDUCE=kernel: the parts' own launch adds plain columns, so a split
    gate/up weight takes the product and silu_and_mul (the same bits)."""
    w = randn(128, 1024, dtype=torch.bfloat16, seed=23)
    assert triton_ops.linear_config(128, 1024)[3] > 1
    x = randn(3, 1024, dtype=torch.bfloat16, seed=24)
    monkeypatch.setattr(triton_ops, "SPLITK_REDUCE", "kernel")
    assert torch.equal(triton_ops.linear_silu_and_mul(x, w),
                       triton_ops.silu_and_mul(triton_ops.linear(x, w)))
    with pytest.raises(ValueError, match="even number of rows"):
        triton_ops.linear_silu_and_mul(x, w[:127])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(5, 2 * 300, dtype=dtype)
    ref = F.silu(x[:, :300].float()) * x[:, 300:].float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(triton_ops.silu_and_mul(x), ref) < tol


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
    assert triton_ops.linear_config(192, 512)[3] > 1
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

    monkeypatch.setattr(triton_ops, "PDL", False)
    reference = run()
    monkeypatch.setattr(triton_ops, "PDL", True)
    assert triton_ops.pdl_for(x)
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

