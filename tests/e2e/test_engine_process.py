"""The engine in its own process: killed, hung or crash-looping, it costs only the requests
in flight; a poison request never reaches it; signals drain cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import LiveServer, start_server


def _health(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def _engine_pid(server: LiveServer) -> int:
    return _health(server)["engine"]["engine_pid"]


def _wait_new_engine(server: LiveServer, old_pid: int, timeout: float = 120.0) -> None:
    """Until a new engine (not ``old_pid``) serves: /ready alone could still answer for
    the old one in the instant after it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        if health["engine"]["status"] == "ready" and health["engine"]["engine_pid"] != old_pid:
            return
        time.sleep(0.1)
    raise AssertionError("no new engine took over")


def _restarts(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("llmserve:engine_restarts_total{"):
            cause = line.split('cause="', 1)[1].split('"', 1)[0]
            out[cause] = float(line.rsplit(" ", 1)[1])
    return out


class _Outcomes:
    """Requests sent from threads; each ends as ("ok" | "error", detail)."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def add(self, result: tuple[str, str]) -> None:
        with self.lock:
            self.results.append(result)

    def start(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=(self, *args), daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def _non_streaming(out: _Outcomes, server: LiveServer, max_tokens: int) -> None:
    r = httpx.post(f"{server.v1}/completions", timeout=60, json={
        "model": server.model, "prompt": "hello", "max_tokens": max_tokens,
        "ignore_eos": True})
    if r.status_code == 200:
        out.add(("ok", ""))
    else:
        err = r.json()["error"]  # OpenAI's envelope, never a bare 500
        assert r.status_code in (500, 503), r.text
        out.add(("error", err["message"]))


def _streaming(out: _Outcomes, server: LiveServer, max_tokens: int) -> None:
    with httpx.stream("POST", f"{server.v1}/completions", timeout=60, json={
            "model": server.model, "prompt": "hello", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}) as s:
        if s.status_code != 200:
            s.read()
            assert s.status_code == 503, s.text
            out.add(("error", s.json()["error"]["message"]))
            return
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]  # always a clean end
    last = json.loads(events[-2])
    out.add(("error", last["error"]["message"]) if "error" in last else ("ok", ""))


@pytest.fixture
def restartable_server(tiny_path, tmp_path):
    server = start_server(tiny_path, tmp_path, "--max-model-len", "1024",
                          "--engine-hang-timeout", "3", name="restart")
    yield server
    assert server.stop() == 0


def test_sigkill_of_the_engine_under_load_costs_only_its_requests(restartable_server):
    server = restartable_server
    pid = _engine_pid(server)
    out = _Outcomes()
    for i in range(6):
        out.start(_streaming if i % 2 else _non_streaming, server, 1000)
    deadline = time.monotonic() + 20
    while server.metrics().get("llmserve:num_requests_running", 0) < 6:
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out.join(timeout=15)
    assert time.monotonic() - killed_at < 15
    assert len(out.results) == 6
    assert all(kind == "error" and "SIGKILL" in detail for kind, detail in out.results), \
        out.results
    # Requests sent while the engine restarts get 503 + Retry-After (or are served).
    r = httpx.post(f"{server.v1}/completions", timeout=30,
                   json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert r.headers["Retry-After"]
    _wait_new_engine(server, pid)
    health = _health(server)
    assert health["status"] == "ok"
    assert health["engine"]["engine_pid"] != pid
    assert health["engine"]["restarts"] == 1
    assert "SIGKILL" in health["engine"]["last_failure"]
    r = httpx.post(f"{server.v1}/completions", timeout=30,
                   json={"model": server.model, "prompt": "hi", "max_tokens": 4,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert _restarts(server) == {"signal": 1.0}
    labels = f'model_name="{server.model}",reason="engine_error"'
    assert server.metrics()[f"llmserve:request_failed_total{{{labels}}}"] == 6


def test_a_hung_engine_is_killed_and_replaced(restartable_server):
    server = restartable_server
    pid = _engine_pid(server)
    out = _Outcomes()
    out.start(_streaming, server, 1000)
    deadline = time.monotonic() + 20
    while server.metrics().get("llmserve:num_requests_running", 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)  # alive, but makes no progress
    out.join(timeout=20)  # the hang detector fires after 3 s
    assert out.results[0][0] == "error" and "hang detector" in out.results[0][1]
    _wait_new_engine(server, pid)
    assert _restarts(server) == {"hang": 1.0}
    # The dead engine's requests and blocks are not the new one's (the gauges kept them
    # until the next step).
    metrics = server.metrics()
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metrics[f"llmserve:{gauge}"] == 0, gauge
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_crash_loop_exits_the_server_nonzero(tiny_path, tmp_path):
    server = start_server(tiny_path, tmp_path, "--max-model-len", "256",
                          "--engine-max-restarts", "1", "--engine-restart-window", "120",
                          name="crashloop")
    try:
        first = _engine_pid(server)
        os.kill(first, signal.SIGKILL)
        _wait_new_engine(server, first)
        os.kill(_engine_pid(server), signal.SIGKILL)  # the second within the window
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    log = Path(server.log_path).read_text()
    assert "giving up" in log


def test_poison_top_k_is_refused_and_the_engine_is_untouched(tiny_server):
    from tests.e2e.conftest import API_KEY

    auth = {"Authorization": f"Bearer {API_KEY}"}
    pid = _engine_pid(tiny_server)
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=auth, timeout=30, json={
        "model": tiny_server.model, "messages": [{"role": "user", "content": "hi"}],
        "temperature": 1.0, "top_k": 9223372036854775808})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_k"
    r = httpx.post(f"{tiny_server.v1}/chat/completions", headers=auth, timeout=30, json={
        "model": tiny_server.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert _engine_pid(tiny_server) == pid
    assert _health(tiny_server)["engine"]["restarts"] == 0


# ---- shutdown -----------------------------------------------------------------------------


def _serve_with_load(tiny_path, tmp_path, name: str) -> tuple[LiveServer, _Outcomes]:
    server = start_server(tiny_path, tmp_path, "--max-model-len", "1024",
                          "--shutdown-timeout", "60", name=name)
    out = _Outcomes()
    for i in range(4):
        out.start(_streaming if i % 2 else _non_streaming, server, 1000)
    deadline = time.monotonic() + 20
    while server.metrics().get("llmserve:num_requests_running", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return server, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_the_drain_early_but_cleanly(tiny_path, tmp_path, sig):
    server, out = _serve_with_load(tiny_path, tmp_path, f"twice-{sig.name}")
    server.proc.send_signal(sig)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
    server.proc.send_signal(sig)
    assert server.proc.wait(30) == 0
    out.join(timeout=10)
    assert len(out.results) == 4
    assert all(kind == "error" and "shutting down" in detail for kind, detail in out.results)
    log = Path(server.log_path).read_text()
    assert "Traceback" not in log and "Event loop is closed" not in log


def test_the_server_s_processes_go_when_it_is_killed(tiny_path, tmp_path):
    """SIGKILL runs no cleanup: the engine process and the tokenizer worker notice their
    parent's death themselves (the worker used to wait on its queue for ever)."""
    server = start_server(tiny_path, tmp_path, "--max-model-len", "256", name="orphan")
    engine = _engine_pid(server)
    deadline = time.monotonic() + 30
    while True:  # the tokenizer worker starts with the server, the engine before /ready
        children = psutil.Process(server.proc.pid).children()
        names = {" ".join(c.cmdline()) for c in children}
        if len(children) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert engine in {c.pid for c in children} and len(children) >= 2, names
    server.proc.kill()
    server.proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"outlived the server: {[' '.join(p.cmdline()) for p in alive]}"


def test_scheduler_kv_cache_usage_and_cli_import_without_torch():
    """`llmserve keys ...` and the API server's own parts start without torch."""
    code = ("import sys, llmserve.scheduler, llmserve.kv_cache, llmserve.engine.messages, "
            "llmserve.usage, llmserve.cli; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
