"""The linear kernel (``layers/triton_linear.py``) against a float64 product, and its batch
invariance: a row's bits alone and in any batch, whichever way a split weight's parts are
added, and the gate/up product with its activation against the two kernels.

Without a GPU they run under Triton's interpreter on CPU tensors (see
test_triton_attention.py); on a GPU the same tests run on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# isort: off
# First: where there is no GPU, it switches Triton to its interpreter before Triton loads.
from tests.unit.test_triton_ops import CUDA, DEVICE, DTYPES, randn, rel_err
from llmserve.layers import triton_linear
# isort: on


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 200), (48, 64), (700, 33), (100, 1100)])
def test_linear_matches_a_float64_product(dtype, n, k):
    x, w = randn(37, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    out = triton_linear.linear(x, w)
    assert out.dtype == dtype and out.shape == (37, n)
    tol = 2e-3 if dtype == torch.float32 else 1e-2  # float32 on GPUs: tf32 products
    assert rel_err(out, x.double() @ w.double().T) < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gives_each_row_the_same_bits_in_any_batch(dtype):
    """The tiles come from the weight's shape, never the number of rows."""
    w = randn(160, 600, dtype=dtype, seed=2)  # split over K: 5 tiles of 128 inputs
    assert triton_linear.linear_config(160, 600)[3] > 1
    x = randn(130, 600, dtype=dtype, seed=3)  # more than one tile of rows
    together = triton_linear.linear(x, w)
    for rows in ([0], [5, 6], list(range(64, 67)), [129]):
        assert torch.equal(triton_linear.linear(x[rows], w), together[rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(64, 1024), (192, 2048), (100, 1100)])
def test_split_linear_sums_its_parts_in_one_launch_with_the_same_bits(dtype, n, k, monkeypatch):
    """The last program of each output tile adds the parts, in the order of the second
    kernel (LLMSERVE_SPLITK_REDUCE=kernel): the same bits, and its counters back at 0."""
    assert triton_linear.linear_config(n, k)[3] > 1
    w = randn(n, k, dtype=dtype, seed=4)
    for m in (1, 3, 17, 70):  # 70 rows: two tiles of rows, and tiles of counters
        x = randn(m, k, dtype=dtype, seed=5 + m)
        monkeypatch.setattr(triton_linear, "SPLITK_REDUCE", "fused")
        fused = triton_linear.linear(x, w)
        monkeypatch.setattr(triton_linear, "SPLITK_REDUCE", "kernel")
        two_kernels = triton_linear.linear(x, w)
        assert torch.equal(fused, two_kernels), m
        tol = 2e-3 if dtype == torch.float32 else 1e-2
        assert rel_err(fused, x.double() @ w.double().T) < tol
        for counters in triton_linear._COUNTERS[x.device]:
            assert not counters.any()


@pytest.fixture
def few_multiprocessors(monkeypatch):
    """linear_config as for a GPU of 8 multiprocessors: small weights split into parts of
    several tiles of inputs (an H100's parts, at shapes the interpreter runs quickly)."""
    monkeypatch.setattr(triton_linear, "_SMS", 8)
    triton_linear.linear_config.cache_clear()
    yield
    monkeypatch.undo()
    triton_linear.linear_config.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(256, 1024), (200, 1000)])  # parts of 2 tiles of inputs
