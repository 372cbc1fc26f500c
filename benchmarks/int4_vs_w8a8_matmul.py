"""The compiled int4 and w8a8 matrix products alone, on SmolLM2-135M's four projection
shapes (qkv, o, gate/up, down) x 30 layers, random weights, at 1, 8 and 64 rows (--rows):
the part of a decode step where the two formats differ. Both kernels alternate in one
process; each figure is the median of --repeats passes (weights warm in cache; with
--cold, 30 distinct copies, read from memory as in a decode step).

    .venv/bin/python benchmarks/int4_vs_w8a8_matmul.py [--repeats 7] [--rows 1,5,8,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmserve.csrc import cpu_ops
from llmserve.layers.quantization.int4 import pack_vnni as pack_int4
from llmserve.layers.quantization.int4 import quantize_groups
from llmserve.layers.quantization.int8 import pack_vnni as pack_int8
from llmserve.layers.quantization.int8 import quantize_rows
from llmserve.layers.quantization.w8a8 import BODY_GROUP, activation_group

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate/up, down
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,8,64", help="comma-separated row counts")
    p.add_argument("--cold", action="store_true",
                   help="30 distinct copies of the weights (read from memory, as in a step)")
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.int_kernels:
        raise SystemExit("needs the compiled integer kernels (AVX-512 VNNI or AVX2)")
    gen = torch.Generator().manual_seed(0)
    calls = {"int4": [], "w8a8": []}
    for n, k in SHAPES * (LAYERS if args.cold else 1):
        w = torch.randn(n, k, generator=gen) * 0.05
        b = quantize_groups(w, 32)
        packed, scale_zero = pack_int4(b.q, b.scale.half(), b.zero.half())
        calls["int4"].append((k, lambda x, a=(packed, scale_zero, 32, n): ops.int4_linear(x, *a)))
        q, w_scale = quantize_rows(w)
        group = activation_group(k, BODY_GROUP)
        packed8, excess = pack_int8(q.t().contiguous(), group)
        padded = torch.zeros(excess.shape[1])
        padded[:n] = w_scale
        calls["w8a8"].append((k, lambda x, a=(packed8, excess, padded, n, 1, group):
                              ops.int8_linear(x, *a)))
    print("| rows | int4 ms (30 layers) | w8a8 ms | int4 / w8a8 |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        times: dict[str, list[float]] = {"int4": [], "w8a8": []}
        for _ in range(args.repeats):
            for fmt, layer_calls in calls.items():
                start = time.perf_counter()
                for _ in range(1 if args.cold else LAYERS):
                    for k, call in layer_calls:
                        call(xs[k])
                times[fmt].append((time.perf_counter() - start) * 1e3)
        t4, t8 = statistics.median(times["int4"]), statistics.median(times["w8a8"])
        print(f"| {m} | {t4:.2f} | {t8:.2f} | {t4 / t8:.2f} |")


if __name__ == "__main__":
    main()
