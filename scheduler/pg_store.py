"""The scheduler's shared store (``scheduler/store.py``'s ``Store``) on PostgreSQL, for replicas that share
state: psycopg 3, its synchronous API, one connection per store object (one owner; not for two threads).

Transactions and isolation: READ COMMITTED, autocommit off, and explicit row locks. Every write
transaction locks what it will change before reading it (``Tx.lock``: ``SELECT ... FOR UPDATE`` of the
sandboxes in ID order; ``Tx.ledger``: ``FOR UPDATE`` of the identity's ledger row), and under READ
COMMITTED a ``FOR UPDATE`` that waited for another transaction returns the row as that one committed it,
so the caller restores the latest state into its core and loses nobody's update. A stricter level would
add nothing here and cost retries: under REPEATABLE READ or SERIALIZABLE the same lock on a row another
replica just changed raises a serialization failure instead of waiting and reading the new version, and
every caller would have to loop. Locks are taken in one order (the ledger row, then sandboxes by ID,
then the events table) so replicas queue rather than deadlock. What no row lock covers is guarded by the
statements themselves:

- The ledger claim is one conditional statement (``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` the stored
  record is none or of an older epoch, or ``UPDATE ... WHERE`` it is the same epoch at ``seq - 1``); a
  rowcount other than 1 is ``LedgerConflict``. It matters when two replicas both find no record and both
  claim seq 1: the second waits for the first's insert, then finds the row and writes nothing.
- Event ids come from an identity column, and ids are handed out when inserted, not when committed: two
  transactions could commit ids 11 then 10, and an SSE reader resuming after 11 would miss 10. A
  transaction that inserts events first locks the events table against other inserters (``SHARE ROW
  EXCLUSIVE``, which readers do not wait on) until it commits, so ids become visible in order. Event
  writes are state changes (a batch that only moves bytes makes none), so the queue is short.
- ``claim_webhooks`` takes its rows ``FOR UPDATE SKIP LOCKED``: two replicas claiming at once take
  different events and neither waits.

A lock wait is bounded (``lock_timeout_s``, raised as ``StoreError`` ``pg_lock_timeout``), and a session
that stays idle inside a transaction is ended by the server after a minute, so a replica that hangs
holding locks does not stop the others for long.

Errors: every ``psycopg.Error`` rolls the transaction back and is raised as ``StoreError``: the server
unreachable or the connection lost is ``pg_unavailable`` (the connection is dropped, and the next
transaction connects again, so the store is usable once the server is back), a deadlock ``pg_deadlock``,
anything else ``pg`` with its SQLSTATE. A commit whose connection is lost raises ``pg_unavailable`` with
its outcome unknown: a feed batch it carried may have been stored, which the forwarder's resend then
meets as a duplicate.

Row versions (``store.py``): ``sandboxes.row_version``, handed out by the sequence ``row_versions`` (one
``nextval`` per transaction that writes rows: unique across sessions, whether or not they commit).

``sandboxes`` is made with ``fillfactor = 50``: a feed batch rewrites every row it names in one
transaction, and an update stays on its page (a HOT update: no index entry, the dead version pruned in
place) only where the page has room for the new version of each of its rows. Full pages sent each
batch's new versions elsewhere, the table grew with every batch (2,400 pages for 1,000 rows after 40
batches here) and the UPDATE took about twice as long (1,000 rows: 16 vs 9 ms on the server). A
migrated schema gets it for the pages written from then on.

Schema: the same tables as SQLite's (``scheduler/sqlite_store.py``) with PostgreSQL types (BIGINT,
DOUBLE PRECISION, BOOLEAN, an IDENTITY id), created when absent in the connection's ``search_path``
schema under an advisory lock (replicas may start together), with its version in ``schema_version``:
version 4. Older schemas are migrated there under the same lock: version 1 as SQLite's version 2 is (open
counts per source, the one count becoming the unattributed source's, and the ledger's last-applied time,
0 for the rows that were there), version 2 as SQLite's 3 (row versions, 0 for the rows there), version 3
as SQLite's 5 (each registration rewritten with the forwarder's pins as a set, ``spki_pins``); another
version is refused. Replicas of different versions must not run on one database: stop every replica,
then start the new ones (an old one would write no ``open_by`` and no ``applied_at``, and, worst, no
``row_version``: the new replicas would take a row it changed for one they hold already). The
registration is TEXT, ``push_registration``'s JSON as it was written (the scheduler reads it back whole
and never queries into it, so JSONB would only re-encode it); ``open_by`` is TEXT too
(``store.open_by_text``), read as JSONB only by ``open_from``, over the rows a partial index holds (those
with any open count).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import Dumper

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import Batch, epoch_start_ns
from sbxnet.protocol.routes import Registration, push_registration
from scheduler.feed_ledger import Decision, Stored
from scheduler.store import (
    COUNT_COLUMNS,
    METER_COLUMNS,
    STATE_COLUMNS,
    WEBHOOK_DONE,
    WEBHOOK_DUE,
    LedgerConflict,
    OneShotWrites,
    RegistrationCache,
    StoredEvent,
    StoredSandbox,
    StoreError,
    check_apply,
    check_lease,
    event_of,
    event_row,
    meter_row,
    rewritten_registrations,
    state_of,
    state_row,
)
from scheduler.timers import Event, SandboxState

SCHEMA_VERSION = 4
_SCHEMA_LOCK = 0x5B8E_5C4E_0001  # pg_advisory_xact_lock key while the schema is checked or created

_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sandboxes (
    sandbox TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    registration TEXT NOT NULL,
    registered_at DOUBLE PRECISION NOT NULL,
    state TEXT NOT NULL,
    active_since DOUBLE PRECISION NOT NULL,
    last_activity DOUBLE PRECISION,
    bytes_in BIGINT NOT NULL,
    bytes_out BIGINT NOT NULL,
    open_connections BIGINT NOT NULL,
    hold_until DOUBLE PRECISION,
    stopped_at DOUBLE PRECISION,
    wake_from TEXT,
    fenced BOOLEAN NOT NULL,
    open_by TEXT NOT NULL DEFAULT '{}',
    row_version BIGINT NOT NULL DEFAULT 0
) WITH (fillfactor = 50);
CREATE SEQUENCE row_versions;
CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}';
CREATE TABLE feed_ledger (
    identity TEXT PRIMARY KEY,
    epoch TEXT NOT NULL,
    epoch_ns BIGINT NOT NULL,
    last_seq BIGINT NOT NULL,
    applied_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    counts_forgotten BOOLEAN NOT NULL DEFAULT false
);
CREATE TABLE events (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sandbox TEXT NOT NULL,
    incarnation TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    why TEXT NOT NULL,
    webhook SMALLINT NOT NULL,
    claimed_by TEXT,
    claimed_until DOUBLE PRECISION
);
CREATE INDEX events_webhook_due ON events (id) WHERE webhook = 1;
"""

