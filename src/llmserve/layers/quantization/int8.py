"""int8 weights with one scale per output channel, multiplied in exact integer arithmetic.

``W[n, :] = w_scale[n] * Wq[n, :]`` with ``Wq`` in [-127, 127]. Activations are split per
row into two int8 parts, ``x = s (x1 + x2 / 254)``: ``x1`` is the row quantized to 8 bits,
``x2`` its rounding residual quantized again, which gives every row about 15 bits of
precision against its largest value (a single int8 level costs about 3% perplexity on
SmolLM2, the two-level split about what int8 weights alone cost). Both parts go through
one ``torch._int_mm`` (int8 x int8 -> int32) as ``[2M, K]``.

Integer sums are exact, so the result of a row is the same whatever else is in the batch
and whatever blocking the GEMM picks; the float steps around it are elementwise. That makes
this method row-invariant by construction, and it keeps the speed of an integer GEMM at
every batch size (weight-only int8 kernels run one row at a time and fall behind float32
past a few rows).

On a CPU with AVX-512 VNNI or AVX2 the compiled kernel (``csrc/int8_linear.cpp``) does the
same arithmetic with the weights packed for ``vpdpbusd`` and the activation split fused in:
bitwise the same result, at memory speed for a single row, where ``torch._int_mm`` spends
several times the weight read on a product this thin (and on a CPU without VNNI runs a
scalar loop: 140 ms per row of SmolLM2's output head on an AMD EPYC Zen 3).
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
from llmserve.layers.quantization.vnni import (
    LANES,
    PANEL,
    QUAD,
    aligned_empty,
    int_kernel_ops,
    padded,
)

LEVELS = 127.0
RESIDUAL = 2 * LEVELS  # the residual of rounding is within +-s/2: 254 steps of s/254


_ROWS_AT_A_TIME = 8192  # float temporaries of a slab, not of a whole large embedding


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``w`` [N, K] float -> (int8 [N, K], float32 scale [N]).
    Rows are independent: computed a slab at a time, with the same result."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], _ROWS_AT_A_TIME):
        part = w[r:r + _ROWS_AT_A_TIME]
        s = part.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / LEVELS
        q[r:r + _ROWS_AT_A_TIME] = torch.round(part / s.unsqueeze(1)).clamp_(-LEVELS, LEVELS)
        scale[r:r + _ROWS_AT_A_TIME] = s
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``s`` [M, 1], ``x1``) with ``x ~ s x1``: ``s = max|x| / 127`` per
    row (at least the smallest normal float) and ``x1 = round(x (1 / s))``, rounded half to
    even, a float tensor of integers not yet clamped to [-127, 127] (``split_levels`` takes
    its residual against the unclamped value, as the compiled kernels do). A product by the
    row's reciprocal, not a division: the kernels quantize at the speed of a multiply."""
    s = x.abs().amax(dim=1, keepdim=True).div_(LEVELS)
    s.clamp_(min=torch.finfo(torch.float32).tiny)  # a normal number: 1 / s stays finite
    return s, torch.round(x * (1.0 / s))


def split_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``s`` [M, 1], ``x1``, ``x2``) with ``x ~ s (x1 + x2 / 254)``:
    ``s = max|x| / 127``, ``x1 = round(x (1 / s))``, ``x2 = round((x - s x1) 254 (1 / s))``,
    both in [-127, 127] (float tensors holding integers). The compiled kernels do the same
    (``csrc/vnni.h``)."""
    s, x1 = quantize_activations(x)
    x2 = torch.round((x - x1 * s).mul_(RESIDUAL).mul_(1.0 / s))
    return s, x1.clamp_(-LEVELS, LEVELS), x2.clamp_(-LEVELS, LEVELS)


def int8_matmul(x: torch.Tensor, weight_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 times ``weight_t`` [K, N] int8 (scales [N]) -> [M, N] float32.

    1. Per row: ``split_levels``.
    2. One integer GEMM over ``[x1; x2]``.
    3. ``y = ((acc2 (1 / 254) + acc1) s) w_scale``, elementwise in float32 (a product by
       the reciprocal, not a division: the kernel's epilogue runs at the speed of a multiply).
    """
    m = x.shape[0]
    s, x1, x2 = split_levels(x)
    acc = torch._int_mm(torch.cat([x1, x2]).to(torch.int8), weight_t).float()  # [2M, N]
    return acc[m:].mul_(1 / RESIDUAL).add_(acc[:m]).mul_(s).mul_(w_scale)


