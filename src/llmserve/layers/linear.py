"""Linear layers, including the fused projections (QKV, gate/up) the models use.

A layer's weight storage and matrix product belong to its ``LinearMethod``, picked from
the configured ``WeightFormat`` (float32, bfloat16, int8, int4); the layer itself only
knows shapes, its bias and where each loaded shard goes. Weights are loaded shard by
shard: a fused layer knows the output offset of each of its parts, so a loader that yields
``q_proj``, ``k_proj`` and ``v_proj`` separately fills one ``qkv_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.activation import silu_and_mul
from llmserve.layers.quantization import LinearMethod, WeightFormat
from llmserve.layers.quantization.base import WeightSource, as_float


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W``: [out_features, in_features], stored by its method."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 fmt: WeightFormat | None = None, method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.quant_method = method or (fmt or WeightFormat()).linear_method(in_features)
        self.quant_method.create_weights(self, in_features, out_features)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)
        self.shard_offsets: dict[str, tuple[int, int]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return y if self.bias is None else y.add_(self.bias)

    def load_shard(self, name: str, tensor: WeightSource, shard: str | None = None) -> None:
        """Take a loaded ``weight`` or ``bias`` (of one shard, for a fused layer)."""
        offset, size = (0, self.out_features) if shard is None else self.shard_offsets[shard]
        label = name if shard is None else f"{shard}.{name}"
        expected = (size, self.in_features) if name == "weight" else (size,)
        if name == "bias" and self.bias is None:
            raise ValueError(f"{label}: this layer has no bias")
        if name not in ("weight", "bias"):
            raise ValueError(f"{label}: a linear layer has only weight and bias")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{label}: expected shape {expected}, got {tuple(tensor.shape)}")
        if name == "weight":
            self.quant_method.load_rows(self, tensor, offset)
        else:
            self.bias.data[offset:offset + size].copy_(as_float(tensor))

    def finalize(self) -> None:
        self.quant_method.finalize(self)

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__
        return f"in={self.in_features}, out={self.out_features}, method={method}"


class MergedLinear(Linear):
    """Several linear layers on the same input, stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 fmt: WeightFormat | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, fmt)
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.output_sizes = list(shard_sizes.values())

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gate/up projection of ``x``: in the product's own
        kernel where the weight's method has one (the GPU's dense linear), else the
        product, then the activation."""
        if self.bias is None and len(self.output_sizes) == 2:
            y = self.quant_method.apply_silu_and_mul(self, x)
            if y is not None:
                return y
        return silu_and_mul(self(x))


class VocabEmbedding(Linear):
    """The token embedding [vocab, hidden]; with tied weights it is also the output head."""

    def __init__(self, vocab_size: int, hidden_size: int, fmt: WeightFormat | None = None
                 ) -> None:
        fmt = fmt or WeightFormat()
        super().__init__(hidden_size, vocab_size, method=fmt.head_method())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [T] -> [T, hidden] float32."""
        return self.quant_method.embedding(self, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [N, hidden] -> [N, vocab] float32."""
        return self.quant_method.apply(self, hidden)


def finalize_weights(model: nn.Module) -> None:
    """Run every layer's post-load step (packing) once all tensors are in."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.finalize()
