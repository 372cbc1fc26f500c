"""llama.cpp's speed on a GGUF file, through llama-cpp-python (run in its own environment,
see setup_llama_cpp_python.sh). Prints one JSON object: single-stream decode tokens/s
(like llama-bench's tg: tokens evaluated one at a time from a short context) and prefill
tokens/s per prompt length (like llama-bench's pp), medians of --repeats runs.

    $(bash benchmarks/setup_llama_cpp_python.sh) benchmarks/llama_cpp_speed.py MODEL.gguf
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from llama_cpp import Llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompt-lens", default="512,1024")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=max(lens) + args.decode_tokens + 64, n_batch=max(lens), verbose=False)
    rng = random.Random(0)
    vocab = llm.n_vocab()

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefill = {}
    for n in lens:
        runs = []
        for _ in range(args.repeats):
            llm.reset()
            ids = tokens(n)
            t = time.perf_counter()
            llm.eval(ids)
            runs.append(n / (time.perf_counter() - t))
        prefill[n] = statistics.median(runs)
    decode = []
    for _ in range(args.repeats):
        llm.reset()
        llm.eval(tokens(16))
        t = time.perf_counter()
        for tok in tokens(args.decode_tokens):
            llm.eval([tok])
        decode.append(args.decode_tokens / (time.perf_counter() - t))
    print(json.dumps({"decode_tok_s": statistics.median(decode),
                      "prefill_tok_s": prefill, "threads": args.threads}))


if __name__ == "__main__":
    main()
