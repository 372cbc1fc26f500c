"""Speculative decoding without a model: the n-gram proposer against a brute-force search,
the planner against exhaustive search, the scheduler's verification bookkeeping with a
fake runner that returns k + 1 tokens, and the acceptance rule's distribution."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from llmserve.config import SpeculativeConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.runner.model_runner import accepted_prefix, token_seed
from llmserve.sample.sampler import Sampler, SamplingRow
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from llmserve.spec_decode import NgramProposer, Speculator, StepCost, ngram_propose, plan_drafts
from llmserve.spec_decode.planner import (
    AcceptancePool,
    ArmStats,
    acceptance_estimate,
    batch_bucket,
    catch_up_pays,
    expected_remaining,
    guard_allows,
    judged_drafts,
)
from llmserve.spec_decode.suffix import SharedHistory, SuffixProposer, suffix_propose
from tests.unit.test_sampling_distribution import CHI2_CRIT_0001
from tests.unit.test_scheduler import make, req

# ---- the n-gram proposer ------------------------------------------------------------------


def _after_latest(seq: list[int], suffix: list[int], k: int) -> list[int]:
    """Up to k tokens after the latest occurrence of ``suffix`` in ``seq`` that has a token
    after it (scanning every start from the latest); [] when there is none."""
    n = len(suffix)
    for start in range(len(seq) - n - 1, -1, -1):
        if seq[start:start + n] == suffix:
            return seq[start + n:start + n + k]
    return []


def _ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Slow, obvious: for n from max to min, the latest earlier occurrence of the last n."""
    for n in range(max_n, min_n - 1, -1):
        if n < len(tokens) and (found := _after_latest(tokens, tokens[-n:], k)):
            return found
    return []


