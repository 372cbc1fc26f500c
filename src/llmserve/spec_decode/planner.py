"""How many draft tokens each request verifies this step: a pure function of the requests'
acceptance rates, the step's size and a measured cost of steps by size.

A draft token costs one more row in the step's forward pass for every request in the
batch, and pays only if accepted. Draft j of a request with acceptance rate a is emitted
with probability a**j (every draft before it must be accepted too). With B requests
sampling and D drafts in a step of N tokens, the step emits B + sum(a**j) tokens in
cost(N + D) seconds. The planner takes drafts in decreasing order of a**j and keeps the
count D that maximises tokens per second (no drafts unless they raise it). One request on
an idle machine speculates freely; in a full batch every row is already paid for by
another request's token, and speculation switches itself off.

A proposer that runs a model (a draft model) costs ``propose_seconds`` per proposal step:
proposing up to j drafts per request takes j such steps (the requests are batched in each),
so the step's cost grows by j times that with its longest proposal.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


class StepCost:
    """Seconds of a forward pass by its number of tokens: measured points, linear in
    between and beyond. A point below an earlier one (timing noise) is raised to it: a
    larger step never costs less."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        points = sorted(points)
        if len(points) < 2 or any(n < 1 or t <= 0 for n, t in points):
            raise ValueError("a step cost needs >= 2 points of (tokens >= 1, seconds > 0)")
        self.tokens = [n for n, _ in points]
        self.seconds = list(itertools.accumulate((t for _, t in points), max))

    def __call__(self, num_tokens: int) -> float:
        ns, ts = self.tokens, self.seconds
        i = min(max(bisect.bisect_left(ns, num_tokens), 1), len(ns) - 1)
        n0, n1, t0, t1 = ns[i - 1], ns[i], ts[i - 1], ts[i]
        return max(t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0), 1e-9)

    def __repr__(self) -> str:
        return "StepCost(" + ", ".join(f"{n}: {t * 1e3:.2f} ms"
                                       for n, t in zip(self.tokens, self.seconds)) + ")"


def plan_drafts(acceptance: Sequence[float], max_drafts: Sequence[int], *,
                num_sampling: int, num_tokens: int, budget: int,
                cost: StepCost, propose_seconds: float = 0.0,
                min_gain: float = 1.0) -> list[int]:
    """Draft tokens per candidate request.

    acceptance[r]: the request's acceptance rate per draft token, in [0, 1).
    max_drafts[r]: the most drafts it may verify (its proposer's limit, its max_tokens).
    num_sampling: requests that sample this step (each emits one token without drafts).
    num_tokens: tokens in the step without drafts; budget: tokens the step may add.
    propose_seconds: cost of one proposal step (0 for history lookups).
    min_gain: speculate only if the best plan's tokens per second exceed the plan without
        drafts by this factor (a margin for what the cost model does not see).
    """
    candidates = sorted(
        ((a ** j, j, r) for r, (a, k) in enumerate(zip(acceptance, max_drafts))
         for j in range(1, k + 1)),
        key=lambda c: (-c[0], c[1], c[2]))[:max(budget, 0)]
    plain_rate = best_rate = num_sampling / cost(num_tokens)
    best_count, expected, longest = 0, float(num_sampling), 0
    for d, (q, j, _) in enumerate(candidates, start=1):
        expected += q
        longest = max(longest, j)
        rate = expected / (cost(num_tokens + d) + propose_seconds * longest)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_count = rate, d
    counts = [0] * len(acceptance)
    if best_rate < plain_rate * min_gain:
        return counts
    for _, _, r in candidates[:best_count]:
        counts[r] += 1
    return counts


# ---- a draft model's catch-up ---------------------------------------------------------------
#
# A request a draft model has not drafted for yet has its history (prompt and output so far)
# written into the draft's cache first: a prefill in the draft, paid once, before the first
# proposal. Late in a request, or in the tail of a busy server where a few requests remain,
# the tokens left may not pay it back.


def expected_remaining(generated: int, max_tokens: int, lengths: Sequence[int]) -> float:
    """Tokens a request that has generated ``generated`` of at most ``max_tokens`` is
    expected to add: the mean excess over ``generated`` of the recent finished requests that
    ran longer (each capped at ``max_tokens``). With no finished request to go by, all of
    ``max_tokens``; once longer than every recent request, 0 (expected to end soon)."""
    if not lengths:
        return float(max(max_tokens - generated, 0))
    excess = [min(n, max_tokens) - generated for n in lengths if n > generated]
    return sum(excess) / len(excess) if excess else 0.0


def catch_up_pays(catch_up_seconds: float, remaining: float, token_seconds: float,
                  gain: float) -> bool:
    """Whether writing a request's history into the draft's cache is paid back: at ``gain``
    over plain steps (``token_seconds`` a token for this request), each of the ``remaining``
    tokens expected saves ``token_seconds * (1 - 1 / gain)``."""
    if catch_up_seconds <= 0:
        return True
    return remaining * token_seconds * (1 - 1 / gain) >= catch_up_seconds


