"""The attention layer models use; it delegates to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.backend import AttentionContext


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D] (rotary applied); returns [T, Hq*D]."""
        return ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata,
                                   self.scale)
