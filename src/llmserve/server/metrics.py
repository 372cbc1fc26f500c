"""Prometheus metrics, named after vLLM's where one exists, with the prefix ``llmserve:``."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.scheduler import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


@dataclass(frozen=True)
class _EngineCounters:
    steps: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_per_pos: tuple[int, ...] = ()

    @classmethod
    def of(cls, s: SchedulerStats) -> _EngineCounters:
        return cls(s.num_steps, s.num_preemptions, s.prefix_queries, s.prefix_hits,
                   s.spec_num_drafts, s.spec_draft_tokens, s.spec_accepted_tokens,
                   tuple(s.spec_accepted_per_pos))


class ServerMetrics:
    """Implements the engine's StatsSink; renders the Prometheus text format."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._model = model_name

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("llmserve:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("llmserve:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("llmserve:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("llmserve:request_queue_time_seconds",
                          "Time from arrival to first scheduling.")
        self.prompt_len = hist("llmserve:request_prompt_tokens", "Prompt length of requests.",
                               _TOKEN_BUCKETS)
        self.gen_len = hist("llmserve:request_generation_tokens",
                            "Generated tokens per request.", _TOKEN_BUCKETS)
        # Per engine step (vLLM: iteration_tokens_total), and the batch it ran.
        self.step_tokens = hist("llmserve:iteration_tokens_total",
                                "Tokens scheduled in one engine step.", _STEP_TOKEN_BUCKETS)
        self.step_batch = hist("llmserve:iteration_batch_size",
                               "Sequences scheduled in one engine step.", _BATCH_BUCKETS)
        self.running = gauge("llmserve:num_requests_running", "Sequences running in the engine.")
        self.waiting = gauge("llmserve:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("llmserve:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).")
        self.prompt_tokens = counter("llmserve:prompt_tokens", "Prompt tokens of requests.")
        self.gen_tokens = counter("llmserve:generation_tokens", "Generated tokens.")
        self.preemptions = counter("llmserve:num_preemptions", "Preempted sequences.")
        self.prefix_queries = counter("llmserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("llmserve:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.aborted = counter("llmserve:request_aborted", "Requests aborted (client gone).")
        self._success = Counter("llmserve:request_success",
                                "Requests answered in full, by finish reason (stop, length).",
                                ["model_name", "finished_reason"], registry=r)
        self._failed = Counter("llmserve:request_failed",
                               "Requests ended by an error (timeout, engine_error, shutdown, "
                               "invalid_request).", ["model_name", "reason"], registry=r)
        self._restarts = Counter("llmserve:engine_restarts",
                                 "Engine processes restarted, by cause (signal, exception, "
                                 "exit, hang).", ["model_name", "cause"], registry=r)
        self._responses = Counter("llmserve:http_responses",
                                  "HTTP responses by status code, errors included.",
                                  ["model_name", "status"], registry=r)
        self._rejected = Counter("llmserve:request_rejected", "Rejected requests by reason.",
                                 ["model_name", "reason"], registry=r)
        # Speculative decoding, named like vLLM's spec_decode counters.
        self.spec_drafts = counter("llmserve:spec_decode_num_drafts",
                                   "Times a request verified draft tokens (one per request "
                                   "and step).")
        self.spec_draft_tokens = counter("llmserve:spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted = counter("llmserve:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self._spec_per_pos = Counter("llmserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = the "
                                     "first draft token); divided by num_drafts, the "
                                     "acceptance rate per position.",
                                     ["model_name", "position"], registry=r)
        self._last = _EngineCounters()  # the engine's cumulative counters as last seen

    # ---- StatsSink -----------------------------------------------------------------------

    def on_step(self, stats: SchedulerStats, new_generation_tokens: int) -> None:
        self.update_gauges(stats)
        self.gen_tokens.inc(new_generation_tokens)
        # The engine's counters are cumulative since it started: add what they grew by.
        now, last = _EngineCounters.of(stats), self._last
        if now.steps > last.steps:  # this message reports a step that ran
            self.step_tokens.observe(stats.num_scheduled_tokens)
            self.step_batch.observe(stats.num_scheduled_seqs)
        self.preemptions.inc(max(0, now.preemptions - last.preemptions))
        self.prefix_queries.inc(max(0, now.prefix_queries - last.prefix_queries))
        self.prefix_hits.inc(max(0, now.prefix_hits - last.prefix_hits))
        self.spec_drafts.inc(max(0, now.spec_drafts - last.spec_drafts))
        self.spec_draft_tokens.inc(max(0, now.spec_draft_tokens - last.spec_draft_tokens))
        self.spec_accepted.inc(max(0, now.spec_accepted - last.spec_accepted))
        for pos, count in enumerate(now.spec_per_pos):
            before = last.spec_per_pos[pos] if pos < len(last.spec_per_pos) else 0
            if count > before:
                self._spec_per_pos.labels(self._model, str(pos)).inc(count - before)
        self._last = now

    def update_gauges(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)

    def on_first_token(self, ttft: float, queue_time: float | None, prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue.observe(max(0.0, queue_time))
        self.prompt_tokens.inc(prompt_tokens)

    def on_inter_token(self, latency: float) -> None:
        self.itl.observe(latency)

    def on_finished(self, reason: str, e2e: float, prompt_tokens: int,
                    generation_tokens: int) -> None:
        if reason == "abort":
            self.aborted.inc()
        elif reason in ("stop", "length"):
            self._success.labels(self._model, reason).inc()
            self.e2e.observe(e2e)
            self.prompt_len.observe(prompt_tokens)
            self.gen_len.observe(generation_tokens)
        else:
            self._failed.labels(self._model, reason).inc()

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self._model, reason).inc()

    def on_response(self, status: int) -> None:
        self._responses.labels(self._model, str(status)).inc()

    def on_engine_restart(self, cause: str) -> None:
        """An engine died (or failed to start): what it held is gone with it."""
        self._restarts.labels(self._model, cause).inc()
        self._last = _EngineCounters()  # a new engine counts from zero
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
