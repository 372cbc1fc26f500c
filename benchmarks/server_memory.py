"""Resident memory of `llmserve serve` with the default model, per weight format.

Starts the server, waits for /ready, sends one request, then reads the process's VmRSS
(resident now) and VmHWM (peak, i.e. during load) from /proc.

    .venv/bin/python benchmarks/server_memory.py [--kv-cache-memory 0.25]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def measure(quantization: str, kv_gib: float) -> dict[str, float]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "serve", "--port", str(port),
                             "--quantization", quantization, "--kv-cache-memory", str(kv_gib)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 8})
        return {k: v / 2**20 for k, v in _status(proc.pid).items()}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-memory", type=float, default=0.25)
    args = p.parse_args()
    print(f"| --quantization | resident MiB (KV pool {args.kv_cache_memory} GiB) | peak MiB |")
    print("|---|---|---|")
    for q in ("none", "int8", "int4"):
        m = measure(q, args.kv_cache_memory)
        print(f"| {q} | {m['VmRSS']:.0f} | {m['VmHWM']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
