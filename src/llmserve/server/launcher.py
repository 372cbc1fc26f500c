"""Start the HTTP server: the engine process first, then HTTP, until a signal drains it.

The first SIGTERM (or Ctrl-C) drains: readiness turns 503 and new requests get 503; running
requests get up to ``--shutdown-timeout`` seconds to finish. A second signal ends the drain
early but still cleanly: every open stream gets a final error event and [DONE], every
waiting non-streaming request a 503 in OpenAI's envelope. Either way the engine process is
stopped and the server exits with code 0. If the engine crash-loops, the server exits 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from llmserve.config import EngineConfig, ServerConfig, check_device
from llmserve.engine.async_llm import AsyncLLM
from llmserve.gc_freeze import freeze_startup_objects
from llmserve.logger import get_logger
from llmserve.server.accounts import Accounts
from llmserve.server.app import ServerState, build_app
from llmserve.server.http_guard import MAX_HEADER_BYTES, GuardedH11Protocol
from llmserve.server.metrics import ServerMetrics
from llmserve.tokenizer.chat_template import (
    ChatTemplateError,
    check_chat_template,
    read_chat_template,
)
from llmserve.tokenizer.tokenizer import Tokenizer

logger = get_logger(__name__)
_IMPORTED = time.monotonic()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, state: ServerState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry: asyncio.Event | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Never uvicorn's own handler: it would cut open connections on a second signal
        # and re-raise the signal at exit (status 143 or 130 instead of 0).
        loop = self._loop
        if loop is None:
            self.should_exit = True
            return
        if not self.state.draining:
            self.state.draining = True
            logger.info("shutdown requested: draining %d requests (up to %.0f s; a second "
                        "signal ends the drain now)", self.engine.num_unfinished,
                        self.shutdown_timeout)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            logger.info("second signal: ending %d requests now", self.engine.num_unfinished)
            assert self._hurry is not None
            loop.call_soon_threadsafe(self._hurry.set)

    def give_up(self, message: str) -> None:
        """The engine cannot be kept alive: exit non-zero so a supervisor takes over."""
        self.exit_code = 1
        self.state.draining = True
        self.should_exit = True

    async def _drain(self) -> None:
        assert self._hurry is not None
        deadline = time.monotonic() + self.shutdown_timeout
        while (self.engine.num_unfinished and time.monotonic() < deadline
               and not self._hurry.is_set()):
            await asyncio.sleep(0.05)
        if self.engine.num_unfinished:
            logger.info("ending %d requests with an error", self.engine.num_unfinished)
            self.engine.abort_all("shutdown", "the server is shutting down")
            await asyncio.sleep(0.2)  # let the final events reach their clients
        self.should_exit = True


def create_app(engine_config: EngineConfig,
               config: ServerConfig) -> tuple[FastAPI, AsyncLLM, ServerState]:
    """Build the app and its engine handle; ``await engine.start()`` starts the engine
    process. Also the in-process mode: serve the app with any ASGI server or test client."""
    engine, metrics, model_name = make_engine(engine_config, config)
    state = ServerState()
    app = build_app(engine, config, metrics, state, model_name, open_accounts(config))
    return app, engine, state


def make_engine(engine_config: EngineConfig,
                config: ServerConfig) -> tuple[AsyncLLM, ServerMetrics, str]:
    """The engine handle (its process not started yet), with the tokenizer and the chat
    template the server uses: a template that does not parse is refused here, before the
    model loads."""
    model_name = config.served_model_name or engine_config.model.model
    metrics = ServerMetrics(model_name)
    engine = AsyncLLM(engine_config,
                      max_queued_requests=config.max_queued_requests,
                      max_queued_tokens=config.max_queued_tokens,
                      request_timeout=config.request_timeout, stats=metrics,
                      hang_timeout=config.engine_hang_timeout,
                      max_restarts=config.engine_max_restarts,
                      restart_window=config.engine_restart_window)
    use_chat_template(engine.tokenizer, config.chat_template, engine_config.model.model)
    return engine, metrics, model_name


def use_chat_template(tokenizer: Tokenizer, chat_template: str | None, model: str) -> None:
    """Give ``tokenizer`` the --chat-template (Jinja text or a file), if any, and check that
    its template parses: a broken one is the server's problem, refused at start, not one to
    answer each chat request with a 400 that blames the client's messages. A model without
    a chat template keeps none (chat requests then get a 400 that says so)."""
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    if not tokenizer.chat_template:
        return
    try:
        check_chat_template(tokenizer.chat_template)
    except ChatTemplateError as e:
        why = str(e).removeprefix("invalid chat template: ")
        if chat_template is not None:
            raise ValueError(f"--chat-template does not parse as a Jinja template: {why}"
                             ) from None
        raise ValueError(f"the chat template of model {model} does not parse as a Jinja "
                         f"template ({why}); give one that does with --chat-template "
                         "FILE") from None


def open_accounts(config: ServerConfig) -> Accounts:
    """The keys, limits and usage accounting the server starts with (the usage database is
    created and migrated here when it is new)."""
    db = None
    if config.use_database:
        from llmserve.usage import Database, database_url

        db = Database(database_url(config.data_dir, config.database_url))
    return Accounts(config.api_key, db, config.request_log)


def check_usage_database(config: ServerConfig) -> None:
    """Refuse, before the model loads, a SQLite usage database this process cannot write
    or create (creates nothing: the server opens the database once its engine is up)."""
    if not config.use_database:
        return
    from llmserve.usage.database import check_writable, database_url, sqlite_path

    path = sqlite_path(database_url(config.data_dir, config.database_url))
    if path is not None:
        check_writable(path)


def process_age_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere, since
    this module was imported)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks after boot
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    return asyncio.run(_serve(engine_config, config))


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a host that does not resolve or a
    port in use fails at once, naming what to change, not after the load (and after the
    log said "serving"). Not inherited by the engine and tokenizer processes."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {e.strerror}"
                         ) from None
    return sock


async def _serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    started = process_age_seconds()  # interpreter start, imports, arguments
    # The engine process loads the model on this machine: a device it cannot use is refused
    # before the socket and the usage database are opened.
    check_device(engine_config.model.device, available=True)
    check_usage_database(config)
    sock = listen_socket(config.host, config.port)
    try:
        return await _serve_on(sock, engine_config, config, started)
    finally:
        sock.close()


async def _serve_on(sock: socket.socket, engine_config: EngineConfig, config: ServerConfig,
                    started: float) -> int:
    engine, metrics, model_name = make_engine(engine_config, config)
    try:
        ready = await engine.start()
        # Opened (created, when new) only now: a start that fails leaves no database behind.
        # Nothing listens before this returns, so /ready is never true without it.
        accounts = open_accounts(config)
    except BaseException:
        await engine.shutdown()
        raise
    state = ServerState()
    app = build_app(engine, config, metrics, state, model_name, accounts)
    logger.info("access: %s", accounts.describe())
    logger.info("ready %.1f s after the process started (imports %.1f s; engine process: "
                "model load %.1f s, KV cache %.1f s, warm-up %.1f s)", process_age_seconds(),
                started, ready.load_seconds, ready.kv_cache_seconds, ready.warm_up_seconds)
    protocol = type("Protocol", (GuardedH11Protocol,),
                    {"header_timeout": config.header_timeout})
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               timeout_graceful_shutdown=5, timeout_keep_alive=5,
                               http=protocol, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    server = DrainingServer(uv_config, engine, state, config.shutdown_timeout)
    engine.on_fatal = server.give_up
    app.state.tokenizers.start()
    accounts.start()
    freeze_startup_objects("API server")
    logger.info("serving %s on http://%s:%d", model_name, config.host,
                sock.getsockname()[1])
    try:
        await server.serve(sockets=[sock])
    finally:
        # uvicorn has put the default handlers back: a signal now would kill the process
        # partway through stopping the engine and writing the last usage (exit 143).
        _ignore_signals_from_now_on()
        app.state.tokenizers.shutdown()
        await engine.shutdown()
        await accounts.close()  # after the drain: every finished request's usage is written
    return server.exit_code


def _ignore_signals_from_now_on() -> None:
    """From now until the process exits, SIGINT and SIGTERM are ignored: the server is
    stopping its processes and writing what is left (SIGKILL still ends it). SIG_IGN, not a
    Python handler: the interpreter puts the default back on those as it finalizes."""
    logger.info("stopping the engine and writing the last usage (SIGINT and SIGTERM are "
                "ignored from now on)")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
