"""The scheduler's idle timers and sandbox states, as a pure core (docs/scheduler-api.md "States",
"Holds", "Wake").

No I/O and no clock: every input carries ``now`` (seconds, a float on the caller's clock) and every
state change comes back as an ``Event``. The HTTP handlers, the store and the driver webhook are
adapters around it; the adapter arms one real timer at ``next_timer()`` and calls ``on_timer(now)``.

What keeps a sandbox ``active``: bytes (a report's byte deltas); under the ``connections`` policy also
an open connection; a hold until it ends. Its idle deadline is ``idle_period_s`` after the latest of
the last activity, the hold's end and the moment it last became active (so a sandbox just woken is not
declared idle over the silence while it was stopped).

Open connections are counted per source (the feed ledger's identity, ``<san>#<stream>``: one forwarder
worker), since each source reports only the connections it carries: a sandbox's ``open_connections`` is
the sum over its sources, and one source's report replaces that source's count only. A source that
restarted or went silent is dropped with ``forget_source`` (the adapters decide when); a sandbox whose
count then falls to zero under ``connections`` runs its idle period from that moment, as it does after
the report that says its last connection closed. An index (source -> sandboxes with a count from it)
keeps ``forget_source`` proportional to what that source held, not to the fleet.

What is trusted: the feed codec and the HTTP layer have validated shapes and types; the core checks
only what it decides on (a non-negative count, a positive finite period or hold). A report about an
unknown sandbox, or whose last activity precedes the sandbox's current incarnation, is counted in
``counters`` and dropped. A report whose last activity is no later than the sandbox's last stop is
about the run that was stopped: its bytes are counted, but it changes no state and no open count.

Stored versions: a store stamps every write of a sandbox's row with a version no other write had
(``scheduler/store.py``), and the core keeps, per sandbox, the version its config and state equal (given
to ``restore``, or by ``mark_stored`` after a write), so a store adapter can tell a row it must read again
from one the core holds already by comparing versions alone. Every call that changes a sandbox forgets
its version (None: unknown, read it again) until ``mark_stored``: a change that was never written can
never pass for the stored row.

Idle only on evidence (docs/scheduler-api.md "Feed liveness"): once ``gate_on_feeds`` is called (the
scheduler's service always does), a sandbox's byte timer runs only while the feed of the forwarder its
route names (``SandboxConfig.feed_keys``, the route's SPKI pins: a forwarder feeds with one of them) is
live, and never from before the moment that feed became live (``feed_live``; with two keys live, the earlier
spell); a sandbox none of whose keys has a live feed has no idle deadline (``feed_stale``). Which feeds
are live is ``feed_liveness.FeedLiveness``'s, outside this core. Holds, wakes and the driver's reports
work as before. An index (feed key -> sandboxes) keeps ``feed_live`` proportional to that forwarder's
sandboxes.

Timers: one heap with lazy invalidation, at most one live entry per sandbox. A deadline that moves
later (the common case: every report) leaves the entry where it is; when the entry reaches the top it
is moved to the real deadline. So a report costs O(1), ``next_timer()`` is exact (never earlier or
later than the true earliest deadline), and ``on_timer`` never fires early.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import NamedTuple

from sbxnet.errors import LocalProtocolError


class State(StrEnum):
    ACTIVE = "active"
    IDLE = "idle"
    STOPPING = "stopping"
    STOPPED = "stopped"
    WAKING = "waking"


class Why(StrEnum):
    """An event's ``why`` (docs/scheduler-api.md "Status and events")."""

    IDLE_TIMER = "idle_timer"
    TRAFFIC = "traffic"
    WAKE = "wake"
    HOLD = "hold"
    DRIVER = "driver"
    REGISTERED = "registered"


class Activity(StrEnum):
    BYTES = "bytes"  # only bytes reset the timer (the default)
    CONNECTIONS = "connections"  # an open connection keeps the sandbox active too


class Input(StrEnum):
    """What can move a registered sandbox from one state to another."""

    TIMER = "timer"
    TRAFFIC = "traffic"
    WAKE = "wake"
    HOLD = "hold"
    STOPPING = "driver_stopping"
    STOPPED = "driver_stopped"
    READY = "driver_ready"
    FAILED = "driver_failed"


_WHY = {
    Input.TIMER: Why.IDLE_TIMER,
    Input.TRAFFIC: Why.TRAFFIC,
    Input.WAKE: Why.WAKE,
    Input.HOLD: Why.HOLD,
    Input.STOPPING: Why.DRIVER,
    Input.STOPPED: Why.DRIVER,
    Input.READY: Why.DRIVER,
    Input.FAILED: Why.DRIVER,
}

_A, _I, _SG, _SD, _W = State.ACTIVE, State.IDLE, State.STOPPING, State.STOPPED, State.WAKING

