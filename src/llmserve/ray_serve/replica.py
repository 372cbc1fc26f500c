"""An engine replica: one AsyncLLM (and its engine process) as a Ray Serve deployment.

The replica is what a single server runs behind its HTTP layer: admission control, the
engine process with its watchdog, detokenization and stop strings, and the Prometheus
metrics of its engine. Ray Serve starts it on a node with its share of CPUs (or a GPU),
sends it traffic only once its constructor returned (the model loaded and warmed up), asks
``check_health`` whether to replace it, and collects ``record_routing_stats`` for the
routers. A stream that its caller cancels (the client went away) aborts the engine
request at once, as closing a RequestStream does in the single server.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from llmserve.config import EngineConfig, ServerConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.events import EngineUnavailableError, QueueFullError, RequestEvent
from llmserve.engine.validation import ContextLengthError
from llmserve.logger import get_logger
from llmserve.ray_serve.messages import Accepted, Rejected, ReplicaInfo, Submission
from llmserve.server.metrics import ServerMetrics

logger = get_logger(__name__)


class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        self.metrics = ServerMetrics(config.served_model_name or engine_config.model.model)
        self.engine = AsyncLLM(engine_config,
                               max_queued_requests=config.max_queued_requests,
                               max_queued_tokens=config.max_queued_tokens,
                               request_timeout=config.request_timeout, stats=self.metrics,
                               hang_timeout=config.engine_hang_timeout,
                               max_restarts=config.engine_max_restarts,
                               restart_window=config.engine_restart_window)
        self.ready = await self.engine.start()
        logger.info("replica %s (pid %d) ready: engine process %d", self.replica_id,
                    os.getpid(), self.ready.pid)

    async def describe(self) -> ReplicaInfo:
        return ReplicaInfo(self.engine.max_model_len, self.engine.vocab_size, self.ready)

    async def generate(self, sub: Submission) -> AsyncIterator[Accepted | Rejected
                                                                | list[RequestEvent]]:
        """Queue the request: yield Accepted (or one Rejected), then its events, as lists
        of what is queued when the caller takes the next item: one event while the caller
        keeps up, several (one Ray message) when it lags."""
        try:
            stream = self.engine.submit(sub.request_id, sub.prompt_token_ids, sub.params,
                                        sub.prompt, sub.priority)
        except QueueFullError as e:
            yield Rejected("queue_full", str(e), e.retry_after, self.replica_id)
            return
        except EngineUnavailableError as e:
            yield Rejected("unavailable", str(e), e.retry_after, self.replica_id)
            return
        except ContextLengthError as e:
            yield Rejected("context_length", str(e), replica=self.replica_id)
            return
        except ValueError as e:
            yield Rejected("invalid", str(e), replica=self.replica_id)
            return
        try:
            yield Accepted(self.replica_id)
            async for event in stream:
                yield [event, *stream.queued()]
        finally:
            stream.close()  # cancelled (client gone): abort in the engine

    async def reset_prefix_cache(self) -> str:
        return await self.engine.reset_prefix_cache()

    def record_routing_stats(self) -> dict[str, Any]:
        """For the routers and the ingress's /metrics (every ROUTING_STATS_PERIOD_S)."""
        stats = self.engine.last_stats
        health = self.engine.health()
        return {
            "app": self.app_name,
            "accepting": self.engine.ready,
            "status": health.status,
            "restarts": health.restarts,
            "last_failure": health.last_failure,
            "pid": os.getpid(),
            "engine_pid": health.engine_pid,
            "num_unfinished": self.engine.num_unfinished,
            "num_running": stats.num_running if stats else 0,
            "num_waiting": stats.num_waiting if stats else 0,
            "kv_usage": stats.kv_usage if stats else 0.0,
            "metrics": self.metrics.render().decode(),
        }

    def check_health(self) -> None:
        """Ray replaces a replica whose engine gave up (more restarts than allowed in the
        window) or was stopped; a restarting engine is still healthy (it is skipped by
        the routers until it is back)."""
        if self.engine.status in ("failed", "stopped"):
            raise RuntimeError(f"the engine is {self.engine.status}: "
                               f"{self.engine.last_failure}")

    async def __del__(self) -> None:
        await self.engine.shutdown()
