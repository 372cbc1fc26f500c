"""int4 weights in groups of 32, 64 or 128 input channels, each with a scale and an offset.

``W[n, k] = scale[n, g] * q[n, k] + zero[n, g]`` for ``g = k // group``, ``q`` in 0..15
(the layout of GGUF's Q4_1; Q4_0 is the case ``zero = -8 scale``). GGUF Q4_0/Q4_1 tensors
are taken as they are when the group is 32; anything else is quantized here, group by
group, from its float32 values (min/max, asymmetric). Scales and offsets are kept in
float16, as GGUF stores them.

Two kernels, one per machine (a layer uses one for every batch size, so rows never depend on
the batch):

- on a CPU with AVX-512 VNNI or AVX2, ``csrc/int4_linear.cpp``: activations split per row
  into two int8 levels (about 15 bits, as for int8 layers), exact integer dot products per
  group (``vpdpbusd``, or ``vpmaddubsw`` + ``vpmaddwd`` on AVX2) on nibbles unpacked in
  registers, group scales applied in float32; both builds give the same bits, and
  ``int4_reference`` below is the same arithmetic written plainly, for the tests;
- elsewhere ``aten._weight_int4pack_mm_for_cpu`` with bfloat16 activations and scales. Its
  float16 path would keep 3 more bits but is not vectorized: 60-100x slower. It computes
  each output row on its own, so it is row-invariant too.
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
from llmserve.layers.quantization.int8 import RESIDUAL, split_levels
from llmserve.layers.quantization.vnni import (
    LANES,
    PANEL,
    QUAD,
    aligned_empty,
    int_kernel_ops,
    padded,
)

ACT_DTYPE = torch.bfloat16
_MAX_Q = 15


def quantize_groups(w: torch.Tensor, group: int) -> BlockQuantized:
    """Asymmetric per-group int4 of ``w`` [N, K] float32."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    # Scale and offset rounded to float16 first (their stored precision), q fitted to them.
    lo, hi = wg.amin(dim=-1).half().float(), wg.amax(dim=-1)
    scale = ((hi - lo) / _MAX_Q).clamp_(min=2.0**-24).half().float()
    q = torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, _MAX_Q)
    return BlockQuantized(q.to(torch.uint8).view(n, k), scale, lo, group)


def pack_vnni(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] uint8 0..15, scale and zero [N, G]) -> the compiled kernel's
    (weights [N' / 64, K / 4, 128] uint8, scale_zero [N' / 64, G, 2, 64] float16), ``N'``
    = N rounded up to 64 (zero channels).

    Per panel of 64 output channels and quad ``j`` of input channels, 128 bytes: byte ``i``
    of half ``h`` holds block ``2h`` (low nibble) and ``2h + 1`` (high nibble) of 16
    channels, at channel ``i // 4`` of the block and input ``4 j + i % 4``.
    """
    n, k = q.shape
    groups = scale.shape[1]
    panels = padded(n) // PANEL
    full = torch.zeros(panels * PANEL, k, dtype=torch.uint8)
    full[:n] = q
    # [panel, quad, block, lane, 4] with block = 2 h + nibble
    t = full.view(panels, PANEL // LANES, LANES, k // QUAD, QUAD).permute(0, 3, 1, 2, 4)
    t = t.reshape(panels, k // QUAD, 2, 2, LANES * QUAD)
    packed = aligned_empty((panels, k // QUAD, 2 * LANES * QUAD), torch.uint8)
    packed.view(panels, k // QUAD, 2, LANES * QUAD).copy_(t[:, :, :, 0] | (t[:, :, :, 1] << 4))
    scale_zero = torch.zeros(panels * PANEL, groups, 2, dtype=torch.float16)
    scale_zero[:n, :, 0] = scale
    scale_zero[:n, :, 1] = zero
    scale_zero = scale_zero.view(panels, PANEL, groups, 2).permute(0, 2, 3, 1).contiguous()
    return packed, scale_zero


def int4_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor) -> torch.Tensor:
    """The compiled kernel's arithmetic, plainly: ``x`` [M, K] float32, ``q`` [N, K] 0..15,
    ``scale``/``zero`` [N, G] (float16 values) -> [M, N] float32, bitwise the kernel's."""
    m, k = x.shape
    groups = scale.shape[1]
    group = k // groups
    s, x1, x2 = split_levels(x)
    codes = (x1 * RESIDUAL + x2).to(torch.int64).view(m, groups, group)  # 254 x1 + x2
    qg = q.to(torch.int64).view(-1, groups, group)
    dots = torch.einsum("mgk,ngk->mng", codes, qg)  # exact integers
    sums = codes.sum(dim=2)  # [M, G]
    scale, zero = scale.float(), zero.float()
    out = torch.zeros(m, q.shape[0])
    for g in range(groups):
        out = out + scale[:, g] * dots[:, :, g].float()
        out = out + zero[:, g] * sums[:, g:g + 1].float()
    return out * (s / RESIDUAL)


@register_linear_method("int4")
class Int4Method(LinearMethod):
    _ops = None  # the compiled module when finalize() packed the weights for it
    _kernel_args: tuple = ()

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        groups = in_features // self.fmt.group_size
        # Until finalize() packs them for a kernel: values one byte each, scales and
        # offsets in their stored precision (never a float32 copy of the weight).
        layer._q_unpacked = torch.empty(out_features, in_features, dtype=torch.uint8)
        layer._scale = torch.empty(out_features, groups, dtype=torch.float16)
        layer._zero = torch.empty(out_features, groups, dtype=torch.float16)

    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None:
        group = self.fmt.group_size
        if not (isinstance(tensor, BlockQuantized) and tensor.group_size == group):
            src = tensor.dequantize() if isinstance(tensor, BlockQuantized) else tensor.float()
            tensor = quantize_groups(src, group)
        rows = slice(row_offset, row_offset + tensor.q.shape[0])
        layer._q_unpacked[rows].copy_(tensor.q)
        layer._scale[rows].copy_(tensor.scale)
        layer._zero[rows].copy_(tensor.zero)

    def finalize(self, layer: nn.Module) -> None:
        q, scale, zero = layer._q_unpacked, layer._scale, layer._zero
        del layer._q_unpacked, layer._scale, layer._zero
        self._ops = int_kernel_ops(q.device)
        if self._ops is not None:
            packed, scale_zero = pack_vnni(q, scale, zero)
            layer.register_buffer("qweight_vnni", packed)
            layer.register_buffer("scale_zero", scale_zero)
            # As a tuple too, read on every call (see Int8Method.finalize).
            self._kernel_args = (packed, scale_zero, self.fmt.group_size, layer.out_features)
            return
        layer.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), 1))
        # The kernel's form: w = (q - 8) * scale + zero'.
        layer.register_buffer("scales_and_zeros", torch.stack(
            [scale.float(), zero.float() + 8 * scale.float()], dim=-1).transpose(0, 1)
            .to(ACT_DTYPE).contiguous())

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            if x.dtype != torch.float32 or x.stride(-1) != 1:
                x = x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
            return self._ops.int4_linear(x, *self._kernel_args)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACT_DTYPE, memory_format=torch.contiguous_format), layer.qweight,
            self.fmt.group_size, layer.scales_and_zeros)
        return y.float()
