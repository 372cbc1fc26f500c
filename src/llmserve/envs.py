"""Every environment variable llmserve reads, in one place.

Imported by ``llmserve/__init__.py`` before torch, because the math library reads some of
these once, when it is first loaded.
"""

from __future__ import annotations

import os

# Intel MKL's "conditional numerical reproducibility" in strict mode keeps each row of a
# matrix product independent of how many rows are computed together, on Intel CPUs (not on
# AMD ones). Dense layers no longer rely on it (csrc/dense_linear.cpp fixes the order
# itself); it still serves the PyTorch fallbacks that run without the compiled kernels.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

LLMSERVE_LOG_LEVEL: str = os.environ.get("LLMSERVE_LOG_LEVEL", "INFO")
# Where `llmserve` looks for extra named models (besides the embedded default).
LLMSERVE_MODEL_DIR: str | None = os.environ.get("LLMSERVE_MODEL_DIR")
# Never touch a model hub: set the hub libraries' offline switches for this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Where the C++ CPU kernels are compiled to (once per machine and source version).
LLMSERVE_CACHE_DIR: str = os.environ.get(
    "LLMSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "llmserve"))
# "0" turns the compiled CPU kernels off: the pure PyTorch paths are used instead.
LLMSERVE_CPU_KERNELS: bool = os.environ.get("LLMSERVE_CPU_KERNELS", "1") != "0"
# "0" turns the layers' Triton kernels on CUDA off (layers/triton_ops.py): PyTorch's ops
# run instead, cuBLAS among them, and greedy output may then depend on the batch.
LLMSERVE_GPU_KERNELS: bool = os.environ.get("LLMSERVE_GPU_KERNELS", "1") != "0"
# How the Triton linear kernel adds the parts of a weight split over its inputs: "fused" (the
# last program of each output tile adds them, one launch) or "kernel" (a second kernel does;
# the same sums in the same order, so the same bits: a comparison on the GPU).
LLMSERVE_SPLITK_REDUCE: str = os.environ.get("LLMSERVE_SPLITK_REDUCE", "fused")
if LLMSERVE_SPLITK_REDUCE not in ("fused", "kernel"):
    raise ValueError(f"LLMSERVE_SPLITK_REDUCE={LLMSERVE_SPLITK_REDUCE!r}: 'fused' or 'kernel'")
# "0" launches the Triton kernels of a step one after another as usual instead of with
# programmatic dependent launch (NVIDIA Hopper and later: each kernel's launch and start-up
# overlap the end of the one before; see layers/triton_launch.py). Read at call time: a
# comparison on the GPU.
LLMSERVE_PDL: bool = os.environ.get("LLMSERVE_PDL", "1") != "0"
# The instruction set the compiled CPU kernels are built for: "native" (this CPU's own, the
# default), "avx2" (x86-64-v3: AVX2 and FMA, no AVX-512, no VNNI: the portable kernels, as
# AMD Zen 2/3 run them) or "baseline" (x86-64-v2: no AVX; the integer formats then fall back
# to PyTorch). Forcing a lower one runs the portable paths on any newer CPU (`make test`).
LLMSERVE_CPU_ISA: str = os.environ.get("LLMSERVE_CPU_ISA", "native")
# "0" runs a Llama-shaped model's decoder layers module by module (the reference path) instead
# of as one call into the compiled kernels per step (models/fused.py); the output is the same.
LLMSERVE_FUSED_LAYERS: bool = os.environ.get("LLMSERVE_FUSED_LAYERS", "1") != "0"
# "0" opens an OpenMP region per kernel of the fused stack, as the modules do, instead of one
# for the whole stack (csrc/team.h).
LLMSERVE_STACK_TEAM: bool = os.environ.get("LLMSERVE_STACK_TEAM", "1") != "0"
# "0": paged attention's decode items on CPU stop reading their KV blocks (every KV head of
# them) before they compute, and rely on software prefetches alone (csrc/paged_attention.cpp,
# load_item_blocks); the output is the same.
LLMSERVE_ATTENTION_LOAD_AHEAD: bool = (
    os.environ.get("LLMSERVE_ATTENTION_LOAD_AHEAD", "1") != "0")
# "0" leaves glibc's malloc thresholds alone (see llmserve/host_memory.py): freed host
# memory is then returned to the system and each CPU step faults its tensors in again.
LLMSERVE_RETAIN_FREED_MEMORY: bool = os.environ.get("LLMSERVE_RETAIN_FREED_MEMORY", "1") != "0"
# Threads of the engine's math (default: the CPUs this process may run on). A Ray replica
# sets it to its share of the node's CPUs (ray_serve/launcher.py).
_threads = os.environ.get("LLMSERVE_NUM_THREADS", "").strip()
LLMSERVE_NUM_THREADS: int | None = int(_threads) if _threads.isdigit() and int(_threads) else None
