"""A throwaway PostgreSQL server for the tests: Debian's postgresql binaries, a cluster in
a temporary directory, listening on a free loopback port and on a socket in that directory,
trust authentication, stopped and deleted at the end. As root, the cluster runs as the
`postgres` user (initdb refuses root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

USER = "llmserve"


class PostgresMissing(RuntimeError):
    pass


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise PostgresMissing("PostgreSQL's server is not installed: `make system-deps` installs "
                          "Debian's postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    def __init__(self, port: int) -> None:
        self.port = port
        self._count = 0

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "test") -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        import psycopg

        self._count += 1
        name = f"{prefix}_{self._count}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@contextmanager
def temporary_postgres() -> Iterator[Postgres]:
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="llmserve-pg-"))
    data = root / "data"
    as_root = os.geteuid() == 0
    prefix: list[str] = []
    if as_root:  # initdb and postgres refuse to run as root
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        root.chmod(0o700)
        prefix = ["runuser", "-u", "postgres", "--"]
    port = _free_port()

    def run(*cmd: str) -> None:
        out = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {out.stdout}{out.stderr}")

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", USER,
            "--no-sync", "-E", "UTF8")
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w",
            "-o", f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off", "start")
        try:
            yield Postgres(port)
        finally:
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
