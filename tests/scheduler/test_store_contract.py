"""The store contract (scheduler/store.py), the same tests on both stores: ``SqliteStore`` on a file and
``PgStore`` on a real throw-away PostgreSQL (tests/scheduler/pg_support.py, one server for the run, an empty
schema per test; skipped with the reason where no server can start).

Registrations put, replaced and removed; ``save``; event ids and ``events_after``; the ledger's decisions
through ``ingest_batch`` with exact byte totals; a transaction that raises leaves nothing; a stale ledger
claim conflicts; webhook leases; and two replicas (two store objects, each with its own connection and
its own ``TimerCore``) running concurrently in two threads: an idle timer both fire is stored once, and
batches from two forwarders about the same sandboxes lose no bytes."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pg_support
import pytest

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import Answer, Batch, SandboxReport, new_epoch
from sbxnet.protocol.routes import Registration, pull_registration
from scheduler.feed_ledger import Stored, Verdict, decide
from scheduler.pg_store import PgStore
from scheduler.sqlite_store import SqliteStore
from scheduler.store import LedgerConflict, Store, config_of, ingest_batch, load_core, sync_core
from scheduler.timers import Event, SandboxConfig, State, TimerCore, Why

PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
FWD = "spiffe://sbxnet.test/forwarder-1"
FWD2 = "spiffe://sbxnet.test/forwarder-2"
E1 = new_epoch(1_000, bytes(8))
E2 = new_epoch(2_000, bytes(8))
T = TypeVar("T")


def reg(incarnation: str = "inc-1", period: float = 300, activity: str = "bytes") -> Registration:
    body: dict[str, Any] = {
        "incarnation": incarnation,
        "forwarder": {"address": "10.0.3.7:8443", "spki_pin": PIN},
        "target_ip": "10.200.1.5",
        "default_port": 8080,
        "ports": {"8080": {"protocol": "http", "auth": "public"}},
        "idle_period_s": period,
        "activity": activity,
    }
    return pull_registration(json.dumps(body).encode())


def register(core: TimerCore, store: Store, sid: str, r: Registration, now: float) -> list[int]:
    """The registry's pattern: lock, restore, register in the core, write it back, in one transaction."""
    with store.transaction() as tx:
        sync_core(core, [sid], tx.lock([sid]))
        events = core.register(config_of(sid, r, now), now)
        return tx.put_registration(sid, r, core.config(sid).registered_at, core.snapshot(sid), events)


def fire_timers(core: TimerCore, store: Store, now: float) -> list[Event]:
    """The service's pattern for an idle timer: lock the sandboxes the core thinks are due, restore what
    the store holds (another replica may have fired them, or seen traffic), run the timers, write back
    what changed."""
    with store.transaction() as tx:
        due = [s.sandbox for s in core.status(now) if s.idle_in_s == 0.0]
        sync_core(core, due, tx.lock(due))
        events = core.on_timer(now)
        tx.save({e.sandbox: core.snapshot(e.sandbox) for e in events}, events)
    return events


def batch(epoch: str, seq: int, *entries: tuple[str, int, int]) -> Batch:
    return Batch(epoch, seq, tuple(SandboxReport(s, i, o, 0, 0.0) for s, i, o in entries))


def totals(store: Store) -> dict[str, tuple[int, int]]:
    return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in store.sandboxes()}


def everything(store: Store) -> tuple[object, ...]:
    """What a reader can see of the store."""
    return (
        store.sandboxes(), store.ledger(FWD), store.ledger(FWD2), store.events_after(0),
        store.undelivered_webhooks(),
    )


class Opener:
    """Opens store objects on one database: each its own connection, as two replicas are. Stores opened
    with ``track`` are closed after the test; a thread opens its own with ``track=False`` and closes it
    (SQLite connections stay in the thread that made them)."""

    def __init__(self, make: Callable[[], Store]) -> None:
        self._make = make
        self._opened: list[Store] = []

    def __call__(self, track: bool = True) -> Store:
        store = self._make()
        if track:
            self._opened.append(store)
        return store

    def close(self) -> None:
        for s in self._opened:
            s.close()


@pytest.fixture(scope="session")
def pg_server() -> pg_support.PgServer:
    try:
        return pg_support.shared_server()
    except pg_support.PgUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(params=["sqlite", "pg"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    if request.param == "sqlite":
        path = tmp_path / "scheduler.db"
        opener = Opener(lambda: SqliteStore(path))
    else:
        dsn = pg_support.fresh_schema(request.getfixturevalue("pg_server"))
        opener = Opener(lambda: PgStore(dsn))
    yield opener
    opener.close()


def with_sandboxes(open_store: Opener, *sids: str, now: float = 100.0) -> tuple[Store, TimerCore]:
    store = open_store()
    core = load_core(store)
    for sid in sids:
        register(core, store, sid, reg(), now)
    return store, core


def both(*calls: Callable[[], T]) -> list[T]:
    """Run the calls at once in threads (each waits for all to start) and return their results; an
    exception in one is raised here."""
    start = threading.Barrier(len(calls), timeout=30)

    def run(call: Callable[[], T]) -> T:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, c) for c in calls]
        return [f.result(timeout=120) for f in futures]


