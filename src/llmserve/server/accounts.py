"""Who may call the server, within which limits, and what each caller used.

Keys come from two places: the single ``--api-key`` (no limits, usage recorded without a
key) and the usage database's keys (``llmserve keys create``), each with its own limits and
usage. As soon as either exists, every path but the probes, the metrics and the console's
static files needs ``Authorization: Bearer KEY``. The database's keys are read again every
couple of seconds, so a key created or revoked from the command line takes effect in a
running server without a restart.

The check runs in ASGI middleware, before a body is read; the limits apply to the
generating endpoints (completions and chat). Usage reaches the database through
UsageRecorder's writer thread, never on the request's path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.logger import get_logger
from llmserve.server.errors import APIError
from llmserve.server.metrics import ServerMetrics
from llmserve.usage import (
    Database,
    KeyInfo,
    KeyStore,
    RateLimiter,
    UsageEvent,
    UsageRecorder,
    hash_key,
)

logger = get_logger(__name__)

# Paths open without a key: probes, the scraper, and the console's page and static files
# (which hold no secret; everything the console reads needs the key).
# "/console/": its redirect to "/console" (a browser's typed URL) needs no key either.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/console", "/console/",
                        "/favicon.ico"})
OPEN_PREFIXES = ("/console/static/",)
# What a key's limits apply to.
LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


@dataclass(frozen=True)
class Principal:
    """The caller: a database key, or None for the shared --api-key and for servers that
    require no key."""

    key: KeyInfo | None = None

    @property
    def key_id(self) -> int | None:
        return self.key.id if self.key else None


ANONYMOUS = Principal()


class Accounts:
    def __init__(self, api_key: str | None, db: Database | None, request_log: str = "off",
                 refresh_interval: float = 2.0) -> None:
        self.api_key = api_key
        self.db = db
        self.store = KeyStore(db) if db is not None else None
        self.recorder = UsageRecorder(db, request_log) if db is not None else None
        self.request_log = request_log
        self.limiter = RateLimiter()
        self.refresh_interval = refresh_interval
        self._keys: dict[str, KeyInfo] = self.store.active_by_hash() if self.store else {}
        # A database that holds a key, even only revoked ones, requires one: revoking the
        # last key must not open the server to everyone.
        self._keyed = self.store.any_created() if self.store else False
        self._refresher: asyncio.Task | None = None

    @property
    def required(self) -> bool:
        return self.api_key is not None or self._keyed or bool(self._keys)

    def describe(self) -> str:
        where = f"usage in {self.db.url}" if self.db else "no usage database"
        keys = f"{len(self._keys)} active database keys" if self._keys else "no database keys"
        shared = ", the shared --api-key" if self.api_key else ""
        return (f"{keys}{shared}; {where}; request logs {self.request_log}"
                + ("" if self.required else "; no key required"))

    def authenticate(self, token: str) -> Principal | None:
        if self.api_key is not None and hmac.compare_digest(token.encode(),
                                                            self.api_key.encode()):
            return ANONYMOUS
        key = self._keys.get(hash_key(token))
        return Principal(key) if key is not None else None

    def reserve(self, principal: Principal, num_tokens: int) -> int:
        """Reserve the most a parsed request can use from its key's tokens per minute;
        returns what was reserved (0 without a token limit). Raises 429 if it does not fit
        now (Retry-After: until it does) or ever (no Retry-After)."""
        key = principal.key
        if key is None or key.limits.tokens_per_minute is None:
            return 0
        decision = self.limiter.reserve(key.id, key.limits, num_tokens, time.monotonic())
        if decision.allowed:
            return num_tokens
        headers = dict(decision.headers)
        message = f"rate limit reached for key '{key.name}': {decision.reason}"
        if math.isfinite(decision.retry_after):
            wait = max(1, math.ceil(decision.retry_after))
            headers["Retry-After"] = str(wait)
            message += f"; try again in {wait} s"
        raise APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                       headers=headers)

    def release(self, principal: Principal, num_tokens: int) -> None:
        """Give back tokens reserved for a request that used fewer (or never ran)."""
        if principal.key is not None and num_tokens > 0:
            self.limiter.give_back(principal.key.id, num_tokens, time.monotonic())

    def record(self, principal: Principal, event: UsageEvent, reserved: int = 0) -> None:
        """A request ended: settle its reservation and queue its usage for the database."""
        self.release(principal, reserved - event.prompt_tokens - event.completion_tokens)
        if self.recorder is not None:
            self.recorder.record(event)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.store is not None:
            self._refresher = asyncio.ensure_future(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                keys = await asyncio.to_thread(self.store.active_by_hash)
                keyed = keys or await asyncio.to_thread(self.store.any_created)
            except Exception as e:  # keep the last good view of the keys
                logger.warning("reading API keys failed (keeping the last ones read): %s", e)
                continue
            if keys.keys() != self._keys.keys():
                if keys or self.api_key is not None:
                    logger.info("API keys changed: %d active", len(keys))
                else:
                    logger.warning("API keys changed: none active; every request is refused "
                                   "(401) until a key is created")
            self._keys, self._keyed = keys, bool(keyed)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)  # writes what is still queued
        if self.db is not None:
            self.db.close()


class Gatekeeper:
    """ASGI middleware: 401 for a missing or unknown key, 429 (Retry-After and OpenAI's
    x-ratelimit-* headers) for a key over its limits, before the body is read. The caller
    is left in ``scope["state"]["principal"]`` for the endpoints."""

    def __init__(self, app: ASGIApp, accounts: Accounts, metrics: ServerMetrics) -> None:
        self.app = app
        self.accounts = accounts
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"]):
            return await self.app(scope, receive, send)
        accounts = self.accounts
        principal: Principal | None = ANONYMOUS
        if accounts.required:
            given = [v for k, v in scope.get("headers") or [] if k == b"authorization"]
            if len(given) > 1:  # which one counts would depend on who reads them
                return await send_error(send, APIError(
                    400, f"{len(given)} Authorization headers: send one",
                    code="invalid_api_key"))
            header = given[0] if given else b""
            scheme, _, token = header.decode("latin-1").partition(" ")
            principal = (accounts.authenticate(token.strip()) if scheme.lower() == "bearer"
                         else None)
            if principal is None:
                return await send_error(send, APIError(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key"))  # as OpenAI
        scope.setdefault("state", {})["principal"] = principal
        key = principal.key
        if key is None or scope["path"] not in LIMITED_PATHS or (
                key.limits.requests_per_minute is None and key.limits.tokens_per_minute is None):
            return await self.app(scope, receive, send)
        decision = accounts.limiter.admit(key.id, key.limits, time.monotonic())
        if not decision.allowed:
            self.metrics.on_rejected("rate_limit")
            wait = max(1, math.ceil(decision.retry_after))
            return await send_error(send, APIError(
                429, f"rate limit reached for key '{key.name}': {decision.reason}; try again "
                     f"in {wait} s", type="rate_limit_error", code="rate_limit_exceeded",
                headers={"Retry-After": str(wait), **decision.headers}))
        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The buckets as they stand when the response starts: with this request's
                # reservation (settled, when it ran to the end) and those of the others in
                # flight. Headers the endpoint set itself (a 429 from the token
                # reservation) are kept.
                limits = accounts.limiter.headers(key.id, time.monotonic())
                own = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in limits.items()]
                message = {**message, "headers": [*message.get("headers", []),
                                                  *(h for h in extra if h[0] not in own)]}
            await send(message)

        await self.app(scope, receive, send_with_limits)


class ResponseCounter:
    """ASGI middleware, outermost: counts every response by status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.on_response(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # Starlette's outermost handler answers it, outside this one
                self.metrics.on_response(500)
            raise


async def send_error(send: Send, error: APIError, close: bool = False) -> None:
    """An error in OpenAI's envelope, straight from ASGI middleware."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (error.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
