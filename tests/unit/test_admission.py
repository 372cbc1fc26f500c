"""The server's admission rule: how many requests will wait in the engine's queue."""

from __future__ import annotations

import pytest

from llmserve.engine.async_llm import estimated_waiting


def _reference(engine_waiting: int, in_transit: int, max_num_seqs: int,
               engine_running: int) -> int:
    """One request at a time: each takes a free running slot if there is one and nobody is
    waiting ahead of it, else it waits."""
    running, waiting = engine_running, engine_waiting
    for _ in range(in_transit):
        if waiting == 0 and running < max_num_seqs:
            running += 1
        else:
            waiting += 1
    return waiting


@pytest.mark.parametrize("max_num_seqs", [1, 2, 4])
def test_matches_one_request_at_a_time(max_num_seqs):
    for waiting in range(4):
        for running in range(max_num_seqs + 1):
            for in_transit in range(8):
                assert estimated_waiting(waiting, in_transit, max_num_seqs, running) == \
                    _reference(waiting, in_transit, max_num_seqs, running)


def test_a_burst_into_an_idle_engine_fills_its_slots_before_its_queue():
    # max_num_seqs 2, nothing reported yet: 4 requests in flight are 2 running + 2 waiting
    assert estimated_waiting(0, 4, 2, 0) == 2
    # an engine with a waiting queue has no free slot, whatever it runs
    assert estimated_waiting(1, 1, 8, 0) == 2