# Version 1 -> 2, as SQLite's 2 -> 3 (scheduler/sqlite_store.py).
_MIGRATE_1 = (
    "ALTER TABLE sandboxes ADD COLUMN open_by TEXT NOT NULL DEFAULT '{}'",
    """UPDATE sandboxes SET open_by = '{"":' || open_connections || '}' WHERE open_connections > 0""",
    "CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}'",
    "ALTER TABLE feed_ledger ADD COLUMN applied_at DOUBLE PRECISION NOT NULL DEFAULT 0",
    "ALTER TABLE feed_ledger ADD COLUMN counts_forgotten BOOLEAN NOT NULL DEFAULT false",
    "UPDATE schema_version SET version = 2",
)
# Version 2 -> 3, as SQLite's 3 -> 4: row versions; and the fillfactor (for pages written from now on).
_MIGRATE_2 = (
    "ALTER TABLE sandboxes ADD COLUMN row_version BIGINT NOT NULL DEFAULT 0",
    "CREATE SEQUENCE row_versions",
    "ALTER TABLE sandboxes SET (fillfactor = 50)",
    "UPDATE schema_version SET version = 3",
)
# Version 3 -> 4, as SQLite's 5 -> 6: each registration rewritten as this build writes it (``spki_pins``).
_REWRITE_REGISTRATION = "UPDATE sandboxes SET registration = %s WHERE sandbox = %s"

