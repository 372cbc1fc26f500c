"""One streamed request against an OpenAI-compatible server, timed from the stream itself."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from llmserve.bench.workloads import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_words: int
    max_tokens: int
    start: float  # seconds since the run began
    ttft: float | None = None  # seconds to the first token-bearing chunk
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between token-bearing chunks
    output_tokens: int = 0  # from usage when the server reports it, else chunks
    prompt_tokens: int | None = None  # from usage
    error: str | None = None  # "429", "5xx", "4xx", "timeout", "connection", "stream"
    detail: str | None = None
    tokens_from_usage: bool = False  # False: output_tokens counts chunks (a lower bound)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str | None
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout: float = 600.0


async def send(client: httpx.AsyncClient, target: Target, req: BenchRequest,
               t0: float) -> RequestResult:
    body: dict = {"stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": req.max_tokens, "temperature": target.temperature}
    if target.model:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        url = f"{target.base_url}/chat/completions"
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        url = f"{target.base_url}/completions"
        body["prompt"] = req.prompt
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = time.perf_counter()
    result = RequestResult(False, req.prompt_words, req.max_tokens, start - t0)
    chunks = 0
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers,
                                 timeout=target.timeout) as r:
            if r.status_code != 200:
                await r.aread()
                result.error = _status_kind(r.status_code)
                result.detail = r.text[:300]
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error, result.detail = "stream", str(payload["error"])[:300]
                    return result
                usage = payload.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.tokens_from_usage = True
                if _has_token(payload):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except httpx.TimeoutException:
        result.error = "timeout"
        return result
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error, result.detail = "connection", f"{type(e).__name__}: {e}"[:300]
        return result
    result.e2e = time.perf_counter() - start
    if not result.tokens_from_usage:  # a chunk holds one token or more
        result.output_tokens = chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "stream"
        result.detail = "no token arrived"
    return result


# What a chat delta's tokens may come as besides content (vLLM's reasoning parsers and
# tool calls): a chunk with any of them carries tokens, as vLLM's benchmark counts it.
_GENERATED = ("reasoning_content", "reasoning", "tool_calls", "function_call")


def _has_token(payload: dict) -> bool:
    """A chunk carries a token if it has text (content, reasoning or a tool call), or is a
    mid-stream chunk whose text is held back (empty, no finish_reason). A final chunk with
    only a finish_reason, the role-only opening chunk of chat and the usage chunk carry
    none."""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta")
        if delta is not None:
            if any(delta.get(name) for name in _GENERATED):
                return True
            if delta.get("role") and not delta.get("content"):
                continue
            text = delta.get("content")
        else:
            text = choice.get("text")
        if text or (text is not None and choice.get("finish_reason") is None):
            return True
    return False


def _status_kind(status: int) -> str:
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    return "4xx"


# ---- the server's prefix cache -------------------------------------------------------------

# Prefix-cache hit counters by server: llmserve's, vLLM's (V1, then V0's GPU name).
_HIT_COUNTERS = ("llmserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                 "vllm:gpu_prefix_cache_hits_total")


def _root(target: Target) -> str:
    return target.base_url.removesuffix("/v1")


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def prefix_cache_hits(target: Target) -> float | None:
    """The server's cumulative prefix-cache hits from its /metrics (None: not reported)."""
    try:
        r = httpx.get(f"{_root(target)}/metrics", headers=_headers(target), timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
              if line.startswith(_HIT_COUNTERS)]
    return sum(values) if values else None


def reset_prefix_cache(target: Target, wait: float = 60.0) -> str:
    """POST /reset_prefix_cache, waiting while the server still runs requests (409).
    Returns "reset", or "not offered" when the server has no such endpoint."""
    deadline = time.monotonic() + wait
    url = f"{_root(target)}/reset_prefix_cache"
    while True:
        try:
            r = httpx.post(url, headers=_headers(target), timeout=30)
        except httpx.HTTPError as e:
            raise ValueError(f"--reset-prefix-cache: cannot reach {url} "
                             f"({type(e).__name__}: {e})") from None
        if r.status_code == 200:
            return "reset"
        if r.status_code in (404, 405):
            return "not offered"
        if r.status_code != 409 or time.monotonic() > deadline:
            raise ValueError(f"--reset-prefix-cache: POST {url} answered {r.status_code}: "
                             f"{r.text[:200]}")
        time.sleep(0.5)
