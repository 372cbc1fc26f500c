"""Offline engine benchmark: continuous batching vs the static baseline.

Kept as a script for BENCHMARKS.md; the same code runs as ``llmserve bench offline``.

    python benchmarks/bench_engine.py --num-requests 200 --output results.json
"""

from __future__ import annotations

import sys

from llmserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "offline", *sys.argv[1:]]))
