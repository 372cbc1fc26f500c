"""What the server receives from an engine front end (``AsyncLLM`` here, or the Ray Serve
client of replicas): each request's events and their stream, the errors of admission and
availability, the measurements it reports, and its health."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llmserve.engine.output_processor import SequenceDelta
from llmserve.outputs import Logprob, RequestOutput
from llmserve.scheduler.output import SchedulerStats

if TYPE_CHECKING:
    from llmserve.engine.async_llm import AsyncLLM


class QueueFullError(Exception):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineBusyError(Exception):
    """The engine cannot do what was asked now (``code``: why; "requests_running": it has
    requests in flight, and can once it is idle)."""

    def __init__(self, message: str, code: str = "requests_running") -> None:
        super().__init__(message)
        self.code = code


class EngineUnavailableError(Exception):
    """No engine is serving right now (loading, restarting or given up); the message says
    which, and ``retry_after`` when to try again."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RequestEvent:
    """What a request's consumer receives: deltas, and finally the whole output or an error."""

    deltas: list[SequenceDelta] = field(default_factory=list)
    output: RequestOutput | None = None  # set on the last event
    # The prompt's logprobs (first entry None), on every event from the one that brings a
    # sequence's first output: a stream that echoes the prompt needs them with that output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # On a failed end: "timeout", "shutdown", "engine_error" or "invalid_request".
    error: str | None = None
    message: str | None = None
    code: str | None = None  # the error envelope's code, where the failure has its own


class RequestStream:
    """The events of one submitted request. Closing it before the last event aborts the
    request in the engine (its KV blocks are freed in the engine's next loop)."""

    def __init__(self, engine: AsyncLLM, request_id: str, events: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._events = events
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def accepted(self) -> None:
        """Queued already: ``submit`` raised if the request could not be."""

    async def __anext__(self) -> RequestEvent:
        if self.finished:
            raise StopAsyncIteration
        event: RequestEvent = await self._events.get()
        self.finished = event.output is not None or event.error is not None
        return event

    def queued(self) -> list[RequestEvent]:
        """The events already queued, without waiting (up to and including a last one)."""
        out: list[RequestEvent] = []
        while not self.finished and not self._events.empty():
            event: RequestEvent = self._events.get_nowait()
            self.finished = event.output is not None or event.error is not None
            out.append(event)
        return out

    def close(self, *, counted: bool = True) -> None:
        """Abort the request if it is still running; ``counted=False`` for a request
        withdrawn before it was answered (a sibling prompt got 429): not an abort."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id, counted=counted)


class StatsSink(Protocol):
    """Receives the engine's measurements (the server's Prometheus metrics implement it)."""

    def on_step(self, stats: SchedulerStats, new_generation_tokens: int) -> None: ...

    def on_first_token(self, ttft: float, queue_time: float | None,
                       prompt_tokens: int) -> None: ...

    def on_inter_token(self, latency: float) -> None: ...

    def on_finished(self, reason: str, e2e: float, prompt_tokens: int,
                    generation_tokens: int) -> None: ...

    def on_rejected(self, reason: str) -> None: ...

    def on_engine_restart(self, cause: str) -> None: ...


@dataclass
class EngineHealth:
    """What /health reports."""

    status: str  # "starting", "ready", "restarting", "failed" or "stopped"
    restarts: int  # since the server started
    last_failure: str | None  # why the engine last died
    engine_pid: int | None
