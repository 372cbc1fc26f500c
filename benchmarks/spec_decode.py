"""Speculative decoding on and off, through the server, at several concurrency levels.

Two `llmserve serve` processes with the same arguments, one with --speculative-config (the
other with --baseline-config, or none), are started alike and kept up side by side (an
idle server costs no CPU); each level runs the same requests on both (a fresh seed per
level), each run after POST /reset_prefix_cache, --repeats times, alternating which server
goes first (off, on, then on, off) so that a drift of the machine's speed cancels; the
ratio is of all repeats' tokens over their time.
Printed per workload and level: output tokens/s off and on and their ratio, TPOT p50, and
from the server's counters the acceptance rate (accepted / draft tokens) and the mean
accepted length (tokens emitted per verifying step: 1 + accepted / drafts).

    .venv/bin/python benchmarks/spec_decode.py --output benchmarks/results/spec_decode.json

Workloads: ``grounded`` (fix typos in, summarize, answer from a passage; rewrite code;
chat endpoint, the model stops by itself) and ``random`` (random words, nothing to copy,
exactly --random-output-len tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: argparse.Namespace, extra: list[str], log_dir: str, name: str):
    port = free_port()
    log = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", args.model,
           "--port", str(port), *args.server_args.split(), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} server exited; see {log.name}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} server not ready in 300 s")


def spec_counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("llmserve:spec_decode_num_") and "_total{" in line \
                and "per_pos" not in line:
            name = line.split("{", 1)[0].removeprefix("llmserve:spec_decode_num_")
            out[name.removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
    return out


def run_level(url: str, workload: str, concurrency: int, num: int, seed: int,
              args: argparse.Namespace, out_path: str) -> dict:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "serve", "--base-url", url,
           "--workload", workload, "--num-prompts", str(num), "--concurrency",
           str(concurrency), "--seed", str(seed), "--warmup", "0", "--reset-prefix-cache",
           "--no-progress", "--output", out_path]
    if workload == "grounded":
        cmd += ["--endpoint", "chat", "--no-ignore-eos"]
    else:
        cmd += ["--input-len", str(args.random_input_len),
                "--output-len", str(args.random_output_len)]
    before = spec_counters(url)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = spec_counters(url)
    with open(out_path) as f:
        result = json.load(f)["summary"]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result["spec"] = delta
    return result


def summarize(workload: str, c: int, n: int, runs: dict[str, list[dict]]) -> dict:
    def rate(rs):  # all repeats together: output tokens over time
        return sum(r["output_tokens"] for r in rs) / sum(r["duration_s"] for r in rs)

    def p50(rs):
        return 1e3 * statistics.median(r["tpot"]["p50"] or 0 for r in rs)

    spec = {k: sum(r["spec"].get(k, 0) for r in runs["on"])
            for k in ("drafts", "draft_tokens", "accepted_tokens")}
    drafts, tokens, acc = spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]
    off, on = rate(runs["off"]), rate(runs["on"])
    return dict(
        workload=workload, concurrency=c, requests=n, repeats=len(runs["on"]),
        off_tok_s=off, on_tok_s=on, ratio=on / off,
        ratio_per_repeat=[a["output_throughput"] / b["output_throughput"]
                          for a, b in zip(runs["on"], runs["off"])],
        off_tpot_p50_ms=p50(runs["off"]), on_tpot_p50_ms=p50(runs["on"]),
        output_tokens=[r["output_tokens"] for r in runs["off"] + runs["on"]],
        errors=[r["errors"] for r in runs["off"] + runs["on"] if r["errors"]],
        drafts=drafts, draft_tokens=tokens, accepted_tokens=acc,
        acceptance_rate=acc / tokens if tokens else None,
        mean_accepted_length=1 + acc / drafts if drafts else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--server-args", default="", help="extra `llmserve serve` arguments for both")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--baseline-config", default=None, metavar="JSON",
                   help="the 'off' server's --speculative-config (default: speculation off), "
                        "to compare two methods in one run")
    p.add_argument("--workloads", default="grounded,random")
    p.add_argument("--levels", default="1,16,64")
    p.add_argument("--requests", default="12,32,64",
                   help="requests per level (comma-separated, one per level)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per server and level, alternating which server goes first")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    log_dir = tempfile.mkdtemp(prefix="spec_bench_")
    baseline = ["--speculative-config", args.baseline_config] if args.baseline_config else []
    off, off_url = start(args, baseline, log_dir, "off")
    on, on_url = start(args, ["--speculative-config", args.speculative_config], log_dir, "on")
    rows = []
    try:
        for workload in args.workloads.split(","):
            for i, (c, n) in enumerate(zip(levels, counts)):
                seed = 1000 * i + 17
                runs: dict[str, list[dict]] = {"off": [], "on": []}
                for rep in range(args.repeats):  # off, on, then on, off: drift cancels
                    for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                        url = off_url if name == "off" else on_url
                        runs[name].append(run_level(
                            url, workload, c, n, seed, args,
                            os.path.join(log_dir, f"{workload}-{c}-{name}-{rep}.json")))
                rows.append(summarize(workload, c, n, runs))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc in (off, on):
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.baseline_config:
        print(f"\n'off' below: the baseline config {args.baseline_config}", end="")
    print(f"\nspeculative config: {args.speculative_config}; server args: "
          f"{args.server_args or '(defaults)'}; logs in {log_dir}")
    print("| workload | streams | requests x repeats | off tok/s | on tok/s | on/off (per "
          "repeat) | TPOT p50 off/on (ms) | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        each = ", ".join(f"{x:.2f}" for x in r["ratio_per_repeat"])
        print(f"| {r['workload']} | {r['concurrency']} | {r['requests']} x {r['repeats']} | "
              f"{r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['ratio']:.2f}x ({each}) | "
              f"{r['off_tpot_p50_ms']:.1f} / {r['on_tpot_p50_ms']:.1f} | {acc} | {mal} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"speculative_config": args.speculative_config,
                       "baseline_config": args.baseline_config,
                       "server_args": args.server_args, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
