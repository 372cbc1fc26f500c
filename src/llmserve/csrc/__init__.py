"""llmserve's C++ CPU kernels, compiled on first use for the machine they run on.

``cpu_ops()`` returns the compiled module, or ``None`` when they cannot be used (no C++
compiler, or ``LLMSERVE_CPU_KERNELS=0``): callers then take their pure PyTorch path. The
build (``-O3 -march=native``, about a minute) is cached under ``LLMSERVE_CACHE_DIR``, keyed
by the source, the flags, the torch version and the CPU's instruction set, so a cache shared
between machines never hands one the other's binary.

``LLMSERVE_CPU_ISA`` picks the instruction set the kernels are built for: ``native``, or a
lower level on any newer CPU (``avx2``: no AVX-512 and no VNNI; ``baseline``: no AVX), so
that the portable paths are tested on every host. The module reports what it was built for:
``isa`` ("avx512", "avx2", "baseline") and ``int_kernels`` ("avx512_vnni", "avx2", or "" when
the int8/int4 layers must use PyTorch's kernels).
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
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"]
# LLMSERVE_CPU_ISA -> the compiler's target: x86-64-v3 is AVX2 + FMA + F16C + BMI2 (Haswell,
# Zen 1 and later), x86-64-v2 SSE4.2 and POPCNT.
ISA_FLAGS = {"native": "-march=native", "avx2": "-march=x86-64-v3",
             "baseline": "-march=x86-64-v2"}


@functools.cache
def cpu_ops() -> ModuleType | None:
    if not envs.LLMSERVE_CPU_KERNELS:
        return None
    flags = [*_FLAGS, _isa_flag(envs.LLMSERVE_CPU_ISA)]
    from torch.utils import cpp_extension

    build_dir = Path(envs.LLMSERVE_CACHE_DIR) / "kernels" / _build_key(flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            ops = cpp_extension.load(
                name="llmserve_cpu_ops", sources=[str(s) for s in _SOURCES],
                extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, or a failed build: fall back, loudly
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch fallbacks (dense "
                       "layers then use the BLAS, whose rows may depend on the batch)",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)
        return None
    logger.info("CPU kernels built for %s (LLMSERVE_CPU_ISA=%s); integer kernels: %s",
                ops.isa, envs.LLMSERVE_CPU_ISA, ops.int_kernels or "none (PyTorch's)")
    ops.set_attention_load_ahead(envs.LLMSERVE_ATTENTION_LOAD_AHEAD)
    return ops


def _isa_flag(isa: str) -> str:
    if isa not in ISA_FLAGS:
        raise ValueError(f"LLMSERVE_CPU_ISA must be one of {', '.join(ISA_FLAGS)}; got {isa!r}")
    if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"LLMSERVE_CPU_ISA={isa} names an x86-64 level; this machine is "
                         f"{platform.machine()} (use native)")
    return ISA_FLAGS[isa]


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


def _build_key(flags: list[str]) -> str:
    h = hashlib.sha256()
    # torch's build files name the sources by path: two checkouts sharing one build
    # directory would rebuild each other's kernels on every start.
    h.update(str(_SOURCES[0].parent).encode())
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(flags).encode())
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
