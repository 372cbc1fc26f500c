"""Tokenization that never stalls the event loop.

Short texts are tokenized inline (well under a millisecond). Long ones go to a worker
process with its own copy of the tokenizer: a worker thread would not do, because the
tokenizer holds the GIL for a good part of the work (measured: /health waited up to 1.4 s
while four 600K-character prompts were tokenized in threads). A text that cannot fit the
context window whatever its tokens is refused before any tokenization.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from llmserve.logger import get_logger
from llmserve.parent_death import die_with_parent
from llmserve.tokenizer import Tokenizer

logger = get_logger(__name__)

INLINE_CHARS = 16_384  # shorter texts are tokenized on the event loop

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer, parent_pid: int) -> None:
    global _worker_tokenizer
    die_with_parent(parent_pid)  # a killed server would leave it blocked on its queue
    # Ctrl-C, systemd and `timeout` signal the whole process group: the API server drains
    # and then stops this worker, as it stops the engine process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _worker_tokenizer = tokenizer


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _encode_chat(messages: list[dict[str, Any]], add_generation_prompt: bool,
                 variables: dict[str, Any]) -> list[int]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_chat(messages, add_generation_prompt, **variables)


def _ready() -> bool:
    return _worker_tokenizer is not None


class TokenizerPool:
    """The tokenizer inline for short texts, in one worker process for long ones. A worker
    that dies is replaced, and the texts it held are tokenized again in the new one."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.tokenizer, os.getpid()))
        return self._pool

    def start(self) -> None:
        """Start the worker now, so the first long prompt does not wait for it."""
        self._executor().submit(_ready)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _in_worker(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            pool = self._executor()
            try:
                return await loop.run_in_executor(pool, fn, *args)
            except BrokenProcessPool:
                if self._pool is pool:  # the first of the texts it held to notice
                    logger.warning("the tokenizer process died; starting another")
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
                if attempt == 2:
                    raise RuntimeError("the tokenizer process died twice while tokenizing "
                                       "this prompt") from None
        raise AssertionError("unreachable")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self._in_worker(_encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          variables: dict[str, Any] | None = None) -> list[int]:
        """``variables``: more for the template (``tools``)."""
        variables = variables or {}
        chars = sum(len(m.get("content") or "") for m in messages) + len(str(variables))
        if chars < INLINE_CHARS:
            return self.tokenizer.encode_chat(messages, add_generation_prompt, **variables)
        return await self._in_worker(_encode_chat, messages, add_generation_prompt, variables)
