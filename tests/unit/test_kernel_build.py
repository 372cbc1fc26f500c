"""The compiled kernels' build cache survives a build killed midway."""

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