_ROW_COLS = f"sandbox, registration, registered_at, row_version, {', '.join(STATE_COLUMNS)}"
# Arrays go as %b (binary): the text format quotes each element, which costs more than the statement.
_LOCK = f"SELECT {_ROW_COLS} FROM sandboxes WHERE sandbox = ANY(%b) ORDER BY sandbox FOR UPDATE"
_LOCK_VERSIONS = "SELECT sandbox, row_version FROM sandboxes WHERE sandbox = ANY(%b) ORDER BY sandbox FOR UPDATE"
_PUT_COLS = ("incarnation", "registration", "registered_at", "row_version", *STATE_COLUMNS)
_PUT = (
    f"INSERT INTO sandboxes (sandbox, {', '.join(_PUT_COLS)}) "
    f"VALUES ({', '.join(['%s'] * (1 + len(_PUT_COLS)))}) ON CONFLICT (sandbox) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _PUT_COLS)
)
# One statement for a whole batch's states: a column per array, matched to the rows by sandbox.
_STATE_TYPES = ("text", "float8", "float8", "int8", "int8", "int8", "float8", "float8", "text", "bool", "text")
_SAVE = (
    f"UPDATE sandboxes AS s SET {', '.join(f'{c} = v.{c}' for c in STATE_COLUMNS)}, row_version = %s "
    f"FROM unnest(%b::text[], {', '.join(f'%b::{t}[]' for t in _STATE_TYPES)}) "
    f"AS v(sandbox, {', '.join(STATE_COLUMNS)}) WHERE s.sandbox = v.sandbox"
)
_METER_TYPES = ("float8", "int8", "int8", "int8", "text")


def _save_meters(n: int) -> str:
    """The UPDATE of the first ``n`` of ``METER_COLUMNS``."""
    cols = METER_COLUMNS[:n]
    return (
        f"UPDATE sandboxes AS s SET {', '.join(f'{c} = v.{c}' for c in cols)}, row_version = %s "
        f"FROM unnest(%b::text[], {', '.join(f'%b::{t}[]' for t in _METER_TYPES[:n])}) "
        f"AS v(sandbox, {', '.join(cols)}) WHERE s.sandbox = v.sandbox"
    )


_SAVE_METERS = _save_meters(len(METER_COLUMNS))
_SAVE_TRAFFIC = _save_meters(len(METER_COLUMNS) - len(COUNT_COLUMNS))  # the open counts left as they are
# The same with the IDs as one array literal (``_id_array``): a batch's usual write.
_SAVE_TRAFFIC_TEXT = _save_meters(len(METER_COLUMNS) - len(COUNT_COLUMNS)).replace("%b::text[]", "%s::text[]", 1)
_LOCK_VERSIONS_TEXT = _LOCK_VERSIONS.replace("%b", "%s::text[]")


# psycopg dumps a list to an array element by element in Python (a batch's four 1,000-element arrays were
# about 1.6 ms, a quarter of the store thread's time per batch on PostgreSQL). The usual write's arrays
# are made here instead: the IDs as one array literal (str.join), the numbers in PostgreSQL's binary
# array format (struct, then sliced into place), each in tens of microseconds.
def _id_array(ids: list[str]) -> str | None:
    """The array literal of ``ids``, every element quoted (so none reads as NULL or splits), or None when
    one holds a character a quoted element would have to escape (then pass the list itself)."""
    text = '{"' + '","'.join(ids) + '"}' if ids else "{}"
    return None if "\\" in text or text.count('"') != 2 * len(ids) else text


class _Float8Array(bytes):
    """A float8[] in the binary format (``_number_array``)."""


class _Int8Array(bytes):
    """An int8[] in the binary format (``_number_array``)."""


class _Float8ArrayDumper(Dumper):
    format = pq.Format.BINARY
    oid = 1022  # float8[]

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


