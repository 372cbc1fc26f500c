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
