"""The HTTP server on a device, end to end: start `llmserve serve`, ask it over HTTP, stop it.

Builds the SmolLM2-135M-shaped random model of ``cuda_bench.py``, starts the server on it
(``--device``), waits for /health, then sends a completion, a streamed chat completion, 32
concurrent completions and a bad request, checks the replies (status, usage, [DONE], the
error envelope), reads /metrics, and stops the server with SIGTERM (exit code 0 expected).
Prints one line per check; exits 1 if any failed.

    python benchmarks/cuda_server_smoke.py --device cuda --tokenizer .gpu/tokenizer
    python benchmarks/cuda_server_smoke.py --device cpu          # the same anywhere
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_bench as cb


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="server-smoke-"))
    model, _ = cb.build_model_dir(work / "model", cb.SMOLLM2_135M, args.tokenizer)
    env = {**os.environ, "LLMSERVE_DATA_DIR": str(work / "data")}
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model), "--device",
           args.device, "--port", str(args.port), "--max-model-len", "2048",
           "--kv-cache-memory", "2", "--quantization", "none"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    base = f"http://127.0.0.1:{args.port}"
    failures = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    try:
        start = time.monotonic()
        while time.monotonic() - start < 300:
            if server.poll() is not None:
                break
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        check("ready", server.poll() is None, f"in {time.monotonic() - start:.1f} s")
        if failures:
            return 1
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        status, body = post(base + "/v1/completions", {
            "model": name, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0})
        reply = json.loads(body)
        check("completion", status == 200 and reply["usage"]["completion_tokens"] == 16,
              f"status {status}, usage {reply.get('usage')}")
        status, body = post(base + "/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True}})
        text = body.decode()
        check("chat stream", status == 200 and text.rstrip().endswith("data: [DONE]")
              and '"usage"' in text, f"status {status}, {text.count('data:')} events")

        def one(i: int) -> int:
            return post(base + "/v1/completions", {
                "model": name, "prompt": [17 + i, 18, 19], "max_tokens": 32, "temperature": 0,
                "ignore_eos": True})[0]

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(one, range(32)))
        check("32 concurrent", codes == [200] * 32,
              f"{sorted(set(codes))} in {time.monotonic() - t0:.2f} s")
        status, body = post(base + "/v1/completions", {"model": name, "prompt": "x",
                                                       "max_tokens": -1})
        check("bad request", status == 400 and "error" in json.loads(body), f"status {status}")
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        check("metrics", "vllm:generation_tokens_total" in metrics
              or "llmserve" in metrics, f"{len(metrics)} bytes")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = None
        log = server.stdout.read() if server.stdout else ""
        (work / "server.log").write_text(log)
        check("clean exit", code == 0, f"exit code {code}; log: {work / 'server.log'}")
        if failures:
            print(log[-3000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
