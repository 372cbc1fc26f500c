"""The routing policies as Ray Serve request routers, chosen by name (``--router``).

Each router runs inside every deployment handle that calls the engine replicas (the
ingress's), and decides with the pure functions of ray_serve/policy.py. Ray Serve does the
rest: it tries the replicas in the order a router ranks them, skips those whose queues are
full (``max_ongoing_requests``), and backs off when every replica is full.

What a router knows of a replica comes from two places: Ray's own count of the requests it
sent and that have not finished (fresh), and the replica's ``record_routing_stats`` report
(every ``ROUTING_STATS_PERIOD_S``): its engine's waiting queue, KV cache usage, whether it
accepts requests, and its Prometheus metrics, which the ingress serves on /metrics.

A replica whose engine is restarting after a failure reports ``accepting: False``; routers
skip it while another replica accepts (a circuit breaker that closes again when the
engine is back). A replica whose engine gave up fails Ray's health check and is replaced.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from llmserve.ray_serve import reports
from llmserve.ray_serve.policy import (
    PrefixIndex,
    ReplicaLoad,
    least_loaded,
    prefix_aware,
    round_robin,
)

ROUTING_STATS_PERIOD_S = 1.0

class _LLMRouter(RequestRouter):
    """What the three policies share: registration, loads, skipping replicas that do not
    accept requests, and trying last those that failed or refused this request.

    No FIFOMixin: with it Ray hands the replica chosen for one request to the oldest one
    waiting, which would undo a prefix-aware choice whenever requests queue."""

    def initialize_state(self, **kwargs: Any) -> None:
        reports.register(self)  # by module attribute: this module is pickled by value

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        in_flight = self.replica_queue_len_cache.get(replica.replica_id)
        if in_flight is None:
            in_flight = int(stats.get("num_unfinished", 0))
        return ReplicaLoad(in_flight, int(stats.get("num_waiting", 0)),
                           float(stats.get("kv_usage", 0.0)))

    @staticmethod
    def _accepting(candidates: list[RunningReplica],
                   pending_request: PendingRequest | None) -> list[RunningReplica]:
        """Candidates whose engines accept requests and whose circuit breakers are
        closed (all candidates if none is). Also asks Ray to back off between rounds
        when every replica is full (Ray sleeps only when a router says so)."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        healthy = [r for r in candidates if (r.routing_stats or {}).get("accepting", True)
                   and not reports.circuit_open(r.replica_id.unique_id)]
        return healthy or candidates

    @staticmethod
    def _ranked(order: list[Hashable], by_id: dict[Hashable, RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """One replica per rank, in ``order``, the request's failed or refusing replicas
        last."""
        sub = pending_request.args[0] if pending_request and pending_request.args else None
        avoid = getattr(sub, "avoid", frozenset())
        order = [r for r in order if r not in avoid] + [r for r in order if r in avoid]
        return [[by_id[r]] for r in order]


class RoundRobinRouter(_LLMRouter):
    """Each replica in turn, whatever its load."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        candidates = self._accepting(candidate_replicas, pending_request)
        if not candidates:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        first = round_robin(list(by_id), next(self._turn))
        rest = [r for r in sorted(by_id) if r != first]
        return self._ranked([first, *rest], by_id, pending_request)


class LeastLoadRouter(_LLMRouter):
    """The replica with the fewest requests in flight (then the shortest engine queue,
    then the emptiest KV cache)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        candidates = self._accepting(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        loads = {k: self._load(r) for k, r in by_id.items()}
        return self._ranked(least_loaded(loads), by_id, pending_request)


class PrefixAwareRouter(_LLMRouter):
    """A prompt goes to the replica that served the longest prefix of it, while loads are
    balanced; see policy.prefix_aware. Keyword arguments (``request_router_kwargs``):
    ``imbalance_threshold`` (requests in flight, default 4), ``min_match_tokens`` (default
    one chunk), ``chunk_size`` (tokens, default 16; the launcher passes the engine's KV block
    size) and ``max_chunks_per_replica``."""

    def initialize_state(self, imbalance_threshold: int = 4, min_match_tokens: int = 16,
                         chunk_size: int = 16, max_chunks_per_replica: int = 1 << 16,
                         **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.imbalance_threshold = imbalance_threshold
        self.min_match_tokens = min_match_tokens
        self.index = PrefixIndex(chunk_size, max_chunks_per_replica)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        self.index.retain(r.unique_id for r in list(self.curr_replicas))
        candidates = self._accepting(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        loads = {k: self._load(r) for k, r in by_id.items()}
        prompt = _prompt_of(pending_request)
        if prompt is None:
            return self._ranked(least_loaded(loads), by_id, pending_request)
        order = prefix_aware(loads, self.index.match(prompt, by_id), self.index.sizes(),
                             imbalance_threshold=self.imbalance_threshold,
                             min_match=self.min_match_tokens)
        ranked = self._ranked(order, by_id, pending_request)
        if ranked:
            # Recorded at once, not when Ray reports the routing done: a request of the
            # same tenant routed meanwhile then follows this one instead of seeding the
            # prefix on a second replica.
            self.index.insert(ranked[0][0].replica_id.unique_id, prompt)
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Where it went (usually the replica ranked first, recorded already)."""
        prompt = _prompt_of(pending_request)
        if prompt is not None:
            self.index.insert(replica_id.unique_id, prompt)


def _prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids, if the request is an engine submission."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "prompt_token_ids", None)


ROUTERS: dict[str, type[RequestRouter]] = {
    "round-robin": RoundRobinRouter,
    "least-load": LeastLoadRouter,
    "prefix-aware": PrefixAwareRouter,
}
