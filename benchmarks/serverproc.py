"""A `llmserve serve` process for benchmarks: started on a free port, ready when /ready says
so, stopped with SIGTERM (a drain, as in production). Shared by the benchmark scripts.

Its usage database is a fresh one in the log's directory unless the arguments name one, so
that keys in the user's own data directory never make a benchmark server require them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, args: list[str], log_path: str, name: str = "server",
                 env: dict[str, str] | None = None, timeout: float = 300.0) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {"LLMSERVE_DATA_DIR": os.path.join(os.path.dirname(log_path) or ".",
                                                 f"{name}-data"), **(env or {})}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(self.port),
                 *args], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} was not ready in {timeout:.0f} s; see {log_path}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *_) -> None:
        self.stop()
