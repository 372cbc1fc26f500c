"""The PyTorch attention backend (``torch_paged``: block sizes the compiled kernel does not
take, or no compiled kernels) with each query row's products its own (this tree) against
one product per tile of rows (before session 48, not chunk-invariant), alternating in one
process on the default model with KV blocks of 8: prefill of one prompt, and decode steps
of a batch.

    .venv/bin/python benchmarks/torch_paged_rows_ab.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from kv_dtype_ab import decode_rate

from llmserve import LLM, SamplingParams
from llmserve.attention import torch_paged

ROW_PRODUCTS = torch_paged._row_products


def one_product(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.bmm(a, b)


def prefill_seconds(llm: LLM, n: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 49000) for _ in range(n)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM(block_size=8, enable_prefix_caching=False, max_model_len=2048,
              max_num_batched_tokens=1024, kv_cache_memory=1.0)
    print(f"backend: {type(llm.engine.runner.backend).__name__}")
    cases = {"prefill 512 tokens, s": lambda s: prefill_seconds(llm, 512, s),
             "prefill 1024 tokens, s": lambda s: prefill_seconds(llm, 1024, s),
             # kv_dtype_ab's decode: tokens/s of 8 requests, as ms a step
             "decode 8 x 256, ms a step": lambda s: 1e3 * 8 / decode_rate(llm, 8, 256, 16, s)}
    print("| case | per-row products | one product a tile (before) | ratio |\n|---|---|---|---|")
    for name, run in cases.items():
        times: dict[str, list[float]] = {"rows": [], "tile": []}
        run(0)  # warm-up
        for rep in range(args.repeats):
            for mode in (("rows", "tile") if rep % 2 == 0 else ("tile", "rows")):
                torch_paged._row_products = ROW_PRODUCTS if mode == "rows" else one_product
                times[mode].append(run(rep + 1))
        torch_paged._row_products = ROW_PRODUCTS
        a, b = statistics.median(times["rows"]), statistics.median(times["tile"])
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