def test_split_linear_sums_its_parts_in_one_program_with_the_same_bits(
        dtype, n, k, monkeypatch, few_multiprocessors):
    """With rows enough to fill the GPU, one program per tile sums the parts one after
    another: the bits of one program per part and their fold, without the partials."""
    _, _, bk, splits = triton_linear.linear_config(n, k)
    assert 1 < splits < -(-k // bk)  # parts of several tiles: their sums are not the tiles'
    w = randn(n, k, dtype=dtype, seed=11)
    for m in (1, 3, 70):
        x = randn(m, k, dtype=dtype, seed=12 + m)
        monkeypatch.setattr(triton_linear, "IN_ORDER_TILES", 1 << 30)  # one program per part
        parts = triton_linear.linear(x, w)
        monkeypatch.setattr(triton_linear, "IN_ORDER_TILES", 1)  # one program per tile
        in_order = triton_linear.linear(x, w)
        assert torch.equal(in_order, parts), m
        tol = 2e-3 if dtype == torch.float32 else 1e-2
        assert rel_err(in_order, x.double() @ w.double().T) < tol


def test_split_linears_sum_in_order_once_the_tiles_fill_the_gpu():
    """The choice is of launch, not arithmetic: it may follow the row count."""
    threshold = triton_linear.IN_ORDER_TILES
    assert not triton_linear.in_order(48, 6)  # a decode of the 1B model's QKV: 48 tiles
    assert not triton_linear.in_order(threshold - 1, 6)
    assert triton_linear.in_order(threshold, 6)
    assert triton_linear.in_order(64 * 48, 6)  # that QKV's 4096-row prefill
    assert not triton_linear.in_order(10 * threshold, 1)  # not split
    if CUDA:  # rows alone (parts in parallel) against a batch past the threshold (in order)
        w = randn(3072, 2048, dtype=torch.bfloat16, seed=2)  # 6 parts of 3 tiles of inputs
        _, bn, bk, splits = triton_linear.linear_config(3072, 2048)
        assert 1 < splits < 2048 // bk
        rows = 64 * -(-threshold // (3072 // bn))
        x = randn(rows, 2048, dtype=torch.bfloat16, seed=3)
        together = triton_linear.linear(x, w)
        for r in ([0], [5, 6], [rows - 1]):
            assert torch.equal(triton_linear.linear(x[r], w), together[r]), r


def test_split_linear_counters_grow_and_keep_their_predecessors(monkeypatch):
    """A call of more tiles than the counters hold grows them (zeroed); the old buffer is
    kept, since a captured CUDA graph may still count in it."""
    monkeypatch.setattr(triton_linear, "SPLITK_REDUCE", "fused")
    w = randn(64, 1024, seed=6)
    x = randn(1, 1024, seed=7)
    key = x.device
    before = list(triton_linear._COUNTERS.get(key, []))
    try:
        triton_linear._COUNTERS[key] = [torch.zeros(1, dtype=torch.int32, device=DEVICE)]
        small = triton_linear._COUNTERS[key][0]
        out = triton_linear.linear(x, w)  # one tile of rows, one of columns: fits
        assert triton_linear._COUNTERS[key] == [small]
        x2 = torch.cat([x, randn(64, 1024, seed=8)])  # two tiles of rows
        out2 = triton_linear.linear(x2, w)
        grown = triton_linear._COUNTERS[key]
        assert len(grown) == 2 and grown[0] is small
        assert grown[1].numel() >= triton_linear._MIN_COUNTERS and not grown[1].any()
        assert not small.any()
        assert torch.equal(out2[:1], out)
        assert rel_err(out2, x2.double() @ w.double().T) < 2e-3
    finally:
        triton_linear._COUNTERS[key] = before


def test_linear_config_depends_on_the_weight_alone():
    assert triton_linear.linear_config(49152, 2048) == (64, 128, 128, 1)  # 384 output tiles
    assert triton_linear.linear_config(2048, 8192) == (64, 64, 128, 8)  # 32 tiles x 8 parts
    assert triton_linear.linear_config(576, 32) == (64, 64, 32, 1)  # one tile of inputs
    for n, k in ((3072, 2048), (960, 576), (2048, 2048)):
        _, _, bk, splits = triton_linear.linear_config(n, k)
        k_tiles = -(-k // bk)
        per_part = -(-k_tiles // splits)
        assert (splits - 1) * per_part < k_tiles  # every part holds inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,k", [(96, 200), (100, 1100), (40, 64)])
def test_gate_up_product_with_its_activation_gives_the_two_kernels_bits(
        dtype, d, k, monkeypatch, few_multiprocessors):
    """One launch writes silu(gate) * up of a gate/up weight: the bits of the product
    followed by silu_and_mul, whether the weight splits over its inputs (parts added by
    the last program, or in one program per tile) or not, alone and in any batch. So the
    row count may choose between them (``GATED_MAX_ROWS``)."""
    monkeypatch.setattr(triton_linear, "GATED_MAX_ROWS", 1 << 30)
    w = randn(2 * d, k, dtype=dtype, seed=21)
    x = randn(70, k, dtype=dtype, seed=22)
    splits = triton_linear.linear_config(2 * d, k)[3]
    for ordered in ((False, True) if splits > 1 else (False,)):
        monkeypatch.setattr(triton_linear, "IN_ORDER_TILES", 1 if ordered else 1 << 30)
        two = triton_linear.silu_and_mul(triton_linear.linear(x, w))
        one = triton_linear.linear_silu_and_mul(x, w)
        assert one.shape == (70, d) and torch.equal(one, two), (splits, ordered)
        for rows in ([0], [3, 4, 5], [69]):
            assert torch.equal(triton_linear.linear_silu_and_mul(x[rows], w), one[rows]), rows
        for counters in triton_linear._COUNTERS.get(x.device, []):
            assert not counters.any()
    ref = x.double() @ w.double().T
    ref = F.silu(ref[:, :d]) * ref[:, d:]
    assert rel_err(one, ref) < (2e-3 if dtype == torch.float32 else 2e-2)


def test_gate_up_product_past_the_row_limit_runs_two_kernels(monkeypatch):
    """Past GATED_MAX_ROWS rows the product and silu_and_mul run as two kernels (counted
    here); the bits are the same either way."""
    w = randn(128, 256, dtype=torch.bfloat16, seed=25)
    x = randn(9, 256, dtype=torch.bfloat16, seed=26)
    launched, silu_and_mul = [], triton_linear.silu_and_mul
    monkeypatch.setattr(triton_linear, "silu_and_mul",
                        lambda y: launched.append(y.shape) or silu_and_mul(y))
    monkeypatch.setattr(triton_linear, "GATED_MAX_ROWS", 8)
    past = triton_linear.linear_silu_and_mul(x, w)
    within = triton_linear.linear_silu_and_mul(x[:8], w)
    assert launched == [(9, 128)]
    assert torch.equal(within, past[:8])


def test_gate_up_product_with_two_kernels_when_the_parts_add_in_a_kernel(monkeypatch):
    """LLMSERVE_SPLITK_REDUCE=kernel: the parts' own launch adds plain columns, so a split
    gate/up weight takes the product and silu_and_mul (the same bits)."""
    w = randn(128, 1024, dtype=torch.bfloat16, seed=23)
    assert triton_linear.linear_config(128, 1024)[3] > 1
    x = randn(3, 1024, dtype=torch.bfloat16, seed=24)
    monkeypatch.setattr(triton_linear, "SPLITK_REDUCE", "kernel")
    assert torch.equal(triton_linear.linear_silu_and_mul(x, w),
                       triton_linear.silu_and_mul(triton_linear.linear(x, w)))
    with pytest.raises(ValueError, match="even number of rows"):
        triton_linear.linear_silu_and_mul(x, w[:127])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = randn(5, 2 * 300, dtype=dtype)
    ref = F.silu(x[:, :300].float()) * x[:, 300:].float()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(triton_linear.silu_and_mul(x), ref) < tol
