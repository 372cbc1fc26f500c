"""retain_freed_memory: freed host blocks are reused instead of faulted in again."""

import os
import subprocess
import sys

import pytest

# A fresh process per case (mallopt is process-wide). Blocks of 40 MiB: above the largest
# threshold glibc ever picks by itself (32 MiB), so without the setting every one of them
# is mmapped, faulted in page by page, and unmapped when freed.
PROBE = """
import resource, torch
from llmserve.host_memory import retain_freed_memory
print(retain_freed_memory())
def churn():
    for _ in range(10):
        torch.empty(10 << 20).fill_(1.0)  # 40 MiB, every page written
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_of_ten_blocks(retain: str) -> tuple[str, int]:
    env = {**os.environ, "LLMSERVE_RETAIN_FREED_MEMORY": retain}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_blocks_are_reused_not_faulted_again():
    pages = 10 * (40 << 20) // 4096
    applied, faults = faults_of_ten_blocks("1")
    assert applied == "True"
    assert faults < pages // 10, f"{faults} page faults for ten reused 40 MiB blocks"
    applied, faults = faults_of_ten_blocks("0")  # the control: glibc's defaults
    assert applied == "False"
    assert faults > pages // 2, f"only {faults} faults without the setting: the probe tests nothing"
