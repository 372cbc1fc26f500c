"""Benchmark tool pieces that need no server: workloads, SLOs, percentiles."""

from __future__ import annotations

import pytest

from llmserve.bench.client import RequestResult, _has_token
from llmserve.bench.metrics import meets_slo, parse_slo, percentile, summarize
from llmserve.bench.workloads import WorkloadSpec, build_workload


@pytest.mark.parametrize("name", ["random", "sharegpt", "shared-prefix", "long"])
def test_same_seed_same_requests(name):
    a = build_workload(WorkloadSpec(name, 20, seed=3))
    b = build_workload(WorkloadSpec(name, 20, seed=3))
    c = build_workload(WorkloadSpec(name, 20, seed=4))
    assert a == b and a != c


def test_workload_shapes(tmp_path):
    rnd = build_workload(WorkloadSpec("random", 10, input_len=50, output_len=7))
    assert all(r.prompt_words == 50 and len(r.prompt.split()) == 50 and r.max_tokens == 7
               for r in rnd)
    shared = build_workload(WorkloadSpec("shared-prefix", 4, input_len=5, prefix_len=30))
    prefixes = {r.prompt.split("\n\n")[0] for r in shared}
    assert len(prefixes) == 1
    long = build_workload(WorkloadSpec("long", 2))
    assert all(r.prompt_words >= 2048 for r in long)
    sg = build_workload(WorkloadSpec("sharegpt", 300))
    lens = sorted(r.prompt_words for r in sg)
    assert lens[150] < 300 < lens[-1]  # long-tailed: median well below the top
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b c", "max_tokens": 3}\n{"prompt": "d"}\n')
    js = build_workload(WorkloadSpec("jsonl", 3, output_len=9, jsonl_path=str(path)))
    assert [(r.prompt, r.max_tokens) for r in js] == [("a b c", 3), ("d", 9), ("a b c", 3)]
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1"):
        build_workload(WorkloadSpec("jsonl", 1, jsonl_path=str(path)))


def test_parse_slo():
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo("latency=5")


def test_percentile_matches_numpy_linear():
    import numpy as np

    data = sorted([0.3, 1.0, 2.5, 7.0, 7.5, 11.0, 0.01])
    for p in (0, 50, 90, 95, 99, 100):
        assert percentile(data, p) == pytest.approx(float(np.percentile(data, p)))


def _result(ttft, e2e, n, ok=True):
    return RequestResult(ok, 10, n, 0.0, ttft, e2e, [0.01] * (n - 1), n, 10,
                         None if ok else "429", None if ok else "queue full", ok)


def test_goodput_falls_as_slos_tighten():
    results = [_result(0.1 * i, 0.1 * i + 1.0, 11) for i in range(1, 11)]
    results.append(_result(None, None, 0, ok=False))
    loose = summarize(results, 10.0, parse_slo("ttft=10s"))
    mid = summarize(results, 10.0, parse_slo("ttft=500ms"))
    tight = summarize(results, 10.0, parse_slo("ttft=150ms"))
    none = summarize(results, 10.0, parse_slo("ttft=1ms"))
    assert loose["good_requests"] == 10 > mid["good_requests"] == 5 > tight["good_requests"] == 1
    assert none["goodput"] == 0.0
    assert loose["errors"] == {"429": 1}
    assert not meets_slo(results[-1], {})


def test_token_chunk_detection():
    assert _has_token({"choices": [{"text": "a", "finish_reason": None}]})
    assert _has_token({"choices": [{"text": "", "finish_reason": None}]})  # held-back text
    assert not _has_token({"choices": [{"text": "", "finish_reason": "stop"}]})
    assert not _has_token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert _has_token({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]})
    assert not _has_token({"choices": [], "usage": {"completion_tokens": 3}})
    # Reasoning and tool calls are generated tokens too (vLLM's benchmark times them).
    for delta in ({"reasoning_content": "hmm"}, {"reasoning": "hmm"},
                  {"role": "assistant", "tool_calls": [{"index": 0, "function": {}}]}):
        assert _has_token({"choices": [{"delta": delta, "finish_reason": None}]}), delta