def test_ngram_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(2000):
        alphabet = rng.randint(2, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 5)
        got = ngram_propose(np.array(tokens), lo, hi, k)
        assert got == _ngram_reference(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_ngram_prefers_the_longest_match():
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    assert ngram_propose(np.array(tokens), 2, 3, 2) == [9, 5]  # "1 2 3" -> 9, not "2 3" -> 7
    assert ngram_propose(np.array(tokens), 2, 2, 2) == [7, 1]  # only bigrams: latest "2 3"
    assert ngram_propose(np.array([4, 5, 6]), 1, 3, 4) == []


# ---- the suffix proposer: the request's own history, then recent requests' ----------------


def _suffix_reference(tokens: list[int], shared: list[list[int]], min_n: int, max_n: int,
                      k: int) -> list[int]:
    """For n from max to min: the request's own latest earlier match, else the latest match
    in the shared sequences (the newest sequence first, its latest position first)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for seq in [tokens, *reversed(shared)]:
            if found := _after_latest(seq, tokens[-n:], k):
                return found
    return []


def test_suffix_matches_a_brute_force_search():
    rng = random.Random(1)
    for _ in range(1500):
        alphabet = rng.randint(2, 8)
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        limit = rng.randint(1, 4)
        history = SharedHistory(lo, hi, limit)
        sequences = [[rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
                     for _ in range(rng.randint(0, 6))]
        for seq in sequences:
            history.add(np.array(seq, dtype=np.int64))
        kept = [seq for seq in sequences if len(seq) > lo][-limit:]  # the newest `limit`
        assert len(history) == len(kept)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 5)
        got = suffix_propose(np.array(tokens), history, k)
        assert got == _suffix_reference(tokens, kept, lo, hi, k), (tokens, kept, lo, hi, k)


class _Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids = rid, tokens


def test_suffix_proposer_learns_from_ended_requests_until_reset():
    proposer = SuffixProposer(2, 4, max_cached_requests=2)
    answer = [5, 6, 7, 8, 9, 10, 11]
    first = _Req("a", [1, 2, 3, *answer])
    assert proposer.propose([first], [4]) == [[]]  # its own history holds no repeat
    proposer.free("a")  # ended: its tokens join the shared history
    second = _Req("b", [40, 41, 5, 6])  # another request starts the same answer
    assert proposer.propose([second], [4]) == [[7, 8, 9, 10]]
    assert proposer.shared.hits == 1
    proposer.free("b")
    proposer.free("never-proposed-for")  # nothing to add
    assert len(proposer.shared) == 2
    proposer.reset()  # with the prefix cache
    assert len(proposer.shared) == 0
    assert proposer.propose([_Req("c", [40, 41, 5, 6])], [4]) == [[]]
    # the oldest request leaves the shared history past max_cached_requests
    for i, seq in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        proposer.propose([_Req(f"r{i}", seq)], [1])
        proposer.free(f"r{i}")
    assert proposer.propose([_Req("d", [0, 1, 2])], [2]) == [[]]
    assert proposer.propose([_Req("e", [0, 9, 10])], [2]) == [[11, 12]]


# ---- the planner --------------------------------------------------------------------------


def _rate(acceptance, counts, num_sampling, num_tokens, cost):
    expected = num_sampling + sum(a ** j for a, c in zip(acceptance, counts)
                                  for j in range(1, c + 1))
    return expected / cost(num_tokens + sum(counts))


@pytest.mark.parametrize("seed", range(30))
def test_planner_finds_the_best_allocation(seed):
    rng = random.Random(seed)
    points = sorted({1, *(rng.randint(2, 64) for _ in range(4))})
    base = rng.uniform(0.005, 0.02)
    cost = StepCost([(n, base + n * rng.uniform(0.0002, 0.004)) for n in points])
    r = rng.randint(1, 3)
    acceptance = [rng.uniform(0, 0.99) for _ in range(r)]
    limits = [rng.randint(0, 4) for _ in range(r)]
    kw = dict(num_sampling=r + rng.randint(0, 8), num_tokens=r + rng.randint(0, 20))
    budget = rng.randint(0, 12)
    counts = plan_drafts(acceptance, limits, budget=budget, cost=cost, **kw)
    assert all(0 <= c <= k for c, k in zip(counts, limits)) and sum(counts) <= budget
    best = max(_rate(acceptance, c, cost=cost, **kw)
               for c in itertools.product(*(range(k + 1) for k in limits)) if sum(c) <= budget)
    assert math.isclose(_rate(acceptance, counts, cost=cost, **kw), best, rel_tol=1e-9)


def test_planner_speculates_alone_and_switches_off_in_a_full_batch():
    # A step of 1 token costs 15 ms, each more token 3 ms (this machine's int4 default).
    cost = StepCost([(1, 0.015), (512, 0.015 + 511 * 0.003)])
    alone = plan_drafts([0.8], [4], num_sampling=1, num_tokens=1, budget=2047, cost=cost)
    assert alone == [4]
    # At 0.7 the fourth draft (emitted with probability 0.24) is not worth 3 ms.
    assert plan_drafts([0.7], [4], num_sampling=1, num_tokens=1, budget=9, cost=cost) == [3]
    busy = plan_drafts([0.7] * 64, [4] * 64, num_sampling=64, num_tokens=64, budget=1984,
                       cost=cost)
    assert busy == [0] * 64
    hopeless = plan_drafts([0.01], [4], num_sampling=1, num_tokens=1, budget=100, cost=cost)
    assert hopeless == [0]
    assert plan_drafts([0.9], [4], num_sampling=1, num_tokens=1, budget=0, cost=cost) == [0]


def test_step_cost_interpolates_and_extrapolates():
    cost = StepCost([(1, 1.0), (3, 2.0), (5, 6.0)])
    assert cost(2) == 1.5 and cost(4) == 4.0 and cost(7) == 10.0 and cost(1) == 1.0
    with pytest.raises(ValueError):
        StepCost([(1, 1.0)])
    noisy = StepCost([(1, 1.0), (2, 3.0), (4, 2.0), (8, 5.0)])  # 4 timed low: noise
    assert [noisy(n) for n in (2, 3, 4, 6)] == [3.0, 3.0, 3.0, 4.0]


def test_a_margin_keeps_marginal_plans_off():
    cost = StepCost([(1, 0.015), (512, 0.015 + 511 * 0.003)])
    kw = dict(num_sampling=1, num_tokens=1, budget=100, cost=cost)
    # 0.3 acceptance: one draft gives 1.3 tokens in 18 ms against 1 in 15 (+8.3%).
    assert plan_drafts([0.3], [4], **kw) == [1]
    assert plan_drafts([0.3], [4], min_gain=1.08, **kw) == [1]
    assert plan_drafts([0.3], [4], min_gain=1.09, **kw) == [0]
    assert plan_drafts([0.8], [4], min_gain=1.5, **kw) == [4]  # 3.36 in 27 ms: +87%


def test_a_costly_proposer_speculates_less():
    """A draft model's proposal steps count: k drafts cost k of them on top of the step."""
    cost = StepCost([(1, 0.015), (512, 0.015 + 511 * 0.003)])
    kw = dict(num_sampling=1, num_tokens=1, budget=100, cost=cost)
    assert plan_drafts([0.8], [4], **kw) == [4]
    # A draft step of 4 ms (about a quarter of the target's): each draft now costs 7 ms and
    # the third (emitted with p = 0.51) no longer pays: 2.44 tokens in 29 ms beat 2.95 in 36.
    assert plan_drafts([0.8], [4], propose_seconds=0.004, **kw) == [2]
    # As slow as the target: never worth it.
    assert plan_drafts([0.8], [4], propose_seconds=0.015, **kw) == [0]


# ---- the guard: what steps actually cost ------------------------------------------------


def test_arm_stats_are_ratios_of_decayed_sums():
    arm = ArmStats()
    samples = [(True, 0.030, 3), (False, 0.010, 1), (True, 0.040, 2), (True, 0.033, 3),
               (False, 0.012, 1), (True, 0.0, 2), (False, 0.02, 0)]  # last two: ignored
    for speculated, seconds, emitted in samples:
        arm.observe(speculated, seconds, emitted)
    assert (arm.spec_n, arm.plain_n) == (3, 2)
    # Oldest first, each older step weighing 0.9 times the next.
    spec = [(0.030, 3), (0.040, 2), (0.033, 3)]
    plain = [(0.010, 1), (0.012, 1)]
    for got, kept in ((arm.spec, spec), (arm.plain, plain)):
        w = [0.9 ** (len(kept) - 1 - i) for i in range(len(kept))]
        want = (sum(wi * s for wi, (s, _) in zip(w, kept))
                / sum(wi * t for wi, (_, t) in zip(w, kept)))
        assert got == pytest.approx(want)


def test_one_costly_step_is_spread_over_the_tokens_around_it():
    """A first speculating step that also prefilled the draft (190 ms for 5 tokens), then
    steps of 45 ms for 6 tokens, against plain steps of 18 ms a token: by the eighth
    speculating step the arm says under 10 ms a token and speculation wins (a moving
    average of per-step ratios would still say 22 ms)."""
    arm = ArmStats()
    arm.observe(True, 0.190, 5)
    for _ in range(7):
        arm.observe(True, 0.045, 6)
    for _ in range(8):
        arm.observe(False, 0.018, 1)
    assert arm.spec < 0.010 and guard_allows(arm, 0)


def test_guard_measures_both_kinds_of_step_then_keeps_the_faster():
    fresh = ArmStats()
    # Nothing measured plain yet: every other step plain, to measure both.
    assert [guard_allows(fresh, d) for d in range(6)] == [False, True] * 3
    plain_known = ArmStats(plain_seconds=0.080, plain_tokens=8, plain_n=8)
    assert all(guard_allows(plain_known, d) for d in range(32))  # spec must be measured
    faster = ArmStats(plain_seconds=0.080, plain_tokens=8, plain_n=8,
                      spec_seconds=0.144, spec_tokens=24, spec_n=8)
    slower = ArmStats(plain_seconds=0.080, plain_tokens=8, plain_n=8,
                      spec_seconds=0.288, spec_tokens=24, spec_n=8)
    assert [guard_allows(faster, d) for d in range(16)] == [True] * 15 + [False]
    assert [guard_allows(slower, d) for d in range(16)] == [False] * 15 + [True]
    assert batch_bucket(1) == 1 and batch_bucket(3) == 2 and batch_bucket(16) == 5


@pytest.mark.parametrize("spec_per_token, wanted", [(0.013, "off"), (0.007, "on")])
def test_guard_switches_a_losing_plan_off_and_keeps_a_winning_one(spec_per_token, wanted):
    """Steps whose real cost the planner misjudges: plain 10 ms per token, speculating
    13 ms (a loss) or 7 ms (a gain), +-10% noise. After a short measuring phase the guard
    settles on the faster kind, with one step in 16 of the other."""
    rng = random.Random(0)
    arm = ArmStats()
    chosen = []
    for _ in range(800):
        spec = guard_allows(arm, arm.decisions)
        arm.decisions += 1
        per_token = spec_per_token if spec else 0.010
        arm.observe(spec, per_token * 3 * rng.uniform(0.9, 1.1), 3)
        chosen.append(spec)
    settled = sum(chosen[32:]) / len(chosen[32:])
    if wanted == "off":
        assert settled <= 1 / 16 + 0.01
    else:
        assert settled >= 15 / 16 - 0.01


def test_the_speculator_learns_only_from_decode_only_steps():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      NgramProposer(1, 4), StepCost([(1, 0.01), (64, 0.2)]), 256)
    params = SamplingParams(max_tokens=8)

    def row(rid: str, tokens: int, drafts: int) -> ScheduledRequest:
        return ScheduledRequest(rid, [1] * tokens, 10, [[0]], True, params,
                                num_draft_tokens=drafts)

    decode = SchedulerOutput([row("a", 3, 2), row("b", 1, 0)], 4)
    spec.observe(decode, ModelRunnerOutput({"a": [5, 6, 7], "b": [8]}), 0.02)
    mixed = SchedulerOutput([row("a", 3, 2), row("c", 40, 0)], 43)  # a prompt chunk
    spec.observe(mixed, ModelRunnerOutput({"a": [5], "c": [9]}), 0.5)
    plain = SchedulerOutput([row("a", 1, 0), row("b", 1, 0)], 2)
    spec.observe(plain, ModelRunnerOutput({"a": [5], "b": [8]}), 0.01)
    arm = spec.arms[batch_bucket(2)]
    assert (arm.spec_n, arm.plain_n) == (1, 1)
    assert arm.spec == pytest.approx(0.02 / 4) and arm.plain == pytest.approx(0.01 / 2)


