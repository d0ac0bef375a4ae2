"""What is particular to the PostgreSQL store (scheduler/pg_store.py), on a real throw-away server
(tests/scheduler/pg_support.py; skipped with the reason where none can start). The contract both stores
meet is tests/scheduler/test_store_contract.py.

Two replicas that both find no ledger record claim seq 1 once (the second waits on the first's lock and
conflicts); event ids become visible in commit order; a failing statement rolls a batch back; a lock
wait is bounded; webhook claims skip rows another transaction holds; replicas starting together create
the schema once; a schema of another version is refused; and the store fails with a clear reason while
the server is down and works again, with nothing lost or doubled, once it is back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pg_support
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store_contract import E1, FWD, FWD2, PIN, batch, both, reg, register, totals

from sbxnet.protocol.feed import epoch_start_ns
from sbxnet.protocol.routes import Registration, push_registration
from scheduler.feed_ledger import Stored, Verdict, decide
from scheduler.pg_store import _OPEN_FROM, SCHEMA_VERSION, PgStore, _id_array, _number_array
from scheduler.store import UNATTRIBUTED, CoreAhead, LedgerConflict, StoreError, ingest_batch, load_core, sync_core
from scheduler.timers import State, TimerCore


@pytest.fixture(scope="session")
def pg_server() -> pg_support.PgServer:
    try:
        return pg_support.shared_server()
    except pg_support.PgUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def dsn(pg_server: pg_support.PgServer) -> str:
    return pg_support.fresh_schema(pg_server)


@pytest.fixture
def stores(dsn: str) -> Iterator[list[PgStore]]:
    """Opened stores, closed after the test."""
    opened: list[PgStore] = []
    yield opened
    for s in opened:
        s.close()


def open_with(stores: list[PgStore], dsn: str, *sids: str, **kw: float) -> tuple[PgStore, TimerCore]:
    store = PgStore(dsn, **kw)
    stores.append(store)
    core = load_core(store)
    for sid in sids:
        register(core, store, sid, reg(), 100.0)
    return store, core


def blocked(t: threading.Thread, for_s: float = 0.5) -> bool:
    t.join(for_s)
    return t.is_alive()


def test_two_replicas_finding_no_record_apply_seq_1_once(dsn: str, stores: list[PgStore]) -> None:
    """Replica A holds its transaction open after claiming seq 1; replica B's ingest of the same batch
    waits on A's row locks, then starts from A's commit, and its claim conflicts: the bytes count once,
    and the forwarder's resend to B is a duplicate."""
    a, core_a = open_with(stores, dsn, "sbx-a", "sbx-b")
    b, core_b = open_with(stores, dsn)
    first = batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 1, 2))
    outcome: list[BaseException | object] = []

    def replica_b() -> None:
        try:
            outcome.append(ingest_batch(core_b, b, FWD, first, 201.0))
        except BaseException as e:
            outcome.append(e)

    with a.transaction() as tx:
        d = decide(tx.ledger(FWD), first)
        assert d.apply and tx.ledger(FWD) is None
        sids = ["sbx-a", "sbx-b"]
        sync_core(core_a, sids, tx.lock(sids))
        for r in first.sandboxes:
            core_a.on_report(r.sandbox, r.bytes_in, r.bytes_out, r.open, 200.0, 200.0)
        tx.claim(FWD, first, d)
        tx.save({s: core_a.snapshot(s) for s in sids}, [])
        t = threading.Thread(target=replica_b)
        t.start()
        assert blocked(t)  # B read no record either, and waits on A's locks
    t.join(30)
    (err,) = outcome
    assert isinstance(err, CoreAhead) and isinstance(err.__cause__, LedgerConflict)
    assert totals(b) == {"sbx-a": (10, 20), "sbx-b": (1, 2)} and b.ledger(FWD) == Stored(E1, 1)
    core_b = load_core(b)  # what the feed adapter does on CoreAhead
    d, _ = ingest_batch(core_b, b, FWD, first, 202.0)
    assert d.verdict is Verdict.DUPLICATE and totals(b) == {"sbx-a": (10, 20), "sbx-b": (1, 2)}


