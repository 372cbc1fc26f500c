"""w8a8: int8 weights (per output channel) times int8 activations (dynamic, one scale per
group of inputs of a row).

The weights are int8's, packed the same way. Each activation row is quantized once to
int8, each group of at most ``BODY_GROUP`` inputs (``HEAD_GROUP`` in the output head) with
its own scale, ``x ~ s_g round(x / s_g)``, ``s_g = max|x_g| / 127``, where int8 keeps one
scale per row and the rounding residual as a second level. Half the integer products, so
about twice the speed where the products are the bound (large batches, long prefills; a
single row reads the same weight bytes and runs at the same speed). The groups cost a
float multiply-add of the partial sums per group and keep an outlier from coarsening the
whole row: on SmolLM2-135M's perplexity against float32, one scale per row (with int8's
two-level head) cost +3.7%, these groups +2.0% with the head on w8a8 as well (int8: +0.7%;
benchmarks/perplexity.py, BENCHMARKS.md). A width no group of a multiple of 4 divides
keeps one scale per row.

Row-invariant for the same reason as int8: exact integer sums, elementwise float steps in
a fixed order.
"""

from __future__ import annotations

import torch

from llmserve.layers.quantization.base import register_linear_method
from llmserve.layers.quantization.int8 import LEVELS, Int8Method, quantize_activations

BODY_GROUP = 256  # at most this many inputs share an activation scale in decoder layers
HEAD_GROUP = 64  # and in the output head


def activation_group(in_features: int, most: int) -> int:
    """The largest group of at most ``most`` inputs (a multiple of 4, the kernel's step)
    that splits ``in_features`` evenly; the whole row if none does."""
    for groups in range(-(-in_features // most), in_features // 4 + 1):
        if in_features % groups == 0 and in_features // groups % 4 == 0:
            return in_features // groups
    return in_features


def w8a8_matmul(x: torch.Tensor, weight_t: torch.Tensor, w_scale: torch.Tensor,
                group: int | None = None) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight_t`` [K, N] int8 (scales [N]) -> [M, N] float32:
    ``y = (sum over groups g, in order, of (x1_g W_g^T) s_g) w_scale`` with ``(s_g, x1_g) =
    quantize_activations(x_g)`` for each group ``x_g`` of ``group`` inputs (default: the
    whole row), the products in exact int32 and the float steps in the compiled kernel's
    order."""
    m, k = x.shape
    group = group or k
    s, x1 = quantize_activations(x.reshape(m * (k // group), group))
    s = s.view(m, k // group)
    x1 = x1.clamp_(-LEVELS, LEVELS).to(torch.int8).view(m, k)
    y = None
    for g in range(k // group):
        inputs = slice(g * group, (g + 1) * group)
        part = torch._int_mm(x1[:, inputs].contiguous(), weight_t[inputs]).float()
        part.mul_(s[:, g:g + 1])
        y = part if y is None else y.add_(part)
    return y.mul_(w_scale)


@register_linear_method("w8a8")
class W8A8Method(Int8Method):
    levels = 1
    max_group = BODY_GROUP

    def activation_group(self, in_features: int) -> int:
        return activation_group(in_features, self.max_group)

    def matmul(self, x: torch.Tensor, weight_t: torch.Tensor, w_scale: torch.Tensor
               ) -> torch.Tensor:
        return w8a8_matmul(x, weight_t, w_scale, self.activation_group(x.shape[1]))


class W8A8HeadMethod(W8A8Method):
    """The output head (and embedding) of the w8a8 format: finer activation groups."""

    max_group = HEAD_GROUP
