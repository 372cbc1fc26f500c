"""What the compiled integer linear kernels (csrc/int8_linear.cpp, csrc/int4_linear.cpp)
share: whether they can run, and the tile their packed weights are padded to.

The packing is the operand layout of AVX-512 VNNI's ``vpdpbusd`` (hence the module's name);
the AVX2 build of the kernels reads the same layout, with bitwise the same results."""

from __future__ import annotations

from types import ModuleType

import torch

from llmserve.csrc import cpu_ops

PANEL = 64  # output channels per kernel tile: packed weights are padded to a multiple
LANES = 16  # output channels per vector
QUAD = 4  # input channels per vpdpbusd lane


def int_kernel_ops(device: torch.device) -> ModuleType | None:
    """The compiled module, if this layer's weights can go to its integer kernels (built for
    AVX-512 VNNI or AVX2; on other CPUs the PyTorch paths run)."""
    if device.type != "cpu":
        return None
    ops = cpu_ops()
    return ops if ops is not None and ops.int_kernels else None


def padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose data starts on a 64-byte boundary (aligned vector loads)."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel + 64 // itemsize, dtype=dtype)
    offset = (-raw.data_ptr() % 64) // itemsize
    return raw[offset:offset + numel].view(shape)
