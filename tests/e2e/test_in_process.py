"""The in-process mode: the app served by a test client in the test's own process, with its
engine in a child process as in `llmserve serve`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.launcher import create_app


def test_in_process_app_serves_requests(tiny_path):
    engine_config = EngineConfig(model=ModelConfig(tiny_path, max_model_len=512),
                                 cache=CacheConfig(num_blocks=64))
    app, engine, state = create_app(engine_config, ServerConfig())

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            assert (await c.get("/ready")).status_code == 503  # no engine yet
            await engine.start()
            try:
                assert (await c.get("/ready")).status_code == 200
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                          "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 5
                # A request the engine's messages cannot encode is refused by submit and
                # leaves nothing counted (the HTTP edge refuses it before, with a 400).
                bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
                    json={"type": "object", "properties": {"\ud800": {"type": "string"}}}))
                with pytest.raises(ValueError):
                    engine.submit("bad", [5, 6, 7], bad)
                assert engine.num_unfinished == 0
                for _ in range(100):  # the engine reports its blocks freed after the step
                    if engine.last_stats.kv_blocks_used == 0:
                        break
                    await asyncio.sleep(0.01)
                assert engine.last_stats.kv_blocks_used == 0
                state.draining = True
                assert (await c.get("/ready")).status_code == 503
            finally:
                await engine.shutdown()
        assert engine.health().status == "stopped"

    asyncio.run(go())


def test_an_unexpected_error_is_a_500_in_the_envelope_and_counted(tiny_path, tmp_path):
    """Starlette answers an exception nothing handled from its outermost layer, past the
    response counter: the 500 went uncounted in http_responses_total."""
    engine_config = EngineConfig(model=ModelConfig(tiny_path, max_model_len=512),
                                 cache=CacheConfig(num_blocks=64))
    app, engine, _ = create_app(engine_config, ServerConfig(data_dir=str(tmp_path)))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a defect")

    async def go() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.get("/boom")
            assert r.status_code == 500
            assert r.json()["error"] == {"message": "internal error: RuntimeError",
                                         "type": "server_error", "param": None, "code": None}
            metrics = (await c.get("/metrics")).text
        assert 'llmserve:http_responses_total{model_name="' in metrics
        assert any(line.startswith("llmserve:http_responses_total{") and 'status="500"' in line
                   and line.endswith(" 1.0") for line in metrics.splitlines()), metrics

    asyncio.run(go())
    asyncio.run(engine.shutdown())
