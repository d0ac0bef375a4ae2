"""The SQLite store (scheduler/sqlite_store.py) and the steps that tie it to the cores (scheduler/store.py):
registrations and the ledger survive reopening; ``apply_batch`` commits all or nothing (a failing
statement in the middle, a process that dies inside the transaction, a closed connection); a batch whose
answer was lost in a crash is a duplicate after the restart; the timer core comes back as it was; and a
simulation of the real outbox, ledger and store through lost answers, failed transactions and reopenings
ends with totals equal to the bytes metered."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.ingress.feed_outbox import Outbox
from forwarder.ingress.metering import SandboxDelta
from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import (
    Answer,
    Batch,
    SandboxReport,
    epoch_start_ns,
    new_epoch,
    pull_answer,
    pull_batch,
    push_answer,
)
from sbxnet.protocol.routes import Registration, pull_registration, push_registration
from scheduler.feed_ledger import Verdict, decide
from scheduler.sqlite_store import _OPEN_FROM, SCHEMA_VERSION, SqliteStore
from scheduler.store import (
    UNATTRIBUTED,
    CoreAhead,
    LedgerConflict,
    StoreError,
    config_of,
    ingest_batch,
    load_core,
    sync_core,
)
from scheduler.timers import Event, State, TimerCore, Why

ROOT = Path(__file__).resolve().parents[2]
PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
FWD = "spiffe://sbxnet.test/forwarder"
E1 = new_epoch(1_000, bytes(8))
E2 = new_epoch(2_000, bytes(8))


def reg(incarnation: str = "inc-1", period: float = 300, activity: str = "bytes") -> Registration:
    body: dict[str, Any] = {
        "incarnation": incarnation,
        "forwarder": {"address": "10.0.3.7:8443", "spki_pin": PIN},
        "target_ip": "10.200.1.5",
        "default_port": 8080,
        "ports": {"8080": {"protocol": "http", "auth": "public"}, "22": {"protocol": "tcp", "auth": "public"}},
        "idle_period_s": period,
        "activity": activity,
    }
    return pull_registration(json.dumps(body).encode())


def register(core: TimerCore, store: SqliteStore, sid: str, r: Registration, now: float) -> list[Event]:
    """What the registry's PUT handler will do: the core first, then the store, in one transaction."""
    events = core.register(config_of(sid, r, now), now)
    store.put_registration(sid, r, core.config(sid).registered_at, core.snapshot(sid), events)
    return events


def batch(epoch: str, seq: int, *entries: tuple[str, int, int]) -> Batch:
    return Batch(epoch, seq, tuple(SandboxReport(s, i, o, 0, 0.0) for s, i, o in entries))


def totals(store: SqliteStore) -> dict[str, tuple[int, int]]:
    return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in store.sandboxes()}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "scheduler.db"


def opened(db: Path) -> tuple[SqliteStore, TimerCore]:
    store = SqliteStore(db)
    return store, load_core(store)


def with_sandboxes(db: Path, *sids: str) -> tuple[SqliteStore, TimerCore]:
    store, core = opened(db)
    for sid in sids:
        register(core, store, sid, reg(), 100.0)
    return store, core


# --- opening -------------------------------------------------------------------------------------------


def test_open_sets_wal_full_and_the_schema_version(db: Path) -> None:
    with SqliteStore(db) as store:
        c = store._conn
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert c.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    with SqliteStore(db, synchronous="NORMAL") as store:  # reopening keeps the one version row
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 1
        assert store._conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == 1


def test_a_file_of_another_schema_version_is_refused(db: Path) -> None:
    SqliteStore(db).close()
    c = sqlite3.connect(db)
    c.execute("UPDATE schema_version SET version = 99")
    c.commit()
    c.close()
    with pytest.raises(StoreError) as e:
        SqliteStore(db)
    assert e.value.reason == "schema_version"