# Every transition, in one place. A pair that is not here changes nothing. ``None``: back to the state
# the wake came from (idle or stopped). The driver's word about the world wins over ours (a sandbox the
# platform says stopped is stopped, one it says ready is active), except that a stop it announces for a
# sandbox that is not idle is refused (``driver_stopping`` answers proceed=False: the stop fence).
TRANSITIONS: dict[tuple[State, Input], State | None] = {
    (_A, Input.TIMER): _I,
    (_A, Input.STOPPED): _SD,
    (_I, Input.TRAFFIC): _A,
    (_I, Input.HOLD): _A,
    (_I, Input.WAKE): _W,
    (_I, Input.STOPPING): _SG,
    (_I, Input.STOPPED): _SD,
    (_SG, Input.TRAFFIC): _A,  # the stop fence
    (_SG, Input.HOLD): _A,
    (_SG, Input.WAKE): _A,
    (_SG, Input.STOPPED): _SD,
    (_SG, Input.READY): _A,
    (_SD, Input.TRAFFIC): _A,
    (_SD, Input.WAKE): _W,
    (_SD, Input.READY): _A,
    (_W, Input.TRAFFIC): _A,
    (_W, Input.READY): _A,
    (_W, Input.FAILED): None,
}


class UnknownSandbox(LocalProtocolError):
    """A call named a sandbox that is not registered (the HTTP layer answers 404)."""

    def __init__(self, sandbox: str) -> None:
        super().__init__("unknown_sandbox", sandbox)


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """What the timer core needs of a registration. ``registered_at`` is when this incarnation began:
    reports about activity before it belong to the previous one."""

    sandbox: str
    incarnation: str
    idle_period_s: float
    activity: Activity = Activity.BYTES
    registered_at: float = 0.0
    # The route's forwarder keys (its SPKI pins, current and next while a key rotates): a batch from a feed
    # presenting any of them is this sandbox's evidence.
    feed_keys: tuple[str, ...] = ()
    forwarder: str = ""  # the route's forwarder address, for status

    def __post_init__(self) -> None:
        if not self.sandbox or not self.incarnation:
            raise LocalProtocolError("bad_config", "sandbox and incarnation must be non-empty")
        if not (math.isfinite(self.idle_period_s) and self.idle_period_s > 0):
            raise LocalProtocolError("bad_config", f"idle_period_s must be positive, not {self.idle_period_s!r}")
        if not isinstance(self.activity, Activity):
            object.__setattr__(self, "activity", Activity(self.activity))


@dataclass(frozen=True, slots=True)
class Event:
    """One state change. ``from_state`` is None only for a sandbox's first registration."""

    sandbox: str
    incarnation: str
    from_state: State | None
    to_state: State
    at: float
    why: Why

    def to_json(self) -> dict[str, object]:
        """The shape of docs/scheduler-api.md: ``{"sandbox", "incarnation", "from", "to", "at", "why"}``."""
        return {
            "sandbox": self.sandbox,
            "incarnation": self.incarnation,
            "from": None if self.from_state is None else self.from_state.value,
            "to": self.to_state.value,
            "at": self.at,
            "why": self.why.value,
        }


# The fields of ``SandboxState`` a report or a forgotten source changes when it makes no event: the rest
# change only with a transition (``TimerCore._step``), so a store writing a batch's sandboxes that made no
# event writes only these (``Tx.save_meters``).
METER_FIELDS = ("last_activity", "bytes_in", "bytes_out", "open_connections", "open_by")


@dataclass(slots=True)
class SandboxState:
    """One incarnation's state: what a store saves and ``TimerCore.restore`` takes back."""

    active_since: float  # when it last became active: the idle period never runs from earlier
    state: State = State.ACTIVE
    last_activity: float | None = None  # the latest activity the policy counts
    bytes_in: int = 0  # totals for this incarnation
    bytes_out: int = 0
    open_connections: int = 0  # the sum of open_by (kept whole: the deadline and status read it)
    open_by: dict[str, int] = field(default_factory=dict)  # source -> its latest count; no zero counts
    hold_until: float | None = None
    stopped_at: float | None = None  # the driver's latest "stopped": older reports change no state
    wake_from: State | None = None  # while waking: where driver_failed returns to
    fenced: bool = False  # a stop the driver announced was cancelled by traffic, a wake or a hold


