"""Keys, limits and usage through a live server: what `llmserve keys` creates is what the
server accepts; limits answer 429 with Retry-After; usage adds up to the responses' usage;
revocation takes effect while the server runs; the database survives a restart."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server

SHARED = "sk-shared-operator-key"


def cli(data_dir, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", *args, "--data-dir",
                          str(data_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def usage_json(data_dir, key: str | None = None) -> dict:
    return json.loads(cli(data_dir, "usage", "--json", *(["--key", key] if key else [])))


def wait_for(predicate, timeout: float = 20.0):
    """Poll until ``predicate`` is truthy (each poll runs the CLI, seconds on a loaded
    machine; the usage writer flushes once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("usage-data")


@pytest.fixture(scope="module")
def keys(data_dir) -> dict[str, str]:
    return {
        "acct": cli(data_dir, "keys", "create", "--name", "acct").strip(),
        # Used by one test only: no earlier request can still be on its way to the database.
        "summed": cli(data_dir, "keys", "create", "--name", "summed").strip(),
        "tiny-budget": cli(data_dir, "keys", "create", "--name", "tiny-budget",
                           "--tokens-per-minute", "100").strip(),
        "burst": cli(data_dir, "keys", "create", "--name", "burst",
                     "--tokens-per-minute", "100").strip(),
        "two-rpm": cli(data_dir, "keys", "create", "--name", "two-rpm",
                       "--requests-per-minute", "2").strip(),
        "doomed": cli(data_dir, "keys", "create", "--name", "doomed").strip(),
    }


@pytest.fixture(scope="module")
def server(tiny_path, keys, data_dir, tmp_path_factory):
    srv = start_server(tiny_path, tmp_path_factory.mktemp("usage-srv"), "--data-dir",
                       str(data_dir), "--api-key", SHARED, "--request-log", "full",
                       "--max-model-len", "512")
    yield srv
    srv.stop()


def post(server, key: str | None, path: str = "/v1/completions", **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": server.model, "prompt": "Hello there", "max_tokens": 8,
            "temperature": 0, **body}
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_database_keys_and_the_shared_key_are_accepted(server, keys):
    assert post(server, keys["acct"]).status_code == 200
    assert post(server, SHARED).status_code == 200
    for bad in (None, "sk-llmserve-not-a-key", keys["acct"] + "x"):
        r = post(server, bad)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    # The probes, the scraper and the console's page stay open.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_a_key_over_its_token_budget_gets_429_and_others_are_unaffected(server, keys):
    """Each request reserves prompt + max_tokens of its key's tokens per minute (as OpenAI
    counts); what it did not use comes back when it ends."""
    first = post(server, keys["tiny-budget"], max_tokens=40)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    prompt = first.json()["usage"]["prompt_tokens"]
    # What is left after this request (it ran to its end: its reservation settled), not
    # what was left when it arrived (which said 100); refilled at 100 a minute meanwhile.
    left = int(first.headers["x-ratelimit-remaining-tokens"])
    assert left <= 100 - first.json()["usage"]["total_tokens"] + 5, left
    ok = post(server, keys["tiny-budget"], max_tokens=40, ignore_eos=True)  # uses it all
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
    # Left: about 100 - (used by the first) - (prompt + 40); the next needs prompt + 90.
    refused = post(server, keys["tiny-budget"], max_tokens=90)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert f"up to {prompt + 90} tokens" in error["message"]
    wait = int(refused.headers["Retry-After"])
    assert 1 <= wait <= 61
    assert refused.headers["x-ratelimit-limit-tokens"] == "100"
    # A request that can never fit says so, with no Retry-After to wait on.
    never = post(server, keys["tiny-budget"], max_tokens=200)
    assert never.status_code == 429 and "Retry-After" not in never.headers
    assert "lower max_tokens" in never.json()["error"]["message"]
    assert post(server, keys["acct"]).status_code == 200  # another key: unaffected
    assert post(server, SHARED).status_code == 200
    m = server.metrics()
    rejected = f'llmserve:request_rejected_total{{model_name="{server.model}",reason="rate_limit"}}'
    assert m[rejected] >= 1


def test_concurrent_requests_cannot_overrun_a_token_budget(server, keys):
    """Eight requests at once, each able to use ~43 tokens, against 100 tokens a minute:
    two run, the others are told to wait; the key never uses more than its budget."""
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: post(server, keys["burst"], max_tokens=40,
                                               ignore_eos=True), range(8)))
    codes = sorted(r.status_code for r in replies)
    assert codes == [200, 200] + [429] * 6, codes
    used = sum(r.json()["usage"]["total_tokens"] for r in replies if r.status_code == 200)
    assert used <= 100


