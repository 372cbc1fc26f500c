"""The FastAPI application: OpenAI-compatible endpoints, health, readiness, metrics."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.config import ServerConfig
from llmserve.engine.async_llm import AsyncLLM, EngineDeadError
from llmserve.server.errors import APIError, bad_request, error_body
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmserve.server.serving import (
    ClientDisconnected,
    Job,
    make_params,
    respond,
    stream,
    validate_prompts,
)
from llmserve.tokenizer.chat_template import ChatTemplateError


@dataclass
class ServerState:
    ready: bool = False  # model loaded and warmed up
    draining: bool = False  # SIGTERM received


def build_app(engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics,
              state: ServerState, model_name: str) -> FastAPI:
    app = FastAPI(title="llmserve", docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), config.api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    def serving() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down", headers={"Retry-After": "5"})
        if not state.ready or engine.dead is not None:
            raise APIError(503, "the model is not ready yet", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{model_name}'", param="model", code="model_not_found")

    guarded = [Depends(authorize)]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(
            first.get("msg", "invalid request body"))
        return bad_request(message, param=param).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return JSONResponse(error_body("the engine stopped", "server_error"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready and not state.draining and engine.dead is None:
            return JSONResponse({"status": "ready"})
        reason = "draining" if state.draining else "not ready"
        return JSONResponse(error_body(f"the server is {reason}", "server_error"), 503,
                            headers={"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "llmserve",
            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(req: TokenizeRequest) -> dict:
        check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            try:
                ids = tok.encode_chat([m.model_dump() for m in req.messages],
                                      req.add_generation_prompt)
            except (ChatTemplateError, ValueError) as e:
                raise bad_request(str(e), param="messages") from None
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send 'prompt' or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        serving()
        check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of sampling is not supported)",
                              param="best_of")
        params = make_params(req.sampling_params)
        prompts = _completion_prompts(engine, req.prompt)
        job = Job(engine.new_request_id("cmpl"), "completion", model_name, prompts, params,
                  req.priority, bool(req.stream_options and req.stream_options.include_usage))
        return await _run(job, req.stream, raw)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        serving()
        check_model(req.model)
        if req.tools or req.tool_choice not in (None, "none"):
            raise bad_request("tools and tool_choice are not supported", param="tools")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise bad_request("response_format other than 'text' is not supported",
                              param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        params = make_params(req.sampling_params)
        try:
            ids = engine.tokenizer.encode_chat(req.message_dicts(), req.add_generation_prompt)
        except (ChatTemplateError, ValueError) as e:
            raise bad_request(str(e), param="messages") from None
        job = Job(engine.new_request_id("chatcmpl"), "chat", model_name, [(None, ids)], params,
                  req.priority, bool(req.stream_options and req.stream_options.include_usage))
        return await _run(job, req.stream, raw)

    async def _run(job: Job, streaming: bool, raw: Request) -> Response:
        validate_prompts(engine, job)
        try:
            if streaming:
                body = stream(engine, job)
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return JSONResponse(await respond(engine, job, raw))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None

    return app


def _completion_prompts(engine: AsyncLLM, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, engine.tokenizer.encode(prompt))]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, engine.tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists", param="prompt")


class BodySizeLimit:
    """Pure ASGI middleware: 413 for bodies over the limit, declared or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        response = APIError(413, f"request body is larger than {self.max_bytes} bytes",
                            code="request_too_large").response()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": response.body})


class _TooLarge(Exception):
    pass
