"""w8a8: int8 weights (per output channel) times int8 activations (per row, dynamic).

The weights are int8's, packed the same way. Each activation row is quantized once to
int8 with its own scale, ``x ~ s round(x / s)``, ``s = max|x| / 127``, where int8 keeps
the rounding residual as a second level: half the integer products, so about twice the
speed where the products are the bound (large batches, long prefills; a single row reads
the same weight bytes and runs at the same speed). Quality is what one level costs:
SmolLM2-135M's perplexity rises ~4% against float32, where int8 costs ~0.7% (the table in
BENCHMARKS.md; benchmarks/perplexity.py). The output head stays on int8's two levels, as
W8A8 checkpoints keep their head at full precision: it alone cost +1.2% at one level.

Row-invariant for the same reason as int8: exact integer sums, elementwise float steps.
"""

from __future__ import annotations

import torch

from llmserve.layers.quantization.base import register_linear_method
from llmserve.layers.quantization.int8 import LEVELS, Int8Method, quantize_activations


def w8a8_matmul(x: torch.Tensor, weight_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight_t`` [K, N] int8 (scales [N]) -> [M, N] float32:
    ``y = (x1 W^T) s w_scale`` with ``(s, x1) = quantize_activations(x)``, the product in
    exact int32 and the float steps in the compiled kernel's order."""
    s, x1 = quantize_activations(x)
    acc = torch._int_mm(x1.clamp_(-LEVELS, LEVELS).to(torch.int8), weight_t)
    return acc.float().mul_(s).mul_(w_scale)


@register_linear_method("w8a8")
class W8A8Method(Int8Method):
    levels = 1
    matmul = staticmethod(w8a8_matmul)
