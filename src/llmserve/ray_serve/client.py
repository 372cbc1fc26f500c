"""The ingress's engine: what the HTTP app asks of AsyncLLM, answered by engine replicas.

The app (server/app.py, server/serving.py) runs unchanged in the ingress: it tokenizes,
validates and shapes OpenAI replies; this client stands where AsyncLLM stands in a single
server and sends each engine request to a replica through Ray Serve's deployment handle,
whose request router picks the replica. A request's stream is the replica's stream of
RequestEvents, relayed.

Failures cost only the requests they touch:
- a replica that dies (or becomes unreachable), or whose engine fails, before the request's
  first event reached the client: the request is sent again, and the routers put that
  replica last (up to ``max_attempts`` sends in all);
- a replica that dies after the first event: the stream ends with an "engine_error" event,
  which the client sees as a final error event (streaming) or a 500 (not streaming), and
  the replica gets a strike: three within 30 s open its circuit breaker (reports.py);
- a replica whose engine is restarting answers "unavailable" and the request is sent
  again (the routers skip that replica once its next report says so), for up to
  ``unavailable_patience`` seconds before the client gets 503;
- a replica whose queue is full answers "queue_full": the other replicas are tried, and
  when every one is full (or Ray's router queue is), the client gets 429.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException, RequestCancelledError

from llmserve.engine.events import (
    EngineBusyError,
    EngineHealth,
    EngineUnavailableError,
    QueueFullError,
    RequestEvent,
)
from llmserve.engine.validation import ContextLengthError, check_request
from llmserve.logger import get_logger
from llmserve.ray_serve.messages import Accepted, Rejected, ReplicaInfo, Submission
from llmserve.ray_serve.reports import record_failure, record_success, replica_reports
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import Tokenizer

logger = get_logger(__name__)

# What a replica that died, or cannot be reached, raises in its caller.
_REPLICA_FAILURES = (RayActorError, ActorUnavailableError, RayTaskError)


class RayEngineClient:
    def __init__(self, handle: Any, tokenizer: Tokenizer, *, max_attempts: int = 3,
                 unavailable_patience: float = 5.0) -> None:
        self.handle = handle  # the engine replicas' DeploymentHandle
        self.tokenizer = tokenizer
        self.max_attempts = max_attempts  # sends of one request to replicas that failed
        # How long a request may keep meeting replicas whose engines are restarting
        # before it is answered 503.
        self.unavailable_patience = unavailable_patience
        self.max_model_len = 0
        self.vocab_size = 0
        self.ready_info: Any = None
        self.status = "starting"
        self.last_failure: str | None = None
        self.on_fatal = None
        self.stats: Any = None  # the ingress's metrics: the router's refusals are its own
        self._open: dict[str, RayRequestStream] = {}
        self._ids = itertools.count()

    async def start(self) -> Any:
        """Learn the model's limits from a replica (Ray routes to ready replicas only)."""
        info: ReplicaInfo = await self.handle.describe.remote()
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.ready_info = info.ready
        self.status = "ready"
        return info.ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.status = "stopped"
        self.abort_all("shutdown", "the server is shutting down")

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self._replicas_status() == "ready"

    def health(self) -> EngineHealth:
        reports = replica_reports().values()
        failures = [r["last_failure"] for r in reports if r.get("last_failure")]
        status = self.status if self.status != "ready" else self._replicas_status()
        return EngineHealth(status, sum(int(r.get("restarts", 0)) for r in reports),
                            failures[-1] if failures else None, None)

    def _replicas_status(self) -> str:
        """"ready" while some replica accepts requests (or none has reported yet)."""
        reports = list(replica_reports().values())
        if not reports or any(r.get("accepting") for r in reports):
            return "ready"
        return "restarting"

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 10**8}"

    @property
    def num_unfinished(self) -> int:
        return len(self._open)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        self.validate_available()
        return check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def validate_available(self) -> None:
        if self.status == "ready":
            return
        if self.status == "starting":
            raise EngineUnavailableError("the model is not ready yet")
        raise EngineUnavailableError(f"the server is {self.status}", retry_after=30)

    def check_job(self, num_requests: int, prompt_tokens: int) -> None:
        """Nothing to refuse up front: a job's requests go to replicas one by one, and
        replicas come and go, so no one replica's queue limits bound a job."""

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None, priority: int = 0) -> RayRequestStream:
        """Validate now; the request reaches a replica when the stream is first awaited
        (``accepted()``, which raises QueueFullError and the like before any byte)."""
        self.validate(prompt_token_ids, params)
        stream = RayRequestStream(self, Submission(request_id, list(prompt_token_ids), params,
                                                   prompt, priority))
        self._open[request_id] = stream
        return stream

    def abort(self, request_id: str, *, counted: bool = True) -> None:
        stream = self._open.get(request_id)
        if stream is not None:
            stream.close(counted=counted)

    def abort_all(self, error: str, message: str) -> None:
        for stream in list(self._open.values()):
            stream.fail(error, message)

    async def reset_prefix_cache(self, timeout: float = 30.0) -> str:
        raise EngineBusyError("the prefix cache is per replica: with --replicas, reset it by "
                              "restarting the replicas (or run a single server)",
                              code="per_replica")


