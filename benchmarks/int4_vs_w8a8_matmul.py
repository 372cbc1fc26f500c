"""The compiled int4 and w8a8 matrix products alone, on SmolLM2-135M's four projection
shapes (qkv, o, gate/up, down) x 30 layers, random weights, at 1, 8 and 64 rows (--rows):
the part of a decode step where the two formats differ. Both kernels alternate in one
process; each figure is the median of --repeats passes (weights warm in cache; with
--cold, 30 distinct copies, read from memory as in a decode step). With --head, each
format's output head too (49152 x 576: int4's is int8 with two activation levels a row,
w8a8's one level per 64 inputs), timed the same way.

    .venv/bin/python benchmarks/int4_vs_w8a8_matmul.py [--repeats 7] [--rows 1,5,8,64] [--head]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from int_kernels_ab import SHAPES, layer_calls
from linear_formats import layer

from llmserve.csrc import cpu_ops
from llmserve.layers.quantization import WeightFormat

LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,8,64", help="comma-separated row counts")
    p.add_argument("--cold", action="store_true",
                   help="30 distinct copies of the weights (read from memory, as in a step)")
    p.add_argument("--head", action="store_true", help="time each format's output head too")
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.int_kernels:
        raise SystemExit("needs the compiled integer kernels (AVX-512 VNNI or AVX2)")
    gen = torch.Generator().manual_seed(0)
    built = layer_calls(SHAPES * (LAYERS if args.cold else 1), gen)
    calls = {fmt: [(k, lambda x, f=f: f(ops, x)) for k, f in built[fmt]]
             for fmt in ("int4", "w8a8")}
    head = torch.randn(49152, 576, generator=gen) * 0.05
    heads = {"int4": layer(WeightFormat("int8"), head, True),  # int4's head is int8
             "w8a8": layer(WeightFormat("w8a8"), head, True)} if args.head else {}
    print("| rows | int4 ms (30 layers) | w8a8 ms | int4 / w8a8 |"
          + (" int4's head ms | w8a8's head ms | ratio |" if heads else "")
          + "\n|---|---|---|---|" + ("---|---|---|" if heads else ""))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        times: dict[str, list[float]] = {"int4": [], "w8a8": []}
        head_times: dict[str, list[float]] = {"int4": [], "w8a8": []}
        for _ in range(args.repeats):
            for fmt, fmt_calls in calls.items():
                start = time.perf_counter()
                for _ in range(1 if args.cold else LAYERS):
                    for k, call in fmt_calls:
                        call(xs[k])
                times[fmt].append((time.perf_counter() - start) * 1e3)
                if heads:
                    start = time.perf_counter()
                    heads[fmt](xs[576])
                    head_times[fmt].append((time.perf_counter() - start) * 1e3)
        t4, t8 = statistics.median(times["int4"]), statistics.median(times["w8a8"])
        line = f"| {m} | {t4:.2f} | {t8:.2f} | {t4 / t8:.2f} |"
        if heads:
            h4, h8 = statistics.median(head_times["int4"]), statistics.median(head_times["w8a8"])
            line += f" {h4:.2f} | {h8:.2f} | {h4 / h8:.2f} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
