"""The server against its own engine: what HTTP, detokenization and the process boundary cost.

For each concurrency level c, c requests (distinct random prompts of --prompt-tokens, greedy,
exactly --max-tokens each) run at once, first on the engine alone in this process
(EngineCore stepped in a loop, as `LLM.generate` does), then through `llmserve serve` as
streaming completions. Printed per level: time per output token after the first (TPOT,
mean over requests) and output tokens/s of the whole batch, engine and server side by side.
With --baseline-src DIR the server is also run from another checkout's src/ (the same
requests), e.g. the commit before the engine moved to its own process:

    git worktree add /tmp/base d4ce39b
    .venv/bin/python benchmarks/engine_vs_server.py --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def prompts(n: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run_engine(engine, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(mean TPOT, output tokens/s) of the batch run at once on EngineCore."""
    from llmserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for i, ids in enumerate(batch):
        engine.add_request(f"r{i}-{start}", ids, params)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
    total = time.perf_counter() - start
    tpots = [(last[r] - first[r]) / (max_tokens - 1) for r in first]
    return statistics.mean(tpots), len(batch) * max_tokens / total


async def _stream_one(client: httpx.AsyncClient, url: str, model: str, ids: list[int],
                      max_tokens: int) -> tuple[float, float, int]:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
    assert first is not None and last is not None
    return first, last, tokens


async def run_server(url: str, model: str, batch: list[list[int]],
                     max_tokens: int) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(
            max_connections=len(batch) + 4)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[_stream_one(client, url, model, ids, max_tokens)
                                         for ids in batch])
        total = time.perf_counter() - start
    tpots = [(last - first) / (tokens - 1) for first, last, tokens in results]
    return statistics.mean(tpots), sum(t for _, _, t in results) / total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, src: str | None, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = src
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port",
             str(self.port), *extra], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see "
                                 f"{self.log.name}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("server not ready in 600 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=230)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="batches per level and side")
    ap.add_argument("--baseline-src", default=None,
                    help="also run the server from this src/ directory")
    ap.add_argument("server_args", nargs="*", help="extra options for both (after --)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    from llmserve.config import EngineConfig, ModelConfig
    from llmserve.engine.core import EngineCore

    engine = EngineCore(EngineConfig(model=ModelConfig(args.model)))
    engine.warm_up()
    results: dict[str, dict[int, list[tuple[float, float]]]] = {"engine": {}}
    seed = 0
    for c in levels:
        for _ in range(args.rounds):
            seed += 1
            results["engine"].setdefault(c, []).append(
                run_engine(engine, prompts(c, args.prompt_tokens, seed), args.max_tokens))
    del engine
    sides = [("server", None)] + ([("baseline server", args.baseline_src)]
                                  if args.baseline_src else [])
    for name, src in sides:
        server = Server(args.model, src, args.server_args)
        try:
            for c in levels:
                for _ in range(args.rounds):
                    seed += 1
                    results.setdefault(name, {}).setdefault(c, []).append(asyncio.run(
                        run_server(server.url, args.model,
                                   prompts(c, args.prompt_tokens, seed), args.max_tokens)))
        finally:
            server.stop()

    print(f"# {args.model}; {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens"
          f" each, greedy; {args.rounds} rounds per level (mean); {os.cpu_count()} CPUs")
    head = "| streams | side | TPOT ms | vs engine | output tok/s | vs engine |"
    print(head)
    print("|---|---|---|---|---|---|")
    for c in levels:
        e_tpot = statistics.mean(t for t, _ in results["engine"][c])
        e_tps = statistics.mean(s for _, s in results["engine"][c])
        for name in results:
            tpot = statistics.mean(t for t, _ in results[name][c])
            tps = statistics.mean(s for _, s in results[name][c])
            print(f"| {c} | {name} | {tpot * 1e3:.2f} | {tpot / e_tpot:.2f}x | {tps:.1f} | "
                  f"{tps / e_tps:.2f}x |")


if __name__ == "__main__":
    main()
