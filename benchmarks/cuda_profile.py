"""Where a decode step's GPU time goes, and linear-kernel variants against each other.

On the 1.07B Llama shape of ``cuda_bench.py`` (random bfloat16 weights):

1. for each variant (programmatic dependent launch off, the linear's warps and stages,
   the output head outside the decode graphs, split linears' parts always in programs of
   their own, other split-K tilings, the attention kernel's keys per tile, segment, warps,
   pipeline stages and loads a tile ahead, the fused launches of a layer undone; each still
   batch-invariant):
   the GPU time of one decode step at batch 1 and 64 (``--sizes``; back-to-back replays of
   its CUDA graph), single-stream decode tokens/s through the engine and the prefill of
   4096 tokens;
2. ``torch.profiler`` over a few eager decode steps of the default variant: device time by
   kernel, summed over the step; then over replays of its batch-1 decode graph: each
   kernel of one replay in order, with its time and the gap before it.

    python benchmarks/cuda_profile.py --tokenizer .gpu/tokenizer --out out/profile.json

``--rounds N`` measures the variants N times over, alternating (the host is shared).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_bench as cb

from llmserve import envs
from llmserve.attention import triton_paged
from llmserve.layers import triton_launch, triton_linear
from llmserve.runner import cuda_graphs
from llmserve.sampling_params import SamplingParams

_IN_ORDER_TILES = triton_linear.IN_ORDER_TILES
_GATED_MAX_ROWS = triton_linear.GATED_MAX_ROWS
VARIANTS = {
    "default": {},
    "no-pdl": {"pdl": False},
    "linear-w8": {"linear_warps": 8},  # the linear's warps and pipeline stages
    "linear-stages4": {"linear_stages": 4},
    "parts-parallel": {"in_order_tiles": 1 << 62},  # a split weight's parts never in order
    "head-eager": {"graph_logits": False},  # the output head after the replay, eagerly
    "splitk-1": {"tiles_per_sm": 1},  # fewer, longer parts (different sums)
    "splitk-4": {"tiles_per_sm": 4},  # more, shorter parts
    "split-bn32": {"split_block_n": 32},  # narrower tiles, fewer parts
    "attn-seg256": {"attn_segment": 256},
    "attn-seg128": {"attn_segment": 128},
    "attn-seg64": {"attn_segment": 64},
    "attn-no-prefetch": {"attn_prefetch": False},  # the key loop's loads to the pipeliner
    "attn-stages2": {"attn_stages": 2},
    "attn-stages4": {"attn_stages": 4},
    "attn-bn32": {"attn_block_n": 32},
    "attn-bn128": {"attn_block_n": 128},
    "attn-w2": {"attn_warps": 2},
    "attn-w8": {"attn_warps": 8},
    "attn-bn128-w8": {"attn_block_n": 128, "attn_warps": 8},
    "attn-bn256-w8": {"attn_block_n": 256, "attn_warps": 8},
    "mlp-two-kernels": {"gated_max_rows": 0},  # the gate/up product, then silu_and_mul
    "mlp-one-kernel": {"gated_max_rows": 1 << 30},  # silu(gate) * up in the product's kernel
    "rope-then-store": {"rope_store": False},  # the rotary's kernel, then the KV store's
    "one-graph-set": {"context_limits": False},  # split attention in every decode graph
    "unfused": {"gated_max_rows": 0, "rope_store": False, "context_limits": False},
}


def apply_variant(v: dict) -> None:
    """Module knobs read at call or capture time: programmatic dependent launch, the linear's
    warps and stages, the head in the graphs, when a split linear sums its parts in one
    program per tile, the split-K tiling, the attention's keys per tile and segment, warps
    and stages per program and its loads a tile ahead, the MLP's activation in the gate/up
    product, the rotary in the KV store's kernel, and the decode graphs for one attention
    segment."""
    triton_launch.PDL = v.get("pdl", envs.LLMSERVE_PDL)
    triton_linear.IN_ORDER_TILES = v.get("in_order_tiles", _IN_ORDER_TILES)
    triton_linear.TILES_PER_SM = v.get("tiles_per_sm", 2)
    triton_linear.SPLIT_BLOCK_N = v.get("split_block_n", 64)
    triton_linear._LINEAR_WARPS = v.get("linear_warps", 4)
    triton_linear._LINEAR_STAGES = v.get("linear_stages", 3)
    triton_linear.linear_config.cache_clear()
    cuda_graphs.LOGITS = v.get("graph_logits", True)
    cuda_graphs.CONTEXT_LIMITS = v.get("context_limits", True)
    triton_paged.BLOCK_N = v.get("attn_block_n", 64)
    triton_paged.SEGMENT = v.get("attn_segment", 512)
    triton_paged.WARPS = v.get("attn_warps", 4)
    triton_paged.STAGES = v.get("attn_stages", 3)
    triton_paged.PREFETCH = v.get("attn_prefetch", True)
    triton_linear.GATED_MAX_ROWS = v.get("gated_max_rows", _GATED_MAX_ROWS)
    triton_paged.ROPE_STORE = v.get("rope_store", True)


def replay_ms(core, size: int, context: int, repeats: int = 50) -> float:
    """Milliseconds a replay of the graph of ``size`` rows whose longest context is
    ``context`` keys (its inputs as the last step left them)."""
    graph = core.runner.graphs.graph(size, context)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the variants this many times over, alternating")
    ap.add_argument("--sizes", default="1,64",
                    help="batch sizes whose graph replay is timed (captured: up to 64)")
    args = ap.parse_args()
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    path, _ = cb.build_model_dir(Path("/tmp/cuda_profile/llama-1b"), cb.LLAMA_1B, args.tokenizer)
    rng = random.Random(0)
    prompt = [rng.randrange(17, cb.VOCAB) for _ in range(128)]
    results: dict = {"variants": {name: [] for name in chosen}}
    for round_, name in itertools.product(range(args.rounds), chosen):
        apply_variant(VARIANTS[name])
        core = cb.engine(path, "cuda", False, max_num_seqs=64)
        cb.run_batch(core, [prompt], 8, "cuda", "warm")
        single = cb.run_batch(core, [prompt], 128, "cuda", "single")
        row = {f"replay_ms_b{size}": replay_ms(core, int(size), len(prompt) + 128)
               for size in args.sizes.split(",")}
        row |= {"single_tok_s": single["decode_tok_s"],
                "prefill_4096_tok_s": cb.prefill_speed(core, 4096, "cuda")}
        results["variants"][name].append(row)
        print(name, json.dumps(row), flush=True)
        if name == "default" and round_ == 0 and not args.no_kernels:
            results["kernels"] = kernel_table(core, prompt)
            try:
                results["timeline"] = graph_timeline(core, len(prompt) + 128)
            except Exception as e:  # the profiler's view of graphs differs by version
                print(f"graph timeline: {type(e).__name__}: {e}", flush=True)
        del core
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def kernel_table(core, prompt: list[int], steps: int = 5) -> list[dict]:
    """Device microseconds per decode step by kernel name (eager steps: the graphs are set
    aside, the kernels are the same)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, core.runner.graphs = core.runner.graphs, None
    core.add_request("prof", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True))
    for _ in range(10):
        core.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    while core.has_unfinished():
        core.step()
    core.runner.graphs = graphs
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if device_us:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / steps,
                         "us_per_step": device_us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"device time per eager decode step: {total:.0f} us")
    for r in rows[:18]:
        print(f"  {r['us_per_step']:8.1f} us  {r['calls_per_step']:6.1f} calls  {r['kernel']}")
    return rows


