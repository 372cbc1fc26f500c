"""Start the HTTP server: load and warm the model, then serve until SIGTERM/SIGINT drains.

On the first SIGTERM (or Ctrl-C) readiness turns 503 and new requests get 503; running
requests get up to ``--shutdown-timeout`` seconds to finish, the rest end with a final error
event; then uvicorn stops and the process exits with code 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from llmserve.config import EngineConfig, ServerConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.logger import get_logger
from llmserve.server.app import ServerState, build_app
from llmserve.server.metrics import ServerMetrics

logger = get_logger(__name__)
_IMPORTED = time.monotonic()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, state: ServerState,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self._loop is None:
            return super().handle_exit(sig, frame)  # second signal: stop now
        self.state.draining = True
        logger.info("shutdown requested: draining %d requests (up to %.0f s)",
                    self.engine.num_unfinished, self.shutdown_timeout)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_unfinished:
            logger.info("shutdown timeout: ending %d requests with an error",
                        self.engine.num_unfinished)
            self.engine.abort_all("shutdown", "the server is shutting down")
            for _ in range(100):  # let the final events reach their clients
                await asyncio.sleep(0.02)
                if not self.engine.num_unfinished:
                    break
            await asyncio.sleep(0.2)
        self.should_exit = True


def create_app(engine_config: EngineConfig,
               config: ServerConfig) -> tuple[FastAPI, AsyncLLM, ServerState]:
    """Load and warm the model, start the engine thread, build the app. Also the in-process
    mode: serve the returned app with any ASGI server or test client, in this process."""
    started = process_age_seconds()  # interpreter start, imports, arguments
    model_name = config.served_model_name or engine_config.model.model
    metrics = ServerMetrics(model_name)
    engine = AsyncLLM(engine_config, max_queued_requests=config.max_queued_requests,
                      max_queued_tokens=config.max_queued_tokens,
                      request_timeout=config.request_timeout, stats=metrics)
    state = ServerState()
    app = build_app(engine, config, metrics, state, model_name)
    warm_start = time.perf_counter()
    engine.warm_up()
    warm_up = time.perf_counter() - warm_start
    engine.start()
    metrics.update_gauges(engine.core.stats())
    state.ready = True
    core = engine.core
    logger.info("ready %.1f s after the process started (imports %.1f s, model load %.1f s, "
                "KV cache %.1f s, warm-up %.1f s)", process_age_seconds(), started,
                core.loaded.load_seconds, core.kv_cache_seconds, warm_up)
    return app, engine, state


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
    app, engine, state = create_app(engine_config, config)
    model_name = config.served_model_name or engine_config.model.model
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(uv_config, engine, state, config.shutdown_timeout)
    logger.info("serving %s on http://%s:%d", model_name, config.host, config.port)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
