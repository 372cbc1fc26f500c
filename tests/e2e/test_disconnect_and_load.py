"""Clients that go away, bursts beyond the queue, and /health under a saturated engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def slow_prefill_server(tiny_path, tmp_path_factory):
    """A small token budget, so a long prompt takes many steps to prefill."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("prefill"),
                          "--max-num-batched-tokens", "2", "--max-model-len", "1024",
                          name="prefill")
    yield server
    assert server.stop() == 0


def _aborted(m: dict[str, float], server) -> float:
    return m.get("llmserve:request_aborted_total", 0.0)


def _assert_idle_and_aborted(server, before: float) -> None:
    m = server.wait_idle()
    assert m["llmserve:num_requests_running"] == 0
    assert m["llmserve:num_requests_waiting"] == 0
    assert m["llmserve:kv_cache_usage_perc"] == 0
    assert _aborted(m, server) == before + 1


def _wait_running(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metrics().get("llmserve:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.02)


def test_streaming_client_disconnect_frees_everything(slow_prefill_server):
    server = slow_prefill_server
    before = _aborted(server.metrics(), server)
    with httpx.stream("POST", f"{server.v1}/completions", timeout=30,
                      json={"model": server.model, "prompt": "hi", "max_tokens": 900,
                            "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metrics()["llmserve:num_requests_running"] == 1
    _assert_idle_and_aborted(server, before)


def test_non_streaming_client_disconnect_frees_everything(slow_prefill_server):
    server = slow_prefill_server
    before = _aborted(server.metrics(), server)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.ensure_future(client.post(
                f"{server.v1}/completions",
                json={"model": server.model, "prompt": "hi", "max_tokens": 900,
                      "ignore_eos": True}))
            await asyncio.to_thread(_wait_running, server)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    _assert_idle_and_aborted(server, before)


def test_disconnect_during_prefill_frees_everything(slow_prefill_server):
    server = slow_prefill_server
    before = _aborted(server.metrics(), server)
    gen_before = server.metrics().get("llmserve:generation_tokens_total", 0)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.ensure_future(client.post(
                f"{server.v1}/completions",
                json={"model": server.model, "prompt": [7] * 1000, "max_tokens": 5}))
            await asyncio.to_thread(_wait_running, server)
            m = server.metrics()
            assert m["llmserve:kv_cache_usage_perc"] > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    _assert_idle_and_aborted(server, before)
    # Aborted mid-prefill: not one token was generated for it.
    assert server.metrics().get("llmserve:generation_tokens_total", 0) == gen_before


def test_burst_of_200_against_a_queue_of_50(tiny_server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post(f"{tiny_server.v1}/completions", headers=AUTH,
                              json={"model": tiny_server.model, "prompt": f"request {i}",
                                    "max_tokens": 8, "ignore_eos": True})
        if r.status_code == 200:
            body = r.json()
            assert body["usage"]["completion_tokens"] == 8
            assert body["choices"][0]["finish_reason"] == "length"
        elif r.status_code == 429:
            assert r.headers.get("retry-after")
        return r.status_code

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.wait_for(
                asyncio.gather(*[one(client, i) for i in range(200)]), 180)

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 50
    assert httpx.get(f"{tiny_server.url}/ready").status_code == 200
    m = tiny_server.wait_idle()
    assert m["llmserve:kv_cache_usage_perc"] == 0


def test_health_is_answered_while_the_engine_is_saturated(tiny_server):
    """Liveness must not wait on the engine: the engine runs off the event loop, so 10
    health checks, one after another, are all answered while 16 long requests keep the
    engine busy (they are still running after the last check: 800 tokens each, a second or
    more of the tiny model's steps, against ~0.1 s of checks). How fast they are answered
    is a measurement, not a test: benchmarks/health_under_load.py."""

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": tiny_server.model, "prompt": [9] * 200, "max_tokens": 800,
                    "ignore_eos": True}
            load = [asyncio.ensure_future(client.post(f"{tiny_server.v1}/completions",
                                                      headers=AUTH, json=body))
                    for _ in range(16)]
            await asyncio.to_thread(_wait_running, tiny_server)
            for _ in range(10):
                r = await client.get(f"{tiny_server.url}/health")
                assert r.status_code == 200
                await asyncio.sleep(0.01)
            assert tiny_server.metrics()["llmserve:num_requests_running"] > 0
            assert not any(task.done() for task in load)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)

    asyncio.run(go())
    tiny_server.wait_idle()


@pytest.mark.parametrize("to_group", [False, True], ids=["to-server", "to-process-group"])
def test_sigterm_under_load_drains_and_exits_0(tiny_path, tmp_path, to_group):
    """SIGTERM to the server, or to its whole process group as systemd and `timeout` send
    it: the engine process ignores it (it used to die, and the server started another one
    while draining, failing the running requests); the server drains and stops it."""
    server = start_server(tiny_path, tmp_path, "--shutdown-timeout", "3",
                          "--max-model-len", "1024", name="sigterm", new_session=to_group)

    async def go() -> tuple[list[str], list[list[str]], int, int]:
        async with httpx.AsyncClient(timeout=60) as client:
            async def stream(max_tokens: int) -> list[str]:
                lines = []
                async with client.stream("POST", f"{server.v1}/completions", json={
                        "model": server.model, "prompt": "hi", "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                return lines

            short = [asyncio.ensure_future(stream(20)) for _ in range(2)]
            long = [asyncio.ensure_future(stream(5000 // 5)) for _ in range(2)]
            await asyncio.to_thread(_wait_running, server)
            if to_group:
                os.killpg(server.proc.pid, signal.SIGTERM)
            else:
                server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = (await client.get(f"{server.url}/ready")).status_code
            new = await client.post(f"{server.v1}/completions",
                                    json={"model": server.model, "prompt": "late"})
            short_lines = [await t for t in short]
            long_lines = [await t for t in long]
            assert new.headers.get("retry-after")
            return short_lines[0], long_lines, ready, new.status_code

    short_lines, long_lines, ready, new_status = asyncio.run(go())
    assert ready == 503 and new_status == 503
    assert short_lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in short_lines[-2]
    for lines in long_lines:  # cut off by the shutdown timeout, with a final error event
        assert lines[-1] == "data: [DONE]"
        assert "shutting_down" in lines[-2] or '"finish_reason": "length"' in lines[-2]
    assert server.proc.wait(30) == 0
    log = Path(server.log_path).read_text()
    assert "died" not in log and "restarted" not in log, log[-2000:]


def test_signals_while_the_server_stops_do_not_cut_it_short(tiny_path, tmp_path):
    """After the drain the server stops its engine and writes the last usage; signals that
    keep coming (an impatient operator, a supervisor's repeats) are ignored: uvicorn had put
    the default handlers back, and the process died with 143 partway."""
    server = start_server(tiny_path, tmp_path, "--data-dir", str(tmp_path / "data"),
                          name="signals")
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert "SIGTERM are ignored from now on" in Path(server.log_path).read_text()
