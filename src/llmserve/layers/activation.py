"""Activations on fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.csrc import cpu_ops
from llmserve.layers.gpu_kernels import gpu_ops_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * d]`` gate/up projection output."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and gate_up.dim() == 2:
        ops = cpu_ops()
        if ops is not None:
            return ops.silu_and_mul(gate_up)
    gpu = gpu_ops_for(gate_up)
    if gpu is not None and gate_up.dim() == 2:
        return gpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
