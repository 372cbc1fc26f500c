"""The scheduler and KV manager driven by a fake model runner (no model, milliseconds)."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.kv_cache import KVCacheManager
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Scheduler, SchedulerOutput
from llmserve.scheduler.output import PENDING_TOKEN, ModelRunnerOutput

BLOCK = 4


class FakeRunner:
    """Samples token = 1000 + number of tokens the request has (deterministic)."""

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        return ModelRunnerOutput({s.request_id: [1000 + s.start_pos + s.num_tokens]
                                  for s in sched.scheduled if s.sample})


def make(num_blocks=64, budget=32, max_seqs=8, caching=True, **kw):
    kv = KVCacheManager(num_blocks, BLOCK, caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw)
    return Scheduler(cfg, kv), FakeRunner()


def req(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0,
        prompt: list[int] | None = None) -> Request:
    ids = prompt if prompt is not None else [(hash(rid) + i) % 900 for i in range(n_prompt)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                   max_tokens=max_tokens, priority=priority)


def step(s: Scheduler, r: FakeRunner) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, r.execute(out))
    s.kv.check_integrity()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(out.scheduled) <= s.config.max_num_seqs
    return out


def run(s: Scheduler, r: FakeRunner, max_steps: int = 500) -> int:
    steps = 0
    while s.has_unfinished():
        step(s, r)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    assert s.kv.num_free_blocks == s.kv.num_blocks and s.kv.num_requests() == 0
    return steps


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s, r = make(budget=32)
    a = req("a", 100, max_tokens=3)
    s.add_request(a)
    run(s, r)
    sizes = [o.scheduled[0].num_tokens for o in r.steps]
    assert sizes == [32, 32, 32, 4, 1, 1]
    samples = [o.scheduled[0].sample for o in r.steps]
    assert samples == [False, False, False, True, True, True]
    assert a.output_token_ids == [1100, 1101, 1102]
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_prompt_only_request_ends_after_its_prefill_without_sampling():
    """max_tokens 0 (scoring a prompt): the chunks compute the prompt, none samples, and
    the step that computes its last chunk ends it, while another request goes on."""
    s, r = make(budget=32)
    a = req("a", 70, max_tokens=0)
    b = req("b", 6, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    changed = []
    while a.status < RequestStatus.FINISHED_STOPPED:
        out = s.schedule()
        changed.append([x.request_id for x in s.update(out, r.execute(out))])
        s.kv.check_integrity()
    sizes = [x.num_tokens for o in r.steps for x in o.scheduled if x.request_id == "a"]
    assert sizes == [32, 32, 6]
    assert not any(x.sample for o in r.steps for x in o.scheduled if x.request_id == "a")
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == []
    assert a.num_new_tokens == 0 and "a" in changed[-1] and "a" not in changed[-2]
    assert s.kv.get_block_ids("a") == [[]]
    run(s, r)
    assert len(b.output_token_ids) == 5


def test_decodes_run_first_and_prefill_chunks_fill_the_budget():
    s, r = make(budget=16)
    s.add_request(req("a", 8, max_tokens=10))
    step(s, r)  # a prefills
    s.add_request(req("b", 40, max_tokens=2))
    out = step(s, r)
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]
    out = step(s, r)
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]
    run(s, r)


def test_max_num_seqs_caps_running_requests():
    s, r = make(budget=1000, max_seqs=3)
    for i in range(7):
        s.add_request(req(f"r{i}", 5, max_tokens=3))
    out = step(s, r)
    assert len(out.scheduled) == 3 and s.num_waiting == 4
    run(s, r)


def test_preemption_takes_the_most_recent_request_and_recomputes_it():
    # 8 blocks of 4 tokens; three requests of 8 prompt tokens growing to 20 tokens each.
    s, r = make(num_blocks=8, budget=64, max_seqs=8)
    reqs = [req(f"r{i}", 8, max_tokens=12) for i in range(3)]
    for x in reqs:
        s.add_request(x)
    preempted: list[str] = []
    while s.has_unfinished():
        out = step(s, r)
        preempted += out.preempted_req_ids
    assert preempted and preempted[0] == "r2"  # admitted last, preempted first
    assert s.num_preemptions == len(preempted)
    for x in reqs:  # recompute lost nothing: same tokens as an uninterrupted run
        assert x.output_token_ids == [1008 + i for i in range(12)]
    assert s.kv.num_free_blocks == 8


def test_preempted_request_goes_to_the_head_of_the_queue():
    s, r = make(num_blocks=6, budget=64, max_seqs=8)
    for i in range(2):
        s.add_request(req(f"r{i}", 8, max_tokens=12))
    while not s.num_preemptions:
        step(s, r)
    s.add_request(req("late", 4, max_tokens=2))
    assert [x.request_id for x in s.waiting] == ["r1", "late"]
    run(s, r)


def test_priority_policy_admits_and_preempts_by_priority():
    s, r = make(num_blocks=8, budget=64, max_seqs=1, policy="priority")
    s.add_request(req("low", 4, max_tokens=2, priority=5))
    s.add_request(req("high", 4, max_tokens=2, priority=-1))
    out = step(s, r)
    assert [x.request_id for x in out.scheduled] == ["high"]
    run(s, r)

    s, r = make(num_blocks=8, budget=64, max_seqs=8, policy="priority")
    s.add_request(req("urgent", 8, max_tokens=12, priority=0))
    s.add_request(req("bulk", 8, max_tokens=12, priority=9))
    s.add_request(req("normal", 8, max_tokens=12, priority=1))
    preempted = []
    while s.has_unfinished():
        preempted += step(s, r).preempted_req_ids
    assert preempted[0] == "bulk"


def test_prefix_hits_skip_the_shared_blocks():
    s, r = make(budget=64)
    system = list(range(1, 17))  # 4 full blocks
    s.add_request(req("a", 0, max_tokens=2, prompt=[*system, 500, 501]))
    run(s, r)
    b = req("b", 0, max_tokens=2, prompt=[*system, 600, 601, 602])
    s.add_request(b)
    out = step(s, r)
    assert out.scheduled[0].start_pos == 16 and out.scheduled[0].num_tokens == 3
    assert b.num_cached_tokens == 16
    assert s.kv.prefix_hits == 16 and s.kv.prefix_queries == 18 + 19
    run(s, r)


def test_prefix_caching_off_recomputes_everything():
    s, r = make(budget=64, caching=False)
    system = list(range(1, 17))
    s.add_request(req("a", 0, max_tokens=2, prompt=[*system, 500]))
    run(s, r)
    s.add_request(req("b", 0, max_tokens=2, prompt=[*system, 600]))
    out = step(s, r)
    assert out.scheduled[0].start_pos == 0 and s.kv.prefix_hits == 0
    run(s, r)


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "mid-decode"])
def test_abort_frees_everything_at_once(when):
    s, r = make(budget=16)
    a = req("a", 40, max_tokens=50)
    other = req("other", 6, max_tokens=3)
    s.add_request(a)
    s.add_request(other)
    if when == "mid-prefill":
        step(s, r)
        assert 0 < a.num_computed_tokens < a.num_prompt_tokens
    elif when == "mid-decode":
        while a.num_output_tokens < 2:
            step(s, r)
    assert s.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.get_block_ids("a") == [[]]
    s.kv.check_integrity()
    assert s.abort("a") is None  # aborting twice is harmless
    run(s, r)
    assert "a" in r.steps[-1].finished_req_ids or any(
        "a" in o.finished_req_ids for o in r.steps)


def test_abort_between_schedule_and_update_drops_the_token():
    s, r = make()
    a = req("a", 4, max_tokens=5)
    s.add_request(a)
    out = s.schedule()
    result = r.execute(out)
    s.abort("a")
    assert s.update(out, result) == []
    assert a.output_token_ids == []
    s.kv.check_integrity()


def test_static_mode_waits_for_the_whole_batch():
    s, r = make(budget=1000, max_seqs=2, scheduling="static")
    s.add_request(req("short", 4, max_tokens=1))
    s.add_request(req("long", 4, max_tokens=6))
    s.add_request(req("next", 4, max_tokens=1))
    seen_next_at = None
    long_done_at = None
    for i in range(20):
        out = step(s, r)
        ids = [x.request_id for x in out.scheduled]
        if "next" in ids and seen_next_at is None:
            seen_next_at = i
        if "long" in ids:
            long_done_at = i
        if not s.has_unfinished():
            break
    assert seen_next_at == long_done_at + 1  # joins only after the batch's longest member


def test_duplicate_request_id_rejected():
    s, _ = make()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("a", 4))


def test_stats_report_running_waiting_and_blocks():
    s, r = make(budget=8, max_seqs=1)
    s.add_request(req("a", 6, max_tokens=4))
    s.add_request(req("b", 6, max_tokens=4))
    step(s, r)
    st = s.stats()
    assert (st.num_running, st.num_waiting) == (1, 1)
    assert st.kv_blocks_used == 2 and st.kv_blocks_total == 64
    assert st.num_scheduled_tokens == 6 and st.num_scheduled_seqs == 1
    run(s, r)


# ---- asynchronous scheduling: the step after, planned before this one's tokens are read ----


def _decoding(s: Scheduler, r: FakeRunner, *requests: Request) -> None:
    for q in requests:
        s.add_request(q)
    while any(q.num_output_tokens == 0 for q in requests):
        step(s, r)


def test_schedule_next_decodes_the_pending_tokens_and_admits_the_queue():
    s, r = make(budget=16)
    a, b = req("a", 5, max_tokens=10), req("b", 3, max_tokens=10)
    _decoding(s, r, a, b)
    now = s.schedule()
    nxt = s.schedule_next(now)
    assert nxt is not None
    assert [(x.request_id, x.token_ids, x.input_from_row) for x in nxt.scheduled] == [
        ("a", [PENDING_TOKEN], 0), ("b", [PENDING_TOKEN], 1)]
    assert [x.start_pos for x in nxt.scheduled] == [x.start_pos + 1 for x in now.scheduled]
    s.kv.check_integrity()
    s.add_request(req("c", 20, max_tokens=3))  # arrives while `now` runs
    s.update(now, r.execute(now))
    after = s.schedule_next(nxt)
    assert after is not None and [x.request_id for x in after.scheduled] == ["a", "b", "c"]
    assert after.scheduled[2].input_from_row is None and after.scheduled[2].num_tokens == 14
    s.update(nxt, r.execute(nxt))
    s.update(after, r.execute(after))
    assert a.output_token_ids == [1005, 1006, 1007, 1008]  # one per position, in order
    run(s, r)


def test_schedule_next_leaves_out_a_request_its_length_ends():
    s, r = make()
    a, b = req("a", 4, max_tokens=2), req("b", 4, max_tokens=8)
    _decoding(s, r, a, b)
    now = s.schedule()  # a's second and last token
    nxt = s.schedule_next(now)
    assert [x.request_id for x in nxt.scheduled] == ["b"]
    s.update(now, r.execute(now))
    assert a.is_finished
    s.update(nxt, r.execute(nxt))
    run(s, r)


def test_schedule_next_drops_a_stopped_request_s_token():
    s, r = make()
    a = req("a", 4, max_tokens=8)
    _decoding(s, r, a)
    now = s.schedule()
    nxt = s.schedule_next(now)
    s.update(now, ModelRunnerOutput({"a": [7]}))
    a.status = RequestStatus.FINISHED_STOPPED  # as a stop token would
    s.running.remove(a)
    s._release(a)
    assert s.update(nxt, r.execute(nxt)) == []
    assert s.kv.num_free_blocks == s.kv.num_blocks
    s.kv.check_integrity()


@pytest.mark.parametrize("case", ["penalty", "min_tokens", "unscheduled", "no_blocks",
                                  "prefill", "static", "crowded"])
def test_schedule_next_declines(case):
    """None, with no request's computed tokens moved, where the step after needs this one's
    tokens on the host, would leave a running request out, or would have to preempt."""
    kw = {"scheduling": "static"} if case == "static" else {}
    s, r = make(num_blocks=3 if case == "no_blocks" else 64, budget=6, **kw)
    a = req("a", 4, max_tokens=8)
    if case in ("penalty", "min_tokens"):
        extra = {"frequency_penalty": 0.5} if case == "penalty" else {"min_tokens": 2}
        a = Request("a", list(range(4)), SamplingParams(max_tokens=8, temperature=0, **extra),
                    max_tokens=8)
    others = [req("b", 4, max_tokens=8), req("c", 4, max_tokens=8)] if case == "crowded" else []
    _decoding(s, r, a, *others)
    if case == "crowded":  # three decoding, then a budget of two tokens: c waits its turn
        s.config = dataclasses.replace(s.config, max_num_batched_tokens=2)
        a.max_tokens = a.num_output_tokens + 1  # this step ends a: the two others would fit
    if case == "unscheduled":
        s.add_request(req("b", 30))
        step(s, r)  # b's first chunk: a decodes, b prefills past this step
    if case == "no_blocks":
        while a.num_tokens % BLOCK:
            step(s, r)  # a's next token needs a block: 2 of 3 held, the third taken below
        s.kv.pool.get_new_blocks(1)
    if case == "prefill":
        s.add_request(req("b", 30))
    now = s.schedule()
    if case == "crowded":
        assert [x.request_id for x in now.scheduled] == ["a", "b"]
    before = [q.num_computed_tokens for q in s.running]
    free = s.kv.num_free_blocks
    assert s.schedule_next(now) is None
    assert [q.num_computed_tokens for q in s.running] == before
    assert s.kv.num_free_blocks == free  # (with one request: nothing allocated either)
