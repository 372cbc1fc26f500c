"""Greedy against sampled requests through the engine: tokens/s of the default model for
``--streams`` requests of 32-token prompts and 48 output tokens each (prefill included),
greedy and at temperature 1.0 (the OpenAI API's default), in one process. Run it in two
trees, alternating, to compare them (``PYTHONPATH=<tree>/src``; ``--label`` names the line).

    python benchmarks/sampled_decode_ab.py --label new --streams 1,16,64
"""

from __future__ import annotations

import argparse
import random
import time

from llmserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    llm = LLM("smollm2-135m-instruct")
    rng = random.Random(0)
    for n in map(int, args.streams.split(",")):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(32)]}
                   for _ in range(n)]
        for temperature in (0.0, 1.0):
            llm.generate(prompts[:1], SamplingParams(temperature=temperature, max_tokens=4))
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                    ignore_eos=True, seed=1)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{args.label} streams {n}, temperature {temperature}: "
                  f"{tokens / seconds:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
