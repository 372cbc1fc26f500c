"""Live servers for end-to-end tests: a real `llmserve serve` process on a free port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "sk-test-key"


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    model: str
    log_path: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """Prometheus samples without labels other than model_name, by metric name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("llmserve:") and "{" in line:
                name, rest = line.split("{", 1)
                labels, value = rest.rsplit("}", 1)
                key = name if labels.count("=") == 1 else f"{name}{{{labels}}}"
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m.get("llmserve:num_requests_running") == 0
                    and m.get("llmserve:num_requests_waiting") == 0
                    and m.get("llmserve:kv_cache_usage_perc") == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, tmp_path, *args: str, name: str = "server",
                 port: int | None = None, new_session: bool = False) -> LiveServer:
    """``new_session``: the server leads a process group of its own (so a test can signal
    the whole group, as systemd and ``timeout`` do)."""
    port = port or free_port()
    log_path = str(tmp_path / f"{name}-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115  (lives as long as the process)
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port", str(port),
           "--kv-cache-memory", "0.25", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=new_session)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", model, log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"server exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not become ready in 180 s")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """Tiny random model; API key required; queue of 50."""
    path, _ = tiny_model_dir("llama-gqa")
    server = start_server(str(path), tmp_path_factory.mktemp("srv"), "--api-key", API_KEY,
                          "--max-queued-requests", "50", "--max-num-seqs", "16",
                          "--max-model-len", "1024", "--max-num-batched-tokens", "512")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def real_server(tmp_path_factory) -> Iterator[LiveServer]:
    server = start_server("smollm2-135m-instruct", tmp_path_factory.mktemp("real"))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def tiny_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama-gqa")[0])
