"""The FastAPI application: OpenAI-compatible endpoints, health, readiness, metrics.

Every answer that is not a success is in OpenAI's error envelope, 404, 405, 413 and
malformed JSON included. The API key is checked before a body is read. Work that may take
longer than a millisecond or two (tokenizing a long prompt, rendering a long chat) runs in
a worker process (server/tokenizing.py), so that /health and every stream keep their pace.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.config import ServerConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.events import EngineBusyError, EngineUnavailableError
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.accounts import ANONYMOUS, Accounts, Gatekeeper, ResponseCounter, send_error
from llmserve.server.console import mount_console
from llmserve.server.errors import APIError, bad_request, error_body, param_of
from llmserve.server.http_guard import HTTPGuard
from llmserve.server.metrics import ServerMetrics
from llmserve.server.prompts import completion_prompts, encode_chat, encode_prompt
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    message_dicts,
)
from llmserve.server.serving import (
    ClientDisconnected,
    Job,
    JobUsage,
    completion_params,
    make_params,
    respond,
    stream,
    validate_prompts,
)
from llmserve.server.tokenizing import TokenizerPool
from llmserve.server.tools import prompt_messages, tool_call_grammar
from llmserve.usage import UsageEvent


@dataclass
class ServerState:
    draining: bool = False  # a shutdown signal was received


def build_app(engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics,
              state: ServerState, model_name: str, accounts: Accounts) -> FastAPI:
    app = FastAPI(title="llmserve", docs_url="/docs", redoc_url=None,
                  responses={400: {"description": "Invalid request (OpenAI error envelope)"},
                             401: {"description": "Missing or invalid API key"},
                             413: {"description": "Request body too large"},
                             429: {"description": "Waiting queue full, or the key's rate "
                                                  "limit reached; see Retry-After"},
                             500: {"description": "The engine failed while running the "
                                                  "request"},
                             503: {"description": "Not ready, restarting or shutting down; "
                                                  "see Retry-After"}})
    tokenizers = TokenizerPool(engine.tokenizer)
    app.state.tokenizers = tokenizers  # the launcher starts and stops its worker
    app.state.accounts = accounts  # and the usage writer
    # Starlette runs the middleware added last first: count, guard, key, then body.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes,
                       timeout=config.body_timeout)
    app.add_middleware(Gatekeeper, accounts=accounts, metrics=metrics)
    app.add_middleware(HTTPGuard, allowed_hosts=config.allowed_hosts)
    app.add_middleware(ResponseCounter, metrics=metrics)

    def serving() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down", headers={"Retry-After": "5"})
        try:
            engine.validate_available()
        except EngineUnavailableError as e:
            raise _unavailable(e) from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{model_name}'", param="model", code="model_not_found")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = (f"method {request.method} is not allowed on {request.url.path}"
                       + (f" (allowed: {allowed})" if allowed else ""))
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            return (await _unreadable_body(request)).response()  # FastAPI's words: say why
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind, code=_http_code(exc.status_code)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            body = await request.body()
            return bad_request(_json_error_message(body), code="invalid_json").response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if not loc and first.get("type") in ("missing", "model_attributes_type"):
            return _not_a_json_object(request).response()  # no body, or not sent as JSON
        param = ".".join(loc) or None
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):  # a check of the whole body: it names the field
            param = cause.param
        msg = str(first.get("msg", "invalid value"))
        if first.get("type") == "extra_forbidden":  # OpenAI's own words for a typo
            where = ".".join(loc[:-1])
            message = f"Unrecognized request argument supplied: {loc[-1]}" + (
                f" (in {where})" if where else "")
            return bad_request(message, param=param, code="unknown_parameter").response()
        if first.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif isinstance(first.get("input"), int | float | str | bool | type(None)):
            msg = f"{msg}, got {json.dumps(first['input'])[:100]}"
        message = f"{param}: {msg}" if param else msg
        return bad_request(message, param=param or param_of(msg)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while an engine serves; 503 (saying why) while it loads, restarts
        after a failure, or was given up."""
        h = engine.health()
        detail = {"engine": asdict(h)}
        if h.status == "ready":
            return JSONResponse({"status": "ok", **detail})
        message = {"starting": "the engine is loading the model",
                   "restarting": f"the engine is restarting after a failure: {h.last_failure}",
                   }.get(h.status, f"the engine is {h.status}"
                                   + (f": {h.last_failure}" if h.last_failure else ""))
        return JSONResponse({**error_body(message, "server_error", code=f"engine_{h.status}"),
                             **detail}, 503, headers={"Retry-After": "5"})

    @app.get("/ready")
    async def ready() -> Response:
        if engine.ready and not state.draining:
            return JSONResponse({"status": "ready"})
        reason = "draining" if state.draining else f"not ready (engine {engine.status})"
        return JSONResponse(error_body(f"the server is {reason}", "server_error"), 503,
                            headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "llmserve",
                "max_model_len": engine.max_model_len}

    def console_info() -> dict[str, Any]:
        """The model card the console shows: the model, its format and KV capacity."""
        ready = engine.ready_info
        info: dict[str, Any] = {"model": model_name, "max_model_len": engine.max_model_len,
                                "cost_per_hour": config.cost_per_hour,
                                "auth_required": accounts.required}
        if ready is not None:
            card = ready.card
            info.update({f: getattr(card, f) for f in card.__struct_fields__})
            info["full_context_sequences"] = round(card.kv_full_context_sequences, 1)
        return info

    mount_console(app, console_info)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}",
             responses={404: {"description": "No such model (OpenAI error envelope)"}})
    async def model(model_id: str) -> dict:
        """One model, as listed by /v1/models (ids may contain '/', as paths and
        Hugging Face names do)."""
        check_model(model_id)
        return model_card()

    @app.post("/reset_prefix_cache", responses={409: {"description": "Requests are running"}})
    async def reset_prefix_cache() -> dict:
        """Forget every cached prompt prefix, so that a benchmark level starts cold (vLLM
        has the same endpoint). Refused with 409 while requests run."""
        try:
            message = await engine.reset_prefix_cache()
        except EngineBusyError as e:
            headers = {"Retry-After": "1"} if e.code == "requests_running" else None
            raise APIError(409, str(e), code=e.code, headers=headers) from None
        except EngineUnavailableError as e:
            raise _unavailable(e) from None
        return {"status": "ok", "message": message}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model)
        if req.messages is not None:  # the prompt chat completions would build and bill
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            messages, variables = prompt_messages(message_dicts(req.messages), tools or None,
                                                  engine.tokenizer.chat_template)
            ids = await encode_chat(engine, tokenizers, messages, req.add_generation_prompt,
                                     variables)
        elif req.tools is not None:
            raise bad_request("tools go with 'messages'", param="tools")
        elif req.prompt is not None:
            ids = await encode_prompt(engine, tokenizers, req.prompt, req.add_special_tokens)
        else:
            raise bad_request("send 'prompt' or 'messages'", param="prompt")
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = [engine.tokenizer.token_text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              param="tokens")
        # Special tokens kept, as vLLM keeps them: /tokenize of the text gives the ids back.
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        serving()
        check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of sampling is not supported)",
                              param="best_of")
        params = completion_params(make_params(req.sampling_params), req.echo)
        prompts = await completion_prompts(engine, tokenizers, req.prompt)
        job = Job(engine.new_request_id("cmpl"), "completion", model_name, prompts, params,
                  req.priority, bool(req.stream_options and req.stream_options.include_usage),
                  echo=req.echo, prompt_logprobs=req.prompt_logprobs)
        job.on_finish = accounting(raw, job, lambda: req.prompt)
        return await _run(job, req.stream, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        serving()
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        tools, mode = make_params(req.tool_setup)
        constraint = make_params(req.constraint)
        if mode not in (None, "auto"):  # required, or a named function: by grammar
            if constraint is not None:
                raise bad_request("tool_choice requires a tool call; it cannot be combined "
                                  "with response_format or structured_outputs",
                                  param="tool_choice")
            constraint = StructuredOutputsParams(grammar=tool_call_grammar(
                tools, None if mode == "required" else mode,
                req.parallel_tool_calls and mode == "required"))
        params = make_params(lambda: req.sampling_params(constraint))
        if params.max_tokens == 0:
            param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
            raise bad_request(f"{param} must be at least 1, got 0", param=param)
        messages, variables = prompt_messages(message_dicts(req.messages),
                                              tools if mode else None,
                                              engine.tokenizer.chat_template)
        ids = await encode_chat(engine, tokenizers, messages, req.add_generation_prompt,
                                 variables)
        job = Job(engine.new_request_id("chatcmpl"), "chat", model_name, [(None, ids)], params,
                  req.priority, bool(req.stream_options and req.stream_options.include_usage),
                  tool_names={t["function"]["name"] for t in tools} if mode else None,
                  legacy_functions=req.legacy_functions,
                  prompt_logprobs=params.prompt_logprobs,
                  max_tokens_param=("max_tokens" if req.max_completion_tokens is None
                                    else "max_completion_tokens"))
        job.on_finish = accounting(raw, job, lambda: messages)
        return await _run(job, req.stream, raw)

    def accounting(raw: Request, job: Job, prompt) -> Callable[[JobUsage], None]:
        """What the job's end reports to the usage database and the key's token budget.
        ``prompt`` is read only when request logs keep prompts."""
        principal = getattr(raw.state, "principal", ANONYMOUS)
        endpoint = raw.url.path
        keep_text = accounts.request_log == "full"

        def finished(usage: JobUsage) -> None:
            text = None
            if keep_text:
                text = prompt()
                text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
            accounts.record(principal, UsageEvent(
                job.request_id, principal.key_id, model_name, endpoint, usage.prompt_tokens,
                usage.completion_tokens, usage.cached_tokens, usage.finish_reason,
                usage.latency_seconds, text,
                (usage.texts[0] if len(usage.texts) == 1 else json.dumps(usage.texts))
                if keep_text else None), reserved=job.reserved_tokens)

        return finished

    async def _run(job: Job, streaming: bool, raw: Request) -> Response:
        serving()  # the engine may have gone while the prompt was tokenized
        most = validate_prompts(engine, job)
        principal = getattr(raw.state, "principal", ANONYMOUS)
        try:
            job.reserved_tokens = accounts.reserve(principal, most)
        except APIError:  # 429: the key's tokens per minute cannot hold it
            metrics.on_rejected("rate_limit")
            raise
        streaming_started = False  # from then on the stream settles the reservation
        try:
            if streaming:
                body = await stream(engine, job)
                streaming_started = True
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return JSONResponse(await respond(engine, job, raw))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineUnavailableError as e:
            raise _unavailable(e) from None
        finally:
            if not streaming_started and not job.finished:  # refused (queue full) or gone
                accounts.release(principal, job.reserved_tokens)
                job.reserved_tokens = 0

    _head_where_get(app)
    return app


def _head_where_get(app: FastAPI) -> None:
    """HEAD wherever GET is served (RFC 9110; load balancers probe with it): the GET's
    status and headers, without the body (the HTTP server sends none for HEAD). The
    published schema is made first and lists GET alone, as OpenAPI schemas do (HEAD is
    implied; clients generated from it must not expect bodies from HEAD)."""
    app.openapi()  # cached: /openapi.json serves this one
    for route in app.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            route.methods.add("HEAD")


def _unavailable(e: EngineUnavailableError) -> APIError:
    return APIError(503, str(e), type="server_error", code="engine_unavailable",
                    headers={"Retry-After": str(e.retry_after)})


def _http_code(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")


def _not_a_json_object(request: Request) -> APIError:
    """The 400 for a body that is missing or was not sent as JSON (``curl -d`` sends a
    form's Content-Type unless told otherwise)."""
    kind = request.headers.get("content-type")
    if not kind:
        got = "no Content-Type"
    elif kind.split(";", 1)[0].strip().lower() != "application/json":
        got = f"Content-Type {kind!r}"
    else:
        return bad_request("the request's body must be a JSON object", code="invalid_body")
    return bad_request(f"the request's body must be a JSON object sent with Content-Type: "
                       f"application/json; got {got}", code="invalid_content_type")


async def _unreadable_body(request: Request) -> APIError:
    """Why a body could not be read as JSON text: compressed, or not UTF-8."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        return APIError(415, f"Content-Encoding {encoding!r} is not supported: send the "
                        "body uncompressed", code="unsupported_content_encoding")
    body = await request.body()
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return bad_request(f"the request's body must be JSON in UTF-8: byte {e.start} "
                           f"(0x{body[e.start]:02x}) is not valid UTF-8", code="invalid_json")
    return bad_request(_json_error_message(body), code="invalid_json")


def _json_error_message(body: bytes) -> str:
    """'invalid JSON at line L column C: what was wrong', from the body itself."""
    try:
        json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    except (UnicodeDecodeError, ValueError) as e:
        return f"invalid JSON: {e}"
    except RecursionError:
        return "invalid JSON: nested too deeply (arrays and objects within each other)"
    return "invalid JSON"


# ---- ASGI middleware (before any body is read) ---------------------------------------------


class BodySizeLimit:
    """Pure ASGI middleware: reads the body before the app does, and answers 413 as soon as
    it exceeds the limit, whether declared (Content-Length) or streamed (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, self._error())
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                return await send_error(send, APIError(
                    408, f"the request body stalled for {self.timeout:g} s (--body-timeout)",
                    code="request_timeout"), close=True)
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await send_error(send, self._error())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # from here on: disconnect detection

        await self.app(scope, replay, send)

    def _error(self) -> APIError:
        return APIError(413, f"request body is larger than {self.max_bytes} bytes "
                             "(--max-body-bytes)", code="request_too_large")
