"""The scheduler's service: the one owner of the timer core, the store and what follows a state change
(docs/scheduler-api.md). The HTTP adapter (``api_http.py``) calls it; it calls no network itself.

Every change runs the same way, as one synchronous operation on the store thread
(``store_thread.StoreThread``: one worker, so two operations never interleave, and the event loop never
waits on the store): open a store transaction, lock and re-read the rows it will change, put them back into the core
(``_refresh``), apply the core's call, write back what changed with its events, commit. The store is the
truth and the core a cache of it: on a store another replica writes too (PostgreSQL), the re-read under
the row lock is what keeps two replicas from losing each other's updates or both firing one idle timer;
on SQLite it costs a primary-key read. A write that fails leaves the core ahead of the store, so the core
is rebuilt from the store (``load_core``) before the error goes back to the caller (``Unavailable``).

The synchronous methods are those operations (a test may call them directly, on its own thread); the
event loop calls them through ``call`` (and reads through ``read``: the route lookup, status and the event
log on a second store connection of its own thread when one is given, so a read does not wait behind a
write that waits on a lock). ``status`` and the timer loop's next deadline come from the core, read on
the store thread too: the core is that thread's.

After a commit the events are published on the loop (handed to it from the store thread with
``call_soon_threadsafe`` right after the commit, so in commit order, and whether or not the request that
made them still waits): waiters on a sandbox's wake are woken, the timer loop re-arms,
the event stream and the webhook sender are told there is something new (both read the store's event log,
so an event another replica committed reaches them too, on their next poll).

Stale feed sources: the timer loop also forgets the open counts of a feed stream (a ledger identity)
whose last batch was applied more than ``source_stale_s`` ago (``forget_stale``): a forwarder worker that
died with connections open, and never came back under a new epoch, must not keep its sandboxes active
forever. The time of each stream's last batch is in the ledger (``Tx.note_applied``), not in this
replica's memory: on a shared store a stream's batches may all go to another replica, and only the store
knows it is alive. After this process starts, nothing is forgotten for ``source_stale_s`` (a scheduler
that was down has old times for live streams too; their next batches refresh them), and the counts a
store kept before they had a source (``store.UNATTRIBUTED``, from a migrated row) are forgotten then,
once. This relies on a live stream sending a batch more often than ``source_stale_s``.

Feed liveness (docs/scheduler-api.md "Feed liveness"): the service makes the ``FeedLiveness`` the feed
adapter notes every applied batch in (per forwarder key, the route's SPKI pin), and its timer loop expires
the feeds silent longer than ``feed_stale_s`` each round; the timer core idles a sandbox by its byte timer
only while its forwarder's feed is live, and never over the silence before it became live. Nothing is
live when this process starts. Liveness is this process's memory, not the store's: on a shared store a
replica idles only the sandboxes of forwarders whose feeds it hears itself (the rows it locks and
re-reads hold every replica's applied batches), and leaves the others to the replica that hears them.
Status says why an active sandbox is not being idled (``idle_blocked``).

What the service does not decide: the states and timers (``timers.TimerCore``), the feed's exactly-once
rule (``feed_ledger``), the shapes on the wire (``sbxnet.protocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

from sbxnet.errors import EnvironmentFault, LocalProtocolError
from sbxnet.protocol.routes import Registration, Route
from scheduler.feed_http import FeedService
from scheduler.feed_liveness import FeedLiveness
from scheduler.store import UNATTRIBUTED, Store, StoredSandbox, StoreError, Tx, config_of, load_core, sync_core
from scheduler.store_thread import StoreThread
from scheduler.timers import (
    Event,
    SandboxStatus,
    State,
    TimerCore,
    UnknownSandbox,
)

log = logging.getLogger("sbxnet.scheduler")

T = TypeVar("T")

MAX_TIMER_SLEEP_S = 0.5  # the timer loop looks again at least this often (a report can make a deadline appear)
DEFAULT_FEED_STALE_S = 5.4  # 3 feed intervals (1 s) + the forwarder's longest retry (2 s + 20 %): settings.py
MAX_SWEEP_S = 1.0  # stale feed sources are looked for this often (a quarter of source_stale_s if less)


class Unavailable(EnvironmentFault):
    """The store failed; nothing was changed (the HTTP adapter answers 503)."""

    def __init__(self, detail: str) -> None:
        super().__init__("store_unavailable", detail)


@dataclass(frozen=True, slots=True)
class WakeAnswer:
    """What ``POST /v1/sandboxes/{id}/wake`` answers: the state, and whether the driver failed the start."""

    state: State
    failed: bool = False


class SchedulerService:
    """``now`` is wall-clock seconds (the store keeps these times across restarts). ``auto_ready``: no
    driver is configured, so a wake takes the sandbox straight to ``active`` (a fleet whose sandboxes
    always run); otherwise the driver is the platform's webhook, which answers through ``driver_*``.
    ``source_stale_s``: a feed stream silent this long has its open counts forgotten (0: never).
    ``worker``: the thread ``store`` is used on (one is made if not given); ``reader``: a second store
    object on the same database for the reads that must not wait behind a write (route lookups, status on
    a shared store, the event log), used on a thread of its own (``reader_thread``; made if not given).
    Without a reader those reads go through ``worker``. ``feed_stale_s``: a forwarder's feed silent this
    long is no longer live, and its sandboxes are not idled until it reports again."""

    def __init__(
        self,
        store: Store,
        *,
        forwarder_allow: Collection[str],
        now: Callable[[], float] = time.time,
        auto_ready: bool = False,
        resync_s: float = 5.0,
        source_stale_s: float = 30.0,
        feed_stale_s: float = DEFAULT_FEED_STALE_S,
        worker: StoreThread | None = None,
        reader: Store | None = None,
        reader_thread: StoreThread | None = None,
        max_pending: int | None = None,
        core: TimerCore | None = None,
    ) -> None:
        if not source_stale_s >= 0:
            raise LocalProtocolError("bad_config", "source_stale_s must be 0 (never) or positive")
        self.store = store
        self.worker = worker or (StoreThread() if max_pending is None else StoreThread(max_pending=max_pending))
        self.reader = reader
        self.reader_thread = (reader_thread or StoreThread("sbxnet-store-read")) if reader is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.auto_ready = auto_ready
        self.resync_s = resync_s
        self.source_stale_s = source_stale_s
        self._now = now
        self._started_at = now()  # forget_stale waits source_stale_s from here
        self._unattributed_forgotten = False
        self.liveness = FeedLiveness(feed_stale_s, self._started_at)
        # ``core``: the store's, loaded already (on the store thread); otherwise loaded here.
        self.feed = FeedService(store, forwarder_allow, core=core, now=now, on_events=self._published,
                                worker=self.worker, liveness=self.liveness)
        self._changed: dict[str, asyncio.Event] = {}  # sandbox -> set at its next state change
        self._new_events = asyncio.Event()  # the event stream and the webhook sender wait on it
        self._timer_kick = asyncio.Event()
        self._timer_task: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {
            "events": 0, "wakes": 0, "driver_starts": 0, "timer_fires": 0, "store_errors": 0, "resyncs": 0,
            "sources_forgotten": 0, "route_lookups": 0,
        }
        self.state_counts: dict[str, int] = {}  # by state, as of the timer loop's last count (metrics)

    # -- the core and the transaction pattern ---------------------------------------------------

    @property
    def core(self) -> TimerCore:
        """The feed adapter rebuilds its core when a write fails; this is always the current one."""
        return self.feed.core

    def now(self) -> float:
        return self._now()

    def _refresh(self, tx: Tx, sandboxes: Collection[str]) -> None:
        """Lock these rows and put what the store holds into the core (a row another replica wrote wins;
        a sandbox the store no longer has is forgotten)."""
        rows = tx.lock(sandboxes)
        core = self.core
        for sid in sandboxes:
            row = rows.get(sid)
            if row is not None:
                core.restore(row.config(), row.state, row.version)
            elif sid in core:
                core.remove(sid)

    @contextlib.contextmanager
    def _transaction(self, sandboxes: Collection[str]) -> Iterator[Tx]:
        """A transaction with these rows locked and refreshed. A store failure rebuilds the core and
        raises ``Unavailable``; any other exception rolls back and is re-raised (the core is rebuilt
        too, since the call may have changed it before failing)."""
        try:
            with self.store.transaction() as tx:
                self._refresh(tx, sandboxes)
                yield tx
        except StoreError as e:
            self.counters["store_errors"] += 1
            self._rebuild()
            raise Unavailable(f"{e.reason}: {e.detail}") from e
        except LocalProtocolError:
            raise  # the core refused the call (unknown sandbox, a bad hold) before changing anything
        except BaseException:
            self._rebuild()
            raise

    def _rebuild(self) -> None:
        self.feed._rebuild()
        self._timer_kick.set()

    def _published(self, events: list[Event]) -> None:
        """After a commit: wake whoever waits on these sandboxes, and tell the stream and the sender. On
        the store thread this hands them to the loop (in commit order); on the loop it publishes."""
        if not events:
            return
        loop = self._loop
        if loop is not None and self.worker.on_thread():
            loop.call_soon_threadsafe(self._publish, events)
            return
        self._publish(events)

    def _publish(self, events: list[Event]) -> None:
        self.counters["events"] += len(events)
        for ev in events:
            waiter = self._changed.pop(ev.sandbox, None)
            if waiter is not None:
                waiter.set()
            log.info("state change", extra={"event": "state_change", "sandbox_id": ev.sandbox,
                                            "fields": ev.to_json()})
        self._new_events.set()
        self._new_events = asyncio.Event()
        self._timer_kick.set()

    def new_events(self) -> asyncio.Event:
        """Set at the next commit that made events (on this replica)."""
        return self._new_events

    async def call(self, fn: Callable[..., T], *args: object, bounded: bool = True) -> T:
        """``fn(*args)`` (one of the operations here) on the store thread; ``Busy`` when too many wait."""
        self._loop = asyncio.get_running_loop()
        return await self.worker.run(fn, *args, bounded=bounded)

    async def read(self, fn: Callable[..., T], *args: object, bounded: bool = True) -> T:
        """``fn(store, *args)`` on the reader's thread with the reader store (the writer's without one)."""
        if self.reader is None or self.reader_thread is None:
            return await self.call(fn, self.store, *args, bounded=bounded)
        return await self.reader_thread.run(fn, self.reader, *args, bounded=bounded)

    async def lookup(self, sandbox: str) -> Route | None:
        """``route`` read without waiting behind a write (counted: ``route_lookups``)."""
        self.counters["route_lookups"] += 1
        return await self.read(self._route_in, sandbox)

    # -- the registry ---------------------------------------------------------------------------

    def register(self, sandbox: str, registration: Registration) -> tuple[bool, State]:
        """``PUT /v1/sandboxes/{id}``: add or replace. Returns (created, state). A new incarnation starts
        afresh (``registered``); the same one keeps its state and takes the new period and policy."""
        now = self.now()
        with self._transaction([sandbox]) as tx:
            created = sandbox not in self.core
            config = config_of(sandbox, registration, now)
            events = self.core.register(config, now)
            registered_at = self.core.config(sandbox).registered_at
            tx.put_registration(sandbox, registration, registered_at, self.core.snapshot(sandbox), events)
        self._published(events)
        state = self.core.state_of(sandbox)
        assert state is not None
        return created, state

    def remove(self, sandbox: str) -> bool:
        with self._transaction([sandbox]) as tx:
            removed = tx.remove_registration(sandbox)
            self.core.remove(sandbox)
        return removed

    def route(self, sandbox: str) -> Route | None:
        """The gateway's route lookup: the registration as stored with the current state. Read from the
        store (another replica may have changed it), not from the core: the last commit, without a lock
        (a plain read; on PostgreSQL a row lock does not hold it up, on SQLite's WAL neither does a write)."""
        return self._route_in(self.store, sandbox)

    def _route_in(self, store: Store, sandbox: str) -> Route | None:
        row = self._row(store, sandbox)
        if row is None:
            return None
        return row.registration.route(sandbox, row.state.state.value)

    def _row(self, store: Store, sandbox: str) -> StoredSandbox | None:
        try:
            return store.sandbox(sandbox)
        except StoreError as e:
            self.counters["store_errors"] += 1
            raise Unavailable(f"{e.reason}: {e.detail}") from e

    # -- holds, wakes and the driver --------------------------------------------------------------

    def hold(self, sandbox: str, ttl_s: float) -> float:
        """``POST /v1/sandboxes/{id}/hold``; returns the hold in force (extend-only). UnknownSandbox."""
        now = self.now()
        with self._transaction([sandbox]) as tx:
            self._known(sandbox)
            outcome = self.core.hold(sandbox, ttl_s, now)
            tx.save({sandbox: self.core.snapshot(sandbox)}, outcome.events)
        self._published(outcome.events)
        return outcome.hold_until

    def start_wake(self, sandbox: str) -> State:
        """One wake: idle or stopped -> waking (the driver's webhook is the ``waking`` event), stopping ->
        active (the stop fence). With ``auto_ready`` the start completes at once. Returns the state."""
        now = self.now()
        self.counters["wakes"] += 1
        with self._transaction([sandbox]) as tx:
            self._known(sandbox)
            outcome = self.core.wake(sandbox, now)
            events = list(outcome.events)
            if outcome.start_driver:
                self.counters["driver_starts"] += 1
                if self.auto_ready:
                    events += self.core.driver_ready(sandbox, now)
            tx.save({sandbox: self.core.snapshot(sandbox)}, events)
        self._published(events)
        state = self.core.state_of(sandbox)
        assert state is not None
        return state

    async def wake(self, sandbox: str, wait: float) -> WakeAnswer:
        """The gateway's wake: start it (coalesced by the core: the driver is asked once per idle/stopped
        -> waking), then wait up to ``wait`` seconds for it to be active. A sandbox that leaves ``waking``
        for anything but ``active`` had its start fail."""
        state = await self.call(self.start_wake, sandbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if state is State.ACTIVE:
                return WakeAnswer(state)
            if state is not State.WAKING:
                return WakeAnswer(state, failed=True)
            left = deadline - loop.time()
            if left <= 0:
                return WakeAnswer(state)
            changed = self._changed.setdefault(sandbox, asyncio.Event())
            # A replica that shares the store may take the change: look at the row now and then too.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 0.25) if self.store.shared else left)
            route = await self.read(self._route_in, sandbox, bounded=False)
            if route is None:
                raise UnknownSandbox(sandbox)
            state = State(route.state)

    def driver_report(self, sandbox: str, what: str) -> tuple[State, bool | None]:
        """The driver's word (``POST /v1/sandboxes/{id}/driver``): ``stopping`` (answers whether to
        proceed: the stop fence), ``stopped``, ``ready`` or ``failed``. Returns (state, proceed)."""
        now = self.now()
        proceed: bool | None = None
        with self._transaction([sandbox]) as tx:
            self._known(sandbox)
            core = self.core
            if what == "stopping":
                stop = core.driver_stopping(sandbox, now)
                events, proceed = stop.events, stop.proceed
            elif what == "stopped":
                wake = core.driver_stopped(sandbox, now)
                events = list(wake.events)
                if wake.start_driver:
                    self.counters["driver_starts"] += 1
                    if self.auto_ready:
                        events += core.driver_ready(sandbox, now)
            elif what == "ready":
                events = core.driver_ready(sandbox, now)
            elif what == "failed":
                events = core.driver_failed(sandbox, now)
            else:
                raise ValueError(f"driver event {what!r}")
            tx.save({sandbox: core.snapshot(sandbox)}, events)
        self._published(events)
        state = self.core.state_of(sandbox)
        assert state is not None
        return state, proceed

    def _known(self, sandbox: str) -> None:
        if sandbox not in self.core:
            raise UnknownSandbox(sandbox)

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> list[SandboxStatus]:
        """Every sandbox's row. On a shared store from the store (this replica's core may lag another's
        writes by up to ``resync_s``), otherwise from the core, which is then exactly the store. An active
        sandbox whose forwarder's feed is not live says so (``idle_blocked``) and has no ``idle_in_s``."""
        if not self.store.shared:
            return self._feed_notes(self.core, self.core.status(self.now()))
        return self._status_in(self.store)

    def _status_in(self, store: Store) -> list[SandboxStatus]:
        try:
            core = load_core(store)
        except StoreError as e:
            self.counters["store_errors"] += 1
            raise Unavailable(f"{e.reason}: {e.detail}") from e
        return self._feed_notes(core, core.status(self.now()))

    def _feed_notes(self, core: TimerCore, rows: list[SandboxStatus]) -> list[SandboxStatus]:
        """``rows`` (of ``core``'s sandboxes) with ``idle_blocked`` for each active one whose forwarder's
        feed is not live: "no feed from <forwarder address> since <last batch, or this start>"."""
        live = self.liveness.live()
        out: list[SandboxStatus] = []
        for row in rows:
            if row.state is State.ACTIVE:
                config = core.config(row.sandbox)
                if not any(k in live for k in config.feed_keys):
                    last = max((self.liveness.silent_since(k) for k in config.feed_keys),
                               default=self.liveness.started_at)
                    since = dt.datetime.fromtimestamp(last, dt.UTC)
                    note = f"no feed from {config.forwarder} since {since.isoformat(timespec='seconds')}"
                    row = replace(row, idle_in_s=None, idle_blocked=note)
            out.append(row)
        return out

    async def status_now(self) -> list[SandboxStatus]:
        """``status`` from the loop: the core on the store thread, or a shared store through the reader."""
        if self.store.shared:
            return await self.read(self._status_in)
        return await self.call(self.status)

    async def status_of_now(self, sandbox: str) -> SandboxStatus:
        if self.store.shared:
            for row in await self.status_now():
                if row.sandbox == sandbox:
                    return row
            raise UnknownSandbox(sandbox)
        return await self.call(self.status_of, sandbox)

    def status_of(self, sandbox: str) -> SandboxStatus:
        for row in self.status() if self.store.shared else ():
            if row.sandbox == sandbox:
                return row
        if self.store.shared:
            raise UnknownSandbox(sandbox)
        return self._feed_notes(self.core, [self.core.status_of(sandbox, self.now())])[0]

    # -- idle timers ----------------------------------------------------------------------------

    def fire_due(self) -> list[Event]:
        """Take idle every sandbox whose period ran out: lock and re-read the due rows (another replica
        may have seen traffic, or fired the timer already), then fire on what the store says."""
        now = self.now()
        due = self.core.due(now)
        if not due:
            return []
        with self._transaction(due) as tx:
            locked = set(due)
            for _ in range(3):  # a re-read row can make another one due (rare); lock it too
                more = [s for s in self.core.due(now) if s not in locked]
                if not more:
                    break
                self._refresh(tx, more)
                locked.update(more)
            events = self.core.on_timer(now)
            touched = {ev.sandbox for ev in events} | locked
            saved = {s: self.core.snapshot(s) for s in touched if s in self.core}
            tx.save(saved, events)
            version = tx.written_version() if saved else 0
        # Committed: the core holds these rows as written, so the next batch about them reads none.
        self.core.mark_stored(saved, version)
        self.counters["timer_fires"] += len(events)
        self._published(events)
        return events

    def forget_stale(self) -> list[Event]:
        """Forget the open counts of every feed stream whose last batch was applied more than
        ``source_stale_s`` ago (and not forgotten since), in one transaction: the stale ledger records
        locked (on PostgreSQL one another transaction holds is skipped: a batch of it is being applied),
        the sandboxes holding their counts locked and re-read (those the store names and those this core's
        index names), the counts dropped (``TimerCore.forget_source``: an active sandbox under
        ``connections`` left with none runs its idle period from now), the records marked. Nothing before
        ``source_stale_s`` has passed since this service was made; the unattributed counts go with the
        first sweep after that. Counted (``sources_forgotten``) and logged per stream."""
        now = self.now()
        stale_s = self.source_stale_s
        if stale_s <= 0 or now - self._started_at < stale_s:
            return []
        with self._transaction(()) as tx:
            stale = tx.stale_sources(now - stale_s)
            sources = stale if self._unattributed_forgotten else [UNATTRIBUTED, *stale]
            held = {s: set(tx.open_from(s)).union(self.core.holding(s)) for s in sources}
            sids = sorted(set().union(*held.values()))
            self._refresh(tx, sids)
            events: list[Event] = []
            for source in sources:
                events += self.core.forget_source(source, now)
                if source != UNATTRIBUTED:
                    tx.mark_forgotten(source)
            saved = {s: self.core.snapshot(s) for s in sids if s in self.core}
            tx.save(saved, events)
            version = tx.written_version() if saved else 0
        self.core.mark_stored(saved, version)
        self._unattributed_forgotten = True
        self.counters["sources_forgotten"] += len(stale)
        for source in sources:
            if source != UNATTRIBUTED or held[source]:
                log.info("feed source stale: its open counts forgotten", extra={
                    "event": "source_forgotten", "fields": {"source": source, "sandboxes": len(held[source])}})
        self._published(events)
        return events

    def resync(self) -> None:
        """Catch up with every row (a shared store: sandboxes another replica registered, changed or
        removed): every row's version read, and in full only the rows whose version is not the one the
        core holds (``sync_core``), those no longer stored removed. With no other writer since, nothing
        but the versions is read (re-reading every row every ``resync_s`` was most of a replica's work at
        100,000 sandboxes). Not locked: a row another replica writes meanwhile is caught up at the next
        resync, or locked and re-read by the next change that touches it."""
        try:
            versions = self.store.versions()
            core = self.core
            moved = core.not_stored_at(versions, versions)
            gone = [sid for sid in core.ids() if sid not in versions]
            rows = {r.sandbox: r for r in self.store.sandboxes_in(moved)} if moved else {}
            sync_core(core, moved + gone, rows)
        except StoreError as e:
            self.counters["store_errors"] += 1
            log.warning("resync failed", extra={"event": "resync_failed", "reason": e.reason})
            return
        self.counters["resyncs"] += 1

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timer_task = asyncio.create_task(self._timers(), name="scheduler-timers")

    async def stop(self) -> None:
        task, self._timer_task = self._timer_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def close(self) -> None:
        """End the store threads (after ``stop``), each once what it was given is done; the stores stay open."""
        self.worker.close()
        if self.reader_thread is not None:
            self.reader_thread.close()

    def _timer_round(self, sweep: bool, resync: bool) -> tuple[float | None, bool]:
        """One round of the timer loop, on the store thread: the sweep, the due timers, a resync; returns
        the next deadline and whether the store failed."""
        failed = False
        self.feed.expire_feeds(self.now())
        try:
            if sweep:
                self.forget_stale()
            self.fire_due()
        except Unavailable as e:
            failed = True
            log.warning("idle timers: store unavailable", extra={"event": "timer_store_error",
                                                                 "fields": {"error": str(e)}})
        if resync:
            self.resync()
        self.state_counts = self.core.state_counts()
        return self.core.next_timer_before(self.now() + MAX_TIMER_SLEEP_S), failed

    async def _timers(self) -> None:
        loop = asyncio.get_running_loop()
        next_resync = loop.time() + self.resync_s
        sweep_s = min(MAX_SWEEP_S, self.source_stale_s / 4)
        next_sweep = loop.time()
        while True:
            sweep = sweep_s > 0 and loop.time() >= next_sweep
            if sweep:
                next_sweep = loop.time() + sweep_s
            resync = self.store.shared and loop.time() >= next_resync
            if resync:
                next_resync = loop.time() + self.resync_s
            at, failed = await self.call(self._timer_round, sweep, resync, bounded=False)
            if failed:
                await asyncio.sleep(1.0)
            sleep = MAX_TIMER_SLEEP_S if at is None else min(MAX_TIMER_SLEEP_S, max(0.0, at - self.now()))
            self._timer_kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timer_kick.wait(), sleep)
