"""The default KV cache against another (or the default format against another weight
format), decode at several batches and contexts, both engines in one process, alternating
(this host's speed drifts by 10-20% within minutes: separate runs cannot be compared).

For each (batch, context): `batch` requests of `context` random prompt tokens, prefilled,
then `--steps` decode steps timed; output tokens/s of each engine, the median of
`--repeats` alternations, and their ratio.

    .venv/bin/python benchmarks/kv_dtype_ab.py [--quantization auto] [--other float32]
    .venv/bin/python benchmarks/kv_dtype_ab.py --other auto --other-quantization w8a8
    .venv/bin/python benchmarks/kv_dtype_ab.py --other auto --other-block-size 16
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from llmserve import LLM, SamplingParams


def decode_rate(llm: LLM, batch: int, context: int, steps: int, seed: int) -> float:
    rng = random.Random(seed)
    engine = llm.engine
    ids = [f"ab{seed}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 49000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 8,
                                          ignore_eos=True))
    while any(r.num_computed_tokens < context for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefill (chunks), then every request decodes
    engine.step()
    produced, start = 0, time.perf_counter()
    for _ in range(steps):
        produced += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort(rid)
    engine.step()
    return produced / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--other", default="float32", help="the KV cache dtype to compare with")
    p.add_argument("--other-quantization", default=None,
                   help="the other engine's weight format (default: --quantization)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the device's, config.default_block_size)")
    p.add_argument("--other-block-size", type=int, default=None,
                   help="the other engine's (default: --block-size)")
    p.add_argument("--points", default="1x256,1x2048,1x4096,8x512,64x128,64x384,64x1024",
                   help="batch x context pairs")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engines = {}
    other_q = args.other_quantization or args.quantization
    other_bs = args.other_block_size or args.block_size
    for quantization, kv, bs in ((args.quantization, "auto", args.block_size),
                                 (other_q, args.other, other_bs)):
        llm = LLM(args.model, quantization=quantization, kv_cache_dtype=kv, max_model_len=8192,
                  max_num_seqs=64, max_num_batched_tokens=4096, kv_cache_memory=2.0,
                  enable_prefix_caching=False, block_size=bs)
        weights = llm.engine.loaded.weight_format.quantization
        card = llm.engine.card
        engines[f"{weights}, KV {kv} ({card.kv_cache_dtype}), blocks of {card.kv_block_size}"] = llm
    names = list(engines)
    print(f"| batch x context | {names[0]} tok/s | {names[1]} tok/s | ratio (per repeat) |")
    print("|---|---|---|---|")
    seeds = itertools.count()
    for point in args.points.split(","):
        batch, context = (int(v) for v in point.split("x"))
        rates: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            order = names if rep % 2 == 0 else names[::-1]
            seed = next(seeds)
            for n in order:
                rates[n].append(decode_rate(engines[n], batch, context, args.steps, seed))
        a, b = (statistics.median(rates[n]) for n in names)
        per = ", ".join(f"{x / y:.2f}" for x, y in zip(rates[names[0]], rates[names[1]]))
        print(f"| {batch} x {context} | {a:.1f} | {b:.1f} | **{a / b:.2f}x** ({per}) |",
              flush=True)


if __name__ == "__main__":
    main()