def _copy(st: SandboxState) -> SandboxState:
    """A copy of ``st``, built directly: ``dataclasses.replace`` costs several times as much, and a batch
    copies every sandbox it names (``snapshot``) and a store read restores every row (``restore``)."""
    return SandboxState(
        st.active_since, st.state, st.last_activity, st.bytes_in, st.bytes_out, st.open_connections,
        dict(st.open_by), st.hold_until, st.stopped_at, st.wake_from, st.fenced,
    )


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    """One row of ``sbxnet scheduler status`` and ``GET /v1/sandboxes``."""

    sandbox: str
    incarnation: str
    state: State
    last_activity: float | None
    bytes_in: int
    bytes_out: int
    open_connections: int
    hold_until: float | None  # None when no hold is in force
    idle_in_s: float | None  # None when no idle timer runs (not active, held by open connections, no feed)
    # Why an active sandbox is not being idled although its timer would run: its forwarder's feed is not
    # live ("no feed from <forwarder> since <time>"; the service words it). None otherwise.
    idle_blocked: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "sandbox": self.sandbox,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "last_activity": self.last_activity,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "open_connections": self.open_connections,
            "hold_until": self.hold_until,
            "idle_in_s": self.idle_in_s,
            "idle_blocked": self.idle_blocked,
        }


class WakeOutcome(NamedTuple):
    events: list[Event]
    start_driver: bool  # ask the driver to start the sandbox (once per idle/stopped -> waking)


class HoldOutcome(NamedTuple):
    hold_until: float  # the hold in force after this call (unchanged when the new one ended earlier)
    events: list[Event]


class StopOutcome(NamedTuple):
    events: list[Event]
    proceed: bool  # False: the sandbox is active or waking again, the driver must not stop it


@dataclass(eq=False, slots=True)
class _Sandbox:
    config: SandboxConfig
    st: SandboxState
    gen: int = 0  # the generation of its one live heap entry
    stored: int | None = None  # the store's version of the row this config and state equal; None: unknown
    counts_moved: bool = False  # its open counts changed since it was restored or marked stored
    # That entry's time, None when it has none. Entries hold the object itself: a removed or
    # re-registered sandbox's entries are stale because the registry no longer maps its ID to it.
    heap_at: float | None = None


def _deadline(sb: _Sandbox, feeds: Mapping[str, float] | None) -> float | None:
    """The sandbox's idle deadline; None when no timer runs. ``feeds``: the live feeds' keys and the start
    of their live spells when the core is gated on feeds (None: not gated)."""
    st = sb.st
    if st.state is not State.ACTIVE:
        return None
    if st.open_connections > 0 and sb.config.activity is Activity.CONNECTIONS:
        return None
    base = st.active_since
    if st.last_activity is not None and st.last_activity > base:
        base = st.last_activity
    if st.hold_until is not None and st.hold_until > base:
        base = st.hold_until
    if feeds is not None:
        spells = [feeds[k] for k in sb.config.feed_keys if k in feeds]
        if not spells:
            return None  # no evidence: its forwarder's feed is not live
        since = min(spells)
        if since > base:
            base = since
    return base + sb.config.idle_period_s


_Entry = tuple[float, int, _Sandbox, int]


