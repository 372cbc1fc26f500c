"""Two builds of the compiled CPU kernels side by side on paged attention.

Each build runs in its own process, alternating, and each case keeps its fastest time over
every run: two builds cannot be compared inside one process, because CPython hands back the
first extension module loaded under a name, whatever its path.

    python benchmarks/attention_ab.py OLD.so NEW.so [--runs 3] [--iters 20]

A build is the ``llmserve_cpu_ops.so`` under ``$LLMSERVE_CACHE_DIR/kernels/<hash>/`` (one
directory per version of the sources); builds from before the five-dimensional cache layout
(session 16) read another layout and cannot be compared with this script. Cases: one layer
of SmolLM2's attention (9 query and 3 KV heads of 64, blocks of 16 scattered over a pool
twice the size they need) for decodes of equal or ShareGPT-like lengths, decodes beside a
prefill chunk, and prefill alone; float32 and int8 caches.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import time
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HQ, HKV, D, BS = 9, 3, 64, 16


def cases() -> dict[str, tuple[list[int], tuple[int, int] | None, int]]:
    """name -> (decode context lengths, (rows, first position) of a prefill chunk, layers).
    A case of several layers times one call on each layer's own cache, as a decode step
    does: their keys and values together do not fit the caches of the CPU."""
    rng = random.Random(1)
    mixed = [int(rng.lognormvariate(6.0, 0.8)) + 16 for _ in range(64)]
    return {
        "64 decodes x 512": ([512] * 64, None, 1),
        "64 decodes, mixed lengths": (mixed, None, 1),
        "64 decodes x 1030": ([1030] * 64, None, 1),
        "48 decodes + 256-row chunk": (mixed[:48], (256, 1024), 1),
        "prefill 1024": ([], (1024, 0), 1),
        "prefill chunk 2048 at 2048": ([], (2048, 2048), 1),
        "1 decode x 1024, 30 layers": ([1024], None, 30),
        "1 decode x 4096, 30 layers": ([4096], None, 30),
        "4 decodes x 4096, 30 layers": ([4096] * 4, None, 30),
    }


def random_cache(dtype: str, pool: int, gen: torch.Generator, pairs: bool = True):
    """Random keys, values and scales of a pool of blocks in kv_format's layout, keys
    [pool, Hkv, D / P, BS, P] and values [pool, Hkv, BS / P, D, P]: P = 2 for int8 (unless
    ``pairs`` is False: then the kernel's float path), else 1."""
    import torch

    p = 2 if dtype == "int8" and pairs else 1
    key_shape, value_shape = (pool, HKV, D // p, BS, p), (pool, HKV, BS // p, D, p)
    if dtype == "int8":
        key = torch.randint(-127, 128, key_shape, dtype=torch.int8, generator=gen)
        value = torch.randint(-127, 128, value_shape, dtype=torch.int8, generator=gen)
        scales = tuple(torch.rand(pool, HKV, BS, generator=gen) * 0.02 for _ in "kv")
        return key, value, scales
    return torch.randn(key_shape, generator=gen), torch.randn(value_shape, generator=gen), (
        None, None)


def make_args(dtype: str, lens: list[int], chunk: tuple[int, int] | None,
              pairs: bool = True, layers: int = 1) -> list[tuple]:
    """paged_attention's arguments for decodes of context lengths ``lens`` (and a prefill
    chunk), one tuple per layer: blocks scattered over a pool twice the size they need."""
    import torch

    seqs = [(1, n) for n in lens] + ([(chunk[0], chunk[1] + chunk[0])] if chunk else [])
    max_blocks = max(-(-n // BS) for _, n in seqs)
    pool = sum(-(-n // BS) for _, n in seqs) * 2
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(dtype, pool, gen, pairs) for _ in range(layers)]
    perm = torch.randperm(pool, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    starts, positions, used = [0], [], 0
    for i, (rows, n) in enumerate(seqs):
        nb = -(-n // BS)
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
        starts.append(starts[-1] + rows)
        positions += range(n - rows, n)
    q = torch.randn(starts[-1], HQ, D, generator=gen)
    return [(q, key, value, *scales, tables, torch.tensor(starts), torch.tensor(positions),
             D ** -0.5) for key, value, scales in caches]


def best_time(ops, layers: list[tuple], iters: int) -> float:
    """Fastest of ``iters`` passes over the layers (one call each), after one to warm up."""
    for args in layers:
        ops.paged_attention(*args)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        for args in layers:
            ops.paged_attention(*args)
        best = min(best, time.perf_counter() - start)
    return best


def run_build(path: str, iters: int) -> None:
    import llmserve  # noqa: F401  (environment before torch's first use)

    importlib.import_module("torch")  # then torch: the build links against its libraries

    spec = importlib.util.spec_from_file_location("llmserve_cpu_ops", path)
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    for dtype in ("float32", "int8"):
        for name, (lens, chunk, layers) in cases().items():
            best = best_time(ops, make_args(dtype, lens, chunk, layers=layers), iters)
            print(f"{dtype}|{name}|{best * 1e3:.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--runs", type=int, default=3, help="processes per build, alternating")
    p.add_argument("--iters", type=int, default=20, help="calls per case in each process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_build(args.old, args.iters)
        return
    best: dict[tuple[str, str, str], float] = defaultdict(lambda: float("inf"))
    for _ in range(args.runs):
        for build in (args.old, args.new):
            out = subprocess.run([sys.executable, __file__, build, build, "--child",
                                  "--iters", str(args.iters)],
                                 check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                dtype, name, ms = line.split("|")
                key = (build, dtype, name)
                best[key] = min(best[key], float(ms))
    print("| case | KV cache | old ms | new ms | old / new |\n|---|---|---|---|---|")
    for dtype in ("float32", "int8"):
        for name in cases():
            old, new = best[(args.old, dtype, name)], best[(args.new, dtype, name)]
            print(f"| {name} | {dtype} | {old:.3f} | {new:.3f} | {old / new:.2f} |")


if __name__ == "__main__":
    main()
