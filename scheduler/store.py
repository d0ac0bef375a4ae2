"""What the scheduler keeps across restarts, as one small interface (``Store``), and the two steps that tie
it to the pure cores: ``load_core`` (a ``TimerCore`` rebuilt from the store) and ``ingest_batch`` (a feed
batch judged, applied and persisted exactly once).

The store holds, per sandbox, its registration (the platform's JSON, ``push_registration``), when its
incarnation began, and the timer core's ``SandboxState`` (state, meters, hold, stop time); per forwarder
identity the feed ledger's ``Stored`` (epoch, last seq); and every ``Event`` with an increasing id (the
SSE stream resumes from an id, the webhook retries what is not yet delivered).

Every write method is one transaction. The one that matters most is ``apply_batch``: the batch's effect
on the sandboxes, its events and its ledger record commit together or not at all, so a crash can never
leave a batch applied without its seq recorded (it would be applied again) or recorded without being
applied (its bytes would be lost).

The ledger write is a claim, one conditional statement: it succeeds only if the stored record is still
the one the decision was made on (the same epoch at ``seq - 1``, or, for an epoch's first batch, none
or an older epoch). A claim that fails raises ``LedgerConflict`` and rolls back: another writer (a second
replica on a shared PostgreSQL) applied something meanwhile; the caller re-reads and decides again. On
SQLite with one writer it never fails, but the same code is right for several.

The core is ahead of the store while a transaction runs: ``ingest_batch`` applies the batch to the core,
then persists what changed. If the write fails, the core holds changes the store does not, so the caller
must rebuild the core (``load_core``) before it is used again; ``ingest_batch`` says so by raising.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sbxnet.errors import EnvironmentFault, LocalProtocolError
from sbxnet.protocol.feed import Batch
from sbxnet.protocol.routes import Registration
from scheduler.feed_ledger import Decision, Stored, decide
from scheduler.timers import Activity, Event, SandboxConfig, SandboxState, TimerCore


class StoreError(EnvironmentFault):
    """The store could not do what was asked (I/O, a full disk, a schema it does not know). The
    transaction was rolled back."""


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
    state: SandboxState

    def config(self) -> SandboxConfig:
        r = self.registration
        return SandboxConfig(self.sandbox, r.incarnation, r.idle_period_s, Activity(r.activity), self.registered_at)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    id: int  # increasing, never reused
    event: Event


class Store(Protocol):
    """What the scheduler's adapters call. Each method is one transaction; a failure raises
    ``StoreError`` and leaves the store as it was."""

    # -- the registry and the timer core's state ------------------------------------------------

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

    def sandboxes(self) -> list[StoredSandbox]:
        """Every stored sandbox, by ID."""
        ...

    def save(self, updates: Mapping[str, SandboxState], events: Sequence[Event]) -> list[int]:
        """The timer core's states for the sandboxes a call changed (timers, holds, wake, driver) and
        its events. A state whose sandbox is not stored is not written (it was removed meanwhile).
        Returns the events' ids."""
        ...

    # -- the feed ledger ------------------------------------------------------------------------

    def ledger(self, identity: str) -> Stored | None:
        """The record for a forwarder identity, or None when there is none."""
        ...

    def apply_batch(
        self, identity: str, batch: Batch, decision: Decision, sandbox_updates: Mapping[str, SandboxState],
        events: Sequence[Event],
    ) -> list[int]:
        """In one transaction: claim the ledger record ``decision.store`` (``LedgerConflict`` if the stored
        record moved since the decision), write the sandboxes' states after the batch (byte totals, open
        connections, last activity, state changes) and its events. ``decision`` must be an APPLY for
        ``batch`` (LocalProtocolError otherwise). Returns the events' ids."""
        ...

    # -- events ---------------------------------------------------------------------------------

    def events_after(self, after_id: int, limit: int = 1000) -> list[StoredEvent]:
        """Events with an id above ``after_id``, oldest first (the SSE stream's resume)."""
        ...

    def undelivered_webhooks(self, limit: int = 100) -> list[StoredEvent]:
        """Events the platform's webhook must get (to ``idle`` or ``waking``) not yet marked delivered."""
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


def load_core(store: Store) -> TimerCore:
    """A timer core holding every stored sandbox as it was saved (no events)."""
    core = TimerCore()
    for s in store.sandboxes():
        core.restore(s.config(), s.state)
    return core


class CoreAhead(StoreError):
    """The store refused a write after the core had changed: rebuild the core with ``load_core``."""


def ingest_batch(
    core: TimerCore, store: Store, identity: str, batch: Batch, now: float
) -> tuple[Decision, list[Event]]:
    """Judge ``batch`` from ``identity`` against the stored ledger; if it is to be applied, apply each entry
    to ``core`` (last activity = ``now - idle_s``) and persist the touched sandboxes, the events and the
    ledger record in one ``apply_batch``. Returns the decision (its ``answer`` is what to send) and the
    events (to publish once this returns). Raises ``CoreAhead`` if the write failed: nothing was stored,
    the core must be rebuilt, and the forwarder gets no answer (it resends the same batch)."""
    decision = decide(store.ledger(identity), batch)
    if not decision.apply:
        return decision, []
    events: list[Event] = []
    touched: dict[str, SandboxState] = {}
    for r in batch.sandboxes:
        events += core.on_report(r.sandbox, r.bytes_in, r.bytes_out, r.open, now - r.idle_s, now)
        if r.sandbox in core:
            touched[r.sandbox] = core.snapshot(r.sandbox)
    try:
        store.apply_batch(identity, batch, decision, touched, events)
    except StoreError as e:
        raise CoreAhead(e.reason, e.detail) from e
    return decision, events
