"""The usage database: migrations, keys, token buckets, the usage writer."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from datetime import date

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import BigInteger, create_engine, inspect

from llmserve.usage import (
    Database,
    DatabaseError,
    KeyStore,
    Limits,
    RateLimiter,
    TokenBucket,
    UsageEvent,
    UsageRecorder,
    database_url,
)
from llmserve.usage.database import _MIGRATIONS
from llmserve.usage.limits import duration
from llmserve.usage.report import usage
from llmserve.usage.schema import Base, RequestLog


@pytest.fixture
def db(tmp_path):
    d = Database(database_url(tmp_path))
    yield d
    d.close()


# ---- schema and migrations -----------------------------------------------------------------


def test_migrations_build_exactly_the_orm_schema(db):
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_on_postgresql_migrations_keys_usage_and_request_logs(postgres):
    """The same schema and code on a real PostgreSQL server (servers that share one)."""
    url = postgres.new_database("usage")
    first = Database(url)
    with first.engine.connect() as conn:
        assert first.engine.dialect.name == "postgresql"
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    store = KeyStore(first)
    key, alice = store.create("alice", 10, 1000)
    store.create("bob")
    store.revoke("bob")
    rec = UsageRecorder(first, request_log="full", flush_interval=0.05)
    for i in range(5):
        rec.record(UsageEvent(f"r{i}", alice.id if i % 2 else None, "m", "/v1/completions",
                              i, 2 * i, cached_tokens=1, prompt=f"p{i}", output=f"o{i}"))
    rec.close()
    first.close()
    second = Database(url)  # migrations again: a no-op
    assert [k.name for k in KeyStore(second).list()] == ["alice", "bob"]
    assert [k.id for k in KeyStore(second).active_by_hash().values()] == [alice.id]
    assert KeyStore(second).find(key).limits.tokens_per_minute == 1000
    rows = {r.key_name: (r.requests, r.prompt_tokens, r.completion_tokens, r.cached_tokens)
            for r in usage(second)}
    assert rows == {"alice": (2, 1 + 3, 2 + 6, 2), None: (3, 0 + 2 + 4, 0 + 4 + 8, 3)}
    with second.session() as s:
        logs = s.query(RequestLog).order_by(RequestLog.request_id).all()
        assert [(r.prompt, r.output) for r in logs] == [(f"p{i}", f"o{i}") for i in range(5)]
    second.close()


def _migrate_to(url: str, revision: str, downgrade: bool = False) -> None:
    """Bring the database at ``url`` to ``revision`` with Alembic (as an older llmserve
    would have left it), without opening it as a Database (which goes to the newest)."""
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            (command.downgrade if downgrade else command.upgrade)(config, revision)
    finally:
        engine.dispose()


_COUNTERS = {"usage_daily": ["requests", "prompt_tokens", "completion_tokens", "cached_tokens"],
             "request_logs": ["prompt_tokens", "completion_tokens"]}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_upgrading_a_database_of_32_bit_counters_keeps_its_rows(backend, tmp_path, request):
    """A database created at revision 0001 (32-bit counters) and holding usage, keys and
    request logs: opening it migrates the counters to 64 bits and keeps every row; the
    downgrade goes back to 32 bits, rows kept too."""
    url = (database_url(tmp_path) if backend == "sqlite"
           else request.getfixturevalue("postgres").new_database("upgrade"))
    _migrate_to(url, "0001")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO api_keys (id, name, prefix, key_hash, created_at, "
                             "tokens_per_minute) VALUES (1, 'alice', 'sk-llmserve-ab', "
                             "'h1', '2026-11-01 00:00:00', 1000)")
        conn.exec_driver_sql("INSERT INTO usage_daily (key_id, day, model, requests, "
                             "prompt_tokens, completion_tokens, cached_tokens) VALUES "
                             "(1, '2026-11-01', 'm', 3, 2147483647, 20, 1), "
                             "(NULL, '2026-11-02', 'n', 1, 5, 6, 0)")
        conn.exec_driver_sql("INSERT INTO request_logs (request_id, key_id, created_at, "
                             "model, endpoint, prompt_tokens, completion_tokens) VALUES "
                             "('r1', 1, '2026-11-01 12:00:00', 'm', '/v1/completions', 7, 8)")
    engine.dispose()

    db = Database(url)  # migrates to the newest revision
    try:
        with db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
            columns = {t: {c["name"]: c["type"] for c in inspect(conn).get_columns(t)}
                       for t in _COUNTERS}
            indexes = {i["name"] for i in inspect(conn).get_indexes("usage_daily")}
        for table, names in _COUNTERS.items():
            for name in names:
                assert isinstance(columns[table][name], BigInteger), (table, name)
        assert indexes == {"ix_usage_daily_key_day_model"}
        assert [(r.key_name, r.day, r.model, r.requests, r.prompt_tokens, r.completion_tokens,
                 r.cached_tokens) for r in usage(db)] == [
            ("alice", date(2026, 11, 1), "m", 3, 2147483647, 20, 1),
            (None, date(2026, 11, 2), "n", 1, 5, 6, 0)]
        assert KeyStore(db).find("alice").limits.tokens_per_minute == 1000
        with db.session() as s:
            assert [(r.request_id, r.key_id, r.prompt_tokens, r.completion_tokens)
                    for r in s.query(RequestLog).all()] == [("r1", 1, 7, 8)]
    finally:
        db.close()

    _migrate_to(url, "0001", downgrade=True)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for table, names in _COUNTERS.items():
                types = {c["name"]: c["type"] for c in inspect(conn).get_columns(table)}
                assert not any(isinstance(types[n], BigInteger) for n in names), table
            assert conn.exec_driver_sql("SELECT prompt_tokens, completion_tokens FROM "
                                        "usage_daily ORDER BY id").fetchall() == [
                (2147483647, 20), (5, 6)]
            assert conn.exec_driver_sql("SELECT count(*) FROM request_logs").scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_days_counters_past_2_to_the_31_are_kept_exactly(backend, tmp_path, request):
    """One key, model and day past 2^31-1 tokens (about 25k tokens/s all day, a cluster
    sharing one database): PostgreSQL refused every further request of that day with
    "integer out of range", and the recorder dropped them from usage."""
    url = (database_url(tmp_path) if backend == "sqlite"
           else request.getfixturevalue("postgres").new_database("big"))
    db = Database(url)
    try:
        _, alice = KeyStore(db).create("alice")
        rec = UsageRecorder(db, request_log="metadata", flush_interval=60)
        rec.record(UsageEvent("r1", alice.id, "m", "/v1/completions", 1, 1, cached_tokens=1))
        rec.flush()
        top = 2**31 - 1
        with db.engine.begin() as conn:  # as the bug report had it, after a busy day
            conn.exec_driver_sql(f"UPDATE usage_daily SET requests = {top}, prompt_tokens = "
                                 f"{top}, completion_tokens = {top}, cached_tokens = {top}")
        rec.record(UsageEvent("r2", alice.id, "m", "/v1/completions", 5, 7, cached_tokens=3))
        rec.record(UsageEvent("r3", alice.id, "m", "/v1/completions", 2**32, 1))  # one huge
        rec.flush()
        assert (rec.events_written, rec.events_dropped) == (3, 0)
        rec.close()
        (row,) = usage(db)
        assert (row.requests, row.prompt_tokens, row.completion_tokens, row.cached_tokens,
                row.total_tokens) == (top + 2, top + 5 + 2**32, top + 8, top + 3,
                                      2 * top + 13 + 2**32)
        with db.session() as s:
            logs = {r.request_id: (r.prompt_tokens, r.completion_tokens)
                    for r in s.query(RequestLog).all()}
        assert logs == {"r1": (1, 1), "r2": (5, 7), "r3": (2**32, 1)}
    finally:
        db.close()


def _open_at_once(url: str, n: int = 6) -> list[str]:
    """n processes opening (and so migrating) the same new database at the same moment;
    the errors of those that failed."""
    code = "import sys; from llmserve.usage import Database; Database(sys.argv[1]).close()"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE,
                              text=True) for _ in range(n)]
    return [err[-500:] for p in procs if (err := p.communicate(timeout=120)[1]) and p.returncode]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_servers_opening_a_new_database_at_once_all_start(backend, tmp_path, request):
    for trial in range(3 if backend == "postgresql" else 1):  # the race is not every time
        if backend == "sqlite":
            url = database_url(tmp_path / f"trial{trial}")
        else:
            url = request.getfixturevalue("postgres").new_database("race")
        assert _open_at_once(url) == []
        db = Database(url)
        with db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        db.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_servers_sharing_a_database_lose_no_usage(backend, tmp_path, request):
    """Two writers adding to the same (key, day, model) rows at the same moments: the
    totals are the sum of both (the database adds; nobody writes back a stale count)."""
    url = (database_url(tmp_path) if backend == "sqlite"
           else request.getfixturevalue("postgres").new_database("shared"))
    dbs = [Database(url), Database(url)]
    _, alice = KeyStore(dbs[0]).create("alice")
    recorders = [UsageRecorder(d, flush_interval=0.01) for d in dbs]
    start = threading.Barrier(2)

    def write(rec: UsageRecorder, tag: str) -> None:
        start.wait()
        for i in range(300):
            rec.record(UsageEvent(f"{tag}{i}", alice.id if i % 2 else None, "m",
                                  "/v1/completions", 2, 3))
            if i % 10 == 0:
                time.sleep(0.005)  # many flushes, interleaved with the other writer's

    threads = [threading.Thread(target=write, args=(r, t)) for r, t in zip(recorders, "ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rec in recorders:
        rec.close()
    rows = {r.key_name: (r.requests, r.prompt_tokens, r.completion_tokens)
            for r in usage(dbs[0])}
    assert rows == {"alice": (300, 600, 900), None: (300, 600, 900)}
    for d in dbs:
        d.close()


def test_sqlite_runs_in_wal_mode(db):
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_reopening_keeps_everything(tmp_path):
    first = Database(database_url(tmp_path))
    key, info = KeyStore(first).create("alice", 10, 1000)
    rec = UsageRecorder(first)
    rec.record(UsageEvent("r1", info.id, "m", "/v1/chat/completions", 3, 4))
    rec.close()
    first.close()
    second = Database(database_url(tmp_path))  # migrations again: a no-op
    assert [k.name for k in KeyStore(second).list()] == ["alice"]
    assert KeyStore(second).find(key).id == info.id
    assert [(r.requests, r.prompt_tokens, r.completion_tokens) for r in usage(second)] == [
        (1, 3, 4)]


def test_bad_database_url_says_which():
    with pytest.raises(DatabaseError, match="cannot use the database URL"):
        Database("nosuchdialect://user:secret@host/db")
    with pytest.raises(DatabaseError) as e:
        Database("nosuchdialect://user:secret@host/db")
    assert "secret" not in str(e.value)


# ---- keys --------------------------------------------------------------------------------------


def test_keys_are_stored_hashed_and_found_by_id_name_prefix_or_key(db):
    store = KeyStore(db)
    key, info = store.create("alice", requests_per_minute=5)
    assert key.startswith("sk-llmserve-") and len(key) > 40
    with db.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT * FROM api_keys").fetchall()
    assert key not in repr(stored)  # only its hash and its first characters
    assert store.find(str(info.id)) == info
    assert store.find("alice") == info
    assert store.find(info.prefix) == info
    assert store.find(key) == info
    assert store.active_by_hash().popitem()[1] == info
    with pytest.raises(DatabaseError, match="no key"):
        store.find("bob")
    for loose in ("sk", "sk-llmserve-", info.prefix[:-1], ""):  # would name any key
        with pytest.raises(DatabaseError, match="no key"):
            store.find(loose)


def test_revoked_keys_leave_the_active_set(db):
    store = KeyStore(db)
    _, alice = store.create("alice")
    store.create("bob")
    assert store.revoke("bob").revoked_at is not None
    assert [k.id for k in store.active_by_hash().values()] == [alice.id]
    assert store.revoke("bob").revoked_at is not None  # twice: no error
    assert [k.active for k in store.list()] == [True, False]


def test_same_name_twice_needs_the_id(db):
    store = KeyStore(db)
    store.create("ci")
    store.create("ci")
    with pytest.raises(DatabaseError, match="give the id"):
        store.find("ci")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": " "}, "needs a name"),
    ({"name": "a", "requests_per_minute": 0}, "from 1 to"),
    ({"name": "a", "tokens_per_minute": -5}, "from 1 to"),
    ({"name": "a", "requests_per_minute": 10**20}, "from 1 to 2147483647"),
    ({"name": "x" * 201}, "at most 200 characters"),
    ({"name": "3"}, "cannot be a number"),
])
def test_bad_key_settings_are_refused(db, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyStore(db).create(**kwargs)
    assert KeyStore(db).list() == []


def test_only_ascii_digits_are_ids(db):
    store = KeyStore(db)
    _, first = store.create("first")
    _, arabic = store.create("١")  # Arabic-Indic one: a name, not id 1
    assert store.find("١").id == arabic.id != first.id
    assert store.find("1").id == first.id
    with pytest.raises(DatabaseError, match="no key '²'"):
        store.find("²")


# ---- token buckets ---------------------------------------------------------------------------


def _slow_level(capacity: float, events: list[tuple[float, str, float]],
                now: float) -> tuple[float, list[bool]]:
    """The bucket's level by replaying every millisecond: refill, then apply what is due
    (a take only if the bucket holds it; a give-back never above capacity)."""
    level, t, rate = capacity, 0.0, capacity / 60.0
    pending, taken = sorted(events), []
    while t < now - 1e-9:
        t = round(t + 0.001, 6)
        level = min(capacity, level + 0.001 * rate)
        while pending and pending[0][0] <= t:
            _, kind, amount = pending.pop(0)
            if kind == "back":
                level = min(capacity, level + amount)
            else:
                taken.append(level >= amount)
                level -= amount if taken[-1] else 0.0
    return level, taken


def test_token_bucket_matches_a_slow_replay():
    bucket = TokenBucket(120.0, updated=0.0)
    events = [(0.5, "take", 50.0), (1.2, "take", 100.0), (1.3, "back", 20.0),
              (2.0, "take", 60.0), (2.5, "back", 200.0), (2.6, "take", 119.0)]
    taken = []
    for at, kind, amount in events:
        if kind == "back":
            bucket.give_back(amount, at)
        else:
            taken.append(bucket.take(amount, at))
    bucket.refill(3.0)
    level, want = _slow_level(120.0, events, 3.0)
    assert taken == want == [True, False, True, True]
    assert bucket.level == pytest.approx(level, abs=0.01)


def test_token_bucket_refills_to_capacity_and_no_further():
    bucket = TokenBucket(60.0, updated=0.0)
    assert bucket.take(60, 0.0) and not bucket.take(1, 0.0)
    assert bucket.seconds_until(1, 0.0) == pytest.approx(1.0)
    assert bucket.take(1, 1.0)
    bucket.refill(1000.0)
    assert bucket.level == 60.0


def test_request_limit_refuses_with_the_wait_and_headers():
    limiter, limits = RateLimiter(), Limits(requests_per_minute=2)
    assert limiter.admit(1, limits, 0.0).allowed
    ok = limiter.admit(1, limits, 0.0)
    assert ok.allowed and ok.headers["x-ratelimit-remaining-requests"] == "0"
    refused = limiter.admit(1, limits, 0.0)
    assert not refused.allowed and refused.retry_after == pytest.approx(30.0)
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert "2 requests per minute" in refused.reason
    assert limiter.admit(2, limits, 0.0).allowed  # another key: its own bucket
    assert limiter.admit(1, limits, 30.0).allowed


def test_token_limit_reserves_the_most_a_request_can_use_and_gives_back_the_rest():
    limiter, limits = RateLimiter(), Limits(tokens_per_minute=60)
    assert limiter.admit(7, limits, 0.0).allowed
    assert limiter.reserve(7, limits, 40, 0.0).allowed  # prompt + max_tokens
    refused = limiter.reserve(7, limits, 30, 0.0)  # 20 left: waits for 10 more
    assert not refused.allowed and refused.retry_after == pytest.approx(10.0)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "20"
    assert "up to 30 tokens" in refused.reason
    limiter.give_back(7, 25, 0.0)  # the first used 15 of its 40
    assert limiter.reserve(7, limits, 30, 0.0).allowed  # 45 left
    never = limiter.reserve(7, limits, 61, 0.0)
    assert not never.allowed and math.isinf(never.retry_after)
    assert "lower max_tokens" in never.reason
    limiter.give_back(7, 1000, 0.0)  # never above the limit
    assert limiter.reserve(7, limits, 60, 0.0).allowed
    assert not limiter.reserve(7, limits, 1, 0.0).allowed
    assert not limiter.admit(7, limits, 0.0).allowed  # empty: refused before the body
    assert limiter.admit(7, limits, 1.0).allowed
    assert limiter.headers(7, 1.0)["x-ratelimit-remaining-tokens"] == "1"


def test_rate_limit_headers_read_the_buckets_without_changing_them():
    limiter, limits = RateLimiter(), Limits(tokens_per_minute=60)
    assert limiter.headers(3, 0.0) == {}  # a key not seen yet
    assert limiter.admit(3, limits, 0.0).allowed
    assert limiter.reserve(3, limits, 50, 0.0).allowed
    assert limiter.headers(3, 0.0)["x-ratelimit-remaining-tokens"] == "10"
    assert not limiter.reserve(3, limits, 20, 0.0).allowed  # the 50 still reserved


def test_changed_limits_take_effect():
    limiter = RateLimiter()
    assert limiter.admit(1, Limits(requests_per_minute=1), 0.0).allowed
    assert not limiter.admit(1, Limits(requests_per_minute=1), 0.0).allowed
    assert limiter.admit(1, Limits(requests_per_minute=10), 0.0).allowed


@pytest.mark.parametrize(("seconds", "text"), [(0.12, "120ms"), (1.0, "1s"), (59.2, "1m0s"),
                                               (360.0, "6m0s"), (0.0, "0ms")])
def test_reset_durations_read_like_openai(seconds, text):
    assert duration(seconds) == text


# ---- the usage writer ----------------------------------------------------------------------


def test_usage_adds_up_per_key_day_and_model(db):
    _, alice = KeyStore(db).create("alice")
    rec = UsageRecorder(db, flush_interval=0.05)
    events = [UsageEvent(f"r{i}", alice.id if i % 2 else None, "m" if i < 6 else "n",
                         "/v1/completions", i, 2 * i, cached_tokens=1) for i in range(10)]
    for e in events:
        rec.record(e)
    rec.flush()
    for e in events[:3]:  # a second batch folds into the same rows
        rec.record(e)
    rec.close()
    rows = {(r.key_name, r.model): r for r in usage(db)}
    expected: dict = {}
    for e in events + events[:3]:
        key = ("alice" if e.key_id else None, e.model)
        t = expected.setdefault(key, [0, 0, 0, 0])
        t[0] += 1
        t[1] += e.prompt_tokens
        t[2] += e.completion_tokens
        t[3] += e.cached_tokens
    assert {k: [r.requests, r.prompt_tokens, r.completion_tokens, r.cached_tokens]
            for k, r in rows.items()} == expected
    assert usage(db, key_id=alice.id, since=date.today()) == [
        r for r in usage(db) if r.key_id == alice.id]


def test_recording_never_waits_for_the_database(db):
    """The writer holds the database's write lock; record() still returns at once."""
    rec = UsageRecorder(db, flush_interval=0.05)
    with db.engine.connect() as conn:
        conn.exec_driver_sql("BEGIN EXCLUSIVE")  # nobody else can write now
        done = threading.Event()

        def many() -> None:
            for i in range(1000):
                rec.record(UsageEvent(f"r{i}", None, "m", "/v1/completions", 1, 1))
            done.set()

        threading.Thread(target=many).start()
        assert done.wait(2.0)
        conn.exec_driver_sql("ROLLBACK")
    rec.close()
    assert sum(r.requests for r in usage(db)) == 1000


