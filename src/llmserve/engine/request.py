"""The state of one request inside the engine: its tokens and explicit progress counters."""

from __future__ import annotations

import enum
import time

from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, eos_token_ids: frozenset[int] = frozenset(),
                 max_tokens: int, priority: int = 0, arrival_time: float | None = None,
                 cache_salt: str | None = None, parent_id: str | None = None, index: int = 0,
                 lead: Request | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved against the context window
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # n > 1: the sequences of one prompt are sibling requests; all but the first wait
        # until the first (the lead) has computed the prompt, then share its KV blocks.
        self.parent_id = parent_id or request_id
        self.index = index
        self.lead = lead

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        # Tokens appended by the last step (several with speculative decoding), and their
        # logprobs when asked.
        self.num_new_tokens = 0
        self.new_logprobs: list = []
        # Speculative decoding: the draft tokens proposed for the next step, and the
        # request's record of drafts verified and accepted (the planner's acceptance rate).
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_judged_drafts = 0  # accepted, and the first rejected of each verification
        self.prompt_logprobs: list | None = (
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None
            else None)
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def waits_for_lead(self) -> bool:
        """A sibling is admitted once its lead's prompt KV exists (or the lead is gone)."""
        lead = self.lead
        return (lead is not None and not lead.is_finished
                and lead.num_computed_tokens < lead.num_prompt_tokens)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token is appended: set a finished status if generation must end."""
        n = self.num_output_tokens
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if n >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                # stop_reason stays None: the model's own end (vLLM's and OpenAI's shape)
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
                return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