def decoding_requests(*ids: str) -> list[Request]:
    """Running requests, each with its prompt computed but the last token: the next step
    decodes them (the history [1, 2, 3] x 3 gives a lookup something to find)."""
    requests = []
    for rid in ids:
        req = Request(rid, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=64),
                      max_tokens=64)
        req.num_computed_tokens = req.num_tokens - 1
        req.status = RequestStatus.RUNNING
        requests.append(req)
    return requests


@pytest.mark.parametrize(("cheap", "cost", "known", "drafted"), [
    (True, StepCost([(1, 0.010), (5, 0.010), (64, 0.19)]), True, [True, True, False]),
    (False, StepCost([(1, 0.010), (5, 0.010), (64, 0.19)]), True, [False, False, False]),
    (False, StepCost([(1, 0.010), (1 << 20, 0.010)]), True, [True, True, True]),
    (False, StepCost([(1, 0.010), (5, 0.010), (64, 0.19)]), False, [True, False, False]),
])
def test_a_model_proposer_speculates_only_for_a_large_gain(cheap, cost, known, drafted):
    """Three requests at acceptance 1/2. Two free rows: the plan gains 1.33x, which a lookup
    takes (MIN_GAIN) and a draft model does not (MODEL_GAIN, 1.5x); free rows (1.94x): a
    draft model too. While a draft model's acceptance is unknown, one request a step
    speculates on the lookup's terms, to learn it."""

    class Proposer(NgramProposer):
        pass

    Proposer.cheap = cheap
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      Proposer(1, 4), cost, 256)
    spec.guard = False
    if known:
        spec.pool = AcceptancePool(accepted=49, judged=100)  # 0.49, as the fresh prior
    requests = decoding_requests("a", "b", "c")
    spec.prepare(requests, [])
    assert [bool(r.draft_token_ids) for r in requests] == drafted