def test_two_first_claims_without_sandboxes_conflict_on_the_insert(dsn: str, stores: list[PgStore]) -> None:
    """The ledger insert itself: B's claim waits for A's uncommitted insert of the same identity's row, then
    finds it and writes nothing."""
    a, _ = open_with(stores, dsn)
    b, _ = open_with(stores, dsn)
    first = batch(E1, 1)
    errors: list[BaseException] = []

    def claim_b() -> None:
        try:
            with b.transaction() as tx:
                tx.claim(FWD, first, decide(tx.ledger(FWD), first))
        except BaseException as e:
            errors.append(e)

    with a.transaction() as tx:
        tx.claim(FWD, first, decide(tx.ledger(FWD), first))
        t = threading.Thread(target=claim_b)
        t.start()
        assert blocked(t)
    t.join(30)
    assert [type(e) for e in errors] == [LedgerConflict] and b.ledger(FWD) == Stored(E1, 1)


def test_event_ids_become_visible_in_commit_order(dsn: str, stores: list[PgStore]) -> None:
    """A transaction that inserted an event holds the next one back until it commits, so a reader that
    resumes after the highest id it saw never skips a lower id committed later. Readers do not wait."""
    a, core = open_with(stores, dsn, "sbx-a", "sbx-b")
    b, _ = open_with(stores, dsn)
    reader, _ = open_with(stores, dsn)
    seen = reader.events_after(0)
    ev_a, ev_b = core.on_timer(1000.0)
    ids: dict[str, list[int]] = {}
    t = threading.Thread(target=lambda: ids.setdefault("b", b.save({}, [ev_b])))
    with a.transaction() as tx:
        ids["a"] = tx.save({}, [ev_a])
        t.start()
        assert blocked(t)  # B's insert waits for A's commit
        t0 = time.monotonic()
        assert reader.events_after(seen[-1].id) == []  # the reader does not wait, and sees neither yet
        assert time.monotonic() - t0 < 5.0
    t.join(30)
    assert ids["b"][0] > ids["a"][0]
    assert [e.event for e in reader.events_after(seen[-1].id)] == [ev_a, ev_b]


@pytest.mark.parametrize(
    "on", ["AFTER UPDATE ON sandboxes", "AFTER INSERT ON events", "AFTER INSERT OR UPDATE ON feed_ledger"]
)
def test_a_failing_statement_rolls_the_batch_back(dsn: str, stores: list[PgStore], on: str) -> None:
    store, core = open_with(stores, dsn, "sbx-a", "sbx-b")
    core.on_timer(1000.0)  # both idle: the batch makes events (traffic -> active)
    store.save({s: core.snapshot(s) for s in ("sbx-a", "sbx-b")}, [])
    before = (store.sandboxes(), store.ledger(FWD), store.events_after(0))
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "CREATE FUNCTION fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$"
        )
        admin.execute(f"CREATE TRIGGER fail {on} FOR EACH STATEMENT EXECUTE FUNCTION fail()")
        b = batch(E1, 1, ("sbx-a", 10, 20), ("sbx-b", 30, 40))
        with pytest.raises(CoreAhead) as e:
            ingest_batch(core, store, FWD, b, 1001.0)
        assert e.value.reason == "pg" and "injected" in e.value.detail
        assert (store.sandboxes(), store.ledger(FWD), store.events_after(0)) == before
        admin.execute(f"DROP TRIGGER fail ON {on.split()[-1]}")
    core = load_core(store)
    d, events = ingest_batch(core, store, FWD, b, 1002.0)
    assert d.apply and [e.to_state for e in events] == [State.ACTIVE, State.ACTIVE]
    assert totals(store) == {"sbx-a": (10, 20), "sbx-b": (30, 40)}


def test_a_lock_wait_is_bounded(dsn: str, stores: list[PgStore]) -> None:
    a, _ = open_with(stores, dsn, "sbx-a")
    b, _ = open_with(stores, dsn, lock_timeout_s=0.3)
    with a.transaction() as tx:
        tx.lock(["sbx-a"])
        t0 = time.monotonic()
        with pytest.raises(StoreError) as e, b.transaction() as tx_b:
            tx_b.lock(["sbx-a"])
        assert e.value.reason == "pg_lock_timeout" and time.monotonic() - t0 < 10.0
    with b.transaction() as tx_b:  # the lock is free again, and b's connection still works
        assert list(tx_b.lock(["sbx-a"])) == ["sbx-a"]