def test_errors_are_explained_and_chunk_counts_flagged():
    from llmserve.bench.report import summary_table

    results = [_result(0.1, 1.0, 11), _result(None, None, 0, ok=False)]
    results[0].tokens_from_usage = False  # no usage came back: 11 chunks
    s = summarize(results, 10.0, {})
    assert s["error_details"] == {"429": "queue full"} and s["tokens_from_chunks"] == 1
    table = summary_table({"summary": s, "target": {"base_url": "http://x/v1"},
                           "arrivals_label": "c=1", "workload": "w"})
    assert "  429: queue full" in table
    assert "1 of 1 completed requests sent no usage" in table


# ---- bad input: one line naming the flag or file, exit 2, nothing written ------------------

def _bench_main(capsys, *args: str) -> tuple[int, str]:
    from llmserve.cli import main

    rc = main(["bench", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


_DOWN = "http://127.0.0.1:9"  # discard port: nothing listens
_SERVE = ("serve", "--base-url", _DOWN, "--request-rate", "inf", "--no-progress")


@pytest.mark.parametrize("args, message", [
    (("--num-prompts", "0"), "--num-prompts must be >= 1, got 0"),
    (("--input-len", "-5"), "--input-len must be >= 1, got -5"),
    (("--output-len", "0"), "--output-len must be >= 1, got 0"),
    (("--range-ratio", "2"), "--range-ratio must be in [0, 1)"),
    (("--range-ratio", "-0.1"), "--range-ratio must be in [0, 1)"),
    (("--prefix-len", "-1"), "--prefix-len must be >= 0, got -1"),
    (("--workload", "shared-prefix", "--num-prefixes", "0"), "--num-prefixes must be >= 1"),
    (("--duration", "-1"), "--duration must be > 0 seconds, got -1.0"),
    (("--timeout", "0"), "--timeout must be a number of seconds > 0, got 0.0"),
    (("--temperature", "-1"), "--temperature must be >= 0"),
    (("--warmup", "-3"), "--warmup must be >= 0, got -3"),
    (("--max-concurrency", "0"), "--max-concurrency must be >= 1, got 0"),
    (("--request-rate", "nan"), "--request-rate must be > 0 (or inf), got nan"),
    (("--burstiness", "inf"), "--burstiness must be > 0"),
    (("--workload", "jsonl", "--dataset", "/nope.jsonl"),
     "--dataset: cannot read /nope.jsonl: No such file or directory"),
    (("--output", "/nodir/x.json"), "--output: the directory /nodir of /nodir/x.json does "
                                    "not exist"),
])
def test_serve_rejects_bad_flags_before_sending_anything(capsys, tmp_path, monkeypatch, args,
                                                        message):
    monkeypatch.chdir(tmp_path)
    rc, err = _bench_main(capsys, *_SERVE, *args)
    assert rc == 2 and message in err, err
    assert "cannot reach" not in err  # refused before the server was tried
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_directory_or_unwritable_place_is_refused_first(capsys, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _bench_main(capsys, *_SERVE, "--output", str(tmp_path))
    assert rc == 2 and "is a directory" in err, err
    rc, err = _bench_main(capsys, "offline", "--output", str(tmp_path / "no" / "x.json"),
                          "--modes", "continuous")
    assert rc == 2 and "--output: the directory" in err and "does not exist" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-1"])
def test_offline_needs_a_request(capsys, value):
    rc, err = _bench_main(capsys, "offline", "--num-requests", value)
    assert rc == 2 and f"--num-requests must be >= 1, got {value}" in err, err


@pytest.mark.parametrize("url, message", [
    (_DOWN, "--base-url: cannot reach http://127.0.0.1:9/v1/models (ConnectError"),
    ("not-a-url", "--base-url must be an http:// or https:// URL"),
])
def test_unreachable_server_fails_in_one_line_writing_nothing(capsys, tmp_path, monkeypatch,
                                                             url, message):
    monkeypatch.chdir(tmp_path)
    rc, err = _bench_main(capsys, "serve", "--base-url", url, "--concurrency", "1",
                          "--no-progress")
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    rc, err = _bench_main(capsys, "sweep", "--base-url", url, "--concurrency", "1,2",
                          "--output-dir", "out", "--no-progress")
    assert rc == 2 and message in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (("--concurrency", "a,b"), "--concurrency: 'a' is not a number"),
    (("--concurrency", "1,,4"), "--concurrency: '' is not a number"),
    (("--request-rate", "1,x"), "--request-rate: 'x' is not a number"),
    (("--concurrency", "0"), "--concurrency must be >= 1, got 0"),
    (("--request-rate", "1,-2"), "--request-rate must be > 0 (or inf), got -2.0"),
    (("--concurrency", "1", "--warmup", "-1"), "--warmup must be >= 0"),
    (("--concurrency", "1", "--num-prompts", "0"), "--num-prompts must be >= 1"),
])
def test_sweep_validates_before_creating_its_directory(capsys, tmp_path, args, message):
    out = tmp_path / "sweep"
    rc, err = _bench_main(capsys, "sweep", "--base-url", _DOWN, "--output-dir", str(out),
                          "--no-progress", *args)
    assert rc == 2 and message in err, err
    assert not out.exists()


def test_compare_names_the_bad_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    for path, message in ((tmp_path / "nope.json", "cannot read {}: No such file"),
                          (text, "{}: not JSON (Expecting value"),
                          (other, "{}: not a benchmark result")):
        rc, err = _bench_main(capsys, "compare", str(path))
        assert rc == 2 and message.format(path) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "other.json"]