@pytest.mark.parametrize(("accepted", "drafted", "learns"), [
    (0, 1, True), (0, 8, True), (1, 31, True), (0, 32, False), (3, 40, False)])
def test_a_draft_model_keeps_learning_until_its_acceptance_is_known(accepted, drafted,
                                                                    learns):
    """A draft model's first drafts rejected (the pool's rate below the fresh 1/2 after
    fewer than LEARN_TOKENS draft tokens) do not stop it: one request a step still
    speculates, or no new evidence would ever come (seen: one rejected first draft left a
    draft model off for the rest of a run). With LEARN_TOKENS verified, the pool's low rate
    is a verdict."""

    class Proposer(NgramProposer):
        cheap = False

    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      Proposer(1, 4), StepCost([(1, 0.010), (5, 0.010), (64, 0.19)]), 256)
    spec.guard = False
    spec.pool = AcceptancePool(accepted=accepted, judged=drafted)
    requests = decoding_requests("a", "b", "c")
    spec.prepare(requests, [])
    assert sum(bool(r.draft_token_ids) for r in requests) == (1 if learns else 0)


@pytest.mark.parametrize("adaptive", [True, False])
def test_not_adaptive_speculates_in_every_step_a_proposal_is_found(adaptive):
    """Rows as dear as whole steps: the adaptive planner never speculates, and
    ``adaptive: false`` (vLLM's behaviour) proposes for every decoding request anyway,
    guard or not, each as many tokens as its lookup finds."""
    dear_rows = StepCost([(1, 0.010), (2, 0.020), (64, 0.64)])
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                        adaptive=adaptive), NgramProposer(1, 4), dear_rows, 256)
    requests = decoding_requests("a", "b")
    for _ in range(3):
        spec.prepare(requests, [])
        assert [r.draft_token_ids for r in requests] == \
            ([[3, 1, 2]] * 2 if not adaptive else [[], []])