def test_webhook_claims_skip_rows_another_transaction_holds(dsn: str, stores: list[PgStore]) -> None:
    store, core = open_with(stores, dsn, "sbx-a", "sbx-b", "sbx-c")
    ids = store.save({}, core.on_timer(1000.0))
    with psycopg.connect(dsn) as other:  # a claim in progress elsewhere, holding the first event's row
        other.execute("SELECT id FROM events WHERE id = %s FOR UPDATE", (ids[0],))
        t0 = time.monotonic()
        assert [e.id for e in store.claim_webhooks("r1", 1000.0, 30.0)] == ids[1:]
        assert time.monotonic() - t0 < 5.0  # did not wait for it
        other.rollback()
    assert [e.id for e in store.claim_webhooks("r2", 1000.0, 30.0)] == ids[:1]


def test_replicas_starting_together_create_the_schema_once(dsn: str, stores: list[PgStore]) -> None:
    made = both(lambda: PgStore(dsn), lambda: PgStore(dsn), lambda: PgStore(dsn))
    stores += made
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert fillfactor(c) == ["fillfactor=50"]


def fillfactor(c: psycopg.Connection[Any]) -> list[str]:
    """The sandboxes table's storage options (a batch's updates stay on their pages only with room)."""
    row = c.execute("SELECT reloptions FROM pg_class WHERE oid = 'sandboxes'::regclass").fetchone()
    assert row is not None
    return list(row[0] or [])


# The schema as version 1 made it.
SCHEMA_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sandboxes (
    sandbox TEXT PRIMARY KEY, incarnation TEXT NOT NULL, registration TEXT NOT NULL,
    registered_at DOUBLE PRECISION NOT NULL, state TEXT NOT NULL, active_since DOUBLE PRECISION NOT NULL,
    last_activity DOUBLE PRECISION, bytes_in BIGINT NOT NULL, bytes_out BIGINT NOT NULL,
    open_connections BIGINT NOT NULL, hold_until DOUBLE PRECISION, stopped_at DOUBLE PRECISION, wake_from TEXT,
    fenced BOOLEAN NOT NULL
);
CREATE TABLE feed_ledger (
    identity TEXT PRIMARY KEY, epoch TEXT NOT NULL, epoch_ns BIGINT NOT NULL, last_seq BIGINT NOT NULL
);
CREATE TABLE events (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, sandbox TEXT NOT NULL, incarnation TEXT NOT NULL,
    from_state TEXT, to_state TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, why TEXT NOT NULL,
    webhook SMALLINT NOT NULL, claimed_by TEXT, claimed_until DOUBLE PRECISION
);
CREATE INDEX events_webhook_due ON events (id) WHERE webhook = 1;
"""


# What version 2 added to version 1, as it wrote it.
SCHEMA_V2_OVER_V1 = """
ALTER TABLE sandboxes ADD COLUMN open_by TEXT NOT NULL DEFAULT '{}';
UPDATE sandboxes SET open_by = '{"":' || open_connections || '}' WHERE open_connections > 0;
CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}';
ALTER TABLE feed_ledger ADD COLUMN applied_at DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE feed_ledger ADD COLUMN counts_forgotten BOOLEAN NOT NULL DEFAULT false;
UPDATE schema_version SET version = 2;
"""


# What version 3 added to version 2, as it wrote it.
SCHEMA_V3_OVER_V2 = """
ALTER TABLE sandboxes ADD COLUMN row_version BIGINT NOT NULL DEFAULT 0;
CREATE SEQUENCE row_versions;
ALTER TABLE sandboxes SET (fillfactor = 50);
UPDATE schema_version SET version = 3;
"""


def single_pin_body(r: Registration) -> str:
    """``r`` as versions 1 to 3 wrote it: the forwarder's one pin as ``spki_pin``."""
    obj = json.loads(push_registration(r))
    fwd = obj["forwarder"]
    (pin,) = fwd.pop("spki_pins")
    fwd["spki_pin"] = pin
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_schema_is_migrated_with_its_rows(dsn: str, stores: list[PgStore], version: int) -> None:
    body = single_pin_body(reg(activity="connections"))
    with psycopg.connect(dsn) as c:
        for stmt in SCHEMA_V1.split(";"):
            if stmt.strip():
                c.execute(stmt)
        c.execute("INSERT INTO schema_version VALUES (1)")
        sql = "INSERT INTO sandboxes VALUES (%s, 'inc-1', %s, 100, %s, 100, 150, 7, 8, %s, NULL, NULL, NULL, false)"
        c.execute(sql, ("sbx-a", body, "active", 2))
        c.execute(sql, ("sbx-b", body, "idle", 0))
        c.execute("INSERT INTO feed_ledger VALUES (%s, %s, %s, 3)", (FWD, E1, epoch_start_ns(E1)))
        for over, since in ((SCHEMA_V2_OVER_V1, 2), (SCHEMA_V3_OVER_V2, 3)):
            if version >= since:
                for stmt in over.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
    made = both(lambda: PgStore(dsn), lambda: PgStore(dsn))  # two replicas starting: migrated once
    stores += made
    store = made[0]
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert fillfactor(c) == ["fillfactor=50"]
        # Every registration as this build writes it: the forwarder's pin as a set of one (spki_pins).
        want = push_registration(reg(activity="connections")).decode()
        assert '"spki_pins":' in want
        assert c.execute("SELECT registration FROM sandboxes").fetchall() == [(want,), (want,)]
    assert {r.sandbox: r.registration.forwarder.spki_pins for r in store.sandboxes()} == {
        "sbx-a": (PIN,), "sbx-b": (PIN,)}
    rows = {r.sandbox: r.state for r in store.sandboxes()}
    assert (rows["sbx-a"].open_by, rows["sbx-a"].open_connections, rows["sbx-a"].bytes_in) == ({UNATTRIBUTED: 2}, 2, 7)
    assert rows["sbx-b"].open_by == {} and rows["sbx-b"].state is State.IDLE
    with store.transaction() as tx:
        assert tx.open_from(UNATTRIBUTED) == ["sbx-a"] and tx.stale_sources(1.0) == [FWD]
    core = load_core(store)
    assert {r.sandbox: r.version for r in store.sandboxes()} == {"sbx-a": 0, "sbx-b": 0}
    assert ingest_batch(core, store, FWD, batch(E1, 4, ("sbx-b", 1, 1)), 500.0)[0].apply
    versions = {r.sandbox: r.version for r in store.sandboxes()}
    assert versions["sbx-a"] == 0 and versions["sbx-b"] >= 1 and core.stored_version("sbx-b") == versions["sbx-b"]
    with store.transaction() as tx:
        assert tx.stale_sources(400.0) == []
    with store.transaction() as tx:  # open_from can read the partial index (on two rows a scan is cheaper)
        tx.execute("SET LOCAL enable_seqscan = off")
        plan = " ".join(r[0] for r in tx.execute("EXPLAIN " + _OPEN_FROM, (FWD,)).fetchall())
    assert "sandboxes_open" in plan