class _Int8ArrayDumper(_Float8ArrayDumper):
    oid = 1016  # int8[]


_ARRAY_HEAD = struct.Struct(">iiiii")  # dimensions, has nulls, element type, length, lower bound


def _number_array(values: list[Any], floats: bool) -> bytes | None:
    """float8 (``floats``) or int8 values as that binary array; None when one is None or does not fit
    (then pass the list itself: psycopg writes the NULLs, or refuses the value as before)."""
    n = len(values)
    if not n or None in values:
        return None
    try:
        data = struct.pack(f">{n}{'d' if floats else 'q'}", *values)
    except struct.error:
        return None
    out = bytearray(20 + 12 * n)
    _ARRAY_HEAD.pack_into(out, 0, 1, 0, 701 if floats else 20, n, 1)
    out[23::12] = b"\x08" * n  # each element's length, 8 (the other three bytes of it stay 0)
    for k in range(8):
        out[24 + k :: 12] = data[k::8]
    return (_Float8Array if floats else _Int8Array)(out)


# A transaction's events in one statement, their ids taken in the order given (ORDER BY the ordinality:
# an identity's values are drawn as the rows are inserted).
_EVENT_FIELDS = "sandbox, incarnation, from_state, to_state, at, why, webhook"
_INSERT_EVENTS = (
    f"INSERT INTO events ({_EVENT_FIELDS}) SELECT {_EVENT_FIELDS} "
    "FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::float8[], %b::text[], %b::int2[]) "
    f"WITH ORDINALITY AS v({_EVENT_FIELDS}, n) ORDER BY n RETURNING id"
)
_EVENT_COLS = "id, sandbox, incarnation, from_state, to_state, at, why"
_CLAIM_FIRST = (  # an epoch's first batch: no record, or one of an older epoch
    "INSERT INTO feed_ledger (identity, epoch, epoch_ns, last_seq) VALUES (%s, %s, %s, 1) "
    "ON CONFLICT (identity) DO UPDATE SET epoch = excluded.epoch, epoch_ns = excluded.epoch_ns, last_seq = 1 "
    "WHERE feed_ledger.epoch_ns < excluded.epoch_ns"
)
_CLAIM_NEXT = "UPDATE feed_ledger SET last_seq = %s WHERE identity = %s AND epoch = %s AND last_seq = %s"
# ``open_by <> '{}'`` as the index says it, so the planner reads the partial index.
_OPEN_FROM = "SELECT sandbox FROM sandboxes WHERE open_by <> '{}' AND (open_by::jsonb) ? %s ORDER BY sandbox"
_STALE = (
    "SELECT identity FROM feed_ledger WHERE applied_at < %s AND NOT counts_forgotten "
    "ORDER BY identity FOR UPDATE SKIP LOCKED"
)
_CLAIM_WEBHOOKS = (
    "UPDATE events SET claimed_by = %s, claimed_until = %s WHERE id IN ("
    f"SELECT id FROM events WHERE webhook = {WEBHOOK_DUE} "
    "AND (claimed_by IS NULL OR claimed_by = %s OR claimed_until <= %s) "
    "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    f") RETURNING {_EVENT_COLS}"
)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class PgTx:
    """``Tx`` on the store's connection; unusable once the transaction ends."""

    def __init__(self, store: PgStore, conn: psycopg.Connection[Any]) -> None:
        self._store = store
        self._conn: psycopg.Connection[Any] | None = conn
        self._events_locked = False
        self._version: int | None = None

    def _c(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise LocalProtocolError("tx_closed", "the transaction has ended")
        return self._conn

    def end(self) -> None:
        self._conn = None

    def execute(self, sql: str, args: Sequence[object] = ()) -> psycopg.Cursor[Any]:
        return self._c().execute(sql, args)

    def lock(self, sandboxes: Collection[str]) -> dict[str, StoredSandbox]:
        ids = list(dict.fromkeys(sandboxes))
        if not ids:
            return {}
        out = {}
        for row in self.execute(_LOCK, (ids,)).fetchall():
            s = self._store._sandbox_of(row)
            out[s.sandbox] = s
        for sid in ids:
            if sid not in out:
                self._store._regs.forget(sid)
        return out

    def lock_versions(self, sandboxes: Collection[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(sandboxes))
        if not ids:
            return {}
        text = _id_array(ids)
        if text is None:
            return {str(sid): int(v) for sid, v in self.execute(_LOCK_VERSIONS, (ids,)).fetchall()}
        return dict(self.execute(_LOCK_VERSIONS_TEXT, (text,)).fetchall())  # text and bigint: str and int

    def written_version(self) -> int:
        if self._version is None:
            row = self.execute("SELECT nextval('row_versions')").fetchone()
            assert row is not None
            self._version = int(row[0])
        return self._version

    def ledger(self, identity: str) -> Stored | None:
        sql = "SELECT epoch, last_seq FROM feed_ledger WHERE identity = %s FOR UPDATE"
        row = self.execute(sql, (identity,)).fetchone()
        return None if row is None else Stored(str(row[0]), int(row[1]))

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        body = push_registration(registration).decode()
        version = self.written_version()
        self.execute(_PUT, (sandbox, registration.incarnation, body, registered_at, version, *state_row(state)))
        return self._insert_events(events)

    def remove_registration(self, sandbox: str) -> bool:
        self._store._regs.forget(sandbox)
        return self.execute("DELETE FROM sandboxes WHERE sandbox = %s", (sandbox,)).rowcount > 0

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        if updates:
            version = self.written_version()
            columns: list[object] = [version, list(updates)]
            columns += [list(c) for c in zip(*(state_row(st) for st in updates.values()), strict=True)]
            self.execute(_SAVE, columns)
        return self._insert_events(events)

    def save_meters(self, updates: Mapping[str, SandboxState], counts: bool = True) -> None:
        if not updates:
            return
        version = self.written_version()
        states = updates.values()
        if counts:
            columns: list[object] = [version, list(updates)]
            columns += [list(c) for c in zip(*(meter_row(st) for st in states), strict=True)]
            self.execute(_SAVE_METERS, columns)
        else:
            ids, la = list(updates), [st.last_activity for st in states]
            bi, bo = [st.bytes_in for st in states], [st.bytes_out for st in states]
            text = _id_array(ids)
            arrays = [_number_array(la, True), _number_array(bi, False), _number_array(bo, False)]
            if text is None or None in arrays:
                self.execute(_SAVE_TRAFFIC, [version, ids, la, bi, bo])
            else:
                self.execute(_SAVE_TRAFFIC_TEXT, [version, text, *arrays])

    def claim(self, identity: str, batch: Batch, decision: Decision) -> None:
        rec = check_apply(batch, decision)
        if rec.last_seq == 1:
            cur = self.execute(_CLAIM_FIRST, (identity, rec.epoch, epoch_start_ns(rec.epoch)))
        else:
            cur = self.execute(_CLAIM_NEXT, (rec.last_seq, identity, rec.epoch, rec.last_seq - 1))
        if cur.rowcount != 1:
            raise LedgerConflict(identity)

    def note_applied(self, identity: str, now: float) -> None:
        sql = "UPDATE feed_ledger SET applied_at = %s, counts_forgotten = false WHERE identity = %s"
        self.execute(sql, (now, identity))

    def open_from(self, source: str) -> list[str]:
        return [str(r[0]) for r in self.execute(_OPEN_FROM, (source,)).fetchall()]

    def stale_sources(self, before: float) -> list[str]:
        return [str(r[0]) for r in self.execute(_STALE, (before,)).fetchall()]

    def mark_forgotten(self, identity: str) -> None:
        self.execute("UPDATE feed_ledger SET counts_forgotten = true WHERE identity = %s", (identity,))

    def _insert_events(self, events: Sequence[Event]) -> list[int]:
        if not events:
            return []
        if not self._events_locked:
            # Ids visible in commit order (the module docstring): held until this transaction ends.
            self.execute("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE")
            self._events_locked = True
        columns = [list(c) for c in zip(*(event_row(ev) for ev in events), strict=True)]
        ids = sorted(int(r[0]) for r in self.execute(_INSERT_EVENTS, columns).fetchall())
        assert len(ids) == len(events)
        return ids


class PgStore(OneShotWrites):
    """``Store`` on a PostgreSQL database (``dsn``: a libpq connection string or URI). Connects at once and
    checks or creates the schema (``StoreError`` if it cannot); reconnects on the next transaction after
    the connection was lost."""

    shared = True

    def __init__(self, dsn: str, *, connect_timeout_s: float = 5.0, lock_timeout_s: float = 10.0) -> None:
        if not (math.isfinite(connect_timeout_s) and connect_timeout_s > 0):
            raise LocalProtocolError("bad_config", "connect_timeout_s must be positive")
        if not (math.isfinite(lock_timeout_s) and lock_timeout_s > 0):
            raise LocalProtocolError("bad_config", "lock_timeout_s must be positive")
        self.dsn = dsn
        self.connect_timeout_s = connect_timeout_s
        self.lock_timeout_s = lock_timeout_s
        self._conn: psycopg.Connection[Any] | None = None
        self._tx: PgTx | None = None
        self._regs = RegistrationCache()
        self.reconnects = 0  # connections made after the first (for metrics)
        self._create()

    # -- the connection -------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if conn is not None:
            self.reconnects += 1
        self._conn = None
        try:
            # libpq's connect_timeout is whole seconds, at least 2.
            timeout = max(2, math.ceil(self.connect_timeout_s))
            conn = psycopg.connect(self.dsn, autocommit=False, connect_timeout=timeout)
        except psycopg.Error as e:
            raise StoreError("pg_unavailable", f"cannot connect: {_first_line(e)}") from None
        try:
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            conn.adapters.register_dumper(_Float8Array, _Float8ArrayDumper)
            conn.adapters.register_dumper(_Int8Array, _Int8ArrayDumper)
            conn.execute(f"SET lock_timeout = {int(self.lock_timeout_s * 1000)}")
            conn.execute("SET idle_in_transaction_session_timeout = 60000")
            conn.commit()
        except psycopg.Error as e:
            conn.close()
            raise StoreError("pg_unavailable", f"cannot set up the session: {_first_line(e)}") from None
        self._conn = conn
        return conn

    def _error(self, conn: psycopg.Connection[Any], e: psycopg.Error) -> StoreError:
        # Connection failures (class 08) and the server going away (57: shutdown, terminated) included:
        # the session is gone even when psycopg has not noticed the socket closing yet.
        if conn.closed or conn.broken or (e.sqlstate or "").startswith(("08", "57")):
            return StoreError("pg_unavailable", f"connection lost: {_first_line(e)}")
        if isinstance(e, pg_errors.LockNotAvailable):
            return StoreError("pg_lock_timeout", _first_line(e))
        if isinstance(e, pg_errors.DeadlockDetected):
            return StoreError("pg_deadlock", _first_line(e))
        return StoreError("pg", f"{e.sqlstate or type(e).__name__}: {_first_line(e)}")

    def _rollback(self, conn: psycopg.Connection[Any]) -> None:
        try:
            conn.rollback()
        except psycopg.Error:
            conn.close()  # a broken connection: the server rolls back what was not committed on its own

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[PgTx]:
        if self._tx is not None:
            raise LocalProtocolError("nested_transaction", "this store already has a transaction open")
        conn = self._connection()
        tx = self._tx = PgTx(self, conn)
        try:
            yield tx
            conn.commit()
        except psycopg.Error as e:
            err = self._error(conn, e)
            self._rollback(conn)
            raise err from e
        except BaseException:
            self._rollback(conn)
            raise
        finally:
            tx.end()
            self._tx = None

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        if self._tx is not None:  # inside the caller's transaction: part of it
            return self._tx.execute(sql, args).fetchall()
        with self.transaction() as tx:
            return tx.execute(sql, args).fetchall()

    def _create(self) -> None:
        with self.transaction() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            row = tx.execute("SELECT to_regclass('schema_version')").fetchone()
            if row is None or row[0] is None:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        tx.execute(stmt)
                tx.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
                return
            rows = [tuple(r) for r in tx.execute("SELECT version FROM schema_version").fetchall()]
            if rows == [(1,)]:
                for stmt in _MIGRATE_1:
                    tx.execute(stmt)
                rows = [(2,)]
            if rows == [(2,)]:
                for stmt in _MIGRATE_2:
                    tx.execute(stmt)
                rows = [(3,)]
            if rows == [(3,)]:
                old = tx.execute("SELECT sandbox, registration FROM sandboxes ORDER BY sandbox").fetchall()
                for args in rewritten_registrations(old):
                    tx.execute(_REWRITE_REGISTRATION, args)
                tx.execute("UPDATE schema_version SET version = 4")
                return
            if rows != [(SCHEMA_VERSION,)]:
                found = [r[0] for r in rows]
                raise StoreError(
                    "schema_version", f"the database has {found}, this build knows 1 to {SCHEMA_VERSION}"
                )

    def _sandbox_of(self, row: Sequence[Any]) -> StoredSandbox:
        sandbox, body, registered_at = str(row[0]), str(row[1]), row[2]
        return StoredSandbox(
            sandbox, self._regs.get(sandbox, body), float(registered_at), int(row[3]), state_of(sandbox, row[4:])
        )

    # -- reads ----------------------------------------------------------------------------------

    def sandboxes(self) -> list[StoredSandbox]:
        out = [self._sandbox_of(r) for r in self._read(f"SELECT {_ROW_COLS} FROM sandboxes ORDER BY sandbox")]
        self._regs.keep_only({s.sandbox for s in out})
        return out

    def versions(self) -> dict[str, int]:
        return {str(r[0]): int(r[1]) for r in self._read("SELECT sandbox, row_version FROM sandboxes")}

    def sandboxes_in(self, sandboxes: Collection[str]) -> list[StoredSandbox]:
        if not sandboxes:
            return []
        rows = self._read(f"SELECT {_ROW_COLS} FROM sandboxes WHERE sandbox = ANY(%s)", (list(sandboxes),))
        return [self._sandbox_of(r) for r in rows]

    def sandbox(self, sandbox: str) -> StoredSandbox | None:
        rows = self._read(f"SELECT {_ROW_COLS} FROM sandboxes WHERE sandbox = %s", (sandbox,))
        return self._sandbox_of(rows[0]) if rows else None

    def ledger(self, identity: str) -> Stored | None:
        rows = self._read("SELECT epoch, last_seq FROM feed_ledger WHERE identity = %s", (identity,))
        return Stored(str(rows[0][0]), int(rows[0][1])) if rows else None

    # -- events ---------------------------------------------------------------------------------

    def events_after(self, after_id: int, limit: int = 1000) -> list[StoredEvent]:
        rows = self._read(f"SELECT {_EVENT_COLS} FROM events WHERE id > %s ORDER BY id LIMIT %s", (after_id, limit))
        return [event_of(r) for r in rows]

    def undelivered_webhooks(self, limit: int = 100) -> list[StoredEvent]:
        rows = self._read(
            f"SELECT {_EVENT_COLS} FROM events WHERE webhook = {WEBHOOK_DUE} ORDER BY id LIMIT %s", (limit,)
        )
        return [event_of(r) for r in rows]

    def claim_webhooks(self, owner: str, now: float, lease_s: float, limit: int = 100) -> list[StoredEvent]:
        check_lease(lease_s, limit)
        with self.transaction() as tx:
            rows = tx.execute(_CLAIM_WEBHOOKS, (owner, now + lease_s, owner, now, limit)).fetchall()
        return sorted((event_of(r) for r in rows), key=lambda e: e.id)

    def mark_delivered(self, event_ids: Sequence[int]) -> None:
        with self.transaction() as tx:
            tx.execute(
                f"UPDATE events SET webhook = {WEBHOOK_DONE} WHERE id = ANY(%s) AND webhook = {WEBHOOK_DUE}",
                (list(event_ids),),
            )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> PgStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
