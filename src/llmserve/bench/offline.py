"""Engine-level throughput without HTTP: continuous batching against static batches.

The same ShareGPT-like workload (random token ids, output lengths held with ignore_eos)
runs through a fresh engine in each scheduling mode, in one process, sampling the KV cache
after every step:

- output tokens/s of each mode and their ratio;
- peak KV memory utilization with paged blocks (KV tokens stored / token slots of the
  blocks in use), beside what reserving each request's maximum length would give.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from llmserve.bench.workloads import sharegpt_description, sharegpt_lengths


@dataclass
class OfflineResult:
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


def sharegpt_like_token_workload(n: int, seed: int, vocab: int = 49152
                                 ) -> tuple[list[list[int]], list[int], str]:
    """The HTTP benchmark's ShareGPT-like lengths, as random token ids."""
    rng = random.Random(seed)
    prompt_lens, output_lens = sharegpt_lengths(rng, n)
    prompts = [[rng.randrange(17, vocab) for _ in range(k)] for k in prompt_lens]
    desc = (f"{n} requests; {sharegpt_description()} (prompt lengths in tokens); prompt "
            f"tokens {sum(prompt_lens)}, output tokens {sum(output_lens)}; seed {seed}")
    return prompts, output_lens, desc


def run_mode(model: str, mode: str, prompts: list[list[int]], output_lens: list[int], *,
             kv_cache_memory: float, max_num_seqs: int, max_num_batched_tokens: int,
             quantization: str = "auto") -> OfflineResult:
    from llmserve import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
              scheduling=mode, quantization=quantization)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine = llm.engine
    block_size = engine.kv_manager.block_size
    for i, (prompt, out_len) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"{mode}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps, output_tokens = 0, 0
    peak = (0, 0.0, 0.0)
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        output_tokens += sum(len(o.new_token_ids) for o in outs)
        used = engine.kv_manager.num_blocks - engine.kv_manager.num_free_blocks
        if used > peak[0]:
            running = engine.scheduler.running
            stored = sum(r.num_computed_tokens for r in running)
            reserved = sum(r.num_prompt_tokens + r.max_tokens for r in running)
            peak = (used, stored / (used * block_size), stored / max(reserved, 1))
    seconds = time.perf_counter() - start
    engine.kv_manager.check_integrity()
    return OfflineResult(mode, seconds, output_tokens, sum(len(p) for p in prompts),
                         output_tokens / seconds, len(prompts) / seconds, steps, *peak)


def run_offline(model: str, num_requests: int, seed: int, kv_cache_memory: float,
                max_num_seqs: int, max_num_batched_tokens: int,
                quantization: str = "auto") -> dict[str, Any]:
    prompts, output_lens, desc = sharegpt_like_token_workload(num_requests, seed)
    print("workload:", desc, flush=True)
    results = [run_mode(model, mode, prompts, output_lens, kv_cache_memory=kv_cache_memory,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        quantization=quantization)
               for mode in ("continuous", "static")]
    cont, static = results
    return {"workload": desc, "model": model, "quantization": quantization,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "ratio": cont.output_tokens_per_s / static.output_tokens_per_s,
            "results": [asdict(r) for r in results]}


def offline_table(report: dict[str, Any]) -> str:
    lines = [f"{'mode':<12}{'seconds':>9}{'out tok/s':>11}{'req/s':>8}{'steps':>7}"
             f"{'peak blocks':>13}{'paged util':>12}{'reserve util':>14}"]
    for r in report["results"]:
        lines.append(f"{r['mode']:<12}{r['seconds']:>9.1f}{r['output_tokens_per_s']:>11.1f}"
                     f"{r['requests_per_s']:>8.2f}{r['steps']:>7}{r['peak_kv_blocks_used']:>13}"
                     f"{r['paged_utilization_at_peak']:>12.1%}"
                     f"{r['reserved_utilization_at_peak']:>14.1%}")
    cont = report["results"][0]
    lines.append(f"\ncontinuous / static output tokens/s: {report['ratio']:.2f}x (goal >= 3x)")
    lines.append(f"peak KV utilization, paged: {cont['paged_utilization_at_peak']:.1%} "
                 f"(goal >= 90%); reserving prompt + max_tokens per request: "
                 f"{cont['reserved_utilization_at_peak']:.1%}")
    return "\n".join(lines)