def test_stale_sources_skip_a_record_another_transaction_holds(dsn: str, stores: list[PgStore]) -> None:
    """A batch of that identity is being applied elsewhere (its ledger row locked): not stale, and the
    sweep does not wait for it."""
    store, core = open_with(stores, dsn, "sbx-a")
    ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 1)), 100.0)
    ingest_batch(core, store, FWD2, batch(E1, 1, ("sbx-a", 1, 1)), 100.0)
    with psycopg.connect(dsn) as other:
        other.execute("SELECT 1 FROM feed_ledger WHERE identity = %s FOR UPDATE", (FWD,))
        t0 = time.monotonic()
        with store.transaction() as tx:
            assert tx.stale_sources(200.0) == [FWD2]
        assert time.monotonic() - t0 < 5.0
        other.rollback()
    with store.transaction() as tx:
        assert tx.stale_sources(200.0) == [FWD, FWD2]


def test_a_schema_of_another_version_is_refused(dsn: str, stores: list[PgStore]) -> None:
    PgStore(dsn).close()
    with psycopg.connect(dsn) as c:
        c.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(StoreError) as e:
        PgStore(dsn)
    assert e.value.reason == "schema_version" and "99" in e.value.detail


def test_an_unreachable_server_is_a_store_error_naming_it() -> None:
    port = pg_support._free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        PgStore(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", connect_timeout_s=2.0)
    assert e.value.reason == "pg_unavailable" and "cannot connect" in e.value.detail
    assert time.monotonic() - t0 < 30.0


def test_a_server_outage_fails_clearly_and_the_store_recovers() -> None:
    """The server stops at once (as a crash); each transaction meanwhile raises ``pg_unavailable`` (a batch
    is refused before the core changes, so the feed adapter answers 500 and the forwarder resends); once
    the server is back the same store object reconnects, the resend applies once, and what was committed
    before is all there."""
    try:
        server = pg_support.PgServer().start()
    except pg_support.PgUnavailable as unavailable:
        pytest.skip(str(unavailable))
    try:
        store = PgStore(server.dsn, connect_timeout_s=2.0)
        core = load_core(store)
        register(core, store, "sbx-a", reg(), 100.0)
        ingest_batch(core, store, FWD, batch(E1, 1, ("sbx-a", 1, 2)), 101.0)
        server.halt()
        b2 = batch(E1, 2, ("sbx-a", 10, 20))
        for _ in range(2):  # the lost connection, then a refused reconnect
            with pytest.raises(StoreError) as e:
                ingest_batch(core, store, FWD, b2, 102.0)
            assert not isinstance(e.value, CoreAhead) and e.value.reason == "pg_unavailable"
        with pytest.raises(StoreError) as e:
            store.sandboxes()
        assert e.value.reason == "pg_unavailable" and "cannot connect" in e.value.detail
        server.resume()
        d, _ = ingest_batch(core, store, FWD, b2, 103.0)
        assert d.apply and store.reconnects >= 1
        assert ingest_batch(core, store, FWD, b2, 104.0)[0].verdict is Verdict.DUPLICATE
        assert totals(store) == {"sbx-a": (11, 22)} and store.ledger(FWD) == Stored(E1, 2)
        store.close()
    finally:
        server.stop()


# -- the arrays the usual write makes itself (_id_array, _number_array) ------------------------------

_ID_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")  # text cannot hold NUL
_FLOATS = st.floats(allow_nan=False, width=64)
_INT8 = st.integers(-(2**63), 2**63 - 1)


def test_the_id_array_literal_reads_back_as_the_ids_or_is_not_made(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:

        @settings(max_examples=60, deadline=None)
        @given(ids=st.lists(st.text(_ID_CHARS, max_size=8), max_size=6))
        def check(ids: list[str]) -> None:
            text = _id_array(ids)
            if any(c in s for s in ids for c in '"\\'):
                assert text is None  # such IDs go as a list, which psycopg escapes
                return
            assert text is not None  # NULL, commas, braces and spaces all come back as written
            assert conn.execute("SELECT %s::text[]", (text,)).fetchone() == (ids,)

        check()


def test_the_binary_number_arrays_read_back_exactly_or_are_not_made(dsn: str, stores: list[PgStore]) -> None:
    store = PgStore(dsn)  # its connection knows the arrays' types
    stores.append(store)

    @settings(max_examples=80, deadline=None)
    @given(values=st.one_of(st.lists(_FLOATS, max_size=8), st.lists(_INT8, max_size=8),
                            st.lists(st.one_of(st.none(), _INT8), max_size=4), st.lists(st.integers(), max_size=3)))
    def check(values: list[Any]) -> None:
        floats = any(type(v) is float for v in values)
        array = _number_array(values, floats)
        if not values or None in values or not (floats or all(-(2**63) <= v < 2**63 for v in values)):
            assert array is None  # the list itself goes: psycopg writes NULLs or refuses the value
            return
        assert array is not None
        with store.transaction() as tx:
            row = tx.execute(f"SELECT %b::{'float8' if floats else 'int8'}[]", (array,)).fetchone()
        assert row is not None
        got = row[0]
        assert got == values and [str(v) for v in got] == [str(v) for v in values]  # -0.0 told from 0.0

    check()


def test_a_batch_written_through_the_made_arrays_reads_back_exactly(dsn: str, stores: list[PgStore]) -> None:
    """The feed's usual write (save_meters without counts) with values the formats meet at their edges."""
    sids = ["a-1", "b.2", "NULL"]
    store, core = open_with(stores, dsn, *sids)
    with store.transaction() as tx:
        states = {sid: core.snapshot(sid) for sid in sids}
        for k, stt in enumerate(states.values()):
            stt.bytes_in, stt.bytes_out = 2**63 - 1 - k, k
            stt.last_activity = [1e300, 5e-324, 1764633600.123456][k]
        tx.save_meters(states, counts=False)
    got = {s.sandbox: s.state for s in store.sandboxes()}
    for sid, stt in states.items():
        assert (got[sid].last_activity, got[sid].bytes_in, got[sid].bytes_out) == (
            stt.last_activity, stt.bytes_in, stt.bytes_out)
