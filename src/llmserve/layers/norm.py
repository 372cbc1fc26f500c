"""RMSNorm, computed in float32 like the reference implementations.

On CPU the compiled kernel does one row per task in a fixed order, with the residual add
fused in (``add_and_norm``); on CUDA a Triton kernel does the same (``triton_ops``);
elsewhere the same arithmetic runs as PyTorch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.csrc import cpu_ops
from llmserve.layers.gpu_kernels import gpu_ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2) + eps))`` of ``x`` [T, hidden] float32."""
        ops = _ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        gpu = gpu_ops_for(x)
        if gpu is not None:
            return gpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` in place; returns the norm of the sum."""
        ops = _ops_for(residual)
        if ops is not None:
            return ops.add_rms_norm_(residual, delta, self.weight, self.eps)
        gpu = gpu_ops_for(residual)
        if gpu is not None:
            return gpu.rms_norm(delta, self.weight, self.eps, residual=residual)
        return self(residual.add_(delta))


def _ops_for(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2:
        return None
    return cpu_ops()