def graph_timeline(core, context: int, replays: int = 3) -> dict:
    """The kernels of one replay of the batch-1 decode graph in order, as the profiler sees
    them inside the graph: each one's device microseconds and the gap before it (from the
    end of the one before). Prints the first layer's kernels and the totals by name."""
    from torch.profiler import ProfilerActivity, profile

    graph = core.runner.graphs.graph(1, context)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                      and e.time_range.end > e.time_range.start),
                     key=lambda e: e.time_range.start)
    per_replay = len(kernels) // replays
    if not per_replay:
        raise RuntimeError("no kernel events recorded inside the graph")
    last = kernels[-per_replay:]
    rows, prev_end = [], None
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        rows.append({"kernel": e.name[:60], "us": e.time_range.end - e.time_range.start,
                     "gap_us": gap})
        prev_end = e.time_range.end
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(r["us"] for r in rows)
    by_name: dict[str, list[float]] = {}
    for r in rows:
        by_name.setdefault(r["kernel"], []).append(r["us"])
    print(f"graph replay, batch 1, {context} keys: {len(rows)} kernels, span {span:.0f} us, "
          f"kernels busy {busy:.0f} us, gaps {sum(r['gap_us'] for r in rows):.0f} us")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(times):8.1f} us  {len(times):4d} x  {name}")
    print("  the first kernels in order (us, gap before):")
    for r in rows[:14]:
        print(f"    {r['us']:6.2f}  {r['gap_us']:5.2f}  {r['kernel']}")
    return {"span_us": span, "busy_us": busy, "kernels": rows}


if __name__ == "__main__":
    main()
