"""What the ingress and the engine replicas send each other through Ray (plain data)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Submission:
    """One engine request. The routers read ``prompt_token_ids`` (prefix-aware routing)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    priority: int = 0
    # Replicas that failed or refused this request before: the routers try them last.
    avoid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Accepted:
    """A replica's first answer to a submission: queued in its engine."""

    replica: str


@dataclass(frozen=True)
class Rejected:
    """A replica's only answer to a submission it did not queue. ``kind``: "queue_full"
    (429), "unavailable" (its engine is loading or restarting: try another replica),
    "context_length" or "invalid" (400)."""

    kind: str
    message: str
    retry_after: int = 5
    replica: str = ""


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress learns from a replica at start-up (every replica loads the same
    model with the same configuration)."""

    max_model_len: int
    vocab_size: int
    ready: object  # the engine's EngineReady message, for the console's model card
