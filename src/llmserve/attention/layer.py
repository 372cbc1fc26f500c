"""The attention layer models use; it delegates to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.backend import AttentionContext, Rope


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, sliding_window: int | None = None) -> None:
        """``scale``: of q k^T (default head_dim ** -0.5); ``sliding_window``: the layer
        sees only the last that many keys of each query's context (None: all of them)."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: AttentionContext, rope: Rope | None = None) -> torch.Tensor:
        """``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D]; returns [T, Hq*D]. ``rope``: the
        rotary still to apply to ``q`` and ``k`` (the backend may fuse it with the KV store);
        None when they are rotated already."""
        i = self.layer_idx
        return ctx.backend.forward(q, k, v, ctx.kv_caches[i], ctx.metadata[i], self.scale,
                                   self.sliding_window, rope)
