"""Paged attention's decode items reading their blocks before they compute
(`set_attention_load_ahead`, csrc/paged_attention.cpp) against software prefetches alone,
alternating in one process. The same results either way; only the time differs.

Kernel alone: SmolLM2's attention (9 query and 3 KV heads of 64, int8 cache, blocks of 32),
`batch` decodes of `context` to `context` + 23 tokens over 30 layers with caches of their own
(read from memory, as a decode step reads them), the blocks of each sequence laid out four
ways in a pool the size of the default cache: at random; in pool order (one sequence's blocks
one after another, as a fresh server's prefill allocates them); in decreasing pool order (a
finished sequence's blocks as its successor took them before the block pool sorted them);
the first 8 in order and the rest at random (a fresh server's pattern after decoding past
256 tokens). Printed: each
setting's fastest pass over the 30 layers, and on / off.

With `--engine`: the default model's decode steps (`batch` requests of `context` random
tokens, prefilled, then decoding), the setting alternating every two steps of the same
requests; the median step of each and on / off.

    .venv/bin/python benchmarks/attention_load_ahead.py [--engine]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from attention_ab import best_time
from attention_block_size import POOL_TOKENS, layer_args

from llmserve.csrc import cpu_ops

BLOCK = 32
POINTS = ((64, 256), (64, 1024), (4, 4096), (1, 4096))


def layouts(calls: list[tuple], gen: torch.Generator) -> dict[str, list[tuple]]:
    """The layers' arguments with their block tables laid out each way."""
    random_tables = calls[0][5]
    n, per_seq = random_tables.shape
    pool = POOL_TOKENS // BLOCK
    ordered = torch.arange(n * per_seq).view(n, per_seq)
    mixed = ordered.clone()
    if per_seq > 8:
        rest = torch.randperm(pool - n * per_seq, generator=gen)[:n * (per_seq - 8)]
        mixed[:, 8:] = rest.view(n, -1) + n * per_seq
    tables = {"at random": random_tables, "in pool order": ordered,
              "in decreasing pool order": ordered.flip(1).contiguous(),
              "first 8 in order, then at random": mixed}
    return {name: [(*c[:5], t, *c[6:]) for c in calls] for name, t in tables.items()}


def kernel(ops, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print("| decodes x tokens | blocks | off ms (30 layers) | on ms | on / off |")
    print("|---|---|---|---|---|")
    for batch, context in POINTS:
        lens = [context + (i * 7) % 24 for i in range(batch)]
        for name, calls in layouts(layer_args(BLOCK, lens, gen), gen).items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    ops.set_attention_load_ahead(on)
                    times[on].append(best_time(ops, calls, 8) * 1e3)
            off, on = min(times[False]), min(times[True])
            print(f"| {batch} x {context} | {name} | {off:.2f} | {on:.2f} | {on / off:.3f} |",
                  flush=True)
    ops.set_attention_load_ahead(True)


def engine(ops, steps: int) -> None:
    from llmserve import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct")
    core = llm.engine
    print("| decodes x tokens | step off ms | step on ms | on / off |\n|---|---|---|---|")
    for batch, context in POINTS[:3]:
        rng = random.Random(batch * context)
        ids = [f"load-ahead-{batch}-{context}-{i}" for i in range(batch)]
        for rid in ids:
            core.add_request(rid, [rng.randrange(100, 49000) for _ in range(context)],
                             SamplingParams(temperature=0, max_tokens=steps + 8,
                                            ignore_eos=True))
        while core.scheduler.waiting or any(r.num_computed_tokens < context
                                            for r in core.scheduler.running):
            core.step()  # prefill
        core.step()
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(steps):
            on = (i // 2) % 2 == 1
            ops.set_attention_load_ahead(on)
            start = time.perf_counter()
            core.step()
            times[on].append((time.perf_counter() - start) * 1e3)
        for rid in ids:
            core.abort(rid)
        core.step()
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} x {context} | {off:.1f} | {on:.1f} | {on / off:.3f} |", flush=True)
    ops.set_attention_load_ahead(True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="store_true", help="the engine's decode steps instead")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("needs the compiled CPU kernels")
    if args.engine:
        engine(ops, args.steps)
    else:
        kernel(ops, args.rounds)


if __name__ == "__main__":
    main()
