"""The engine's Triton kernels compile for a Hopper GPU (sm_90) on this machine, GPU or not:
Triton ships its own ptxas. The interpreter runs the kernels' arithmetic (the other Triton
tests); this catches what only the GPU compiler sees (a construct it rejects, loads that
no longer pipeline, programmatic dependent launch's instructions missing) before a lent
GPU's time is spent on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(),
                                reason=f"Triton's NVIDIA backend has no ptxas at {PTXAS}")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_compile.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_every_kernel_compiles_for_sm90(compiled):
    names = {r["kernel"] for r in compiled}
    assert names == {"_linear_kernel", "_sum_splits_kernel", "_rms_norm_kernel",
                     "_rotary_kernel", "_silu_and_mul_kernel", "_store_kv_kernel",
                     "paged_attention_kernel", "combine_segments_kernel"}
    failed = [r for r in compiled if "error" in r]
    assert not failed, json.dumps(failed, indent=1)


def test_products_pipeline_their_loads_onto_the_tensor_cores(compiled):
    """Each linear configuration copies its tiles asynchronously (cp.async: the loads of the
    next tiles overlap the products) and multiplies with wgmma. The attention's key loop
    does too when its loads are left to Triton's pipeliner; with PREFETCH it loads the next
    tile into registers before it multiplies the current one."""
    for r in compiled:
        if r["kernel"] == "_linear_kernel" or (r["kernel"] == "paged_attention_kernel"
                                               and not r["PREFETCH"]):
            assert r["cp_async"] > 0 and r["wgmma"] > 0, r
        if r["kernel"] == "paged_attention_kernel" and r["PREFETCH"]:
            assert r["loop_loads_first"] and r["wgmma"] > 0, r
        if r["kernel"] == "_linear_kernel":  # 32 KiB: one stage of 64 x 128 + 128 x 64 tiles
            assert r["shared"] > 32 * 1024, r


def test_programmatic_dependent_launch_waits_before_touching_memory(compiled):
    """Launched with PDL, every kernel waits for the one before it (once), and reads or
    writes global memory only after that; without PDL, no wait."""
    for r in compiled:
        assert r["griddepcontrol_wait"] == (1 if r["PDL"] else 0), r
        if r["PDL"]:
            assert r["waits_before_memory"], r
