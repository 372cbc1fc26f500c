"""The replicas' routing-stats reports, as the request routers of this process hold them.

Ray Serve pickles a request router's module by value into each handle, so a registry kept
in routers.py would be a copy per router; the routers register here instead (this module
is imported by reference), and the ingress reads every replica's last report from here.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()


def register(router: Any) -> None:
    _ROUTERS.add(router)


def replica_reports() -> dict[str, dict[str, Any]]:
    """The last report of every replica the routers in this process know, by replica id."""
    out: dict[str, dict[str, Any]] = {}
    for router in list(_ROUTERS):
        for rid, replica in router.curr_replicas.items():
            if replica.routing_stats:
                out[rid.unique_id] = replica.routing_stats
    return out