def test_requests_arriving_one_by_one_are_written_together(db, monkeypatch):
    """One transaction per flush interval, not one per request (a commit costs the API
    server more CPU than the request's own HTTP handling)."""
    writes: list[int] = []
    original = UsageRecorder._write

    def counting(self) -> None:
        writes.append(len(self._pending))
        original(self)

    monkeypatch.setattr(UsageRecorder, "_write", counting)
    rec = UsageRecorder(db, flush_interval=0.5)
    start = time.monotonic()
    for i in range(40):
        rec.record(UsageEvent(f"r{i}", None, "m", "/v1/completions", 1, 1))
        time.sleep(0.005)
    elapsed = time.monotonic() - start
    rec.close()
    assert sum(writes) == 40
    assert len(writes) <= 2 + int(elapsed / 0.5), writes
    assert sum(r.requests for r in usage(db)) == 40


@pytest.mark.parametrize("level", ["off", "metadata", "full"])
def test_request_logs_keep_text_only_when_asked(db, level):
    rec = UsageRecorder(db, request_log=level)
    rec.record(UsageEvent("r1", None, "m", "/v1/chat/completions", 3, 4, finish_reason="stop",
                          latency_seconds=0.5, prompt="secret prompt", output="the answer"))
    rec.close()
    with db.session() as s:
        logs = s.query(RequestLog).all()
        if level == "off":
            assert logs == []
            return
        (log,) = logs
        assert (log.request_id, log.prompt_tokens, log.completion_tokens,
                log.finish_reason) == ("r1", 3, 4, "stop")
        assert math.isclose(log.latency_seconds, 0.5)
        if level == "full":
            assert (log.prompt, log.output) == ("secret prompt", "the answer")
        else:
            assert log.prompt is None and log.output is None


