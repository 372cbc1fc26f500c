"""One stream's decode step at growing contexts (the default model on CPU): how much of a
step attention takes as the context grows.

For each context length L: `--batch` requests (one by default) of L random prompt tokens,
40 greedy tokens each; the decode steps after the prefill are timed. `--repeats` rounds.

    .venv/bin/python benchmarks/long_context_decode.py --contexts 256,2048,4096,7000
    .venv/bin/python benchmarks/long_context_decode.py --batch 64 --contexts 512,1024
"""

from __future__ import annotations

import argparse
import random
import time

from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmserve.engine.core import EngineCore
from llmserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="256,2048,4096,7000")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    core = EngineCore(EngineConfig(
        model=ModelConfig(args.model, "cpu", max_model_len=8192),
        cache=CacheConfig(kv_cache_memory_gib=2.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max(256, args.batch))))
    rng = random.Random(0)
    for rep in range(args.repeats):
        for length in (int(c) for c in args.contexts.split(",")):
            for i in range(args.batch):
                core.add_request(f"r{length}-{rep}-{i}",
                                 [rng.randrange(17, 49000) for _ in range(length)],
                                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            # Prefill (and the step after its last chunk), then time pure decode steps.
            while any(r.num_computed_tokens < r.num_prompt_tokens
                      for r in core.scheduler.running + list(core.scheduler.waiting)):
                core.step()
            core.step()
            start, steps = time.perf_counter(), 0
            while core.has_unfinished():
                core.step()
                steps += 1
            ms = 1e3 * (time.perf_counter() - start) / steps
            print(f"{args.batch} x context {length}: {ms:.2f} ms per decode step", flush=True)


if __name__ == "__main__":
    main()