@pytest.mark.parametrize("cheap", [True, False])
def test_a_model_proposer_waits_for_decode_only_steps(cheap):
    """A prompt waiting to be prefilled makes the next step mixed: a lookup speculates
    there, a draft model does not (the guard measures decode-only steps alone)."""

    class Proposer(NgramProposer):
        pass

    Proposer.cheap = cheap
    free_rows = StepCost([(1, 0.010), (1 << 20, 0.010)])
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      Proposer(1, 4), free_rows, 256)
    spec.guard = False
    spec.pool = AcceptancePool(accepted=90, judged=100)
    running = Request("a", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=64),
                      max_tokens=64)
    running.num_computed_tokens = running.num_tokens - 1
    running.status = RequestStatus.RUNNING
    waiting = Request("b", list(range(40)), SamplingParams(max_tokens=8), max_tokens=8)
    assert (spec.prepare([running], [waiting]) > 0) == cheap
    assert spec.prepare([running], []) > 0


def test_acceptance_pool_is_a_decayed_rate_over_all_requests():
    pool = AcceptancePool(decay=0.9)
    assert pool.rate == 0.5  # nothing verified: no opinion
    history = [(4, 4), (4, 3), (0, 0), (2, 0), (4, 4)]  # (drafted, accepted); (0, 0) ignored
    for drafted, accepted in history:
        pool.observe(drafted, accepted)
    kept = [(d, a) for d, a in history if d]
    weights = [0.9 ** (len(kept) - 1 - i) for i in range(len(kept))]
    acc = sum(w * a for w, (_, a) in zip(weights, kept))
    judged = sum(w * (a + (a < d)) for w, (d, a) in zip(weights, kept))
    assert pool.rate == pytest.approx((acc + 1) / (judged + 2))


@pytest.mark.parametrize("rate", [0.3, 0.7, 0.95])
def test_accepted_over_judged_drafts_recovers_the_acceptance_rate(rate):
    """Drafts accepted one after another with probability ``rate`` each, as the planner
    models them, verified 8 at a time: accepted over judged drafts recovers the rate;
    accepted over drafted ones (the drafts after a rejection counted as rejected, though
    never tested) falls far below it."""
    rng = random.Random(11)
    accepted = judged = drafted = 0
    for _ in range(4000):
        run = 0
        while run < 8 and rng.random() < rate:
            run += 1
        accepted, drafted = accepted + run, drafted + 8
        judged += judged_drafts(8, run)
    assert accepted / judged == pytest.approx(rate, abs=0.02)
    assert accepted / drafted < rate - 0.1


def test_a_new_request_starts_from_the_pools_rate():
    assert acceptance_estimate(0, 0, prior=0.95) == pytest.approx(0.95)
    assert acceptance_estimate(0, 0, prior=0.5) == 0.5  # the former fixed prior
    # Its own record takes over: 2 of 20 accepted against a pool at 0.9.
    assert acceptance_estimate(2, 20, prior=0.9) == pytest.approx((2 + 1.8) / 22)


@pytest.mark.parametrize("cheap", [False, True])
def test_a_draft_models_speculator_pools_acceptance_from_every_verification(cheap):
    class Proposer(NgramProposer):
        pass

    Proposer.cheap = cheap
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      Proposer(1, 4), StepCost([(1, 0.01), (64, 0.2)]), 256)
    params = SamplingParams(max_tokens=8)
    mixed = SchedulerOutput([ScheduledRequest("a", [1] * 5, 10, [[0]], True, params,
                                              num_draft_tokens=4),
                             ScheduledRequest("c", [1] * 40, 0, [[0]], True, params)], 45)
    spec.observe(mixed, ModelRunnerOutput({"a": [5, 6, 7], "c": [9]}), 0.5)
    # Mixed steps count here too; a lookup's requests keep their own prior (no pool).
    # 4 drafts, 2 accepted: 3 judged (the third was rejected, the fourth never tested).
    assert (spec.pool.judged, spec.pool.accepted) == ((0, 0) if cheap else (3, 2))



