"""HTTP hygiene for a server that may sit behind a proxy or be reached from a browser.

- A request with both Content-Length and Transfer-Encoding is refused and its connection
  closed (RFC 9112 section 6.1: the framing is ambiguous, the classic request smuggling).
- Headers: at most ``MAX_HEADERS`` of them (431), at most ``MAX_HEADER_BYTES`` in all
  (431 here; also h11's limit on a head that arrives in pieces, set in the launcher), and
  they must arrive within ``header_timeout``
  seconds of the first byte of a request (or of the connection): a client that trickles
  its headers (slowloris) is answered 408 and disconnected.
- The Host header must name this server (``--allowed-hosts``; by default the loopback names
  when bound to loopback), against DNS rebinding: a web page that resolves its own name to
  127.0.0.1 must not reach a local server that has no API key.

The body read timeout lives with the body size limit (server/app.py: BodySizeLimit).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmserve.server.errors import error_body

MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """The loopback names when bound to loopback; otherwise any host (None)."""
    return LOOPBACK_HOSTS if bind_host in LOOPBACK_HOSTS else None


def parse_allowed_hosts(value: str | None, bind_host: str) -> tuple[str, ...] | None:
    """``--allowed-hosts``: comma-separated names ("*" for any); None for the default."""
    if value is None:
        return default_allowed_hosts(bind_host)
    names = tuple(h.strip().lower() for h in value.split(",") if h.strip())
    if not names:
        raise ValueError("allowed-hosts must name at least one host, or '*' for any")
    return None if "*" in names else names


class HTTPGuard:
    """ASGI middleware: framing, header count and Host checks, before anything else runs."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None) -> None:
        self.app = app
        self.allowed = None if allowed_hosts is None else frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        names = {k for k, _ in headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            return await _refuse(send, 400, "the request has both Content-Length and "
                                 "Transfer-Encoding; send one of them (RFC 9112 6.1)",
                                 "ambiguous_framing", close=True)
        if len(headers) > MAX_HEADERS:
            return await _refuse(send, 431, f"the request has {len(headers)} header fields; "
                                 f"at most {MAX_HEADERS} are accepted",
                                 "too_many_headers", close=True)
        # h11's limit holds only for headers that arrive in pieces: a whole head read at
        # once passes it, whatever its size.
        size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
        if size > MAX_HEADER_BYTES:
            return await _refuse(send, 431, f"the request's header fields take {size} bytes; "
                                 f"at most {MAX_HEADER_BYTES} are accepted",
                                 "headers_too_large", close=True)
        if self.allowed is not None:
            host = _host_name(dict(headers).get(b"host", b"").decode("latin-1"))
            if host not in self.allowed:
                return await _refuse(
                    send, 421, f"the Host header names {host or 'nothing'!r}, which this "
                    f"server does not answer to; allowed: {', '.join(sorted(self.allowed))} "
                    "(--allowed-hosts)", "host_not_allowed")
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _refuse(send: Send, status: int, message: str, code: str,
                  close: bool = False) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers (uvicorn has none: a
    client may send one header byte a minute and hold its connection forever)."""

    header_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()
        super().data_received(data)
        if not self._between_requests():
            self._disarm()  # the headers of a request are in

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        body = json.dumps(error_body(
            f"request headers not received within {self.header_timeout:g} s",
            "invalid_request_error", code="request_timeout")).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()
