"""Where the block pool puts a decoding sequence's new blocks, measured on the engine's
decode steps: the pool as it is (a sequence grows into the block after its last one where
that is free and uncached, and a new run of blocks leaves the free uncached blocks after it
for that) against the pool before it (each call's blocks from the head of the free queue,
in increasing order), the two alternating wave by wave in one process on the default
model.

A wave: `--batch` requests of `--prompt` random tokens, greedy, `--output` tokens each (EOS
ignored), run to the end. Printed per policy: the median decode step over the wave's last
half (the longest contexts), the wave's decode time, and how often a request's block table
jumps late in the wave. Then the attention kernel alone on each policy's last tables, the
two alternating (low noise: the engine's steps vary more than the difference). `--fresh`
gives each wave a fresh pool (a server's first requests); without it the pool cycles, as a
busy server's does, and each timed wave follows an untimed one of the same policy (what
one policy leaves in the free queue takes a wave to wear off).

    .venv/bin/python benchmarks/block_order_engine.py [--fresh] [--num-blocks N]
        [--batch 64 --prompt 256 --output 512]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.kv_cache import BlockPool
from llmserve.kv_cache.block_pool import KVBlock

BLOCK = 32  # the CPU's default block size, which the kernel timing assumes


class SwitchedPool(BlockPool):
    """The pool, with the placement switched off (``plain``): each call's blocks from the
    head of the free queue in increasing order, as before (session 42)."""

    plain = False

    def get_new_blocks(self, n: int, after: int | None = None, room: int = 0) -> list[KVBlock]:
        return super().get_new_blocks(n) if self.plain else super().get_new_blocks(n, after, room)


def wave(core, tag: str, batch: int, prompt: int, output: int,
         seed: int) -> tuple[list[float], list[tuple[int, list[int]]]]:
    """Run one wave: the decode steps' times in ms, in order, and the requests' context
    lengths and block tables three quarters into the decode."""
    rng = random.Random(seed)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        core.add_request(rid, [rng.randrange(100, 49000) for _ in range(prompt)],
                         SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
    sched = core.scheduler
    while sched.waiting or any(r.num_computed_tokens < prompt for r in sched.running):
        core.step()
    times: list[float] = []
    tables: list[tuple[int, list[int]]] = []
    while sched.running or sched.waiting:
        if len(times) == output * 3 // 4:
            tables = [(r.num_computed_tokens, sched.kv.get_block_ids(r.request_id)[0])
                      for r in sched.running]
        start = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times, tables


def jumps(tables: list[tuple[int, list[int]]]) -> float:
    """Mean number of places where a table's next block is not the one after."""
    return statistics.mean(sum(b != a + 1 for a, b in itertools.pairwise(t))
                           for _, t in tables)


def kernel_on_tables(tables: dict[str, list[tuple[int, list[int]]]], rounds: int) -> None:
    """The attention kernel alone, 30 layers from memory, on each policy's block tables as
    the engine left them (the same cache contents, queries and context lengths: the
    shorter of the two policies' requests, ranked by length): ms, alternating."""
    from attention_ab import best_time
    from attention_block_size import layer_args

    from llmserve.csrc import cpu_ops

    ops = cpu_ops()
    if ops is None:
        print("(no compiled kernels: the kernel on the tables is not timed)")
        return
    ranked = {name: sorted(t, key=lambda entry: entry[0]) for name, t in tables.items()}
    n = min(len(t) for t in ranked.values())
    lens = [min(t[i][0] for t in ranked.values()) for i in range(n)]
    width = max(len(row) for t in ranked.values() for _, row in t)
    calls = layer_args(BLOCK, lens, torch.Generator().manual_seed(0))
    by_policy = {}
    for name, t in ranked.items():
        table = torch.tensor([row + [0] * (width - len(row)) for _, row in t[:n]])
        by_policy[name] = [(*c[:5], table, *c[6:]) for c in calls]
    best = {name: float("inf") for name in tables}
    for r in range(rounds):
        for name in (list(tables) if r % 2 == 0 else list(tables)[::-1]):
            best[name] = min(best[name], best_time(ops, by_policy[name], 8) * 1e3)
    (b_name, before), (a_name, after) = best.items()
    print(f"kernel alone on the tables ({n} decodes of {lens[0]}-{lens[-1]} tokens, 30 layers): "
          f"{a_name} {after:.2f} ms against {b_name} {before:.2f} ({after / before:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=512)
    p.add_argument("--waves", type=int, default=6, help="waves per policy")
    p.add_argument("--fresh", action="store_true", help="a fresh pool for every wave")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="the pool's size (default: the default cache's)")
    args = p.parse_args()
    llm = LLM("smollm2-135m-instruct", num_kv_blocks=args.num_blocks)
    core = llm.engine
    kv = core.scheduler.kv
    num_blocks, caching = kv.pool.num_blocks, kv.pool.enable_caching
    kv.pool = SwitchedPool(num_blocks, caching)
    print(f"{args.batch} requests x {args.prompt} prompt tokens + {args.output} output, "
          f"{num_blocks} blocks of {kv.block_size}, {'fresh' if args.fresh else 'cycling'} pool")
    print("| wave | policy | jumps a table | median step, last half (ms) | decode time (s) |\n"
          "|---|---|---|---|---|")
    results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    last_tables: dict[str, list[list[int]]] = {}
    wave(core, "warm", args.batch, args.prompt, 32, 0)
    for w in range(2 * args.waves):
        policy = ("before", "after")[(w + w // 2) % 2]  # before, after, after, before, ...
        if args.fresh:
            kv.pool = SwitchedPool(num_blocks, caching)
        kv.pool.plain = policy == "before"
        if not args.fresh:  # a wave to leave the pool as the policy leaves it, not timed
            wave(core, f"s{w}", args.batch, args.prompt, args.output, 500 + w)
        times, tables = wave(core, f"w{w}", args.batch, args.prompt, args.output, 1000 + w)
        last_tables[policy] = tables
        half = statistics.median(times[len(times) // 2:])
        results[policy].append((half, sum(times) / 1e3))
        print(f"| {w} | {policy} | {jumps(tables):.1f} | {half:.1f} | "
              f"{sum(times) / 1e3:.2f} |", flush=True)
    (b_step, b_total), (a_step, a_total) = (
        (min(s for s, _ in results[k]), min(t for _, t in results[k]))
        for k in ("before", "after"))
    print(f"\nbest of each: median step {a_step:.1f} against {b_step:.1f} ms "
          f"({a_step / b_step:.3f}); decode {a_total:.2f} against {b_total:.2f} s "
          f"({a_total / b_total:.3f})")
    del llm, core
    kernel_on_tables(last_tables, 6)


if __name__ == "__main__":
    main()
