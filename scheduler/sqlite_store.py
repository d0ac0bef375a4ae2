"""The scheduler's default store (``scheduler/store.py``'s ``Store``) on SQLite: one file, WAL.

Durability: ``journal_mode=WAL`` with ``synchronous=FULL`` by default. An answer to a feed batch is sent
only after its transaction commits, and the forwarder drops an acknowledged batch; under ``NORMAL`` a
power loss (not a process crash, which WAL survives either way) may roll back the last commits after
their answers went out, and those bytes would be lost from the totals. ``FULL`` syncs the WAL at every
commit, so an acknowledged batch is on disk. Its cost is one fsync per transaction, which is one per
forwarder per report interval (about 100 a second at the issue's scale), not one per sandbox. ``NORMAL``
may be chosen (``synchronous="NORMAL"``) where losing the last moments of metering on power loss is
acceptable; the ledger and totals stay consistent either way, since they commit together.

Every write is one explicit transaction begun with ``BEGIN IMMEDIATE`` (the write lock is taken at once,
so two processes on one file queue on ``busy_timeout`` instead of failing to upgrade a read lock). Any
``sqlite3.Error`` rolls the transaction back and is raised as ``StoreError``.

The schema is created on open, with its version in ``schema_version``; a file of another version is
refused (no migration yet: there has been one version).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from os import PathLike
from typing import Any, Literal

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import Batch, epoch_start_ns
from sbxnet.protocol.routes import Registration, RouteError, pull_registration, push_registration
from scheduler.feed_ledger import Decision, Stored
from scheduler.store import WEBHOOK_STATES, LedgerConflict, StoredEvent, StoredSandbox, StoreError, check_apply
from scheduler.timers import Event, SandboxState, State, Why

SCHEMA_VERSION = 1

_WEBHOOK_NONE, _WEBHOOK_DUE, _WEBHOOK_DONE = 0, 1, 2

_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sandboxes (
    sandbox TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    registration TEXT NOT NULL,          -- push_registration's JSON
    registered_at REAL NOT NULL,         -- when this incarnation began
    state TEXT NOT NULL,
    active_since REAL NOT NULL,
    last_activity REAL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL,
    open_connections INTEGER NOT NULL,
    hold_until REAL,
    stopped_at REAL,
    wake_from TEXT,
    fenced INTEGER NOT NULL
);
CREATE TABLE feed_ledger (
    identity TEXT PRIMARY KEY,           -- the forwarder certificate's SAN
    epoch TEXT NOT NULL,
    epoch_ns INTEGER NOT NULL,           -- the epoch's start time: epochs are ordered by it
    last_seq INTEGER NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, -- AUTOINCREMENT: an id is never reused, even after pruning
    sandbox TEXT NOT NULL,
    incarnation TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    at REAL NOT NULL,
    why TEXT NOT NULL,
    webhook INTEGER NOT NULL             -- 0: not for the webhook, 1: due, 2: delivered
);
CREATE INDEX events_webhook_due ON events (id) WHERE webhook = 1;
"""

