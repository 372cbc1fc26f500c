"""Every error status in OpenAI's envelope, with Retry-After where it applies."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time

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
    _envelope(r, 400, param="max_tokens", code="context_length_exceeded")
    # The field the client sent is the one named; a prompt too long by itself is the
    # prompt's (or the messages') fault, whatever max_tokens says.
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "max_completion_tokens": 2000,
                         "messages": [{"role": "user", "content": "hi"}]})
    err = _envelope(r, 400, param="max_completion_tokens", code="context_length_exceeded")
    assert "max_completion_tokens (2000)" in err["message"]
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH,
                   json={"model": tiny_server.model, "max_tokens": 1,
                         "messages": [{"role": "user", "content": "hi " * 1100}]})
    _envelope(r, 400, param="messages", code="context_length_exceeded")
    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH,
                   json={"model": tiny_server.model, "prompt": [5] * 1100, "max_tokens": 1})
    _envelope(r, 400, param="prompt", code="context_length_exceeded")


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
    _envelope(r, 400, param="tools.0.function")


@pytest.mark.parametrize("path, body, param, fragment", [
    ("completions", {"prompt": "hi", "max_token": 5}, "max_token",
     "Unrecognized request argument supplied: max_token"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "nmae": "x"}]},
     "messages.0.nmae", "Unrecognized request argument supplied: nmae (in messages.0)"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "this model accepts text only"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["if"]'),
    ("completions", {"prompt": "hi", "guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ("completions", {"prompt": "hi", "guided_json": {"type": "object"},
                     "structured_outputs": {"regex": "a"}}, None, "both constrain the output"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "names the function 'g', which is not among the tools (f)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "reasoning_effort": "high"}, "reasoning_effort",
     "reasoning_effort is not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "this server decodes with llguidance"),
])
def test_what_cannot_be_honoured_is_refused_by_name(tiny_server, path, body, param, fragment):
    """Nothing silently ignored: typos, images, unenforceable schemas and unsupported
    options are a 400 naming the field."""
    r = httpx.post(f"{tiny_server.v1}/{path}", headers=AUTH,
                   json={"model": tiny_server.model, **body})
    err = _envelope(r, 400, param=param)
    assert fragment in err["message"], err


def test_documented_no_effect_fields_are_accepted(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH, json={
        "model": tiny_server.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "user": "u-1", "store": False, "metadata": {"team": "a"},
        "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s",
        "stream_options": None})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def tight_server(tiny_path, tmp_path_factory):
    """One sequence at a time, a queue of 2, a 1-second deadline (which the 30-token
    requests here meet)."""
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
    # into an idle engine, the burst fills its running slot before its queue: 1 + 2 taken.
    # Each taken request finishes, or on a host slowed by other work reaches the 1-second
    # deadline while it waits its turn (408): taking it is what is checked here.
    assert statuses.count(200) + statuses.count(408) >= 3, statuses
    for r in responses:
        if r.status_code == 408:
            _envelope(r, 408, code="request_timeout")
        if r.status_code == 429:
            _envelope(r, 429, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    m = tight_server.wait_idle()
    labels = f'model_name="{tight_server.model}",reason="queue_full"'
    key = f"llmserve:request_rejected_total{{{labels}}}"
    assert m[key] >= 1


@pytest.fixture(scope="module")
def deadline_server(tmp_path_factory):
    """The default model with a half-second deadline: 1000 tokens take it seconds on any
    CPU (the tiny model decodes them in about one on this one, too close to a deadline)."""
    server = start_server("smollm2-135m-instruct", tmp_path_factory.mktemp("deadline"),
                          "--max-num-seqs", "1", "--request-timeout", "0.5",
                          "--max-model-len", "1024", name="deadline")
    yield server
    assert server.stop() == 0


def test_deadline_ends_a_request_with_a_clear_error(deadline_server):
    server = deadline_server
    r = httpx.post(f"{server.v1}/completions", timeout=60,
                   json={"model": server.model, "prompt": "hi", "max_tokens": 1000,
                         "ignore_eos": True, "min_tokens": 1000})
    err = _envelope(r, 408, code="request_timeout")
    assert "timed out after 0.5 s" in err["message"]
    with httpx.stream("POST", f"{server.v1}/completions", timeout=60,
                      json={"model": server.model, "prompt": "hi", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "request_timeout" in lines[-2]
    m = server.wait_idle()
    assert m["llmserve:kv_cache_usage_perc"] == 0


# ---- inputs that used to reach code that raises ------------------------------------------


def _chat(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


def _schema(properties: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": properties}}}


def _tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "lone surrogate (U+D800)"),
    ("/v1/completions", {"prompt": ["ok", "nul\x00"]}, "prompt", "NUL character"),
    ("/v1/chat/completions", _chat("x\udfff"), "messages.0.content", "lone surrogate"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": 5}]), "messages.0.content",
     "'text' must be a string, got int"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": None}]), "messages.0.content",
     "got null"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": ["a"]}]), "messages.0.content",
     "got list"),
    ("/v1/chat/completions", _chat([{"type": "image_url", "image_url": {"url": "x"}}]),
     "messages.0.content", "text only"),
    ("/v1/chat/completions", {**_chat("hi"), "top_k": 2**63}, "top_k",
     "up to 2147483647, got 9223372036854775808"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed", "seed must be in [-"),
    ("/v1/completions", {"prompt": "hi", "priority": 2**40}, "priority",
     "less than or equal to 2147483647, got 1099511627776"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 2**70}, "min_tokens",
     "min_tokens must be <= max_tokens"),
    ("/v1/chat/completions", {**_chat("hi"), "min_tokens": 2**70, "max_tokens": None}, None,
     "min_tokens (1180591620717411303424) exceeds"),
    ("/v1/completions", {"prompt": [2**40]}, None, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**40]}, None, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(2**70): 1}}, "logit_bias",
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop.0", "lone surrogate"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "lone surrogate"),
    # anywhere in the body, not only in text fields: a schema's property names, a tool's
    # description, a call's arguments (these reached the engine or the tokenizer)
    ("/v1/completions", {"prompt": "hi", "response_format": _schema({"\ud800": {}})},
     "response_format.json_schema.schema.properties",
     "a key in response_format.json_schema.schema.properties has a lone surrogate (U+D800)"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "array", "minItems": 10**30}},
     "guided_json", "Expected positive integer for 'minItems'"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"minimum": float("nan")}},
     "guided_json", "NaN and Infinity are not JSON numbers"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a\udc00"}, "guided_regex",
     "lone surrogate (U+DC00) at character 1"),
    ("/v1/chat/completions", {**_chat("hi"), "tools": [_tool(description="\ud800")]},
     "tools.0.function.description", "lone surrogate"),
    ("/v1/chat/completions", {**_chat("hi"), "tools": [_tool(parameters=_schema(
        {"\ud800": {}})["json_schema"]["schema"])], "tool_choice": "required"},
     "tools.0.function.parameters.properties", "lone surrogate"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": {"a": "\ud800"}}}]}]},
     "messages.1.tool_calls.0.function.arguments.a", "lone surrogate"),
    # as OpenAI and vLLM refuse them
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0",
     "content: a 'user' message needs content (a string or a list of text parts), got null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages.0",
     "got an empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages.0",
     "tool_calls: only an assistant message has them"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream_options can only be set when stream is true"),
    ("/v1/chat/completions", {**_chat("hi"), "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
])
def test_bad_inputs_are_400_with_what_was_wrong(tiny_server, path, body, param, fragment):
    # json.dumps escapes lone surrogates as \ud800, as a JavaScript client would send them
    r = httpx.post(f"{tiny_server.url}{path}", timeout=30,
                   headers={**AUTH, "content-type": "application/json"},
                   content=json.dumps({"model": tiny_server.model, **body}))
    err = _envelope(r, 400)
    if param is not None:
        assert err["param"] == param, err
    assert fragment in err["message"], err


def test_a_refused_request_leaves_nothing_behind(tiny_server):
    """A schema the engine's messages could not encode used to be refused after the request
    was counted: it stayed for ever, and enough of them filled the queue. Now refused at
    the edge, and one that reached the engine's client would leave nothing either
    (test_in_process.py)."""
    body = {"model": tiny_server.model, "prompt": "hi", "max_tokens": 2,
            "response_format": _schema({"\ud800": {"type": "string"}})}
    for _ in range(3):
        _envelope(httpx.post(f"{tiny_server.url}/v1/completions", timeout=30,
                             headers={**AUTH, "content-type": "application/json"},
                             content=json.dumps(body)), 400)
    tiny_server.wait_idle()
    r = httpx.post(f"{tiny_server.url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # 409 while any request is counted as running


def test_more_prompts_than_the_server_could_ever_queue_is_400_not_429(tiny_server):
    """16 running and 50 queued at most: 67 prompts in one request could never be
    admitted, so retrying after a 429 would not help."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=30, json={
        "model": tiny_server.model, "prompt": ["a"] * 67, "max_tokens": 1})
    err = _envelope(r, 400, param="prompt", code="request_too_large")
    assert "send at most 66 a request" in err["message"], err
    r = httpx.post(f"{tiny_server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": tiny_server.model, "prompt": ["a"] * 66, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 66


def test_inputs_that_used_to_500_are_served(tiny_server):
    url = tiny_server.url
    # OpenAI-style content parts and a null content on /tokenize
    for messages in ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]}],
                     [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]):
        r = httpx.post(f"{url}/tokenize", headers=AUTH, json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["count"] > 0
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30, json={
        "model": tiny_server.model, "prompt": "hi", "seed": 2**63 - 1, "n": 2,
        "max_tokens": 3, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_every_error_is_in_the_envelope(tiny_server):
    url = tiny_server.url
    err = _envelope(httpx.get(f"{url}/v1/nothing", headers=AUTH), 404, code="not_found")
    assert "GET /v1/nothing" in err["message"]
    err = _envelope(httpx.get(f"{url}/v1/completions", headers=AUTH), 405,
                    code="method_not_allowed")
    assert "POST" in err["message"]
    r = httpx.post(f"{url}/v1/completions", headers={**AUTH, "content-type":
                   "application/json"}, content=b'{"model": "m",\n "prompt": "hi",, }')
    err = _envelope(r, 400, code="invalid_json")
    assert err["message"].startswith("invalid JSON at line 2 column 17: Expecting"), err


def test_a_body_that_is_not_json_says_why(tiny_server):
    url = f"{tiny_server.v1}/completions"
    plain = b'{"prompt": "hi", "max_tokens": 1}'
    # curl -d without a Content-Type sends a form's
    r = httpx.post(url, content=plain, headers={
        **AUTH, "content-type": "application/x-www-form-urlencoded"})
    err = _envelope(r, 400, code="invalid_content_type")
    assert "Content-Type: application/json; got Content-Type " \
           "'application/x-www-form-urlencoded'" in err["message"], err
    err = _envelope(httpx.post(url, content=plain, headers=AUTH), 400,
                    code="invalid_content_type")
    assert "got no Content-Type" in err["message"]
    err = _envelope(httpx.post(url, headers={**AUTH, "content-type": "application/json"}), 400,
                    code="invalid_body")
    r = httpx.post(url, content='{"prompt": "café"}'.encode("latin-1"), headers={
        **AUTH, "content-type": "application/json; charset=latin-1"})
    err = _envelope(r, 400, code="invalid_json")
    assert "must be JSON in UTF-8: byte 15 (0xe9)" in err["message"], err
    r = httpx.post(url, content=gzip.compress(plain), headers={
        **AUTH, "content-type": "application/json", "content-encoding": "gzip"})
    err = _envelope(r, 415, code="unsupported_content_encoding")
    assert "'gzip' is not supported" in err["message"]


def test_head_wherever_get(tiny_server):
    """Load balancers probe with HEAD: the GET's status, no body."""
    for path, headers in (("/health", {}), ("/ready", {}), ("/metrics", {}),
                          ("/v1/models", AUTH)):
        r = httpx.head(f"{tiny_server.url}{path}", headers=headers)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    assert httpx.head(f"{tiny_server.url}/v1/models").status_code == 401


def test_authentication_comes_before_the_body(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    _envelope(r, 401, code="invalid_api_key")
    r = httpx.post(f"{tiny_server.v1}/completions", content=b"x" * (5 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    _envelope(r, 401, code="invalid_api_key")
    assert httpx.get(f"{tiny_server.url}/openapi.json").status_code == 401
    assert httpx.get(f"{tiny_server.url}/openapi.json", headers=AUTH).status_code == 200
    # two Authorization headers (a bad one, then the key): which counts would depend on
    # who reads them, so neither does
    two = httpx.Headers([("authorization", "Bearer wrong"), *AUTH.items()])
    err = _envelope(httpx.get(f"{tiny_server.url}/v1/models", headers=two), 400,
                    code="invalid_api_key")
    assert "2 Authorization headers" in err["message"]


def test_chunked_body_over_the_limit_is_413(tiny_server):
    def chunks():
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    r = httpx.post(f"{tiny_server.v1}/completions", headers={
        **AUTH, "content-type": "application/json"}, content=chunks(), timeout=30)
    _envelope(r, 413, code="request_too_large")


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_server):
    r = httpx.post(f"{tiny_server.v1}/completions", headers=AUTH, timeout=30, json={
        "model": tiny_server.model, "prompt": "w" * 3_000_000})
    err = _envelope(r, 400, param="prompt", code="context_length_exceeded")
    assert "3000000 characters" in err["message"] and "cannot fit" in err["message"]


def test_a_429_is_not_an_abort(tight_server):
    """Two prompts a request, one running and two queued at most: the second request's
    first prompt is queued, its second refused, and the first withdrawn unanswered."""
    before = tight_server.metrics().get("llmserve:request_aborted_total", 0.0)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": tight_server.model, "prompt": ["a", "b"],
                    "max_tokens": 5, "ignore_eos": True}
            return await asyncio.gather(*[client.post(f"{tight_server.v1}/completions",
                                                      json=body) for _ in range(3)])

    statuses = [r.status_code for r in asyncio.run(run())]
    assert 429 in statuses, statuses
    m = tight_server.wait_idle()
    assert m.get("llmserve:request_aborted_total", 0.0) == before


# ---- HTTP hygiene --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guard_server(tiny_path, tmp_path_factory):
    """Short header and body deadlines; default allowed hosts (bound to loopback)."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("guard"), "--max-model-len",
                          "256", "--header-timeout", "1", "--body-timeout", "1",
                          name="guard")
    yield server
    assert server.stop() == 0


def _raw(server, data: bytes, wait: float = 0.0, chunks: tuple[bytes, ...] = ()) -> bytes:
    """Send bytes on a fresh connection; return all that comes back until it closes."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        time.sleep(wait)
        for chunk in chunks:
            s.sendall(chunk)
        out = b""
        while True:
            try:
                got = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not got:
                break
            out += got
    return out


def _status_and_json(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.lower()


def test_content_length_with_transfer_encoding_is_refused_and_closed(guard_server):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    raw = _raw(guard_server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
               + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + hex(len(body))[2:].encode()
               + b"\r\n" + body + b"\r\n0\r\n\r\n")
    status, err, head = _status_and_json(raw)
    assert status == 400 and err["error"]["code"] == "ambiguous_framing"
    assert b"connection: close" in head  # and _raw saw it close


def test_slow_headers_and_slow_bodies_are_timed_out(guard_server):
    start = time.monotonic()
    raw = _raw(guard_server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    status, err, _ = _status_and_json(raw)
    assert status == 408 and "headers" in err["error"]["message"]
    assert time.monotonic() - start < 5
    raw = _raw(guard_server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
    status, err, _ = _status_and_json(raw)
    assert status == 408 and "body stalled" in err["error"]["message"]


def test_header_count_and_host_are_checked(guard_server):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    raw = _raw(guard_server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
    status, err, _ = _status_and_json(raw)
    assert status == 431 and err["error"]["code"] == "too_many_headers"
    # One header of 20 KiB, the whole head in one write (h11 limits only a head in pieces)
    big = b"X-Big: " + b"a" * 20 * 1024 + b"\r\n"
    raw = _raw(guard_server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + big + b"\r\n")
    status, err, _ = _status_and_json(raw)
    assert status == 431 and err["error"]["code"] == "headers_too_large", err
    assert httpx.get(f"{guard_server.url}/health",
                     headers={"X-Fine": "a" * 8 * 1024}).status_code == 200
    r = httpx.get(f"{guard_server.url}/health", headers={"Host": "evil.example:80"})
    _envelope(r, 421, code="host_not_allowed")
    port = guard_server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert httpx.get(f"{guard_server.url}/health", headers={"Host": host}).status_code \
            == 200


def test_reset_prefix_cache(tiny_server):
    def hits() -> float:
        return tiny_server.metrics().get("llmserve:prefix_cache_hits_total", 0.0)

    body = {"model": tiny_server.model, "prompt": list(range(200, 264)), "max_tokens": 1}

    def send() -> None:
        r = httpx.post(f"{tiny_server.v1}/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text

    send()
    before = hits()
    send()
    assert hits() > before  # the 64-token prompt's blocks were cached: a hit
    _envelope(httpx.post(f"{tiny_server.url}/reset_prefix_cache"), 401)
    r = httpx.post(f"{tiny_server.url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and "forgot" in r.json()["message"]
    after_reset = hits()
    send()
    assert hits() == after_reset  # nothing left to hit


def test_reset_prefix_cache_is_refused_while_requests_run(tight_server):
    import threading

    def long_request() -> None:
        httpx.post(f"{tight_server.v1}/completions", timeout=60, json={
            "model": tight_server.model, "prompt": "hi", "max_tokens": 1000, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while tight_server.metrics().get("llmserve:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(f"{tight_server.url}/reset_prefix_cache", timeout=30)
    err = _envelope(r, 409, code="requests_running")
    assert "running" in err["message"] and r.headers["Retry-After"]
    t.join(30)


def test_what_python_s_json_cannot_take_is_no_500(tiny_server):
    """A history call's arguments nested past Python's recursion limit, with an integer of
    more than 4300 digits, or with an escaped lone surrogate are kept as the text sent (they
    gave 500s, in chat and /tokenize); a body nested that deep is a 400."""
    for args in ("[" * 1000 + "]" * 1000, '{"a": 1' + "0" * 4400 + "}", '{"\\ud83d": 1}'):
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "c", "type": "function",
                        "function": {"name": "f", "arguments": args}}]},
                    {"role": "tool", "content": "ok", "tool_call_id": "c"}]
        r = httpx.post(f"{tiny_server.url}/tokenize", headers=AUTH, timeout=30,
                       json={"messages": messages})
        assert r.status_code == 200, (args[:20], r.text)
        if r.json()["count"] < 1000:  # (the deep one is longer than this server's context)
            r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH, timeout=30,
                           json={"model": tiny_server.model, "messages": messages,
                                 "max_tokens": 1})
            assert r.status_code == 200, (args[:20], r.text)
    deep = "[" * 3000 + "]" * 3000
    body = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            f'"metadata": {{"a": {deep}}}}}')
    r = httpx.post(f"{tiny_server.v1}/chat/completions", timeout=30, content=body,
                   headers={**AUTH, "content-type": "application/json"})
    err = _envelope(r, 400, code="invalid_json")
    assert "nested too deeply" in err["message"]


def test_text_parts_are_joined_by_newlines_and_an_assistant_may_refuse(tiny_server):
    """As vLLM: several text parts are one text, joined by newlines; OpenAI's assistant
    messages may hold a refusal part (it was refused as not text)."""
    def count(messages) -> int:
        r = httpx.post(f"{tiny_server.url}/tokenize", headers=AUTH, json={"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert count([{"role": "user", "content": parts}]) == count(
        [{"role": "user", "content": "Hello\nworld"}])
    refused = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"}]},
               {"role": "user", "content": "why?"}]
    assert count(refused) == count([*refused[:1], {"role": "assistant", "content": "I cannot"},
                                    refused[2]])
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=AUTH, timeout=30,
                   json={"model": tiny_server.model, "messages": refused, "max_tokens": 1})
    assert r.status_code == 200, r.text
