"""The scheduler's default store (``scheduler/store.py``'s ``Store``) on SQLite: one file, WAL.

Durability: ``journal_mode=WAL`` with ``synchronous=FULL`` by default. An answer to a feed batch is sent
only after its transaction commits, and the forwarder drops an acknowledged batch; under ``NORMAL`` a
power loss (not a process crash, which WAL survives either way) may roll back the last commits after
their answers went out, and those bytes would be lost from the totals. ``FULL`` syncs the WAL at every
commit, so an acknowledged batch is on disk. Its cost is one fsync per transaction, which is one per
forwarder per report interval (about 100 a second at the issue's scale), not one per sandbox. ``NORMAL``
may be chosen (``synchronous="NORMAL"``) where losing the last moments of metering on power loss is
acceptable; the ledger and totals stay consistent either way, since they commit together.

Transactions: every write is one explicit transaction begun with ``BEGIN IMMEDIATE``, which takes the
database's write lock at once and holds it to the end. That is the ``Tx`` lock: ``Tx.lock`` and
``Tx.ledger`` only read, since nobody else can write until this transaction ends, and what they read is
the latest commit (two processes on one file queue on ``busy_timeout`` instead of failing to upgrade a
read lock; each then starts from the other's result). ``shared`` is False: the scheduler runs one writer
on a file, but two stores on one file are still correct. Any ``sqlite3.Error`` rolls the transaction back
and is raised as ``StoreError``. Reads outside a transaction see the latest commit.

Webhook claims (``claim_webhooks``) are ``claimed_by`` / ``claimed_until`` on the event row.

Open counts per source (``SandboxState.open_by``) are JSON text in ``sandboxes.open_by`` (``{}`` for
none); a partial index on the rows with any lets ``open_from`` read just those (``json_each`` then finds
the source). The ledger row also says when its last batch was applied (``applied_at``, the scheduler's
clock) and whether its counts were forgotten since (``counts_forgotten``), for ``stale_sources``.

Traffic meters: a sandbox's last activity and byte totals, with its row version, are a row of their own in
``meters`` (the sandbox's ID its key), the rest of its state and its registration in ``sandboxes``. Nearly
every write is a feed batch's, and nearly all of those write only these columns, so each is a write of a
narrow row (a third less time than rewriting the whole row, with its registration, and a fifth of the
pages to commit). A sandbox has a row in both or in neither; the reads join them.

Row versions (``store.py``): ``meters.row_version``, handed out by the one-row table ``row_versions``
(the last one given), which a transaction that writes rows increments once; under ``BEGIN IMMEDIATE``
no two transactions can take the same one, whichever connection they are on (one that rolls back hands
its number out again: nothing was written with it). ``Tx.lock_versions`` answers from what this
connection last read and wrote while no other connection has committed since (``PRAGMA data_version``,
read under ``BEGIN IMMEDIATE``, moves only when another connection commits), so with one writer a feed
batch reads no row at all; after another connection's commit it reads the versions again.

The schema is created on open, with its version in ``schema_version``: version 6. Older files are
migrated on open, in one transaction: version 1 had no webhook claim columns (added); version 2 kept one
open count per sandbox and nothing about when a ledger record was last applied. Its count becomes the
unattributed source's (``store.UNATTRIBUTED``, which the service forgets once, ``source_stale_s`` after it
starts), and its ledger rows get ``applied_at`` 0 (the service's grace after a start covers them: a live
forwarder's next batch sets it); version 3 had no row versions (its rows get 0, and versions are handed
out from 1); version 4 kept the meters and the row version in ``sandboxes`` (moved to ``meters``); version 5
wrote a forwarder's one pin as ``spki_pin`` (each registration is rewritten as ``push_registration`` writes it
now, with ``spki_pins``: a build older than the pin set cannot read those, and refuses the file by its
version). A file of any other version is refused.
"""

from __future__ import annotations

import functools
import itertools
import sqlite3
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from os import PathLike
from typing import Any, Literal, cast

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
    open_by_text,
    rewritten_registrations,
    state_of,
    state_row,
)
from scheduler.timers import Event, SandboxState