def test_unknown_request_log_level_is_refused(db):
    with pytest.raises(ValueError, match="off, metadata, full"):
        UsageRecorder(db, request_log="everything")


def test_one_request_the_database_refuses_holds_back_no_one(postgres):
    """On PostgreSQL: a NUL character in a logged text (a model can write one) is stored as
    U+FFFD, which PostgreSQL's text can hold; a request the database still refuses (here a
    model name past its column) is dropped alone, with an error, instead of failing every
    later write with it."""
    db = Database(postgres.new_database("refused"))
    try:
        rec = UsageRecorder(db, request_log="full", flush_interval=60)
        rec.record(UsageEvent("nul", None, "m", "/v1/completions", 3, 2, finish_reason="stop",
                              prompt="a\x00b", output="\x00\x00"))
        rec.record(UsageEvent("long", None, "m" * 300, "/v1/completions", 1, 1))
        for i in range(3):
            rec.record(UsageEvent(f"ok{i}", None, "m", "/v1/completions", 5, 7))
        rec.flush()
        assert (rec.events_written, rec.events_dropped) == (4, 1)
        rec.close()
        with db.session() as s:
            logs = {r.request_id: r for r in s.query(RequestLog).all()}
        assert set(logs) == {"nul", "ok0", "ok1", "ok2"}
        assert (logs["nul"].prompt, logs["nul"].output) == ("a\ufffdb", "\ufffd\ufffd")
        rows = usage(db)
        assert [(r.model, r.requests, r.prompt_tokens) for r in rows] == [("m", 4, 18)]
    finally:
        db.close()


