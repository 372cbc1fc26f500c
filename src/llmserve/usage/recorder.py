"""Usage accounting off the request path: the event loop only appends to a queue; a writer
thread folds what arrived into per-day rows (and request logs, when on) in one transaction
about once a second. ``close()`` writes everything still queued, so a clean shutdown loses
nothing; a failed write is retried at the next flush."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import DataError, IntegrityError

from llmserve.logger import get_logger
from llmserve.usage.database import Database
from llmserve.usage.keys import utcnow
from llmserve.usage.schema import DailyUsage, RequestLog

logger = get_logger(__name__)

REQUEST_LOG_LEVELS = ("off", "metadata", "full")
_MAX_PENDING = 100_000  # events kept while the database cannot be written


@dataclass(frozen=True)
class UsageEvent:
    """One finished request, as its client was billed (the response's usage)."""

    request_id: str
    key_id: int | None
    model: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    latency_seconds: float | None = None
    prompt: str | None = None  # kept only with request logs at "full"
    output: str | None = None
    at: datetime = field(default_factory=utcnow)


class UsageRecorder:
    def __init__(self, db: Database, request_log: str = "off",
                 flush_interval: float = 1.0) -> None:
        if request_log not in REQUEST_LOG_LEVELS:
            raise ValueError(f"request log level must be one of {', '.join(REQUEST_LOG_LEVELS)}"
                             f", got {request_log!r}")
        self.db = db
        self.request_log = request_log
        self.flush_interval = flush_interval
        self._queue: queue.SimpleQueue[UsageEvent | _Flush | None] = queue.SimpleQueue()
        self._pending: list[UsageEvent] = []
        self._written = 0
        self._dropped = 0  # requests the database refused (logged one by one)
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()

    def record(self, event: UsageEvent) -> None:
        """Thread-safe and non-blocking: safe to call from the event loop."""
        self._queue.put(event)

    @property
    def events_written(self) -> int:
        return self._written

    @property
    def events_dropped(self) -> int:
        return self._dropped

    def flush(self, timeout: float = 10.0) -> None:
        """Write everything recorded so far (for tests and `close`)."""
        done = threading.Event()
        self._queue.put(_Flush(done))
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._pending:
            logger.error("usage accounting: %d requests could not be written to %s",
                         len(self._pending), self.db.url)

    # ---- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            flushes: list[_Flush] = []
            # Gather for one interval (a commit per request would cost the server more CPU
            # than the request's own HTTP handling), or until asked to flush or stop.
            deadline = time.monotonic() + self.flush_interval
            while not flushes and not stop:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                stop = self._take(item, flushes)
            while not stop:  # and whatever else is already queued
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                stop = self._take(item, flushes)
            if self._pending:
                self._write()
            for f in flushes:
                f.done.set()

    def _take(self, item: UsageEvent | _Flush | None, flushes: list[_Flush]) -> bool:
        """File one queued item; True for the stop mark."""
        if item is None:
            return True
        if isinstance(item, _Flush):
            flushes.append(item)
        else:
            self._pending.append(item)
        return False

    def _write(self) -> None:
        events = self._pending
        try:
            with self.db.session() as s:
                self._fold_daily(s, events)
                if self.request_log != "off":
                    s.add_all(self._log_row(e) for e in events)
        except (DataError, IntegrityError) as e:  # a row the database refuses: not transient
            logger.warning("usage accounting: the database refused a batch of %d requests "
                           "(%s); writing them one by one", len(events), e)
            self._write_apart(events)
            return
        except Exception as e:
            if len(events) > _MAX_PENDING:
                del events[: len(events) - _MAX_PENDING]
            logger.warning("usage accounting: writing %d requests failed (%s); retrying",
                           len(events), e)
            return
        self._written += len(events)
        self._pending = []

    def _write_apart(self, events: list[UsageEvent]) -> None:
        """Each request in a transaction of its own, so that one the database refuses
        cannot hold back everyone's usage: it is dropped, with an error in the log."""
        for i, e in enumerate(events):
            try:
                with self.db.session() as s:
                    self._fold_daily(s, [e])
                    if self.request_log != "off":
                        s.add(self._log_row(e))
            except (DataError, IntegrityError) as err:
                self._dropped += 1
                logger.error("usage accounting: request %s dropped, the database refused it: "
                             "%s", e.request_id, err)
                continue
            except Exception:  # the database went away meanwhile: the rest waits
                self._pending = events[i:]
                return
            self._written += 1
        self._pending = []

    @staticmethod
    def _fold_daily(session, events: list[UsageEvent]) -> None:
        totals: dict[tuple[int | None, date, str], list[int]] = defaultdict(lambda: [0] * 4)
        for e in events:
            t = totals[(e.key_id, e.at.date(), e.model)]
            t[0] += 1
            t[1] += e.prompt_tokens
            t[2] += e.completion_tokens
            t[3] += e.cached_tokens
        for (key_id, day, model), (requests, prompt, completion, cached) in totals.items():
            # One UPDATE that adds in the database (never read, add, write back: two servers
            # sharing a database would lose one's counts); a row per (key, day, model) as a
            # rule, and if two servers insert the day's first row at once, both rows count.
            key_match = (DailyUsage.key_id.is_(None) if key_id is None
                         else DailyUsage.key_id == key_id)
            first_row = (select(func.min(DailyUsage.id))
                         .where(key_match, DailyUsage.day == day, DailyUsage.model == model)
                         .scalar_subquery())
            added = session.execute(
                update(DailyUsage)
                .where(DailyUsage.id == first_row)
                .values(requests=DailyUsage.requests + requests,
                        prompt_tokens=DailyUsage.prompt_tokens + prompt,
                        completion_tokens=DailyUsage.completion_tokens + completion,
                        cached_tokens=DailyUsage.cached_tokens + cached)
                .execution_options(synchronize_session=False))
            if added.rowcount == 0:
                session.add(DailyUsage(key_id=key_id, day=day, model=model, requests=requests,
                                       prompt_tokens=prompt, completion_tokens=completion,
                                       cached_tokens=cached))

    def _log_row(self, e: UsageEvent) -> RequestLog:
        full = self.request_log == "full"
        return RequestLog(request_id=e.request_id, key_id=e.key_id, created_at=e.at,
                          model=e.model, endpoint=e.endpoint, finish_reason=e.finish_reason,
                          prompt_tokens=e.prompt_tokens, completion_tokens=e.completion_tokens,
                          latency_seconds=e.latency_seconds,
                          prompt=_storable(e.prompt) if full else None,
                          output=_storable(e.output) if full else None)


def _storable(text: str | None) -> str | None:
    """Text as every database stores it: PostgreSQL's text holds no NUL character (a model
    can write one, and a client can send one as a token id), so NUL is kept as U+FFFD."""
    return text.replace("\x00", "\ufffd") if text and "\x00" in text else text


@dataclass(frozen=True)
class _Flush:
    done: threading.Event
