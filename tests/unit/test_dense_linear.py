"""The dense kernel (csrc/dense_linear.cpp): bitwise the fused multiply-add chain of
``dense_reference``, whatever the number of rows, their tiling and blocking, the thread count
and the threads' floating-point state; and ``fma32`` itself against exact rational
arithmetic."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from llmserve.csrc import cpu_ops
from llmserve.layers.quantization.dense import (
    dense_reference,
    fma32,
    pack_panels,
    unpack_rows,
)

ops = cpu_ops()
needs_kernels = pytest.mark.skipif(
    ops is None, reason="compiled kernels unavailable (no C++ compiler, or LLMSERVE_CPU_KERNELS=0)")


def _round_to_float32(v: Fraction) -> np.float32:
    """The float32 nearest to ``v``, ties to even: the obvious way, by exact comparison."""
    guess = np.float32(float(v))  # within one float32 step of the answer
    candidates = {guess, np.nextafter(guess, np.float32(np.inf)),
                  np.nextafter(guess, np.float32(-np.inf))}
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - v),
                                          int(np.array(c).view(np.int32)) & 1))


def test_fma32_rounds_once():
    rng = random.Random(0)
    a, b, c = [], [], []
    for _ in range(3000):
        a.append(np.float32(rng.uniform(-2, 2)))
        b.append(np.float32(rng.uniform(-2, 2)))
        c.append(np.float32(rng.uniform(-4, 4) * 10 ** rng.randint(-8, 2)))
    ta, tb, tc = (torch.from_numpy(np.array(v, dtype=np.float32)) for v in (a, b, c))
    got = fma32(ta, tb, tc).numpy()
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i] == _round_to_float32(exact), (a[i], b[i], c[i])


@pytest.mark.parametrize(("tail", "rounds_up"), [(2.0 ** -80, True), (-(2.0 ** -80), False),
                                                 (0.0, False)])
def test_fma32_decides_double_rounding_ties(tail: float, rounds_up: bool):
    """(1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 lies exactly halfway between two float32 values. A
    c of 2^-80 tips the exact sum above the tie, but float64 cannot hold it (the sum rounds
    back onto the tie, which rounds to even, down): fused, it rounds up. A negative c tips
    it down, and c = 0 leaves a true tie, rounded to even."""
    a = torch.tensor([1.0 + 2.0 ** -12], dtype=torch.float32)
    c = torch.tensor([tail], dtype=torch.float32)
    exact = Fraction(float(a)) ** 2 + Fraction(tail)
    want = _round_to_float32(exact)
    assert (want > np.float32(1.0 + 2.0 ** -11)) == rounds_up
    assert fma32(a, a, c).item() == want


# (out, in): below one panel, a partial last panel, exact panels, SmolLM2's widths, and 10
# panels (a full span of 8 and 2 more, the last partial).
SHAPES = [(1, 3), (5, 64), (37, 64), (48, 40), (100, 576), (149, 96), (64, 1536)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_equals_the_fma_chain_bitwise(n: int, k: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    x = torch.randn(20, k, generator=gen) * 3
    x[3] = 0.0
    packed = pack_panels(w)
    y = ops.dense_linear(x, packed, n)
    assert torch.equal(y, dense_reference(x, w))
    for m in range(0, 20):  # every tile shape: 1..6 rows, and 1..5 after one or two full tiles
        assert torch.equal(ops.dense_linear(x[:m], packed, n), y[:m]), m
        if m:
            assert torch.equal(ops.dense_linear(x[m - 1:m], packed, n)[0], y[m - 1]), m


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_do_not_depend_on_batch_blocks_or_threads(dtype: torch.dtype):
    """Past a block of rows (the kernel keeps ~256 KiB of x in cache: 42 rows at 1536
    inputs), on one thread or several: every row is the row computed alone."""
    gen = torch.Generator().manual_seed(7)
    n, k = 100, 1536
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    packed = pack_panels(w)
    x = torch.randn(97, k, generator=gen)
    alone = torch.cat([ops.dense_linear(x[i:i + 1], packed, n) for i in range(97)])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in (97, 50, 43, 7):
                assert torch.equal(ops.dense_linear(x[:m], packed, n), alone[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_strided_rows_and_denormals_follow_ieee_in_every_thread():
    """Rows of a wider tensor (a stride past K) give the same values; denormal inputs and
    products are computed per IEEE 754 even when the calling thread flushes them."""
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 96
    w = torch.randn(n, k, generator=gen) * 1e-20
    wide = torch.randn(9, k + 5, generator=gen) * 1e-20  # products ~1e-40: denormal
    x = wide[:, :k]
    packed = pack_panels(w)
    want = dense_reference(x, w)
    assert (want.abs() < torch.finfo(torch.float32).tiny).any() and want.abs().max() > 0
    assert torch.equal(ops.dense_linear(x, packed, n), want)
    torch.set_flush_denormal(True)
    try:
        assert torch.equal(ops.dense_linear(x, packed, n), want)
    finally:
        torch.set_flush_denormal(False)


@needs_kernels
def test_packing_round_trips_and_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 20, generator=gen)
    packed = pack_panels(w)
    assert packed.shape == (3, 20, 16) and packed.data_ptr() % 64 == 0
    assert torch.equal(unpack_rows(packed, torch.arange(37)), w)
    assert torch.equal(packed[2, :, 5:], torch.zeros(20, 11))  # padding channels
    with pytest.raises(RuntimeError, match="input channels"):
        ops.dense_linear(torch.randn(2, 21), packed, 37)
    with pytest.raises(RuntimeError, match="output channels"):
        ops.dense_linear(torch.randn(2, 20), packed, 30)
    with pytest.raises(RuntimeError, match="float32"):
        ops.dense_linear(torch.randn(2, 20).double(), packed, 37)
    assert ops.dense_linear(torch.randn(0, 20), packed, 37).shape == (0, 37)