_STATE_COLS = (
    "state", "active_since", "last_activity", "bytes_in", "bytes_out", "open_connections", "hold_until",
    "stopped_at", "wake_from", "fenced",
)
_UPDATE_STATE = f"UPDATE sandboxes SET {', '.join(c + ' = ?' for c in _STATE_COLS)} WHERE sandbox = ?"
_PUT = (
    "INSERT OR REPLACE INTO sandboxes (sandbox, incarnation, registration, registered_at, "
    f"{', '.join(_STATE_COLS)}) VALUES ({', '.join('?' * (4 + len(_STATE_COLS)))})"
)
_SELECT_SANDBOXES = (
    f"SELECT sandbox, registration, registered_at, {', '.join(_STATE_COLS)} FROM sandboxes ORDER BY sandbox"
)
_INSERT_EVENT = (
    "INSERT INTO events (sandbox, incarnation, from_state, to_state, at, why, webhook) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_SELECT_EVENTS = "SELECT id, sandbox, incarnation, from_state, to_state, at, why FROM events"
# The claims: each one statement that writes only if the record is still the one the decision read.
_CLAIM_FIRST = (  # an epoch's first batch: no record, or one of an older epoch
    "INSERT INTO feed_ledger (identity, epoch, epoch_ns, last_seq) VALUES (?, ?, ?, 1) "
    "ON CONFLICT (identity) DO UPDATE SET epoch = excluded.epoch, epoch_ns = excluded.epoch_ns, last_seq = 1 "
    "WHERE feed_ledger.epoch_ns < excluded.epoch_ns"
)
_CLAIM_NEXT = "UPDATE feed_ledger SET last_seq = ? WHERE identity = ? AND epoch = ? AND last_seq = ?"

Synchronous = Literal["FULL", "NORMAL"]


def _state_row(st: SandboxState) -> tuple[object, ...]:
    return (
        st.state.value, st.active_since, st.last_activity, st.bytes_in, st.bytes_out, st.open_connections,
        st.hold_until, st.stopped_at, None if st.wake_from is None else st.wake_from.value, int(st.fenced),
    )


def _state_of(row: Sequence[Any]) -> SandboxState:  # a row's values are what the schema says
    state, active_since, last_activity, bytes_in, bytes_out, n_open, hold_until, stopped_at, wake_from, fenced = row
    return SandboxState(
        active_since=float(active_since),
        state=State(state),
        last_activity=None if last_activity is None else float(last_activity),
        bytes_in=int(bytes_in),
        bytes_out=int(bytes_out),
        open_connections=int(n_open),
        hold_until=None if hold_until is None else float(hold_until),
        stopped_at=None if stopped_at is None else float(stopped_at),
        wake_from=None if wake_from is None else State(wake_from),
        fenced=bool(fenced),
    )


def _event_of(row: Sequence[Any]) -> StoredEvent:
    eid, sandbox, incarnation, frm, to, at, why = row
    ev = Event(
        str(sandbox), str(incarnation), None if frm is None else State(frm), State(to), float(at),
        Why(why),
    )
    return StoredEvent(int(eid), ev)


class SqliteStore:
    """``Store`` on one SQLite file. One owner: not shared between threads (sqlite3's default check)."""

    def __init__(
        self, path: str | PathLike[str], *, synchronous: Synchronous = "FULL", busy_timeout_s: float = 5.0
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise LocalProtocolError("bad_config", "synchronous must be FULL or NORMAL")
        try:
            # isolation_level=None: the module opens no transaction of its own; ours are explicit.
            self._conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_s)
        except sqlite3.Error as e:
            raise StoreError("open", f"{path}: {e}") from None
        try:
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError("not_wal", f"{path}: journal_mode is {mode!r}, WAL needs a file on a local disk")
            self._conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._create()
        except BaseException:
            self._conn.close()
            raise
        self.path = path
        self.synchronous = synchronous

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            self._rollback()
            raise StoreError("sqlite", str(e)) from e
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        try:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # a closed or broken connection: SQLite rolls back what was not committed on its own

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[sqlite3.Row]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise StoreError("sqlite", str(e)) from e

    def _create(self) -> None:
        with self._tx() as c:
            exists = c.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
            ).fetchone()
            if exists is None:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                c.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                return
            rows = c.execute("SELECT version FROM schema_version").fetchall()
            if [tuple(r) for r in rows] != [(SCHEMA_VERSION,)]:
                found = [r[0] for r in rows]
                raise StoreError("schema_version", f"the file has {found}, this build knows {SCHEMA_VERSION}")

    @staticmethod
    def _insert_events(c: sqlite3.Connection, events: Sequence[Event]) -> list[int]:
        ids = []
        for ev in events:
            cur = c.execute(
                _INSERT_EVENT,
                (
                    ev.sandbox, ev.incarnation, None if ev.from_state is None else ev.from_state.value,
                    ev.to_state.value, ev.at, ev.why.value,
                    _WEBHOOK_DUE if ev.to_state.value in WEBHOOK_STATES else _WEBHOOK_NONE,
                ),
            )
            assert cur.lastrowid is not None
            ids.append(cur.lastrowid)
        return ids

    # -- the registry and the timer core's state ------------------------------------------------

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        body = push_registration(registration).decode()
        with self._tx() as c:
            c.execute(_PUT, (sandbox, registration.incarnation, body, registered_at, *_state_row(state)))
            return self._insert_events(c, events)

    def remove_registration(self, sandbox: str) -> bool:
        with self._tx() as c:
            return c.execute("DELETE FROM sandboxes WHERE sandbox = ?", (sandbox,)).rowcount > 0

    def sandboxes(self) -> list[StoredSandbox]:
        out = []
        for row in self._read(_SELECT_SANDBOXES):
            sandbox, body, registered_at = row[0], row[1], row[2]
            try:
                reg = pull_registration(str(body).encode())
            except RouteError as e:
                raise StoreError("bad_row", f"sandbox {sandbox!r}: stored registration refused: {e.reason}") from None
            out.append(StoredSandbox(str(sandbox), reg, float(registered_at), _state_of(row[3:])))
        return out

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        with self._tx() as c:
            c.executemany(_UPDATE_STATE, [(*_state_row(st), sid) for sid, st in updates.items()])
            return self._insert_events(c, events)

    # -- the feed ledger ------------------------------------------------------------------------

    def ledger(self, identity: str) -> Stored | None:
        rows = self._read("SELECT epoch, last_seq FROM feed_ledger WHERE identity = ?", (identity,))
        return Stored(str(rows[0][0]), int(rows[0][1])) if rows else None

    def apply_batch(
        self, identity: str, batch: Batch, decision: Decision, sandbox_updates: Mapping[str, SandboxState],
        events: Sequence[Event],
    ) -> list[int]:
        rec = check_apply(batch, decision)
        with self._tx() as c:
            # The claim first: a conflict is found before anything else is written.
            if rec.last_seq == 1:
                cur = c.execute(_CLAIM_FIRST, (identity, rec.epoch, epoch_start_ns(rec.epoch)))
            else:
                cur = c.execute(_CLAIM_NEXT, (rec.last_seq, identity, rec.epoch, rec.last_seq - 1))
            if cur.rowcount != 1:
                raise LedgerConflict(identity)
            c.executemany(_UPDATE_STATE, [(*_state_row(st), sid) for sid, st in sandbox_updates.items()])
            return self._insert_events(c, events)

    # -- events ---------------------------------------------------------------------------------

    def events_after(self, after_id: int, limit: int = 1000) -> list[StoredEvent]:
        rows = self._read(f"{_SELECT_EVENTS} WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
        return [_event_of(r) for r in rows]

    def undelivered_webhooks(self, limit: int = 100) -> list[StoredEvent]:
        rows = self._read(f"{_SELECT_EVENTS} WHERE webhook = {_WEBHOOK_DUE} ORDER BY id LIMIT ?", (limit,))
        return [_event_of(r) for r in rows]

    def mark_delivered(self, event_ids: Sequence[int]) -> None:
        with self._tx() as c:
            c.executemany(
                f"UPDATE events SET webhook = {_WEBHOOK_DONE} WHERE id = ? AND webhook = {_WEBHOOK_DUE}",
                [(i,) for i in event_ids],
            )

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