class RayRequestStream:
    """One engine request's events from whichever replica serves it (see the module
    docstring for what happens when that replica fails)."""

    def __init__(self, client: RayEngineClient, submission: Submission) -> None:
        self.client = client
        self.request_id = submission.request_id
        self.submission = submission
        self.finished = False
        self.replica: str | None = None  # the replica that accepted the last send
        self._gen: Any = None  # that send's DeploymentResponseGenerator
        self._pending: deque[RequestEvent] = deque()  # received, not yet taken
        self._sends = 0
        self._failures = 0  # sends that ended by their replica failing
        self._avoid: set[str] = set()  # replicas that failed or refused this request
        self._relayed = 0
        self._forced: RequestEvent | None = None  # an end decided here (shutdown)

    def __aiter__(self) -> RayRequestStream:
        return self

    async def accepted(self) -> None:
        """Send the request until a replica queues it. Raises QueueFullError,
        EngineUnavailableError, ContextLengthError or ValueError as AsyncLLM.submit does;
        however it ends without a queued request (cancelled too), nothing is left behind."""
        try:
            await self._accept()
        except BaseException:
            self.finished = True
            self._close_quietly()
            raise

    async def _accept(self) -> None:
        """1. Send (to the replica the router picks; this request's failed or refusing
              replicas last).
           2. A replica that dies before answering: send again, up to max_attempts.
           3. A replica whose engine is restarting, or whose queue is full: send again,
              while another replica may take it (queue full) or for up to
              unavailable_patience seconds (restarting); then 429 or 503."""
        started, waits = time.monotonic(), 0
        while True:
            if self._forced is not None or self.finished:
                message = self._forced.message if self._forced else None
                raise EngineUnavailableError(message or "the request was withdrawn")
            try:
                try:
                    self._send()
                    first = await self._gen.__anext__()
                except BaseException:
                    self._gen = None  # that send is over: nothing to cancel
                    raise
            except _REPLICA_FAILURES as e:
                self._failures += 1
                if self._failures >= self.client.max_attempts:
                    raise EngineUnavailableError(f"no replica could take the request "
                                                 f"({_cause(e)})") from None
                logger.warning("request %s: a replica failed before accepting it (%s); "
                               "sending it again", self.request_id, _cause(e))
                continue
            except BackPressureError as e:  # every replica busy and Ray's queue full
                queued = int(getattr(e, "num_queued_requests", 0) or 0)
                if self.client.stats is not None:
                    self.client.stats.on_rejected("queue_full")
                raise QueueFullError(
                    f"the server is at capacity: every replica is busy and {queued} requests "
                    "wait for one; retry later", max(1, min(30, queued // 8))) from None
            except StopAsyncIteration:
                raise EngineUnavailableError("a replica ended the request without an "
                                             "answer") from None
            except RequestCancelledError:
                raise EngineUnavailableError("the request was withdrawn") from None
            except RayServeException as e:  # no replica (deleted, draining)
                raise EngineUnavailableError(f"no replica is serving ({_cause(e)})") from None
            if isinstance(first, Accepted):
                self.replica = first.replica
                return
            if isinstance(first, Rejected) and first.kind in ("unavailable", "queue_full"):
                self._avoid.add(first.replica)
                others = len(replica_reports()) > len(self._avoid)
                patient = (first.kind == "unavailable"
                           and time.monotonic() - started < self.client.unavailable_patience)
                if others or patient:
                    await asyncio.sleep(min(0.05 * 2 ** waits, 0.5))
                    waits += 1
                    continue
            raise _rejection(first)

    def _send(self) -> None:
        """Send the request once more, cancelling any earlier send (its replica may be
        alive and still working on it); each send has an engine request id of its own."""
        _cancel(self._gen)
        self._pending.clear()
        self._sends += 1
        sub = self.submission
        if self._sends > 1:
            sub = replace(sub, request_id=f"{self.request_id}-send{self._sends}",
                          avoid=frozenset(self._avoid))
        self._gen = self.client.handle.options(stream=True).generate.remote(sub)

    async def __anext__(self) -> RequestEvent:
        if self.finished:
            raise StopAsyncIteration
        if self._gen is None:
            await self.accepted()
        while True:
            event = await self._next_event()
            if (event.error == "engine_error" and self._relayed == 0 and self._forced is None
                    and not self.finished and self._failures + 1 < self.client.max_attempts):
                # Nothing reached the client yet: send it again, elsewhere.
                self._failures += 1
                if self.replica is not None:
                    self._avoid.add(self.replica)
                logger.warning("request %s: %s; sending it again", self.request_id,
                               event.message)
                try:
                    await self._accept()
                except (QueueFullError, EngineUnavailableError) as e:
                    kind = "queue_full" if isinstance(e, QueueFullError) else "unavailable"
                    event = RequestEvent(error=kind, message=str(e))
                except ValueError as e:  # the replicas' limits differ (a rolling update)
                    event = RequestEvent(error="invalid_request", message=str(e))
                else:
                    continue
            break
        if self._forced is not None:
            event = self._forced
        self._relayed += 1
        if event.output is not None or event.error is not None:
            self.finished = True
            self._close_quietly()
            if event.output is not None:
                record_success(self.replica)
        return event

    async def _next_event(self) -> RequestEvent:
        """The next event of the current send; a failure of its replica as an error
        event (and a strike against that replica's circuit breaker)."""
        try:
            if not self._pending:
                self._pending.extend(await self._gen.__anext__())
            return self._pending.popleft()
        except (RequestCancelledError, asyncio.CancelledError):
            if self._forced is not None:
                return self._forced
            if self.finished:  # closed here while a reader waited
                raise StopAsyncIteration from None
            raise
        except StopAsyncIteration:
            return self._forced or RequestEvent(
                error="engine_error",
                message="the replica ended this request's stream without a final event")
        except _REPLICA_FAILURES as e:
            record_failure(self.replica)
            return RequestEvent(error="engine_error", message=(
                f"the replica serving this request failed ({_cause(e)}) after "
                f"{self._relayed} events; it was not completed"))
        except RayServeException as e:
            return RequestEvent(error="engine_error",
                                message=f"the request's replica is gone ({_cause(e)})")

    def fail(self, error: str, message: str) -> None:
        """End the stream here with an error event (the replica's request is cancelled)."""
        if not self.finished and self._forced is None:
            self._forced = RequestEvent(error=error, message=message)
            _cancel(self._gen)

    def close(self, *, counted: bool = True) -> None:
        """Cancel the request on its replica (which aborts it in the engine)."""
        if not self.finished:
            self.finished = True
            self._close_quietly()

    def _close_quietly(self) -> None:
        self.client._open.pop(self.request_id, None)
        _cancel(self._gen)


def _cancel(gen: Any) -> None:
    """Cancel a send, best effort: Ray's cancel re-raises the send's own routing error
    (BackPressureError...) when it had one, which here means there is nothing to cancel."""
    if gen is None:
        return
    try:
        gen.cancel()
    except Exception as e:
        logger.debug("cancelling a send: %r", e)


def _rejection(answer: object) -> Exception:
    if not isinstance(answer, Rejected):
        return EngineUnavailableError(f"unexpected answer from a replica: {answer!r}")
    if answer.kind == "queue_full":
        return QueueFullError(answer.message, answer.retry_after)
    if answer.kind == "unavailable":
        return EngineUnavailableError(answer.message, answer.retry_after)
    if answer.kind == "context_length":
        return ContextLengthError(answer.message)
    return ValueError(answer.message)


def _cause(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"