def test_requests_per_minute(server, keys):
    codes = [post(server, keys["two-rpm"]).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = post(server, keys["two-rpm"])
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    assert 1 <= int(r.headers["Retry-After"]) <= 30
    # Limits apply to generation only: the key still reads models and tokenizes.
    headers = {"Authorization": f"Bearer {keys['two-rpm']}"}
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200


def test_usage_totals_equal_the_sum_of_the_responses_usage(server, keys, data_dir):
    key = keys["summed"]
    sums = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def add(usage: dict) -> None:
        sums["requests"] += 1
        sums["prompt_tokens"] += usage["prompt_tokens"]
        sums["completion_tokens"] += usage["completion_tokens"]

    add(post(server, key, max_tokens=5).json()["usage"])
    add(post(server, key, prompt="One two three four", max_tokens=12).json()["usage"])
    add(post(server, key, "/v1/chat/completions", prompt=None,
             messages=[{"role": "user", "content": "Hi!"}], max_tokens=7).json()["usage"])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": server.model, "max_tokens": 9, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "Stream it"}]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    add(chunks[-1]["usage"])

    def grown() -> dict | None:
        now = usage_json(data_dir, "summed")["totals"]
        delta = {k: now.get(k, 0) for k in sums}
        return delta if delta == sums else None

    assert wait_for(grown) == sums
    rows = usage_json(data_dir, "summed")["rows"]
    assert {r["model"] for r in rows} == {server.model}
    assert {r["key_name"] for r in rows} == {"summed"}


def test_request_logs_keep_prompts_when_full(server, keys, data_dir):
    post(server, keys["acct"], prompt="a very particular prompt", max_tokens=3)

    def logged() -> list:
        with sqlite3.connect(data_dir / "llmserve.db") as conn:
            return conn.execute("SELECT prompt, output, completion_tokens, endpoint FROM "
                                "request_logs WHERE prompt = 'a very particular prompt'"
                                ).fetchall()

    rows = wait_for(logged)
    assert len(rows) == 1 and rows[0][2] == 3 and rows[0][3] == "/v1/completions"


def test_responses_by_status_and_step_sizes_are_metrics(server, keys):
    """What the console's dashboard plots: responses by status, and each step's batch."""
    post(server, keys["acct"], max_tokens=6)
    post(server, "wrong-key")
    m = server.metrics()
    label = f'model_name="{server.model}"'
    assert m[f'llmserve:http_responses_total{{{label},status="200"}}'] >= 1
    assert m[f'llmserve:http_responses_total{{{label},status="401"}}'] >= 1
    assert m[f'llmserve:http_responses_total{{{label},status="429"}}'] >= 1  # tests above
    steps = m["llmserve:iteration_batch_size_count"]
    assert steps >= 6  # at least one step per generated token
    assert m["llmserve:iteration_tokens_total_count"] == steps
    assert m["llmserve:iteration_batch_size_sum"] >= steps  # at least one sequence a step
    assert m["llmserve:iteration_tokens_total_sum"] >= m["llmserve:iteration_batch_size_sum"]


def test_revoked_keys_are_refused_without_a_restart(server, keys, data_dir):
    assert post(server, keys["doomed"]).status_code == 200
    cli(data_dir, "keys", "revoke", "doomed")
    assert wait_for(lambda: post(server, keys["doomed"]).status_code == 401)
    new = cli(data_dir, "keys", "create", "--name", "late").strip()
    assert wait_for(lambda: post(server, new).status_code == 200)


def test_revoking_the_last_key_locks_the_server(tiny_path, tmp_path):
    """A server that requires keys keeps requiring one when its last key is revoked
    (it used to open to everyone), and one started on a database of revoked keys only
    requires one too."""
    data = tmp_path / "data"
    only = cli(data, "keys", "create", "--name", "only").strip()
    srv = start_server(tiny_path, tmp_path, "--data-dir", str(data), "--max-model-len", "256",
                       name="locked")
    try:
        assert post(srv, None).status_code == 401 and post(srv, only).status_code == 200
        cli(data, "keys", "revoke", "only")
        assert wait_for(lambda: post(srv, only).status_code == 401)
        time.sleep(2 * 2.0)  # two more reads of the keys
        assert post(srv, None).status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        assert srv.stop() == 0
    assert "none active; every request is refused" in Path(srv.log_path).read_text()
    again = start_server(tiny_path, tmp_path, "--data-dir", str(data), "--max-model-len",
                         "256", name="again")
    try:
        assert post(again, None).status_code == 401
    finally:
        again.stop()


def test_the_database_survives_a_restart_and_nothing_is_lost_at_shutdown(
        server, keys, data_dir, tiny_path, tmp_path):
    sent = [post(server, keys["acct"], max_tokens=4).json()["usage"] for _ in range(3)]
    assert server.stop() == 0  # right away: the writer's last batch is written at shutdown
    totals = usage_json(data_dir, "acct")["totals"]
    again = start_server(tiny_path, tmp_path, "--data-dir", str(data_dir))
    try:
        assert post(again, None).status_code == 401  # the database holds keys: required
        assert post(again, keys["acct"]).status_code == 200
        assert post(again, keys["doomed"]).status_code == 401
    finally:
        again.stop()
    after = usage_json(data_dir, "acct")["totals"]
    assert after["requests"] == totals["requests"] + 1
    assert totals["requests"] >= len(sent)
    logs = Path(again.log_path).read_text() + Path(server.log_path).read_text()
    for key in keys.values():
        assert key not in logs


def test_a_server_on_postgresql(postgres, tiny_path, tmp_path):
    """`--database-url` for servers that share a database: keys made by the CLI on one
    PostgreSQL database are required by a server on it, and its usage lands there."""
    url = postgres.new_database("server")

    def pg_cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "llmserve.cli", *args, "--database-url",
                              url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    key = pg_cli("keys", "create", "--name", "shared-db", "--tokens-per-minute", "100000").strip()
    srv = start_server(tiny_path, tmp_path, "--database-url", url)
    try:
        assert post(srv, None).status_code == 401
        sent = [post(srv, key, max_tokens=n).json()["usage"] for n in (3, 5)]
    finally:
        assert srv.stop() == 0
    totals = json.loads(pg_cli("usage", "--json", "--key", "shared-db"))["totals"]
    assert totals["requests"] == 2
    assert totals["prompt_tokens"] == sum(u["prompt_tokens"] for u in sent)
    assert totals["completion_tokens"] == sum(u["completion_tokens"] for u in sent) == 8
    assert url.split("@")[1] in Path(srv.log_path).read_text()  # the log says where usage goes


def test_requests_that_end_early_are_billed_what_ran(tmp_path):
    """A request its client gives up on is billed what the engine did for it, streaming or
    not: its prompt and the tokens generated if it ran, nothing if it never left the queue
    (both used to be billed the whole prompt, and a non-streaming one no tokens)."""
    data = tmp_path / "data"
    key = cli(data, "keys", "create", "--name", "early").strip()
    srv = start_server("smollm2-135m-instruct", tmp_path, "--data-dir", str(data),
                       "--request-log", "full", "--max-num-seqs", "1")
    long = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    def given_up(prompt: str, seconds: float, stream: bool = False) -> None:
        body = {"model": srv.model, "prompt": prompt, "stream": stream, **long}
        auth = {"Authorization": f"Bearer {key}"}
        with pytest.raises(httpx.TimeoutException):  # no byte for that long: gone
            if not stream:
                httpx.post(f"{srv.v1}/completions", json=body, timeout=seconds, headers=auth)
            with httpx.stream("POST", f"{srv.v1}/completions", json=body, timeout=seconds,
                              headers=auth) as r:
                for _ in r.iter_lines():
                    pass

    try:
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(given_up, "the one that runs", 3.0)
            time.sleep(1.0)  # it holds the only sequence slot; these two wait behind it
            queued = [pool.submit(given_up, "queued, not streamed", 0.8),
                      pool.submit(given_up, "queued, streamed", 0.8, True)]
            for f in [running, *queued]:
                f.result()

        def logged() -> dict | None:
            with sqlite3.connect(data / "llmserve.db") as conn:
                rows = conn.execute("SELECT prompt, prompt_tokens, completion_tokens, "
                                    "finish_reason FROM request_logs").fetchall()
            return {r[0]: r[1:] for r in rows} if len(rows) == 3 else None

        rows = wait_for(logged)
        assert rows is not None
        assert rows["queued, not streamed"] == (0, 0, "abort")
        assert rows["queued, streamed"] == (0, 0, "abort")
        prompt_tokens, completion_tokens, ending = rows["the one that runs"]
        assert prompt_tokens > 0 and 0 < completion_tokens < 1000 and ending == "abort"
    finally:
        assert srv.stop() == 0
