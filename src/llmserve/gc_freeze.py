"""Keep the garbage collector's full collections short in a long-running process.

A server process holds hundreds of thousands of objects from its start (modules, the
tokenizer, FastAPI's routes, SQLAlchemy's mappers, the model's Python objects) that live
as long as it does. CPython's full (generation 2) collection walks all of them each time:
measured here at 100-165 ms in the API server and ~95 ms in the engine process, stalls that
land on whichever requests are in flight (a p99 of 341 ms against 140 ms in one round of
benchmarks/usage_accounting.py). Moving everything alive at the end of start-up into the
permanent generation (``gc.freeze()``, as vLLM's API server and Instagram's do) leaves
the collector only what serving allocates. Frozen objects are never collected: only what
start-up keeps for good should be alive when this runs.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from llmserve.logger import get_logger

logger = get_logger(__name__)


def freeze_startup_objects(where: str) -> None:
    """Collect what start-up left behind, then freeze the survivors."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("%s: %d objects frozen after start-up (%.0f ms)", where,
                 gc.get_freeze_count(), 1000 * (time.perf_counter() - start))


@contextlib.contextmanager
def startup_objects_frozen(where: str) -> Iterator[None]:
    """``freeze_startup_objects`` for a while: benchmarks that build and drop engines in one
    process time their steps as the engine process runs them, then thaw, so that the
    engines they free later are collected."""
    freeze_startup_objects(where)
    try:
        yield
    finally:
        gc.unfreeze()
