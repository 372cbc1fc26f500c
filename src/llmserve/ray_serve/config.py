"""How llmserve runs on Ray Serve: replicas, their resources, routing and autoscaling."""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_NAMES = ("round-robin", "least-load", "prefix-aware")


@dataclass(frozen=True)
class RayServeConfig:
    """``replicas`` fixed, or autoscaling between ``min_replicas`` and ``max_replicas`` on
    queue depth: Ray Serve adds replicas while the mean number of requests in flight per
    replica exceeds ``target_ongoing_requests`` for ``upscale_delay_s``, and removes them
    (draining their requests first) after ``downscale_delay_s`` below it."""

    replicas: int = 1
    address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); else local
    router: str = "prefix-aware"
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    # Requests one replica takes at a time; more wait in the router (up to
    # --max-queued-requests of them, then 429). None: as many as its engine runs and
    # queues (max_num_seqs + --max-queued-requests).
    max_ongoing_requests: int | None = None
    min_replicas: int | None = None  # set (with max_replicas) to autoscale
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    # prefix-aware: requests in flight by which loads may differ before least-load wins
    imbalance_threshold: int = 4
    app_name: str = "llmserve"

    def __post_init__(self) -> None:
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"router must be one of {', '.join(ROUTER_NAMES)}, "
                             f"got {self.router!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ValueError("cpus-per-replica must be > 0 and gpus-per-replica >= 0, got "
                             f"{self.cpus_per_replica} and {self.gpus_per_replica}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max-ongoing-requests must be >= 1, "
                             f"got {self.max_ongoing_requests}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both min-replicas and max-replicas")
        if self.autoscaling:
            assert self.min_replicas is not None and self.max_replicas is not None
            if not 1 <= self.min_replicas <= self.max_replicas:
                raise ValueError(f"need 1 <= min-replicas <= max-replicas, got "
                                 f"{self.min_replicas} and {self.max_replicas}")
            if self.target_ongoing_requests <= 0:
                raise ValueError(f"target-ongoing-requests must be > 0, "
                                 f"got {self.target_ongoing_requests}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance threshold must be >= 0, "
                             f"got {self.imbalance_threshold}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None
