"""`llmserve bench` against live tiny-model servers."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import API_KEY


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", *args],
                          capture_output=True, text=True, timeout=600)


def test_serve_reports_consistent_metrics(tiny_server, tmp_path):
    out = tmp_path / "run.json"
    proc = _bench("serve", "--base-url", tiny_server.url, "--api-key", API_KEY,
                  "--num-prompts", "12", "--concurrency", "4", "--input-len", "20",
                  "--output-len", "10", "--slo", "ttft=10s,tpot=1s", "--output", str(out),
                  "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["completed"] == s["requests"] == 12 and s["errors"] == {}
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert s[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert set(s[metric]) == {"mean", "p50", "p90", "p95", "p99"}
        assert all(v is not None for v in s[metric].values())
    assert s["output_tokens"] == 12 * 10  # usage, with ignore_eos holding the length
    for r in result["requests"]:
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) == r["output_tokens"] - 1 == 9
        assert 20 <= r["prompt_tokens"] <= 22  # about one token per word, as intended
        assert r["tpot"] > 0


def test_same_seed_sends_the_same_requests(tiny_server, tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        proc = _bench("serve", "--base-url", tiny_server.url, "--api-key", API_KEY,
                      "--workload", "sharegpt", "--num-prompts", "6", "--request-rate", "50",
                      "--seed", "11", "--output", str(out), "--no-progress", "--warmup", "0")
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(out.read_text()))
    shape = [[(r["prompt_tokens"], r["max_tokens"]) for r in sorted(
        run["requests"], key=lambda r: (r["prompt_tokens"], r["max_tokens"]))] for run in runs]
    assert shape[0] == shape[1]


def test_429s_are_counted_not_fatal(tiny_path, tmp_path):
    from tests.e2e.conftest import start_server

    server = start_server(tiny_path, tmp_path, "--max-num-seqs", "1", "--max-queued-requests",
                          "1", "--max-model-len", "1024", name="bench429")
    try:
        out = tmp_path / "burst.json"
        proc = _bench("serve", "--base-url", server.url, "--num-prompts", "10",
                      "--request-rate", "inf", "--input-len", "8", "--output-len", "20",
                      "--output", str(out), "--no-progress", "--warmup", "0")
        assert proc.returncode == 0, proc.stderr
        s = json.loads(out.read_text())["summary"]
        assert s["errors"].get("429", 0) >= 1
        assert s["completed"] >= 1
        assert s["completed"] + s["errors"]["429"] == 10
    finally:
        assert server.stop() == 0


def test_sweep_and_compare_write_json_and_plots(tiny_server, tmp_path):
    for label in ("a", "b"):
        proc = _bench("sweep", "--base-url", tiny_server.url, "--api-key", API_KEY,
                      "--concurrency", "1,2", "--num-prompts", "4", "--input-len", "10",
                      "--output-len", "5", "--label", label, "--output-dir",
                      str(tmp_path / label), "--no-progress", "--warmup", "1")
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / label / "c1.json").exists() and (tmp_path / label / "c2.json").exists()
        assert (tmp_path / label / "sweep.png").stat().st_size > 1000
    md, png = tmp_path / "cmp.md", tmp_path / "cmp.png"
    proc = _bench("compare", str(tmp_path / "a" / "sweep.json"), str(tmp_path / "b" / "sweep.json"),
                  "--output", str(md), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    table = md.read_text()
    assert "| load | metric | a | b |" in table and "| c=2 | TTFT p99 ms |" in table
    assert png.stat().st_size > 1000


def test_sweep_levels_share_no_prompt_and_start_from_a_reset_cache(tiny_server, tmp_path):
    from llmserve.bench.workloads import WorkloadSpec, build_workload

    out = tmp_path / "levels"
    proc = _bench("sweep", "--base-url", tiny_server.url, "--api-key", API_KEY,
                  "--concurrency", "1,2,4", "--num-prompts", "4", "--input-len", "40",
                  "--output-len", "3", "--output-dir", str(out), "--no-progress",
                  "--warmup", "1", "--seed", "5", "--reset-prefix-cache")
    assert proc.returncode == 0, proc.stderr
    points = json.loads((out / "sweep.json").read_text())["points"]
    seeds = [p["seed"] for p in points]
    assert len(set(seeds)) == 3 and seeds[0] == 5
    prompts = [{r.prompt for r in build_workload(WorkloadSpec("random", 4, 40, 3, seed=s))}
               for s in seeds]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    for p in points:
        assert p["prefix_cache"]["reset"] == "reset"
        assert p["prefix_cache"]["hits_during"] == 0  # nothing answered from the cache
    assert "warning" not in proc.stderr


def test_a_warm_cache_is_warned_about(tiny_server, tmp_path):
    import httpx

    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": tiny_server.model, "prompt": list(range(100, 164)), "max_tokens": 1}
    for _ in range(2):  # the second is a prefix-cache hit
        assert httpx.post(f"{tiny_server.v1}/completions", json=body, headers=auth,
                          timeout=30).status_code == 200
    proc = _bench("serve", "--base-url", tiny_server.url, "--api-key", API_KEY,
                  "--num-prompts", "2", "--concurrency", "1", "--input-len", "10",
                  "--output-len", "2", "--output", str(tmp_path / "w.json"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "prefix-cache hits before this run" in proc.stderr


def test_a_run_where_nothing_completes_says_why_and_fails(tiny_server, tmp_path):
    proc = _bench("serve", "--base-url", tiny_server.url, "--api-key", API_KEY,
                  "--model", "nosuch", "--num-prompts", "2", "--concurrency", "2",
                  "--input-len", "8", "--output-len", "4", "--output",
                  str(tmp_path / "r.json"), "--no-progress", "--warmup", "0")
    assert proc.returncode == 1, proc.stdout
    assert "4xx:" in proc.stdout and "nosuch" in proc.stdout  # the server's own message
    assert "no request completed" in proc.stderr and "Traceback" not in proc.stderr
    from tests.e2e.conftest import free_port

    down = f"http://127.0.0.1:{free_port()}"
    proc = _bench("serve", "--base-url", down, "--model", "m", "--num-prompts", "1",
                  "--concurrency", "1", "--reset-prefix-cache", "--output",
                  str(tmp_path / "d.json"), "--no-progress", "--warmup", "0")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    # The server is tried before the run: one line naming it, no result written.
    assert f"--base-url: cannot reach {down}/v1/models" in proc.stderr, proc.stderr
    assert not (tmp_path / "d.json").exists()


def test_the_server_is_tried_first_and_a_missing_key_named(tiny_server, tmp_path):
    out = tmp_path / "k.json"
    for key, says in (((), "the server needs an API key: pass it with --api-key"),
                      (("--api-key", "sk-wrong"), "the key given with --api-key was refused")):
        proc = _bench("serve", "--base-url", tiny_server.url, *key, "--num-prompts", "2",
                      "--concurrency", "1", "--output", str(out), "--no-progress")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"GET {tiny_server.v1}/models answered 401: {says}" in proc.stderr, proc.stderr
        assert not out.exists()
    # Against the same server, a sweep whose every request fails says so and fails.
    proc = _bench("sweep", "--base-url", tiny_server.url, "--api-key", API_KEY, "--model",
                  "nosuch", "--concurrency", "1,2", "--num-prompts", "2", "--input-len", "4",
                  "--output-len", "2", "--output-dir", str(tmp_path / "s"), "--no-progress",
                  "--warmup", "0")
    assert proc.returncode == 1, proc.stderr
    assert "no request completed at any level" in proc.stderr, proc.stderr
