"""The throw-away PostgreSQL server the shared-store tests use starts, answers and goes away."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pg_support import PgServer, PgUnavailable


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    try:
        server = PgServer().start()
    except PgUnavailable as e:
        pytest.skip(str(e))
    yield server
    server.stop()


def test_a_real_server_answers_sql(pg: PgServer) -> None:
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(pg.dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        assert version is not None and int(version[0].split(".")[0]) >= 13
        conn.execute("CREATE TABLE t (k text PRIMARY KEY, v bigint NOT NULL)")
        conn.execute("INSERT INTO t VALUES ('a', 1) ON CONFLICT (k) DO UPDATE SET v = t.v + excluded.v")
        conn.execute("INSERT INTO t VALUES ('a', 2) ON CONFLICT (k) DO UPDATE SET v = t.v + excluded.v")
        assert conn.execute("SELECT v FROM t WHERE k = 'a'").fetchone() == (3,)


def test_stop_removes_the_cluster() -> None:
    try:
        server = PgServer().start()
    except PgUnavailable as e:
        pytest.skip(str(e))
    d = server.dir
    server.stop()
    assert not d.exists()
