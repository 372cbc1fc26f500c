"""The engine core in a process of its own, and the API server's handle on it.

Why a process: a crashed kernel, an exception in the engine or the out-of-memory killer
then costs the requests in flight, not the server (the API server notices, answers them,
and starts a new engine); and the engine's Python work no longer takes turns on one GIL
with the event loop that serves HTTP.

Transport: two ZeroMQ PUSH/PULL sockets over a Unix-domain (ipc://) path, one per
direction. ZeroMQ frames messages, never blocks the sender (the queues are unbounded, and
a message to a dead peer is dropped rather than raising), and its asyncio sockets let the
API server await the engine's outputs on its event loop with no reader thread; a pipe
would need its own framing and a thread to read without blocking. Each engine gets fresh
sockets, so nothing addressed to a dead engine reaches its successor.

The process is started with "spawn" (a fork of a process that runs an event loop, ZeroMQ
and OpenMP threads is unsafe), asks Linux to kill it when the API server dies
(PR_SET_PDEATHSIG), and ignores SIGINT: Ctrl-C in a terminal reaches the whole process
group, and it is the API server that decides how the engine stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from llmserve.config import EngineConfig
from llmserve.engine.messages import (
    AbortRequest,
    AddRequest,
    Codec,
    EngineFailed,
    EngineInput,
    EngineOutput,
    EngineReady,
    RequestFailed,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    UtilityResult,
)
from llmserve.errors import LLMServeError
from llmserve.gc_freeze import freeze_startup_objects
from llmserve.logger import get_logger
from llmserve.parent_death import die_with_parent

logger = get_logger(__name__)

_IDLE_POLL_MS = 1000  # an idle engine wakes this often to see whether its parent is alive


# ---- the engine process ------------------------------------------------------------------


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int) -> None:
    """Entry point of the engine process: load, warm up, say ready, then serve messages."""
    die_with_parent(parent_pid)
    # The API server owns the engine's lifetime: it drains, then sends Shutdown (and kills
    # it past a deadline), and the engine dies with it. Ctrl-C, systemd and `timeout` signal
    # the whole process group: the engine must not die under the requests being drained.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    codec = Codec()
    try:
        from llmserve.engine.core import EngineCore  # torch is imported here, not earlier

        core = EngineCore(config)
        warm_up = core.warm_up()
        freeze_startup_objects("engine process")
        out.send(codec.encode(EngineReady(
            os.getpid(), core.max_model_len, core.loaded.arch_config.vocab_size, core.stats(),
            core.loaded.load_seconds, core.kv_cache_seconds, warm_up, core.loaded.describe(),
            core.card)))
        EngineLoop(core, inp, out, codec, parent_pid).run()
    except BaseException as e:  # the last word, then a non-zero exit
        user_error = isinstance(e, LLMServeError | ValueError)
        if not user_error:
            logger.exception("engine process failed")
        message = str(e) if user_error else f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            out.send(codec.encode(EngineFailed(message, user_error)), zmq.NOBLOCK)
        out.close(linger=2000)
        inp.close(linger=0)
        # Closing only queues the message; terminating the context waits (up to the
        # linger) until ZeroMQ's I/O thread has delivered it. os._exit would drop it.
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    out.close(linger=2000)
    inp.close(linger=0)
    ctx.term()


class EngineLoop:
    """Apply what arrived, run a step, send its outputs; repeat. Blocks only when idle."""

    def __init__(self, core: Any, inp: zmq.Socket, out: zmq.Socket, codec: Codec,
                 parent_pid: int) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.codec = codec
        self.parent_pid = parent_pid
        self.num_added = 0
        self.tokens_added = 0
        self.failed: list[RequestFailed] = []

    def run(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished() and not self.inp.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    return  # orphaned (PR_SET_PDEATHSIG is Linux-only)
                continue
            changed = False
            while True:
                try:
                    raw = self.inp.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = self.codec.inputs.decode(raw)
                if isinstance(message, Shutdown):
                    return
                self.apply(message)
                changed = True
            if not core.has_unfinished() and not changed:
                continue
            outputs = core.step() if core.has_unfinished() else []
            self.failed += core.take_failed()
            self.out.send(self.codec.encode(StepOutputs(
                outputs, core.stats(), self.failed, self.num_added, self.tokens_added,
                core.waiting_tokens())))
            self.failed = []

    def apply(self, message: EngineInput) -> None:
        if isinstance(message, ResetPrefixCache):
            try:
                result = UtilityResult(message.call_id, True, f"forgot "
                                       f"{self.core.reset_prefix_cache()} cached blocks")
            except RuntimeError as e:
                result = UtilityResult(message.call_id, False, str(e))
            self.out.send(self.codec.encode(result))
            return
        if isinstance(message, AbortRequest):
            self.core.abort(message.request_id, message.index, stopped=message.stopped)
            return
        assert isinstance(message, AddRequest)
        self.num_added += 1
        self.tokens_added += len(message.prompt_token_ids)
        try:
            self.core.add_request(message.request_id, message.prompt_token_ids,
                                  message.params, message.priority)
        except Exception as e:  # attributable to this request alone: it fails, we go on
            if not isinstance(e, ValueError):
                logger.exception("request %s could not be added", message.request_id)
            self.core.abort(message.request_id)
            self.failed.append(RequestFailed(message.request_id, f"{type(e).__name__}: {e}"
                                             if not isinstance(e, ValueError) else str(e)))


# ---- the API server's side ----------------------------------------------------------------


class EngineStartError(LLMServeError):
    """The engine process could not load the model or start; the message says why."""


class EngineProcess:
    """One engine process and the two sockets to it. Create it on the event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="llmserve-engine-")
        input_addr = f"ipc://{self._dir}/input"
        output_addr = f"ipc://{self._dir}/output"
        self.codec = Codec()
        self._push = zmq.Context.instance().socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # unbounded: sending never blocks
        self._push.bind(input_addr)
        self._pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(output_addr)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_engine_core, name="llmserve-engine", daemon=True,
                                args=(config, input_addr, output_addr, os.getpid()))
        self.started = time.monotonic()
        self.proc.start()
        self.pid = self.proc.pid
        self.failure: EngineFailed | None = None  # its last word, if it sent one

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        return self.proc.sentinel

    def send(self, message: EngineInput) -> None:
        self._push.send(self.codec.encode(message), zmq.NOBLOCK)

    async def recv(self) -> EngineOutput:
        message = self.codec.outputs.decode(await self._pull.recv())
        if isinstance(message, EngineFailed):
            self.failure = message
        return message

    def exit_cause(self) -> str:
        """Why the process ended, for logs and error messages."""
        if self.failure is not None:
            return self.failure.message
        code = self.proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        return f"exited with code {code}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, AttributeError, ValueError):
            os.kill(self.pid, signal.SIGKILL)

    async def stop(self, timeout: float) -> None:
        """Ask the engine to stop, wait up to ``timeout`` s, then kill it."""
        if self.proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.send(Shutdown())
            deadline = time.monotonic() + timeout
            while self.proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self.proc.is_alive():
            self.kill()
        self.close()

    def close(self) -> None:
        self.proc.join(5)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
