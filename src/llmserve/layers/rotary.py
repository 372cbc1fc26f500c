"""Rotary position embedding with precomputed cos/sin tables (neox / rotate-half layout)."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmserve.csrc import cpu_ops
from llmserve.layers.gpu_kernels import gpu_ops_for
from llmserve.models.arch_config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with Llama 3 / linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.freq_factors is not None:
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to flattened query/key tensors by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        # [max_positions, 2, D/2]: the halves' factors, so one broadcast covers both.
        self.register_buffer("cos", freqs.cos().unsqueeze(1).repeat(1, 2, 1), persistent=False)
        sin = freqs.sin()
        self.register_buffer("sin", torch.stack((-sin, sin), dim=1), persistent=False)
        # The step's tables, looked up once and reused by every layer of the step.
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forget_step(self) -> None:
        """Drop the step's looked-up tables (before a CUDA graph captures the lookup)."""
        self._step = None

    def kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the GPU kernels take: cos of each position (either half), and sin with its
        sign (the second half's), each [max_positions, D / 2]."""
        return self.cos[:, 0], self.sin[:, 1]

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: [T] int64; ``q``: [T, Hq, D]; ``k``: [T, Hkv, D]. On CPU the
        compiled kernel rotates ``q`` and ``k`` in place (same arithmetic)."""
        if q.device.type == "cpu" and q.dtype == torch.float32:
            ops = cpu_ops()
            if ops is not None:
                ops.rotary_embedding_(q, k, positions, self.cos, self.sin)
                return q, k
        gpu = gpu_ops_for(q)
        if gpu is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            gpu.rotary_(q, k, positions, *self.kernel_tables())
            return q, k
        if self._step is None or self._step[0] is not positions:
            cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, 2, D/2]
            sin = self.sin.index_select(0, positions).unsqueeze(1)
            self._step = (positions, cos, sin)
        _, cos, sin = self._step
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` as ``x cos + swap(x) sin``."""
    t, h, d = x.shape
    halves = x.float().view(t, h, 2, d // 2)
    out = halves * cos + halves.flip(2) * sin
    return out.view(t, h, d).to(x.dtype)
