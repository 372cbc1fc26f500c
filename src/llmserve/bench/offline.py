"""Engine-level throughput without HTTP: continuous batching against static batches.

The same ShareGPT-like workload (random token ids, output lengths held with ignore_eos)
runs through a fresh engine in each mode, in one process, sampling the KV cache after
every step:

- ``continuous``: iteration-level batching (the engine's default).
- ``static-padded``: static batching as a padded batch runs it (``model.generate`` on a
  batch in transformers, the usual baseline of published continuous-batching results): a
  batch of ``max_num_seqs`` requests starts together and every member keeps computing a
  token per step until the batch's longest member ends; only each request's own tokens
  count as output. Run as the engine's ``--scheduling static`` with each member's
  ``max_tokens`` raised to its batch's longest. Prompts are not padded (generous to it).
- ``static``: the engine's ``--scheduling static`` as is: the same fixed batches, but a
  member that ends stops computing (its slot stays empty until the batch ends). A
  stronger baseline than any padded batch; on a CPU, where a step's cost grows with its
  rows, much stronger.

Reported: output tokens/s of each mode and continuous's ratio to each baseline; peak KV
memory utilization with paged blocks (KV tokens stored / token slots of the blocks in
use), beside what reserving each request's maximum length would give; and for a model with
sliding-window layers, the blocks held at the peak against what the same sequences would
hold with every layer global.
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
    # The running sequences at the peak, if every layer kept its whole context.
    peak_kv_blocks_without_windows: int = 0


def sharegpt_like_token_workload(n: int, seed: int, vocab: int = 49152
                                 ) -> tuple[list[list[int]], list[int], str]:
    """The HTTP benchmark's ShareGPT-like lengths, as random token ids."""
    rng = random.Random(seed)
    prompt_lens, output_lens = sharegpt_lengths(rng, n)
    prompts = [[rng.randrange(17, vocab) for _ in range(k)] for k in prompt_lens]
    desc = (f"{n} requests; {sharegpt_description()} (prompt lengths in tokens); prompt "
            f"tokens {sum(prompt_lens)}, output tokens {sum(output_lens)}; seed {seed}")
    return prompts, output_lens, desc


MODES = ("continuous", "static-padded", "static")


def padded_lengths(output_lens: list[int], batch: int) -> list[int]:
    """Each request's length in a padded static batch: its batch's longest."""
    return [max(output_lens[i - i % batch:i - i % batch + batch])
            for i in range(len(output_lens))]


def run_mode(model: str, mode: str, prompts: list[list[int]], output_lens: list[int], *,
             kv_cache_memory: float, max_num_seqs: int, max_num_batched_tokens: int,
             quantization: str = "auto") -> OfflineResult:
    from llmserve import LLM, SamplingParams

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    llm = LLM(model, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
              scheduling="continuous" if mode == "continuous" else "static",
              quantization=quantization)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine = llm.engine
    kv = engine.kv_manager
    block_size = kv.block_size
    # Static batches are the first max_num_seqs waiting requests, in order: consecutive
    # slices of the list.
    run_lens = padded_lengths(output_lens, max_num_seqs) if mode == "static-padded" \
        else output_lens
    for i, (prompt, out_len) in enumerate(zip(prompts, run_lens)):
        engine.add_request(f"{mode}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps, produced = 0, 0
    peak = (0, 0.0, 0.0, 0)
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        produced += sum(len(o.new_token_ids) for o in outs)
        used = kv.num_blocks - kv.num_free_blocks
        if used > peak[0]:
            running = engine.scheduler.running
            stored = sum(_tokens_held(kv.held_blocks(r.request_id), r.num_computed_tokens,
                                      block_size) for r in running)
            reserved = kv.num_groups * sum(r.num_prompt_tokens + r.max_tokens for r in running)
            every_layer = kv.num_groups * sum(-(-r.num_computed_tokens // block_size)
                                              for r in running)
            peak = (used, stored / (used * block_size), stored / max(reserved, 1), every_layer)
    seconds = time.perf_counter() - start
    kv.check_integrity()
    if produced != sum(run_lens):
        raise RuntimeError(f"{mode}: {produced} tokens generated, {sum(run_lens)} expected")
    output_tokens = sum(output_lens)  # padding rows' extra tokens are not output
    return OfflineResult(mode, seconds, output_tokens, sum(len(p) for p in prompts),
                         output_tokens / seconds, len(prompts) / seconds, steps, *peak)


def _tokens_held(held_per_group: list[int], num_computed: int, block_size: int) -> int:
    """Tokens stored in a sequence's blocks, summed over its KV cache groups: a group holds
    the blocks from its first held one to the last computed token (a sliding-window group
    has released those before)."""
    end = -(-num_computed // block_size)
    return sum(num_computed - (end - held) * block_size for held in held_per_group if held)


def run_offline(model: str, num_requests: int, seed: int, kv_cache_memory: float,
                max_num_seqs: int, max_num_batched_tokens: int, quantization: str = "auto",
                modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    """Each of ``modes`` (continuous first, for the ratios) over the same workload."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be some of {', '.join(MODES)}; got {', '.join(modes)}")
    modes = tuple(sorted(set(modes), key=MODES.index))
    prompts, output_lens, desc = sharegpt_like_token_workload(num_requests, seed)
    print("workload:", desc, flush=True)
    results = []
    for mode in modes:
        results.append(run_mode(model, mode, prompts, output_lens,
                                kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                quantization=quantization))
        print(offline_row(results[-1]), flush=True)
    cont = results[0]
    return {"workload": desc, "model": model, "quantization": quantization,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "kv_cache_memory_gib": kv_cache_memory,
            "ratios": {r.mode: cont.output_tokens_per_s / r.output_tokens_per_s
                       for r in results[1:] if cont.mode == "continuous"},
            "results": [asdict(r) for r in results]}


_HEADER = (f"{'mode':<15}{'seconds':>9}{'out tok/s':>11}{'req/s':>8}{'steps':>7}"
           f"{'peak blocks':>13}{'paged util':>12}{'reserve util':>14}")


def offline_row(r: OfflineResult | dict[str, Any]) -> str:
    r = asdict(r) if isinstance(r, OfflineResult) else r
    return (f"{r['mode']:<15}{r['seconds']:>9.1f}{r['output_tokens_per_s']:>11.1f}"
            f"{r['requests_per_s']:>8.2f}{r['steps']:>7}{r['peak_kv_blocks_used']:>13}"
            f"{r['paged_utilization_at_peak']:>12.1%}{r['reserved_utilization_at_peak']:>14.1%}")


def offline_table(report: dict[str, Any]) -> str:
    lines = [_HEADER, *(offline_row(r) for r in report["results"])]
    cont = report["results"][0]
    lines.append("")
    for mode, ratio in report["ratios"].items():
        lines.append(f"continuous / {mode} output tokens/s: {ratio:.2f}x (goal >= 3x)")
    lines.append(f"peak KV utilization ({cont['mode']}), paged: "
                 f"{cont['paged_utilization_at_peak']:.1%} "
                 f"(goal >= 90%); reserving prompt + max_tokens per request: "
                 f"{cont['reserved_utilization_at_peak']:.1%}")
    every_layer = cont.get("peak_kv_blocks_without_windows", 0)
    if every_layer > cont["peak_kv_blocks_used"]:
        lines.append(f"sliding windows: {cont['peak_kv_blocks_used']} blocks held at the peak; "
                     f"{every_layer} with every layer global "
                     f"({1 - cont['peak_kv_blocks_used'] / every_layer:.0%} less KV memory)")
    return "\n".join(lines)
