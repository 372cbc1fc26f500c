"""Completions and chat completions: run requests through AsyncLLM and shape OpenAI replies.

One user request may become several engine requests (a list of prompts in /v1/completions);
their events are merged into one stream. Choice index = prompt index * n + sequence index.

Evaluation harnesses (lm-evaluation-harness) score text through /v1/completions: ``echo``
returns the prompt before the completion, and with ``logprobs`` the prompt tokens'
logprobs before the generated ones (the engine computes them as prompt logprobs); with
``max_tokens`` 0 the prompt alone. A stream sends the prompt with each choice's first chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.events import QueueFullError, RequestEvent, RequestStream
from llmserve.engine.validation import ContextLengthError
from llmserve.outputs import Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import APIError, bad_request, error_body, param_of
from llmserve.server.logprobs import (
    NO_ECHO,
    Echoed,
    chat_logprobs,
    completion_logprobs,
    echoed_with_logprobs,
    prompt_logprobs,
)
from llmserve.server.tools import ToolCallStream, parse_tool_calls


@dataclass
class Job:
    """One user request: its prompts (token ids) and how to shape the reply."""

    request_id: str
    kind: str  # "completion" or "chat"
    model: str
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    priority: int = 0
    include_usage: bool = False
    # Chat with tools: the functions whose calls are parsed out of the output (None: no
    # parsing); legacy_functions answers in the old function_call shape.
    tool_names: set[str] | None = None
    legacy_functions: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    echo: bool = False  # completions: the reply's text (and logprobs) start with the prompt
    prompt_logprobs: int | None = None  # as the client asked: returned with the reply
    max_tokens_param: str = "max_tokens"  # or max_completion_tokens: as the client sent it
    # Called once when the job ends, however it ends, with what the client is billed for.
    on_finish: Callable[[JobUsage], None] | None = None
    started: float = field(default_factory=time.monotonic)
    reserved_tokens: int = 0  # taken from the key's tokens per minute; settled at the end
    finished: bool = False

    def finish(self, completion_tokens: int, cached_tokens: int, finish_reason: str,
               texts: list[str], ran: set[int] | None = None) -> None:
        """Report the job's end once. ``ran``: the prompts that were processed (their first
        output came back), for a job that ended early; None: all of them."""
        if self.finished:
            return
        self.finished = True
        if self.on_finish is not None:
            prompt_tokens = sum(len(ids) for i, (_, ids) in enumerate(self.prompts)
                                if ran is None or i in ran)
            self.on_finish(JobUsage(prompt_tokens, completion_tokens, cached_tokens,
                                    finish_reason, texts, time.monotonic() - self.started))


@dataclass(frozen=True)
class JobUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str  # of the first choice; "abort" (client gone) or "error" otherwise
    texts: list[str]  # each choice's output text
    latency_seconds: float


class ClientDisconnected(Exception):
    pass


def make_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise bad_request(str(e), param=param_of(str(e))) from None


def completion_params(params: SamplingParams, echo: bool) -> SamplingParams:
    """The engine's parameters for a /v1/completions request: with echo and logprobs k, the
    prompt's logprobs too (k of them, or more if prompt_logprobs asks). max_tokens 0 is
    for scoring a prompt: without echo it would return nothing at all, so it is refused."""
    if params.max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be at least 1, got 0 (0 is allowed only with "
                          "echo: true, which returns the prompt and, with logprobs, its "
                          "logprobs)", param="max_tokens")
    if echo and params.logprobs is not None:
        params = replace(params, prompt_logprobs=max(params.logprobs,
                                                     params.prompt_logprobs or 0))
    return params


def validate_prompts(engine: AsyncLLM, job: Job) -> int:
    """Check every prompt against the model; returns the most tokens the job can use
    (each prompt plus its max_tokens, for each of the n choices), as a rate limit counts."""
    most = 0
    for _, ids in job.prompts:
        try:
            max_tokens = engine.validate(ids, job.params)
        except ValueError as e:
            raise _invalid(engine, e, job) from None
        most += (len(ids) + max_tokens) * job.params.n
    return most


def _invalid(engine: AsyncLLM, e: ValueError, job: Job) -> APIError:
    """The 400 for a request the engine cannot serve (OpenAI's code for a context overrun),
    naming the field the client sent: the prompt (or messages) when it alone is too long,
    else the max_tokens field it used."""
    if isinstance(e, ContextLengthError):
        if e.prompt_alone:
            param = "prompt" if job.kind == "completion" else "messages"
        else:
            param = job.max_tokens_param
        message = str(e).replace("max_tokens", job.max_tokens_param)
        return bad_request(f"This model's maximum context length is {engine.max_model_len} "
                           f"tokens: {message}", param=param, code="context_length_exceeded")
    return bad_request(str(e), param=param_of(str(e)))


async def _submit_all(engine: AsyncLLM, job: Job) -> list[RequestStream]:
    """Queue every prompt of the job now; a full queue is a 429 before any byte is sent.
    (AsyncLLM queues at ``submit``; an engine on other machines, when the stream is
    ``accepted``.)"""
    try:
        engine.check_job(len(job.prompts), sum(len(ids) for _, ids in job.prompts))
    except ValueError as e:
        raise bad_request(str(e), param="prompt" if job.kind == "completion" else "messages",
                          code="request_too_large") from None
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(job.prompts):
            streams.append(engine.submit(f"{job.request_id}-{i}", ids, job.params, text,
                                         job.priority))
            await streams[-1].accepted()
    except BaseException as e:  # refused, or the client went away while it was queued
        for st in streams:
            st.close(counted=False)  # withdrawn unanswered: not an abort
        if isinstance(e, QueueFullError):
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        if isinstance(e, ValueError):
            raise _invalid(engine, e, job) from None
        raise
    return streams


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestEvent]]:
    """Yield (prompt index, event) from all streams as they come. Leaving early (client
    gone, error) closes every stream, which aborts its engine request."""
    try:
        if len(streams) == 1:
            async for event in streams[0]:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, st: RequestStream) -> None:
            async for event in st:
                await queue.put((i, event))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, event = await queue.get()
                if event.output is not None or event.error is not None:
                    remaining -= 1
                yield i, event
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for st in streams:
            st.close()


def _error_from_event(event: RequestEvent) -> APIError:
    if event.error == "timeout":
        return APIError(408, event.message or "request timed out", type="timeout_error",
                        code="request_timeout")
    if event.error == "shutdown":
        return APIError(503, event.message or "server shutting down", type="server_error",
                        code="shutting_down", headers={"Retry-After": "5"})
    if event.error == "invalid_request":
        return bad_request(event.message or "invalid request", code=event.code)
    if event.error == "queue_full":  # a request sent again to replicas that were full
        return APIError(429, event.message or "the server is at capacity",
                        type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": "5"})
    if event.error == "unavailable":
        return APIError(503, event.message or "no replica is available",
                        type="server_error", code="unavailable", headers={"Retry-After": "5"})
    return APIError(500, event.message or "internal error", type="server_error",
                    code=event.error)


# ---- non-streaming -------------------------------------------------------------------------


async def respond(engine: AsyncLLM, job: Job, raw: Request) -> dict[str, Any]:
    """Collect the whole answer, watching for the client going away from the first moment
    (a prompt still being prefilled is aborted too)."""
    events = _merged(await _submit_all(engine, job))
    outputs: dict[int, RequestOutput] = {}
    ran: set[int] = set()  # prompts processed: their first tokens came back
    generated = 0

    async def collect() -> None:
        nonlocal generated
        async for i, event in events:
            if event.error is not None:
                raise _error_from_event(event)
            if event.deltas or event.output is not None:
                ran.add(i)
            generated += sum(len(d.token_ids) for d in event.deltas)
            if event.output is not None:
                outputs[i] = event.output

    task = asyncio.ensure_future(collect())
    ending = "error"
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await raw.is_disconnected():
                ending = "abort"
                raise ClientDisconnected
        task.result()
        ending = ""
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task  # let the cancellation land before closing the generator under it
        await events.aclose()
        if ending:  # what ran is billed, as in a stream: not the prompts that never ran
            done = list(outputs.values())
            job.finish(generated, sum(o.num_cached_tokens for o in done), ending,
                       [c.text for o in done for c in o.outputs], ran)
    body = _full_response(engine, job, [outputs[i] for i in range(len(job.prompts))])
    usage = body["usage"]
    job.finish(usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
               body["choices"][0]["finish_reason"],
               [c.get("text", c.get("message", {}).get("content")) or ""
                for c in body["choices"]])
    return body


def _full_response(engine: AsyncLLM, job: Job, outputs: list[RequestOutput]) -> dict[str, Any]:
    n, k = job.params.n, job.params.logprobs or 0
    choices = []
    for p, out in enumerate(outputs):
        echoed = _echo(engine, job, p, out.prompt_logprobs)
        for c in out.outputs:
            choice: dict[str, Any] = {"index": p * n + c.index, "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}
            if job.kind == "chat":
                choice["message"] = _chat_message(job, c.text, choice)
                choice["logprobs"] = chat_logprobs(engine.tokenizer, c.logprobs, k)
            else:
                choice["text"] = echoed.text + c.text
                choice["logprobs"] = completion_logprobs(c.logprobs, k, echoed.rows)
                if job.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs,
                                                                 job.prompt_logprobs)
            choices.append(choice)
    body = {"id": job.request_id, "object": _object(job), "created": job.created,
            "model": job.model, "choices": choices, "usage": _usage(job, outputs)}
    if job.kind == "chat" and job.prompt_logprobs is not None:  # per prompt, as vLLM does
        body["prompt_logprobs"] = prompt_logprobs(outputs[0].prompt_logprobs,
                                                   job.prompt_logprobs)
    return body


def _chat_message(job: Job, text: str, choice: dict[str, Any]) -> dict[str, Any]:
    """The assistant's message; with tools, its calls parsed out of the text (and the finish
    reason says so when the model stopped after calling)."""
    if job.tool_names is None:
        return {"role": "assistant", "content": text}
    content, calls = parse_tool_calls(text, job.tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        if job.legacy_functions:
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        else:
            message["tool_calls"] = [c.to_openai() for c in calls]
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "function_call" if job.legacy_functions else "tool_calls"
    return message


# ---- streaming -----------------------------------------------------------------------------


async def stream(engine: AsyncLLM, job: Job) -> AsyncIterator[str]:
    """Queue the request now (429 raises before the response starts), return the SSE body.
    The server cancels the body when the client disconnects, which aborts the request."""
    if job.kind == "chat" and job.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream: true on chat "
                          "completions (as in vLLM); send stream: false",
                          param="prompt_logprobs")
    return _sse(engine, job, _merged(await _submit_all(engine, job)))


async def _sse(engine: AsyncLLM, job: Job,
               events: AsyncIterator[tuple[int, RequestEvent]]) -> AsyncIterator[str]:
    n, k = job.params.n, job.params.logprobs or 0
    completion_tokens = 0
    prompt_tokens = sum(len(ids) for _, ids in job.prompts)
    tool_streams: dict[int, ToolCallStream] = {}
    cached_tokens: dict[int, int] = {}  # per prompt, from its final output
    started: set[int] = set()  # choices whose first chunk went out (with the echoed prompt)
    offsets: dict[int, int] = {}  # per choice: text_offset of its next logprobs token
    texts: dict[int, list[str]] = {}  # per choice, for usage accounting
    ran: set[int] = set()  # prompts processed (their first tokens came back)
    complete = False  # every prompt's output ended
    ending = "abort"  # until the stream ends otherwise: the client went away
    try:
        if job.kind == "chat":
            for p in range(len(job.prompts)):
                for i in range(n):
                    yield _chunk(job, [{"index": p * n + i, "delta": {"role": "assistant",
                                                                      "content": ""},
                                        "logprobs": None, "finish_reason": None}])
        async for p, event in events:
            if event.error is not None:
                err = _error_from_event(event)
                ending = "error"
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            if event.output is not None:
                cached_tokens[p] = event.output.num_cached_tokens
            if event.deltas or event.output is not None:
                ran.add(p)
            for d in event.deltas:
                completion_tokens += len(d.token_ids)
                if not d.token_ids and d.finish_reason is None:
                    continue  # one chunk per token, even while its text is held back
                index = p * n + d.index
                texts.setdefault(index, []).append(d.text)
                if index == 0 and d.finish_reason is not None:
                    ending = d.finish_reason
                first = index not in started
                started.add(index)
                finish = d.finish_reason
                if job.kind == "chat":
                    delta: dict[str, Any] = {"content": d.text}
                    if job.tool_names is not None:
                        calls = tool_streams.setdefault(index, ToolCallStream(job.tool_names))
                        delta, finish = _tool_delta(job, calls, d.text, finish)
                    choice = {"index": index, "delta": delta,
                              "logprobs": chat_logprobs(engine.tokenizer, d.logprobs, k)}
                else:
                    echoed = _echo(engine, job, p, event.prompt_logprobs) if first else NO_ECHO
                    logprobs = completion_logprobs(d.logprobs, k, echoed.rows,
                                                    offsets.get(index, 0))
                    if logprobs is not None:
                        offsets[index] = (offsets.get(index, 0)
                                          + sum(map(len, logprobs["tokens"])))
                    choice = {"index": index, "text": echoed.text + d.text,
                              "logprobs": logprobs}
                    if first and job.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs(event.prompt_logprobs,
                                                                     job.prompt_logprobs)
                choice["finish_reason"] = finish
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                yield _chunk(job, [choice])
        else:
            complete = True
            if job.include_usage:
                usage = _usage_dict(prompt_tokens, completion_tokens,
                                    sum(cached_tokens.values()))
                yield _chunk(job, [], usage=usage)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never leave a stream hanging without a final event
        ending = "error"
        yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
    finally:
        await events.aclose()
        job.finish(completion_tokens, sum(cached_tokens.values()), ending,
                   ["".join(texts[i]) for i in sorted(texts)], None if complete else ran)
    yield "data: [DONE]\n\n"


def _tool_delta(job: Job, stream: ToolCallStream, text: str,
                finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The delta of one streamed token with tools: content as it comes, each call once it
    is complete (OpenAI's tool_calls delta: index, id, type, name and arguments)."""
    first = len(stream.calls)
    content, calls = stream.feed(text, final=finish is not None)
    delta: dict[str, Any] = {"content": content}
    if calls:
        if job.legacy_functions:
            delta["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        else:
            delta["tool_calls"] = [c.to_openai(first + i) for i, c in enumerate(calls)]
        if not content:
            delta["content"] = None
    if finish == "stop" and stream.calls:
        finish = "function_call" if job.legacy_functions else "tool_calls"
    return delta, finish


def _chunk(job: Job, choices: list[dict[str, Any]], usage: dict | None = None) -> str:
    body: dict[str, Any] = {"id": job.request_id, "object": _object(job, chunk=True),
                            "created": job.created, "model": job.model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ---- shaping ------------------------------------------------------------------------------


def _object(job: Job, chunk: bool = False) -> str:
    if job.kind == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def _usage(job: Job, outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return _usage_dict(prompt, completion, sum(o.num_cached_tokens for o in outputs))


def _usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _echo(engine: AsyncLLM, job: Job, p: int,
          entries: list[dict[int, Logprob] | None] | None) -> Echoed:
    """The echo of prompt ``p``: its text as sent, or decoded when it came as token ids;
    with its logprobs rows (from the engine's prompt logprobs ``entries``) when asked."""
    if not job.echo:
        return NO_ECHO
    text, ids = job.prompts[p]
    if text is None:
        text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    if job.params.logprobs is None:
        return Echoed(text)
    return echoed_with_logprobs(engine.tokenizer, text, ids, entries, job.params.logprobs)