def _as_plain_user(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` as a process without root's override of file permissions."""
    import os
    import shutil

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file permissions cannot be tested")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)


def test_a_read_only_database_is_refused_naming_the_file(tmp_path):
    """(It used to open, and every usage write failed with SQL warnings.)"""
    Database(database_url(tmp_path)).close()
    path = tmp_path / "llmserve.db"
    path.chmod(0o444)
    opened = _as_plain_user(f"from llmserve.usage import Database\n"
                            f"Database({f'sqlite:///{path}'!r})")
    assert opened.returncode != 0
    assert f"the usage database {path} is read-only for this user" in opened.stderr
    # Past the permission check (a read-only mount looks writable to it): the write probe.
    probed = _as_plain_user("import llmserve.usage.database as d\n"
                            "d.check_writable = lambda path: None\n"
                            f"d.Database({f'sqlite:///{path}'!r})")
    assert f"cannot write the usage database {path}: attempt to write a readonly " \
           f"database" in probed.stderr, probed.stderr
    # Reports only read it.
    listed = _as_plain_user(f"from llmserve.usage import Database, KeyStore\n"
                            f"print(KeyStore(Database({f'sqlite:///{path}'!r}, "
                            f"writes=False)).list())")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr


def test_a_read_only_data_dir_says_which_directory(tmp_path):
    """(It used to say only sqlite's "unable to open database file".)"""
    data_dir = tmp_path / "ro"
    data_dir.mkdir()
    data_dir.chmod(0o555)
    out = _as_plain_user(f"from llmserve.usage import Database\n"
                         f"Database({f'sqlite:///{data_dir}/sub/llmserve.db'!r})")
    assert (f"cannot create the usage database {data_dir}/sub/llmserve.db: the directory "
            f"{data_dir} is not writable") in out.stderr, out.stderr
    assert list(data_dir.iterdir()) == []
