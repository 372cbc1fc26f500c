"""Open the usage database: SQLite under the data directory by default (WAL mode), or any
SQLAlchemy URL (PostgreSQL for servers that share one); migrated to the newest schema with
Alembic whenever it is opened."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from llmserve.errors import LLMServeError

DATABASE_FILE = "llmserve.db"
_MIGRATIONS = Path(__file__).parent / "migrations"
_MIGRATION_ATTEMPTS = 3
_MIGRATION_LOCK_ID = 0x6C6C6D73  # "llms": the advisory lock migrations take on PostgreSQL


class DatabaseError(LLMServeError):
    pass


def default_data_dir() -> Path:
    """$LLMSERVE_DATA_DIR, else the user's data directory (~/.local/share/llmserve)."""
    if env := os.environ.get("LLMSERVE_DATA_DIR"):
        return Path(env).expanduser()
    from platformdirs import user_data_path

    return user_data_path("llmserve", appauthor=False)


def sqlite_path(url: str) -> Path | None:
    """The file of an ``sqlite:///PATH`` URL (None: another database, or in memory)."""
    if not url.startswith("sqlite:///"):
        return None
    name = url.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(name) if name and name != ":memory:" else None


def check_writable(path: Path) -> None:
    """The SQLite database ``path`` can be written, or created with its directory, by this
    process; else a DatabaseError that names the path and why. Creates nothing (the server
    checks this before its model loads, and opens the database once the engine is up).
    SQLite in WAL mode also writes two files beside the database: its directory must be
    writable too."""
    hint = "choose another with --data-dir or --database-url, or run without one (--no-database)"
    if path.exists():
        if not path.is_file():
            raise DatabaseError(f"the usage database {path} is not a file; {hint}")
        if not os.access(path, os.R_OK | os.W_OK):
            raise DatabaseError(f"the usage database {path} is read-only for this user "
                                f"(keys and usage could not be written); make it writable, "
                                f"or {hint}")
    directory = path.parent
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    if not directory.is_dir():
        raise DatabaseError(f"cannot create the usage database {path}: {directory} is not "
                            f"a directory; {hint}")
    if not os.access(directory, os.W_OK | os.X_OK):
        what = "create the usage database" if not path.exists() else \
            "use the usage database"
        raise DatabaseError(f"cannot {what} {path}: the directory {directory} is not "
                            f"writable for this user; {hint}")


def _remove(paths: list[Path]) -> None:
    """Remove the files and (empty) directories a failed open created, deepest first."""
    for p in paths:
        for f in (p, p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm"),
                  p.with_name(p.name + "-journal")):
            try:
                if f.is_dir():
                    f.rmdir()
                else:
                    f.unlink(missing_ok=True)
            except OSError:
                pass


def database_url(data_dir: str | Path | None = None, url: str | None = None) -> str:
    if url:
        return url
    directory = Path(data_dir).expanduser() if data_dir else default_data_dir()
    return f"sqlite:///{directory / DATABASE_FILE}"


class Database:
    """An SQLAlchemy engine and session factory over a migrated database."""

    def __init__(self, url: str, *, writes: bool = True) -> None:
        """``writes`` False: only read (reports), so a read-only SQLite file is fine."""
        self.url = url
        path = sqlite_path(url)
        created: list[Path] = []  # what this open made, removed again if it fails
        if path is not None and (writes or not path.exists()):
            check_writable(path)
            created = [p for p in (path, *path.parents) if not p.exists()]
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DatabaseError(f"cannot create the data directory {path.parent}: "
                                    f"{e.strerror}") from None
        try:
            try:
                self.engine: Engine = create_engine(url)
            except Exception as e:  # a malformed URL, a driver that is not installed
                raise DatabaseError(f"cannot use the database URL {_redacted(url)}: {e}"
                                    ) from None
            if self.engine.dialect.name == "sqlite":
                event.listen(self.engine, "connect", _sqlite_pragmas)
            self._sessions = sessionmaker(self.engine, expire_on_commit=False)
            self.migrate()
            if path is not None and writes:
                self._check_sqlite_writes(path)
        except BaseException:
            if hasattr(self, "engine"):
                self.engine.dispose()
            _remove(created)
            raise

    def _check_sqlite_writes(self, path: Path) -> None:
        """A file SQLite opened read-only (its permissions, a read-only mount) reads fine
        and fails at every write: refused here, not with every request's usage lost."""
        from sqlalchemy.exc import OperationalError

        try:
            with self.engine.begin() as connection:  # the same value: nothing changes
                version = connection.exec_driver_sql("PRAGMA user_version").scalar()
                connection.exec_driver_sql(f"PRAGMA user_version = {int(version or 0)}")
        except OperationalError as e:
            raise DatabaseError(f"cannot write the usage database {path}: "
                                f"{e.orig or e}; make it writable, or choose another "
                                "with --data-dir or --database-url") from None

    def migrate(self) -> None:
        """Bring the schema to the newest revision (a no-op when it is there). Servers and
        commands that open a new database at the same moment take turns: on PostgreSQL
        behind a transaction-scoped advisory lock, elsewhere by trying again after a
        loser's failed CREATE, which then finds the schema in place."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(_MIGRATIONS))
        for attempt in range(_MIGRATION_ATTEMPTS):
            try:
                with self.engine.begin() as connection:
                    if connection.dialect.name == "postgresql":
                        connection.exec_driver_sql(
                            f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_ID})")
                    config.attributes["connection"] = connection
                    command.upgrade(config, "head")
                return
            except Exception as e:
                if attempt + 1 == _MIGRATION_ATTEMPTS:
                    raise DatabaseError(f"cannot open the usage database "
                                        f"{_redacted(self.url)}: {e}") from None
                time.sleep(0.1 * (attempt + 1))

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose transaction commits at the end of the block (or rolls back)."""
        with self._sessions.begin() as session:
            yield session

    def close(self) -> None:
        self.engine.dispose()


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at each checkpoint, as WAL intends
    cursor.execute("PRAGMA busy_timeout=5000")  # a CLI and the server may write at once
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _redacted(url: str) -> str:
    """The URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "(unparsable URL)"
