"""The ingress deployment: the single server's HTTP app, in front of the engine replicas.

Ray Serve's HTTP proxy hands each HTTP request to the ingress, which runs the same FastAPI
app as ``llmserve serve`` (OpenAI endpoints, errors, streaming, keys and limits, the
console, health and readiness) with a RayEngineClient where AsyncLLM would be. So the API
is the single server's, byte for byte; only /metrics adds a ``replica`` label.
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmserve.config import EngineConfig, ServerConfig
from llmserve.logger import get_logger
from llmserve.models.loader import load_tokenizer
from llmserve.ray_serve.client import RayEngineClient
from llmserve.ray_serve.metrics import ClusterMetrics
from llmserve.ray_serve.reports import replica_reports
from llmserve.server.app import ServerState, build_app
from llmserve.server.launcher import open_accounts, use_chat_template

logger = get_logger(__name__)


class Ingress:
    async def __init__(self, engine: Any, engine_config: EngineConfig,
                       config: ServerConfig) -> None:
        model_name = config.served_model_name or engine_config.model.model
        tokenizer = load_tokenizer(engine_config.model.model)
        use_chat_template(tokenizer, config.chat_template, engine_config.model.model)
        self.engine = RayEngineClient(engine, tokenizer)
        # The replicas load the model meanwhile: until one is ready the app answers 503
        # (not ready yet), as the single server does while its engine starts; Ray's proxy
        # has the route as soon as this constructor returns.
        self._starting = asyncio.get_running_loop().create_task(self._start_engine())
        self.state = ServerState()
        self.metrics = ClusterMetrics(model_name, replica_reports)
        self.engine.stats = self.metrics  # the router's own refusals (429) are counted here
        # (Ray's wrapper owns the name "app".)
        self.http_app = build_app(self.engine, config, self.metrics,  # type: ignore[arg-type]
                                  self.state, model_name, open_accounts(config))
        self.http_app.state.tokenizers.start()
        self.http_app.state.accounts.start()

    async def _start_engine(self) -> None:
        try:
            await self.engine.start()  # also creates the handle's router, which holds reports
        except Exception as e:
            logger.error("the engine replicas could not be reached: %s: %s",
                         type(e).__name__, e)
            self.engine.status = "failed"
            return
        logger.info("ingress ready: max_model_len %d", self.engine.max_model_len)

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    # The launcher's drain, called through the application's handle before the application
    # is deleted (Ray's proxy drops the route at deletion: the app must say 503 first).
    def begin_drain(self) -> int:
        """New requests get 503 (shutting down), /ready says draining; returns how many
        requests are running."""
        self.state.draining = True
        return self.engine.num_unfinished

    def unfinished(self) -> int:
        return self.engine.num_unfinished

    async def end_requests(self) -> int:
        """End what still runs with the single server's final error (shutting down), and
        give the final events a moment to reach their clients."""
        left = self.engine.num_unfinished
        if left:
            self.engine.abort_all("shutdown", "the server is shutting down")
            await asyncio.sleep(0.3)
        return left

    async def __del__(self) -> None:
        app = getattr(self, "http_app", None)
        if app is None:  # the constructor failed
            return
        self.state.draining = True
        app.state.tokenizers.shutdown()
        await self.engine.shutdown()
        await app.state.accounts.close()
