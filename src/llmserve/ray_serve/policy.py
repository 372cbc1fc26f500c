"""Routing policies as pure functions: which replica should serve a prompt.

Ray Serve's request routers (ray_serve/routers.py) call these with what they know of each
replica; nothing here imports Ray or torch, so the decisions are unit-tested on their own.

A replica's load is its requests in flight as the router counts them (Ray's queue length:
requests sent and not finished), then the engine's own report (waiting requests, KV cache
usage) to break ties. The prefix-aware policy follows SGLang's cache-aware router: while
the replicas' loads differ by no more than a threshold, send a prompt to the replica that
served the longest prefix of it (so the prefix is likely still in that replica's KV cache);
without a match, to the replica that holds the fewest prefixes (so each new prefix goes
where there is room for it); when the load is unbalanced, least-load wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one replica's load."""

    in_flight: int  # requests sent to it and not finished (the router's own count)
    waiting: int = 0  # the engine's waiting queue at its last report
    kv_usage: float = 0.0  # fraction of its KV cache blocks in use at its last report

    @property
    def key(self) -> tuple[int, int, float]:
        return (self.in_flight, self.waiting, self.kv_usage)


def least_loaded(loads: dict[Hashable, ReplicaLoad]) -> list[Hashable]:
    """Replicas from the least to the most loaded (ties in the order given)."""
    return sorted(loads, key=lambda r: loads[r].key)


def round_robin(replicas: Sequence[Hashable], counter: int) -> Hashable:
    """The replica whose turn it is: the ``counter``-th of the replicas in a stable order."""
    ordered = sorted(replicas, key=str)
    return ordered[counter % len(ordered)]


def prefix_aware(loads: dict[Hashable, ReplicaLoad], matched: dict[Hashable, int],
                 sizes: dict[Hashable, int], *, imbalance_threshold: int,
                 min_match: int) -> list[Hashable]:
    """Replicas in the order to try for one prompt.

    1. Unbalanced (the most and least loaded replicas' in-flight counts differ by more than
       ``imbalance_threshold``): least-load order; the prefix is worth less than the wait.
    2. Balanced and some replica served at least ``min_match`` tokens of the prompt's
       prefix: the longest match first (ties: the less loaded), then least-load order.
    3. Balanced, no such match: the replica holding the fewest prefixes first (ties: the
       less loaded), so that new prefixes spread evenly over the replicas' caches.
    """
    if not loads:
        return []
    in_flight = [load.in_flight for load in loads.values()]
    by_load = least_loaded(loads)
    if max(in_flight) - min(in_flight) > imbalance_threshold:
        return by_load
    best = max(matched.get(r, 0) for r in loads)
    if best >= min_match:
        return sorted(loads, key=lambda r: (-matched.get(r, 0), loads[r].key))
    return sorted(loads, key=lambda r: (sizes.get(r, 0), loads[r].key))


class PrefixIndex:
    """The prompt prefixes each replica served recently, at the granularity of chunks.

    A trie over chunks of ``chunk_size`` tokens, kept as vLLM keeps its prefix cache: each
    node is the hash of its whole path (the chunk's tokens chained to its parent's hash),
    so a lookup walks the prompt's chunks and stops at the first one a replica lacks. It
    is approximate by design, as SGLang's router tree is: it records what was routed to a
    replica, not what that replica's cache still holds; each replica keeps at most
    ``max_chunks`` nodes and forgets the least recently used first, as its cache would.
    """

    def __init__(self, chunk_size: int = 16, max_chunks: int = 1 << 16) -> None:
        if chunk_size < 1 or max_chunks < 1:
            raise ValueError("chunk_size and max_chunks must be >= 1")
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self._nodes: dict[Hashable, OrderedDict[int, None]] = {}

    def chunk_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The path of the prompt's full chunks, as node hashes."""
        out, parent, c = [], 0, self.chunk_size
        for start in range(0, len(token_ids) - c + 1, c):
            parent = hash((parent, tuple(token_ids[start:start + c])))
            out.append(parent)
        return out

    def match(self, token_ids: Sequence[int],
              replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Tokens of the prompt's prefix each replica served (a multiple of chunk_size)."""
        path = self.chunk_hashes(token_ids)
        out = {}
        for r in replicas:
            nodes = self._nodes.get(r)
            n = 0
            if nodes is not None:
                while n < len(path) and path[n] in nodes:
                    n += 1
            out[r] = n * self.chunk_size
        return out

    def insert(self, replica: Hashable, token_ids: Sequence[int]) -> None:
        """Record that ``replica`` served this prompt. Its path becomes the most recent,
        the root side last, so that eviction takes a path's tail before its head."""
        nodes = self._nodes.setdefault(replica, OrderedDict())
        for h in reversed(self.chunk_hashes(token_ids)):
            nodes[h] = None
            nodes.move_to_end(h)
        while len(nodes) > self.max_chunks:
            nodes.popitem(last=False)

    def size(self, replica: Hashable) -> int:
        return len(self._nodes.get(replica, ()))

    def sizes(self) -> dict[Hashable, int]:
        return {r: len(nodes) for r, nodes in self._nodes.items()}

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (dead, drained or scaled down)."""
        keep = set(replicas)
        for r in [r for r in self._nodes if r not in keep]:
            del self._nodes[r]