# --- the store's shape ---------------------------------------------------------------------------------


def test_shared_says_whether_other_replicas_may_write(open_store: Opener) -> None:
    store = open_store()
    assert store.shared is isinstance(store, PgStore)


def test_registrations_put_replace_remove(open_store: Opener) -> None:
    store = open_store()
    core = TimerCore()
    a, b = reg("inc-a", 60, "connections"), reg("inc-b", 300)
    ids_b = register(core, store, "sbx-b", b, 5.0)
    ids_a = register(core, store, "sbx-a", a, 7.0)
    assert len(ids_b) == len(ids_a) == 1 and ids_a[0] > ids_b[0]
    other = open_store()  # another connection sees what was committed
    rows = other.sandboxes()
    assert [(r.sandbox, r.registration, r.registered_at) for r in rows] == [("sbx-a", a, 7.0), ("sbx-b", b, 5.0)]
    assert rows[0].config() == core.config("sbx-a") and rows[0].state == core.snapshot("sbx-a")
    # The same incarnation again: the new period, the same state and start; no event.
    core.on_report("sbx-a", 5, 6, 0, 8.0, 8.0)
    store.save({"sbx-a": core.snapshot("sbx-a")}, [])
    assert register(core, store, "sbx-a", reg("inc-a", 90, "connections"), 9.0) == []
    (row_a,) = [r for r in other.sandboxes() if r.sandbox == "sbx-a"]
    assert (row_a.registration.idle_period_s, row_a.registered_at, row_a.state.bytes_in) == (90, 7.0, 5)
    # A new incarnation replaces the row and starts afresh.
    assert len(register(core, store, "sbx-a", reg("inc-a2"), 10.0)) == 1
    (row_a,) = [r for r in other.sandboxes() if r.sandbox == "sbx-a"]
    assert (row_a.registration.incarnation, row_a.registered_at, row_a.state.bytes_in) == ("inc-a2", 10.0, 0)
    assert store.remove_registration("sbx-b") and not store.remove_registration("sbx-b")
    assert [r.sandbox for r in other.sandboxes()] == ["sbx-a"]
    assert load_core(other).status(20.0) == [s for s in core.status(20.0) if s.sandbox != "sbx-b"]


