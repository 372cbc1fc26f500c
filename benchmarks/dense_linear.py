"""The batch-invariant dense kernel (csrc/dense_linear.cpp) beside PyTorch's F.linear (MKL
sgemm), on SmolLM2-135M's linear shapes, float32 and bfloat16 weights, at 1, 8, 64 and 512
rows.

Both run in this process, alternating, each timed as the minimum over repeats; the ratio is
kernel time / F.linear time (below 1: the kernel is faster). For bfloat16 the baseline is
what llmserve ran before the kernel: the weight widened into a float32 scratch buffer, then
F.linear.

    cd benchmarks && ../.venv/bin/python dense_linear.py [--rows 1,8,64,512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch
import torch.nn.functional as F

import llmserve  # noqa: F401  (MKL's reproducibility mode, as the server runs it)
from llmserve.csrc import cpu_ops
from llmserve.layers.quantization.dense import pack_panels

SHAPES = {  # name: (out, in) of SmolLM2-135M
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def best_time(fn, repeats: int, min_seconds: float = 0.05) -> float:
    fn()
    calls = 1
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    calls = max(1, int(min_seconds / max(one, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the compiled kernels are unavailable (LLMSERVE_CPU_KERNELS=0?)")
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| weights | shape (out x in) | rows | F.linear ms | kernel ms | ratio |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            packed = pack_panels(w)
            scratch = torch.empty(n, k)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                if dtype == torch.float32:
                    def baseline(x=x, w=w):
                        return F.linear(x, w)
                else:
                    def baseline(x=x, w=w, scratch=scratch):
                        return F.linear(x, scratch.copy_(w))

                def kernel(x=x, packed=packed, n=n):
                    return ops.dense_linear(x, packed, n)

                base_t = kern_t = float("inf")
                for _ in range(2):  # alternate, so that both see the same minutes
                    base_t = min(base_t, best_time(baseline, args.repeats))
                    kern_t = min(kern_t, best_time(kernel, args.repeats))
                ratios.append(kern_t / base_t)
                print(f"| {dtype_name} | {name} {n}x{k} | {m} | {base_t * 1e3:.3f} | "
                      f"{kern_t * 1e3:.3f} | {kern_t / base_t:.2f} |", flush=True)
    print(f"\nworst ratio {max(ratios):.2f}, best {min(ratios):.2f}")


if __name__ == "__main__":
    main()
