"""Continuous (iteration-level) batching over a per-step token budget.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting
ones while budget, sequence slots and KV blocks last. A prompt longer than the budget left
is cut into chunks computed over several steps, mixed with the decodes of others. When KV
blocks run out, the most recently admitted running request (lowest priority first under
the priority policy) is preempted by recompute: its blocks are freed and it goes back to
the head of the waiting queue. The scheduler thinks only in "how many tokens does each
request compute this step" and in block ids; it never touches a tensor.

Speculative decoding: a decoding request may carry draft tokens (``draft_token_ids``, set
by the proposer before the step). They are scheduled after its last known token when the
budget and the KV blocks allow (drafts are dropped before anyone is preempted for them);
after the step, ``num_computed_tokens`` rolls back over the rejected ones, whose KV slots
are simply overwritten later.
"""

from __future__ import annotations

import bisect
import itertools
import time

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.kv_cache import KVCacheManager
from llmserve.logger import get_logger
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler.output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)

logger = get_logger(__name__)


def overlappable(params: SamplingParams) -> bool:
    """Whether a request's next step can be planned before its last token is known: its
    sampling reads no host copy of its tokens."""
    return not (params.has_penalties or params.min_tokens > 0
                or params.structured_outputs is not None)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.static = config.scheduling == "static"
        self.by_priority = config.policy == "priority"
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # admission order: head first
        self.running: list[Request] = []  # admission order
        # Static mode: the batch being formed; nothing else is admitted until it drains.
        self._static_batch: list[Request] = []
        self._finished_ids: set[str] = set()
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        self.num_preemptions = 0
        self._last_tokens = 0
        self._last_seqs = 0
        self.num_steps = 0  # schedule() calls that scheduled work
        self.spec_num_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self._order[request.request_id] = next(self._seq)
        self._enqueue(self.waiting, request, front=False)

    def abort(self, request_id: str,
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """End a request wherever it is and free its blocks at once."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        for queue in (self.running, self.waiting, self._static_batch):
            if request in queue:
                queue.remove(request)
        request.status = status
        self._release(request)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._static_batch)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._static_batch)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """1. Running requests in admission order, each up to the budget left; when blocks
              run out, preempt from the tail until the request fits (or is itself preempted).
           2. Only if nothing was preempted: admit from the queue head while the budget,
              the sequence cap and the KV blocks allow, taking prefix-cache hits first.
        """
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:  # cannot happen while update() keeps pace; be safe
                i += 1
                continue
            drafts = self._drafts_that_fit(req, num_new, budget)
            if drafts:
                scheduled = self._schedule(req, num_new, drafts)
                out.scheduled.append(scheduled)
                budget -= scheduled.num_tokens
                i += 1
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: nothing after it in running remains
            out.scheduled.append(self._schedule(req, num_new))
            budget -= num_new
            i += 1

        if not out.preempted_req_ids:
            budget = self._admit(out, budget)
        return self._close(out, budget)

    def schedule_next(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Asynchronous scheduling: the step after ``prev``, planned while ``prev`` runs and
        before its sampled tokens are known. Each request ``prev`` sampled for decodes the
        token ``prev`` samples (``PENDING_TOKEN``, taken from ``prev``'s sampled ids on the
        device), then waiting requests are admitted as ``schedule`` would.

        None (plan the step after ``prev``'s tokens are read) unless every running request
        sampled in ``prev`` without drafts and with parameters that need no host copy of its
        tokens (no penalties, min_tokens or structured outputs), and each fits one more
        token in its blocks: this never preempts. A request ``prev`` finishes by its length
        is left out; one that ``prev`` stops by a stop token decodes one token in vain, which
        ``update`` drops (its KV slot lies past every hashed block: nothing reads it).
        """
        if self.static or prev.preempted_req_ids or not prev.scheduled:
            return None
        rows = {item.request_id: row for row, item in enumerate(prev.scheduled)}
        if any(item.num_draft_tokens or not item.sample for item in prev.scheduled) or \
                any(r.request_id not in rows or r.draft_token_ids
                    or not overlappable(r.sampling_params) for r in self.running):
            return None
        # Those that sample once more; prev's token is their (num_output_tokens + 1)-th.
        going = [r for r in self.running if r.num_output_tokens + 1 < r.max_tokens]
        budget = self.config.max_num_batched_tokens
        if not going or len(going) > budget:
            return None
        # On a failure the earlier ones keep the block they got: their next allocation
        # (in schedule()) needs it anyway and takes nothing more.
        for req in going:
            if self.kv.allocate_slots(req, 1) is None:
                return None
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        for req in going:
            out.scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=[PENDING_TOKEN],
                start_pos=req.num_computed_tokens,
                block_ids=self.kv.get_block_ids(req.request_id),
                sample=True,
                sampling_params=req.sampling_params,
                input_from_row=rows[req.request_id],
            ))
            req.num_computed_tokens += 1
        budget -= len(going)
        budget = self._admit(out, budget)
        return self._close(out, budget)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit from the queue head while the budget, the sequence cap and the KV blocks
        allow, taking prefix-cache hits first; returns the budget left."""
        queue = self._admission_queue()
        while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = queue[0]
            if req.waits_for_lead:
                break
            hits, num_hit = None, 0
            if req.num_computed_tokens == 0 and req.prompt_logprobs is None:
                # (prompt logprobs need logits at every prompt position: no cache hits)
                hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            queue.pop(0)
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            out.scheduled.append(self._schedule(req, num_new))
            budget -= num_new

        return budget

    def _close(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self._last_tokens = out.num_batched_tokens
        self._last_seqs = len(out.scheduled)
        if out.scheduled:
            self.num_steps += 1
        return out

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, finish requests that stop; return the requests that got a
        token (finished ones included)."""
        changed = []
        for item in sched.scheduled:
            req = self.requests.get(item.request_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            if item.request_id in result.prompt_logprobs and req.prompt_logprobs is not None:
                first, entries = result.prompt_logprobs[item.request_id]
                req.prompt_logprobs[first:first + len(entries)] = entries
            if not item.sample:
                if req.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                    self._finish_prompt_only(req)  # its prompt is computed: all it asked
                    changed.append(req)
                continue  # a prefill chunk that samples nothing
            tokens = result.sampled_token_ids[item.request_id]
            logprobs = result.logprobs.get(item.request_id)
            if item.num_draft_tokens:
                self._record_verification(req, item.num_draft_tokens, len(tokens) - 1)
            req.num_new_tokens = 0
            req.new_logprobs = []
            for j, token in enumerate(tokens):
                req.append_output_token(token)
                req.num_new_tokens += 1
                if logprobs is not None:
                    req.new_logprobs.append(logprobs[j])
                if req.check_stop():  # a stop inside an accepted run cuts it there
                    self.running.remove(req)
                    self._release(req)
                    break
            changed.append(req)
        return changed

    def stats(self) -> SchedulerStats:
        used = self.kv.num_blocks - self.kv.num_free_blocks
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_blocks_used=used,
            kv_blocks_total=self.kv.num_blocks,
            kv_usage=self.kv.usage(),
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_tokens,
            num_scheduled_seqs=self._last_seqs,
            num_steps=self.num_steps,
            spec_num_drafts=self.spec_num_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
        )

    # ---- helpers ------------------------------------------------------------------------

    def _finish_prompt_only(self, req: Request) -> None:
        """End a max_tokens 0 request once its prompt is computed: nothing was sampled (its
        last step computed no logits), and its prompt logprobs, if asked, are complete."""
        req.status = RequestStatus.FINISHED_LENGTH
        req.num_new_tokens = 0
        req.new_logprobs = []
        self.running.remove(req)
        self._release(req)

    def _drafts_that_fit(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The request's draft tokens, if it is decoding and they fit in the budget and in
        free KV blocks (allocated here); otherwise none (drafts never preempt anyone)."""
        drafts = req.draft_token_ids
        req.draft_token_ids = []
        if not drafts or num_new != 1:
            return []
        drafts = drafts[:budget - 1]
        while drafts and self.kv.allocate_slots(req, 1 + len(drafts)) is None:
            drafts = drafts[:len(drafts) // 2]
        return drafts

    def _record_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Roll back over the rejected drafts; count drafts and acceptances."""
        req.num_computed_tokens -= num_drafts - num_accepted
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        # The drafts after the first rejected one were never judged (the planner's rate).
        req.num_judged_drafts += num_accepted + (num_accepted < num_drafts)
        self.spec_num_drafts += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def _schedule(self, req: Request, num_new: int,
                  drafts: list[int] | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        # The step owns its data: copies of the request's lists, made only where the step
        # reads them (penalties, min_tokens, prompt logprobs while prefilling).
        params = req.sampling_params
        needs_prompt = params.repetition_penalty != 1.0 or (
            params.prompt_logprobs is not None and start < req.num_prompt_tokens)
        needs_output = params.has_penalties or params.min_tokens > 0
        drafts = drafts or []
        scheduled = ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:start + num_new] + drafts,
            start_pos=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=req.num_computed_tokens == req.num_tokens and req.max_tokens > 0,
            sampling_params=req.sampling_params,
            prompt_token_ids=list(req.prompt_token_ids) if needs_prompt else [],
            output_token_ids=list(req.output_token_ids) if needs_output else [],
            num_draft_tokens=len(drafts),
        )
        req.num_computed_tokens += len(drafts)
        return scheduled

    def _admission_queue(self) -> list[Request]:
        if not self.static:
            return self.waiting
        if not self.running and not self._static_batch:
            take = self.config.max_num_seqs
            self._static_batch, self.waiting = self.waiting[:take], self.waiting[take:]
        return self._static_batch

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.by_priority:
            return max(candidates, key=lambda r: (r.priority, self._order[r.request_id]))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        queue = self._static_batch if self.static else self.waiting
        self._enqueue(queue, req, front=True)
        logger.info("preempted request %s (recompute %d tokens; %d blocks free of %d)",
                    req.request_id, req.num_tokens, self.kv.num_free_blocks, self.kv.num_blocks)

    def _enqueue(self, queue: list[Request], req: Request, front: bool) -> None:
        if self.by_priority:
            keys = [(r.priority, self._order[r.request_id]) for r in queue]
            key = (req.priority, self._order[req.request_id])
            queue.insert(bisect.bisect_left(keys, key), req)
        elif front:
            queue.insert(0, req)
        else:
            queue.append(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]
        self._order.pop(req.request_id, None)
