"""llmserve's C++ CPU kernels, compiled on first use for the machine they run on.

``cpu_ops()`` returns the compiled module, or ``None`` when they cannot be used (no C++
compiler, or ``LLMSERVE_CPU_KERNELS=0``): callers then take their pure PyTorch path. The
build (``-O3 -march=native``, about a minute) is cached under ``LLMSERVE_CACHE_DIR``, keyed
by the source, the torch version and the CPU's instruction set, so a cache shared between
machines never hands one the other's binary.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from llmserve import envs

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -fopenmp: at::parallel_for runs its loop on ATen's OpenMP threads only in code compiled
# with it; without, every kernel would run on one core. -fvisibility=hidden: only the module's
# entry point is exported (calls between the kernels bind inside the library, not through
# the dynamic linker).
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"]


@functools.cache
def cpu_ops() -> ModuleType | None:
    if not envs.LLMSERVE_CPU_KERNELS:
        return None
    from torch.utils import cpp_extension

    build_dir = Path(envs.LLMSERVE_CACHE_DIR) / "kernels" / _build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            return cpp_extension.load(
                name="llmserve_cpu_ops", sources=[str(s) for s in _SOURCES],
                extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, or a failed build: fall back, loudly
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch fallbacks",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)
        return None


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Processes building the same kernels queue on an flock, which the system releases
    when its holder dies. torch's own lock is a file that a build killed midway (a server
    stopped during its first start) leaves behind, and every later start would wait on it
    forever; under the flock no other build is running, so such a file is stale."""
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _build_key() -> str:
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(_FLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(platform.machine().encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or ""


if os.name == "nt":  # pragma: no cover - the flags above are for gcc/clang
    _FLAGS = ["/O2"]
