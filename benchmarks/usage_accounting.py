"""What per-key accounting costs a server: requests/s and latency of small requests with a
database key (limits checked, usage recorded) against the same server with no database.

Two `llmserve serve` processes, started alike but for their access: "on" reads its key from
a fresh usage database (requests and tokens limits set high enough never to refuse, so the
limiter runs on every request) and records usage; "off" has `--no-database` and a shared
`--api-key`. Both are up at once; rounds alternate (on, off, off, on, ...) so a drift of
the machine's speed cancels. Each round sends the same small completions (a short prompt,
a few output tokens, greedy) at a fixed concurrency.

    .venv/bin/python benchmarks/usage_accounting.py \
        --output benchmarks/results/usage_accounting.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
from serverproc import LocalServer

SHARED_KEY = "sk-benchmark-shared"


async def one_round(url: str, key: str, model: str, n: int, concurrency: int,
                    max_tokens: int) -> tuple[float, list[float]]:
    """(wall seconds, each request's latency in seconds)."""
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": f"Request {i}: say hello.", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        async with sem:
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body)
            latencies.append(time.perf_counter() - start)
        r.raise_for_status()

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        return time.perf_counter() - start, latencies


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--server-args", default="--kv-cache-memory 0.5")
    ap.add_argument("--requests", type=int, default=200, help="per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="per side (alternating)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="usage-bench-")
    data_dir = os.path.join(work, "data")
    key = subprocess.run([sys.executable, "-m", "llmserve.cli", "keys", "create", "--name",
                          "bench", "--requests-per-minute", "100000000", "--tokens-per-minute",
                          "1000000000", "--data-dir", data_dir], check=True,
                         capture_output=True, text=True).stdout.strip()
    common = ["--model", args.model, *args.server_args.split()]
    sides = {
        "on": LocalServer([*common, "--data-dir", data_dir], os.path.join(work, "on.log"), "on"),
        "off": LocalServer([*common, "--no-database", "--api-key", SHARED_KEY],
                           os.path.join(work, "off.log"), "off"),
    }
    keys = {"on": key, "off": SHARED_KEY}
    try:
        for name, srv in sides.items():  # warm-up: first requests, allocator, connections
            asyncio.run(one_round(srv.url, keys[name], args.model, 16, args.concurrency,
                                  args.max_tokens))
        seconds = {"on": 0.0, "off": 0.0}
        latencies: dict[str, list[float]] = {"on": [], "off": []}
        ratios: list[float] = []
        p99_ratios: list[float] = []
        for r in range(args.rounds):
            rps, tails = {}, {}
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                wall, lat = asyncio.run(one_round(sides[name].url, keys[name], args.model,
                                                  args.requests, args.concurrency,
                                                  args.max_tokens))
                seconds[name] += wall
                latencies[name] += lat
                rps[name] = args.requests / wall
                tails[name] = 1000 * p99(lat)
            ratios.append(rps["on"] / rps["off"])
            p99_ratios.append(tails["on"] / tails["off"])
            print(f"round {r}: on {rps['on']:.1f} req/s p99 {tails['on']:.0f} ms, off "
                  f"{rps['off']:.1f} req/s p99 {tails['off']:.0f} ms; on/off req/s "
                  f"{ratios[-1]:.3f}, p99 {p99_ratios[-1]:.3f}", flush=True)
        total = args.requests * args.rounds
        result = {name: {"requests_per_s": total / seconds[name],
                         "p50_ms": 1000 * sorted(latencies[name])[len(latencies[name]) // 2],
                         "p99_ms": 1000 * p99(latencies[name])} for name in sides}
        sides["on"].stop()  # a clean shutdown writes what is still queued
        recorded = json.loads(subprocess.run(
            [sys.executable, "-m", "llmserve.cli", "usage", "--json", "--data-dir", data_dir],
            check=True, capture_output=True, text=True).stdout)["totals"]["requests"]
        ratio = result["on"]["requests_per_s"] / result["off"]["requests_per_s"]
        print(f"\n{'':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
        for name in sides:
            r_ = result[name]
            print(f"{name:>4} {r_['requests_per_s']:>8.1f} {r_['p50_ms']:>8.1f} "
                  f"{r_['p99_ms']:>8.1f}")
        print(f"on/off requests/s: {ratio:.3f} (rounds: "
              + " ".join(f"{x:.3f}" for x in ratios) + "); p99 on/off: "
              f"{result['on']['p99_ms'] / result['off']['p99_ms']:.3f}; requests recorded by "
              f"'on': {recorded} of {total + 16} sent")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"model": args.model, "server_args": args.server_args,
                           "requests_per_round": args.requests, "rounds": args.rounds,
                           "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                           "result": result, "ratio": ratio, "round_ratios": ratios,
                           "round_p99_ratios": p99_ratios,
                           "recorded": recorded, "sent": total + 16}, f,
                          indent=1)
    finally:
        for srv in sides.values():
            srv.stop()


if __name__ == "__main__":
    main()