def pack_vnni(weight_t: torch.Tensor, group: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight_t`` [K, N] int8 -> (packed [N' / 64, K / 4, 256] int8, excess [K / group,
    N'] int32), ``N'`` = N rounded up to 64 (zero channels); ``group`` defaults to K.

    The compiled kernel's layout: panels of 64 output channels, each [K / 4][4][16][4] (16
    output channels x 4 input channels per 64 bytes), in the order the kernel reads them.
    ``excess[g, n] = 128 sum W[n, k]`` over the inputs ``k`` of group ``g``: what the
    kernel's unsigned activations (x + 128) add to column ``n``'s sum of that group, taken
    back after the integer sum.
    """
    k, n = weight_t.shape
    group = group or k
    w = torch.zeros(padded(n), k, dtype=torch.int8)
    w[:n] = weight_t.t()
    panels = w.shape[0] // PANEL
    packed = aligned_empty((panels, k // QUAD, PANEL * QUAD), torch.int8)
    packed.view(panels, k // QUAD, PANEL // LANES, LANES, QUAD).copy_(
        w.view(panels, PANEL // LANES, LANES, k // QUAD, QUAD).permute(0, 3, 1, 2, 4))
    excess = w.view(w.shape[0], k // group, group).sum(dim=2, dtype=torch.int32).mul_(128)
    return packed, excess.t().contiguous()


def _unpacked_view(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight as [N' / 64, 4, 16, K / 4, 4]: index it [n // 64, n % 64 // 16,
    n % 16] for row ``n`` of W."""
    panels, quads, _ = packed.shape
    return packed.view(panels, quads, PANEL // LANES, LANES, QUAD).permute(0, 2, 3, 1, 4)


@register_linear_method("int8")
class Int8Method(LinearMethod):
    levels = 2  # int8 levels per activation row (w8a8: 1)
    matmul = staticmethod(int8_matmul)  # the PyTorch path, and the kernel's reference
    _ops = None  # the compiled module once finalize() has packed the weights for it
    _kernel_args: tuple = ()

    def activation_group(self, in_features: int) -> int:
        """Inputs per activation scale: the whole row (w8a8 takes smaller groups)."""
        return in_features

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

    def finalize(self, layer: nn.Module) -> None:
        if layer.in_features % QUAD == 0:
            self._ops = int_kernel_ops(layer.qweight_t.device)
        if self._ops is None:
            return
        group = self.activation_group(layer.in_features)
        packed, excess = pack_vnni(layer.qweight_t, group)
        layer.register_buffer("qweight_vnni", packed)
        layer.register_buffer("vnni_excess", excess)
        w_scale = torch.zeros(excess.shape[1])
        w_scale[:layer.w_scale.shape[0]] = layer.w_scale
        layer.register_buffer("w_scale", w_scale)  # padded like the packed columns
        del layer.qweight_t
        # The kernel's arguments once more, as a tuple read on every call: nn.Module's
        # attribute lookup costs ~2 us a buffer, a third of a small layer's kernel time.
        self._kernel_args = (packed, excess, w_scale, layer.out_features, self.levels, group)

    def fused_kernel(self, layer: nn.Module) -> tuple | None:
        return None if self._ops is None else ("int8", *self._kernel_args)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None and x.dtype == torch.float32 and x.stride(-1) == 1:
            return self._ops.int8_linear(x, *self._kernel_args)
        return self.matmul(x, self._weight_t(layer), layer.w_scale[:layer.out_features])

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # Row-major [T, K]: a transposed result would make later reductions over K depend
        # on T, and so on the batch.
        if self._ops is not None and ids.device.type == "cpu":
            return self._ops.int8_embedding(layer.qweight_vnni, layer.w_scale, ids,
                                            layer.out_features)
        if hasattr(layer, "qweight_vnni"):
            w = _unpacked_view(layer.qweight_vnni)
            rows = w[ids // PANEL, ids % PANEL // LANES, ids % LANES].reshape(
                ids.shape[0], -1).float()
        else:
            rows = layer.qweight_t.index_select(1, ids).t().to(
                torch.float32, memory_format=torch.contiguous_format)
        return rows.mul_(layer.w_scale.index_select(0, ids).unsqueeze(1))

    @staticmethod
    def _weight_t(layer: nn.Module) -> torch.Tensor:
        """The [K, N] int8 weight (unpacked again when the layer holds only the packed
        copy: a float32 input the kernel does not take)."""
        if hasattr(layer, "qweight_t"):
            return layer.qweight_t
        w = _unpacked_view(layer.qweight_vnni)
        return w.reshape(-1, w.shape[-2] * QUAD)[:layer.out_features].t()
