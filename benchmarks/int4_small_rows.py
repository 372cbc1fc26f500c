"""The int4 kernel at 1 and 4 rows on the default model's projection shapes, each layer's
weights in 30 copies so that they come from memory as in a decode step: microseconds per
call (best of 15 passes over the copies). Run it against a baseline build in alternation:

    .venv/bin/python benchmarks/int4_small_rows.py
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/int4_small_rows.py
"""

from __future__ import annotations

import time

import torch

from llmserve.csrc import cpu_ops
from llmserve.layers.quantization.int4 import pack_vnni, quantize_groups

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


def main() -> None:
    torch.set_num_threads(2)
    ops = cpu_ops()
    for name, n, k in SHAPES:
        b = quantize_groups(torch.randn(n, k) * 0.05, 32)
        packed, scale_zero = pack_vnni(b.q, b.scale.half(), b.zero.half())
        copies = [(packed.clone(), scale_zero.clone()) for _ in range(30)]
        for m in (1, 4):
            x = torch.randn(m, k)

            def run(x=x, n=n, copies=copies) -> None:
                for p, s in copies:
                    ops.int4_linear(x, p, s, 32, n)

            for _ in range(3):
                run()
            best = float("inf")
            for _ in range(15):
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            print(f"{name:8s} m={m}: {best / len(copies) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