# The schema as version 2 wrote it (version 1: the same without the events' claim columns).
SCHEMA_V2 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sandboxes (
    sandbox TEXT PRIMARY KEY, incarnation TEXT NOT NULL, registration TEXT NOT NULL, registered_at REAL NOT NULL,
    state TEXT NOT NULL, active_since REAL NOT NULL, last_activity REAL, bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL, open_connections INTEGER NOT NULL, hold_until REAL, stopped_at REAL,
    wake_from TEXT, fenced INTEGER NOT NULL
);
CREATE TABLE feed_ledger (
    identity TEXT PRIMARY KEY, epoch TEXT NOT NULL, epoch_ns INTEGER NOT NULL, last_seq INTEGER NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, sandbox TEXT NOT NULL, incarnation TEXT NOT NULL, from_state TEXT,
    to_state TEXT NOT NULL, at REAL NOT NULL, why TEXT NOT NULL, webhook INTEGER NOT NULL,
    claimed_by TEXT, claimed_until REAL
);
CREATE INDEX events_webhook_due ON events (id) WHERE webhook = 1;
"""


# What version 3 added to version 2 (open counts per source, the ledger's last-applied time), as it wrote it.
SCHEMA_V3_OVER_V2 = """
ALTER TABLE sandboxes ADD COLUMN open_by TEXT NOT NULL DEFAULT '{}';
UPDATE sandboxes SET open_by = '{"":' || open_connections || '}' WHERE open_connections > 0;
CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}';
ALTER TABLE feed_ledger ADD COLUMN applied_at REAL NOT NULL DEFAULT 0;
ALTER TABLE feed_ledger ADD COLUMN counts_forgotten INTEGER NOT NULL DEFAULT 0;
UPDATE schema_version SET version = 3;
"""

# What version 4 added to version 3 (row versions, in ``sandboxes``), as it wrote it; sbx-a written once since.
SCHEMA_V4_OVER_V3 = """
ALTER TABLE sandboxes ADD COLUMN row_version INTEGER NOT NULL DEFAULT 0;
CREATE TABLE row_versions (last INTEGER NOT NULL);
INSERT INTO row_versions (last) VALUES (0);
UPDATE sandboxes SET row_version = 3 WHERE sandbox = 'sbx-a';
UPDATE row_versions SET last = 3;
UPDATE schema_version SET version = 4;
"""


# What version 5 did to version 4 (the meters in a table of their own), as it wrote it.
SCHEMA_V5_OVER_V4 = """
CREATE TABLE meters (
    sandbox TEXT PRIMARY KEY, last_activity REAL, bytes_in INTEGER NOT NULL, bytes_out INTEGER NOT NULL,
    row_version INTEGER NOT NULL DEFAULT 0
);
INSERT INTO meters (sandbox, last_activity, bytes_in, bytes_out, row_version)
    SELECT sandbox, last_activity, bytes_in, bytes_out, row_version FROM sandboxes;
ALTER TABLE sandboxes DROP COLUMN last_activity;
ALTER TABLE sandboxes DROP COLUMN bytes_in;
ALTER TABLE sandboxes DROP COLUMN bytes_out;
ALTER TABLE sandboxes DROP COLUMN row_version;
UPDATE schema_version SET version = 5;
"""


def single_pin_body(r: Registration) -> str:
    """``r`` as versions 1 to 5 wrote it: the forwarder's one pin as ``spki_pin``."""
    obj = json.loads(push_registration(r))
    fwd = obj["forwarder"]
    (pin,) = fwd.pop("spki_pins")
    fwd["spki_pin"] = pin
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def old_file(db: Path, version: int) -> None:
    """A file as version 1, 2, 3, 4 or 5 left it: sbx-a active with two connections open (one count, no source
    before version 3), sbx-b idle with none, a ledger record, and sbx-a's idle event due to the webhook; the
    registrations with the forwarder's one pin (``spki_pin``)."""
    schema = SCHEMA_V2 if version >= 2 else SCHEMA_V2.replace(",\n    claimed_by TEXT, claimed_until REAL", "")
    body = single_pin_body(reg(activity="connections"))
    c = sqlite3.connect(db)
    c.executescript(schema)
    c.execute("INSERT INTO schema_version VALUES (?)", (version,))
    sql = "INSERT INTO sandboxes VALUES (?, 'inc-1', ?, 100.0, ?, 100.0, 150.0, 7, 8, ?, NULL, NULL, NULL, 0)"
    c.execute(sql, ("sbx-a", body, "active", 2))
    c.execute(sql, ("sbx-b", body, "idle", 0))
    c.execute("INSERT INTO feed_ledger VALUES (?, ?, ?, 3)", (FWD, E1, epoch_start_ns(E1)))
    c.execute("INSERT INTO events (sandbox, incarnation, from_state, to_state, at, why, webhook) "
              "VALUES ('sbx-b', 'inc-1', 'active', 'idle', 400.0, 'idle_timer', 1)")
    c.commit()
    if version >= 3:
        c.executescript(SCHEMA_V3_OVER_V2)
    if version >= 4:
        c.executescript(SCHEMA_V4_OVER_V3)
    if version == 5:
        c.executescript(SCHEMA_V5_OVER_V4)
    c.close()


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_an_older_file_is_migrated_with_its_rows(db: Path, version: int) -> None:
    old_file(db, version)
    with SqliteStore(db) as store:
        assert store._conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        # Every registration as this build writes it: the forwarder's pin as a set of one (spki_pins).
        want = push_registration(reg(activity="connections")).decode()
        assert '"spki_pins":' in want
        assert store._conn.execute("SELECT registration FROM sandboxes").fetchall() == [(want,), (want,)]
        assert {r.sandbox: r.registration.forwarder.spki_pins for r in store.sandboxes()} == {
            "sbx-a": (PIN,), "sbx-b": (PIN,)}
        rows = {r.sandbox: r.state for r in store.sandboxes()}
        # The one count is the unattributed source's: the rest of the state is as it was.
        assert (rows["sbx-a"].open_by, rows["sbx-a"].open_connections) == ({UNATTRIBUTED: 2}, 2)
        assert (rows["sbx-a"].bytes_in, rows["sbx-a"].last_activity, rows["sbx-a"].state) == (7, 150.0, State.ACTIVE)
        assert (rows["sbx-b"].open_by, rows["sbx-b"].state) == ({}, State.IDLE)
        with store.transaction() as tx:
            assert tx.open_from(UNATTRIBUTED) == ["sbx-a"] and tx.open_from(FWD) == []
            assert tx.stale_sources(1.0) == [FWD]  # applied_at 0: the service's start grace covers it
        core = load_core(store)
        assert core.holding(UNATTRIBUTED) == ["sbx-a"] and core.next_timer() is None  # held open; sbx-b idle
        # Row versions: 0 for the rows there before version 4, handed out from 1 (version 4's kept, and
        # handed out after its last).
        a_was, last = (3, 3) if version >= 4 else (0, 0)
        assert {r.sandbox: r.version for r in store.sandboxes()} == {"sbx-a": a_was, "sbx-b": 0}
        assert core.stored_version("sbx-b") == 0
        assert ingest_batch(core, store, FWD, batch(E1, 4, ("sbx-b", 1, 1)), 500.0)[0].apply
        assert {r.sandbox: r.version for r in store.sandboxes()} == {"sbx-a": a_was, "sbx-b": last + 1}
        assert core.stored_version("sbx-b") == last + 1
        assert {r.sandbox: (r.state.bytes_in, r.state.bytes_out) for r in store.sandboxes()} == {
            "sbx-a": (7, 8), "sbx-b": (8, 9)}
        with store.transaction() as tx:
            assert tx.stale_sources(400.0) == []
        (due,) = store.claim_webhooks("r1", 1001.0, 30.0)  # version 1's events got the claim columns
        assert due.event.sandbox == "sbx-b" and store.claim_webhooks("r2", 1001.0, 30.0) == []
    with SqliteStore(db) as store:  # reopened: nothing is migrated twice
        assert store._conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert {r.sandbox: r.state.open_by for r in store.sandboxes()} == {"sbx-a": {"": 2}, "sbx-b": {}}


