"""The API server's tokenizer worker: long texts in a process of its own, which is replaced
when it dies and keeps working through a signal to the whole process group."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from llmserve.server.tokenizing import INLINE_CHARS, TokenizerPool

TEXT = "The quick brown fox jumps over the lazy dog. " * (INLINE_CHARS // 40)


def _worker_pids(pool: TokenizerPool) -> list[int]:
    assert pool._pool is not None
    return list(pool._pool._processes)


def test_a_killed_worker_is_replaced(smol_tokenizer):
    want = smol_tokenizer.encode(TEXT)
    pool = TokenizerPool(smol_tokenizer)
    try:
        assert asyncio.run(pool.encode(TEXT)) == want
        (first,) = _worker_pids(pool)
        os.kill(first, signal.SIGKILL)
        time.sleep(0.5)
        messages = [{"role": "user", "content": TEXT}]
        assert asyncio.run(pool.encode_chat(messages, True)) == smol_tokenizer.encode_chat(
            messages, True)
        assert asyncio.run(pool.encode(TEXT)) == want
        assert _worker_pids(pool) != [first]
    finally:
        pool.shutdown()


def test_the_worker_ignores_the_signals_that_drain_the_server(smol_tokenizer):
    pool = TokenizerPool(smol_tokenizer)
    try:
        asyncio.run(pool.encode(TEXT))
        (pid,) = _worker_pids(pool)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(pid, sig)
        time.sleep(0.5)
        assert asyncio.run(pool.encode(TEXT)) == smol_tokenizer.encode(TEXT)
        assert _worker_pids(pool) == [pid]
    finally:
        pool.shutdown()
