"""Launching the Triton kernels: programmatic dependent launch (PDL), and whether they run
under Triton's interpreter.

On Hopper and later GPUs the kernels (the layers' and the attention's) are launched with
PDL: a kernel may start while the one before it is finishing. Each waits for it
(``wait_for_inputs``: ``gdc_wait``) before it reads or writes anything, then lets the next
kernel launch: a kernel's launch and start-up overlap the end of the one before. The
arithmetic is unchanged, and so are the bits. ``LLMSERVE_PDL=0`` launches them one after
another (read at call time, through this module's ``PDL``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from llmserve import envs

# Under the interpreter (CPU tensors, the tests) kernels upcast 16-bit products (see
# attention/triton_kernels.py) and never launch with PDL.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
PDL = envs.LLMSERVE_PDL  # read at call time: tests and benchmarks switch it


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_for(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device launch with programmatic dependent launch (an
    NVIDIA GPU of compute capability 9.0 or later; ROCm's "cuda" devices have none)."""
    return (PDL and not INTERPRETED and x.device.type == "cuda"
            and torch.version.hip is None and _pdl_capable(x.device.index))


def pdl_launch(pdl: bool) -> dict:
    """A kernel's launch options for ``pdl``: its ``PDL`` constexpr, and the launch flag."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before has finished and its writes are visible, then
    let the kernel after launch (it waits in turn before it touches anything)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