def test_the_pin_migration_leaves_a_registration_it_cannot_read_as_it_was(db: Path) -> None:
    """A row whose stored registration does not decode was unreadable before version 6 too: the migration
    keeps its text (nothing lost) and rewrites the others; reading it is the same store error as before."""
    old_file(db, 5)
    c = sqlite3.connect(db)
    c.execute("UPDATE sandboxes SET registration = ? WHERE sandbox = 'sbx-b'", ('{"not": "a registration"}',))
    c.commit()
    c.close()
    with SqliteStore(db) as store:
        rows = dict(store._conn.execute("SELECT sandbox, registration FROM sandboxes").fetchall())
        assert rows == {"sbx-a": push_registration(reg(activity="connections")).decode(),
                        "sbx-b": '{"not": "a registration"}'}
        with pytest.raises(StoreError) as e:
            store.sandboxes()
        assert e.value.reason == "bad_row" and "sbx-b" in e.value.detail


def test_a_row_whose_open_counts_do_not_parse_is_a_store_error(db: Path) -> None:
    with_sandboxes(db, "sbx-a")[0].close()
    for text in ('{"fwd#0":0}', '{"fwd#0":true}', '["fwd#0"]', "{not json", '{"fwd#0":1.5}'):
        c = sqlite3.connect(db)
        c.execute("UPDATE sandboxes SET open_by = ?", (text,))
        c.commit()
        c.close()
        with SqliteStore(db) as store, pytest.raises(StoreError) as e:
            store.sandboxes()
        assert e.value.reason == "bad_row" and "open_by" in e.value.detail


