"""The HTTP server on a device, with asynchronous scheduling on and off, under load.

Builds the SmolLM2-135M-shaped random model of ``cuda_bench.py``, then for each round and
mode starts ``llmserve serve`` on it (``--device``; ``--no-async-scheduling`` for "sync"),
runs ``llmserve bench serve`` at each concurrency (random prompts, greedy, ``ignore_eos``),
and stops the server. Rounds alternate the modes; every ratio is within one round. Prints
a table: output tokens/s, TTFT p50 and TPOT p50 by mode and concurrency.

    python benchmarks/cuda_server_bench.py --device cuda --tokenizer .gpu/tokenizer
    python benchmarks/cuda_server_bench.py --device cpu --concurrency 1,4 --rounds 1  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_bench as cb

MODES = {"async": ["--async-scheduling"], "sync": ["--no-async-scheduling"]}


def start(model: Path, device: str, port: int, extra: list[str], work: Path):
    log = work / f"server-{port}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model), "--device",
           device, "--port", str(port), "--max-model-len", "2048", "--kv-cache-memory", "4",
           "--quantization", "none", "--max-num-seqs", "64", *extra]
    env = {**os.environ, "LLMSERVE_DATA_DIR": str(work / "data")}
    with open(log, "w") as out:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    start_t = time.monotonic()
    while time.monotonic() - start_t < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready in 300 s; log: {log}")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(port: int, concurrency: int, requests: int, input_len: int, output_len: int,
          out: Path) -> dict:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--concurrency", str(concurrency), "--num-prompts",
           str(requests), "--input-len", str(input_len), "--output-len", str(output_len),
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="server-bench-"))
    model, _ = cb.build_model_dir(work / "model", cb.SMOLLM2_135M, args.tokenizer)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for rnd in range(args.rounds):
        order = list(MODES) if rnd % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            proc = start(model, args.device, args.port, MODES[mode], work)
            try:
                for c in levels:
                    res = bench(args.port, c, max(c * args.requests_per_stream, 4),
                                args.input_len, args.output_len, work / f"{mode}-{rnd}-{c}.json")
                    row = {"round": rnd, "mode": mode, "concurrency": c,
                           "output_tok_s": res["output_throughput"],
                           "ttft_p50_ms": 1e3 * (res["ttft"]["p50"] or float("nan")),
                           "tpot_p50_ms": 1e3 * (res["tpot"]["p50"] or float("nan")),
                           "errors": res["errors"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop(proc)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("| streams | round | async tok/s | sync tok/s | async / sync | TTFT p50 async / sync ms "
          "| TPOT p50 async / sync ms |")
    print("|---|---|---|---|---|---|---|")
    for rnd in range(args.rounds):
        for c in levels:
            a, s = ({r["mode"]: r for r in rows if r["round"] == rnd and r["concurrency"] == c}[m]
                    for m in ("async", "sync"))
            print(f"| {c} | {rnd + 1} | {a['output_tok_s']:.0f} | {s['output_tok_s']:.0f} | "
                  f"{a['output_tok_s'] / s['output_tok_s']:.2f}x | {a['ttft_p50_ms']:.1f} / "
                  f"{s['ttft_p50_ms']:.1f} | {a['tpot_p50_ms']:.2f} / {s['tpot_p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
