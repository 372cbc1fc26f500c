"""The proposer protocol and the Speculator, which runs before each step: it picks the
decoding requests, asks the planner how many drafts each may verify, and hands each
request its draft tokens (``Request.draft_token_ids``) for the scheduler to place."""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from llmserve.config import SpeculativeConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.logger import get_logger
from llmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from llmserve.spec_decode.ngram import NgramProposer
from llmserve.spec_decode.planner import (
    AcceptancePool,
    ArmStats,
    StepCost,
    acceptance_estimate,
    batch_bucket,
    catch_up_pays,
    expected_remaining,
    guard_allows,
    plan_drafts,
)

logger = get_logger(__name__)


class Proposer(Protocol):
    """Draft tokens for requests: ``counts[i]`` at most for ``requests[i]``."""

    # True when proposing costs next to nothing (history lookups): the Speculator then
    # proposes first and plans over what was found; a model proposes after planning.
    cheap: bool
    # Seconds of one proposal step (a draft model's forward pass; 0 for lookups).
    step_seconds: float
    # Seconds the last propose() spent writing histories (catch_up_seconds' work).
    last_catch_up_seconds: float

    def propose(self, requests: list[Request], counts: list[int]) -> list[list[int]]: ...

    def catch_up_seconds(self, request: Request) -> float:
        """What starting to propose for the request costs: a draft model's writing of the
        history of a request it does not follow yet (0 for lookups)."""
        ...

    def free(self, request_id: str) -> None: ...

    def reset(self) -> None:
        """Forget what is shared between requests (with the prefix cache)."""


def build_proposer(config: SpeculativeConfig, **draft_kwargs) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from llmserve.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                              config.suffix_decoding_max_cached_requests)
    from llmserve.spec_decode.draft import DraftProposer

    return DraftProposer(config, **draft_kwargs)