def test_expected_remaining_is_the_mean_excess_of_longer_requests():
    rng = random.Random(3)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(0, 30))]
        generated, max_tokens = rng.randint(0, 320), rng.randint(1, 400)
        max_tokens = max(max_tokens, generated + 1)
        longer = [min(n, max_tokens) - generated for n in lengths if n > generated]
        if not lengths:
            want = max_tokens - generated
        else:
            want = sum(longer) / len(longer) if longer else 0.0
        assert expected_remaining(generated, max_tokens, lengths) == pytest.approx(want)
    # Nothing finished yet: the request's whole allowance.
    assert expected_remaining(10, 256, []) == 246
    # Longer than every recent request: expected to end now.
    assert expected_remaining(120, 256, [100, 110, 90]) == 0.0
    # Early in a request, what the others added beyond this point; capped at max_tokens.
    assert expected_remaining(0, 100, [50, 150]) == pytest.approx((50 + 100) / 2)


def test_catch_up_pays_when_the_expected_saving_covers_it():
    # 100 tokens left at 20 ms a token and 1.5x save 100 * 20 ms / 3 = 0.667 s.
    assert catch_up_pays(0.6, 100, 0.020, 1.5)
    assert not catch_up_pays(0.7, 100, 0.020, 1.5)
    assert catch_up_pays(0.0, 0.0, 0.020, 1.5)  # nothing to write: always
    assert not catch_up_pays(1e-3, 0.0, 0.020, 1.5)  # anything to write, nothing to gain


class _CatchingUp(NgramProposer):
    """A lookup that costs like a draft model: each request's history is written once."""

    cheap = False

    def __init__(self, token_seconds: float) -> None:
        super().__init__(1, 4)
        self.token_seconds = token_seconds
        self.followed: set[str] = set()

    def catch_up_seconds(self, request) -> float:
        return 0.0 if request.request_id in self.followed else \
            request.num_tokens * self.token_seconds

    def propose(self, requests, counts):
        self.followed.update(r.request_id for r, k in zip(requests, counts) if k)
        return [[7] * k for k in counts]


def _decoding(rid: str, prompt: int, generated: int, max_tokens: int = 256) -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens),
                max_tokens=max_tokens)
    r.output_token_ids.extend([2] * generated)
    r.num_computed_tokens = r.num_tokens - 1
    r.status = RequestStatus.RUNNING
    return r


def test_a_draft_model_skips_requests_whose_catch_up_does_not_pay():
    """Free verification rows (the plan wants drafts for everyone). A request the draft
    has not followed, with 250 tokens to write at 0.6 ms each (0.15 s), starts only if the
    tokens it is expected to add save that back at 1.5x of a 20 ms step (> 22.5 tokens)."""
    cost = StepCost([(1, 0.020), (1 << 20, 0.020)])
    proposer = _CatchingUp(0.0006)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4),
                      proposer, cost, 256)
    spec.guard = False
    spec.pool = AcceptancePool(accepted=95, judged=100)
    # No request has finished yet: the allowance (256 - 50) counts: drafted.
    fresh = _decoding("a", 200, 50)
    assert spec.prepare([fresh], []) > 0 and "a" in proposer.followed
    # Recent requests ended at 100-110 tokens: one at 95 expects ~10 more, too few to pay
    # its catch-up; one at 20 expects ~85.
    for n in (100, 105, 110):
        done = _decoding(f"done{n}", 10, n)
        done.status = RequestStatus.FINISHED_STOPPED
        spec.finished(done)
    late, early = _decoding("late", 155, 95), _decoding("early", 230, 20)
    spec.prepare([late, early], [])
    assert not late.draft_token_ids and early.draft_token_ids
    # Once followed, nothing is left to write: the late one continues to the end.
    proposer.followed.add("late")
    spec.prepare([late], [])
    assert late.draft_token_ids
    # An aborted request says nothing about lengths.
    gone = _decoding("gone", 10, 3)
    gone.status = RequestStatus.FINISHED_ABORTED
    spec.finished(gone)
    assert list(spec.lengths) == [100, 105, 110]



