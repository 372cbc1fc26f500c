"""What this process knows of the engine replicas: their reports, and their failures.

Ray Serve pickles a request router's module by value into each handle, so state kept in
routers.py would be a copy per router; the routers register here instead (this module is
imported by reference), the ingress reads every replica's last report from here (its
metrics for /metrics), and the engine client records here the failures it sees.

The circuit breaker: a replica that failed ``BREAKER_FAILURES`` requests within
``BREAKER_WINDOW_S`` seconds (it died under them, or cut their streams) is open: routers
send it nothing while another replica is closed, until ``BREAKER_WINDOW_S`` seconds after
its last failure; then it is tried again (half-open), and one more failure reopens it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any

BREAKER_FAILURES = 3
BREAKER_WINDOW_S = 30.0

_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
_FAILURES: dict[str, deque[float]] = {}
_HALF_OPEN: set[str] = set()
_LOCK = threading.Lock()  # routers run on Ray's router thread, the ingress on its own


def register(router: Any) -> None:
    with _LOCK:
        _ROUTERS.add(router)


def replica_reports() -> dict[str, dict[str, Any]]:
    """The last report of every replica the routers in this process know, by replica id."""
    with _LOCK:
        routers = list(_ROUTERS)
    out: dict[str, dict[str, Any]] = {}
    for router in routers:
        for rid, replica in list(router.curr_replicas.items()):  # a snapshot
            if replica.routing_stats:
                out[rid.unique_id] = replica.routing_stats
    return out


def record_failure(replica: str | None, now: float | None = None) -> None:
    """A request failed because of this replica (it died under it, or cut its stream)."""
    if replica is None:
        return
    now = time.monotonic() if now is None else now
    with _LOCK:
        times = _FAILURES.setdefault(replica, deque(maxlen=BREAKER_FAILURES))
        if replica in _HALF_OPEN:  # the trial failed: open again
            _HALF_OPEN.discard(replica)
            times.extend([now] * BREAKER_FAILURES)
        else:
            times.append(now)


def record_success(replica: str | None) -> None:
    """A request completed on this replica: a half-open breaker closes."""
    if replica is not None and replica in _HALF_OPEN:
        with _LOCK:
            _HALF_OPEN.discard(replica)


def circuit_open(replica: str, now: float | None = None) -> bool:
    """Whether the replica's breaker is open (see the module docstring)."""
    now = time.monotonic() if now is None else now
    with _LOCK:
        times = _FAILURES.get(replica)
        if not times or len(times) < BREAKER_FAILURES:
            return False
        if times[-1] - times[0] > BREAKER_WINDOW_S:  # strikes too far apart
            return False
        if now - times[-1] > BREAKER_WINDOW_S:  # cooled down: half-open, tried again
            times.clear()
            _HALF_OPEN.add(replica)
            return False
        return True
