"""/health latency of a live `llmserve serve`, idle and with the engine saturated.

Starts the server (the default model unless --model), measures --checks health requests one
after another on an idle server, then again while --streams long completions keep the engine
busy, and prints the percentiles of both side by side. The engine runs in its own process,
so liveness should not wait on it; tests/e2e asserts the behaviour, this script the figure.

With --big-prompts N, instead of streams: N prompts of --big-prompt-chars characters arrive
at once (the engine-process issue's case: four 3.9 MB prompts blocked /health for 25 s when
they were tokenized on the event loop). PYTHONPATH=<other checkout>/src measures another
commit's server the same way.

    .venv/bin/python benchmarks/health_under_load.py [--model M] [--streams 16] [--checks 50]
    .venv/bin/python benchmarks/health_under_load.py --big-prompts 4 [--big-prompt-chars N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, port: int, extra: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port",
           str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # inherits PYTHONPATH
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready in 300 s")


async def health_latencies(client: httpx.AsyncClient, url: str, checks: int) -> list[float]:
    out = []
    for _ in range(checks):
        t0 = time.perf_counter()
        r = await client.get(f"{url}/health")
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
        await asyncio.sleep(0.02)
    return out


async def measure(url: str, model: str, streams: int, checks: int, prompt_len: int,
                  max_tokens: int) -> tuple[list[float], list[float], float]:
    async with httpx.AsyncClient(timeout=600) as client:
        idle = await health_latencies(client, url, checks)
        body = {"model": model, "prompt": [9] * prompt_len, "max_tokens": max_tokens,
                "ignore_eos": True}
        load = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json=body))
                for _ in range(streams)]
        while True:  # until the engine runs them
            text = (await client.get(f"{url}/metrics")).text
            running = next((float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("llmserve:num_requests_running")), 0.0)
            if running >= min(streams, 1):
                break
            await asyncio.sleep(0.05)
        busy = await health_latencies(client, url, checks)
        still = sum(not t.done() for t in load) / streams
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        return idle, busy, still


async def measure_big_prompts(url: str, model: str, count: int, chars: int,
                              checks: int) -> tuple[list[float], list[float], list[int], float]:
    """/health while ``count`` prompts of ``chars`` characters arrive at once (each is
    tokenized, or refused as too long, and answered with max_tokens 1)."""
    async with httpx.AsyncClient(timeout=600) as client:
        idle = await health_latencies(client, url, checks)
        text = ("word " * (chars // 5 + 1))[:chars]
        body = {"model": model, "prompt": text, "max_tokens": 1}
        t0 = time.perf_counter()
        big = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json=body))
               for _ in range(count)]
        busy: list[float] = []
        while not all(t.done() for t in big) or len(busy) < checks:
            busy += await health_latencies(client, url, 1)
        elapsed = time.perf_counter() - t0
        return idle, busy, [t.result().status_code for t in big], elapsed


def summary(xs: list[float]) -> str:
    qs = statistics.quantiles(xs, n=100, method="inclusive")
    return (f"p50 {statistics.median(xs) * 1e3:.1f} ms, p90 {qs[89] * 1e3:.1f} ms, "
            f"p99 {qs[98] * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--checks", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--big-prompts", type=int, default=0,
                    help="instead of streams: send this many long prompts at once")
    ap.add_argument("--big-prompt-chars", type=int, default=4_000_000)
    ap.add_argument("server_args", nargs="*", help="extra `llmserve serve` options (after --)")
    args = ap.parse_args()
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        proc = start(args.model, port, args.server_args, log)
        if args.big_prompts:
            try:
                idle, busy, statuses, elapsed = asyncio.run(measure_big_prompts(
                    f"http://127.0.0.1:{port}", args.model, args.big_prompts,
                    args.big_prompt_chars, args.checks))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            print(f"# {args.model}, {os.cpu_count()} CPUs, {args.big_prompts} prompts of "
                  f"{args.big_prompt_chars} characters at once (answered {statuses} after "
                  f"{elapsed:.1f} s)")
            print(f"/health idle:        {summary(idle)}")
            print(f"/health big prompts: {summary(busy)}  ({len(busy)} checks)")
            return
        try:
            idle, busy, still = asyncio.run(measure(
                f"http://127.0.0.1:{port}", args.model, args.streams, args.checks,
                args.prompt_len, args.max_tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"# {args.model}, {os.cpu_count()} CPUs, {args.streams} streams of "
          f"{args.prompt_len} + {args.max_tokens} tokens, {args.checks} checks each")
    print(f"/health idle:      {summary(idle)}")
    print(f"/health saturated: {summary(busy)}  ({still:.0%} of the streams still running "
          f"after the last check)")
    print(f"ratio of medians (saturated / idle): "
          f"{statistics.median(busy) / statistics.median(idle):.1f}x")


if __name__ == "__main__":
    main()
