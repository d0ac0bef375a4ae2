"""The service's transactions and the store's row versions (scheduler/store.py "Row versions"): what the
timer loop and the stale-source sweep write, the core holds at its version, so the feed's next batch
about those sandboxes reads none of them in full; a row a hold changed (not marked) is read once. A
resync reads in full only the rows another writer changed or added, and drops those it removed. A real
SQLite file, the connection's statements traced, a fake clock."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

from test_store_contract import PIN, reg

from sbxnet.protocol.feed import Batch, SandboxReport, new_epoch
from scheduler.service import SchedulerService
from scheduler.sqlite_store import SqliteStore
from scheduler.store import StoredSandbox, ingest_batch
from scheduler.timers import SandboxConfig, State, TimerCore

FWD = "spiffe://sbxnet.test/forwarder#0"
E1 = new_epoch(1_000, bytes(8))
SIDS = ("sbx-a", "sbx-b", "sbx-c")


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rows_the_timers_and_the_sweep_wrote_are_not_read_again_by_the_next_batch(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    clock = Clock(100.0)
    service = SchedulerService(store, forwarder_allow=[], now=clock, source_stale_s=30.0)
    for sid in SIDS:
        service.register(sid, reg(period=10, activity="connections"))
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)

    def full_reads() -> list[str]:
        """The row reads (versions are read as ``sandbox, row_version``)."""
        return [q for q in statements if q.startswith("SELECT s.sandbox, s.registration")]

    def feed(seq: int, now: float, open_: int = 0) -> None:
        # Through the service's feed adapter, from the forwarder the routes name (its key, the routes'
        # pin): the service idles only on a live feed.
        clock.t, was = now, clock.t
        b = Batch(E1, seq, tuple(SandboxReport(sid, 1, 1, open_, 0.0) for sid in SIDS))
        decision = service.feed.ingest(FWD, b, PIN)
        clock.t = was
        assert decision is not None and decision.apply

    feed(1, 101.0, open_=1)
    statements.clear()
    clock.t = 200.0  # the connections are open: nothing is due until the source goes stale
    assert service.fire_due() == []
    assert service.forget_stale() == []  # FWD silent since 101: its counts go, idle from now
    assert [store.sandboxes()[i].state.open_by for i in range(3)] == [{}, {}, {}]
    clock.t = 210.0
    assert [e.to_state for e in service.fire_due()] == [State.IDLE] * 3
    reads_before = len(full_reads())
    feed(2, 211.0)
    assert len(full_reads()) == reads_before  # the batch read none of the rows the service wrote
    assert [service.core.state_of(s) for s in SIDS] == [State.ACTIVE] * 3
    assert [r.state.bytes_in for r in store.sandboxes()] == [2, 2, 2]
    # A hold through the service: that row is the core's, but not at a version it marked: read once.
    service.hold("sbx-b", 100.0)
    statements.clear()
    feed(3, 212.0)
    assert len(full_reads()) == 1 and "'sbx-b'" in full_reads()[0] and "'sbx-a'" not in full_reads()[0]
    assert [r.state.bytes_in for r in store.sandboxes()] == [3, 3, 3]
    store.close()


class ReadCounting(SqliteStore):
    """A real ``SqliteStore`` that remembers which rows ``sandboxes_in`` was asked for."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.asked: list[list[str]] = []

    def sandboxes_in(self, sandboxes: Collection[str]) -> list[StoredSandbox]:
        self.asked.append(sorted(sandboxes))
        return super().sandboxes_in(sandboxes)


def test_resync_reads_in_full_only_the_rows_another_writer_changed(tmp_path: Path) -> None:
    clock = Clock(100.0)
    store = ReadCounting(tmp_path / "s.db")
    service = SchedulerService(store, forwarder_allow=[], now=clock)
    for sid in SIDS:
        service.register(sid, reg(period=10))
    ingest_batch(service.core, store, FWD, Batch(E1, 1, tuple(SandboxReport(s, 5, 6, 0, 0.0) for s in SIDS)), 101.0)
    service.resync()  # nothing changed elsewhere: the rows the batch wrote are not read again
    assert store.asked == []
    other = SqliteStore(tmp_path / "s.db")  # another writer on the same file
    with other.transaction() as tx:
        tx.remove_registration("sbx-b")
        (row,) = tx.lock(["sbx-c"]).values()
        tx.save({"sbx-c": replace(row.state, bytes_in=999)}, [])
        core = TimerCore()
        core.register(SandboxConfig("sbx-d", "inc-1", 10.0, registered_at=100.0), 100.0)
        tx.put_registration("sbx-d", reg(period=10), 100.0, core.snapshot("sbx-d"), [])
    other.close()
    service.resync()
    assert store.asked == [["sbx-c", "sbx-d"]]
    assert sorted(service.core.ids()) == ["sbx-a", "sbx-c", "sbx-d"]
    assert service.core.snapshot("sbx-c").bytes_in == 999 and service.core.snapshot("sbx-a").bytes_in == 5
