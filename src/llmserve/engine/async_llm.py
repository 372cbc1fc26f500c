"""AsyncLLM: the engine core on its own thread, driven from an asyncio event loop.

The HTTP server never runs model code on its event loop. Requests and aborts go to the
engine thread through a queue; the thread runs schedule/execute/update, turns tokens into
text (OutputProcessor), and hands each request's events to its asyncio queue with
``call_soon_threadsafe``. PyTorch releases the GIL inside its kernels, so the event loop
keeps answering (health checks, new connections) while the engine is saturated.

Admission control happens here, before a request reaches the engine: a bounded waiting
queue (requests and prompt tokens), and a per-request deadline enforced at every step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.config import EngineConfig
from llmserve.engine.core import EngineCore, EngineCoreOutput
from llmserve.engine.output_processor import OutputProcessor, RequestState, SequenceDelta
from llmserve.logger import get_logger
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import SchedulerStats

logger = get_logger(__name__)


class QueueFullError(Exception):
    """The waiting queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(Exception):
    """The engine thread stopped; no request can be served."""


@dataclass
class RequestEvent:
    """What a request's consumer receives: deltas, and finally the whole output or an error."""

    deltas: list[SequenceDelta] = field(default_factory=list)
    output: RequestOutput | None = None  # set on the last event
    error: str | None = None  # "timeout", "shutdown" or "engine_error" on a failed end
    message: str | None = None


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

    async def __anext__(self) -> RequestEvent:
        if self.finished:
            raise StopAsyncIteration
        event: RequestEvent = await self._events.get()
        self.finished = event.output is not None or event.error is not None
        return event

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class StatsSink(Protocol):
    """Receives the engine's measurements (the server's Prometheus metrics implement it)."""

    def on_step(self, stats: SchedulerStats, new_generation_tokens: int) -> None: ...

    def on_first_token(self, ttft: float, queue_time: float | None,
                       prompt_tokens: int) -> None: ...

    def on_inter_token(self, latency: float) -> None: ...

    def on_finished(self, reason: str, e2e: float, prompt_tokens: int,
                    generation_tokens: int) -> None: ...

    def on_rejected(self, reason: str) -> None: ...