SCHEMA_VERSION = 6

_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sandboxes (
    sandbox TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    registration TEXT NOT NULL,          -- push_registration's JSON
    registered_at REAL NOT NULL,         -- when this incarnation began
    state TEXT NOT NULL,
    active_since REAL NOT NULL,
    open_connections INTEGER NOT NULL,
    hold_until REAL,
    stopped_at REAL,
    wake_from TEXT,
    fenced INTEGER NOT NULL,
    open_by TEXT NOT NULL DEFAULT '{}'   -- source -> open count, JSON, sorted keys (store.open_by_text)
);
CREATE TABLE meters (                    -- what a feed batch writes: one narrow row per sandbox
    sandbox TEXT PRIMARY KEY,
    last_activity REAL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL,
    row_version INTEGER NOT NULL DEFAULT 0  -- the version of the write that left the sandbox so (store.py)
);
CREATE TABLE row_versions (last INTEGER NOT NULL);  -- one row: the last version handed out
CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}';
CREATE TABLE feed_ledger (
    identity TEXT PRIMARY KEY,           -- the forwarder certificate's SAN and the stream: <san>#<n>
    epoch TEXT NOT NULL,
    epoch_ns INTEGER NOT NULL,           -- the epoch's start time: epochs are ordered by it
    last_seq INTEGER NOT NULL,
    applied_at REAL NOT NULL DEFAULT 0,  -- when its last batch was applied (the scheduler's clock)
    counts_forgotten INTEGER NOT NULL DEFAULT 0  -- 1: its open counts were dropped since (stale)
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, -- AUTOINCREMENT: an id is never reused, even after pruning
    sandbox TEXT NOT NULL,
    incarnation TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    at REAL NOT NULL,
    why TEXT NOT NULL,
    webhook INTEGER NOT NULL,            -- 0: not for the webhook, 1: due, 2: delivered
    claimed_by TEXT,                     -- the webhook owner holding a lease on it, until claimed_until
    claimed_until REAL
);
CREATE INDEX events_webhook_due ON events (id) WHERE webhook = 1;
INSERT INTO row_versions (last) VALUES (0);
"""
# Version 1 -> 2: the webhook claim columns.
_MIGRATE_1 = (
    "ALTER TABLE events ADD COLUMN claimed_by TEXT",
    "ALTER TABLE events ADD COLUMN claimed_until REAL",
    "UPDATE schema_version SET version = 2",
)
# Version 2 -> 3: open counts per source (the one count becomes the unattributed source's, ``""``, as
# store.open_by_text writes it), and the ledger's last-applied time.
_MIGRATE_2 = (
    "ALTER TABLE sandboxes ADD COLUMN open_by TEXT NOT NULL DEFAULT '{}'",
    """UPDATE sandboxes SET open_by = '{"":' || open_connections || '}' WHERE open_connections > 0""",
    "CREATE INDEX sandboxes_open ON sandboxes (sandbox) WHERE open_by <> '{}'",
    "ALTER TABLE feed_ledger ADD COLUMN applied_at REAL NOT NULL DEFAULT 0",
    "ALTER TABLE feed_ledger ADD COLUMN counts_forgotten INTEGER NOT NULL DEFAULT 0",
    "UPDATE schema_version SET version = 3",
)
# Version 3 -> 4: row versions.
_MIGRATE_3 = (
    "ALTER TABLE sandboxes ADD COLUMN row_version INTEGER NOT NULL DEFAULT 0",
    "CREATE TABLE row_versions (last INTEGER NOT NULL)",
    "INSERT INTO row_versions (last) VALUES (0)",
    "UPDATE schema_version SET version = 4",
)
# Version 4 -> 5: the traffic meters and the row version in a table of their own.
_MIGRATE_4 = (
    _SCHEMA[_SCHEMA.index("CREATE TABLE meters") : _SCHEMA.index("CREATE TABLE row_versions")].strip().rstrip(";"),
    "INSERT INTO meters (sandbox, last_activity, bytes_in, bytes_out, row_version) "
    "SELECT sandbox, last_activity, bytes_in, bytes_out, row_version FROM sandboxes",
    "ALTER TABLE sandboxes DROP COLUMN last_activity",
    "ALTER TABLE sandboxes DROP COLUMN bytes_in",
    "ALTER TABLE sandboxes DROP COLUMN bytes_out",
    "ALTER TABLE sandboxes DROP COLUMN row_version",
    "UPDATE schema_version SET version = 5",
)
# Version 5 -> 6: a forwarder pinned by a set (``spki_pins``); each stored registration is rewritten as this
# build writes it (``store.rewritten_registrations``), in _create.
_REWRITE_REGISTRATION = "UPDATE sandboxes SET registration = ? WHERE sandbox = ?"

# The state's columns by table (state_row gives them in STATE_COLUMNS order).
_TRAFFIC = METER_COLUMNS[: -len(COUNT_COLUMNS)]  # in ``meters``: last_activity, bytes_in, bytes_out
_IN_METERS = [i for i, c in enumerate(STATE_COLUMNS) if c in _TRAFFIC]
_IN_SANDBOXES = [i for i, c in enumerate(STATE_COLUMNS) if c not in _TRAFFIC]
assert _TRAFFIC == ("last_activity", "bytes_in", "bytes_out")  # the order save_meters writes them in
_REST = [STATE_COLUMNS[i] for i in _IN_SANDBOXES]
_JOINED = "sandboxes AS s JOIN meters AS m ON m.sandbox = s.sandbox"
_ROW_COLS = "s.sandbox, s.registration, s.registered_at, m.row_version, " + ", ".join(
    ("m." if c in _TRAFFIC else "s.") + c for c in STATE_COLUMNS
)
_UPDATE_REST = f"UPDATE sandboxes SET {', '.join(c + ' = ?' for c in _REST)} WHERE sandbox = ?"
_PUT = (
    "INSERT OR REPLACE INTO sandboxes (sandbox, incarnation, registration, registered_at, "
    f"{', '.join(_REST)}) VALUES ({', '.join('?' * (4 + len(_REST)))})"
)
_PUT_METERS = (
    f"INSERT OR REPLACE INTO meters (sandbox, {', '.join(_TRAFFIC)}, row_version) "
    f"VALUES ({', '.join('?' * (2 + len(_TRAFFIC)))})"
)
_UPDATE_TRAFFIC = f"UPDATE meters SET {', '.join(c + ' = ?' for c in _TRAFFIC)}, row_version = ? WHERE sandbox = ?"
# The same for many rows in one statement, an UPDATE ... FROM a VALUES list of them (SQLite 3.33 or
# later): a thousand rows in about three quarters of the CPU an executemany of _UPDATE_TRAFFIC takes (its
# reset, bind and step per row). Chunks of a power of two rows, _TRAFFIC_MIN to _TRAFFIC_MAX (fewer where
# the connection binds fewer parameters), the rest one row a statement: preparing one of these costs
# more than running it (6 ms for a thousand rows), so only those few texts are ever made, and the
# connection's statement cache keeps them prepared.
_TRAFFIC_PARAMS = len(_TRAFFIC) + 2  # a row of _UPDATE_TRAFFIC's parameters: the columns, row_version, sandbox
_TRAFFIC_MIN, _TRAFFIC_MAX = 8, 512
_UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)


@functools.lru_cache(maxsize=16)
def _update_traffic_from(n: int) -> str:
    """The UPDATE ... FROM (VALUES ...) of ``n`` rows of _UPDATE_TRAFFIC's parameters, in its order."""
    sets = ", ".join(f"{c} = v.column{i + 1}" for i, c in enumerate((*_TRAFFIC, "row_version")))
    row = "(" + ", ".join("?" * _TRAFFIC_PARAMS) + ")"
    return (f"UPDATE meters SET {sets} FROM (VALUES {', '.join([row] * n)}) AS v "
            f"WHERE meters.sandbox = v.column{_TRAFFIC_PARAMS}")
# The open counts: writing open_by costs an update of the partial index on it for every row.
_UPDATE_COUNTS = f"UPDATE sandboxes SET {', '.join(c + ' = ?' for c in COUNT_COLUMNS)} WHERE sandbox = ?"
_NEXT_VERSION = "UPDATE row_versions SET last = last + 1 RETURNING last"
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
# ``open_by <> '{}'`` as the index says it, so the planner reads the partial index.
_OPEN_FROM = (
    "SELECT sandbox FROM sandboxes WHERE open_by <> '{}' "
    "AND EXISTS (SELECT 1 FROM json_each(sandboxes.open_by) WHERE key = ?) ORDER BY sandbox"
)
_LOCK_CHUNK = 500  # IDs per SELECT ... IN (...): well under SQLite's limit on bound parameters
_ABSENT = -1  # in the known versions: the sandbox is not stored
_KNOWN_MAX = 1_000_000  # known versions beyond this (sandboxes removed elsewhere, never seen again): start afresh

Synchronous = Literal["FULL", "NORMAL"]


class SqliteTx:
    """``Tx`` on the store's connection inside ``BEGIN IMMEDIATE``; unusable once the transaction ends."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._open = True
        self._version: int | None = None
        # Row versions this transaction wrote, for the store's known versions once it commits (None:
        # written if it was stored, which this connection does not know: forget it).
        self.wrote: dict[str, int | None] = {}

    def _c(self) -> sqlite3.Connection:
        if not self._open:
            raise LocalProtocolError("tx_closed", "the transaction has ended")
        return self._store._conn

    def end(self) -> None:
        self._open = False

    def lock(self, sandboxes: Collection[str]) -> dict[str, StoredSandbox]:
        out: dict[str, StoredSandbox] = {}
        ids = list(dict.fromkeys(sandboxes))
        for row in self._select(_ROW_COLS, _JOINED, "s.sandbox", ids):
            s = self._store._sandbox_of(row)
            out[s.sandbox] = s
        known = self._store._known
        for sid in ids:
            got = out.get(sid)
            if got is None:
                self._store._regs.forget(sid)
            known[sid] = _ABSENT if got is None else got.version
        return out

    def lock_versions(self, sandboxes: Collection[str]) -> dict[str, int]:
        known = self._store._known
        try:
            # The usual batch: every row known (one writer), in one pass.
            out = {sid: known[sid] for sid in sandboxes}
        except KeyError:
            pass
        else:
            return {sid: v for sid, v in out.items() if v != _ABSENT} if _ABSENT in out.values() else out
        out = {}
        missing: list[str] = []
        for sid in dict.fromkeys(sandboxes):
            v = known.get(sid)
            if v is None:
                missing.append(sid)
            elif v != _ABSENT:
                out[sid] = v
        if missing:
            rows = self._select("sandbox, row_version", "meters", "sandbox", missing)
            found: dict[str, int] = {str(r[0]): int(r[1]) for r in rows}
            for sid in missing:
                v = found.get(sid)
                known[sid] = _ABSENT if v is None else v
                if v is not None:
                    out[sid] = v
        return out

    def _wrote(self, sandboxes: Collection[str], version: int) -> None:
        """``save``'s rows: written where stored, which the known versions say or leave open."""
        known, wrote = self._store._known, self.wrote
        wrote.update({
            sid: None if (was := wrote.get(sid, known.get(sid))) is None else _ABSENT if was == _ABSENT else version
            for sid in sandboxes
        })

    def _select(self, columns: str, source: str, key: str, ids: list[str]) -> Iterator[sqlite3.Row]:
        c = self._c()
        for i in range(0, len(ids), _LOCK_CHUNK):
            part = ids[i : i + _LOCK_CHUNK]
            marks = ", ".join("?" * len(part))
            yield from c.execute(f"SELECT {columns} FROM {source} WHERE {key} IN ({marks})", part)

    def written_version(self) -> int:
        if self._version is None:
            self._version = int(self._c().execute(_NEXT_VERSION).fetchall()[0][0])
        return self._version

    def ledger(self, identity: str) -> Stored | None:
        row = self._c().execute("SELECT epoch, last_seq FROM feed_ledger WHERE identity = ?", (identity,)).fetchone()
        return None if row is None else Stored(str(row[0]), int(row[1]))

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        c = self._c()
        body = push_registration(registration).decode()
        version = self.written_version()
        row = state_row(state)
        c.execute(_PUT, (sandbox, registration.incarnation, body, registered_at, *[row[i] for i in _IN_SANDBOXES]))
        c.execute(_PUT_METERS, (sandbox, *[row[i] for i in _IN_METERS], version))
        self.wrote[sandbox] = version
        return self._insert_events(c, events)

    def remove_registration(self, sandbox: str) -> bool:
        self._store._regs.forget(sandbox)
        c = self._c()
        removed = c.execute("DELETE FROM sandboxes WHERE sandbox = ?", (sandbox,)).rowcount > 0
        c.execute("DELETE FROM meters WHERE sandbox = ?", (sandbox,))
        self.wrote[sandbox] = _ABSENT
        return removed

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        c = self._c()
        if updates:
            version = self.written_version()
            rows = [(state_row(st), sid) for sid, st in updates.items()]
            c.executemany(_UPDATE_REST, [(*[row[i] for i in _IN_SANDBOXES], sid) for row, sid in rows])
            self._update_traffic([(*[row[i] for i in _IN_METERS], version, sid) for row, sid in rows])
            self._wrote(updates, version)
        return self._insert_events(c, events)

    def save_meters(self, updates: Mapping[str, SandboxState], counts: bool = True) -> None:
        if not updates:
            return
        version = self.written_version()
        c = self._c()
        rows = [(st.last_activity, st.bytes_in, st.bytes_out, version, sid) for sid, st in updates.items()]
        self._update_traffic(rows)
        if counts:
            c.executemany(_UPDATE_COUNTS, [(st.open_connections, open_by_text(st.open_by), sid)
                                           for sid, st in updates.items()])
        self._wrote(updates, version)

    def _update_traffic(self, rows: Sequence[tuple[object, ...]]) -> None:
        """_UPDATE_TRAFFIC for each of ``rows`` (its parameters), a chunk of them per statement."""
        c = self._c()
        most = self._store._traffic_rows
        done, n = 0, len(rows)
        while most and n - done >= _TRAFFIC_MIN:
            k = most
            while k > n - done:
                k //= 2
            c.execute(_update_traffic_from(k), list(itertools.chain.from_iterable(rows[done : done + k])))
            done += k
        if done < n:
            c.executemany(_UPDATE_TRAFFIC, rows[done:])

    def claim(self, identity: str, batch: Batch, decision: Decision) -> None:
        rec = check_apply(batch, decision)
        c = self._c()
        if rec.last_seq == 1:
            cur = c.execute(_CLAIM_FIRST, (identity, rec.epoch, epoch_start_ns(rec.epoch)))
        else:
            cur = c.execute(_CLAIM_NEXT, (rec.last_seq, identity, rec.epoch, rec.last_seq - 1))
        if cur.rowcount != 1:
            raise LedgerConflict(identity)

    def note_applied(self, identity: str, now: float) -> None:
        sql = "UPDATE feed_ledger SET applied_at = ?, counts_forgotten = 0 WHERE identity = ?"
        self._c().execute(sql, (now, identity))

    def open_from(self, source: str) -> list[str]:
        return [str(r[0]) for r in self._c().execute(_OPEN_FROM, (source,))]

    def stale_sources(self, before: float) -> list[str]:
        sql = "SELECT identity FROM feed_ledger WHERE applied_at < ? AND counts_forgotten = 0 ORDER BY identity"
        return [str(r[0]) for r in self._c().execute(sql, (before,))]

    def mark_forgotten(self, identity: str) -> None:
        self._c().execute("UPDATE feed_ledger SET counts_forgotten = 1 WHERE identity = ?", (identity,))

    @staticmethod
    def _insert_events(c: sqlite3.Connection, events: Sequence[Event]) -> list[int]:
        if not events:
            return []
        # One statement for them all (a batch that wakes a thousand sandboxes makes a thousand events).
        # Their ids are consecutive: AUTOINCREMENT takes one more than the largest id ever used, and
        # nobody else inserts under BEGIN IMMEDIATE.
        c.executemany(_INSERT_EVENT, [event_row(ev) for ev in events])
        last = int(c.execute("SELECT last_insert_rowid()").fetchone()[0])
        return list(range(last - len(events) + 1, last + 1))


class SqliteStore(OneShotWrites):
    """``Store`` on one SQLite file. One owner: not shared between threads (sqlite3's default check)."""

    shared = False

    def __init__(
        self, path: str | PathLike[str], *, synchronous: Synchronous = "FULL", busy_timeout_s: float = 5.0
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise LocalProtocolError("bad_config", "synchronous must be FULL or NORMAL")
        self._tx: SqliteTx | None = None
        self._regs = RegistrationCache()
        # Row versions as this connection last read or wrote them, valid while PRAGMA data_version is
        # ``_known_at`` (no other connection has committed since); _ABSENT: not stored.
        self._known: dict[str, int] = {}
        self._known_at: int | None = None
        try:
            # isolation_level=None: the module opens no transaction of its own; ours are explicit.
            # check_same_thread=False: the scheduler uses a store on its store thread (one at a time),
            # which need not be the thread that opened it.
            self._conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_s,
                                         check_same_thread=False)
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
        # The most rows per UPDATE ... FROM (VALUES ...) statement, a power of two; 0: one UPDATE per row.
        limit = self._conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // _TRAFFIC_PARAMS
        most = _TRAFFIC_MAX
        while most > limit:
            most //= 2
        self._traffic_rows = most if _UPDATE_FROM and most >= _TRAFFIC_MIN else 0

    # -- transactions ---------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[SqliteTx]:
        if self._tx is not None:
            raise LocalProtocolError("nested_transaction", "this store already has a transaction open")
        conn = self._conn
        tx = self._tx = SqliteTx(self)
        try:
            conn.execute("BEGIN IMMEDIATE")
            # Under the write lock: no other connection can commit until this transaction ends.
            seen = conn.execute("PRAGMA data_version").fetchone()[0]
            if seen != self._known_at or len(self._known) > _KNOWN_MAX:
                self._known.clear()
                self._known_at = seen
            yield tx
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            self._rollback()
            raise StoreError("sqlite", str(e)) from e
        except BaseException:
            self._rollback()
            raise
        else:
            known, wrote = self._known, tx.wrote
            if None in wrote.values():
                for sid, v in wrote.items():
                    if v is None:
                        known.pop(sid, None)
                    else:
                        known[sid] = v
            else:
                known.update(cast(dict[str, int], wrote))  # the usual commit: rows it knew, none unknown
        finally:
            tx.end()
            self._tx = None

    def _rollback(self) -> None:
        # What this transaction read may include its own writes, now undone: know nothing.
        self._known.clear()
        self._known_at = None
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
        with self.transaction():
            c = self._conn
            exists = c.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
            ).fetchone()
            if exists is None:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                c.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                return
            rows = [tuple(r) for r in c.execute("SELECT version FROM schema_version").fetchall()]
            if rows == [(1,)]:
                for stmt in _MIGRATE_1:
                    c.execute(stmt)
                rows = [(2,)]
            if rows == [(2,)]:
                for stmt in _MIGRATE_2:
                    c.execute(stmt)
                rows = [(3,)]
            if rows == [(3,)]:
                for stmt in _MIGRATE_3:
                    c.execute(stmt)
                rows = [(4,)]
            if rows == [(4,)]:
                for stmt in _MIGRATE_4:
                    c.execute(stmt)
                rows = [(5,)]
            if rows == [(5,)]:
                old = c.execute("SELECT sandbox, registration FROM sandboxes").fetchall()
                c.executemany(_REWRITE_REGISTRATION, rewritten_registrations(old))
                c.execute("UPDATE schema_version SET version = 6")
                return
            if rows != [(SCHEMA_VERSION,)]:
                found = [r[0] for r in rows]
                raise StoreError(
                    "schema_version", f"the file has version {found}, this build knows 1 to {SCHEMA_VERSION}"
                )

    def _sandbox_of(self, row: Sequence[Any]) -> StoredSandbox:
        sandbox, body, registered_at = str(row[0]), str(row[1]), row[2]
        reg = self._regs.get(sandbox, body)
        return StoredSandbox(sandbox, reg, float(registered_at), int(row[3]), state_of(sandbox, row[4:]))

    # -- reads ----------------------------------------------------------------------------------

    def sandboxes(self) -> list[StoredSandbox]:
        out = [self._sandbox_of(row) for row in self._read(f"SELECT {_ROW_COLS} FROM {_JOINED} ORDER BY s.sandbox")]
        self._regs.keep_only({s.sandbox for s in out})
        return out

    def versions(self) -> dict[str, int]:
        return {str(r[0]): int(r[1]) for r in self._read("SELECT sandbox, row_version FROM meters")}

    def sandboxes_in(self, sandboxes: Collection[str]) -> list[StoredSandbox]:
        out: list[StoredSandbox] = []
        ids = list(sandboxes)
        for i in range(0, len(ids), _LOCK_CHUNK):
            part = ids[i : i + _LOCK_CHUNK]
            marks = ", ".join("?" * len(part))
            rows = self._read(f"SELECT {_ROW_COLS} FROM {_JOINED} WHERE s.sandbox IN ({marks})", part)
            out += [self._sandbox_of(r) for r in rows]
        return out

    def sandbox(self, sandbox: str) -> StoredSandbox | None:
        rows = self._read(f"SELECT {_ROW_COLS} FROM {_JOINED} WHERE s.sandbox = ?", (sandbox,))
        return self._sandbox_of(rows[0]) if rows else None

    def ledger(self, identity: str) -> Stored | None:
        rows = self._read("SELECT epoch, last_seq FROM feed_ledger WHERE identity = ?", (identity,))
        return Stored(str(rows[0][0]), int(rows[0][1])) if rows else None

    # -- events ---------------------------------------------------------------------------------

    def events_after(self, after_id: int, limit: int = 1000) -> list[StoredEvent]:
        rows = self._read(f"{_SELECT_EVENTS} WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
        return [event_of(r) for r in rows]

    def undelivered_webhooks(self, limit: int = 100) -> list[StoredEvent]:
        rows = self._read(f"{_SELECT_EVENTS} WHERE webhook = {WEBHOOK_DUE} ORDER BY id LIMIT ?", (limit,))
        return [event_of(r) for r in rows]

    def claim_webhooks(self, owner: str, now: float, lease_s: float, limit: int = 100) -> list[StoredEvent]:
        check_lease(lease_s, limit)
        with self.transaction():
            rows = self._conn.execute(
                f"{_SELECT_EVENTS} WHERE webhook = {WEBHOOK_DUE} "
                "AND (claimed_by IS NULL OR claimed_by = ? OR claimed_until <= ?) ORDER BY id LIMIT ?",
                (owner, now, limit),
            ).fetchall()
            self._conn.executemany(
                "UPDATE events SET claimed_by = ?, claimed_until = ? WHERE id = ?",
                [(owner, now + lease_s, r[0]) for r in rows],
            )
        return [event_of(r) for r in rows]

    def mark_delivered(self, event_ids: Sequence[int]) -> None:
        with self.transaction():
            self._conn.executemany(
                f"UPDATE events SET webhook = {WEBHOOK_DONE} WHERE id = ? AND webhook = {WEBHOOK_DUE}",
                [(i,) for i in event_ids],
            )

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
