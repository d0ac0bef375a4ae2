"""The service's transactions and the store's row versions (scheduler/store.py "Row versions"): what the
timer loop and the stale-source sweep write, the core holds at its version, so the feed's next batch
about those sandboxes reads none of them in full; a row a hold changed (not marked) is read once. A real
SQLite file, the connection's statements traced, a fake clock."""

from __future__ import annotations

from pathlib import Path

from test_store_contract import reg

from sbxnet.protocol.feed import Batch, SandboxReport, new_epoch
from scheduler.service import SchedulerService
from scheduler.sqlite_store import SqliteStore
from scheduler.store import ingest_batch
from scheduler.timers import State

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
        return [q for q in statements if q.startswith("SELECT sandbox, registration")]

    def feed(seq: int, now: float, open_: int = 0) -> None:
        b = Batch(E1, seq, tuple(SandboxReport(sid, 1, 1, open_, 0.0) for sid in SIDS))
        decision, _ = ingest_batch(service.core, store, FWD, b, now)
        assert decision.apply

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