def test_open_counts_are_stored_as_sorted_json_and_found_by_source(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a", "sbx-b", "sbx-c")
    with store.transaction() as tx:
        core.on_report("sbx-b", 0, 0, 2, 150.0, 150.0, "spiffe://f/2#1")
        core.on_report("sbx-b", 0, 0, 1, 150.0, 150.0, 'odd "name" % _ #0')
        core.on_report("sbx-a", 0, 0, 3, 150.0, 150.0, "spiffe://f/2#1")
        tx.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b")}, [])
    texts = dict(store._conn.execute("SELECT sandbox, open_by FROM sandboxes").fetchall())
    assert texts == {"sbx-a": '{"spiffe://f/2#1":3}', "sbx-b": '{"odd \\"name\\" % _ #0":1,"spiffe://f/2#1":2}',
                     "sbx-c": "{}"}
    with store.transaction() as tx:
        assert tx.open_from("spiffe://f/2#1") == ["sbx-a", "sbx-b"]
        assert tx.open_from('odd "name" % _ #0') == ["sbx-b"]
        assert tx.open_from("spiffe://f/2#") == [] and tx.open_from("%") == []
    plan = " ".join(str(r[-1]) for r in store._conn.execute("EXPLAIN QUERY PLAN " + _OPEN_FROM, ("x",)))
    assert "sandboxes_open" in plan  # the partial index: the rows with a count, not the fleet
    store.close()


def test_bad_settings_and_unopenable_paths(tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError):
        SqliteStore(tmp_path / "x.db", synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(StoreError):
        SqliteStore(tmp_path / "no" / "such" / "dir.db")
    with pytest.raises(StoreError) as e:
        SqliteStore(":memory:")  # no WAL without a file
    assert e.value.reason == "not_wal"


# --- registrations -------------------------------------------------------------------------------------


def test_registrations_round_trip_and_survive_reopening(db: Path) -> None:
    store, core = opened(db)
    a, b = reg("inc-a", 60, "connections"), reg("inc-b", 300)
    register(core, store, "sbx-b", b, 5.0)
    register(core, store, "sbx-a", a, 7.0)
    store.close()
    with SqliteStore(db) as store:
        rows = store.sandboxes()
        assert [(r.sandbox, r.registration, r.registered_at) for r in rows] == [("sbx-a", a, 7.0), ("sbx-b", b, 5.0)]
        assert rows[0].config() == core.config("sbx-a") and rows[0].state == core.snapshot("sbx-a")
        # A new incarnation replaces the row and its state.
        core2 = load_core(store)
        core2.on_report("sbx-a", 10, 20, 0, 8.0, 8.0)
        store.save({"sbx-a": core2.snapshot("sbx-a")}, [])
        register(core2, store, "sbx-a", reg("inc-a2"), 9.0)
        assert store.remove_registration("sbx-b") and not store.remove_registration("sbx-b")
    with SqliteStore(db) as store:
        (row,) = store.sandboxes()
        assert (row.registration.incarnation, row.registered_at, row.state.bytes_in) == ("inc-a2", 9.0, 0)


def test_events_have_increasing_ids_and_webhooks_are_tracked(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a")
    evs = core.on_timer(1000.0) + core.wake("sbx-a", 1001.0).events
    ids = store.save({"sbx-a": core.snapshot("sbx-a")}, evs)
    assert [e.to_state for e in evs] == [State.IDLE, State.WAKING]
    store.close()
    with SqliteStore(db) as store:
        every = store.events_after(0)
        assert [e.id for e in every] == sorted(e.id for e in every) and [e.id for e in every][1:] == ids
        assert [e.event for e in every][1:] == evs and every[0].event.why is Why.REGISTERED
        assert [e.event for e in store.events_after(ids[0])] == evs[1:]
        assert [e.id for e in store.undelivered_webhooks()] == ids  # idle and waking
        store.mark_delivered(ids[:1])
        assert [e.id for e in store.undelivered_webhooks()] == ids[1:]
        store._conn.execute("DELETE FROM events")  # ids are never reused, even after pruning
        assert store.save({}, evs[:1])[0] > ids[-1]


# --- the ledger ----------------------------------------------------------------------------------------


def test_the_ledger_record_survives_reopening(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a")
    assert store.ledger(FWD) is None
    for seq in (1, 2, 3):
        d, _ = ingest_batch(core, store, FWD, batch(E1, seq, ("sbx-a", 1, 2)), 200.0)
        assert d.verdict is Verdict.APPLY
    store.close()
    store, core = opened(db)
    assert store.ledger(FWD) is not None and (store.ledger(FWD).epoch, store.ledger(FWD).last_seq) == (E1, 3)  # type: ignore[union-attr]
    assert ingest_batch(core, store, FWD, batch(E2, 1, ("sbx-a", 1, 2)), 201.0)[0].reason == "restart"
    store.close()
    with SqliteStore(db) as store:
        rec = store.ledger(FWD)
        assert rec is not None and (rec.epoch, rec.last_seq) == (E2, 1)
        assert store.ledger("another") is None
        assert totals(store) == {"sbx-a": (4, 8)}


def test_apply_batch_takes_only_the_apply_decision_for_that_batch(db: Path) -> None:
    with SqliteStore(db) as store:
        b1 = batch(E1, 1)
        with pytest.raises(LocalProtocolError):
            store.apply_batch(FWD, b1, decide(None, batch(E1, 2)), {}, [])  # a gap
        with pytest.raises(LocalProtocolError):
            store.apply_batch(FWD, batch(E2, 1), decide(None, b1), {}, [])  # another batch's
        assert store.ledger(FWD) is None


def test_a_claim_on_a_record_that_moved_conflicts_and_writes_nothing(db: Path) -> None:
    """Two writers on one file (what two replicas on PostgreSQL will be): both decide on the same record,
    the second claim fails, and nothing of its batch is written."""
    a, core_a = with_sandboxes(db, "sbx-a")
    b, core_b = opened(db)
    ingest_batch(core_a, a, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 101.0)
    for first in (batch(E1, 2, ("sbx-a", 5, 5)), batch(E2, 1, ("sbx-a", 5, 5))):
        stale = decide(b.ledger(FWD), first)
        ingest_batch(core_a, a, FWD, first, 102.0)
        with pytest.raises(LedgerConflict):
            b.apply_batch(FWD, first, stale, {"sbx-a": core_b.snapshot("sbx-a")}, [])
    assert totals(b) == {"sbx-a": (11, 11)} and b.ledger(FWD) == a.ledger(FWD)
    # An epoch's first batch over a record of a newer epoch does not claim it either.
    with pytest.raises(LedgerConflict):
        b.apply_batch(FWD, batch(E1, 1), decide(None, batch(E1, 1)), {}, [])
    a.close()
    b.close()


@pytest.mark.parametrize(("most", "n"), [(0, 11), (8, 9), (8, 11), (8, 8), (16, 31), (512, 7), (512, 700)])
def test_the_meters_of_a_batch_are_written_whatever_the_rows_per_statement(db: Path, most: int, n: int) -> None:
    """A batch's traffic meters go out in chunks of a power of two rows per UPDATE ... FROM (VALUES ...)
    statement, up to ``most`` (0: one UPDATE per row, as where SQLite binds too few parameters or is older
    than 3.33), the rest one row a statement: every row gets its own values and the batch's version,
    whatever the chunks, and the others keep theirs."""
    sids = [f"sbx-{i:03d}" for i in range(n)]
    store, core = with_sandboxes(db, *sids, "sbx-other")
    store._traffic_rows = most
    before = store.sandbox("sbx-other")
    for seq in (1, 2):
        entries = [(sid, seq * 10 + i, 1000 * seq + i) for i, sid in enumerate(sids)]
        assert ingest_batch(core, store, FWD, batch(E1, seq, *entries, ("ghost", 5, 5)), 200.0 + seq)[0].apply
    version = store.sandbox(sids[0]).version  # type: ignore[union-attr]
    store.close()
    reopened, _ = opened(db)
    rows = {s.sandbox: s for s in reopened.sandboxes()}
    assert totals(reopened) == {
        **{sid: (10 + 20 + 2 * i, 3000 + 2 * i) for i, sid in enumerate(sids)}, "sbx-other": (0, 0)}
    assert {rows[sid].version for sid in sids} == {version} and rows["sbx-other"] == before
    assert {rows[sid].state.last_activity for sid in sids} == {202.0}


def test_row_versions_are_read_again_only_after_another_connection_committed(db: Path) -> None:
    """With one writer a batch reads no row: lock_versions answers from what this connection read and
    wrote (PRAGMA data_version says nobody else committed). A commit on another connection, or a
    transaction of this one that rolled back, makes it read the versions again; the batch then applies
    to what the other connection wrote."""
    a, core = with_sandboxes(db, "sbx-a", "sbx-b")
    statements: list[str] = []
    a._conn.set_trace_callback(statements.append)
    reads = lambda: [q for q in statements  # noqa: E731
                     if q.startswith("SELECT") and ("FROM meters WHERE sandbox IN" in q or "WHERE s.sandbox IN" in q)]
    b1 = batch(E1, 1, ("sbx-a", 1, 1), ("sbx-b", 1, 1))
    assert ingest_batch(core, a, FWD, b1, 200.0)[0].apply
    assert len(reads()) == 1  # the rows: this connection wrote their versions, but the core holds none
    statements.clear()
    for seq in (2, 3):
        assert ingest_batch(core, a, FWD, batch(E1, seq, ("sbx-a", 1, 1), ("sbx-b", 1, 1)), 200.0 + seq)[0].apply
    assert reads() == []
    b, core_b = opened(db)  # another connection holds sbx-b
    with b.transaction() as tx:
        sync_core(core_b, ["sbx-b"], tx.lock(["sbx-b"]))
        held = core_b.hold("sbx-b", 1000.0, 210.0)
        tx.save({"sbx-b": core_b.snapshot("sbx-b")}, held.events)
    statements.clear()
    assert ingest_batch(core, a, FWD, batch(E1, 4, ("sbx-a", 1, 1), ("sbx-b", 1, 1)), 220.0)[0].apply
    assert len(reads()) == 2 and "row_version FROM" in reads()[0]  # the versions, then sbx-b's row alone
    assert core.snapshot("sbx-b").hold_until == 1210.0 and totals(a)["sbx-b"] == (4, 4)
    statements.clear()
    with pytest.raises(RuntimeError), a.transaction() as tx:
        tx.save({"sbx-a": core.snapshot("sbx-a")}, [])
        raise RuntimeError("rolled back")
    assert ingest_batch(core, a, FWD, batch(E1, 5, ("sbx-a", 1, 1), ("sbx-b", 1, 1)), 230.0)[0].apply
    assert len(reads()) == 1  # the versions again: every one the core's
    assert totals(a) == {"sbx-a": (5, 5), "sbx-b": (5, 5)} and load_core(b).status(231.0) == core.status(231.0)
    b.close()
    a.close()


def fire_timers(core: TimerCore, store: SqliteStore, now: float) -> list[Event]:
    """The service's pattern for an idle timer: lock the sandboxes the core thinks are due, restore what
    the store holds, run the timers, save what changed."""
    with store.transaction() as tx:
        due = [s.sandbox for s in core.status(now) if s.idle_in_s == 0.0]
        sync_core(core, due, tx.lock(due))
        events = core.on_timer(now)
        tx.save({e.sandbox: core.snapshot(e.sandbox) for e in events}, events)
    return events


def test_two_stores_on_one_file_interleaved_lose_no_update_and_fire_once(db: Path) -> None:
    """Two replicas on one file, each with its own core, a cache that is stale after the other's writes:
    their transactions alternate (batches from two forwarders about the same sandboxes, holds, timers),
    each starts from the other's commit, so the totals are exact and each idle timer fires once."""
    a, core_a = with_sandboxes(db, "sbx-a", "sbx-b")
    b, core_b = opened(db)
    fwd2 = "spiffe://sbxnet.test/forwarder-2"
    want = {"sbx-a": [0, 0], "sbx-b": [0, 0]}
    for i in range(1, 21):
        store, core, fwd = (a, core_a, FWD) if i % 2 else (b, core_b, fwd2)
        d, _ = ingest_batch(core, store, fwd, batch(E1, (i + 1) // 2, ("sbx-a", i, 2 * i), ("sbx-b", 1, 0)), 100.0 + i)
        assert d.verdict is Verdict.APPLY
        want["sbx-a"][0] += i
        want["sbx-a"][1] += 2 * i
        want["sbx-b"][0] += 1
    assert totals(a) == totals(b) == {k: tuple(v) for k, v in want.items()}
    with a.transaction() as tx:  # a hold through the pattern, on the stale core of a
        sync_core(core_a, ["sbx-b"], tx.lock(["sbx-b"]))
        held = core_a.hold("sbx-b", 1000.0, 121.0)
        tx.save({"sbx-b": core_a.snapshot("sbx-b")}, held.events)
    assert totals(a)["sbx-b"] == (20, 0)  # the hold wrote the bytes b's batches added, not a stale count
    fired_b = fire_timers(core_b, b, 1000.0)  # b's core does not know the hold: sbx-b looks due to it
    fired_a = fire_timers(core_a, a, 1000.0)
    assert [e.sandbox for e in fired_b] == ["sbx-a"] and fired_a == []
    assert [e.sandbox for e in fire_timers(core_b, b, 2000.0)] == ["sbx-b"]  # the hold's end + 300 s passed
    idle = [e.event.sandbox for e in a.events_after(0) if e.event.to_state is State.IDLE]
    assert sorted(idle) == ["sbx-a", "sbx-b"]
    assert fire_timers(core_a, a, 3000.0) == []
    assert [s.state for s in b.sandboxes()] == [core_a.snapshot("sbx-a"), core_a.snapshot("sbx-b")]
    a.close()
    b.close()


def test_a_transaction_rolls_back_on_an_exception_and_refuses_nesting(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a")
    before = snapshot_db(store)
    with pytest.raises(RuntimeError, match="injected"), store.transaction() as tx:
        tx.save({"sbx-a": core.snapshot("sbx-a")}, core.on_timer(1000.0))
        tx.claim(FWD, batch(E1, 1), decide(None, batch(E1, 1)))
        raise RuntimeError("injected")
    assert snapshot_db(store) == before and not store._conn.in_transaction
    with store.transaction() as tx:
        with pytest.raises(LocalProtocolError):
            store.save({}, [])
        assert tx.lock(["sbx-a", "nope", "sbx-a"]).keys() == {"sbx-a"}
    with pytest.raises(LocalProtocolError):
        tx.lock(["sbx-a"])  # the transaction has ended
    store.close()


# --- atomicity -----------------------------------------------------------------------------------------

TRIGGERS = {
    "ledger": ["AFTER INSERT ON feed_ledger", "AFTER UPDATE ON feed_ledger"],
    "sandboxes": ["AFTER UPDATE ON sandboxes"],
    "meters": ["AFTER UPDATE ON meters"],
    "events": ["AFTER INSERT ON events"],
}


def snapshot_db(store: SqliteStore) -> tuple[object, ...]:
    c = store._conn
    return tuple(
        c.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("sandboxes", "meters", "feed_ledger", "events")
    )


@pytest.mark.parametrize("where", sorted(TRIGGERS))
@pytest.mark.parametrize("first", [True, False])
def test_apply_batch_is_all_or_nothing(db: Path, where: str, first: bool) -> None:
    """A statement fails in the middle of the transaction (the ledger claim, a sandbox's update, an event's
    insert): the totals, the ledger and the events are as before, and the same batch applies afterwards."""
    store, core = with_sandboxes(db, "sbx-a", "sbx-b")
    if not first:
        ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 150.0)
    b = batch(E1, 1 if first else 2, ("sbx-a", 10, 20), ("sbx-b", 30, 40))
    core.on_timer(1000.0)  # both idle: the batch makes events (traffic -> active)
    store.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b")}, [])
    before = snapshot_db(store)
    for i, on in enumerate(TRIGGERS[where]):
        store._conn.execute(f"CREATE TEMP TRIGGER fail{i} {on} BEGIN SELECT RAISE(ABORT, 'injected'); END")
    with pytest.raises(CoreAhead):
        ingest_batch(core, store, FWD, b, 1001.0)
    assert snapshot_db(store) == before
    assert not store._conn.in_transaction
    for i in range(len(TRIGGERS[where])):
        store._conn.execute(f"DROP TRIGGER fail{i}")
    core = load_core(store)  # the core was ahead of the store: rebuilt
    d, events = ingest_batch(core, store, FWD, b, 1002.0)
    assert d.apply and len(events) == 2
    assert totals(store) == {"sbx-a": (10 + (0 if first else 1), 20 + (0 if first else 1)), "sbx-b": (30, 40)}
    store.close()


def test_a_closed_connection_fails_cleanly(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a")
    b = batch(E1, 1, ("sbx-a", 1, 1))
    d = decide(store.ledger(FWD), b)
    core.on_report("sbx-a", 1, 1, 0, 101.0, 101.0)
    store._conn.close()
    with pytest.raises(StoreError):
        store.apply_batch(FWD, b, d, {"sbx-a": core.snapshot("sbx-a")}, [])
    with pytest.raises(StoreError):  # before the core was touched: a plain StoreError, not CoreAhead
        ingest_batch(core, store, FWD, b, 101.0)
    with SqliteStore(db) as store:
        assert store.ledger(FWD) is None and totals(store) == {"sbx-a": (0, 0)}


CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from sbxnet.protocol.feed import Batch, SandboxReport
    from scheduler.sqlite_store import SqliteStore
    from scheduler.store import ingest_batch, load_core

    store = SqliteStore(sys.argv[2])
    core = load_core(store)
    mode, epoch, seq = sys.argv[3], sys.argv[4], int(sys.argv[5])
    if mode == "inside":  # the process dies in the middle of the transaction, after some writes
        store._conn.create_function("die", 0, lambda: os._exit(9))
        store._conn.execute("CREATE TEMP TRIGGER die AFTER INSERT ON events BEGIN SELECT die(); END")
    b = Batch(epoch, seq, (SandboxReport("sbx-a", 10, 20, 0, 0.0), SandboxReport("sbx-b", 30, 40, 0, 0.0)))
    decision, events = ingest_batch(core, store, "spiffe://sbxnet.test/forwarder", b, 1001.0)
    os._exit(7 if decision.apply else 8)  # SIGKILL-like: the answer never reaches the forwarder
    """
)


def child(db: Path, mode: str, b: Batch) -> int:
    args = [sys.executable, "-c", CHILD, str(ROOT), str(db), mode, b.epoch, str(b.seq)]
    return subprocess.run(args, timeout=60).returncode


def idle_both(db: Path) -> None:
    store, core = with_sandboxes(db, "sbx-a", "sbx-b")
    events = core.on_timer(1000.0)
    assert len(events) == 2
    store.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b")}, events)
    store.close()


def test_a_process_that_dies_inside_the_transaction_applies_nothing(db: Path) -> None:
    idle_both(db)
    with SqliteStore(db) as store:
        before = snapshot_db(store)
    b = batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 30, 40))
    assert child(db, "inside", b) == 9
    with SqliteStore(db) as store:
        assert snapshot_db(store) == before
        d, events = ingest_batch(load_core(store), store, FWD, b, 1002.0)  # the forwarder's resend
        assert d.apply and [e.to_state for e in events] == [State.ACTIVE, State.ACTIVE]
        assert totals(store) == {"sbx-a": (10, 20), "sbx-b": (30, 40)}


def test_exactly_once_across_a_restart_whose_answer_was_lost(db: Path) -> None:
    """The scheduler commits the batch and dies before its answer goes out; restarted, it gets the same
    batch again (the forwarder resends it byte for byte): a duplicate, acknowledged, not applied again."""
    idle_both(db)
    b = batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 30, 40))
    assert child(db, "after", b) == 7
    with SqliteStore(db) as store:
        after = snapshot_db(store)
        core = load_core(store)
        assert totals(store) == {"sbx-a": (10, 20), "sbx-b": (30, 40)}
        assert core.state_of("sbx-a") is State.ACTIVE
        d, events = ingest_batch(core, store, FWD, b, 1003.0)
        assert d.verdict is Verdict.DUPLICATE and d.answer == Answer.ok(1) and events == []
        assert snapshot_db(store) == after and core.snapshot("sbx-a").bytes_in == 10
    assert child(db, "after", b) == 8  # and again from another process


# --- the timer core's state ----------------------------------------------------------------------------


def test_timer_state_restored_after_reopening_is_the_same(db: Path) -> None:
    store, core = opened(db)
    for i, (period, policy) in enumerate([(30, "bytes"), (60, "connections"), (45, "bytes"), (90, "bytes")]):
        register(core, store, f"sbx-{i}", reg(f"inc-{i}", period, policy), 10.0 + i)
    sids = [f"sbx-{i}" for i in range(4)]

    def persist(events: list[Event]) -> None:
        store.save({s: core.snapshot(s) for s in sids}, events)

    persist(core.on_report("sbx-0", 100, 2000, 1, 20.0, 20.5))
    persist(core.on_report("sbx-1", 5, 5, 2, 21.0, 21.0))  # held open by its connections
    persist(core.hold("sbx-2", 500, 22.0).events)
    persist(core.on_timer(200.0))  # sbx-0 and sbx-3 idle
    persist(core.driver_stopping("sbx-3", 201.0).events)
    persist(core.driver_stopped("sbx-3", 202.0).events)
    persist(core.wake("sbx-0", 203.0).events)
    store.close()
    with SqliteStore(db) as store2:
        again = load_core(store2)
    assert again.next_timer() == core.next_timer() is not None
    assert again.status(250.0) == core.status(250.0)
    assert [again.snapshot(s) for s in sids] == [core.snapshot(s) for s in sids]
    assert [again.config(s) for s in sids] == [core.config(s) for s in sids]
    assert again.on_timer(1000.0) == core.on_timer(1000.0)
    assert again.driver_ready("sbx-0", 1001.0) == core.driver_ready("sbx-0", 1001.0)


# --- the simulation ------------------------------------------------------------------------------------

SIDS = ("sbx-a", "sbx-b", "sbx-c")
FATES = ("ok", "ok", "ok", "lost_request", "lost_answer", "http_500", "tx_fails", "crash_after_commit", "duplicate")


class Sim:
    """A forwarder's outbox feeding a scheduler (TimerCore + ledger + SqliteStore) through lost answers,
    failed transactions, crashes after commit and reopenings of the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.now = 100.0
        self.clock_ns = 1_000
        self.rng = random.Random(0)
        self.ob = Outbox(self.new_epoch, random.Random(0))
        self.store, self.core = with_sandboxes(path, *SIDS)
        self.moved: Counter[tuple[str, str]] = Counter()
        self.stash: list[bytes] = []
        self.reopens = 0

    def new_epoch(self) -> str:
        self.clock_ns += 1
        return new_epoch(self.clock_ns, self.rng.randbytes(8))

    def reopen(self) -> None:
        self.store.close()
        self.store, self.core = opened(self.path)
        self.reopens += 1

    def receive(self, body: bytes) -> Answer:
        return ingest_batch(self.core, self.store, FWD, pull_batch(body), self.now)[0].answer

    def traffic(self, i: int, up: int, down: int) -> None:
        sid = SIDS[i % len(SIDS)]
        self.now += 0.5
        self.ob.add({sid: SandboxDelta(up, down, 0, self.now, 0.0)}, self.now)
        self.moved[(sid, "in")] += up
        self.moved[(sid, "out")] += down

    def send(self, fate: str) -> None:
        w = self.ob.wake_at()
        if w is None:
            return
        self.now = max(self.now, w)
        assert self.ob.next_batch(self.now) is not None
        body = self.ob.in_flight_body
        assert body is not None
        if fate in ("lost_request", "http_500"):
            if fate == "lost_request":
                self.stash.append(body)
            self.ob.on_failure(self.now, fate)
            return
        if fate == "tx_fails":
            for name, on in (("f", "INSERT ON events"), ("g", "UPDATE ON sandboxes")):
                self.store._conn.execute(f"CREATE TEMP TRIGGER {name} AFTER {on} BEGIN SELECT RAISE(ABORT, 'x'); END")
            try:
                answer = self.receive(body)  # a duplicate writes nothing, so nothing fails
            except CoreAhead:
                self.core = load_core(self.store)  # what the adapter does on CoreAhead (it answers 500)
                self.ob.on_failure(self.now, "http_500")
                return
            finally:
                self.store._conn.execute("DROP TRIGGER f")
                self.store._conn.execute("DROP TRIGGER g")
        else:
            answer = self.receive(body)
        if fate == "duplicate":
            answer = self.receive(body)
        if fate in ("lost_answer", "crash_after_commit"):
            if fate == "crash_after_commit":
                self.reopen()
            self.ob.on_failure(self.now, "timeout")
            return
        self.ob.on_answer(pull_answer(push_answer(answer), answer.http_status), self.now)

    def replay(self, i: int) -> None:
        if self.stash:
            self.receive(self.stash[i % len(self.stash)])

    def drain(self) -> None:
        for _ in range(1000):
            if self.ob.wake_at() is None:
                break
            self.send("ok")
        assert self.ob.in_flight is None and self.ob.pending_count == 0

    def check(self) -> None:
        stored = {s.sandbox: s.state for s in self.store.sandboxes()}
        for sid in SIDS:
            assert (stored[sid].bytes_in, stored[sid].bytes_out) == (self.moved[(sid, "in")], self.moved[(sid, "out")])
            assert stored[sid] == self.core.snapshot(sid)  # the core and the store agree


OPS = st.one_of(
    st.tuples(st.just("traffic"), st.integers(0, 5), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("send"), st.sampled_from(FATES)),
    st.tuples(st.just("send"), st.sampled_from(FATES)),
    st.tuples(st.just("replay"), st.integers(0, 50)),
    st.tuples(st.just("reopen")),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, min_size=5, max_size=60))
def test_simulation_totals_equal_bytes_metered_across_reopenings(ops: list[tuple[object, ...]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        sim = Sim(Path(d) / "s.db")
        try:
            for op in ops:
                getattr(sim, str(op[0]))(*op[1:])
            sim.drain()
            sim.reopen()
            sim.check()
        finally:
            sim.store.close()


def test_simulation_directed_every_fate_then_reopen(tmp_path: Path) -> None:
    sim = Sim(tmp_path / "s.db")
    for i, fate in enumerate(FATES * 3):
        sim.traffic(i, 1000 + i, 7 * i)
        sim.send(fate)
        if i % 4 == 3:
            sim.reopen()
    sim.replay(0)
    sim.drain()
    sim.reopen()
    sim.check()
    assert sim.reopens >= 6
    sim.store.close()