class Speculator:
    # Speculate only for a predicted gain of 5% or more: the step costs are measured at
    # start-up with short contexts and greedy rows, and miss the per-row work of long
    # contexts and sampling parameters; a marginal prediction must not become a loss.
    MIN_GAIN = 1.05
    # A proposer that runs a model speculates only in decode-only steps (see prepare) and
    # where the plan promises 1.5x or more: its passes are timed at start-up for one
    # request and cost more in a batch, and a request it has not seen first has its prompt
    # written into the draft's cache, a cost paid back over many speculating steps by one
    # user on an idle server, never by a busy batch (small gains, prefills all at once).
    MODEL_GAIN = 1.5
    # Until the proposer's acceptance is known (this many draft tokens judged), one
    # request a step speculates on the plan's MIN_GAIN: the gain depends on what it learns.
    LEARN_TOKENS = 32
    # Output lengths of recent finished requests: what a request is expected to add still.
    RECENT_LENGTHS = 256
    # With a draft model, the weight a request's own acceptance record keeps per step in
    # which it did not speculate: after a bad stretch, ~10 plain steps bring it back to
    # the pool's rate.
    FADE = 0.8

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cost: StepCost,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.proposer = proposer
        self.cost = cost
        self.budget = max_num_batched_tokens
        self.seconds = 0.0  # spent proposing and planning (cumulative)
        # What decode-only steps cost per emitted token, with and without drafts, by batch
        # size: the guard over the planner's cost model (planner.guard_allows).
        self.arms: dict[int, ArmStats] = {}
        self.guard = True  # False: the cost model alone decides (tests that need drafts)
        self._bucket = 0  # the batch-size range of the step being prepared
        self.pool = AcceptancePool()  # a draft model's recent acceptance over all requests
        self.lengths: deque[int] = deque(maxlen=self.RECENT_LENGTHS)
        self._catch_up = 0.0  # seconds of history writing in the step being prepared
        self._steps = 0  # prepare() calls
        self._verified_at: dict[str, int] = {}  # the step a request last verified drafts

    def prepare(self, running: list[Request], waiting: list[Request]) -> int:
        """Set the draft tokens of the running requests for the next step; returns how
        many were proposed."""
        start = time.perf_counter()
        self._catch_up = 0.0
        self._steps += 1
        decoding, pending = [], 0
        for r in running:
            r.draft_token_ids = []
            todo = r.num_tokens - r.num_computed_tokens
            pending += todo
            if todo == 1 and r.status == RequestStatus.RUNNING:
                decoding.append(r)
        pending += sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        base = min(pending, self.budget)
        self._bucket = batch_bucket(len(decoding))
        if not decoding or base >= self.budget:
            return 0
        if not self.proposer.cheap and base > len(decoding):
            # A draft model speculates in decode-only steps, the ones the guard measures: a
            # prompt chunk in the step makes extra rows look free to the plan, but not the
            # draft's passes for the whole batch nor its prefill of each new request.
            return 0
        k = self.config.num_speculative_tokens
        limits = [max(0, min(k, r.max_tokens - r.num_output_tokens - 1)) for r in decoding]
        plan_kw = dict(num_sampling=len(decoding), num_tokens=base,
                       budget=self.budget - base, cost=self.cost,
                       propose_seconds=self.proposer.step_seconds, min_gain=self.MIN_GAIN)
        # A draft model's acceptance is a property of the model pair: a new request starts
        # from the pool's, and a request's own record fades back to it over the steps it
        # does not speculate in (one bad stretch must not end its speculation for good: no
        # new evidence would come). A lookup's is one of the request's text: it starts from
        # 1/2 and keeps its record.
        if self.proposer.cheap:
            acceptance = [acceptance_estimate(r.num_accepted_tokens, r.num_judged_drafts, 0.5)
                          for r in decoding]
        else:
            # While the pool is still learning (fewer than LEARN_TOKENS verified), a rejected
            # first draft or two is no verdict: below the fresh prior the plan would stop
            # drafting, and with no new drafts the pool would never learn again.
            prior = self.pool.rate
            if self.pool.judged < self.LEARN_TOKENS:
                prior = max(prior, AcceptancePool().rate)
            acceptance = []
            for r in decoding:
                # Steps run without drafts since its last verification.
                last = self._verified_at.get(r.request_id)
                idle = 0 if last is None else self._steps - 1 - last
                acceptance.append(acceptance_estimate(
                    r.num_accepted_tokens, r.num_judged_drafts, prior,
                    fade=self.FADE ** idle))
        # Planned as if every proposal were found: under load nothing is asked for at all.
        adaptive = self.config.adaptive
        counts = plan_drafts(acceptance, limits, **plan_kw) if adaptive else list(limits)
        chosen = [i for i, c in enumerate(counts) if c]
        if chosen and adaptive and not self.proposer.cheap:
            # A request the draft has not followed yet (its history to write first) only if
            # the tokens it is expected to add pay that back: not in the tail of a busy
            # server, where a few long requests remain with little left to generate.
            token_seconds = self.cost(base)  # a plain step: one token for each request
            unpaid = {i for i in chosen if not catch_up_pays(
                self.proposer.catch_up_seconds(decoding[i]),
                expected_remaining(decoding[i].num_output_tokens, decoding[i].max_tokens,
                                   self.lengths),
                token_seconds, self.MODEL_GAIN)}
            if unpaid:
                limits = [0 if i in unpaid else n for i, n in enumerate(limits)]
                counts = plan_drafts(acceptance, limits, **plan_kw)
                chosen = [i for i, c in enumerate(counts) if c]
        if chosen and adaptive and not self.proposer.cheap and not any(
                plan_drafts(acceptance, limits, **{**plan_kw, "min_gain": self.MODEL_GAIN})):
            chosen = chosen[:1] if self.pool.judged < self.LEARN_TOKENS else []
        if chosen and adaptive and self.guard:
            arm = self.arms.setdefault(self._bucket, ArmStats())
            allowed = guard_allows(arm, arm.decisions)
            arm.decisions += 1
            if not allowed:
                chosen = []
        proposals: list[list[int]] = [[] for _ in decoding]
        if chosen and self.proposer.cheap:
            # Lookups may find fewer tokens than planned: plan again over what was found.
            found = self.proposer.propose([decoding[i] for i in chosen],
                                          [limits[i] for i in chosen])
            lengths = [0] * len(decoding)
            for i, p in zip(chosen, found):
                proposals[i], lengths[i] = p, len(p)
            if adaptive:
                counts = plan_drafts(acceptance, lengths, **plan_kw)
                proposals = [p[:c] for p, c in zip(proposals, counts)]
        elif chosen:
            found = self.proposer.propose([decoding[i] for i in chosen],
                                          [counts[i] for i in chosen])
            for i, p in zip(chosen, found):
                proposals[i] = p[:counts[i]]
            self._catch_up = self.proposer.last_catch_up_seconds
        total = 0
        for r, p in zip(decoding, proposals):
            r.draft_token_ids = p
            total += len(p)
        self.seconds += time.perf_counter() - start
        return total

    def observe(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                seconds: float) -> None:
        """Account a step that ran (``seconds`` from prepare() to the scheduler's update):
        decode-only steps feed the guard's measurements; steps with prompt chunks, whose
        cost is mostly the prompt's, do not. A draft model's writing of a request's history
        (its prompt, the first time) is left out: whether that pays was decided before it was
        made (catch_up_pays, from the tokens the request should still add), and one such
        write would otherwise weigh on the speculating arm for many steps after."""
        if not self.proposer.cheap:  # the pool is a draft model's prior (see prepare)
            for s in sched.scheduled:
                if s.num_draft_tokens:
                    emitted = len(result.sampled_token_ids.get(s.request_id, ()))
                    self.pool.observe(s.num_draft_tokens, max(emitted - 1, 0))
                    self._verified_at[s.request_id] = self._steps
        if not sched.scheduled or any(s.num_tokens != 1 + s.num_draft_tokens
                                      for s in sched.scheduled):
            return
        # Filed where the step was decided (the scheduler may have run fewer requests).
        arm = self.arms.setdefault(self._bucket or batch_bucket(len(sched.scheduled)),
                                   ArmStats())
        self._bucket = 0
        arm.observe(any(s.num_draft_tokens for s in sched.scheduled),
                    seconds - self._catch_up,
                    sum(len(t) for t in result.sampled_token_ids.values()))

    def finished(self, request: Request) -> None:
        """A request ended: its proposer state goes, and its output length (one that ended
        on a stop or at its limit, not an abort) joins the recent lengths."""
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.lengths.append(request.num_output_tokens)
        self.free(request.request_id)

    def free(self, request_id: str) -> None:
        self._verified_at.pop(request_id, None)
        self.proposer.free(request_id)

    def forget_requests(self) -> None:
        """Forget what was learned from the requests so far: their output lengths and the
        draft's acceptance (the engine's warm-up request is no user's). The step timings
        stay: they are the machine's."""
        self.lengths.clear()
        self.pool = AcceptancePool()
        self._verified_at.clear()

    def reset(self) -> None:
        self.proposer.reset()
