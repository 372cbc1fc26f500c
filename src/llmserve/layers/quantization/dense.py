"""Dense weights: float32, or bfloat16 storage computed in float32.

On CPU the compiled kernel (``csrc/dense_linear.cpp``) computes every output element as one
chain of fused multiply-adds over the inputs in order, ``k = 0 .. K-1``, so a row's result
is the same alone, in any batch, on any number of threads and on any x86-64 CPU (the
argument is in the kernel's header; ``dense_reference`` below is the same chain in torch
ops, and the tests hold the kernel to it bitwise). bfloat16 weights are widened in
registers as they are read: half the bytes of float32, the same arithmetic on their values.

Without the compiled kernels (no compiler, ``LLMSERVE_CPU_KERNELS=0``), ``F.linear`` runs
instead: a bfloat16 weight is widened into a float32 scratch buffer (one per shape) and
multiplied by the BLAS, whose row results may then depend on the batch (MKL's strict mode
holds them on Intel CPUs, not on AMD ones). On a GPU the activations are in the weights'
dtype (bfloat16, float16) and a Triton kernel whose tiles do not depend on the number of
rows multiplies them (``layers/triton_linear.py``: batch-invariant, unlike cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.csrc import cpu_ops
from llmserve.layers.gpu_kernels import gpu_ops_for
from llmserve.layers.quantization.base import (
    LinearMethod,
    WeightSource,
    as_float,
    register_linear_method,
)
from llmserve.layers.quantization.vnni import aligned_empty

PANEL = 16  # output channels per packed panel (the kernel's vector of float32 lanes)

_scratch: dict[tuple[torch.Size, torch.device], torch.Tensor] = {}


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] -> [N' / 16, K, 16] in its dtype, ``N'`` = N rounded up to 16 (zero
    channels): the kernel's layout, each panel of 16 output channels read front to back."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    packed = aligned_empty((panels, k, PANEL), weight.dtype)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    packed.copy_(padded.view(panels, PANEL, k).transpose(1, 2))
    return packed


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the weight that ``pack_panels`` packed, [len(ids), K] row-major (a
    transposed result would make later sums over K depend on the number of rows)."""
    return packed[ids // PANEL, :, ids % PANEL].contiguous()


def dense_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: ``x`` [M, K] float32, ``weight`` [N, K] float32
    or bfloat16 -> [M, N] float32 with ``y = fma(x[:, K-1], w[:, K-1], ... fma(x[:, 0],
    w[:, 0], 0))``, every step one correctly rounded float32 fused multiply-add."""
    w = weight.float()
    y = torch.zeros(x.shape[0], w.shape[0])
    for i in range(x.shape[1]):
        y = fma32(x[:, i:i + 1], w[:, i], y)
    return y


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (IEEE 754 fusedMultiplyAdd), for float32 tensors
    (broadcast) of finite values.

    1. ``a * b`` is exact in float64 (48 significant bits); ``s = a * b + c`` rounds it once
       more and TwoSum gives the exact error ``e``: ``a * b + c = s + e``.
    2. Rounding ``s`` to float32 is then correct unless ``s`` sits exactly halfway between
       two float32 values: anywhere else ``|e|``, at most half a float64 step, cannot carry
       the exact value across a float32 rounding boundary.
    3. At a halfway ``s``, the sign of ``e`` says which neighbour the exact value is
       nearer (``e == 0``: a true tie, rounded to even as the cast does).
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.float()
    rd = r.double()
    other = torch.nextafter(r, torch.where(s > rd, torch.inf, -torch.inf))  # s is between
    halfway = (s != rd) & ((rd + other.double()) * 0.5 == s) & (e != 0)
    toward = torch.where((other.double() > rd) == (e > 0), other, r)
    return torch.where(halfway, toward, r)


def _widened(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return weight
    key = (weight.shape, weight.device)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = torch.empty(weight.shape, device=weight.device)
    return buf.copy_(weight)


@register_linear_method("none")
class DenseMethod(LinearMethod):
    _ops = None  # the compiled module once finalize() has packed the weight for it
    _kernel_args: tuple = ()

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.register_buffer("weight", torch.empty(out_features, in_features,
                                                    dtype=self.fmt.torch_dtype))

    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None:
        values = as_float(tensor)
        layer.weight[row_offset:row_offset + values.shape[0]].copy_(values)

    def finalize(self, layer: nn.Module) -> None:
        if layer.weight.device.type != "cpu" or layer.weight.numel() == 0:
            return
        self._ops = cpu_ops()
        if self._ops is None:
            return
        packed = pack_panels(layer.weight)
        del layer.weight
        layer.register_buffer("weight_panels", packed)
        # Read on every call as a tuple (nn.Module's buffer lookup costs ~2 us).
        self._kernel_args = (packed, layer.out_features)

    def fused_kernel(self, layer: nn.Module) -> tuple | None:
        if self._ops is None:
            return None
        packed, out_features = self._kernel_args
        return ("dense", packed, None, None, out_features, 0, 0)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            if x.dtype != torch.float32 or x.stride(-1) != 1:
                x = x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
            return self._ops.dense_linear(x, *self._kernel_args)
        weight = layer.weight
        if weight.device.type != "cpu":  # GPUs multiply in the weights' dtype
            gpu = gpu_ops_for(weight)
            if gpu is not None:
                return gpu.linear(x, weight)
            return F.linear(x.to(weight.dtype), weight)
        return F.linear(x, _widened(weight))

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        weight = getattr(layer, "weight", None)  # None: packed for the CPU kernel
        gpu = gpu_ops_for(weight) if weight is not None else None
        return None if gpu is None else gpu.linear_silu_and_mul(x, weight)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return unpack_rows(layer.weight_panels, ids).float()
        embedded = F.embedding(ids, layer.weight)
        return embedded if embedded.device.type != "cpu" else embedded.float()
