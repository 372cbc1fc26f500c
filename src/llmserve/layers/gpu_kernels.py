"""Which tensors the layers' Triton kernels (``triton_ops``) take: CUDA tensors, when
Triton is installed and ``LLMSERVE_GPU_KERNELS`` is not 0. Imported by CPU-only installs
too, so Triton is imported on first use only."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from llmserve import envs


@functools.cache
def triton_ops() -> ModuleType | None:
    if not envs.LLMSERVE_GPU_KERNELS:
        return None
    try:
        from llmserve.layers import triton_ops as ops
    except ImportError:
        return None
    return ops


def gpu_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels for ``x``, or None (CPU tensors, no Triton: the PyTorch path)."""
    return triton_ops() if x.device.type == "cuda" else None
