"""The sampler's time for a batch of sampled rows (temperature 0.8, SmolLM2's 49152-token
vocabulary), on CPU: one call of ``Sampler`` on ``[rows, vocab]`` float32 logits, best of
``--repeats``. Run it in two trees, alternating, to compare them (``PYTHONPATH=<tree>/src``);
a tree whose rows carry a ``torch.Generator`` (before the batched race) gets one per row,
seeded as the runner seeded them.

    python benchmarks/sampler_speed.py --rows 1,8,64,256
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()

    from llmserve.runner.model_runner import token_seed
    from llmserve.sample.sampler import Sampler, SamplingRow
    from llmserve.sampling_params import SamplingParams

    keyed = "seed" in SamplingRow.__dataclass_fields__
    params = SamplingParams(temperature=0.8, top_p=args.top_p)
    sampler = Sampler()

    def rows(n: int, step: int) -> list:
        def key(i: int):
            seed = token_seed(1234 + i, step)
            return seed if keyed else torch.Generator().manual_seed(seed)
        return [SamplingRow(params, key(i), [], [], frozenset()) for i in range(n)]

    gen = torch.Generator().manual_seed(0)
    for n in map(int, args.rows.split(",")):
        logits = torch.randn(n, args.vocab, generator=gen) * 3
        sampler(logits, rows(n, 0))
        best = float("inf")
        for step in range(1, args.repeats + 1):
            batch = rows(n, step)  # the runner builds them each step too
            start = time.perf_counter()
            sampler(logits, batch)
            best = min(best, time.perf_counter() - start)
        print(f"rows {n}: {best * 1e3:.2f} ms ({best / n * 1e6:.0f} us a row); "
              f"{'batched race' if keyed else 'a generator per row'}", flush=True)


if __name__ == "__main__":
    main()
