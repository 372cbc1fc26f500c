"""Plain data the scheduler hands to the runner, and its per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.sampling_params import SamplingParams

PENDING_TOKEN = -1  # an input token sampled by the step before, not yet read back


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions from ``start_pos``.

    With speculative decoding the last ``num_draft_tokens`` of ``token_ids`` are proposals:
    the runner samples at each of them and at the last known token (k + 1 rows) and keeps
    the samples up to the first that differs from the proposal it verifies.

    With asynchronous scheduling a decode may be scheduled before its input token is known
    on the host: ``token_ids`` is ``[PENDING_TOKEN]`` and ``input_from_row`` the row of the
    step before whose sample it is (the runner takes it from that step's sampled ids on
    the device).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[list[int]]  # the request's whole block table in each KV cache group
    sample: bool  # the step reaches the request's last known token: sample the next one
    sampling_params: SamplingParams
    # Copies of the request's tokens where the step reads them (penalties, min_tokens,
    # prompt logprobs); empty otherwise.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    input_from_row: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests that ended since the last step: the runner drops its state for them.
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# (token ids with the chosen one first, their logprobs, rank of the chosen token)
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    """The tokens each request that sampled this step emits (one, or with drafts the accepted
    ones and the target's own next token), with their logprobs where asked."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, logprobs of the following
    # prompt tokens) for requests with prompt_logprobs.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float
    prefix_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_hits: int  # tokens found there (cumulative)
    num_preemptions: int  # cumulative
    num_scheduled_tokens: int  # in the last step
    num_scheduled_seqs: int  # in the last step
    num_steps: int = 0  # steps that scheduled work (cumulative)
    # Speculative decoding, cumulative: requests that verified drafts (one per request and
    # step), draft tokens verified, accepted, and accepted at each draft position.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