class _Stub:
    """An HTTP server answering every GET /v1/models with ``models`` (status, body) and
    every POST with ``post`` (status, body)."""

    def __init__(self, models: tuple[int, str], post: tuple[int, str] = (500, "boom")):
        import http.server
        import threading

        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.seen.append(("GET", self.path, self.headers.get("Authorization")))
                self._answer(*(models if self.path == "/v1/models" else (404, "")))

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.seen.append(("POST", self.path, self.headers.get("Authorization")))
                self._answer(*post)

            def log_message(self, *args):
                pass

        self.seen: list[tuple[str, str, str | None]] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("key, message", [
    (None, "answered 401: the server needs an API key: pass it with --api-key"),
    ("wrong", "answered 401: the key given with --api-key was refused"),
])
def test_a_server_wanting_a_key_is_named_before_the_run(capsys, tmp_path, monkeypatch, key,
                                                        message):
    monkeypatch.chdir(tmp_path)
    stub = _Stub((401, '{"error": "unauthorized"}'))
    try:
        rc, err = _bench_main(capsys, "serve", "--base-url", stub.url, "--concurrency", "1",
                              "--no-progress", *(("--api-key", key) if key else ()))
    finally:
        stub.close()
    assert rc == 2 and f"GET {stub.url}/v1/models {message}" in err, err
    assert [m for m, _, _ in stub.seen] == ["GET"]  # nothing sent after the probe
    assert stub.seen[0][2] == (f"Bearer {key}" if key else None)
    assert list(tmp_path.iterdir()) == []


def test_a_server_without_a_model_list_needs_model(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stub = _Stub((404, "not found"))
    try:
        rc, err = _bench_main(capsys, "serve", "--base-url", stub.url, "--concurrency", "1",
                              "--no-progress")
        assert rc == 2 and "answered 404" in err and "--model" in err, err
        assert list(tmp_path.iterdir()) == []
        # Named, the model is sent to (the server's answers then decide).
        rc, err = _bench_main(capsys, "serve", "--base-url", stub.url, "--model", "m",
                              "--concurrency", "1", "--num-prompts", "1", "--warmup", "0",
                              "--no-progress", "--output", "r.json")
        assert rc == 1 and "warning: GET" in err and "no request completed" in err, err
    finally:
        stub.close()
    assert ("POST", "/v1/completions", None) in stub.seen


def test_a_sweep_where_nothing_completes_fails(capsys, tmp_path):
    stub = _Stub((200, '{"object": "list", "data": [{"id": "m"}]}'), post=(500, "boom"))
    try:
        rc, err = _bench_main(capsys, "sweep", "--base-url", stub.url, "--concurrency", "1,2",
                              "--num-prompts", "2", "--warmup", "0", "--input-len", "3",
                              "--output-len", "2", "--output-dir", str(tmp_path / "s"),
                              "--no-progress")
    finally:
        stub.close()
    assert rc == 1 and "no request completed at any level" in err, err
