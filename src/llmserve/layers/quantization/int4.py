"""int4 weights in groups of 32, 64 or 128 input channels, each with a scale and an offset.

``W[n, k] = scale[n, g] * q[n, k] + zero[n, g]`` for ``g = k // group``, ``q`` in 0..15
(the layout of GGUF's Q4_1; Q4_0 is the case ``zero = -8 scale``). GGUF Q4_0/Q4_1 tensors
are taken as they are when the group is 32; anything else is quantized here, group by
group, from its float32 values (min/max, asymmetric). Scales and offsets are kept in
float16, as GGUF stores them.

Two kernels, one per machine (a layer uses one for every batch size, so rows never depend on
the batch):

- on a CPU with AVX-512 VNNI or AVX2, ``csrc/int4_linear.cpp``: activations quantized to
  one int8 level per group of 32 inputs (``ACT_GROUP``, the arithmetic of llama.cpp's Q8_1
  blocks), exact integer dot products per group (``vpdpbusd``, or ``vpmaddubsw`` +
  ``vpmaddwd`` on AVX2) on nibbles unpacked in registers, scales applied in float32 by
  fused multiply-adds; both
  builds give the same bits, and ``int4_reference`` below is the same arithmetic written
  plainly, for the tests. One level (not two as for int8) halves the integer work, which
  is what bounds a batch of many rows; scales per 32 inputs keep the loss at +0.44%
  perplexity on SmolLM2 (two levels: +0.21%; BENCHMARKS.md);
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
from llmserve.layers.quantization.dense import fma32
from llmserve.layers.quantization.int8 import LEVELS, quantize_activations
from llmserve.layers.quantization.vnni import (
    LANES,
    PANEL,
    QUAD,
    aligned_empty,
    int_kernel_ops,
    padded,
)

ACT_DTYPE = torch.bfloat16
ACT_GROUP = 32  # inputs per activation scale (the compiled kernel's)
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
    ``scale``/``zero`` [N, G] (float16 values) -> [M, N] float32, bitwise the kernel's.

    Per group ``a`` of 32 inputs of a row: ``(s_a, x1) = quantize_activations(x_a)``,
    ``A = x1 . q`` (exact), ``X = sum x1``; then, over the groups in order,
    ``out = fma(scale s_a, A, out)`` and ``out = fma(zero, s_a X, out)`` (each rounded once)
    with the scale and offset of the weight group holding ``a``."""
    m, k = x.shape
    n, groups = scale.shape
    act_groups = k // ACT_GROUP
    per_group = k // groups // ACT_GROUP
    s, x1 = quantize_activations(x.reshape(m * act_groups, ACT_GROUP))
    s = s.view(m, act_groups)
    codes = x1.clamp_(-LEVELS, LEVELS).to(torch.int64).view(m, act_groups, ACT_GROUP)
    qg = q.to(torch.int64).view(n, act_groups, ACT_GROUP)
    dots = torch.einsum("mak,nak->mna", codes, qg).float()  # exact integers
    scaled_sums = s * codes.sum(dim=2).float()  # [M, act_groups]
    scale, zero = scale.float(), zero.float()
    out = torch.zeros(m, n)
    for a in range(act_groups):
        g = a // per_group
        out = fma32(scale[:, g] * s[:, a:a + 1], dots[:, :, a], out)
        out = fma32(zero[:, g], scaled_sums[:, a:a + 1], out)
    return out


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

    def fused_kernel(self, layer: nn.Module) -> tuple | None:
        if self._ops is None:
            return None
        packed, scale_zero, group, out_features = self._kernel_args
        return ("int4", packed, scale_zero, None, out_features, 0, group)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            if x.dtype != torch.float32 or x.stride(-1) != 1:
                x = x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
            return self._ops.int4_linear(x, *self._kernel_args)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACT_DTYPE, memory_format=torch.contiguous_format), layer.qweight,
            self.fmt.group_size, layer.scales_and_zeros)
        return y.float()
