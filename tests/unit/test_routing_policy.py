"""The routing policies' decisions (ray_serve/policy.py): pure functions, no Ray."""

from __future__ import annotations

import random

import pytest

from llmserve.ray_serve import reports
from llmserve.ray_serve.config import RayServeConfig
from llmserve.ray_serve.policy import (
    PrefixIndex,
    ReplicaLoad,
    least_loaded,
    prefix_aware,
    round_robin,
)


def _slow_match(served: list[list[int]], prompt: list[int], chunk: int) -> int:
    """Longest common prefix with any prompt served, in whole chunks (the obvious way)."""
    best = 0
    for p in served:
        n = 0
        while n < min(len(p), len(prompt)) and p[n] == prompt[n]:
            n += 1
        best = max(best, n // chunk * chunk)
    return best


def test_prefix_index_matches_the_longest_served_prefix_in_whole_chunks():
    rng = random.Random(0)
    index = PrefixIndex(chunk_size=4)
    tenants = [[rng.randrange(50) for _ in range(rng.randrange(0, 30))] for _ in range(6)]
    served: dict[str, list[list[int]]] = {"a": [], "b": []}
    for _ in range(200):
        replica = rng.choice("ab")
        prompt = rng.choice(tenants) + [rng.randrange(50) for _ in range(rng.randrange(8))]
        got = index.match(prompt, ["a", "b"])
        for r in "ab":
            assert got[r] == _slow_match(served[r], prompt, 4), (r, prompt)
        index.insert(replica, prompt)
        served[replica].append(prompt)


def test_prefix_index_forgets_least_recent_paths_tail_first():
    index = PrefixIndex(chunk_size=2, max_chunks=4)
    index.insert("a", [1, 2, 3, 4, 5, 6])  # 3 nodes
    index.insert("a", [9, 9])  # 4 nodes
    index.insert("a", [7, 7])  # 5 > 4: the oldest path's tail goes first
    assert index.size("a") == 4
    assert index.match([1, 2, 3, 4, 5, 6], ["a"])["a"] == 4
    assert index.match([9, 9], ["a"])["a"] == 2
    index.retain(["b"])
    assert index.sizes() == {}


def test_least_loaded_orders_by_in_flight_then_waiting_then_kv():
    loads = {"a": ReplicaLoad(3), "b": ReplicaLoad(1, 5), "c": ReplicaLoad(1, 2, 0.9),
             "d": ReplicaLoad(1, 2, 0.1)}
    assert least_loaded(loads) == ["d", "c", "b", "a"]


def test_round_robin_takes_turns_in_a_stable_order():
    replicas = ["b", "c", "a"]
    assert [round_robin(replicas, i) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_prefix_aware_prefers_the_longest_match_while_balanced():
    loads = {"a": ReplicaLoad(2), "b": ReplicaLoad(0)}
    order = prefix_aware(loads, {"a": 64, "b": 16}, {}, imbalance_threshold=4, min_match=16)
    assert order == ["a", "b"]  # the longer prefix wins over the lighter load


def test_prefix_aware_falls_back_to_least_load_when_unbalanced():
    loads = {"a": ReplicaLoad(9), "b": ReplicaLoad(2)}
    order = prefix_aware(loads, {"a": 512}, {}, imbalance_threshold=4, min_match=16)
    assert order == ["b", "a"]


def test_prefix_aware_without_a_match_spreads_new_prefixes_by_size():
    loads = {"a": ReplicaLoad(1), "b": ReplicaLoad(3)}
    order = prefix_aware(loads, {"a": 8}, {"a": 100, "b": 3}, imbalance_threshold=4,
                         min_match=16)
    assert order == ["b", "a"]  # an 8-token match is below min_match: the emptier tree
    order = prefix_aware(loads, {}, {"a": 3, "b": 3}, imbalance_threshold=4, min_match=16)
    assert order == ["a", "b"]  # the same size: the less loaded
    assert prefix_aware({}, {}, {}, imbalance_threshold=4, min_match=16) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"router": "random"}, "router must be one of"),
    ({"replicas": 0}, "replicas must be >= 1"),
    ({"min_replicas": 2}, "both min-replicas and max-replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "min-replicas <= max-replicas"),
    ({"cpus_per_replica": 0}, "cpus-per-replica must be > 0"),
])
def test_ray_serve_config_refuses_what_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayServeConfig(**kwargs)


def test_circuit_breaker_opens_on_repeated_failures_and_half_opens_after_the_window():
    rid = "breaker-test-replica"
    window = reports.BREAKER_WINDOW_S
    reports.record_failure(rid, now=0.0)
    reports.record_failure(rid, now=1.0)
    assert not reports.circuit_open(rid, now=1.5)  # two strikes: still closed
    reports.record_failure(rid, now=2.0)
    assert reports.circuit_open(rid, now=2.5)
    assert reports.circuit_open(rid, now=2.0 + window - 0.1)
    assert not reports.circuit_open(rid, now=2.0 + window + 0.1)  # half-open: tried again
    reports.record_failure(rid, now=40.0)  # and one more failure reopens it
    assert reports.circuit_open(rid, now=40.5)
    assert not reports.circuit_open(rid, now=80.0)  # half-open again
    reports.record_success(rid)  # a request completed: closed
    reports.record_failure(rid, now=81.0)
    assert not reports.circuit_open(rid, now=81.5)
    assert not reports.circuit_open("another-replica", now=40.5)
    reports.record_failure(None)  # a failure before any replica accepted: nobody's strike