@dataclass
class _Tracked:
    state: RequestState
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    deadline: float | None
    num_tokens_prompt: int
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None, request_timeout: float | None = None,
                 stats: StatsSink | None = None, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.request_timeout = request_timeout
        self.stats = stats
        self._processor = OutputProcessor(self.tokenizer)
        self._inbox: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()  # guards the admission counters below
        self._pending_requests = 0
        self._pending_tokens = 0
        self._waiting_snapshot = (0, 0)  # (requests, prompt tokens) waiting in the engine
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self.dead: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def warm_up(self) -> None:
        """Run one short request through the engine so no user pays for first-call costs."""
        rid = "warmup"
        self.core.add_request(rid, self.tokenizer.encode("Hello") or [0],
                              SamplingParams(max_tokens=2, temperature=0))
        while self.core.has_unfinished():
            self.core.step()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**8}"

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # ---- requests ----------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError / ContextLengthError for a request the engine cannot serve."""
        self.core.validate(prompt_token_ids, params)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request now (raising QueueFullError / ValueError at once) and return the
        stream of its events. Call from the event loop's thread."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        self.validate(prompt_token_ids, params)
        self._admit(len(prompt_token_ids))
        events: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        deadline = None if self.request_timeout is None else now + self.request_timeout
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer)
        tracked = _Tracked(state, events, asyncio.get_running_loop(), now, deadline,
                           len(prompt_token_ids))
        self._inbox.put(("add", (request_id, prompt_token_ids, params, priority, tracked)))
        return RequestStream(self, request_id, events)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prompt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestEvent]:
        """Submit a request and yield its events; leaving early aborts it in the engine."""
        stream = self.submit(request_id, prompt_token_ids, params, prompt, priority)
        try:
            async for event in stream:
                yield event
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the engine frees the request's blocks in its next loop."""
        self._inbox.put(("abort", request_id))

    def _admit(self, prompt_tokens: int) -> None:
        with self._lock:
            waiting, waiting_tokens = self._waiting_snapshot
            waiting += self._pending_requests
            waiting_tokens += self._pending_tokens
            if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
                self._reject("queue_full")
                raise QueueFullError(f"the server's waiting queue is full ({waiting} requests "
                                     f"waiting, limit {self.max_queued_requests}); retry later",
                                     self._retry_after(waiting))
            if (self.max_queued_tokens is not None
                    and waiting_tokens + prompt_tokens > self.max_queued_tokens):
                self._reject("queue_tokens_full")
                raise QueueFullError(f"the server's waiting queue is full ({waiting_tokens} "
                                     f"prompt tokens waiting, limit {self.max_queued_tokens}); "
                                     "retry later", self._retry_after(waiting))
            self._pending_requests += 1
            self._pending_tokens += prompt_tokens

    def _reject(self, reason: str) -> None:
        if self.stats is not None:
            self.stats.on_rejected(reason)

    @staticmethod
    def _retry_after(waiting: int) -> int:
        return max(1, min(30, waiting // 8))

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                changed = self._drain_inbox(block=not self.core.has_unfinished())
                changed |= self._expire()
                new_tokens = 0
                if self.core.has_unfinished():
                    outputs = self.core.step()
                    self._deliver(outputs)
                    new_tokens = sum(len(o.new_token_ids) for o in outputs)
                elif not changed:
                    continue
                stats = self.core.stats()
                self._waiting_snapshot = (stats.num_waiting, self._waiting_tokens())
                if self.stats is not None:
                    self.stats.on_step(stats, new_tokens)
        except BaseException as e:  # the engine is gone: fail every request, loudly
            logger.exception("engine thread failed")
            self.dead = e
            for rid in list(self._tracked):
                self._fail(rid, "engine_error", f"the engine failed: {e}")

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; True if there were any."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, payload = item
            if kind == "add":
                self._add(*payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "fail_all":
                for rid in list(self._tracked):
                    self._fail(rid, *payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int,
             tracked: _Tracked) -> None:
        with self._lock:
            self._pending_requests -= 1
            self._pending_tokens -= tracked.num_tokens_prompt
        try:
            self.core.add_request(rid, prompt_ids, params, priority)
        except ValueError as e:  # validated before, so only a duplicate id gets here
            self._tracked[rid] = tracked
            self._fail(rid, "invalid_request", str(e))
            return
        self._tracked[rid] = tracked
        self._processor.states[rid] = tracked.state

    def _abort(self, rid: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return
        self.core.abort(rid)
        self._processor.pop(rid)
        if self.stats is not None:
            self.stats.on_finished("abort", time.monotonic() - tracked.arrival,
                                   tracked.num_tokens_prompt, tracked.generated)

    def abort_all(self, error: str, message: str) -> None:
        """From any thread: end every request with an error event (used on shutdown)."""
        self._inbox.put(("fail_all", (error, message)))

    def _expire(self) -> bool:
        now = time.monotonic()
        expired = [rid for rid, t in self._tracked.items()
                   if t.deadline is not None and now > t.deadline]
        for rid in expired:
            self._fail(rid, "timeout",
                       f"request timed out after {self.request_timeout:g} s (--request-timeout)")
        return bool(expired)

    def _fail(self, rid: str, error: str, message: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return
        self.core.abort(rid)
        self._processor.finish_aborted(rid)
        tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait,
                                          RequestEvent(error=error, message=message))
        if self.stats is not None:
            self.stats.on_finished(error, time.monotonic() - tracked.arrival,
                                   tracked.num_tokens_prompt, tracked.generated)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        deltas, to_stop = self._processor.process(outputs)
        for rid, index in to_stop:
            self.core.abort(rid, index, stopped=True)
        now = time.monotonic()
        by_request: dict[str, list[SequenceDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        first_sched = {o.request_id: o.first_scheduled_time for o in outputs}
        for rid, ds in by_request.items():
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            self._record_timing(tracked, ds, now, first_sched.get(rid))
            event = RequestEvent(deltas=ds)
            if tracked.state.finished:
                event.output = tracked.state.to_output()
                del self._tracked[rid]
                self._processor.pop(rid)
                if self.stats is not None:
                    reason = tracked.state.seqs[0].finish_reason or "stop"
                    self.stats.on_finished(reason, now - tracked.arrival,
                                           tracked.num_tokens_prompt, tracked.generated)
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, event)

    def _record_timing(self, t: _Tracked, deltas: list[SequenceDelta], now: float,
                       first_scheduled: float | None) -> None:
        t.generated += sum(len(d.token_ids) for d in deltas)
        if self.stats is None:
            return
        if t.first_token is None:
            queue_time = None if first_scheduled is None else first_scheduled - t.arrival
            self.stats.on_first_token(now - t.arrival, queue_time, t.num_tokens_prompt)
        elif t.last_token is not None:
            self.stats.on_inter_token(now - t.last_token)
        t.first_token = t.first_token or now
        t.last_token = now

    def _waiting_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.core.scheduler.waiting)
