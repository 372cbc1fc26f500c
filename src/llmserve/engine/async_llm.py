"""AsyncLLM: the API server's side of the engine, on its asyncio event loop.

The engine core runs in a process of its own (engine/core_proc.py). This side owns what
users see: admission control (a bounded waiting queue, in requests and prompt tokens),
per-request deadlines, detokenization and stop strings (OutputProcessor), metrics, and one
asyncio queue of events per request. Everything here runs on the event loop; nothing here
takes more than a fraction of a millisecond per message.

A watchdog keeps the engine alive. When the engine process ends (an exception, a
segfault, SIGKILL, the out-of-memory killer) or stops making progress while it has work
(no step for ``hang_timeout`` seconds), every request in flight ends at once with an
error, new requests get 503 while a fresh engine loads and warms up, and serving resumes by
itself. More than ``max_restarts`` restarts within ``restart_window`` seconds is a crash
loop: the server gives up (``on_fatal``) so that systemd or Kubernetes takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.engine.core_proc import EngineProcess, EngineStartError
from llmserve.engine.events import (
    EngineBusyError,
    EngineHealth,
    EngineUnavailableError,
    QueueFullError,
    RequestEvent,
    RequestStream,
    StatsSink,
)
from llmserve.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    ResetPrefixCache,
    StepOutputs,
    UtilityResult,
)
from llmserve.engine.output_processor import OutputProcessor, RequestState, SequenceDelta
from llmserve.engine.validation import check_request
from llmserve.logger import get_logger
from llmserve.models.loader import load_tokenizer
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import SchedulerStats
from llmserve.tokenizer import Tokenizer

logger = get_logger(__name__)


@dataclass
class _Tracked:
    state: RequestState
    queue: asyncio.Queue
    arrival: float
    deadline: float | None
    num_tokens_prompt: int
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0


def estimated_waiting(engine_waiting: int, in_transit: int, max_num_seqs: int,
                      engine_running: int) -> int:
    """Requests that will wait in the engine's queue: those it reported waiting, plus those
    sent since its report beyond its free running slots (a burst into an idle engine is not
    a queue). An engine with requests waiting has no free slot (its KV cache is full)."""
    free = 0 if engine_waiting else max(0, max_num_seqs - engine_running)
    return engine_waiting + max(0, in_transit - free)


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None, *,
                 max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 request_timeout: float | None = None, stats: StatsSink | None = None,
                 hang_timeout: float = 60.0, max_restarts: int = 5,
                 restart_window: float = 300.0,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        """``tokenizer``: the model's own (loaded from ``config``) unless given."""
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model.model)
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.request_timeout = request_timeout
        self.stats = stats
        self.hang_timeout = hang_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.on_fatal = on_fatal
        self.max_model_len = 0  # known once the engine is ready
        self.vocab_size = 0
        self.ready_info: EngineReady | None = None
        self.last_stats: SchedulerStats | None = None
        self.status = "starting"
        self.last_failure: str | None = None
        self.restart_times: deque[float] = deque()
        self.num_restarts = 0
        self._proc: EngineProcess | None = None
        self._processor = OutputProcessor(self.tokenizer)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._reader: asyncio.Task | None = None
        # Admission: the engine's last report plus what was sent since.
        self._sent = self._sent_tokens = 0
        self._engine_added = self._engine_added_tokens = 0
        self._engine_waiting = self._engine_waiting_tokens = 0
        self._last_message = time.monotonic()
        self._busy_since = time.monotonic()
        self._calls: dict[int, asyncio.Future] = {}  # utility calls awaiting their result
        self._call_ids = itertools.count()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        """Start the engine process and wait until it has loaded and warmed up the model.
        Raises EngineStartError (with the engine's own message) if it cannot start."""
        ready = await self._launch()
        self._tasks.append(asyncio.ensure_future(self._watchdog()))
        return ready

    async def _launch(self) -> EngineReady:
        proc = EngineProcess(self.config)
        self._proc = proc
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(proc.sentinel, lambda: died.done() or died.set_result(None))
        first = asyncio.ensure_future(proc.recv())
        await asyncio.wait({first, died}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():  # it died: its last word may still be in flight
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(first), 2.0)
        message = None
        if first.done() and not first.cancelled() and first.exception() is None:
            message = first.result()
        else:
            first.cancel()
        loop.remove_reader(proc.sentinel)
        if not isinstance(message, EngineReady):
            cause = proc.failure.message if proc.failure else proc.exit_cause()
            proc.kill()
            proc.close()
            self._proc = None
            raise EngineStartError(cause)
        self.ready_info = message
        self.max_model_len = message.max_model_len
        self.vocab_size = message.vocab_size
        self.last_stats = message.stats
        if self.stats is not None:
            self.stats.update_gauges(message.stats)
        self._sent = self._sent_tokens = 0
        self._engine_added = self._engine_added_tokens = 0
        self._engine_waiting = self._engine_waiting_tokens = 0
        self._last_message = time.monotonic()
        loop.add_reader(proc.sentinel, self._on_exit, proc)
        self._reader = asyncio.ensure_future(self._read(proc))
        self.status = "ready"
        logger.info("engine process %d ready: %s", message.pid, message.description)
        return message

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.status = "stopped"
        for task in self._tasks:
            task.cancel()
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            await proc.stop(timeout)
        if self._reader is not None:
            self._reader.cancel()

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def engine_pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def health(self) -> EngineHealth:
        return EngineHealth(self.status, self.num_restarts, self.last_failure, self.engine_pid)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**8}"

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # ---- requests ----------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError / ContextLengthError for a request the engine cannot serve, or
        EngineUnavailableError while no engine is ready; returns its resolved max_tokens."""
        self.validate_available()
        return check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def validate_available(self) -> None:
        if self.status == "ready":
            return
        if self.status == "restarting":
            raise EngineUnavailableError(f"the engine is restarting after a failure "
                                         f"({self.last_failure}); retry shortly")
        if self.status == "starting":
            raise EngineUnavailableError("the model is not ready yet")
        raise EngineUnavailableError(f"the engine is {self.status}", retry_after=30)

    def check_job(self, num_requests: int, prompt_tokens: int) -> None:
        """Raise ValueError for a job of ``num_requests`` requests (``prompt_tokens`` prompt
        tokens in all) that this server could never queue whole, however idle: its queue
        limits would refuse it for ever, so it is a bad request, not one to retry."""
        running = self.config.scheduler.max_num_seqs
        if self.max_queued_requests is not None:
            most = running + self.max_queued_requests
            if num_requests > most:
                raise ValueError(
                    f"{num_requests} prompts in one request can never be queued here: the "
                    f"server runs {running} requests at once and queues "
                    f"{self.max_queued_requests} more; send at most {most} a request")
        if self.max_queued_tokens is not None and prompt_tokens > self.max_queued_tokens:
            raise ValueError(
                f"{prompt_tokens} prompt tokens in one request can never be queued here: the "
                f"server queues at most {self.max_queued_tokens} prompt tokens; send fewer")

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request now (raising QueueFullError / ValueError / EngineUnavailableError
        at once) and return the stream of its events. Call on the event loop."""
        self.validate(prompt_token_ids, params)
        self._admit(len(prompt_token_ids))
        assert self._proc is not None
        # Sent before anything is recorded: a request that cannot be encoded for the engine
        # (text that is not valid Unicode) raises here and leaves nothing behind.
        self._proc.send(AddRequest(request_id, list(prompt_token_ids), params, priority))
        events: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        if not self._tracked:
            self._busy_since = now
        deadline = None if self.request_timeout is None else now + self.request_timeout
        state = self._processor.add_request(request_id, prompt, prompt_token_ids, params)
        self._tracked[request_id] = _Tracked(state, events, now, deadline,
                                             len(prompt_token_ids))
        self._sent += 1
        self._sent_tokens += len(prompt_token_ids)
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

    def abort(self, request_id: str, *, counted: bool = True) -> None:
        """End a request the client no longer waits for; its blocks are freed at once."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self._processor.pop(request_id)
        self._send_abort(request_id)
        if counted and self.stats is not None:
            self.stats.on_finished("abort", time.monotonic() - tracked.arrival,
                                   tracked.num_tokens_prompt, tracked.generated)

    async def reset_prefix_cache(self, timeout: float = 30.0) -> str:
        """Forget every cached prefix. Refused (EngineBusyError) while requests run: their
        blocks would stay cached, and a benchmark wants a cold cache, not a cooler one."""
        self.validate_available()
        if self._tracked:
            raise EngineBusyError(f"{len(self._tracked)} requests are running; reset the "
                                  "prefix cache when the server is idle")
        assert self._proc is not None
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._proc.send(ResetPrefixCache(call_id))
        try:
            ok, message = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not ok:
            raise EngineBusyError(message)
        return message

    def abort_all(self, error: str, message: str) -> None:
        """End every request with an error event (used on shutdown)."""
        for rid in list(self._tracked):
            self._fail(rid, error, message)

    def _send_abort(self, request_id: str, index: int | None = None,
                    stopped: bool = False) -> None:
        if self._proc is not None and self.status == "ready":
            self._proc.send(AbortRequest(request_id, index, stopped))

    def _admit(self, prompt_tokens: int) -> None:
        stats = self.last_stats
        waiting = estimated_waiting(self._engine_waiting, self._sent - self._engine_added,
                                    self.config.scheduler.max_num_seqs,
                                    stats.num_running if stats is not None else 0)
        waiting_tokens = (self._engine_waiting_tokens + self._sent_tokens
                          - self._engine_added_tokens)
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

    def _reject(self, reason: str) -> None:
        if self.stats is not None:
            self.stats.on_rejected(reason)

    @staticmethod
    def _retry_after(waiting: int) -> int:
        return max(1, min(30, waiting // 8))

    # ---- what the engine sends ------------------------------------------------------------

    async def _read(self, proc: EngineProcess) -> None:
        while True:
            message = await proc.recv()
            self._last_message = time.monotonic()
            if isinstance(message, StepOutputs):
                try:
                    self._on_step(message)
                except Exception as e:  # a bug here must not stop the reading
                    logger.exception("processing the engine's step outputs failed")
                    for rid in {o.request_id for o in message.outputs}:
                        self._fail(rid, "engine_error", f"internal error while processing "
                                                        f"this request's output: {e!r}")
            elif isinstance(message, UtilityResult):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result((message.ok, message.message))
            elif isinstance(message, EngineFailed):
                logger.error("engine process %d failed: %s", proc.pid, message.message)

    def _on_step(self, step: StepOutputs) -> None:
        self._engine_added, self._engine_added_tokens = step.num_added, step.tokens_added
        self._engine_waiting = step.stats.num_waiting
        self._engine_waiting_tokens = step.waiting_tokens
        self.last_stats = step.stats
        for failed in step.failed:
            self._fail(failed.request_id, "invalid_request", failed.message, failed.code)
        deltas, to_stop = self._processor.process(step.outputs)
        for rid, index in to_stop:
            self._send_abort(rid, index, stopped=True)
        now = time.monotonic()
        by_request: dict[str, list[SequenceDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        first_sched = {o.request_id: o.first_scheduled_time for o in step.outputs}
        for rid, ds in by_request.items():
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            self._record_timing(tracked, ds, now, first_sched.get(rid))
            event = RequestEvent(deltas=ds, prompt_logprobs=tracked.state.prompt_logprobs)
            if tracked.state.finished:
                event.output = tracked.state.to_output()
                del self._tracked[rid]
                self._processor.pop(rid)
                if self.stats is not None:
                    reason = tracked.state.seqs[0].finish_reason or "stop"
                    self.stats.on_finished(reason, now - tracked.arrival,
                                           tracked.num_tokens_prompt, tracked.generated)
            tracked.queue.put_nowait(event)
        if self.stats is not None:
            self.stats.on_step(step.stats, sum(len(o.new_token_ids) for o in step.outputs))

    def _fail(self, rid: str, error: str, message: str, code: str | None = None) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return
        self._send_abort(rid)
        self._processor.finish_aborted(rid)
        tracked.queue.put_nowait(RequestEvent(error=error, message=message, code=code))
        if self.stats is not None:
            self.stats.on_finished(error, time.monotonic() - tracked.arrival,
                                   tracked.num_tokens_prompt, tracked.generated)

    def _record_timing(self, t: _Tracked, deltas: list[SequenceDelta], now: float,
                       first_scheduled: float | None) -> None:
        t.generated += sum(len(d.token_ids) for d in deltas)
        if self.stats is None:
            return
        if t.first_token is None:
            # The engine's clock is CLOCK_MONOTONIC too (same machine): comparable.
            queue_time = None if first_scheduled is None else first_scheduled - t.arrival
            self.stats.on_first_token(now - t.arrival, queue_time, t.num_tokens_prompt)
        elif t.last_token is not None:
            self.stats.on_inter_token(now - t.last_token)
        t.first_token = t.first_token or now
        t.last_token = now

    # ---- the watchdog ----------------------------------------------------------------------

    async def _watchdog(self) -> None:
        """Expire deadlines; kill an engine that makes no progress while it has work."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if self.request_timeout is not None:
                for rid in [r for r, t in self._tracked.items()
                            if t.deadline is not None and now > t.deadline]:
                    self._fail(rid, "timeout", f"request timed out after "
                                               f"{self.request_timeout:g} s (--request-timeout)")
            proc = self._proc
            if (self.status == "ready" and proc is not None and self._tracked
                    and now - max(self._last_message, self._busy_since) > self.hang_timeout):
                logger.error("engine process %d made no progress for %.0f s with %d requests "
                             "in flight: killing it", proc.pid, self.hang_timeout,
                             len(self._tracked))
                proc.failure = EngineFailed(f"no progress for {self.hang_timeout:g} s "
                                            "(hang detector, --engine-hang-timeout)")
                proc.kill()

    def _on_exit(self, proc: EngineProcess) -> None:
        """The engine process ended (its sentinel became readable): from this moment no
        request is admitted; the rest happens in _recover."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        if proc is not self._proc or self.status != "ready":
            return
        self.status = "restarting"
        self._tasks.append(asyncio.ensure_future(self._recover(proc)))

    async def _recover(self, proc: EngineProcess) -> None:
        await asyncio.sleep(0.05)  # let its last word (EngineFailed) arrive
        if self._reader is not None:
            self._reader.cancel()
        proc.proc.join(1)
        cause = proc.exit_cause()
        self.last_failure = cause
        self.num_restarts += 1
        n = len(self._tracked)
        logger.error("engine process %d died (%s); failing %d requests in flight and "
                     "starting a new engine", proc.pid, cause, n)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailableError(f"the engine failed ({cause})"))
        self.abort_all("engine_error", f"the engine failed while running this request "
                                       f"({cause}); it was not completed")
        proc.close()
        self._proc = None
        if self.stats is not None:
            self.stats.on_engine_restart(_cause_kind(cause))
        while True:
            now = time.monotonic()
            self.restart_times.append(now)
            while self.restart_times and now - self.restart_times[0] > self.restart_window:
                self.restart_times.popleft()
            if len(self.restart_times) > self.max_restarts:
                self.status = "failed"
                message = (f"the engine failed {len(self.restart_times)} times in "
                           f"{self.restart_window:g} s (last: {self.last_failure}); giving up")
                logger.critical(message)
                if self.on_fatal is not None:
                    self.on_fatal(message)
                return
            try:
                await self._launch()
                logger.info("engine restarted (restart %d)", self.num_restarts)
                return
            except EngineStartError as e:
                self.last_failure = str(e)
                self.num_restarts += 1  # counted as /metrics counts it: a failure each
                if self.stats is not None:
                    self.stats.on_engine_restart(_cause_kind(str(e)))
                logger.error("%s", e)


def _cause_kind(cause: str) -> str:
    """A small label set for the restart counter."""
    if cause.startswith("killed by"):
        return "signal"
    if cause.startswith("no progress"):
        return "hang"
    if cause.startswith("exited with code"):
        return "exit"
    return "exception"
