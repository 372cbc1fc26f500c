"""int4 weights in groups of 32, 64 or 128 input channels, each with a scale and an offset.

``W[n, k] = scale[n, g] * q[n, k] + zero[n, g]`` for ``g = k // group``, ``q`` in 0..15
(the layout of GGUF's Q4_1; Q4_0 is the case ``zero = -8 scale``). GGUF Q4_0/Q4_1 tensors
are taken as they are when the group is 32; anything else is quantized here, group by
group, from its float32 values (min/max, asymmetric).

The product is ``aten._weight_int4pack_mm_for_cpu`` (AVX-512, unpacks nibbles in
registers) with bfloat16 activations and scales. Its float16 path would keep 3 more bits
but is not vectorized: 60-100x slower on this machine. The kernel computes each output row
on its own, so it is row-invariant.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.quantization.base import (
    BlockQuantized,
    LinearMethod,
    WeightSource,
    register_linear_method,
)

ACT_DTYPE = torch.bfloat16
_MAX_Q = 15


def quantize_groups(w: torch.Tensor, group: int) -> BlockQuantized:
    """Asymmetric per-group int4 of ``w`` [N, K] float32."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / _MAX_Q).clamp_(min=torch.finfo(torch.float32).tiny)
    q = torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, _MAX_Q)
    return BlockQuantized(q.to(torch.uint8).view(n, k), scale, lo, group)


@register_linear_method("int4")
class Int4Method(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        group = self.fmt.group_size
        layer.register_buffer("qweight", torch.empty(out_features, in_features // 2,
                                                     dtype=torch.uint8))
        layer.register_buffer("scales_and_zeros", torch.empty(
            in_features // group, out_features, 2, dtype=ACT_DTYPE))
        # Until finalize(): unpacked values, one byte each (the size of int8, never float32).
        layer._q_unpacked = torch.empty(out_features, in_features, dtype=torch.uint8)

    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None:
        group = self.fmt.group_size
        if not (isinstance(tensor, BlockQuantized) and tensor.group_size == group):
            src = tensor.dequantize() if isinstance(tensor, BlockQuantized) else tensor.float()
            tensor = quantize_groups(src, group)
        rows = slice(row_offset, row_offset + tensor.q.shape[0])
        layer._q_unpacked[rows].copy_(tensor.q)
        # The kernel's form: w = (q - 8) * scale + zero'.
        layer.scales_and_zeros[:, rows, 0].copy_(tensor.scale.t())
        layer.scales_and_zeros[:, rows, 1].copy_((tensor.zero + 8 * tensor.scale).t())

    def finalize(self, layer: nn.Module) -> None:
        q = layer._q_unpacked
        layer.qweight.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1))
        del layer._q_unpacked

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACT_DTYPE, memory_format=torch.contiguous_format), layer.qweight,
            self.fmt.group_size, layer.scales_and_zeros)
        return y.float()
