"""Does torch.compile help the CPU decode step? Times single-stream decode steps of the
default model eager and with each decoder layer compiled (inductor, dynamic shapes; the
paged attention call stays eager), in one process.

    .venv/bin/python benchmarks/compile_probe.py [--quantization int4] [--cpp-wrapper]
"""

from __future__ import annotations

import argparse
import time

import torch

import llmserve.attention.layer as attention_layer
from llmserve import LLM, SamplingParams


def step_ms(llm: LLM, steps: int = 30) -> float:
    engine = llm.engine
    engine.add_request(f"r{time.monotonic_ns()}", list(range(100, 116)), SamplingParams(
        temperature=0, max_tokens=steps + 3, ignore_eos=True))
    engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default="int4")
    p.add_argument("--cpp-wrapper", action="store_true")
    args = p.parse_args()
    llm = LLM(quantization=args.quantization, max_model_len=2048, kv_cache_memory=0.5)
    eager = step_ms(llm)
    if args.cpp_wrapper:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
    attention_layer.Attention.forward = torch.compiler.disable(
        attention_layer.Attention.forward)
    start = time.perf_counter()
    for layer in llm.engine.loaded.model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    step_ms(llm, steps=3)  # compiles
    compile_s = time.perf_counter() - start
    compiled = step_ms(llm)
    print(f"{args.quantization}: eager {eager:.1f} ms/step, compiled {compiled:.1f} ms/step "
          f"({eager / compiled:.2f}x), compilation {compile_s:.0f} s")


if __name__ == "__main__":
    main()
