"""The compiled integer kernels (AVX-512 VNNI or AVX2 builds) against plain PyTorch
implementations of their arithmetic.

int8 and w8a8: the kernel and the torch._int_mm path compute the same activation levels
(two, or one for w8a8) and the same float epilogue around exact integer sums; int4:
``int4_reference`` spells out the kernel's steps with torch ops. Either way the results must
be bitwise equal: any difference is a bug (a packing slip, a lost tail channel, a wrong
offset correction), not rounding.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.csrc import cpu_ops
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import WeightFormat
from llmserve.layers.quantization.int4 import int4_reference, quantize_groups
from llmserve.layers.quantization.int4 import pack_vnni as pack_int4
from llmserve.layers.quantization.int8 import int8_matmul, pack_vnni, quantize_rows
from llmserve.layers.quantization.w8a8 import w8a8_matmul

ops = cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.int_kernels,
    reason="compiled kernels unavailable, or built for a CPU without AVX2")


def _activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * 3
    if m > 1:
        x[:, k // 2] = 60.0  # an outlier channel
        x[m // 2] = 0.0  # an all-zero row: the scale floor
    return x


# (out, in): 36, 0 and 1 output channels past the last full 64-wide tile; SmolLM2 shapes.
SHAPES = [(100, 64), (64, 4), (129, 12), (960, 576), (576, 1536)]


# (levels, inputs per activation scale: None = the row): int8; w8a8 with one scale per row,
# per 64 inputs (the format's default), per 4 (the smallest the kernel takes).
FORMATS = [(2, None), (1, None), (1, 64), (1, 4)]


@pytest.mark.parametrize(("levels", "group"), FORMATS,
                         ids=["int8", "w8a8-row", "w8a8-g64", "w8a8-g4"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_kernel_equals_int_mm_bitwise(n: int, k: int, levels: int, group: int | None):
    group = group if group and k % group == 0 else k
    gen = torch.Generator().manual_seed(n * k)
    q, w_scale = quantize_rows(torch.randn(n, k, generator=gen))
    weight_t = q.t().contiguous()
    packed, excess = pack_vnni(weight_t, group)
    padded_scale = torch.zeros(excess.shape[1])
    padded_scale[:n] = w_scale

    def reference(x: torch.Tensor) -> torch.Tensor:
        if levels == 2:
            return int8_matmul(x, weight_t, w_scale)
        return w8a8_matmul(x, weight_t, w_scale, group)

    # Row counts around both tile heights (3 rows of two levels, 6 of one).
    for m in (0, 1, 2, 3, 4, 5, 6, 7, 13, 64):
        x = _activations(m, k, gen)
        got = ops.int8_linear(x, packed, excess, padded_scale, n, levels, group)
        assert torch.equal(got, reference(x)), f"{m} rows"
    # A strided input (rows of a wider tensor) reads the same values.
    wide = _activations(9, k + 8, gen)
    assert torch.equal(
        ops.int8_linear(wide[:, :k], packed, excess, padded_scale, n, levels, group),
        reference(wide[:, :k].contiguous()))


def test_w8a8_is_int8_with_one_level():
    """w8a8 drops only the residual level: its error against the float product is about
    the one-level quantization step, the two-level int8's far below it."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=gen)
    q, w_scale = quantize_rows(w)
    x = torch.randn(16, 256, generator=gen)
    exact = x @ (q.float() * w_scale.unsqueeze(1)).t()
    one = (w8a8_matmul(x, q.t().contiguous(), w_scale) - exact).abs().max()
    two = (int8_matmul(x, q.t().contiguous(), w_scale) - exact).abs().max()
    assert one > 20 * two
    # one level: each input off by at most half a step of its row's scale
    step = x.abs().amax(dim=1, keepdim=True) / 127
    bound = (step / 2 * (q.float() * w_scale.unsqueeze(1)).abs().sum(dim=1)).max()
    assert one <= bound