class TimerCore:
    """Every registered sandbox's state and idle timer. Not thread-safe; one owner drives it."""

    def __init__(self) -> None:
        self._sandboxes: dict[str, _Sandbox] = {}
        self._heap: list[_Entry] = []
        self._by_source: dict[str, set[str]] = {}  # source -> sandboxes with a count from it
        self._by_feed: dict[str, set[str]] = {}  # feed key -> the sandboxes whose route names it
        # Gated on feeds (``gate_on_feeds``): the live feeds' keys and the start of each one's live spell.
        # None: not gated, every byte timer runs (the core alone, as its own tests drive it).
        self._feeds: dict[str, float] | None = None
        # How many sandboxes are in each state, kept as they move (``state_counts``): counting them when
        # asked was a pass over every sandbox, 70 ms a second at 100,000 of them.
        self._in_state: dict[State, int] = dict.fromkeys(State, 0)
        self._seq = itertools.count()
        self.counters: dict[str, int] = {"report_unknown_sandbox": 0, "report_stale_incarnation": 0}

    # -- the registry --------------------------------------------------------------------------

    def register(self, config: SandboxConfig, now: float) -> list[Event]:
        """Add a sandbox or replace its registration. The same incarnation keeps its state, meters,
        hold and incarnation start (``registered_at`` of the first registration) and takes the new
        period and policy; a new incarnation starts afresh, ``active`` (one ``registered`` event)."""
        old = self._sandboxes.get(config.sandbox)
        if old is not None and old.config.incarnation == config.incarnation:
            self._unindex_feed(old)
            old.config = replace(config, registered_at=old.config.registered_at)
            self._index_feed(old)
            old.stored = None
            self._schedule(old)
            return []
        if old is not None:
            self._unindex(old)
            self._unindex_feed(old)
            self._in_state[old.st.state] -= 1
        sb = _Sandbox(config, SandboxState(active_since=now))
        self._sandboxes[config.sandbox] = sb
        self._index_feed(sb)
        self._in_state[State.ACTIVE] += 1
        self._schedule(sb)
        frm = None if old is None else old.st.state
        return [Event(config.sandbox, config.incarnation, frm, State.ACTIVE, now, Why.REGISTERED)]

    def remove(self, sandbox: str) -> bool:
        """Forget a sandbox (its heap entries go stale). False if it was not registered."""
        sb = self._sandboxes.pop(sandbox, None)
        if sb is None:
            return False
        self._unindex(sb)
        self._unindex_feed(sb)
        self._in_state[sb.st.state] -= 1
        return True

    def restore(self, config: SandboxConfig, state: SandboxState, stored: int | None = None) -> None:
        """Install a sandbox as a store saved it (after a restart); no event. ``state`` is taken as it is
        (its ``open_connections`` should be the sum of its ``open_by``, as every state the core made is).
        ``stored``: the version of the row it was read from (``stored_version``), None if unknown."""
        old = self._sandboxes.get(config.sandbox)
        if old is not None:
            self._unindex(old)
            self._unindex_feed(old)
            self._in_state[old.st.state] -= 1
        if old is not None and old.config == config:
            # The same registration (a row another replica wrote): the state replaced in place, so its heap
            # entry stays live (a new object would leave one stale entry per restore to be compacted away).
            sb = old
            sb.st, sb.stored, sb.counts_moved = _copy(state), stored, False
        else:
            sb = _Sandbox(config, _copy(state), stored=stored)
            self._sandboxes[config.sandbox] = sb
        for source in sb.st.open_by:
            self._by_source.setdefault(source, set()).add(config.sandbox)
        self._index_feed(sb)
        self._in_state[sb.st.state] += 1
        self._schedule(sb)

    def snapshot(self, sandbox: str) -> SandboxState:
        """A copy of a sandbox's state, for the store."""
        return _copy(self._get(sandbox).st)

    def state(self, sandbox: str) -> SandboxState:
        """The sandbox's state itself, not a copy: for a store to read at once while it writes the row
        (a batch writes every sandbox it names, and ``snapshot``'s copies were a tenth of its cost). Not to
        be changed or kept past the next call into the core."""
        return self._get(sandbox).st

    def stored_version(self, sandbox: str) -> int | None:
        """The version of the stored row this sandbox's config and state equal (``restore``,
        ``mark_stored``); None when unknown: changed since, or not registered here."""
        sb = self._sandboxes.get(sandbox)
        return None if sb is None else sb.stored

    def not_stored_at(self, sandboxes: Iterable[str], versions: Mapping[str, int]) -> list[str]:
        """Those of ``sandboxes`` whose ``stored_version`` is unknown or not the one ``versions`` gives
        (what a store read of the rows' versions says), in order: the rows to read in full."""
        get = self._sandboxes.get
        out: list[str] = []
        for sid in sandboxes:
            sb = get(sid)
            if sb is None or sb.stored is None or versions.get(sid) != sb.stored:
                out.append(sid)
        return out

    def mark_stored(self, sandboxes: Iterable[str], version: int) -> None:
        """These sandboxes' rows were written, as the core holds them now, with ``version`` (after the
        commit). Those not registered here are left out."""
        get = self._sandboxes.get
        for sid in sandboxes:
            sb = get(sid)
            if sb is not None:
                sb.stored = version
                sb.counts_moved = False

    def counts_changed(self, sandbox: str) -> bool:
        """Whether the sandbox's open counts (``open_by``, ``open_connections``) changed since it was last
        restored or marked stored. A store that knows the row held the core's state at that point (its
        version) leaves them as they are when not: writing them costs an index update per row."""
        return self._get(sandbox).counts_moved

    def rows_to_write(
        self, sandboxes: Iterable[str], moved: Collection[str]
    ) -> tuple[list[str], dict[str, SandboxState], dict[str, SandboxState], dict[str, SandboxState]]:
        """For a store writing these sandboxes' rows after a batch, in one pass: the registered ones, in
        order; then their states (the core's own, as ``state`` gives them) in three parts: those in
        ``moved`` (a transition: the whole row), those whose open counts changed (``counts_changed``: the
        meters with the counts) and the rest (the traffic meters alone)."""
        get = self._sandboxes.get
        present: list[str] = []
        whole: dict[str, SandboxState] = {}
        counted: dict[str, SandboxState] = {}
        traffic: dict[str, SandboxState] = {}
        for sid in sandboxes:
            sb = get(sid)
            if sb is None:
                continue
            present.append(sid)
            (whole if sid in moved else counted if sb.counts_moved else traffic)[sid] = sb.st
        return present, whole, counted, traffic

    def has_state(self, sandbox: str, state: SandboxState) -> bool:
        """Whether the sandbox's state equals ``state`` (``snapshot(sandbox) == state`` without the copy)."""
        return self._get(sandbox).st == state

    def config(self, sandbox: str) -> SandboxConfig:
        return self._get(sandbox).config

    def state_of(self, sandbox: str) -> State | None:
        sb = self._sandboxes.get(sandbox)
        return None if sb is None else sb.st.state

    def ids(self) -> list[str]:
        """Every registered sandbox's ID, in no order."""
        return list(self._sandboxes)

    def state_counts(self) -> dict[str, int]:
        """How many sandboxes are in each state, every state named (for metrics); costs nothing per sandbox."""
        return {state.value: n for state, n in self._in_state.items()}

    def __len__(self) -> int:
        return len(self._sandboxes)

    def __contains__(self, sandbox: object) -> bool:
        return sandbox in self._sandboxes

    # -- the feed ------------------------------------------------------------------------------

    def on_report(
        self, sandbox: str, bytes_in: int, bytes_out: int, open_connections: int, last_activity: float, now: float,
        source: str = "",
    ) -> list[Event]:
        """Apply one sandbox's entry of an applied feed batch from ``source`` (the ledger identity): byte
        deltas, the connections open at that source at sending (replacing that source's count; the
        sandbox's ``open_connections`` is the sum over sources), and its last activity on our clock
        (receive time minus ``idle_s``).

        It changes only the sandbox's ``METER_FIELDS`` unless it returns an event for it (a transition).

        Bytes are activity at ``last_activity``. Under the ``connections`` policy a report with open
        connections, or one that says the last of its source's connections closed, is activity at ``now``
        (the feed carries no close time; the close happened within one report interval before). Activity takes
        a sandbox that is not active back to ``active`` (why ``traffic``). A report no later than the
        sandbox's last stop adds its bytes and nothing else. Unknown sandbox and previous incarnation:
        counted, dropped."""
        sb = self._sandboxes.get(sandbox)
        if sb is None:
            self.counters["report_unknown_sandbox"] += 1
            return []
        if last_activity < sb.config.registered_at:
            self.counters["report_stale_incarnation"] += 1
            return []
        if bytes_in < 0 or bytes_out < 0 or open_connections < 0:
            raise LocalProtocolError("bad_report", "negative count")
        sb.stored = None
        st = sb.st
        st.bytes_in += bytes_in
        st.bytes_out += bytes_out
        if st.stopped_at is not None and last_activity <= st.stopped_at:
            # About the run that was stopped: its connections (any live one would make the report's
            # last activity later than the stop) died with it.
            return []
        was_open = st.open_by.get(source, 0)
        if open_connections != was_open:
            self._set_open(sb, source, open_connections)
        at: float | None = last_activity if bytes_in or bytes_out else None
        if sb.config.activity is Activity.CONNECTIONS and (open_connections or was_open):
            at = now if at is None or now > at else at
        events: list[Event] = []
        if at is not None:
            if st.last_activity is None or at > st.last_activity:
                st.last_activity = at
            if st.state is not State.ACTIVE:
                ev = self._step(sb, Input.TRAFFIC, now)
                if ev is not None:
                    events.append(ev)
        if st.state is State.ACTIVE:
            self._schedule(sb)
        return events

    def on_reports(self, entries: Iterable[tuple[str, int, int, int, float]], now: float, source: str = ""
                   ) -> list[Event]:
        """``on_report`` of each entry of one applied batch, in order: (sandbox, bytes in, bytes out, open
        connections, seconds since its last activity at sending: last activity is ``now`` minus that), the
        shape of the feed codec's reports. The same states, versions, timers and events as calling
        ``on_report`` for each; the common entry (a known, active sandbox whose source's open count did not
        change) is applied here without the calls, since a batch is a thousand of them."""
        get = self._sandboxes.get
        active, bytes_policy = State.ACTIVE, Activity.BYTES
        events: list[Event] = []
        for sandbox, bytes_in, bytes_out, n_open, idle_s in entries:
            last_activity = now - idle_s
            sb = get(sandbox)
            if sb is not None:
                st = sb.st
                if (
                    st.state is active
                    and last_activity >= sb.config.registered_at
                    and bytes_in >= 0
                    and bytes_out >= 0
                    and (st.stopped_at is None or last_activity > st.stopped_at)
                    and n_open == st.open_by.get(source, 0)
                    and (n_open == 0 or sb.config.activity is bytes_policy)
                ):
                    # ``on_report``'s path for it: no transition, no open count moved, and a deadline that
                    # can only move later (its heap entry, which is no later than the old one, stays).
                    sb.stored = None
                    st.bytes_in += bytes_in
                    st.bytes_out += bytes_out
                    if (bytes_in or bytes_out) and (st.last_activity is None or last_activity > st.last_activity):
                        st.last_activity = last_activity
                    if sb.heap_at is None:
                        self._schedule(sb)
                    continue
            events += self.on_report(sandbox, bytes_in, bytes_out, n_open, last_activity, now, source)
        return events

    def forget_source(self, source: str, now: float) -> list[Event]:
        """Drop ``source``'s open counts from every sandbox (a forwarder worker that restarted, whose new
        epoch knows nothing of the old one's connections, or one that stopped reporting). An active
        sandbox under the ``connections`` policy whose count falls to zero has activity at ``now``: its
        idle period runs from here, as after the report that says its last connection closed. A source
        that went away is not traffic, so no state changes and the events are none; the list is there so
        the adapters treat this input as every other. Only ``METER_FIELDS`` change."""
        sids = self._by_source.pop(source, None)
        if not sids:
            return []
        for sid in sids:
            sb = self._sandboxes[sid]  # the index names registered sandboxes only
            sb.stored, sb.counts_moved = None, True
            st = sb.st
            del st.open_by[source]
            st.open_connections = sum(st.open_by.values())
            if (
                st.open_connections == 0
                and sb.config.activity is Activity.CONNECTIONS
                and st.state is State.ACTIVE
                and (st.last_activity is None or now > st.last_activity)
            ):
                st.last_activity = now
            self._schedule(sb)
        return []

    def holding(self, source: str) -> list[str]:
        """The sandboxes with an open count from ``source``, by ID (the adapters lock these rows before
        ``forget_source``)."""
        return sorted(self._by_source.get(source, ()))

    # -- feed liveness -------------------------------------------------------------------------

    def gate_on_feeds(self, live: Mapping[str, float]) -> None:
        """From now on idle only on evidence: a byte timer runs only while the feed its sandbox's route
        names is live. ``live``: the feeds live now, each with the start of its live spell (the service's
        ``FeedLiveness.live()``; after a rebuild of the core, what it knew). Costs a pass over every
        sandbox (at start, and after a rebuild)."""
        self._feeds = dict(live)
        for sb in self._sandboxes.values():
            self._schedule(sb)

    @property
    def gated(self) -> bool:
        return self._feeds is not None

    def feed_live(self, key: str, since: float) -> None:
        """The feed ``key`` became live at ``since`` (its first batch since the scheduler started or since
        it went stale): its sandboxes' timers run again, none from before ``since``. Nothing when the
        core is not gated or the feed is live already."""
        feeds = self._feeds
        if feeds is None or key in feeds:
            return
        feeds[key] = since
        get = self._sandboxes.get
        for sid in self._by_feed.get(key, ()):
            sb = get(sid)
            if sb is not None:
                self._schedule(sb)

    def feed_stale(self, key: str) -> None:
        """The feed ``key`` went silent: its sandboxes are not idled until it is live again (their heap
        entries go stale: an entry whose sandbox has no deadline is dropped when it comes up)."""
        if self._feeds is not None:
            self._feeds.pop(key, None)

    def feed_is_live(self, key: str) -> bool:
        """Whether the byte timers of sandboxes whose route names ``key`` run (always, when not gated)."""
        return self._feeds is None or key in self._feeds

    # -- holds ---------------------------------------------------------------------------------

    def hold(self, sandbox: str, ttl_s: float, now: float) -> HoldOutcome:
        """Keep the sandbox active until ``now + ttl_s``; extend-only (a hold ending earlier than the
        current one changes nothing). Returns the hold's end. An idle or stopping sandbox goes back to
        ``active`` (why ``hold``); a stopped or waking one keeps its state, and the hold counts once it
        is active again."""
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise LocalProtocolError("bad_hold", f"ttl_s must be positive, not {ttl_s!r}")
        sb = self._changing(sandbox)
        st = sb.st
        until = now + ttl_s
        if st.hold_until is None or until > st.hold_until:
            st.hold_until = until
        ev = self._step(sb, Input.HOLD, now)
        self._schedule(sb)
        return HoldOutcome(st.hold_until, [] if ev is None else [ev])

    # -- timers --------------------------------------------------------------------------------

    def next_timer(self) -> float | None:
        """The earliest idle deadline over all sandboxes (exact), or None when no timer runs."""
        heap = self._heap
        while heap:
            at, _, sb, gen = heap[0]
            if sb.gen != gen or self._sandboxes.get(sb.config.sandbox) is not sb:
                heapq.heappop(heap)
                continue
            d = _deadline(sb, self._feeds)
            if d is None:
                heapq.heappop(heap)
                sb.heap_at = None
            elif d != at:
                heapq.heapreplace(heap, (d, next(self._seq), sb, gen))
                sb.heap_at = d
            else:
                return at
        return None

    def next_timer_before(self, horizon: float) -> float | None:
        """``next_timer`` when it is at or before ``horizon``; otherwise None or a time after ``horizon``
        no later than the earliest deadline, if there is one (None: no timer runs). A sleeper that wakes
        at ``horizon`` anyway needs no more, and this brings up to date only the heap entries at or
        before ``horizon``: ``next_timer`` moves every entry below the earliest deadline, which under
        steady traffic (every deadline moving later each second, none of them due) is every sandbox on
        every call."""
        heap = self._heap
        while heap:
            at, _, sb, gen = heap[0]
            if at > horizon:
                return at  # an entry is never later than its sandbox's deadline
            if sb.gen != gen or self._sandboxes.get(sb.config.sandbox) is not sb:
                heapq.heappop(heap)
                continue
            d = _deadline(sb, self._feeds)
            if d is None:
                heapq.heappop(heap)
                sb.heap_at = None
            elif d != at:
                heapq.heapreplace(heap, (d, next(self._seq), sb, gen))
                sb.heap_at = d
            else:
                return at
        return None

    def due(self, now: float) -> list[str]:
        """The sandboxes ``on_timer(now)`` would take idle, without changing anything (a shared store's
        adapter locks and re-reads exactly these rows first). Walks only the heap's entries at or before
        ``now`` (a child is never earlier than its parent), so its cost is the number due, not the fleet."""
        heap = self._heap
        out: list[str] = []
        todo = [0] if heap else []
        while todo:
            i = todo.pop()
            at, _, sb, gen = heap[i]
            if at > now:
                continue
            if sb.gen == gen and self._sandboxes.get(sb.config.sandbox) is sb:
                d = _deadline(sb, self._feeds)
                if d is not None and d <= now:
                    out.append(sb.config.sandbox)
            todo.extend(j for j in (2 * i + 1, 2 * i + 2) if j < len(heap))
        out.sort()
        return out

    def on_timer(self, now: float) -> list[Event]:
        """Every sandbox whose deadline is at or before ``now`` goes idle (why ``idle_timer``), once per
        expiry: an idle sandbox has no timer until it is active again."""
        events: list[Event] = []
        while True:
            at = self.next_timer()
            if at is None or at > now:
                return events
            _, _, sb, _ = heapq.heappop(self._heap)
            sb.heap_at = None
            ev = self._step(sb, Input.TIMER, now)
            if ev is not None:
                events.append(ev)

    # -- wake and the driver -------------------------------------------------------------------

    def wake(self, sandbox: str, now: float) -> WakeOutcome:
        """The gateway's wake. Idle or stopped: -> ``waking`` and ask the driver to start it. Waking:
        coalesced, the driver is not asked again. Stopping: the stop fence, back to ``active``. Active:
        nothing to do."""
        sb = self._changing(sandbox)
        ev = self._step(sb, Input.WAKE, now)
        self._schedule(sb)
        if ev is None:
            return WakeOutcome([], False)
        return WakeOutcome([ev], ev.to_state is State.WAKING)

    def driver_stopping(self, sandbox: str, now: float) -> StopOutcome:
        """The driver announces it is stopping the sandbox. Allowed from ``idle`` (-> ``stopping``);
        a stopping or stopped sandbox answers proceed=True with no event; an active or waking one
        proceed=False (traffic or a wake came first: do not stop it)."""
        sb = self._changing(sandbox)
        sb.st.fenced = False
        ev = self._step(sb, Input.STOPPING, now)
        proceed = sb.st.state in (State.STOPPING, State.STOPPED)
        return StopOutcome([] if ev is None else [ev], proceed)

    def driver_stopped(self, sandbox: str, now: float) -> WakeOutcome:
        """The driver says the sandbox is stopped; its connections are gone. Active, idle or stopping:
        -> ``stopped``. If a stop fence had sent it back to ``active`` (the stop went through anyway),
        it goes on to ``waking`` and the driver is asked to start it. Waking: the state stays (the
        driver has the start request), but a failed start now returns to ``stopped``."""
        sb = self._changing(sandbox)
        st = sb.st
        fenced = st.fenced and st.state is State.ACTIVE
        st.stopped_at = now
        self._clear_open(sb)
        if st.state is State.WAKING:
            st.wake_from = State.STOPPED
            return WakeOutcome([], False)
        ev = self._step(sb, Input.STOPPED, now)
        if ev is None:
            return WakeOutcome([], False)
        if fenced:
            again = self._step(sb, Input.WAKE, now)
            assert again is not None
            return WakeOutcome([ev, again], True)
        return WakeOutcome([ev], False)

    def driver_ready(self, sandbox: str, now: float) -> list[Event]:
        """The driver says the sandbox runs: waking, stopped or stopping -> ``active`` (its idle period
        starts now). Idle or active: nothing changes."""
        sb = self._changing(sandbox)
        ev = self._step(sb, Input.READY, now)
        self._schedule(sb)
        return [] if ev is None else [ev]

    def driver_failed(self, sandbox: str, now: float) -> list[Event]:
        """The driver could not start it: waking -> the state the wake came from (idle or stopped)."""
        sb = self._changing(sandbox)
        ev = self._step(sb, Input.FAILED, now)
        return [] if ev is None else [ev]

    # -- status --------------------------------------------------------------------------------

    def status(self, now: float) -> list[SandboxStatus]:
        """Every sandbox, by ID."""
        return [self._status(self._sandboxes[sid], now) for sid in sorted(self._sandboxes)]

    def status_of(self, sandbox: str, now: float) -> SandboxStatus:
        return self._status(self._get(sandbox), now)

    def _status(self, sb: _Sandbox, now: float) -> SandboxStatus:
        st = sb.st
        d = _deadline(sb, self._feeds)
        return SandboxStatus(
            sandbox=sb.config.sandbox,
            incarnation=sb.config.incarnation,
            state=st.state,
            last_activity=st.last_activity,
            bytes_in=st.bytes_in,
            bytes_out=st.bytes_out,
            open_connections=st.open_connections,
            hold_until=st.hold_until if st.hold_until is not None and st.hold_until > now else None,
            idle_in_s=None if d is None else max(0.0, d - now),
        )

    # -- internals -----------------------------------------------------------------------------

    def _get(self, sandbox: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox)
        if sb is None:
            raise UnknownSandbox(sandbox)
        return sb

    def _changing(self, sandbox: str) -> _Sandbox:
        """``_get`` for a call that may change the sandbox: its stored version is forgotten."""
        sb = self._get(sandbox)
        sb.stored = None
        return sb

    def _step(self, sb: _Sandbox, inp: Input, now: float) -> Event | None:
        """Apply ``TRANSITIONS`` for one input; the one place a state changes. Returns its event."""
        sb.stored = None
        st = sb.st
        key = (st.state, inp)
        if key not in TRANSITIONS:
            return None
        to = TRANSITIONS[key]
        if to is None:
            to = st.wake_from if st.wake_from is not None else State.IDLE
        frm = st.state
        if to is State.ACTIVE:
            st.active_since = now
            if frm is State.STOPPING:
                st.fenced = True
        elif to is State.WAKING:
            st.wake_from = frm
        elif to is State.IDLE:
            st.fenced = False
        elif to is State.STOPPED:
            st.stopped_at = now
            self._clear_open(sb)
            st.fenced = False
        if frm is State.WAKING:
            st.wake_from = None
        st.state = to
        self._in_state[frm] -= 1
        self._in_state[to] += 1
        return Event(sb.config.sandbox, sb.config.incarnation, frm, to, now, _WHY[inp])

    def _set_open(self, sb: _Sandbox, source: str, n: int) -> None:
        """Set ``source``'s count on ``sb`` (0: drop it), keeping the sum and the index."""
        st, sid = sb.st, sb.config.sandbox
        sb.counts_moved = True
        if n:
            if source not in st.open_by:
                self._by_source.setdefault(source, set()).add(sid)
            st.open_by[source] = n
        else:
            del st.open_by[source]
            self._unindex_one(source, sid)
        st.open_connections = sum(st.open_by.values())

    def _clear_open(self, sb: _Sandbox) -> None:
        """The sandbox stopped: its connections are gone, whoever carried them."""
        sb.counts_moved = True
        self._unindex(sb)
        sb.st.open_by.clear()
        sb.st.open_connections = 0

    def _index_feed(self, sb: _Sandbox) -> None:
        for key in sb.config.feed_keys:
            self._by_feed.setdefault(key, set()).add(sb.config.sandbox)

    def _unindex_feed(self, sb: _Sandbox) -> None:
        sid = sb.config.sandbox
        for key in sb.config.feed_keys:
            held = self._by_feed.get(key)
            if held is not None:
                held.discard(sid)
                if not held:
                    del self._by_feed[key]

    def _unindex(self, sb: _Sandbox) -> None:
        for source in sb.st.open_by:
            self._unindex_one(source, sb.config.sandbox)

    def _unindex_one(self, source: str, sid: str) -> None:
        held = self._by_source.get(source)
        if held is not None:
            held.discard(sid)
            if not held:
                del self._by_source[source]

    def _schedule(self, sb: _Sandbox) -> None:
        """Keep the invariant: a sandbox with a deadline has a live heap entry no later than it."""
        d = _deadline(sb, self._feeds)
        if d is None or (sb.heap_at is not None and sb.heap_at <= d):
            return
        heap = self._heap
        if len(heap) > 2 * len(self._sandboxes) + 1024:
            self._compact()
        sb.gen += 1
        sb.heap_at = d
        heapq.heappush(heap, (d, next(self._seq), sb, sb.gen))

    def _compact(self) -> None:
        """Drop stale entries (from deadlines that moved earlier, and removed sandboxes)."""
        live = self._sandboxes
        self._heap = [e for e in self._heap if e[2].gen == e[3] and live.get(e[2].config.sandbox) is e[2]]
        heapq.heapify(self._heap)
