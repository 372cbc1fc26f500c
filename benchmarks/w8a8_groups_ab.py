"""w8a8's activation groups against one scale per row, batch-64 decode in one process.

The same code loads the model twice: as shipped (a scale per <= 256 inputs in the decoder
layers, per 64 in the output head) and configured as w8a8 was before the groups (one
scale per row, int8's two-level head); then batch-64 decode rates alternate between them.

    cd benchmarks && ../.venv/bin/python w8a8_groups_ab.py [--kv-cache-dtype int8] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics

from bench_cpu import decode_rate

from llmserve import LLM, SamplingParams
from llmserve.layers.quantization import base, w8a8


def load(kv_cache_dtype: str) -> LLM:
    llm = LLM(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=64 * 128,
              kv_cache_memory=1.0, enable_prefix_caching=False, quantization="w8a8",
              kv_cache_dtype=kv_cache_dtype)
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=4))  # warm-up
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", default="int8")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    grouped = load(args.kv_cache_dtype)
    # The groups are chosen when a layer packs its weights (at load), the head's method
    # when the model is built: both as before for the second copy.
    head = base.WeightFormat.head_quantization
    w8a8.W8A8Method.max_group = 1 << 30
    base.WeightFormat.head_quantization = property(lambda self: "int8")
    try:
        per_row = load(args.kv_cache_dtype)
    finally:
        w8a8.W8A8Method.max_group = w8a8.BODY_GROUP
        base.WeightFormat.head_quantization = head
    rates: dict[str, list[float]] = {"per row": [], "groups": []}
    for i in range(args.runs):
        for name, llm in (("per row", per_row), ("groups", grouped)):
            rates[name].append(decode_rate(llm, 64, 128, 32, i))
            print(name, round(rates[name][-1], 1), flush=True)
    for name, v in rates.items():
        print(f"{name}: median {statistics.median(v):.1f} max {max(v):.1f} tok/s")
    ratio = statistics.median(rates["groups"]) / statistics.median(rates["per row"])
    print(f"groups / per row, medians: {ratio:.3f}")


if __name__ == "__main__":
    main()
