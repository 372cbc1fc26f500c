"""Each weight format's linear layer at SmolLM2-135M's shapes: the compiled kernel this build
runs beside the PyTorch path the same layer takes without it, at 1, 8 and 64 rows.

The PyTorch paths are what a CPU without the compiled integer kernels runs: ``torch._int_mm``
for int8 and w8a8 (and int4's int8 output head), ``aten._weight_int4pack_mm_for_cpu`` for
int4, ``F.linear`` (MKL) for dense float32. On a CPU without AVX-512 VNNI those were the only
paths before the AVX2 kernels; ``torch._int_mm`` is a scalar loop there. Each side is timed
as the best of --repeats, alternating, in this process.

    .venv/bin/python benchmarks/linear_formats.py [--rows 1,8,64] [--formats int8,w8a8,int4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import llmserve  # noqa: F401
from llmserve.csrc import cpu_ops
from llmserve.layers.linear import Linear
from llmserve.layers.quantization import WeightFormat, dense, int4, int8

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}


def best_ms(fn: Callable[[], object], repeats: int, budget: float) -> float:
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > budget:  # a scalar fallback at 64 rows: a few seconds a call
            break
    return best * 1e3


def layer(fmt: WeightFormat, weight: torch.Tensor, compiled: bool) -> Linear:
    n, k = weight.shape
    out = Linear(k, n, fmt=fmt)
    out.load_shard("weight", weight)
    if compiled:
        out.finalize()
        return out
    saved = (int8.int_kernel_ops, int4.int_kernel_ops, dense.cpu_ops)
    int8.int_kernel_ops = int4.int_kernel_ops = lambda device: None
    dense.cpu_ops = lambda: None
    try:
        out.finalize()
    finally:
        int8.int_kernel_ops, int4.int_kernel_ops, dense.cpu_ops = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--formats", default="int8,w8a8,int4,none")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per side and case")
    args = ap.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the compiled kernels are unavailable")
    print(f"# kernels built for {ops.isa}, integer kernels: {ops.int_kernels or 'none'}; "
          f"{torch.get_num_threads()} threads")
    print("| format | layer | rows | compiled ms | PyTorch path ms | speedup |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            fmt = WeightFormat(name)
            if shape == "lm_head" and name == "int4":
                fmt = WeightFormat("int8")  # int4's head is int8
            w = torch.randn(n, k, generator=gen) * 0.05
            ours, theirs = layer(fmt, w, True), layer(fmt, w, False)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                a = best_ms(lambda x=x, f=ours: f(x), args.repeats, args.budget)
                b = best_ms(lambda x=x, f=theirs: f(x), args.repeats, args.budget)
                label = name if fmt.quantization == name else f"{name} ({fmt.quantization} head)"
                print(f"| {label} | {shape} {n}x{k} | {m} | {a:.3f} | {b:.3f} | {b / a:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
