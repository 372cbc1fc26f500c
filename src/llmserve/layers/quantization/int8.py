"""int8 weights with one scale per output channel, multiplied in exact integer arithmetic.

``W[n, :] = w_scale[n] * Wq[n, :]`` with ``Wq`` in [-127, 127]. Activations are split per
row into two int8 parts, ``x = s (x1 + x2 / 254)``: ``x1`` is the row quantized to 8 bits,
``x2`` its rounding residual quantized again, which gives every row about 15 bits of
precision against its largest value (a single int8 level costs about 3% perplexity on
SmolLM2, the two-level split about what int8 weights alone cost). Both parts go through
one ``torch._int_mm`` (int8 x int8 -> int32, VNNI on this CPU) as ``[2M, K]``.

Integer sums are exact, so the result of a row is the same whatever else is in the batch
and whatever blocking the GEMM picks; the float steps around it are elementwise. That makes
this method row-invariant by construction, and it keeps the speed of an integer GEMM at
every batch size (weight-only int8 kernels run one row at a time and fall behind float32
past a few rows).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.quantization.base import (
    LinearMethod,
    WeightSource,
    as_float,
    register_linear_method,
)

_LEVELS = 127.0
_RESIDUAL = 2 * _LEVELS  # the residual of rounding is within +-s/2: 254 steps of s/254


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``w`` [N, K] float -> (int8 [N, K], float32 scale [N])."""
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _LEVELS
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return q, scale


def int8_matmul(x: torch.Tensor, weight_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight_t`` [K, N] int8 (scales [N]) -> [M, N] float32.

    1. Per row: ``s = max|x| / 127``, ``x1 = round(x / s)``, ``x2 = round((x - s x1) 254/s)``.
    2. One integer GEMM over ``[x1; x2]``.
    3. ``y = s w_scale (acc1 + acc2 / 254)``, elementwise.
    """
    m = x.shape[0]
    s = x.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    s.div_(_LEVELS)
    x1 = torch.round(x / s)
    x2 = torch.round((x - x1 * s).mul_(_RESIDUAL).div_(s))
    acc = torch._int_mm(torch.cat([x1, x2]).to(torch.int8), weight_t).float()  # [2M, N]
    return acc[m:].div_(_RESIDUAL).add_(acc[:m]).mul_(s).mul_(w_scale)


@register_linear_method("int8")
class Int8Method(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        # Stored [K, N]: the layout torch._int_mm streams fastest.
        layer.register_buffer("qweight_t", torch.empty(in_features, out_features,
                                                       dtype=torch.int8))
        layer.register_buffer("w_scale", torch.empty(out_features))

    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None:
        q, scale = quantize_rows(as_float(tensor))
        rows = slice(row_offset, row_offset + q.shape[0])
        layer.qweight_t[:, rows].copy_(q.t())
        layer.w_scale[rows].copy_(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, layer.qweight_t, layer.w_scale)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # Row-major [T, K]: a transposed result would make later reductions over K depend
        # on T, and so on the batch.
        rows = layer.qweight_t.index_select(1, ids).t().to(
            torch.float32, memory_format=torch.contiguous_format)
        return rows.mul_(layer.w_scale.index_select(0, ids).unsqueeze(1))
