"""The linear-method interface, the weight-format config and the method registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

# float16: on GPUs only (the CPU kernels read float32 and bfloat16 weights).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class BlockQuantized:
    """A weight still in a 4-bit, 32-wide block format of its file (GGUF Q4_0 / Q4_1).

    ``w[n, k] = scale[n, k // 32] * q[n, k] + zero[n, k // 32]``, so a method that stores
    the same layout (int4 with group 32) takes it without a round trip through float32.
    """

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor  # [N, K // 32] float32
    group_size: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // self.group_size, self.group_size).float()
        return (q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(n, k)


WeightSource = torch.Tensor | BlockQuantized


def as_float(tensor: WeightSource) -> torch.Tensor:
    """The float32 values of a loaded tensor, whatever form the file gave it in."""
    return tensor.dequantize() if isinstance(tensor, BlockQuantized) else tensor.float()


class LinearMethod(ABC):
    """How one linear layer stores ``W`` [out, in] and computes ``x W^T``.

    Lifecycle: ``create_weights`` registers the (empty) storage on the layer at
    construction, in its final size; ``load_rows`` fills output rows shard by shard as
    tensors are read (quantizing each tensor as it arrives, so no float32 copy of the whole
    model ever exists); ``finalize`` runs once after loading (packing, layout changes).
    ``apply`` must be row-invariant: a row's result may not depend on the other rows of
    ``x``, so that greedy output does not depend on batching.
    """

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None: ...

    @abstractmethod
    def load_rows(self, layer: nn.Module, tensor: WeightSource, row_offset: int) -> None: ...

    def finalize(self, layer: nn.Module) -> None:
        del layer

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x``: [M, in] float32 -> [M, out] float32."""

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a fused gate/up projection ``[M, 2d]`` of ``x``, as one
        kernel (the product never written); None where the method has no such kernel."""
        del layer, x
        return None

    def fused_kernel(self, layer: nn.Module) -> tuple | None:
        """The compiled kernel ``apply`` calls, as the arguments of ``make_linear_plan``
        after its kind (``("int4", packed, scale_zero, None, out, 0, group)``), for a fused
        decoder layer to call directly; None when ``apply`` runs PyTorch's kernels."""
        del layer
        return None

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``W`` as float32 (for a vocabulary embedding stored this way)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as an embedding")

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in layer.buffers(recurse=False))


@dataclass(frozen=True)
class WeightFormat:
    """The configured weight format: passed to layers, opened only by them.

    ``quantization`` names the method of the decoder layers' linear projections;
    ``dtype`` is the dtype of weights kept dense; the vocabulary embedding and output head
    use ``head_quantization`` (8 bits when the body is quantized, as llama.cpp keeps
    token embeddings at Q8_0 in its 4-bit files; w8a8's own activation groups with w8a8).
    """

    quantization: str = "none"
    dtype: str = "float32"
    group_size: int = 32  # int4 only

    def __post_init__(self) -> None:
        methods = list_quantization_methods()
        if self.quantization not in methods:
            raise ValueError(f"quantization must be one of {methods}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, "
                             f"got {self.group_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def head_quantization(self) -> str:
        return self.quantization if self.quantization in ("none", "w8a8") else "int8"

    def linear_method(self, in_features: int) -> LinearMethod:
        name = self.quantization
        if name == "int4" and in_features % self.group_size:
            name = "int8"  # a width the groups do not divide stays at 8 bits
        return get_linear_method_class(name)(self)

    def head_method(self) -> LinearMethod:
        if self.head_quantization == "w8a8":
            from llmserve.layers.quantization.w8a8 import W8A8HeadMethod

            return W8A8HeadMethod(self)
        return get_linear_method_class(self.head_quantization)(self)


_METHODS: dict[str, type[LinearMethod]] = {}


def register_linear_method(name: str):
    def wrap(cls: type[LinearMethod]) -> type[LinearMethod]:
        _METHODS[name] = cls
        return cls

    return wrap


def _load_builtin() -> None:
    from llmserve.layers.quantization import dense, int4, int8, w8a8  # noqa: F401


def get_linear_method_class(name: str) -> type[LinearMethod]:
    _load_builtin()
    if name not in _METHODS:
        raise ValueError(f"unknown quantization {name!r}; choose from {sorted(_METHODS)}")
    return _METHODS[name]


def list_quantization_methods() -> list[str]:
    _load_builtin()
    return sorted(_METHODS)
