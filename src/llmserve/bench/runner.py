"""Drive a workload against a server: fixed concurrency or an arrival rate."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from llmserve.bench.client import RequestResult, Target, send
from llmserve.bench.metrics import summarize
from llmserve.bench.workloads import BenchRequest


@dataclass(frozen=True)
class Arrivals:
    concurrency: int | None = None  # fixed number of requests in flight
    request_rate: float | None = None  # requests/s (inf: all at once)
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    max_concurrency: int | None = None  # cap in-flight requests in rate mode
    duration: float | None = None  # stop sending after this many seconds
    warmup: int = 0  # requests sent (and not counted) before the run, other prompts
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of --concurrency or --request-rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return f"rate={self.request_rate:g}/s, burstiness={self.burstiness:g}"


def run_benchmark(target: Target, requests: list[BenchRequest], arrivals: Arrivals,
                  slo: dict[str, float], progress: bool = True,
                  warmup: list[BenchRequest] | None = None) -> dict[str, Any]:
    """Send ``warmup`` (not counted), then ``requests`` as ``arrivals`` says."""
    return asyncio.run(_run(target, requests, arrivals, slo, progress, warmup or []))


async def _run(target: Target, requests: list[BenchRequest], arrivals: Arrivals,
               slo: dict[str, float], progress: bool,
               warmup: list[BenchRequest]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout) as client:
        if warmup:
            await asyncio.gather(*[send(client, target, r, time.perf_counter())
                                   for r in warmup])
        bar = tqdm(total=len(requests), desc=arrivals.label(), unit="req", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True)
        t0 = time.perf_counter()
        results = await (_closed_loop(client, target, requests, arrivals, t0, bar)
                         if arrivals.concurrency is not None
                         else _open_loop(client, target, requests, arrivals, t0, bar))
        duration = time.perf_counter() - t0
        bar.close()
    return {
        "target": asdict(target) | {"api_key": None},
        "arrivals": asdict(arrivals),
        "summary": summarize(results, duration, slo),
        "requests": [asdict(r) | {"tpot": r.tpot} for r in results],
    }


async def _closed_loop(client, target, requests, arrivals, t0, bar) -> list[RequestResult]:
    """``concurrency`` workers each send the next request as soon as theirs finishes."""
    results: list[RequestResult] = []
    queue = iter(requests)
    deadline = None if arrivals.duration is None else t0 + arrivals.duration

    async def worker() -> None:
        for req in queue:
            if deadline is not None and time.perf_counter() > deadline:
                return
            results.append(await send(client, target, req, t0))
            bar.update(1)

    await asyncio.gather(*[worker() for _ in range(arrivals.concurrency)])
    return results


async def _open_loop(client, target, requests, arrivals, t0, bar) -> list[RequestResult]:
    """Requests arrive on a schedule (gamma inter-arrival times with mean 1 / rate), whether
    or not earlier ones finished; ``max_concurrency`` caps how many are in flight."""
    rng = random.Random(arrivals.seed)
    rate = arrivals.request_rate
    limit = asyncio.Semaphore(arrivals.max_concurrency or len(requests) or 1)
    deadline = None if arrivals.duration is None else t0 + arrivals.duration

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            r = await send(client, target, req, t0)
        bar.update(1)
        return r

    tasks = []
    next_at = t0
    for req in requests:
        if deadline is not None and time.perf_counter() > deadline:
            break
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(req)))
        if rate != float("inf"):
            theta = 1.0 / (rate * arrivals.burstiness)
            next_at += rng.gammavariate(arrivals.burstiness, theta)
    return list(await asyncio.gather(*tasks))
