"""Start-up to ready: `llmserve serve` beside llama.cpp's llama-server, same GGUF file.

Each server is started --runs times, alternating, and timed from the spawn to its first 200
(llmserve's /ready: model loaded and warmed up; llama-server's /health, which answers 503
while it loads), then stopped. llmserve's own log line with its phases (imports, model load,
KV cache, warm-up) is printed for the last run. The compiled kernels are assumed cached
(a first start compiles them: --cold measures one such start in an empty cache first).

    .venv/bin/python benchmarks/startup.py [--runs 5] [--llama-server PATH] [--cold]
        [--baseline-src DIR] [-- extra llmserve serve options]

--baseline-src starts a third server from another checkout's src/ (an earlier commit:
`git worktree add /tmp/base <commit>`, then --baseline-src /tmp/base/src), alternating with
the others: a before/after in one run.

llama-server: --llama-server, else $LLAMA_SERVER, else benchmarks/build_llama_server.sh's
binary if it was built (the script builds it; it is skipped otherwise).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmserve.models.loader import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(cmd: list[str], url: str, env: dict[str, str] | None = None,
                  timeout: float = 600) -> tuple[float, str]:
    """Seconds from spawning ``cmd`` to the first 200 from ``url``; and the process output."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"{cmd[0]} exited with {proc.returncode}:\n"
                                     f"{log.read()[-2000:]}")
                try:
                    if httpx.get(url, timeout=1).status_code == 200:
                        ready = time.perf_counter() - t0
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout:
                    raise SystemExit(f"{cmd[0]} not ready after {timeout} s")
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.seek(0)
        return ready, log.read()


def find_llama_server(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("LLAMA_SERVER"),
                      str(Path.home() / ".cache/llmserve/llama.cpp/build/bin/llama-server")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--baseline-src", default=None,
                    help="also start llmserve from this source tree (PYTHONPATH)")
    ap.add_argument("--cold", action="store_true",
                    help="first, one llmserve start with an empty kernel cache (a compile)")
    ap.add_argument("server_args", nargs="*", help="extra `llmserve serve` options (after --)")
    args = ap.parse_args()
    gguf = str(resolve_model_path(args.model))
    llama = find_llama_server(args.llama_server)
    port = free_port()
    ours = [sys.executable, "-m", "llmserve.cli", "serve", "--model", args.model,
            "--port", str(port), *args.server_args]
    theirs = [llama, "-m", gguf, "--port", str(port), "-t", "2"] if llama else None

    if args.cold:
        cache = tempfile.mkdtemp(prefix="llmserve-cold-")
        try:
            cold, _ = time_to_ready(ours, f"http://127.0.0.1:{port}/ready",
                                    {**os.environ, "LLMSERVE_CACHE_DIR": cache})
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"llmserve, empty kernel cache (compiles the kernels): {cold:.1f} s")

    times: dict[str, list[float]] = {"llmserve": [], "llmserve (baseline)": [],
                                     "llama-server": []}
    phases = ""
    for _ in range(args.runs):
        t, log = time_to_ready(ours, f"http://127.0.0.1:{port}/ready")
        times["llmserve"].append(t)
        phases = next((m.group(0) for m in re.finditer(r"ready [^\n]*", log)), phases)
        if args.baseline_src:
            env = {**os.environ, "PYTHONPATH": args.baseline_src}
            t, _ = time_to_ready(ours, f"http://127.0.0.1:{port}/ready", env)
            times["llmserve (baseline)"].append(t)
        if theirs:
            t, _ = time_to_ready(theirs, f"http://127.0.0.1:{port}/health")
            times["llama-server"].append(t)
    print(f"# {Path(gguf).name}, {os.cpu_count()} CPUs, {args.runs} alternating starts, "
          f"options: {' '.join(args.server_args) or '(defaults)'}")
    print("| server | median s | min s | max s |\n|---|---|---|---|")
    for name, xs in times.items():
        if xs:
            print(f"| {name} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    if not theirs:
        print("(llama-server not found: benchmarks/build_llama_server.sh builds it)")
    print(f"llmserve's own account of its last start: {phases}")


if __name__ == "__main__":
    main()