def test_a_faded_record_weighs_less_against_the_prior():
    assert acceptance_estimate(1, 9, prior=0.9, fade=1.0) == pytest.approx((1 + 1.8) / 11)
    assert acceptance_estimate(1, 9, prior=0.9, fade=0.5) == pytest.approx((0.5 + 1.8) / 6.5)
    assert acceptance_estimate(1, 9, prior=0.9, fade=1e-9) == pytest.approx(0.9)


def test_a_draft_models_request_speculates_again_after_a_bad_stretch():
    """Four verifications that rejected the first of 8 drafts put the request's estimate
    below what a draft model's plan takes; with no new evidence it would never speculate
    again. Its record fades over the steps it runs plain, back towards the pool's 90%."""
    cost = StepCost([(1, 0.020), (1 << 20, 0.020)])
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=8),
                      _CatchingUp(0.0), cost, 256)
    spec.guard = False
    spec.pool = AcceptancePool(accepted=90, judged=100)
    r = _decoding("a", 20, 10)
    assert spec.prepare([r], []) == 8
    params = SamplingParams(max_tokens=256)
    sched = SchedulerOutput([ScheduledRequest("a", [1] * 9, 29, [[0]], True, params,
                                              num_draft_tokens=8)], 9)
    r.num_draft_tokens, r.num_accepted_tokens, r.num_judged_drafts = 32, 0, 4
    spec.observe(sched, ModelRunnerOutput({"a": [7]}), 0.02)
    plain_steps = 0
    while spec.prepare([r], []) == 0:
        plain_steps += 1
        assert plain_steps < 30, "the bad stretch was never forgotten"
    assert 1 <= plain_steps <= 15


# ---- the configuration ------------------------------------------------------------------


def test_speculative_config_from_json_names_what_is_wrong():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                      '"prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 3, 5)
    for text, words in [('{"method": "medusa"}', "must be one of"),
                        ('{"num_speculative_tokens": 0}', "[1, 16]"),
                        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "min <= max"),
                        ('{"method": "draft"}', 'needs "model"'),
                        ('{"method": "suffix", "suffix_decoding_max_cached_requests": 0}',
                         "positive integer"),
                        ('{"method": "draft", "model": "m", "draft_prompt_lookup": "yes"}',
                         "true or false"),
                        ('{"draft_prompt_lookup": false}', 'method "draft" only'),
                        ('{"method": "draft", "model": "m", "draft_kv_from_target": 1}',
                         "draft_kv_from_target must be true or false"),
                        ('{"draft_kv_from_target": true}', 'method "draft" only'),
                        ('{"adaptive": "no"}', "adaptive must be true or false"),
                        ('{"num_speculative_token": 4}', "unknown speculative config keys"),
                        ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.from_json(text)
        assert words in str(e.value), (text, str(e.value))


# ---- the scheduler verifies drafts --------------------------------------------------------


class TruthRunner:
    """Each request's "true" continuation is a fixed sequence; the runner samples it at
    every row (so it accepts the drafts that agree with it) and checks the step's layout."""

    def __init__(self, truth: dict[str, list[int]]) -> None:
        self.truth = truth
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        out = ModelRunnerOutput()
        for s in sched.scheduled:
            if not s.sample:
                continue
            k = s.num_draft_tokens
            first_pos = s.start_pos + s.num_tokens - k  # where the first sample goes
            samples = [self.truth[s.request_id][first_pos + j] for j in range(k + 1)]
            out.sampled_token_ids[s.request_id] = accepted_prefix(samples, s.draft_token_ids)
        return out


def _drive(s, runner, requests, propose) -> None:
    """Before each step, ``propose(request)`` sets its drafts; integrity after each step."""
    for r in requests:
        s.add_request(r)
    for _ in range(500):
        if not s.has_unfinished():
            break
        for r in s.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                r.draft_token_ids = propose(r)
        out = s.schedule()
        assert out.num_batched_tokens == sum(x.num_tokens for x in out.scheduled)
        s.update(out, runner.execute(out))
        s.kv.check_integrity()
        for r in s.running:
            assert r.num_computed_tokens == r.num_tokens - 1 or r.num_computed_tokens < \
                r.num_prompt_tokens
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == s.kv.num_blocks and s.kv.num_requests() == 0


