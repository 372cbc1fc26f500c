"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same arithmetic as ``weight * (x * rsqrt(mean(x^2) + eps))``, in one op."""
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
