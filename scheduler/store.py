"""What the scheduler keeps across restarts, as one small interface (``Store``, written through ``Tx``), and
the two steps that tie it to the pure cores: ``load_core`` (a ``TimerCore`` rebuilt from the store) and
``ingest_batch`` (a feed batch judged, applied and persisted exactly once).

The store holds, per sandbox, its registration (the platform's JSON, ``push_registration``), when its
incarnation began, and the timer core's ``SandboxState`` (state, meters, open counts per source, hold,
stop time); per forwarder identity the feed ledger's ``Stored`` (epoch, last seq), when its last batch was
applied and whether its open counts have been forgotten since (``stale_sources``); and every ``Event``
with an increasing id (the SSE stream resumes from an id, the webhook retries what is not yet delivered).

The store is the truth; a replica's ``TimerCore`` is a cache of it. Several replicas may share one store
(``Store.shared``: PostgreSQL), so every write is one transaction (``Store.transaction``) that first locks
and reads the rows it will change (``Tx.lock``, ``Tx.ledger``), has the caller restore those rows into
its core (``TimerCore.restore``), apply the operation there, and write back what changed (``Tx.save``).
Two replicas therefore never lose each other's updates (the second waits for the first's commit and
starts from its result), and an idle timer fires once (the second replica re-reads the row under the
lock, finds it idle already, and its core makes no event).

Row versions: every write of a sandbox's row stamps it with the writing transaction's version
(``Tx.written_version``), a number the store hands out once, so no two writes of any rows share one
unless they are one transaction's. A core that read or wrote a row knows its version
(``TimerCore.stored_version``), and a row whose stored version is that one holds what the core holds: the
feed's path locks its rows reading their versions alone (``Tx.lock_versions``) and reads in full only
those whose version moved (``refresh_core``), which with one writer is none. A write that skips the lock (a one-shot
``save`` of states computed from a stale core) can overwrite another replica's commit: the one-shot
methods are for a store with one writer, and for tests.

The one that matters most is the feed batch: its effect on the sandboxes, its events and its ledger
record commit together or not at all, so a crash can never leave a batch applied without its seq
recorded (it would be applied again) or recorded without being applied (its bytes would be lost).

The ledger write is a claim, one conditional statement: it succeeds only if the stored record is still
the one the decision was made on (the same epoch at ``seq - 1``, or, for an epoch's first batch, none
or an older epoch). Read under the transaction the record cannot move, except that two writers can
both find none and both claim seq 1: the second claim fails, raises ``LedgerConflict``, and the
transaction rolls back; the forwarder's resend is then a duplicate.

The core is ahead of the store while a transaction runs: ``ingest_batch`` applies the batch to the core,
then persists what changed. If the write fails, the core holds changes the store does not, so the caller
must rebuild the core (``load_core``) before it is used again; ``ingest_batch`` says so by raising.

Webhooks: an event to ``idle`` or ``waking`` is due to the platform's webhook until ``mark_delivered``.
Replicas take due events with ``claim_webhooks``, a lease per owner, so two replicas do not both deliver
one event while the lease runs; a replica that dies holding a lease leaves its events to the others
once it ends (delivery is at least once: a slow owner may deliver after its lease ran out).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from sbxnet.errors import EnvironmentFault, LocalProtocolError
from sbxnet.protocol.feed import Batch
from sbxnet.protocol.routes import Registration, RouteError, pull_registration, push_registration
from scheduler.feed_ledger import Decision, Stored, decide
from scheduler.timers import METER_FIELDS, Activity, Event, SandboxConfig, SandboxState, State, TimerCore, Why


class StoreError(EnvironmentFault):
    """The store could not do what was asked (I/O, a full disk, a lost connection, a schema it does not
    know). The transaction was rolled back (after a failed commit: its outcome may be unknown)."""


class LedgerConflict(StoreError):
    """The ledger record changed since the decision was made (another writer): nothing was written."""

    def __init__(self, identity: str) -> None:
        super().__init__("ledger_conflict", identity)


@dataclass(frozen=True, slots=True)
class StoredSandbox:
    """One sandbox as the store holds it."""

    sandbox: str
    registration: Registration
    registered_at: float  # when this incarnation began (the timer core's ``registered_at``)
    version: int  # the version of the write that left the row so (``Tx.written_version``)
    state: SandboxState

    def config(self) -> SandboxConfig:
        return config_of(self.sandbox, self.registration, self.registered_at)


def config_of(sandbox: str, r: Registration, registered_at: float) -> SandboxConfig:
    """The timer core's config of a registration: its timer, and the forwarder whose feed is its evidence
    (keyed by the route's SPKI pins: docs/scheduler-api.md "Feed liveness")."""
    return SandboxConfig(sandbox, r.incarnation, r.idle_period_s, Activity(r.activity), registered_at,
                         feed_keys=r.forwarder.spki_pins, forwarder=r.forwarder.address)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    id: int  # increasing, never reused
    event: Event


class Tx(Protocol):
    """One open transaction (``Store.transaction``). Rows read through it stay locked against other
    writers until it ends. Lock before writing: a transaction that writes and then locks more rows can
    deadlock with another replica (PostgreSQL then aborts one of them with a ``StoreError``)."""

    def lock(self, sandboxes: Collection[str]) -> dict[str, StoredSandbox]:
        """The stored rows of these sandboxes (IDs not stored are left out), locked until the transaction
        ends. PostgreSQL: ``SELECT ... FOR UPDATE`` in ID order, so two replicas locking overlapping sets
        never deadlock; SQLite: ``BEGIN IMMEDIATE`` already holds the whole database."""
        ...

    def lock_versions(self, sandboxes: Collection[str]) -> dict[str, int]:
        """``lock``, reading only each stored row's version: what ``refresh_core`` compares with the
        versions a core holds before reading in full (with ``lock``) just the rows that moved."""
        ...

    def written_version(self) -> int:
        """The version every row this transaction writes is stamped with (``put_registration``, ``save``):
        taken from the store on first use, never one another transaction's writes had or will have."""
        ...

    def ledger(self, identity: str) -> Stored | None:
        """The record for a forwarder identity, or None; locked where it exists."""
        ...

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        """Insert or replace a sandbox's registration with its state (a new incarnation's is fresh) and
        the events registering it made. Returns the events' ids."""
        ...

    def remove_registration(self, sandbox: str) -> bool:
        """Forget a sandbox and its state (its events stay). False if it was not stored."""
        ...

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        """The timer core's states for the sandboxes an operation changed (timers, holds, wake, driver, a
        batch) and its events. A state whose sandbox is not stored is not written (it was removed
        meanwhile). Returns the events' ids, increasing in the order given."""
        ...

    def save_meters(self, updates: Mapping[str, SandboxState], counts: bool = True) -> None:
        """``save`` of states that differ from their rows in ``METER_COLUMNS`` alone (a batch's sandboxes
        that made no event, their rows read or known by version under this transaction's lock): only
        those columns are written, with the version; with ``counts`` False not the open counts either
        (``open_connections``, ``open_by``: they are what the rows hold). The caller must know the rest
        is what the row holds."""
        ...

    def claim(self, identity: str, batch: Batch, decision: Decision) -> None:
        """Claim the ledger record ``decision.store`` for ``batch`` (one conditional statement);
        ``LedgerConflict`` if the stored record moved since the decision. ``decision`` must be an APPLY
        for ``batch`` (LocalProtocolError otherwise)."""
        ...

    def note_applied(self, identity: str, now: float) -> None:
        """The identity's batch was applied at ``now`` (after its ``claim``): its open counts are live, so
        ``stale_sources`` leaves it out until ``now`` is old."""
        ...

    def open_from(self, source: str) -> list[str]:
        """The stored sandboxes whose open counts include one from ``source``, by ID (not locked: lock
        them with ``lock`` and look again at what it returns). Costs the rows with any open count (an
        index holds just those), not the fleet."""
        ...

    def stale_sources(self, before: float) -> list[str]:
        """Identities whose last batch was applied before ``before`` and whose open counts have not been
        forgotten since (``mark_forgotten``), by identity, locked until the transaction ends. PostgreSQL
        skips a record another transaction holds (a batch of that identity is being applied: it is not
        stale)."""
        ...

    def mark_forgotten(self, identity: str) -> None:
        """The identity's open counts were dropped: ``stale_sources`` leaves it out until its next claim."""
        ...


class Store(Protocol):
    """What the scheduler's adapters call. Writes go through ``transaction``; the one-shot write methods
    are each one transaction. A failure raises ``StoreError`` and leaves the store as it was."""

    @property
    def shared(self) -> bool:
        """Whether other replicas may write to this store (False: this process is its only writer)."""
        ...

    def transaction(self) -> AbstractContextManager[Tx]:
        """A transaction: committed when the block ends normally, rolled back when it raises (the
        exception propagates; a database error is raised as ``StoreError``). A commit that fails raises
        ``StoreError``. One at a time per store object (LocalProtocolError for a nested one)."""
        ...

    # -- one-shot writes, each its own transaction ---------------------------------------------

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        """``Tx.put_registration`` in a transaction of its own."""
        ...

    def remove_registration(self, sandbox: str) -> bool:
        """``Tx.remove_registration`` in a transaction of its own."""
        ...

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        """``Tx.save`` in a transaction of its own (no lock: see the module docstring)."""
        ...

    def apply_batch(
        self, identity: str, batch: Batch, decision: Decision, sandbox_updates: Mapping[str, SandboxState],
        events: Sequence[Event],
    ) -> list[int]:
        """In one transaction: ``Tx.claim`` (``LedgerConflict`` if the stored record moved since the
        decision), then ``Tx.save`` of the sandboxes' states after the batch and its events. Returns the
        events' ids."""
        ...

    # -- reads ----------------------------------------------------------------------------------

    def sandboxes(self) -> list[StoredSandbox]:
        """Every stored sandbox, by ID."""
        ...

    def versions(self) -> dict[str, int]:
        """Every stored sandbox's row version (a plain read: what a resync compares with its core's)."""
        ...

    def sandboxes_in(self, sandboxes: Collection[str]) -> list[StoredSandbox]:
        """The stored rows of these sandboxes (those not stored left out), a plain read without locks."""
        ...

    def sandbox(self, sandbox: str) -> StoredSandbox | None:
        """One stored sandbox as last committed, or None; a plain read that takes no lock and waits for
        none (the route lookup)."""
        ...

    def ledger(self, identity: str) -> Stored | None:
        """The record for a forwarder identity, or None when there is none."""
        ...

    # -- events ---------------------------------------------------------------------------------

    def events_after(self, after_id: int, limit: int = 1000) -> list[StoredEvent]:
        """Events with an id above ``after_id``, oldest first (the SSE stream's resume). An id becomes
        visible only after every lower id has (so a reader that resumes from the last id it saw misses
        nothing)."""
        ...

    def undelivered_webhooks(self, limit: int = 100) -> list[StoredEvent]:
        """Events the platform's webhook must get (to ``idle`` or ``waking``) not yet marked delivered,
        oldest first, whoever holds a claim on them."""
        ...

    def claim_webhooks(self, owner: str, now: float, lease_s: float, limit: int = 100) -> list[StoredEvent]:
        """Take up to ``limit`` undelivered webhook events, oldest first, that no other owner holds a lease
        on (its ``claimed_until`` is ``now`` or earlier, or there is none; ``owner``'s own are taken
        again), and lease them to ``owner`` until ``now + lease_s``, in one transaction."""
        ...

    def mark_delivered(self, event_ids: Sequence[int]) -> None:
        """The webhook delivered these events."""
        ...

    def close(self) -> None: ...


WEBHOOK_STATES = frozenset({"idle", "waking"})  # the events the platform's webhook gets


def check_apply(batch: Batch, decision: Decision) -> Stored:
    """The record an APPLY of ``batch`` writes; LocalProtocolError for a decision that is not one."""
    rec = decision.store
    if not decision.apply or rec is None or rec.epoch != batch.epoch or rec.last_seq != batch.seq:
        raise LocalProtocolError("not_an_apply", "apply_batch takes the APPLY decision for this batch")
    return rec


def check_lease(lease_s: float, limit: int) -> None:
    """``claim_webhooks``'s arguments: a positive finite lease, a positive limit."""
    if not (lease_s > 0 and lease_s < float("inf")) or limit < 1:
        raise LocalProtocolError("bad_lease", "lease_s must be positive and finite, limit at least 1")


class OneShotWrites:
    """The one-shot write methods of ``Store``, each one ``transaction()``, for a store class to inherit."""

    def transaction(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def put_registration(
        self, sandbox: str, registration: Registration, registered_at: float, state: SandboxState,
        events: Sequence[Event],
    ) -> list[int]:
        with self.transaction() as tx:
            return tx.put_registration(sandbox, registration, registered_at, state, events)

    def remove_registration(self, sandbox: str) -> bool:
        with self.transaction() as tx:
            return tx.remove_registration(sandbox)

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        with self.transaction() as tx:
            return tx.save(updates, events)

    def apply_batch(
        self, identity: str, batch: Batch, decision: Decision, sandbox_updates: Mapping[str, SandboxState],
        events: Sequence[Event],
    ) -> list[int]:
        check_apply(batch, decision)  # before a transaction is begun
        with self.transaction() as tx:
            # The claim first: a conflict is found before anything else is written.
            tx.claim(identity, batch, decision)
            return tx.save(sandbox_updates, events)


# -- rows, as both SQL stores lay them out --------------------------------------------------------

STATE_COLUMNS = (
    "state", "active_since", "last_activity", "bytes_in", "bytes_out", "open_connections", "hold_until",
    "stopped_at", "wake_from", "fenced", "open_by",
)
METER_COLUMNS = METER_FIELDS  # the columns Tx.save_meters writes, in this order (meter_row)
COUNT_COLUMNS = ("open_connections", "open_by")  # the last of them, which save_meters(counts=False) leaves
WEBHOOK_NONE, WEBHOOK_DUE, WEBHOOK_DONE = 0, 1, 2  # events.webhook
# The source of the open counts a store kept before they were kept per source (a migrated row's single
# count), and of reports from a caller that names none. The service forgets it once, after its start.
UNATTRIBUTED = ""


def open_by_text(open_by: Mapping[str, int]) -> str:
    """``open_by`` as the JSON text the ``open_by`` column holds: sorted keys, no spaces, so one value has
    one text (``{}`` for none, which the stores' partial index leaves out)."""
    if not open_by:
        return "{}"
    return _dump(tuple(open_by.items()))


def open_by_of(sandbox: str, text: str) -> dict[str, int]:
    """The ``open_by`` column's JSON back: an object of positive integer counts, or ``StoreError``."""
    if text == "{}":
        return {}
    try:
        return dict(_parse(text))
    except ValueError:
        raise StoreError("bad_row", f"sandbox {sandbox!r}: open_by is not an object of positive counts") from None


# Memoized both ways: a batch writes and reads every sandbox it names, and they hold a few distinct count
# sets (one stream with one or two connections, mostly), which json would otherwise encode and decode
# each time at a few microseconds each: as much as the rest of a row's work.
@functools.lru_cache(maxsize=4096)
def _dump(items: tuple[tuple[str, int], ...]) -> str:
    return json.dumps(dict(items), sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> tuple[tuple[str, int], ...]:
    value = json.loads(text)
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int and v > 0 for k, v in value.items()
    ):
        raise ValueError("not an object of positive counts")
    return tuple(value.items())


def state_row(st: SandboxState) -> tuple[object, ...]:
    """A state's values in ``STATE_COLUMNS`` order."""
    return (
        st.state.value, st.active_since, st.last_activity, st.bytes_in, st.bytes_out, st.open_connections,
        st.hold_until, st.stopped_at, None if st.wake_from is None else st.wake_from.value, bool(st.fenced),
        open_by_text(st.open_by),
    )


def meter_row(st: SandboxState) -> tuple[object, ...]:
    """A state's values in ``METER_COLUMNS`` order."""
    return st.last_activity, st.bytes_in, st.bytes_out, st.open_connections, open_by_text(st.open_by)


_STATES = {s.value: s for s in State}


def state_of(sandbox: str, row: Sequence[Any]) -> SandboxState:
    """The state in a row's ``STATE_COLUMNS`` values (which are what the schema says). ``open_connections``
    is the sum of ``open_by`` (the column is written for readers of the database, not read back)."""
    state, active_since, last_activity, bytes_in, bytes_out, _, hold_until, stopped_at, wake_from, fenced, by = row
    open_by = open_by_of(sandbox, by)
    return SandboxState(
        float(active_since),
        _STATES.get(state) or State(state),  # the lookup first: State() costs a microsecond
        None if last_activity is None else float(last_activity),
        int(bytes_in),
        int(bytes_out),
        sum(open_by.values()),
        open_by,
        None if hold_until is None else float(hold_until),
        None if stopped_at is None else float(stopped_at),
        None if wake_from is None else _STATES.get(wake_from) or State(wake_from),
        bool(fenced),
    )


def event_row(ev: Event) -> tuple[object, ...]:
    """An event's values: sandbox, incarnation, from_state, to_state, at, why, webhook."""
    return (
        ev.sandbox, ev.incarnation, None if ev.from_state is None else ev.from_state.value, ev.to_state.value,
        ev.at, ev.why.value, WEBHOOK_DUE if ev.to_state.value in WEBHOOK_STATES else WEBHOOK_NONE,
    )


def event_of(row: Sequence[Any]) -> StoredEvent:
    """The event in a row of id, sandbox, incarnation, from_state, to_state, at, why."""
    eid, sandbox, incarnation, frm, to, at, why = row
    ev = Event(str(sandbox), str(incarnation), None if frm is None else State(frm), State(to), float(at), Why(why))
    return StoredEvent(int(eid), ev)


class RegistrationCache:
    """Parsed registrations by sandbox, reused while the stored JSON is the same text: a batch locks and
    reads every sandbox it names, and parsing each one's registration again would cost more than the
    rest of the write."""

    MAX = 1_000_000  # beyond this (sandboxes removed elsewhere, never seen again) start afresh

    def __init__(self) -> None:
        self._regs: dict[str, tuple[str, Registration]] = {}

    def get(self, sandbox: str, body: str) -> Registration:
        hit = self._regs.get(sandbox)
        if hit is not None and hit[0] == body:
            return hit[1]
        try:
            reg = pull_registration(body.encode())
        except RouteError as e:
            raise StoreError("bad_row", f"sandbox {sandbox!r}: stored registration refused: {e.reason}") from None
        if len(self._regs) >= self.MAX:
            self._regs.clear()
        self._regs[sandbox] = (body, reg)
        return reg

    def forget(self, sandbox: str) -> None:
        self._regs.pop(sandbox, None)

    def keep_only(self, sandboxes: Collection[str]) -> None:
        """After a full read: drop the sandboxes no longer stored."""
        self._regs = {s: v for s, v in self._regs.items() if s in sandboxes}


def rewritten_registrations(rows: Sequence[Sequence[Any]]) -> list[tuple[str, str]]:
    """For a migration: ``(body, sandbox)`` for each ``(sandbox, body)`` row whose registration this build
    writes otherwise (a forwarder's one ``spki_pin`` becomes ``spki_pins``), as ``push_registration`` writes
    it now. A body that does not decode is left as it is: it was unreadable before (reads of it raise
    ``bad_row``), and rewriting it would lose what it held."""
    out: list[tuple[str, str]] = []
    for sandbox, body in rows:
        try:
            fresh = push_registration(pull_registration(str(body).encode())).decode()
        except (RouteError, LocalProtocolError):
            continue
        if fresh != body:
            out.append((fresh, str(sandbox)))
    return out


def load_core(store: Store) -> TimerCore:
    """A timer core holding every stored sandbox as it was saved (no events), with its row's version."""
    core = TimerCore()
    for s in store.sandboxes():
        core.restore(s.config(), s.state, s.version)
    return core


def sync_core(core: TimerCore, sandboxes: Collection[str], rows: Mapping[str, StoredSandbox]) -> None:
    """Make ``core`` hold what the store holds for ``sandboxes`` (``rows``, from ``Tx.lock``): a stored
    sandbox restored unless the core holds that row's version already, one that is not stored removed
    (another replica removed it, or it was never registered)."""
    for sid in sandboxes:
        row = rows.get(sid)
        if row is None:
            core.remove(sid)
        elif core.stored_version(sid) != row.version:
            have = core.config(sid) if sid in core else None
            # The core's config when the row's is the same (building one validates it: a few us a row).
            config = have if have is not None and _same_config(have, row) else row.config()
            core.restore(config, row.state, row.version)


def _same_config(c: SandboxConfig, row: StoredSandbox) -> bool:
    """``c == row.config()`` without building one."""
    r = row.registration
    return (
        c.incarnation == r.incarnation
        and c.idle_period_s == r.idle_period_s
        and c.activity == r.activity
        and c.registered_at == row.registered_at
        and c.feed_keys == r.forwarder.spki_pins
        and c.forwarder == r.forwarder.address
    )


def refresh_core(core: TimerCore, tx: Tx, sandboxes: Collection[str]) -> None:
    """``sync_core`` for ``sandboxes``, their rows locked, reading in full only the rows whose stored
    version is not the one ``core`` holds (``Tx.lock_versions``, then ``Tx.lock`` of those): with one
    writer the core holds every version already, and nothing but versions is read."""
    versions = tx.lock_versions(sandboxes)
    stale = core.not_stored_at(sandboxes, versions)
    if stale:
        present = [sid for sid in stale if sid in versions]
        sync_core(core, stale, tx.lock(present) if present else {})


class CoreAhead(StoreError):
    """The store refused a write after the core had changed: rebuild the core with ``load_core``."""


def ingest_batch(
    core: TimerCore, store: Store, identity: str, batch: Batch, now: float
) -> tuple[Decision, list[Event]]:
    """Judge ``batch`` from ``identity`` against the ledger record read (and locked) in one transaction; if
    it is to be applied, lock the batch's sandboxes, bring ``core`` up to what the store holds for them
    (``refresh_core``: only rows whose version moved are read in full), apply each entry to the core
    (last activity = ``now - idle_s``, open counts as ``identity``'s) and write the ledger claim, the time
    it was applied, the touched sandboxes and the events in the same transaction. Returns the decision
    (its ``answer`` is what to send) and the events (to publish once this returns); once committed, the
    core holds the written rows' version (``TimerCore.mark_stored``).

    An epoch's first batch (a forwarder worker that restarted, or one the ledger has no record of) knows
    nothing of the connections its previous epoch reported: ``identity``'s counts are forgotten first
    (``TimerCore.forget_source``) from every sandbox that holds one, and those rows are locked, brought
    up to date and written with the rest. Which rows: those the store says hold one (``Tx.open_from``)
    and those this core's index names. The store's answer is complete across replicas: counts from
    ``identity`` are added only by its own batches, which all lock its ledger record first, as this one
    did before asking, so every batch of it that committed is visible and none can commit meanwhile
    (other writers only remove counts, and a row whose count went meanwhile is re-read under its lock).
    The core's index adds the rows it would otherwise change without a lock (it may lag the store).

    Raises ``CoreAhead`` if the write failed after the core was changed (including ``LedgerConflict``):
    nothing was stored, the core must be rebuilt, and the forwarder gets no answer (it resends the same
    batch). A ``StoreError`` before that (the store unreachable, the ledger unreadable) is raised as it is:
    the core is still a faithful cache."""
    ((decision, events),) = ingest_batches(core, store, [(identity, batch)], now)
    return decision, events


def ingest_batches(
    core: TimerCore, store: Store, batches: Sequence[tuple[str, Batch]], now: float
) -> list[tuple[Decision, list[Event]]]:
    """``ingest_batch`` for several batches (each with its identity) in one transaction (group commit: one
    begin, one commit, one sync for all of them): each judged against the ledger as the ones before it in
    the list left it (a batch sent twice is applied once), applied and written in that order. Returns
    each one's decision and events. Any failure fails them all: ``CoreAhead`` if the core had changed by
    then (nothing of any of them was stored), otherwise the ``StoreError`` as it is."""
    ahead = False
    out: list[tuple[Decision, list[Event]]] = []
    touched: list[str] = []
    version = 0
    try:
        with store.transaction() as tx:
            for identity, batch in batches:
                decision = decide(tx.ledger(identity), batch)
                if not decision.apply:
                    out.append((decision, []))
                    continue
                sids, restart = _rows_of(core, tx, identity, batch, decision)
                refresh_core(core, tx, sids)
                ahead = True
                events, wrote = _apply(core, tx, identity, batch, decision, sids, restart, now)
                out.append((decision, events))
                touched += wrote
            version = tx.written_version() if touched else 0
    except StoreError as e:
        if not ahead:
            raise
        raise CoreAhead(e.reason, e.detail) from e
    core.mark_stored(touched, version)  # committed: the core holds these rows as written
    return out


def _rows_of(core: TimerCore, tx: Tx, identity: str, batch: Batch, decision: Decision) -> tuple[list[str], bool]:
    """The rows an APPLY of ``batch`` writes (an epoch's first batch: with those holding its counts), and
    whether it is an epoch's first."""
    sids = [r.sandbox for r in batch.sandboxes]
    restart = decision.store is not None and decision.store.last_seq == 1
    if restart:
        held = set(core.holding(identity)).union(tx.open_from(identity))
        sids += sorted(held.difference(sids))
    return sids, restart


def _apply(
    core: TimerCore, tx: Tx, identity: str, batch: Batch, decision: Decision, sids: list[str], restart: bool,
    now: float,
) -> tuple[list[Event], list[str]]:
    """One APPLY of ``batch`` inside ``tx``, its rows locked and refreshed (``ingest_batch``); returns its
    events and the rows it wrote."""
    events: list[Event] = core.forget_source(identity, now) if restart else []
    events += core.on_reports(batch.sandboxes, now, identity)
    tx.claim(identity, batch, decision)
    tx.note_applied(identity, now)
    # The core's own states, not copies: written at once. A sandbox with no event changed only
    # its meters (TimerCore.on_report, forget_source), and the rest of its row is what the core
    # holds (read, or known by version, under this lock): those columns alone are written.
    # Of those, one whose open counts did not change leaves them too (TimerCore.counts_changed).
    touched, whole, counted, traffic = core.rows_to_write(sids, {ev.sandbox for ev in events})
    tx.save(whole, events)
    tx.save_meters(counted)
    tx.save_meters(traffic, counts=False)
    return events, touched
