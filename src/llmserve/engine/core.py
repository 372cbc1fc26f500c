"""EngineCore: the loop of schedule, execute, update over one model and its KV cache."""

from __future__ import annotations

import os
import time

import torch

from llmserve import envs
from llmserve.attention.kv_format import kv_bytes_per_vector, resolve_kv_cache_dtype
from llmserve.config import EngineConfig
from llmserve.engine.messages import EngineCoreOutput, ModelCard, RequestFailed
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.validation import check_request
from llmserve.host_memory import retain_freed_memory
from llmserve.kv_cache import (
    KVCacheManager,
    KVCacheSpec,
    group_layers,
    num_blocks_for_memory,
)
from llmserve.kv_cache.sizing import default_kv_cache_memory_gib, describe_capacity
from llmserve.logger import get_logger
from llmserve.models.loader import LoadedModel, load_model
from llmserve.runner import ModelRunner
from llmserve.runner.cuda_graphs import MAX_CONTEXT as MAX_GRAPH_CONTEXT
from llmserve.runner.model_runner import StepHandle
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from llmserve.structured_output import GrammarBackend

logger = get_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(envs.LLMSERVE_NUM_THREADS or len(os.sched_getaffinity(0)))
        retain_freed_memory()  # per-step tensors reuse freed memory instead of page-faulting
        torch.manual_seed(config.seed)
        mc = config.model
        self.loaded = loaded or load_model(mc.model, mc.device, quantization=mc.quantization,
                                           dtype=mc.dtype, group_size=mc.int4_group_size)
        logger.info(self.loaded.describe())
        arch = self.loaded.arch_config
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = self.tokenizer.stop_token_ids | frozenset(arch.eos_token_ids)

        cache = config.cache
        fmt = self.loaded.weight_format
        kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, fmt.dtype, fmt.quantization,
                                          str(mc.device))
        windows = [arch.window(i) if cache.hybrid_kv_cache else None
                   for i in range(arch.num_hidden_layers)]
        groups = tuple(group_layers(windows))
        spec = KVCacheSpec(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
                           cache.block_size, kv_bytes_per_vector(kv_dtype, arch.head_dim),
                           kv_dtype, groups)
        num_blocks = cache.num_blocks or num_blocks_for_memory(
            spec, cache.kv_cache_memory_gib or default_kv_cache_memory_gib(mc.device),
            mc.device)
        step_tokens = config.scheduler.max_num_batched_tokens
        capacity = spec.max_sequence_tokens(num_blocks, step_tokens)
        if capacity < 1:
            raise ValueError(f"a KV cache of {num_blocks} blocks cannot hold one token: the "
                             f"model's {len(groups)} KV cache groups need a block each; give "
                             "it more memory (--kv-cache-memory) or more blocks")
        self.max_model_len = self._resolve_max_model_len(capacity)
        budget = config.scheduler.max_num_batched_tokens
        if not config.scheduler.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a prompt is computed in one step, but a step holds "
                f"{budget} tokens (max_num_batched_tokens) and a prompt may have up to "
                f"{self.max_model_len} (max_model_len): raise max_num_batched_tokens to "
                f"{self.max_model_len}, lower max_model_len, or enable chunked prefill")
        self.kv_spec = spec
        per_sequence = spec.bytes_per_sequence(self.max_model_len, 1)  # while decoding
        logger.info(describe_capacity(spec, num_blocks, self.max_model_len, step_tokens))
        self.card = ModelCard(
            arch.architecture, arch.num_parameters, self.loaded.weight_description,
            self.loaded.weight_bytes, kv_dtype, cache.block_size, spec.bytes_per_token,
            capacity, str(mc.device),
            config.speculative.method if config.speculative else None,
            per_sequence, num_blocks * spec.bytes_per_block / per_sequence)

        # Hashing stays on without prefix caching: then each request family gets its own
        # salt, so only the n sequences of one request share blocks.
        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, enable_caching=True,
                                         groups=groups)
        self._families: dict[str, list[str]] = {}
        self._failed: list[RequestFailed] = []  # see take_failed
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        start = time.perf_counter()
        self.runner = ModelRunner(self.loaded.model, arch, num_blocks=num_blocks,
                                  block_size=cache.block_size, device=config.model.device,
                                  kv_cache_dtype=kv_dtype,
                                  seed=config.seed, eos_token_ids=self.eos_token_ids,
                                  kv_groups=[g.layers for g in groups])
        self.kv_cache_seconds = time.perf_counter() - start  # allocating the KV tensors
        if self.runner.device.type == "cuda" and not mc.enforce_eager:
            if hasattr(self.runner.backend, "build_graph_metadata"):
                self.runner.capture_cuda_graphs(config.scheduler.max_num_seqs,
                                                min(self.max_model_len, MAX_GRAPH_CONTEXT))
            else:
                logger.warning("no CUDA graphs: the %s attention backend cannot be captured "
                               "(install Triton for triton_paged); every step runs eagerly",
                               self.runner.backend.name)
        elif mc.enforce_eager and self.runner.device.type != "cuda":
            logger.warning("enforce_eager has no effect on %s: only CUDA steps are captured "
                           "as graphs, every other step runs eagerly", self.runner.device)
        self.runner.grammar = GrammarBackend(self.tokenizer, arch.vocab_size,
                                             self.eos_token_ids)
        self.runner.grammar.warm_up()  # llguidance's view of the vocabulary, in background
        self.speculator = None
        if config.speculative is not None:
            self.speculator = self._build_speculator(config)
        asked = config.scheduler.async_scheduling
        self.async_scheduling = (self.runner.device.type == "cuda" if asked is None
                                 else asked) and self.speculator is None
        # The step launched ahead (async scheduling): its schedule and handle.
        self._ahead: tuple[SchedulerOutput, StepHandle] | None = None
        self._ahead_parents: set[str] = set()  # the user request ids it holds
        self.steps_ahead = 0  # steps launched ahead (tests, benchmarks)

    def _build_speculator(self, config: EngineConfig):
        from llmserve.spec_decode import Speculator, StepCost, build_proposer

        spec = config.speculative
        # A draft model keeps one block table per request, each block holding all its
        # layers: as many blocks as the target's cache would have in one group.
        kv = self.kv_manager
        # A draft of the target's own model may read histories from the target's cache.
        from llmserve.spec_decode.draft import TargetKV

        target_kv = TargetKV(self.runner.kv_caches, self.kv_spec.dtype_name,
                             lambda rid: kv.get_block_ids(rid)[0], kv.num_groups,
                             self.max_model_len)
        proposer = build_proposer(spec, target=self.loaded, engine_config=config,
                                  num_blocks=max(1, kv.num_blocks // kv.num_groups),
                                  target_kv=target_kv)
        cost = StepCost(self._measure_step_costs(spec.num_speculative_tokens))
        logger.info("speculative decoding: %s, up to %d draft tokens per request and step; "
                    "measured %s", spec.method, spec.num_speculative_tokens, cost)
        return Speculator(spec, proposer, cost, config.scheduler.max_num_batched_tokens)

    def _measure_step_costs(self, k: int) -> list[tuple[int, float]]:
        """Seconds of a step by its size, from 1 token to a full batch of verifications."""
        kv = self.kv_manager
        top = min(self.config.scheduler.max_num_batched_tokens,
                  self.config.scheduler.max_num_seqs * (k + 1), self.max_model_len,
                  kv.num_free_blocks * kv.block_size)
        sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16} | {2 ** i for i in range(5, 12)})
        sizes = sorted({n for n in sizes if n <= top} | {top})
        blocks = kv.pool.get_new_blocks(-(-max(sizes) // kv.block_size))
        try:
            block_ids = [b.block_id for b in blocks]
            self.runner.time_verify_step(1, block_ids, repeats=2)  # first-call costs
            # Round robin over the sizes, best of the rounds: a burst of load from elsewhere
            # on the machine spoils one round of a few sizes, not every round of one size.
            # Small steps are cheap to time and decide the most: more rounds for them, and
            # up to 20 while those take under a quarter of a second (a small model's steps
            # last well under a millisecond, where one lucky sample of a 1-token step makes
            # every verification look dear and speculation never starts).
            best = dict.fromkeys(sizes, float("inf"))
            extra_until = time.perf_counter() + 0.25
            for round_ in range(20):
                if round_ >= 5 and time.perf_counter() > extra_until:
                    break
                for n in sizes:
                    if round_ < 2 or n <= 64:
                        best[n] = min(best[n], self.runner.time_verify_step(n, block_ids, 1))
            return sorted(best.items())
        finally:
            kv.pool.free_blocks(blocks)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> list[Request]:
        """Validate against the model and queue the request (n sequences for n > 1)."""
        if request_id in self._families:
            raise ValueError(f"duplicate request id {request_id!r}")
        if self._ahead is not None and request_id in self._ahead_parents:
            # That step's token for the old request would be taken for the new one.
            raise ValueError(f"request id {request_id!r} is still held by a step in flight; "
                             "request ids must be unique")
        max_tokens = self.validate(prompt_token_ids, params)
        salt = None if self.config.cache.enable_prefix_caching else request_id
        lead = None
        family = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, prompt_token_ids, params.child(i) if params.n > 1 else params,
                            eos_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                            priority=priority, cache_salt=salt, parent_id=request_id, index=i,
                            lead=lead)
            lead = lead or child
            family.append(child)
        for child in family:
            self.scheduler.add_request(child)
        self._families[request_id] = [c.request_id for c in family]
        return family

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the context window and vocabulary; returns the resolved
        max_tokens. Raises ContextLengthError or ValueError with a message for the user."""
        return check_request(prompt_token_ids, params, self.max_model_len,
                             self.loaded.arch_config.vocab_size)

    def abort(self, request_id: str, index: int | None = None, *,
              stopped: bool = False) -> bool:
        """End a request (all its sequences, or only sequence ``index``) and free its blocks
        at once. ``stopped``: the frontend matched a stop string (finish reason "stop")."""
        family = self._families.get(request_id, [])
        ids = family if index is None else family[index:index + 1]
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        ended = [r for r in (self.scheduler.abort(rid, status) for rid in ids) if r is not None]
        for r in ended:
            self._forget(r)
        if index is None:
            self._families.pop(request_id, None)
        return bool(ended)

    def step(self) -> list[EngineCoreOutput]:
        """Run one step and return what it produced.

        With asynchronous scheduling the step after is planned and launched before this
        one's tokens are read (``Scheduler.schedule_next``), so the device runs it while the
        host reads, updates and answers for this one; the next call then reads that step."""
        start = time.perf_counter()
        if self._ahead is not None:
            (sched, handle), self._ahead = self._ahead, None
        else:
            if self.speculator is not None:
                self.speculator.prepare(self.scheduler.running, self.scheduler.waiting)
            sched = self.scheduler.schedule()
            handle = self.runner.launch(sched)
        if self.async_scheduling:
            nxt = self.scheduler.schedule_next(sched)
            if nxt is not None:
                self._ahead = (nxt, self.runner.launch(nxt, prev=handle))
                requests = self.scheduler.requests
                self._ahead_parents = {requests[s.request_id].parent_id for s in nxt.scheduled}
                self.steps_ahead += 1
        result = handle.result()
        changed = self.scheduler.update(sched, result)
        failed = self._grammar_failures()
        if self.speculator is not None:
            self.speculator.observe(sched, result, time.perf_counter() - start)
            # Requests that ended outside a step (too long for the cache...).
            for rid in sched.finished_req_ids:
                self.speculator.free(rid)
        outputs = []
        for r in changed:
            if r.parent_id in failed:  # reported as failed instead (take_failed)
                if r.is_finished:  # ended by its grammar's forced end, short: as an abort
                    r.status = RequestStatus.FINISHED_ABORTED
                    self._forget(r)
                continue
            prompt_lp = None
            if r.prompt_logprobs is not None and not r.prompt_logprobs_sent:
                prompt_lp, r.prompt_logprobs_sent = r.prompt_logprobs, True
            outputs.append(EngineCoreOutput(
                r.parent_id, r.index,
                r.output_token_ids[r.num_output_tokens - r.num_new_tokens:],
                r.status.finish_reason, r.stop_reason, r.num_prompt_tokens, r.num_cached_tokens,
                None if r.sampling_params.logprobs is None else list(r.new_logprobs),
                prompt_lp, r.first_scheduled_time))
            if r.is_finished:
                self._forget(r)
        for parent in failed:  # its other sequences (n > 1) end with it
            self.abort(parent)
        return outputs

    def take_failed(self) -> list[RequestFailed]:
        """The requests that failed in steps since the last call: they are ended, their
        blocks freed, and no output of theirs was returned."""
        failed, self._failed = self._failed, []
        return failed

    def _grammar_failures(self) -> set[str]:
        """The requests whose output's grammar failed in this step (or in the step after,
        whose masks may already be computed): recorded for ``take_failed``."""
        grammar = self.runner.grammar
        if grammar is None:
            return set()
        parents = set()
        for child_id, reason in grammar.take_failed().items():
            parent = next((p for p, family in self._families.items() if child_id in family),
                          None)
            if parent is None or parent in parents:
                continue  # ended meanwhile (aborted), or one of its sequences failed already
            parents.add(parent)
            self._failed.append(RequestFailed(parent, (
                f"the output's structured-output constraint could not be enforced: the "
                f"grammar engine gave up while generating ({reason}); the schema, regex or "
                "grammar is beyond its limits: simplify it"), code="grammar_too_complex"))
        return parents

    def _forget(self, r: Request) -> None:
        if self.speculator is not None:
            self.speculator.finished(r)
        family = self._families.get(r.parent_id)
        if family is not None and all(cid not in self.scheduler.requests for cid in family):
            del self._families[r.parent_id]

    def has_unfinished(self) -> bool:
        """Requests not finished, or a step launched ahead not read yet."""
        return self.scheduler.has_unfinished() or self._ahead is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (benchmarks start each level from a cold cache);
        returns the blocks forgotten. Raises RuntimeError while requests run."""
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"{len(self.scheduler.requests)} requests are running")
        if self._ahead is not None:  # a step ahead of requests that have all ended: read it
            self.step()
        if self.speculator is not None:
            self.speculator.reset()  # the suffix method's shared history, a cache as well
        return self.kv_manager.reset_prefix_cache()

    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests waiting to be scheduled."""
        return sum(r.num_prompt_tokens for r in self.scheduler.waiting)

    def warm_up(self) -> float:
        """Run one short request through so no user pays for first-call costs; seconds."""
        start = time.perf_counter()
        self.add_request("warmup", self.tokenizer.encode("Hello") or [0],
                         SamplingParams(max_tokens=2, temperature=0))
        while self.has_unfinished():
            self.step()
        if self.speculator is not None:
            # No user's request: its 2 tokens must not stand for what requests generate
            # (it would keep a draft model off for the whole first request).
            self.speculator.forget_requests()
        return time.perf_counter() - start

    def _resolve_max_model_len(self, kv_capacity_tokens: int) -> int:
        native = self.loaded.arch_config.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is not None and asked > native:
            raise ValueError(f"max_model_len {asked} exceeds the model's context length {native}")
        length = asked or native
        if length > kv_capacity_tokens:
            if asked is not None:
                raise ValueError(f"max_model_len {asked} does not fit in the KV cache "
                                 f"({kv_capacity_tokens} tokens); give the cache more memory "
                                 "(--kv-cache-memory, or kv_cache_memory / num_kv_blocks in "
                                 "the Python API)")
            logger.warning("context window capped to the KV cache capacity: %d tokens "
                           "(the model allows %d)", kv_capacity_tokens, native)
            length = kv_capacity_tokens
        return length
