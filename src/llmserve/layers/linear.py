"""Linear layers, including the fused projections (QKV, gate/up) the models use.

Weights are loaded shard by shard: a fused layer knows the output offset of each of its
parts, so a loader that yields ``q_proj``, ``k_proj`` and ``v_proj`` separately fills one
``qkv_proj`` matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W``: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        """Copy a loaded tensor (``name`` is "weight" or "bias") into this layer."""
        del shard
        param = getattr(self, name)
        if param is None or param.shape != tensor.shape:
            got = None if param is None else tuple(param.shape)
            raise ValueError(f"{name}: expected shape {got}, got {tuple(tensor.shape)}")
        param.data.copy_(tensor)


class MergedLinear(Linear):
    """Several linear layers on the same input, stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.output_sizes = list(shard_sizes.values())

    def load_shard(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            return super().load_shard(name, tensor)
        offset, size = self.shard_offsets[shard]
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"{shard}.{name}: this layer has no {name}")
        target = param.data.narrow(0, offset, size)
        if target.shape != tensor.shape:
            raise ValueError(
                f"{shard}.{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)