# ---- acceptance rates ----------------------------------------------------------------------
#
# The plan's model: each draft is accepted with probability a, and only while every draft
# before it was. A verification of d drafts that accepts x tests x + 1 of them when x < d (the
# first rejected one ends it; the drafts after it were never judged) and d when x = d. So a
# is estimated as accepted over judged drafts (the maximum-likelihood estimate under that
# model), not over drafted ones: a request whose first draft of 8 is rejected has shown one
# rejection, not eight.


def judged_drafts(drafted: int, accepted: int) -> int:
    """Drafts a verification judged: those accepted, and the first rejected one if any."""
    return accepted + (accepted < drafted)


@dataclass
class AcceptancePool:
    """The proposer's acceptance rate per draft token over recent verifications of all
    requests: exponentially decayed counts (``decay`` per verification) of accepted and
    judged drafts, so that the rate follows the workload. With nothing verified yet: 1/2."""

    accepted: float = 0.0
    judged: float = 0.0
    decay: float = 0.98

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.accepted = self.accepted * self.decay + accepted
            self.judged = self.judged * self.decay + judged_drafts(drafted, accepted)

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.judged + 2)


def acceptance_estimate(accepted: float, judged: float, prior: float,
                        weight: float = 2.0, fade: float = 1.0) -> float:
    """A request's acceptance rate per draft token: its own counts (drafts accepted, drafts
    judged: see judged_drafts), smoothed towards ``prior`` (the pool's rate) as if ``weight``
    drafts had been judged at that rate. A new
    request of a draft model starts at what the draft achieves on the others (one that
    agrees with its target 95% of the time drafts fully from the first step), and its own
    record takes over as it grows. ``fade`` (in (0, 1]) scales its own counts: what is left
    of a record that has not grown for a while."""
    return (accepted * fade + weight * prior) / (judged * fade + weight)


# ---- what the steps actually cost ----------------------------------------------------------
#
# The step costs above are timed at start-up on one short sequence; a batch of long
# contexts pays attention over its whole context for every draft row, and sampling
# parameters add per-row work, so a plan the model calls a gain can be a loss. The guard
# measures both kinds of decode-only step as they run, per batch size, and lets a step
# speculate only where speculating steps have been faster per emitted token.


@dataclass
class ArmStats:
    """Seconds per emitted token of decode-only steps without drafts (plain) and with them
    (spec), for one range of batch sizes: exponentially decayed sums of seconds and of
    tokens (``decay`` per step of the kind), whose ratio is the recent tokens per second.
    Sums, not a mean of per-step ratios: a costly step (a draft model's prefill of a
    prompt) weighs by its seconds, spread over the tokens of the steps around it, as it is
    spread over a request's tokens."""

    plain_seconds: float = 0.0
    plain_tokens: float = 0.0
    spec_seconds: float = 0.0
    spec_tokens: float = 0.0
    plain_n: int = 0
    spec_n: int = 0
    decisions: int = 0  # guard decisions taken (drives exploration)

    @property
    def plain(self) -> float:
        return self.plain_seconds / self.plain_tokens if self.plain_tokens else 0.0

    @property
    def spec(self) -> float:
        return self.spec_seconds / self.spec_tokens if self.spec_tokens else 0.0

    def observe(self, speculated: bool, seconds: float, emitted: int,
                decay: float = 0.9) -> None:
        if emitted <= 0 or seconds <= 0:
            return
        if speculated:
            self.spec_seconds = self.spec_seconds * decay + seconds
            self.spec_tokens = self.spec_tokens * decay + emitted
            self.spec_n += 1
        else:
            self.plain_seconds = self.plain_seconds * decay + seconds
            self.plain_tokens = self.plain_tokens * decay + emitted
            self.plain_n += 1


def guard_allows(stats: ArmStats, decision: int, *, min_samples: int = 8,
                 explore_every: int = 16) -> bool:
    """Whether a step that the planner would speculate in does. ``decision`` counts the
    guard's decisions for this batch size: one in ``explore_every`` goes the other way, so
    that both kinds of step stay measured as contexts and workloads change.

    - Too few plain steps measured: every other step plain (measuring both quickly).
    - Too few speculating steps measured: speculate (that is what needs measuring).
    - Both measured: the faster per emitted token, the other one step in explore_every.
    """
    if stats.plain_n < min_samples:
        return decision % 2 == 1
    explore = decision % explore_every == explore_every - 1
    if stats.spec_n < min_samples:
        return True
    return (stats.spec < stats.plain) != explore


def batch_bucket(num_sampling: int) -> int:
    """The range of batch sizes a step's measurements pool with: 1, 2-3, 4-7, 8-15..."""
    return max(num_sampling, 1).bit_length()
