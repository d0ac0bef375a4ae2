"""A real, throw-away PostgreSQL server for the tests that need one (the scheduler's shared store).

Debian's server binaries (``scripts/setup.sh`` installs ``postgresql``) run a fresh cluster in a
temporary directory on a loopback port, as the ``postgres`` user (the server refuses to run as root),
with trust authentication on 127.0.0.1 only. ``stop()`` removes it; ``halt()`` and ``resume()`` take it down
and bring it back on the same port with its data (a database outage). ``shared_server()`` is one server
for the whole test run, started on first use and removed at exit; ``fresh_schema()`` gives each test an
empty schema of its own on it (a DSN whose ``search_path`` is that schema). Tests that cannot start one
skip with the reason; nothing here touches the machine's own clusters.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg


class PgUnavailable(Exception):
    """Why no server could be started here (the tests skip with this text)."""


def _bindir() -> Path:
    base = Path("/usr/lib/postgresql")
    versions = sorted((p for p in base.iterdir() if (p / "bin" / "initdb").exists()), key=lambda p: int(p.name)) \
        if base.is_dir() else []
    if not versions:
        raise PgUnavailable("no PostgreSQL server binaries under /usr/lib/postgresql (scripts/setup.sh installs them)")
    return versions[-1] / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """One cluster. ``fsync`` off by default: the tests need no durability, and it is faster (a benchmark
    that reports commit costs turns it on)."""

    def __init__(self, *, fsync: bool = False) -> None:
        self.fsync = fsync
        self.bindir = _bindir()
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sbxnet-pg-"))
        self.data = self.dir / "data"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            try:
                shutil.chown(self.dir, "postgres", "postgres")
            except (LookupError, PermissionError) as e:
                raise PgUnavailable(f"cannot hand {self.dir} to the postgres user: {e}") from None

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)

    def start(self) -> PgServer:
        r = self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        if r.returncode:
            raise PgUnavailable(f"initdb failed: {r.stderr.strip()[-300:]}")
        return self.resume()

    def resume(self) -> PgServer:
        """Start the server on its data directory (after ``start`` made it, or after ``halt``)."""
        fsync = "on" if self.fsync else "off"
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync={fsync} -c max_connections=50"
        log = str(self.dir / "log")
        r = self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", log, "-w", "-t", "60", "start")
        if r.returncode:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise PgUnavailable(f"pg_ctl start failed: {(r.stderr + log).strip()[-300:]}")
        return self

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=5"

    def halt(self) -> None:
        """Stop the server at once (as a crash would), keeping its data for ``resume``."""
        r = self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=30)
        if r.returncode:
            raise PgUnavailable(f"pg_ctl stop failed: {r.stderr.strip()[-300:]}")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=30)
        for _ in range(50):
            try:
                shutil.rmtree(self.dir)
                return
            except OSError:
                time.sleep(0.1)


_shared: PgServer | PgUnavailable | None = None
_schemas = itertools.count(1)


def shared_server() -> PgServer:
    """One server for the test run (started on first call, removed when the process exits); raises
    ``PgUnavailable`` (each time) if it could not start."""
    global _shared
    if _shared is None:
        try:
            _shared = PgServer().start()
        except PgUnavailable as e:
            _shared = e
        else:
            atexit.register(_shared.stop)
    if isinstance(_shared, PgUnavailable):
        raise _shared
    return _shared


def fresh_schema(server: PgServer) -> str:
    """A new, empty schema on ``server``; returns a DSN whose ``search_path`` is it."""
    name = f"t{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    return f"{server.dsn} options='-c search_path={name}'"
