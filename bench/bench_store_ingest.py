"""What ``ingest_batch`` costs on each store: one feed batch naming 1,000 registered sandboxes, applied and
committed (the ledger read and locked, the sandboxes locked, read and brought into the core, the reports
applied, the claim, one write of the states, the commit).

Run: .venv/bin/pytest bench/bench_store_ingest.py -p no:cacheprovider --benchmark-columns=min,median,max
``extra_info['updates_per_s']`` is 1,000 over the median; ``extra_info['cpu_ms']`` the median CPU time of
this process per batch (the scheduler's own core: on PostgreSQL the server's work is not in it, though
here it runs on the same cores and is in the wall time). Arms: SQLite with ``synchronous`` FULL (the
default: one fsync per commit) and NORMAL; PostgreSQL on a throw-away local server with fsync on (skipped
where none can start); each with one writer (the core already holds what the store does) and with two
store objects taking turns on one database (each core stale after the other's commit, so every sandbox
is restored from its row); and, with one writer, a batch that wakes every sandbox (each idle before it,
as the idle timers' transaction left it, untimed): 1,000 transitions, each a full row and an event.
The machine is shared: compare arms run together, not numbers across runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "scheduler"))

import pg_support
from test_store_contract import reg

from sbxnet.protocol.feed import Batch, SandboxReport, new_epoch
from scheduler.pg_store import PgStore
from scheduler.sqlite_store import SqliteStore
from scheduler.store import Store, ingest_batch, load_core, refresh_core
from scheduler.timers import SandboxConfig, TimerCore

N = 1000
SIDS = [f"sbx-{i:06d}" for i in range(N)]


@pytest.fixture(scope="module")
def pg_server() -> Iterator[pg_support.PgServer]:
    try:
        server = pg_support.PgServer(fsync=True).start()
    except pg_support.PgUnavailable as e:
        pytest.skip(str(e))
    yield server
    server.stop()


def _register_all(store: Store) -> None:
    core, r = TimerCore(), reg()
    with store.transaction() as tx:
        for sid in SIDS:
            core.register(SandboxConfig(sid, r.incarnation, r.idle_period_s, registered_at=1.0), 1.0)
            tx.put_registration(sid, r, 1.0, core.snapshot(sid), [])


@pytest.fixture(params=["sqlite-FULL", "sqlite-NORMAL", "pg"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    opened: list[Store] = []
    if request.param == "pg":
        dsn = pg_support.fresh_schema(request.getfixturevalue("pg_server"))

        def make() -> Store:
            opened.append(PgStore(dsn))
            return opened[-1]
    else:
        sync = request.param.partition("-")[2]

        def make() -> Store:
            opened.append(SqliteStore(tmp_path / "bench.db", synchronous=sync))
            return opened[-1]

    yield make
    for s in opened:
        s.close()


@pytest.mark.parametrize("writers", [1, 2, "wake"])
def test_ingest_1000_sandbox_batch(benchmark: Any, open_store: Callable[[], Store], writers: int | str) -> None:
    wake = writers == "wake"
    writers = 1 if wake else int(writers)
    stores = [open_store() for _ in range(writers)]
    _register_all(stores[0])
    cores = [load_core(s) for s in stores]
    epoch = new_epoch(time.time_ns(), bytes(8))
    seq = 0

    def next_batch() -> tuple[tuple[object, ...], dict[str, object]]:
        nonlocal seq
        seq += 1
        b = Batch(epoch, seq, tuple(SandboxReport(sid, 100, 200, 1, 0.1) for sid in SIDS))
        k = seq % writers
        now = 10.0 + seq * (1000 if wake else 1)  # waking: each round after every idle period ran out
        if wake:  # every sandbox idle, as the service's timer transaction leaves it (SchedulerService.fire_due)
            with stores[k].transaction() as tx:
                refresh_core(cores[k], tx, SIDS)
                events = cores[k].on_timer(now - 1)
                assert len(events) == N
                tx.save({sid: cores[k].snapshot(sid) for sid in SIDS}, events)
                version = tx.written_version()
            cores[k].mark_stored(SIDS, version)
        return (cores[k], stores[k], "spiffe://bench/forwarder", b, now), {}

    cpu: list[float] = []

    def ingest(*args: Any) -> None:
        t = time.process_time()
        decision, events = ingest_batch(*args)
        cpu.append(time.process_time() - t)
        assert decision.apply and len(events) == (N if wake else 0)

    benchmark.pedantic(ingest, setup=next_batch, rounds=30, iterations=1, warmup_rounds=3)
    assert {s.state.bytes_in for s in stores[0].sandboxes()} == {100 * seq}
    benchmark.extra_info["sandboxes_per_batch"] = N
    benchmark.extra_info["cpu_ms"] = round(1000 * statistics.median(cpu[3:]), 2)  # the warm-up rounds left out
    if benchmark.stats is not None:
        benchmark.extra_info["updates_per_s"] = round(N / benchmark.stats.stats.median)
