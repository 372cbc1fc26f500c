"""Offline engine throughput: continuous batching against the static-batching baseline.

Runs the same ShareGPT-like synthetic workload (long-tailed prompt and output lengths,
random token ids, a fixed seed, output lengths held with ignore_eos) through the engine in
both scheduling modes, in one process, and prints:

- output tokens/s and requests/s of each mode, and their ratio;
- peak KV memory utilization with paged blocks (KV tokens stored / token slots of the
  blocks in use), beside what reserving each request's maximum length would give.

    python benchmarks/bench_engine.py --num-requests 200
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass

from llmserve import LLM, SamplingParams


@dataclass
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]
    prompts: list[list[int]]
    description: str


def sharegpt_like(n: int, seed: int, vocab: int = 49152) -> Workload:
    """Lognormal lengths, as in ShareGPT traces: many short turns, a long tail."""
    rng = random.Random(seed)
    p_mu, p_sigma, p_min, p_max = math.log(160), 0.9, 8, 1024
    o_mu, o_sigma, o_min, o_max = math.log(48), 0.9, 4, 400
    prompt_lens = [min(p_max, max(p_min, int(rng.lognormvariate(p_mu, p_sigma))))
                   for _ in range(n)]
    output_lens = [min(o_max, max(o_min, int(rng.lognormvariate(o_mu, o_sigma))))
                   for _ in range(n)]
    prompts = [[rng.randrange(17, vocab) for _ in range(k)] for k in prompt_lens]
    desc = (f"{n} requests; prompt tokens ~ lognormal(median {math.exp(p_mu):.0f}, sigma "
            f"{p_sigma}) clipped to [{p_min}, {p_max}]; output tokens ~ lognormal(median "
            f"{math.exp(o_mu):.0f}, sigma {o_sigma}) clipped to [{o_min}, {o_max}]; seed {seed}")
    return Workload(prompt_lens, output_lens, prompts, desc)


@dataclass
class RunResult:
    mode: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    steps: int
    peak_kv_blocks_used: int
    paged_utilization_at_peak: float
    reserved_utilization_at_peak: float


def run(args: argparse.Namespace, wl: Workload, mode: str) -> RunResult:
    """Drive a fresh engine step by step, sampling KV occupancy after every step."""
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              scheduling=mode)
    # A short warm-up so that no mode pays for first-call allocations.
    llm.generate([wl.prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4))
    engine = llm.engine
    block_size = engine.kv_manager.block_size
    for i, (prompt, out_len) in enumerate(zip(wl.prompts, wl.output_lens)):
        engine.add_request(f"{mode}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps, output_tokens = 0, 0
    peak = (0, 0.0, 0.0)
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        output_tokens += sum(len(o.new_token_ids) for o in outs)
        running = engine.scheduler.running
        used = engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks
        if used > peak[0]:
            stored = sum(r.num_computed_tokens for r in running)
            reserved = sum(r.num_prompt_tokens + r.max_tokens for r in running)
            peak = (used, stored / (used * block_size), stored / max(reserved, 1))
    seconds = time.perf_counter() - start
    engine.kv_manager.check_integrity()
    return RunResult(mode, seconds, output_tokens, sum(wl.prompt_lens),
                     output_tokens / seconds, len(wl.prompts) / seconds, steps,
                     peak[0], peak[1], peak[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    wl = sharegpt_like(args.num_requests, args.seed)
    print("workload:", wl.description)
    print(f"  total prompt tokens {sum(wl.prompt_lens)}, total output tokens "
          f"{sum(wl.output_lens)}")
    results = [run(args, wl, "continuous"), run(args, wl, "static")]
    cont, static = results
    print(f"\n{'mode':<12}{'seconds':>9}{'out tok/s':>11}{'req/s':>8}{'steps':>7}"
          f"{'peak blocks':>13}{'paged util':>12}{'reserve util':>14}")
    for r in results:
        print(f"{r.mode:<12}{r.seconds:>9.1f}{r.output_tokens_per_s:>11.1f}"
              f"{r.requests_per_s:>8.2f}{r.steps:>7}{r.peak_kv_blocks_used:>13}"
              f"{r.paged_utilization_at_peak:>12.1%}{r.reserved_utilization_at_peak:>14.1%}")
    ratio = cont.output_tokens_per_s / static.output_tokens_per_s
    print(f"\ncontinuous / static output tokens/s: {ratio:.2f}x (goal >= 3x)")
    print(f"peak KV utilization, paged: {cont.paged_utilization_at_peak:.1%} (goal >= 90%); "
          f"reserving prompt + max_tokens per request: {cont.reserved_utilization_at_peak:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": wl.description, "ratio": ratio,
                       "results": [asdict(r) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
