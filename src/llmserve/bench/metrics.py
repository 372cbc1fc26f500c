"""Aggregates over request results: latency percentiles, throughput, goodput against SLOs."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from llmserve.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft=500ms,tpot=50ms,e2e=10s"`` -> {"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|s)?", value.strip())
        if name not in SLO_METRICS or m is None:
            raise ValueError(f"bad SLO {part!r}: use NAME=VALUE[ms|s] with NAME in "
                             f"{', '.join(SLO_METRICS)}, e.g. ttft=500ms,tpot=50ms")
        scale = 1e-3 if m.group(2) == "ms" else 1.0
        out[name] = float(m.group(1)) * scale
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e,
              "itl": max(r.itl) if r.itl else 0.0}
    return all(values[k] is None or values[k] <= limit for k, limit in slo.items())


def summarize(results: list[RequestResult], duration: float,
              slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = [r for r in ok if meets_slo(r, slo)]
    summary: dict[str, Any] = {
        "duration_s": duration,
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        # what the server said, once per kind of error
        "error_details": {r.error: r.detail for r in reversed(results)
                          if not r.ok and r.error is not None},
        # completed requests whose output tokens are chunks: no usage came back
        "tokens_from_chunks": sum(not r.tokens_from_usage for r in ok),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration if duration else 0.0,
        "slo": slo,
        "good_requests": len(good),
        "goodput": len(good) / duration if duration else 0.0,
        "goodput_fraction": len(good) / len(results) if results else 0.0,
    }
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    for name, values in series.items():
        summary[name] = stats(values)
    return summary


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(values)
    return {"mean": sum(ordered) / len(ordered),
            **{f"p{p}": percentile(ordered, p) for p in PERCENTILES}}


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(ordered) == 1:
        return ordered[0]
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
