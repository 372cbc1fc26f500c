"""Dense weights: float32, or bfloat16 storage computed in float32.

This CPU has no bfloat16 arithmetic (no AVX512-BF16, no AMX), so oneDNN's bfloat16 GEMM
converts internally, runs slower than float32 once a batch has a few rows, and blocks its
work by row count, which makes a row's result depend on the batch. Here a bfloat16 weight
is widened into a float32 scratch buffer (one per shape, shared by all layers) and
multiplied by the same strict-mode MKL GEMM as float32: exact products of the stored
values, row-invariant, at half the resident memory of float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.quantization.base import (
    LinearMethod,
    WeightSource,
    as_float,
    register_linear_method,
)

_scratch: dict[tuple[torch.Size, torch.device], torch.Tensor] = {}


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
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.register_buffer("weight", torch.empty(out_features, in_features,
                                                    dtype=self.fmt.torch_dtype))

    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None:
        values = as_float(tensor)
        layer.weight[row_offset:row_offset + values.shape[0]].copy_(values)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _widened(layer.weight))

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight).float()
