"""The compiled CPU attention kernel at several KV block sizes, alternating in one process.

SmolLM2's attention (9 query and 3 KV heads of 64, int8 cache) for `--batch` decodes of
`--context` to `--context` + 23 tokens (so most sequences end in a partial block), blocks
scattered at random over a pool as large as the default 2 GiB cache holds (per layer), for
30 layers with caches of their own (read from memory, as a decode step reads them) and for
one layer called again and again (warm in the CPU's caches). Printed: the fastest pass of
each block size per round, and each size's time against the first size's.

    .venv/bin/python benchmarks/attention_block_size.py [--sizes 16,32,64,128] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
from attention_ab import best_time

from llmserve.csrc import cpu_ops

HQ, HKV, D, LAYERS = 9, 3, 64, 30
POOL_TOKENS = 10965 * 16  # what the default cache holds for SmolLM2 with an int8 cache


def layer_args(block_size: int, lens: list[int], gen: torch.Generator) -> list[tuple]:
    """paged_attention's arguments for each of LAYERS layers, int8 pairs layout."""
    pool = POOL_TOKENS // block_size
    per_seq = -(-max(lens) // block_size)
    perm = torch.randperm(pool, generator=gen)[:len(lens) * per_seq]
    tables = perm.view(len(lens), per_seq).contiguous()
    starts = torch.arange(len(lens) + 1)
    positions = torch.tensor([n - 1 for n in lens])
    q = torch.randn(len(lens), HQ, D, generator=gen)
    out = []
    for _ in range(LAYERS):
        key = torch.randint(-127, 128, (pool, HKV, D // 2, block_size, 2), dtype=torch.int8,
                            generator=gen)
        value = torch.randint(-127, 128, (pool, HKV, block_size // 2, D, 2), dtype=torch.int8,
                              generator=gen)
        scales = [torch.rand(pool, HKV, block_size, generator=gen) * 0.02 for _ in "kv"]
        out.append((q, key, value, *scales, tables, starts, positions, D ** -0.5, 0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,32,64,128")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=8)
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("needs the compiled CPU kernels")
    gen = torch.Generator().manual_seed(0)
    lens = [args.context + (i * 7) % 24 for i in range(args.batch)]
    sizes = [int(s) for s in args.sizes.split(",")]
    calls = {bs: layer_args(bs, lens, gen) for bs in sizes}
    print(f"{args.batch} decodes of {args.context}-{args.context + 23} tokens, int8 cache; "
          f"ms: {LAYERS} layers from memory / one layer warm")
    print("| round | " + " | ".join(f"blocks of {bs}" for bs in sizes) + " | against the first |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for r in range(args.rounds):
        cold, warm = {}, {}
        for bs in (sizes if r % 2 == 0 else sizes[::-1]):
            cold[bs] = best_time(ops, calls[bs], args.passes) * 1e3
            warm[bs] = best_time(ops, calls[bs][:1], args.passes * 4) * 1e3
        cells = " | ".join(f"{cold[bs]:.2f} / {warm[bs]:.3f}" for bs in sizes)
        ratios = ", ".join(f"{cold[bs] / cold[sizes[0]]:.2f} / {warm[bs] / warm[sizes[0]]:.2f}"
                           for bs in sizes[1:])
        print(f"| {r + 1} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
