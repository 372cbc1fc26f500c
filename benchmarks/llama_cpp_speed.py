"""llama.cpp's speed on a GGUF file, through llama-cpp-python (run in its own environment,
see setup_llama_cpp_python.sh). Prints one JSON object: single-stream decode tokens/s
(like llama-bench's tg: tokens evaluated one at a time from a short context) and prefill
tokens/s per prompt length (like llama-bench's pp), and with --batches, aggregate decode
tokens/s of that many sequences decoded together (like llama-batched-bench and llama-server
with that many slots: one llama_decode per step holding one token of every sequence),
medians of --repeats runs.

    $(bash benchmarks/setup_llama_cpp_python.sh) benchmarks/llama_cpp_speed.py MODEL.gguf
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llama_cpp
from llama_cpp import Llama


def batched_decode_rate(model_path: str, threads: int, n_seqs: int, prompt_len: int,
                        new_tokens: int, unified: bool, repeats: int, rng: random.Random) -> float:
    """Output tokens/s over the decode steps of ``n_seqs`` sequences decoded together.

    Each sequence first gets a ``prompt_len``-token prompt (prefill not timed); then every
    step decodes one token of each sequence in one llama_decode, as llama-server does with
    that many busy slots. Tokens fed back are random, not sampled: no sampling cost is
    counted for llama.cpp (llama-batched-bench measures the same way). ``unified``: one KV
    buffer shared by all sequences (llama.cpp's -kvu) or one per sequence.
    """
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    cparams = llama_cpp.llama_context_default_params()
    per_seq = -(-(prompt_len + new_tokens) // 256) * 256  # llama.cpp pads the cache to 256
    cparams.n_ctx = n_seqs * per_seq
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = n_seqs
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.kv_unified = unified
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int]], last_pos: int) -> None:
        """One llama_decode per 512 (sequence, position, token); logits at ``last_pos``."""
        for start in range(0, len(entries), 512):
            chunk = entries[start:start + 512]
            batch.n_tokens = len(chunk)
            for i, (seq, pos, tok) in enumerate(chunk):
                batch.token[i], batch.pos[i] = tok, pos
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                batch.logits[i] = pos == last_pos
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

    runs = []
    for _ in range(repeats):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        decode([(s, p, rng.randrange(100, vocab)) for s in range(n_seqs)
                for p in range(prompt_len)], prompt_len - 1)
        start = time.perf_counter()
        for step in range(new_tokens):
            pos = prompt_len + step
            decode([(s, pos, rng.randrange(100, vocab)) for s in range(n_seqs)], pos)
        runs.append(n_seqs * new_tokens / (time.perf_counter() - start))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prompt-lens", default="512,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="",
                   help="comma-separated sequence counts for aggregate decode (e.g. 1,8,32,64)")
    p.add_argument("--batch-prompt-len", type=int, default=128)
    p.add_argument("--batch-new-tokens", type=int, default=32)
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
    aggregate = {}
    for b in [int(b) for b in args.batches.split(",") if b]:
        aggregate[b] = {
            kind: batched_decode_rate(args.model, args.threads, b, args.batch_prompt_len,
                                      args.batch_new_tokens, kind == "unified", args.repeats,
                                      rng)
            for kind in ("unified", "per_sequence")}
    print(json.dumps({"decode_tok_s": statistics.median(decode), "prefill_tok_s": prefill,
                      "aggregate_tok_s": aggregate, "threads": args.threads}))


if __name__ == "__main__":
    main()
