"""Every error status in OpenAI's envelope, with Retry-After where it applies."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _envelope(r: httpx.Response, status: int, param: str | None = None,
              code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("body, param, fragment", [
    ({"temperature": -1}, "temperature", "temperature must be in [0, 2], got -1"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k", "top_k must be -1 or 0"),
    ({"logprobs": 50}, "logprobs", "logprobs must be in [0, 20], got 50"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0"),
    ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"n": 0}, "n", "n must be in [1, 128]"),
])
def test_invalid_parameters_are_400(tiny_server, body, param, fragment):
    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH,
                   json={"model": tiny_server.model, "prompt": "hi", **body})
    err = _envelope(r, 400, param=param)
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"


def test_context_length_exceeded_is_400_never_truncated(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH,
                   json={"model": tiny_server.model, "prompt": [5] * 1000, "max_tokens": 100})
    err = _envelope(r, 400, param="max_tokens", code="context_length_exceeded")
    assert "1024" in err["message"]
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "max_tokens": 2000,
                         "messages": [{"role": "user", "content": "hi"}]})
    _envelope(r, 400, code="context_length_exceeded")


def test_missing_or_wrong_api_key_is_401_but_probes_stay_open(tiny_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{tiny_server.v1}/completions", headers=headers,
                       json={"model": tiny_server.model, "prompt": "hi"})
        _envelope(r, 401, code="invalid_api_key")
    assert httpx.get(f"{tiny_server.v1}/models").status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{tiny_server.url}{path}").status_code == 200


def test_unknown_model_is_404(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    _envelope(r, 404, param="model", code="model_not_found")


def test_oversized_body_is_413(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH,
                   json={"model": tiny_server.model, "prompt": "x" * (5 * 1024 * 1024)})
    _envelope(r, 413)


def test_malformed_json_and_unsupported_features_are_400(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/completions", headers={**AUTH,
                   "content-type": "application/json"}, content=b"{not json")
    _envelope(r, 400)
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "messages": []})
    _envelope(r, 400, param="messages")
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "tools": [{"type": "function"}],
                         "messages": [{"role": "user", "content": "hi"}]})
    _envelope(r, 400, param="tools")


@pytest.fixture(scope="module")
def tight_server(tiny_path, tmp_path_factory):
    """One sequence at a time, a queue of 2, a 1-second deadline."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("tight"), "--max-num-seqs", "1",
                          "--max-queued-requests", "2", "--request-timeout", "1",
                          "--max-model-len", "1024", name="tight")
    yield server
    assert server.stop() == 0


def test_full_queue_is_429_with_retry_after(tight_server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": tight_server.model, "prompt": "hi", "max_tokens": 30,
                    "ignore_eos": True}
            return await asyncio.gather(*[client.post(f"{tight_server.v1}/completions",
                                                      json=body) for _ in range(8)])

    responses = asyncio.run(run())
    statuses = sorted(r.status_code for r in responses)
    assert 429 in statuses and 200 in statuses, statuses
    for r in responses:
        if r.status_code == 429:
            _envelope(r, 429, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    m = tight_server.wait_idle()
    labels = f'model_name="{tight_server.model}",reason="queue_full"'
    key = f"llmserve:request_rejected_total{{{labels}}}"
    assert m[key] >= 1


def test_deadline_ends_a_request_with_a_clear_error(tight_server):
    r = httpx.post(f"{tight_server.v1}/completions", timeout=60,
                   json={"model": tight_server.model, "prompt": "hi", "max_tokens": 1000,
                         "ignore_eos": True, "min_tokens": 1000})
    err = _envelope(r, 408, code="request_timeout")
    assert "timed out after 1 s" in err["message"]
    with httpx.stream("POST", f"{tight_server.v1}/completions", timeout=60,
                      json={"model": tight_server.model, "prompt": "hi", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "request_timeout" in lines[-2]
    m = tight_server.wait_idle()
    assert m["llmserve:kv_cache_usage_perc"] == 0
