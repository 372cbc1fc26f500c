"""Keep freed host memory in the process, so that a step's tensors do not page-fault.

glibc hands out large blocks with mmap and gives them back with munmap (or trims the heap)
when they are freed; every step of a CPU forward pass allocates its activations, logits
and kernel scratch anew, so each step faulted its pages in again and the kernel zeroed
them. At batch 64 on SmolLM2 that was ~137,000 page faults a second, about a tenth of the
CPU time (`perf record`: exc_page_fault, clear_page_erms). Raising glibc's mmap and trim
thresholds keeps freed blocks for the next step, as tcmalloc or jemalloc would (what
PyTorch's CPU performance guides suggest preloading); with them the same decode faulted
~50 times a second. Tensors above MMAP_THRESHOLD (a large prefill's activations: 8192
tokens x 3072 float32 is 100 MB) are still mapped and unmapped each step. The price is
that memory freed by a step stays resident: after bench_cpu's batch-64 run (w8a8, int8
KV, 1 GiB pool; a 8192-token prefill step first) the process held 1858 MiB against 1484
without (peak 1920 against 1853). LLMSERVE_RETAIN_FREED_MEMORY=0 trades the faults back
for that memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from llmserve import envs
from llmserve.logger import get_logger

logger = get_logger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # blocks below this come from the heap (glibc: 128 KiB to 32 MiB)
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap's top before it is returned


def retain_freed_memory() -> bool:
    """Set glibc's thresholds (once per process; idempotent). Returns whether they were
    set: False where the C library is not glibc or LLMSERVE_RETAIN_FREED_MEMORY=0."""
    if not envs.LLMSERVE_RETAIN_FREED_MEMORY:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc (musl, macOS): nothing to set
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the mmap/trim thresholds; each step's tensors "
                       "will page-fault")
    return ok
