"""What generation returns to callers (the offline API and the server)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution (log_softmax of
    the logits before penalties, temperature and filters); rank 1 is the most likely."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, Logprob]] | None = None  # per token: chosen first, then top-k

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None
