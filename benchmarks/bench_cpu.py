"""CPU speed of each weight format, beside llama.cpp on the same GGUF and the bandwidth
ceiling. Every figure of one run comes from the same process and minute; each is the
median of --repeats runs.

    .venv/bin/python benchmarks/bench_cpu.py [--llama-cpp] [--repeats 3]

1. Single-stream decode tokens/s per format (after a 16-token prompt, like llama-bench's
   tg128), and the ceiling: measured read bandwidth / weight bytes read per token.
2. Aggregate decode tokens/s at batch 1, 8, 32, 64 (128-token prompts, all prefilled in
   one step first; only the decode steps are timed).
3. Prefill tokens/s of one 512- and one 1024-token prompt.
With --llama-cpp, llama.cpp's decode, aggregate decode (the same batches, prompts and
token counts: one llama_decode per step over all sequences, as llama-server runs its busy
slots; the better of a unified and a per-sequence KV cache) and prefill figures on the same
file (2 threads, through llama-cpp-python in its own environment:
benchmarks/setup_llama_cpp_python.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.models.loader import DEFAULT_MODEL, resolve_model_path

HERE = Path(__file__).parent
FORMATS = {
    "float32": {"quantization": "none"},
    "bfloat16": {"quantization": "none", "dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "int4": {"quantization": "int4"},
}

AGGREGATE_PROMPT, AGGREGATE_NEW = 128, 32  # aggregate decode: prompt and output tokens


def format_options(name: str) -> dict:
    """A --formats entry, ``int8`` or ``int8+kv-float32`` (with a KV cache dtype; without
    one, ``auto``: int8 for these formats on CPU), as LLM keyword arguments."""
    base, _, kv = name.partition("+kv-")
    if base not in FORMATS:
        raise SystemExit(f"unknown format {base!r}: choose from {', '.join(FORMATS)}, "
                         "optionally followed by +kv-<KV cache dtype>")
    return {**FORMATS[base], **({"kv_cache_dtype": kv} if kv else {})}


def read_bandwidth_gbs(repeats: int) -> float:
    """Bytes per second of summing a 512 MiB float32 tensor (reads only), all threads."""
    x = torch.ones(128 * 2**20)
    x.sum()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        runs.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return statistics.median(runs)


def head_and_body_bytes(llm: LLM) -> int:
    """Weight bytes one decode step reads: every layer plus the output head (an untied
    embedding table is only looked up, one row per token)."""
    model = llm.engine.loaded.model
    total = llm.engine.loaded.weight_bytes
    if model.lm_head is not None:
        emb = model.model.embed_tokens
        total -= sum(t.numel() * t.element_size() for t in emb.buffers(recurse=False))
    return total


def decode_rate(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    """Output tokens/s over the decode steps of ``batch`` requests (prefill excluded)."""
    rng = random.Random(seed)
    engine = llm.engine
    for i in range(batch):
        prompt = [rng.randrange(100, 49000) for _ in range(prompt_len)]
        engine.add_request(f"d{seed}-{i}", prompt, SamplingParams(
            temperature=0, max_tokens=new_tokens + 1, ignore_eos=True))
    engine.step()  # every prompt fits the step's budget: all prefilled, first tokens out
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def prefill_rate(llm: LLM, n: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 49000) for _ in range(n)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return n / (time.perf_counter() - start)


def median(fn, repeats: int) -> float:
    return statistics.median(fn(i) for i in range(repeats))


def measure_format(model: str, name: str, batches: list[int], bandwidth: float,
                   repeats: int) -> dict:
    llm = LLM(model, max_model_len=2048, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * 128, kv_cache_memory=1.0,
              enable_prefix_caching=False, **format_options(name))
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=4))  # warm-up
    nbytes = head_and_body_bytes(llm)
    return {
        "bytes_per_token": nbytes, "ceiling_tok_s": bandwidth * 1e9 / nbytes,
        "weight_bytes": llm.engine.loaded.weight_bytes,
        "decode_tok_s": median(lambda i: decode_rate(llm, 1, 16, 128, i), repeats),
        "aggregate_tok_s": {b: median(lambda i, b=b: decode_rate(llm, b, AGGREGATE_PROMPT,
                                                                  AGGREGATE_NEW, i), repeats)
                            for b in batches},
        "prefill_tok_s": {n: median(lambda i, n=n: prefill_rate(llm, n, i), repeats)
                          for n in (512, 1024)},
    }


def llama_cpp(model_path: Path, batches: list[int], repeats: int) -> dict:
    setup = subprocess.run(["bash", str(HERE / "setup_llama_cpp_python.sh")], check=True,
                           capture_output=True, text=True)
    python = setup.stdout.strip().splitlines()[-1]
    out = subprocess.run([python, str(HERE / "llama_cpp_speed.py"), str(model_path),
                          "--repeats", str(repeats), "--threads", "2",
                          "--batches", ",".join(map(str, batches)),
                          "--batch-prompt-len", str(AGGREGATE_PROMPT),
                          "--batch-new-tokens", str(AGGREGATE_NEW)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma-separated weight formats, each optionally with a KV cache "
                        "dtype: int8,w8a8+kv-int8 (default: every weight format, KV auto)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-cpp", action="store_true")
    p.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.formats.split(","):
        format_options(name)  # refuse a typo before minutes of measuring
    threads = len(os.sched_getaffinity(0))
    report: dict = {"threads": threads, "torch": torch.__version__, "formats": {}}
    bandwidth = read_bandwidth_gbs(5)
    report["read_bandwidth_gbs"] = bandwidth
    print(f"read bandwidth {bandwidth:.1f} GB/s, {threads} threads", flush=True)
    if args.llama_cpp:  # first: a run cut short still has its baseline
        report["llama_cpp"] = llama_cpp(resolve_model_path(args.model), batches,
                                        args.repeats)
        print("llama.cpp", json.dumps(report["llama_cpp"]), flush=True)
    for name in args.formats.split(","):
        r = measure_format(args.model, name, batches, bandwidth, args.repeats)
        report["formats"][name] = r
        print(name, json.dumps(r), flush=True)
    print(tables(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


def tables(report: dict) -> str:
    ref = report.get("llama_cpp")
    lines = ["| format | MB read/token | ceiling tok/s | decode tok/s | vs ceiling | "
             "vs llama.cpp |", "|---|---|---|---|---|---|"]
    for name, r in report["formats"].items():
        vs = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}" if ref else "-"
        lines.append(f"| {name} | {r['bytes_per_token'] / 1e6:.0f} | {r['ceiling_tok_s']:.0f} | "
                     f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / r['ceiling_tok_s']:.0%} | "
                     f"{vs} |")
    if ref:
        lines.append(f"| llama.cpp (same GGUF) | | | {ref['decode_tok_s']:.1f} | | 1.00 |")
    first = next(iter(report["formats"].values()))
    batches = list(first["aggregate_tok_s"])
    lines += ["", "| format | " + " | ".join(f"batch {b} tok/s" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    ref_agg = {int(b): max(v.values()) for b, v in ref.get("aggregate_tok_s", {}).items()} \
        if ref else {}
    for name, r in report["formats"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{r['aggregate_tok_s'][b]:.1f}"
            + (f" ({r['aggregate_tok_s'][b] / ref_agg[b]:.2f}x)" if b in ref_agg else "")
            for b in batches) + " |")
    if ref_agg:
        lines.append("| llama.cpp (same GGUF, better KV layout) | " + " | ".join(
            f"{ref_agg[b]:.1f}" if b in ref_agg else "-" for b in batches) + " |")
    lines += ["", "| format | prefill 512 tok/s | prefill 1024 tok/s | vs llama.cpp |",
              "|---|---|---|---|"]
    for name, r in report["formats"].items():
        pf = r["prefill_tok_s"]
        vs = "-"
        if ref:
            vs = " / ".join(f"{pf[n] / ref['prefill_tok_s'][str(n)]:.2f}" for n in (512, 1024))
        lines.append(f"| {name} | {pf[512]:.0f} | {pf[1024]:.0f} | {vs} |")
    if ref:
        pf = ref["prefill_tok_s"]
        lines.append(f"| llama.cpp | {pf['512']:.0f} | {pf['1024']:.0f} | 1.00 / 1.00 |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
