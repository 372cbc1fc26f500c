"""The compiled kernels' build cache survives a build killed midway."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.csrc import cpu_ops

ops = cpu_ops()


@pytest.mark.skipif(ops is None, reason="compiled kernels unavailable (no C++ compiler?)")
def test_a_lock_left_by_a_killed_build_does_not_block_the_next_start():
    # torch's build lock is a plain file; a process killed while building leaves it behind
    # and torch then waits for it to disappear, forever.
    build_dir = Path(ops.__file__).parent
    (build_dir / "lock").touch()
    load = "from llmserve.csrc import cpu_ops; assert cpu_ops() is not None"
    subprocess.run([sys.executable, "-c", load], check=True, timeout=300)
    assert not (build_dir / "lock").exists()


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(ops is None, reason="compiled kernels unavailable (no C++ compiler?)")
@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo")
def test_the_kernels_are_built_for_what_the_switch_names():
    """LLMSERVE_CPU_ISA=avx2 builds the AVX2 kernels whatever the CPU has; native builds the
    best this CPU runs: VNNI integer kernels where it has AVX-512 VNNI, AVX2 ones where it
    has AVX2, none (PyTorch's) below."""
    from llmserve import envs

    flags = _cpu_flags()
    if envs.LLMSERVE_CPU_ISA == "avx2":
        assert (ops.isa, ops.int_kernels) == ("avx2", "avx2")
    elif envs.LLMSERVE_CPU_ISA == "baseline":
        assert (ops.isa, ops.int_kernels) == ("baseline", "")
    else:
        wide = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "baseline"
        assert ops.isa == wide
        if {"avx512_vnni", "avx512bw"} <= flags:
            assert ops.int_kernels == "avx512_vnni"
        elif {"avx2", "f16c"} <= flags:
            assert ops.int_kernels == "avx2"


def test_an_unknown_isa_is_refused_with_the_choices():
    env = {**os.environ, "LLMSERVE_CPU_ISA": "sse9"}
    run = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--prompt", "hi"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "LLMSERVE_CPU_ISA must be one of native, avx2, baseline; got 'sse9'" in run.stderr
    assert "Traceback" not in run.stderr