def test_lock_returns_the_stored_rows_and_leaves_out_the_rest(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    with store.transaction() as tx:
        rows = tx.lock(["sbx-c", "nope", "sbx-a", "sbx-c"])
        assert sorted(rows) == ["sbx-a", "sbx-c"]
        assert rows["sbx-a"].state == core.snapshot("sbx-a") and rows["sbx-c"].config() == core.config("sbx-c")
        assert tx.lock([]) == {}
    ids = [f"sbx-{i}" for i in range(1200)]  # more than one statement's worth of IDs on SQLite
    with store.transaction() as tx:
        assert tx.lock(ids) == {}  # none of these is stored
        for sid in ids[:700]:
            tx.put_registration(sid, reg(), 1.0, core.snapshot("sbx-a"), [])
    with store.transaction() as tx:
        assert sorted(tx.lock(ids)) == sorted(ids[:700])


def test_save_writes_stored_sandboxes_and_its_events(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b")
    events = core.on_timer(1000.0)
    assert [e.sandbox for e in events] == ["sbx-a", "sbx-b"]
    ghost = core.snapshot("sbx-a")
    ids = store.save({"sbx-a": core.snapshot("sbx-a"), "ghost": ghost}, events[:1])
    assert len(ids) == 1
    rows = {r.sandbox: r.state for r in open_store().sandboxes()}
    assert sorted(rows) == ["sbx-a", "sbx-b"]  # the state of a sandbox not stored is not written
    assert rows["sbx-a"].state is State.IDLE and rows["sbx-b"].state is State.ACTIVE
    assert store.save({}, []) == []


def test_events_after_in_order_with_increasing_ids(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b")
    ids = [e.id for e in store.events_after(0)]
    evs = core.on_timer(1000.0)
    ids += store.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b")}, evs)
    woken = core.wake("sbx-a", 1001.0).events + core.driver_ready("sbx-a", 1002.0)
    ids += store.save({"sbx-a": core.snapshot("sbx-a")}, woken)
    every = open_store().events_after(0)
    assert [e.id for e in every] == ids and ids == sorted(set(ids)) and len(ids) == 6
    assert [e.event.why for e in every[:2]] == [Why.REGISTERED] * 2 and [e.event for e in every[2:]] == evs + woken
    assert [e.event.to_state for e in every[2:]] == [State.IDLE, State.IDLE, State.WAKING, State.ACTIVE]
    assert store.events_after(ids[3]) == every[4:]
    assert store.events_after(0, limit=2) == every[:2] and store.events_after(ids[-1]) == []


def test_many_events_in_one_write_get_their_ids_in_the_order_given(open_store: Opener) -> None:
    """A batch that wakes a thousand sandboxes writes a thousand events in one statement: the ids returned
    are the stored ones, increasing in the order given, and the next write's follow them."""
    store, _ = with_sandboxes(open_store, "sbx-a", "sbx-b")
    before = [e.id for e in store.events_after(0)]
    moves = [("sbx-b", State.IDLE), ("sbx-a", State.WAKING)]
    events = [
        Event(moves[i % 2][0], "inc-1", State.ACTIVE, moves[i % 2][1], 500.0 + i, Why.TRAFFIC) for i in range(1000)
    ]
    ids = store.save({}, events)
    more = open_store().save({}, events[:3])
    stored = store.events_after(before[-1], limit=2000)
    assert [e.id for e in stored] == ids + more and ids == sorted(set(ids)) and more[0] > ids[-1]
    assert [e.event for e in stored] == events + events[:3]
    assert [e.event.to_state for e in store.undelivered_webhooks(limit=2)] == [State.IDLE, State.WAKING]


# --- row versions --------------------------------------------------------------------------------------


def versions(store: Store, *sids: str) -> dict[str, int]:
    """The rows' versions, which ``lock_versions`` and ``lock`` agree on."""
    with store.transaction() as tx:
        got = tx.lock_versions(sids)
        assert got == {sid: row.version for sid, row in tx.lock(sids).items()}
        return got


def test_every_write_stamps_its_rows_with_a_version_no_other_write_had(open_store: Opener) -> None:
    """One version per writing transaction, whichever store object wrote; a row removed and registered
    again never gets a version back that it had (a core holding that version would take it for its own)."""
    a, b = open_store(), open_store()
    core = TimerCore()
    register(core, a, "sbx-a", reg(), 1.0)
    register(core, b, "sbx-b", reg(), 1.0)
    first = versions(a, "sbx-a", "sbx-b", "nope")
    assert sorted(first) == ["sbx-a", "sbx-b"] and first["sbx-a"] != first["sbx-b"]
    with b.transaction() as tx:
        assert tx.lock_versions([]) == {}
        tx.save({"sbx-a": core.snapshot("sbx-a"), "sbx-b": core.snapshot("sbx-b")}, [])
        written = tx.written_version()
        assert tx.written_version() == written  # one per transaction
    assert versions(a, "sbx-a", "sbx-b") == {"sbx-a": written, "sbx-b": written}
    assert written not in first.values()
    had = {first["sbx-a"], written}
    assert a.remove_registration("sbx-a")
    again = set()
    for i in range(4):  # a new row for sbx-a, written again and again from either store object
        register(core, (a, b)[i % 2], "sbx-a", reg(f"inc-{i}"), 2.0 + i)
        again.add(versions(b, "sbx-a")["sbx-a"])
    assert len(again) == 4 and not again & had
    assert load_core(a).stored_version("sbx-a") == versions(a, "sbx-a")["sbx-a"]


def test_save_meters_writes_only_the_meters_and_the_version(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b")
    core.on_report("sbx-a", 5, 6, 2, 150.0, 150.0, "fwd#0")
    meters = core.snapshot("sbx-a")
    meters.state, meters.hold_until, meters.fenced = State.IDLE, 999.0, True  # not meters: not written
    before = {r.sandbox: r for r in store.sandboxes()}
    with store.transaction() as tx:
        tx.save_meters({"sbx-a": meters, "ghost": meters})
        tx.save_meters({})
        written = tx.written_version()
    after = {r.sandbox: r for r in open_store().sandboxes()}
    assert sorted(after) == ["sbx-a", "sbx-b"] and after["sbx-b"] == before["sbx-b"]
    assert after["sbx-a"].version == written != before["sbx-a"].version
    assert after["sbx-a"].state == core.snapshot("sbx-a")  # the meters, and the rest as it was
    assert (after["sbx-a"].state.open_by, after["sbx-a"].state.last_activity) == ({"fwd#0": 2}, 150.0)


def test_save_meters_without_counts_leaves_the_open_counts_as_stored(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a")
    core.on_report("sbx-a", 1, 1, 3, 150.0, 150.0, "fwd#0")
    store.save({"sbx-a": core.snapshot("sbx-a")}, [])
    core.on_report("sbx-a", 5, 6, 1, 160.0, 160.0, "fwd#0")
    with store.transaction() as tx:
        tx.save_meters({"sbx-a": core.snapshot("sbx-a"), "ghost": core.snapshot("sbx-a")}, counts=False)
    (row,) = open_store().sandboxes()
    assert (row.state.bytes_in, row.state.bytes_out, row.state.last_activity) == (6, 7, 160.0)
    assert (row.state.open_by, row.state.open_connections) == ({"fwd#0": 3}, 3)


def test_ingest_leaves_each_row_as_the_core_holds_it_whichever_columns_it_writes(open_store: Opener) -> None:
    """Batches that change bytes only, open counts, or the state (a transition), in every mix: after each
    the rows are the core's states, at the version the core holds."""
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    with store.transaction() as tx:
        sync_core(core, ["sbx-a", "sbx-b", "sbx-c"], tx.lock(["sbx-a", "sbx-b", "sbx-c"]))
        events = core.on_timer(1000.0)  # all idle: a report with bytes is a transition
        tx.save({e.sandbox: core.snapshot(e.sandbox) for e in events}, events)
    plan = [  # per batch: (bytes, open) for sbx-a, sbx-b, sbx-c
        ((1, 0), (1, 1), (0, 2)), ((1, 0), (1, 1), (0, 2)), ((0, 1), (2, 1), (0, 0)), ((5, 1), (0, 0), (0, 0)),
        ((0, 0), (0, 0), (1, 3)), ((0, 0), (0, 0), (0, 3)),
    ]
    for seq, entries in enumerate(plan, 1):
        named = zip(("sbx-a", "sbx-b", "sbx-c"), entries, strict=True)
        b = Batch(E1, seq, tuple(SandboxReport(sid, n, 2 * n, o, 0.0) for sid, (n, o) in named))
        assert ingest_batch(core, store, FWD, b, 1000.0 + seq)[0].apply
        rows = {r.sandbox: r for r in open_store().sandboxes()}
        for sid, row in rows.items():
            assert row.state == core.snapshot(sid) and row.version == core.stored_version(sid), (seq, sid)
    assert totals(store) == {"sbx-a": (7, 14), "sbx-b": (4, 8), "sbx-c": (1, 2)}
    assert {r.sandbox: r.state.open_by for r in store.sandboxes()} == {"sbx-a": {}, "sbx-b": {}, "sbx-c": {FWD: 3}}


def test_a_batch_reads_in_full_only_the_rows_another_writer_changed(
    open_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ingest_batch compares versions: with one writer it reads no row in full; a row another store object
    wrote (a hold) or removed and registered again (a new incarnation) is read, and the batch applies to
    what the store holds."""
    a, core_a = with_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    b = open_store()
    with a.transaction() as tx:
        tx_class = type(tx)
    read: list[list[str]] = []
    real_lock = tx_class.lock

    def lock(self: Any, sandboxes: Any) -> Any:
        read.append(sorted(sandboxes))
        return real_lock(self, sandboxes)

    monkeypatch.setattr(tx_class, "lock", lock)
    every = ("sbx-a", "sbx-b", "sbx-c")
    assert ingest_batch(core_a, a, FWD, batch(E1, 1, *((s, 10, 10) for s in every)), 200.0)[0].apply
    assert read == [list(every)]  # register() left the core's versions unknown: read once
    read.clear()
    assert ingest_batch(core_a, a, FWD, batch(E1, 2, *((s, 10, 10) for s in every)), 201.0)[0].apply
    assert read == []  # one writer: versions only
    core_b = load_core(b)
    register(core_b, b, "sbx-a", reg("inc-2"), 300.0)  # a new incarnation
    with b.transaction() as tx:
        sync_core(core_b, ["sbx-b"], tx.lock(["sbx-b"]))
        held = core_b.hold("sbx-b", 1000.0, 300.0)
        tx.save({"sbx-b": core_b.snapshot("sbx-b")}, held.events)
    read.clear()
    assert ingest_batch(core_a, a, FWD, batch(E1, 3, *((s, 1, 2) for s in every)), 400.0)[0].apply
    assert read == [["sbx-a", "sbx-b"]]
    rows = {r.sandbox: r for r in a.sandboxes()}
    assert rows["sbx-a"].registration.incarnation == core_a.config("sbx-a").incarnation == "inc-2"
    assert (rows["sbx-a"].state.bytes_in, rows["sbx-a"].state.bytes_out) == (1, 2)  # the new incarnation's
    assert rows["sbx-b"].state.hold_until == 1300.0 and totals(a)["sbx-b"] == totals(a)["sbx-c"] == (21, 22)
    for sid, row in rows.items():
        assert core_a.snapshot(sid) == row.state and core_a.stored_version(sid) == row.version
    read.clear()
    assert a.remove_registration("sbx-c")
    assert ingest_batch(core_a, a, FWD, batch(E1, 4, *((s, 1, 1) for s in every)), 401.0)[0].apply
    assert read == [] and "sbx-c" not in core_a and core_a.counters["report_unknown_sandbox"] == 1


# --- the ledger through ingest_batch -------------------------------------------------------------------


def test_ingest_decisions_and_exact_totals(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b")
    reader = open_store()
    want = {"sbx-a": (0, 0), "sbx-b": (0, 0)}

    def feed(b: Batch, verdict: Verdict, answer: Answer, reason: str | None) -> None:
        d, _ = ingest_batch(core, store, FWD, b, 200.0 + b.seq)
        assert (d.verdict, d.answer, d.reason) == (verdict, answer, reason)
        if d.apply:
            for r in b.sandboxes:
                if r.sandbox in want:
                    i, o = want[r.sandbox]
                    want[r.sandbox] = (i + r.bytes_in, o + r.bytes_out)
        assert totals(reader) == want
        assert {s.sandbox: s.state for s in reader.sandboxes()} == {s: core.snapshot(s) for s in want}

    feed(batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 1, 2)), Verdict.APPLY, Answer.ok(1), None)
    feed(batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 1, 2)), Verdict.DUPLICATE, Answer.ok(1), "duplicate")
    feed(batch(E1, 2, ("sbx-a", 3, 4), ("ghost", 9, 9)), Verdict.APPLY, Answer.ok(2), None)
    assert core.counters["report_unknown_sandbox"] == 1
    feed(batch(E1, 1, ("sbx-a", 10, 20)), Verdict.REPLAY, Answer.replay(2), "replay")
    feed(batch(E1, 4, ("sbx-a", 10, 20)), Verdict.GAP, Answer.gap(2), "gap")
    feed(batch(E2, 3, ("sbx-a", 10, 20)), Verdict.GAP, Answer.gap(0), "gap")
    feed(batch(E2, 1, ("sbx-b", 1000, 2000)), Verdict.APPLY, Answer.ok(1), "restart")
    feed(batch(E1, 3, ("sbx-a", 10, 20)), Verdict.STALE_EPOCH, Answer.stale_epoch(), "stale_epoch")
    feed(batch(E2, 2), Verdict.APPLY, Answer.ok(2), None)  # an empty batch applies its seq
    assert want == {"sbx-a": (13, 24), "sbx-b": (1001, 2002)}
    assert reader.ledger(FWD) == Stored(E2, 2) and reader.ledger(FWD2) is None


def test_a_stale_claim_conflicts_and_writes_nothing(open_store: Opener) -> None:
    """Two stores decide on the same record; the second claim finds it moved."""
    a, core_a = with_sandboxes(open_store, "sbx-a")
    b = open_store()
    core_b = load_core(b)
    first = batch(E1, 1, ("sbx-a", 1, 1))
    stale = decide(b.ledger(FWD), first)  # no record yet: both would apply seq 1
    ingest_batch(core_a, a, FWD, first, 101.0)
    core_b.on_report("sbx-a", 1, 1, 0, 101.0, 101.0)
    with pytest.raises(LedgerConflict):
        b.apply_batch(FWD, first, stale, {"sbx-a": core_b.snapshot("sbx-a")}, [])
    for nxt in (batch(E1, 2, ("sbx-a", 5, 5)), batch(E2, 1, ("sbx-a", 5, 5))):
        stale = decide(b.ledger(FWD), nxt)
        ingest_batch(core_a, a, FWD, nxt, 102.0)
        with pytest.raises(LedgerConflict), b.transaction() as tx:
            tx.claim(FWD, nxt, stale)
    assert totals(b) == {"sbx-a": (11, 11)} and b.ledger(FWD) == a.ledger(FWD) == Stored(E2, 1)
    with pytest.raises(LocalProtocolError):  # only an APPLY for that batch is a claim
        b.apply_batch(FWD, batch(E2, 3), decide(b.ledger(FWD), batch(E2, 3)), {}, [])


# --- open counts per source and the ledger's last-applied time ------------------------------------------


def test_open_counts_per_source_round_trip_and_are_found_by_source(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    odd = 'spiffe://t/o\'dd "%_\\#1'  # quotes, LIKE's wildcards, a backslash: matched exactly
    with store.transaction() as tx:
        core.on_report("sbx-a", 0, 0, 2, 150.0, 150.0, f"{FWD}#0")
        core.on_report("sbx-a", 0, 0, 1, 150.0, 150.0, f"{FWD}#1")
        core.on_report("sbx-b", 0, 0, 4, 150.0, 150.0, odd)
        core.on_report("sbx-c", 0, 0, 1, 150.0, 150.0, f"{FWD}#1")
        core.on_report("sbx-c", 0, 0, 0, 150.0, 151.0, f"{FWD}#1")  # closed again: no count kept
        tx.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b", "sbx-c")}, [])
    rows = {r.sandbox: r.state for r in open_store().sandboxes()}
    assert {s: (st.open_by, st.open_connections) for s, st in rows.items()} == {
        "sbx-a": ({f"{FWD}#0": 2, f"{FWD}#1": 1}, 3), "sbx-b": ({odd: 4}, 4), "sbx-c": ({}, 0)}
    assert rows == {s: core.snapshot(s) for s in rows}
    with open_store().transaction() as tx:
        assert tx.open_from(f"{FWD}#1") == ["sbx-a"] and tx.open_from(f"{FWD}#0") == ["sbx-a"]
        assert tx.open_from(odd) == ["sbx-b"]
        assert tx.open_from(FWD) == [] and tx.open_from("%") == [] and tx.open_from("") == []
    again = load_core(open_store())
    assert again.holding(f"{FWD}#1") == ["sbx-a"] and again.holding(odd) == ["sbx-b"]


def test_the_ledger_says_which_sources_went_stale(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a")
    ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 100.0)
    ingest_batch(core, store, FWD2, batch(E1, 1, ("sbx-a", 1, 1)), 200.0)
    reader = open_store()

    def stale(before: float) -> list[str]:
        with reader.transaction() as tx:
            return tx.stale_sources(before)

    assert stale(100.0) == [] and stale(150.0) == [FWD] and stale(250.0) == [FWD, FWD2]
    ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 300.0)  # a duplicate: not applied
    assert stale(250.0) == [FWD, FWD2]
    with store.transaction() as tx:
        tx.mark_forgotten(FWD)
        tx.mark_forgotten("nobody")
    assert stale(250.0) == [FWD2]
    ingest_batch(core, store, FWD, batch(E1, 2), 300.0)  # an empty batch is a sign of life too
    assert stale(250.0) == [FWD2] and stale(350.0) == [FWD, FWD2]
    with store.transaction() as tx:
        tx.mark_forgotten(FWD)
    ingest_batch(core, store, FWD, batch(E2, 1), 400.0)  # a restart: live again
    assert stale(450.0) == [FWD, FWD2] and reader.ledger(FWD) == Stored(E2, 1)


def opens(epoch: str, seq: int, *entries: tuple[str, int]) -> Batch:
    """A batch of open counts, no bytes: (sandbox, connections open at that stream)."""
    return Batch(epoch, seq, tuple(SandboxReport(s, 0, 0, n, 0.0) for s, n in entries))


def connections_sandboxes(open_store: Opener, *sids: str, period: float = 10.0) -> tuple[Store, TimerCore]:
    store = open_store()
    core = load_core(store)
    for sid in sids:
        register(core, store, sid, reg(period=period, activity="connections"), 100.0)
    return store, core


S0, S1 = f"{FWD}#0", f"{FWD}#1"  # two workers' streams of one forwarder


def test_two_streams_with_a_connection_open_each_keep_a_sandbox_active_until_both_close(
    open_store: Opener,
) -> None:
    store, core = connections_sandboxes(open_store, "sbx-a")
    assert ingest_batch(core, store, S0, opens(E1, 1, ("sbx-a", 1)), 101.0)[0].apply
    assert ingest_batch(core, store, S1, opens(E1, 1, ("sbx-a", 1)), 101.5)[0].apply
    (row,) = open_store().sandboxes()
    assert (row.state.open_by, row.state.open_connections) == ({S0: 1, S1: 1}, 2)
    assert ingest_batch(core, store, S0, opens(E1, 2, ("sbx-a", 0)), 102.0)[0].apply  # S0's one closes
    assert fire_timers(core, store, 500.0) == []  # S1's keeps it active
    reader = load_core(open_store())
    assert reader.status_of("sbx-a", 500.0).open_connections == 1 and reader.next_timer() is None
    assert ingest_batch(core, store, S1, opens(E1, 2, ("sbx-a", 0)), 600.0)[0].apply  # and S1's
    assert fire_timers(core, store, 609.0) == []
    (ev,) = fire_timers(core, store, 610.0)  # one period after the last close
    assert (ev.sandbox, ev.to_state) == ("sbx-a", State.IDLE)
    (row,) = open_store().sandboxes()
    assert (row.state.state, row.state.open_by, row.state.last_activity) == (State.IDLE, {}, 600.0)


def test_a_restarted_stream_drops_the_counts_of_its_previous_epoch(open_store: Opener) -> None:
    """Stream 0 restarts (a new epoch) without the old connections; its first batch goes to another
    replica whose core was loaded before the counts were made, so only the store knows who holds them."""
    store, core = connections_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    other = open_store()
    core_other = load_core(other)  # stale from here on: it has seen none of the counts
    ingest_batch(core, store, S0, opens(E1, 1, ("sbx-a", 2), ("sbx-b", 1)), 101.0)
    ingest_batch(core, store, S1, opens(E1, 1, ("sbx-a", 1)), 101.0)
    d, events = ingest_batch(core_other, other, S0, opens(E2, 1, ("sbx-c", 1)), 150.0)
    assert (d.verdict, d.reason, events) == (Verdict.APPLY, "restart", [])
    rows = {r.sandbox: r.state for r in open_store().sandboxes()}
    assert {s: st.open_by for s, st in rows.items()} == {"sbx-a": {S1: 1}, "sbx-b": {}, "sbx-c": {S0: 1}}
    assert rows["sbx-b"].last_activity == 150.0  # its period runs from the restart
    assert [e.sandbox for e in fire_timers(core_other, other, 160.0)] == ["sbx-b"]
    assert fire_timers(core_other, other, 10_000.0) == []  # sbx-a (S1) and sbx-c (S0's new one) held
    assert load_core(open_store()).holding(S0) == ["sbx-c"]
    # S1 restarts through the first replica, whose core is stale since the other's writes (its index
    # still names S0's old counts): what it changes is what the store holds.
    d, _ = ingest_batch(core, store, S1, opens(E2, 1), 10_001.0)
    assert d.reason == "restart" and {r.sandbox: r.state.open_by for r in store.sandboxes()} == {
        "sbx-a": {}, "sbx-b": {}, "sbx-c": {S0: 1}}


# --- transactions --------------------------------------------------------------------------------------


def test_a_transaction_that_raises_leaves_nothing(open_store: Opener) -> None:
    store, core = with_sandboxes(open_store, "sbx-a")
    ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 101.0)
    reader = open_store()
    before = everything(reader)
    with pytest.raises(RuntimeError, match="injected"), store.transaction() as tx:
        tx.lock(["sbx-a"])
        tx.put_registration("sbx-new", reg(), 102.0, core.snapshot("sbx-a"), core.register(
            SandboxConfig("sbx-new", "inc-1", 300.0), 102.0))
        events = core.on_timer(1000.0)
        tx.save({"sbx-a": core.snapshot("sbx-a")}, events)
        tx.claim(FWD, batch(E1, 2), decide(tx.ledger(FWD), batch(E1, 2)))
        assert tx.remove_registration("sbx-a")
        raise RuntimeError("injected")
    assert everything(reader) == before == everything(store)
    core = load_core(store)  # the core was ahead: rebuilt; the store works on
    d, _ = ingest_batch(core, store, FWD, batch(E1, 2, ("sbx-a", 1, 1)), 1001.0)
    assert d.apply and totals(reader) == {"sbx-a": (2, 2)}


def test_one_transaction_at_a_time_and_none_after_it_ends(open_store: Opener) -> None:
    store = open_store()
    with store.transaction() as tx:
        with pytest.raises(LocalProtocolError):
            store.remove_registration("x")  # a one-shot write is a transaction too
        assert tx.ledger(FWD) is None
        assert store.sandboxes() == []  # a read inside runs inside
    with pytest.raises(LocalProtocolError):
        tx.lock(["x"])
    assert store.remove_registration("x") is False


# --- webhooks ------------------------------------------------------------------------------------------


def idle_events(open_store: Opener, n: int) -> tuple[Store, list[int]]:
    sids = [f"sbx-{i}" for i in range(n)]
    store, core = with_sandboxes(open_store, *sids)
    events = core.on_timer(1000.0)
    ids = store.save({s: core.snapshot(s) for s in sids}, events)
    assert [e.to_state for e in events] == [State.IDLE] * n
    return store, ids


def test_webhook_leases_keep_two_owners_apart_until_they_expire(open_store: Opener) -> None:
    store, ids = idle_events(open_store, 3)
    other = open_store()
    assert [e.id for e in store.undelivered_webhooks()] == ids  # registered events are not for the webhook

    def claim(s: Store, owner: str, now: float, limit: int = 100) -> list[int]:
        return [e.id for e in s.claim_webhooks(owner, now, 30.0, limit)]

    assert claim(store, "r1", 100.0, limit=2) == ids[:2]  # leased until 130
    assert claim(other, "r2", 100.0) == ids[2:]  # until 130
    assert claim(other, "r2", 129.9) == ids[2:]  # its own again (renewed to 159.9), never r1's
    assert claim(store, "r1", 120.0) == ids[:2]  # renewed to 150
    assert claim(store, "r3", 140.0) == []  # both leases run
    assert claim(store, "r3", 150.0) == ids[:2]  # r1's ran out at 150
    assert claim(other, "r1", 151.0) == []
    store.mark_delivered(ids[:1])
    store.mark_delivered([*ids[:1], 10**9])  # again, and an id that does not exist: nothing happens
    assert [e.id for e in other.undelivered_webhooks()] == ids[1:]
    assert claim(other, "r4", 10_000.0) == ids[1:]
    events = {e.id: e.event for e in store.events_after(0)}
    assert [e.event for e in other.claim_webhooks("r4", 10_000.0, 1.0)] == [events[i] for i in ids[1:]]
    with pytest.raises(LocalProtocolError):
        store.claim_webhooks("r1", 1.0, 0.0)


def test_two_owners_claiming_at_once_never_get_the_same_event(open_store: Opener) -> None:
    _, ids = idle_events(open_store, 40)

    def deliver_all(owner: str) -> list[int]:
        """A webhook sender: claim a few, deliver them, until there are none left for it."""
        store = open_store(track=False)
        try:
            got: list[int] = []
            while claimed := [e.id for e in store.claim_webhooks(owner, 500.0, 1000.0, limit=3)]:
                got += claimed
                store.mark_delivered(claimed)
            return got
        finally:
            store.close()

    r1, r2 = both(lambda: deliver_all("r1"), lambda: deliver_all("r2"))
    assert not set(r1) & set(r2) and sorted(r1 + r2) == ids


# --- two replicas --------------------------------------------------------------------------------------

SIDS = [f"sbx-{i:02d}" for i in range(12)]


def test_two_replicas_fire_an_idle_timer_once_and_lose_no_bytes(open_store: Opener) -> None:
    """Each round both replicas ingest a batch about every sandbox from their own forwarder at once (the
    sandboxes become active), then both fire the idle timers at the same moment at once: every sandbox
    goes idle once per round, and becomes active once per round, however the two interleave."""
    setup, _ = with_sandboxes(open_store, *SIDS, now=0.0)
    rounds = 4

    def replica(fwd: str, delay: float, barrier: threading.Barrier) -> list[Event]:
        store = open_store(track=False)
        try:
            core = load_core(store)
            barrier.wait()
            made: list[Event] = []
            for r in range(rounds):
                t = 1000.0 * (r + 1)
                b = batch(E1, r + 1, *((s, 1 + r, 2 + i) for i, s in enumerate(SIDS)))
                d, evs = ingest_batch(core, store, fwd, b, t + delay)
                assert d.apply
                made += evs
                barrier.wait()
                made += fire_timers(core, store, t + 500.0)
                barrier.wait()
            return made
        finally:
            store.close()

    barrier = threading.Barrier(2, timeout=60)
    made = both(lambda: replica(FWD, 0.0, barrier), lambda: replica(FWD2, 0.25, barrier))
    stored = [e.event for e in setup.events_after(0)]
    returned = [e for m in made for e in m]
    assert Counter(stored[len(SIDS) :]) == Counter(returned)  # each event once, by the replica that made it
    for sid in SIDS:
        mine = [e.to_state for e in stored if e.sandbox == sid]
        assert mine == [State.ACTIVE] + [State.IDLE] + [State.ACTIVE, State.IDLE] * (rounds - 1)
    want = {s: (2 * sum(1 + r for r in range(rounds)), 2 * rounds * (2 + i)) for i, s in enumerate(SIDS)}
    assert totals(setup) == want


def test_two_replicas_ingesting_concurrently_lose_no_update(open_store: Opener) -> None:
    """Two forwarders' batches about the same sandboxes, ingested by two replicas as fast as they go."""
    setup, _ = with_sandboxes(open_store, "sbx-a", "sbx-b", "sbx-c")
    n = 30

    def replica(fwd: str, scale: int, ready: threading.Barrier) -> int:
        store = open_store(track=False)
        try:
            core = load_core(store)
            ready.wait()  # both cores loaded before either writes: each is stale after the other's commits
            for seq in range(1, n + 1):
                b = batch(E1, seq, ("sbx-a", scale * seq, 1), ("sbx-b", scale, seq), ("sbx-c", 1, 1))
                assert ingest_batch(core, store, fwd, b, 100.0 + seq)[0].apply
            return seq
        finally:
            store.close()

    ready = threading.Barrier(2, timeout=60)
    assert both(lambda: replica(FWD, 1, ready), lambda: replica(FWD2, 1000, ready)) == [n, n]
    tri = n * (n + 1) // 2
    assert totals(setup) == {"sbx-a": (1001 * tri, 2 * n), "sbx-b": (1001 * n, 2 * tri), "sbx-c": (2 * n, 2 * n)}
    assert setup.ledger(FWD) == setup.ledger(FWD2) == Stored(E1, n)