def test_w8a8_groups_confine_an_outlier():
    """With a scale per group of 64 inputs, an outlier coarsens only its own group: the
    error is within each group's half step, and below one scale per row's (rounding errors
    add up like a random walk: a quarter of the coarse inputs, about half the error)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(96, 256, generator=gen)
    q, w_scale = quantize_rows(w)
    w_q = q.float() * w_scale.unsqueeze(1)
    x = torch.randn(16, 256, generator=gen)
    x[:, 3] = 80.0  # an outlier channel, in the first group
    exact = x @ w_q.t()
    row = (w8a8_matmul(x, q.t().contiguous(), w_scale) - exact).abs()
    grouped = (w8a8_matmul(x, q.t().contiguous(), w_scale, 64) - exact).abs()
    step = x.view(16, 4, 64).abs().amax(dim=2, keepdim=True) / 127  # [16, 4, 1]
    bound = torch.einsum("mg,ngk->mn", step.squeeze(2) / 2, w_q.abs().view(96, 4, 64))
    assert (grouped <= bound).all()
    assert grouped.mean() < 0.6 * row.mean()


def test_int8_packed_layer_keeps_embedding_and_fallback():
    """A layer holding only the packed weight still embeds rows and runs inputs the kernel
    does not take, with the values of the unpacked weight."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 64, generator=gen)
    layer = Linear(64, 200, fmt=WeightFormat("int8"))
    layer.load_shard("weight", weight)
    q, w_scale = quantize_rows(weight)
    layer.finalize()
    assert hasattr(layer, "qweight_vnni") and not hasattr(layer, "qweight_t")
    ids = torch.tensor([0, 15, 16, 63, 64, 199, 5])
    expected = q[ids].float() * w_scale[ids].unsqueeze(1)
    assert torch.equal(layer.quant_method.embedding(layer, ids), expected)  # compiled gather
    method = layer.quant_method
    method._ops, ops_ = None, method._ops
    try:
        assert torch.equal(method.embedding(layer, ids), expected)  # indexing the packed view
    finally:
        method._ops = ops_
    with pytest.raises(RuntimeError, match="token id 200 outside the embedding's 200 rows"):
        ops.int8_embedding(layer.qweight_vnni, layer.w_scale, torch.tensor([3, 200]), 200)
    assert torch.equal(layer.quant_method._weight_t(layer), q.t())
    x = _activations(5, 64, gen)
    assert torch.equal(layer(x), int8_matmul(x, q.t().contiguous(), w_scale))


def test_int8_kernel_rejects_mismatched_shapes():
    q, _ = quantize_rows(torch.randn(64, 32))
    packed, excess = pack_vnni(q.t().contiguous())
    with pytest.raises(RuntimeError, match="input channels"):
        ops.int8_linear(torch.randn(2, 36), packed, excess, torch.ones(64), 64, 2, 36)
    with pytest.raises(RuntimeError, match="output channels"):
        ops.int8_linear(torch.randn(2, 32), packed, excess, torch.ones(64), 65, 2, 32)
    with pytest.raises(RuntimeError, match="levels must be 1 or 2"):
        ops.int8_linear(torch.randn(2, 32), packed, excess, torch.ones(64), 64, 3, 32)
    with pytest.raises(RuntimeError, match="activation group"):
        ops.int8_linear(torch.randn(2, 32), packed, excess, torch.ones(64), 64, 1, 12)
    with pytest.raises(RuntimeError, match="groups need one level"):
        ops.int8_linear(torch.randn(2, 32), packed, excess, torch.ones(64), 64, 2, 16)
    with pytest.raises(RuntimeError, match="excess"):  # packed for one group, called with 2
        ops.int8_linear(torch.randn(2, 32), packed, excess, torch.ones(64), 64, 1, 16)


# (out, in, group); row counts below cover every tile size (up to 4 rows: one tile of the whole
# panel, or of half panels where the panels do not split evenly over the threads: 3, 15 and
# 9 panels on 2 threads; more: balanced tiles of up to 6 rows a half panel at a time: 5,
# 3 + 4, 4 + 5, 5 + 6 + 6).
INT4_SHAPES = [(100, 64, 32), (130, 256, 64), (64, 128, 128), (960, 576, 32), (576, 1536, 128)]


@pytest.mark.parametrize(("n", "k", "group"), INT4_SHAPES)
def test_int4_kernel_equals_reference_bitwise(n: int, k: int, group: int):
    gen = torch.Generator().manual_seed(n + k + group)
    b = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, group)
    scale, zero = b.scale.half(), b.zero.half()
    packed, scale_zero = pack_int4(b.q, scale, zero)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for m in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64):
                x = _activations(m, k, gen)
                got = ops.int4_linear(x, packed, scale_zero, group, n)
                assert torch.equal(got, int4_reference(x, b.q, scale, zero)), \
                    f"{m} rows, {num_threads} threads"
    finally:
        torch.set_num_threads(threads)


def test_int4_layer_is_close_to_its_dequantized_weight():
    """End to end through the layer: the product of the stored (dequantized) weight, up to
    the activations' rounding to int8 per group of 32 inputs (at most 1/254 of each group's
    largest value per input)."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(192, 256, generator=gen) * 0.05
    layer = Linear(256, 192, fmt=WeightFormat("int4", group_size=64))
    layer.load_shard("weight", weight)
    layer.finalize()
    assert hasattr(layer, "qweight_vnni")
    x = _activations(7, 256, gen)
    ref = x @ quantize_groups(weight, 64).dequantize().t()
    assert ((layer(x) - ref).abs().max() / ref.abs().max()).item() < 2e-2
