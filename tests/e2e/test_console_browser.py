"""The web console in a real browser: Playwright driving Debian's chromium (`make system-deps`
installs it) against a live server. Sign-in with a key (kept out of URLs and logs), a
streamed chat answer with its TTFT and tokens/s, Stop (the server aborts the request),
Copy and Regenerate, the dashboard's plots moving while requests run, the model card,
keyboard use and a phone-width layout. Screenshots go to test-artifacts/console/."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import API_KEY, LiveServer, start_server

playwright_sync = pytest.importorskip("playwright.sync_api")

CHROMIUM = os.environ.get("LLMSERVE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("LLMSERVE_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))
# As the machine's own probe starts it: headless, no sandbox (root), and nothing that
# reaches for Google's hosts on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found: `make system-deps` installs Debian's chromium "
                    "(or set LLMSERVE_CHROMIUM to a Chromium binary)")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def keyed_server(tiny_path, tmp_path_factory) -> LiveServer:
    """The shared --api-key, a price per hour, and room for long answers (for Stop)."""
    srv = start_server(tiny_path, tmp_path_factory.mktemp("console-srv"), "--api-key", API_KEY,
                       "--cost-per-hour", "2.5", "--max-model-len", "1024", "--no-database")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def long_answer_server(tmp_path_factory) -> LiveServer:
    """keyed_server's options on the default model, for the tests that act while an answer
    streams (Stop, New chat): the tiny model writes 900 tokens in well under a second on a
    2-core host, which a click after the first token does not always beat; the default
    model takes seconds."""
    srv = start_server("smollm2-135m-instruct", tmp_path_factory.mktemp("console-long"),
                       "--api-key", API_KEY, "--cost-per-hour", "2.5", "--max-model-len", "1024",
                       "--no-database", name="console-long")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(tiny_path, tmp_path_factory) -> LiveServer:
    srv = start_server(tiny_path, tmp_path_factory.mktemp("console-open"), "--no-database",
                       "--max-model-len", "512")
    yield srv
    srv.stop()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.set_default_timeout(20_000)
    pg.js_errors = errors
    pg.expected_errors = ["Failed to load resource: the server responded with a status of 4"]
    yield pg
    context.close()
    # The 401 and 400 answers the tests provoke show up as failed loads (and what a test
    # adds to expected_errors); anything else is a bug in the page.
    unexpected = [e for e in errors if not e.startswith(tuple(pg.expected_errors))]
    assert not unexpected, f"errors in the page: {unexpected}"


def shot(page, name: str) -> None:
    (ARTIFACTS / "console").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console" / f"{name}.png"), full_page=True)


def sign_in(page, server: LiveServer) -> None:
    page.goto(server.url)
    page.get_by_label("API key").fill(API_KEY)
    page.get_by_role("button", name="Sign in").click()
    page.locator("#panel-chat").wait_for(state="visible")


def set_max_tokens(page, n: int) -> None:
    if page.locator("#chat-settings").get_attribute("open") is None:
        page.locator("#chat-settings summary").click()
    page.get_by_label("Max tokens").fill(str(n))


def watch_answer(page) -> None:
    """Record the length of the answer's text at every change, to see it stream."""
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .text');
            const last = answers[answers.length - 1];
            if (last) window.__lengths.push(last.textContent.length);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});
    }""")


def send(page, text: str) -> None:
    page.get_by_label("Message").fill(text)
    page.get_by_role("button", name="Send").click()


def last_answer(page):
    return page.locator(".message.assistant").last


def wait_answered(page) -> None:
    page.wait_for_function(
        "() => { const a = document.querySelectorAll('.message.assistant');"
        " return a.length && !a[a.length - 1].hasAttribute('aria-busy'); }")


def test_the_console_asks_for_a_key_and_keeps_it_out_of_urls_and_logs(page, keyed_server):
    page.goto(keyed_server.url)
    page.get_by_role("heading", name="Sign in").wait_for()
    assert page.locator("#panel-chat").is_hidden()
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("That key was not accepted").wait_for()
    shot(page, "sign-in-refused")
    page.get_by_label("API key").fill(API_KEY)
    page.get_by_label("API key").press("Enter")
    page.locator("#panel-chat").wait_for(state="visible")
    assert page.locator("#model-name").inner_text() == keyed_server.model
    # The key: in this tab's sessionStorage and the Authorization header only.
    assert API_KEY not in page.url
    assert page.evaluate("() => sessionStorage.getItem('llmserve.apiKey')") == API_KEY
    assert page.evaluate("() => localStorage.length") == 0
    urls: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    set_max_tokens(page, 8)
    send(page, "Hello")
    wait_answered(page)
    assert urls and not any(API_KEY in u for u in urls)
    assert API_KEY not in Path(keyed_server.log_path).read_text()
    # Signing out forgets the key.
    page.get_by_role("button", name="Sign out").click()
    page.get_by_role("heading", name="Sign in").wait_for()
    assert page.evaluate("() => sessionStorage.getItem('llmserve.apiKey')") is None


def test_a_chat_answer_streams_in_with_its_ttft_and_tokens_per_second(
        page, long_answer_server):
    # The default model, and an answer long enough that the stream outlasts the browser's
    # reads: the tiny model's 400 tokens once came in one read on a busy host (a full CI
    # run on 2 cores), as its 96 had before.
    sign_in(page, long_answer_server)
    set_max_tokens(page, 400)
    page.get_by_label("System prompt").fill("You are terse.")
    page.get_by_label("Temperature").fill("0")
    watch_answer(page)
    send(page, "Tell me about paged attention.")
    wait_answered(page)
    answer = last_answer(page)
    text = answer.locator(".text").inner_text()
    assert text
    lengths = page.evaluate("() => window.__lengths")
    growing = sorted({n for n in lengths if n > 0})
    # At least one partial answer shown before the whole one. How many depends on how the
    # browser's reads split the stream: the tiny model makes a token in about a millisecond,
    # and a busy machine (the full suite on 2 cores) delivers most of it in one read.
    assert len(growing) >= 2, f"the answer arrived in one piece, not streamed: {lengths}"
    stats = answer.locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms · [\d.,]+ tokens/s · \d+ tokens", stats), stats
    assert page.locator(".message.user").last.inner_text().endswith(
        "Tell me about paged attention.")
    shot(page, "chat")

    # Regenerate asks again with the same conversation: greedy, so the same answer.
    answer.get_by_role("button", name="Regenerate").click()
    wait_answered(page)
    assert page.locator(".message.assistant").count() == 1
    assert last_answer(page).locator(".text").inner_text() == text
    # Copy puts the answer on the clipboard.
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    last_answer(page).get_by_role("button", name="Copy").click()
    assert page.evaluate("() => navigator.clipboard.readText()") == text
    # A second turn carries the first: the server sees the whole conversation.
    send(page, "And again?")
    wait_answered(page)
    assert page.locator(".message.assistant").count() == 2


def test_stop_ends_the_answer_and_the_server_frees_the_request(page, long_answer_server):
    server = long_answer_server
    sign_in(page, server)
    set_max_tokens(page, 900)
    page.get_by_label("Temperature").fill("1")
    aborted_before = server.metrics().get("llmserve:request_aborted_total", 0)
    send(page, "Write a very long story.")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .text').textContent.length > 0")
    page.get_by_role("button", name="Stop").click()
    wait_answered(page)
    stats = last_answer(page).locator(".stats").inner_text()
    assert "stopped" in stats, stats
    m = server.wait_idle()
    assert m["llmserve:request_aborted_total"] == aborted_before + 1
    assert m["llmserve:kv_cache_usage_perc"] == 0
    assert page.get_by_role("button", name="Send").is_enabled()


def test_an_error_from_the_server_is_shown_in_the_answer(page, keyed_server):
    sign_in(page, keyed_server)
    set_max_tokens(page, 5000)  # past the context window: the server says 400
    send(page, "Hello")
    wait_answered(page)
    error = last_answer(page).get_by_role("alert")
    assert "max_tokens" in error.inner_text() or "context" in error.inner_text()
    # Nothing came back: the question returns to the composer, not into the history (the
    # next message must not follow an unanswered one).
    assert page.get_by_label("Message").input_value() == "Hello"
    assert page.locator(".message.user").count() == 0
    set_max_tokens(page, 4)
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") else None)
    page.get_by_role("button", name="Send").click()
    wait_answered(page)
    assert [m["role"] for m in bodies[-1]["messages"]] == ["user"]


def test_new_chat_during_an_answer_starts_clean(page, long_answer_server):
    sign_in(page, long_answer_server)
    set_max_tokens(page, 900)
    page.get_by_label("Temperature").fill("1")
    send(page, "A long story, please.")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .text').textContent.length > 0")
    page.get_by_role("button", name="New chat").click()
    page.get_by_role("button", name="Send").wait_for(state="visible")
    page.wait_for_function("() => !document.getElementById('send').disabled")
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") else None)
    set_max_tokens(page, 4)
    send(page, "Fresh start")
    wait_answered(page)
    assert [m["content"] for m in bodies[-1]["messages"]] == ["Fresh start"]
    assert page.locator(".message").count() == 2


@pytest.mark.parametrize("ending, complete", [("data: [DONE]\r\n\r\n", True), ("", False)])
def test_streams_with_crlf_lines_and_streams_cut_short(page, open_server, ending, complete):
    """Server-sent events may end lines with CRLF (a proxy's choice); a stream that closes
    without [DONE] is a cut answer, said as such."""
    page.goto(open_server.url)
    page.locator("#panel-chat").wait_for(state="visible")

    def chunk(text: str) -> str:
        return ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                   "finish_reason": None}]}) + "\r\n\r\n")

    body = chunk("Hello") + chunk(", world") + ending
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    send(page, "Hi")
    wait_answered(page)
    assert last_answer(page).locator(".text").inner_text() == "Hello, world"
    alerts = last_answer(page).get_by_role("alert")
    stats = last_answer(page).locator(".stats").inner_text()
    if complete:
        assert alerts.count() == 0
    else:  # no usage came: the pieces are counted, a lower bound, and said so
        assert "closed before the answer was complete" in alerts.inner_text()
        assert "≥ 2 tokens" in stats, stats


def test_a_long_answer_ends_above_the_composer(page, open_server):
    """The composer stays pinned to the window's bottom: a long answer scrolls so that its
    end, its figures and its buttons show above it, not under it."""
    page.goto(open_server.url)
    page.locator("#panel-chat").wait_for(state="visible")
    lines = [f"Line {i} of a long answer." for i in range(120)]
    body = "".join("data: " + json.dumps({"choices": [{"index": 0, "delta": {
        "content": line + "\n"}, "finish_reason": None}]}) + "\n\n" for line in lines)
    body += "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    send(page, "A long one")
    wait_answered(page)
    covered = page.evaluate("""() => {
        const composer = document.getElementById('composer').getBoundingClientRect();
        const answer = [...document.querySelectorAll('.message.assistant')].pop();
        const out = [];
        for (const el of [answer.querySelector('.stats'), answer.querySelector('.regenerate')]) {
            const r = el.getBoundingClientRect();
            if (r.bottom > composer.top || r.bottom > window.innerHeight) out.push(el.className);
        }
        return out;
    }""")
    assert covered == []
    shot(page, "long-answer")


def test_the_dashboard_says_when_the_server_stops_answering(page, open_server):
    page.goto(open_server.url)
    page.get_by_role("tab", name="Dashboard").click()
    page.locator('[data-chart="tokens"]').wait_for()
    page.wait_for_function("() => !document.querySelector('#tiles').classList.contains('stale')")
    page.expected_errors.append("Failed to load resource: net::ERR_FAILED")
    page.route("**/metrics", lambda route: route.abort())  # the server went away
    outage = page.locator("#dash-outage")
    outage.wait_for(state="visible")
    assert "No metrics since" in outage.inner_text()
    assert "could not be reached" in outage.inner_text()
    assert "stale" in page.locator("#tiles").get_attribute("class")
    shot(page, "dashboard-outage")
    page.unroute("**/metrics")  # back
    outage.wait_for(state="hidden")
    assert "stale" not in page.locator("#tiles").get_attribute("class")


def test_a_server_that_cannot_answer_yet_is_not_a_sign_in(page, open_server):
    """A 503 (draining, starting) on the first load: a notice, retried; no key form."""
    served: list[int] = []

    def once(route) -> None:
        if served:
            route.continue_()
            return
        served.append(503)
        route.fulfill(status=503, headers={"Retry-After": "5",
                                           "Content-Type": "application/json"},
                      body=json.dumps({"error": {"message": "the server is draining",
                                                 "type": "service_unavailable"}}))

    page.expected_errors.append("Failed to load resource: the server responded with a "
                                "status of 503")
    page.route("**/console/api/info", once)
    page.goto(open_server.url)
    notice = page.locator("#unavailable")
    notice.wait_for(state="visible")
    assert "the server is draining" in notice.inner_text()
    assert page.locator("#signin").is_hidden() and page.locator(".tabs").is_hidden()
    page.locator("#panel-chat").wait_for(state="visible", timeout=10_000)  # the retry
    assert notice.is_hidden()


def test_a_key_with_a_character_no_header_can_carry_is_refused_in_words(page, keyed_server):
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "console/api/info" in r.url else None)
    page.goto(keyed_server.url)
    page.get_by_label("API key").wait_for()
    before = len(sent)
    page.get_by_label("API key").fill(API_KEY + "\u200b")  # pasted with a zero-width space
    page.get_by_role("button", name="Sign in").click()
    error = page.locator("#signin-error")
    page.wait_for_function("() => document.getElementById('signin-error').textContent")
    assert "U+200B" in error.inner_text()
    assert len(sent) == before  # nothing sent, no retry loop
    sign_in(page, keyed_server)  # the right key still works


def test_console_urls_and_files_a_browser_fetches(keyed_server):
    r = httpx.get(f"{keyed_server.url}/console/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/console")
    js = httpx.get(f"{keyed_server.url}/console/static/console.js")
    assert js.status_code == 200 and js.headers["cache-control"] == "no-cache"
    assert js.headers["x-content-type-options"] == "nosniff"


def test_the_page_allows_only_its_own_scripts(keyed_server):
    r = httpx.get(keyed_server.url)
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"


def test_the_dashboard_plots_move_while_requests_run(page, keyed_server):
    sign_in(page, keyed_server)
    page.get_by_role("tab", name="Dashboard").click()
    page.locator('[data-chart="tokens"]').wait_for()
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
            while not stop.is_set():
                c.post(f"{keyed_server.url}/v1/completions",
                       json={"prompt": "The dashboard", "max_tokens": 64})
                c.post(f"{keyed_server.url}/v1/completions",  # an error, by status
                       json={"prompt": "x", "max_tokens": -1})

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        def points(chart: str) -> int:
            return int(page.locator(f'[data-chart="{chart}"]').get_attribute("data-points")
                       or 0)

        page.wait_for_function(
            "() => parseFloat(document.querySelector('[data-metric=output-tps] .tile-value')"
            ".textContent.replace(/,/g, '')) > 0")
        first = points("tokens")
        page.wait_for_function(
            f"() => +document.querySelector('[data-chart=tokens]').dataset.points > {first + 2}")
        for chart in ("ttft", "itl", "batch", "cost"):
            page.wait_for_function(
                f"() => +document.querySelector('[data-chart={chart}]').dataset.points > 0")
        page.locator('[data-chart="errors"] .u-legend').get_by_text("400").wait_for()
        assert page.locator("[data-metric=cost] .tile-value").inner_text().startswith("$")
        shot(page, "dashboard")
    finally:
        stop.set()
        for w in workers:
            w.join()
    # Every chart is drawn and titled.
    titles = page.locator(".chart .u-title").all_inner_texts()
    for title in ("Tokens per second", "Time to first token (ms)", "Inter-token latency (ms)",
                  "Requests", "KV cache usage and prefix-cache hit rate (%)",
                  "Sequences in each engine step", "Error responses per second, by status",
                  "Cost per 1K output tokens ($)"):
        assert title in titles


def test_the_model_card(page, keyed_server):
    sign_in(page, keyed_server)
    page.get_by_role("tab", name="Model").click()
    card = page.locator("#card")
    card.wait_for()
    rows = dict(zip(card.locator("dt").all_inner_texts(), card.locator("dd").all_inner_texts(),
                    strict=True))
    info = httpx.get(f"{keyed_server.url}/console/api/info",
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert rows["Model"] == keyed_server.model
    assert rows["Architecture"] == info["architecture"]
    assert rows["Context window"] == "1,024 tokens"
    assert rows["Weight format"] == info["weight_format"]
    assert rows["KV capacity"] == (f"{info['kv_capacity_tokens']:,} tokens, all sequences "
                                   "together")
    assert float(rows["Full-context sequences that fit"].replace(",", "")) == pytest.approx(
        info["kv_capacity_tokens"] / 1024, abs=0.06)
    assert rows["Cost per hour"] == "$2.5"
    assert rows["API key required"] == "yes"
    shot(page, "model-card")


def test_an_open_server_needs_no_sign_in_and_the_keyboard_reaches_everything(page,
                                                                            open_server):
    urls: list[str] = []
    page.on("request", lambda r: urls.append(r.url))
    page.goto(open_server.url)
    page.locator("#panel-chat").wait_for(state="visible")
    # Everything the console loads comes from the server itself: no CDN, no network.
    assert urls and all(u.startswith(open_server.url + "/") or u.startswith("data:")
                        for u in urls), urls
    assert page.locator("#signin").is_hidden()
    assert page.get_by_role("button", name="Sign out").is_hidden()
    # Tabs by arrow keys (the WAI-ARIA tabs pattern), Enter sends a message.
    page.get_by_role("tab", name="Chat").focus()
    page.keyboard.press("ArrowRight")
    assert page.get_by_role("tab", name="Dashboard").get_attribute("aria-selected") == "true"
    assert page.locator("#panel-dashboard").is_visible()
    page.keyboard.press("ArrowRight")
    assert page.locator("#panel-model").is_visible()
    page.keyboard.press("Home")
    assert page.locator("#panel-chat").is_visible()
    page.get_by_label("Message").fill("Hi")
    page.get_by_label("Message").press("Enter")
    wait_answered(page)
    assert last_answer(page).locator(".text").inner_text()
    # Every form control has a label.
    unlabeled = page.evaluate("""() => [...document.querySelectorAll('input, textarea')]
        .filter(e => !e.labels || !e.labels.length).map(e => e.id)""")
    assert unlabeled == []


def test_phone_width(browser, open_server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True,
                                  has_touch=True, device_scale_factor=2)
    page = context.new_page()
    try:
        page.goto(open_server.url)
        page.locator("#panel-chat").wait_for(state="visible")
        page.get_by_label("Message").fill("Hello from a phone")
        page.get_by_role("button", name="Send").click()
        wait_answered(page)
        fits = "() => document.documentElement.scrollWidth <= window.innerWidth"
        assert page.evaluate(fits)
        shot(page, "phone-chat")
        page.get_by_role("tab", name="Dashboard").click()
        page.locator('[data-chart="tokens"]').wait_for()
        assert page.evaluate(fits)
        width = page.locator('[data-chart="tokens"] canvas').first.bounding_box()["width"]
        assert width <= 390
        shot(page, "phone-dashboard")
    finally:
        context.close()


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile, written out slowly: the reference for the console's."""
    count = cumulative[-1][1]
    if count <= 0:
        return None
    rank = q * count
    prev_le, prev_count = 0.0, 0.0
    for le, c in cumulative:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (c - prev_count)
        prev_le, prev_count = le, c
    return prev_le


def test_the_dashboards_percentiles_are_promqls(page, open_server):
    """The console's parser and histogram_quantile (prom.js) against a slow reference, on
    the server's own histograms after some traffic."""
    for n in (1, 5, 20, 40):
        httpx.post(f"{open_server.url}/v1/completions",
                   json={"prompt": "Percentiles", "max_tokens": n}, timeout=60)
    page.goto(open_server.url)
    page.locator("#panel-chat").wait_for(state="visible")
    got = page.evaluate("""async () => {
        const prom = await import('./console/static/prom.js');
        const text = await (await fetch('metrics')).text();
        const m = prom.parse(text);
        const out = {};
        for (const name of ['llmserve:inter_token_latency_seconds',
                            'llmserve:time_to_first_token_seconds',
                            'llmserve:iteration_batch_size']) {
            const b = prom.buckets(m, name);
            out[name] = {buckets: b.map(([le, c]) => [le === Infinity ? 'inf' : le, c]),
                         q: [0.1, 0.5, 0.9, 0.99].map(q => prom.quantile(q, b))};
        }
        return out;
    }""")
    text = httpx.get(f"{open_server.url}/metrics").text
    for name, value in got.items():
        cumulative = []
        for line in text.splitlines():
            if line.startswith(f"{name}_bucket{{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                cumulative.append((float(le), float(line.rsplit(" ", 1)[1])))
        cumulative.sort()
        assert cumulative and cumulative[-1][1] > 0
        assert [(float(le), c) for le, c in value["buckets"]] == cumulative
        want = [histogram_quantile(q, cumulative) for q in (0.1, 0.5, 0.9, 0.99)]
        assert value["q"] == pytest.approx(want, rel=1e-12), name


@pytest.mark.parametrize("message, shown", [
    ("the waiting queue is full; retry later", "retry later (retry after 3 s)"),
    ("tokens per minute used up; try again in 3 s", "try again in 3 s"),
])
def test_a_429_says_the_wait_once(page, open_server, message, shown):
    page.goto(open_server.url)
    page.locator("#panel-chat").wait_for(state="visible")
    page.expected_errors.append("Failed to load resource: the server responded with a "
                                "status of 429")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=429, headers={"Retry-After": "3", "Content-Type": "application/json"},
        body=json.dumps({"error": {"message": message, "type": "rate_limit_exceeded"}})))
    send(page, "Hi")
    wait_answered(page)
    alert = last_answer(page).get_by_role("alert").inner_text()
    assert alert.endswith(shown) and alert.count("3 s") == 1, alert
