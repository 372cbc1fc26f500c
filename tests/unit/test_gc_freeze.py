"""Start-up objects frozen out of the collector's reach: for good (the server's processes) or
for a while (benchmarks that build and drop engines in one process)."""

from __future__ import annotations

import gc

from llmserve.gc_freeze import startup_objects_frozen


def test_objects_frozen_for_a_while_are_thawed_and_collectable_after():
    gc.unfreeze()
    cycle: list = []
    cycle.append(cycle)  # garbage only the collector frees, once unreachable
    with startup_objects_frozen("test"):
        assert gc.get_freeze_count() > 0
        del cycle
        gc.collect()
        frozen_inside = gc.get_freeze_count()
    assert gc.get_freeze_count() == 0
    assert frozen_inside > 0
    assert gc.collect() >= 1  # the thawed cycle is found now