def _truth(r: Request, length: int = 64) -> list[int]:
    rng = random.Random(r.request_id)
    return r.prompt_token_ids + [rng.randrange(100, 900) for _ in range(length)]


@pytest.mark.parametrize("seed", range(10))
def test_drafts_are_verified_and_the_output_is_the_truth(seed):
    rng = random.Random(seed)
    s, _ = make(num_blocks=40, budget=rng.choice([8, 16, 32]), max_seqs=4)
    requests = [req(f"r{seed}-{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 30))
                for i in range(6)]
    truth = {r.request_id: _truth(r) for r in requests}

    def propose(r: Request) -> list[int]:  # right for a while, then wrong
        t = truth[r.request_id][r.num_tokens:r.num_tokens + rng.randint(0, 5)]
        cut = rng.randint(0, len(t))
        return t[:cut] + [1] * (len(t) - cut)

    runner = TruthRunner(truth)
    _drive(s, runner, requests, propose)
    for r in requests:
        assert r.output_token_ids == truth[r.request_id][r.num_prompt_tokens:][:r.max_tokens]
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert any(x.num_draft_tokens for step in runner.steps for x in step.scheduled)
    stats = s.stats()
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    # Judged: the accepted drafts and at most one rejected per verification.
    for r in requests:
        assert r.num_accepted_tokens <= r.num_judged_drafts <= r.num_draft_tokens
    assert 0 < sum(r.num_judged_drafts - r.num_accepted_tokens for r in requests) \
        <= stats.spec_num_drafts


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    s, _ = make()
    r = Request("a", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0,
                                               stop_token_ids=[503]), max_tokens=20)
    truth = {"a": [5, 6, 7, 501, 502, 503, 504, 505, 506]}
    _drive(s, TruthRunner(truth), [r], lambda r: truth["a"][r.num_tokens:r.num_tokens + 4])
    assert r.output_token_ids == [501, 502, 503] and r.stop_reason == 503


def test_drafts_never_preempt_and_respect_the_budget():
    # 3 blocks of 4: the prompt takes 2; drafts beyond the pool are dropped, nobody preempted.
    s, _ = make(num_blocks=3, budget=6)
    r = req("a", 7, max_tokens=5)
    truth = {"a": _truth(r)}
    runner = TruthRunner(truth)
    _drive(s, runner, [r], lambda r: truth["a"][r.num_tokens:r.num_tokens + 8])
    assert s.num_preemptions == 0
    assert r.output_token_ids == truth["a"][7:12]
    assert max(x.num_tokens for step in runner.steps for x in step.scheduled) <= 6


def test_preemption_drops_drafts_and_recomputes():
    s, _ = make(num_blocks=6, budget=32, max_seqs=4)
    requests = [req(f"p{i}", 6, max_tokens=12) for i in range(3)]
    truth = {r.request_id: _truth(r) for r in requests}
    _drive(s, TruthRunner(truth), requests,
           lambda r: truth[r.request_id][r.num_tokens:r.num_tokens + 3])
    assert s.num_preemptions > 0
    for r in requests:
        assert r.output_token_ids == truth[r.request_id][6:18]


# ---- the acceptance rule's distribution -------------------------------------------------


def test_verifying_a_draft_keeps_the_target_distribution():
    """Deterministic draft d: accepted with probability p(d); the first emitted token is
    distributed as p (chi-square, alpha 0.001), and without the draft it is the very same
    token (per-position seeds)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0])
    probs = torch.softmax(logits, 0)
    params = SamplingParams(temperature=1.0, seed=0)
    trials, draft = 4000, 1
    sampler = Sampler()

    def rows(position_seed_base: int) -> list[SamplingRow]:
        return [SamplingRow(params, token_seed(s, 10), [], [], frozenset())
                for s in range(position_seed_base, trials)]

    first = sampler(logits.repeat(trials, 1), rows(0)).token_ids
    emitted = [accepted_prefix([t, 0], [draft])[0] for t in first]
    alone = sampler(logits.repeat(trials, 1), rows(0)).token_ids
    assert emitted == alone  # speculation does not change a seeded request's tokens
    counts = np.bincount(emitted, minlength=len(logits))
    expected = probs.numpy() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_0001[len(logits) - 1], (counts, expected)
    accepted = sum(t == draft for t in first) / trials
    assert abs(accepted - float(probs[draft])) < 4 * math.sqrt(0.25 / trials)
