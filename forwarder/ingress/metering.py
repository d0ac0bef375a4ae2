"""Exact byte counts per connection and per sandbox, each direction. Time comes from the caller.

The hot path touches only its own ``ConnMeter``: two integer adds per chunk, and ``last_activity`` set to
the time the plane read (slotted attributes: no instance dict). The ``Meter`` derives the rest when asked:

- ``take(now)``: what moved per sandbox since the previous take (the idle-timer feed), as columns
  (``Deltas``: one list per field, a sandbox per index), which the feed's outbox and encoder consume
  without a per-sandbox object; ``take_deltas(now)`` is the same take as a dict of ``SandboxDelta``.
  Every byte a connection counted appears in exactly one take: live connections carry what earlier
  takes already reported, and a closing connection folds what no take has reported yet into its
  sandbox's record.
- ``totals()``: bytes since start, for the metrics flush: a running sum over closed connections plus the
  live ones, so it stays exact after sandboxes are forgotten.

Memory is bounded by the live connections plus the sandboxes touched since the previous take: a sandbox
is forgotten at the take that reports it with no connection open.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class ConnMeter:
    sandbox_id: str
    conn_id: str
    last_activity: float  # the caller's monotonic clock
    up: int = 0  # gateway -> sandbox; only ever grows
    down: int = 0  # sandbox -> gateway; only ever grows
    # How much of up/down earlier takes reported, and when a take last reported its sandbox while it was
    # the sandbox's only connection (None: not yet). The Meter's bookkeeping: planes never touch it.
    _taken_up: int = field(default=0, init=False, repr=False)
    _taken_down: int = field(default=0, init=False, repr=False)
    _reported: float | None = field(default=None, init=False, repr=False)


@dataclass(frozen=True)
class SandboxDelta:
    bytes_up: int  # since the previous take
    bytes_down: int
    open_connections: int  # at this take
    last_activity: float  # the latest of any of its connections, open or closed since the previous take
    idle_s: float  # now - last_activity (never negative): the age a peer on another clock can use


@dataclass(slots=True)
class Deltas:
    """One take, as columns: index ``i`` of each list is sandbox ``sandboxes[i]`` (each sandbox once).
    ``last_activity`` is on the caller's clock, as in ``SandboxDelta``; ``now`` is the take's time."""

    now: float
    sandboxes: list[str]
    bytes_up: list[int]
    bytes_down: list[int]
    open_connections: list[int]
    last_activity: list[float]

    def __len__(self) -> int:
        return len(self.sandboxes)

    def as_dict(self) -> dict[str, SandboxDelta]:
        now = self.now
        return {
            sid: SandboxDelta(up, down, n, last, max(0.0, now - last))
            for sid, up, down, n, last in zip(
                self.sandboxes, self.bytes_up, self.bytes_down, self.open_connections, self.last_activity, strict=True
            )
        }


@dataclass
class SandboxUsage:
    bytes_up: int
    bytes_down: int
    open_connections: int
    last_activity: float


@dataclass(eq=False, slots=True)
class _Sandbox:
    """A known sandbox: its live connections, and what changed since the previous take that its live
    connections do not carry (a connection opened or closed: ``touched``; closed ones' untaken bytes)."""

    conns: set[ConnMeter]
    reported: float  # when a take last reported it (for ``refresh_s``)
    touched: bool = True
    up: int = 0  # closed connections' bytes that no take has reported yet
    down: int = 0
    last: float = 0.0  # the latest activity of the connections opened or closed since the previous take


class Meter:
    def __init__(self) -> None:
        # Every sandbox with a live connection, or touched since the previous take (reported by the next).
        # A sandbox whose one live connection is all there is to it (the usual case) is that ConnMeter
        # itself, so the take reads it without a record, a set and a loop; any other is a _Sandbox.
        self._sandboxes: dict[str, ConnMeter | _Sandbox] = {}
        self._closed_up = 0  # every closed connection's bytes since start
        self._closed_down = 0

    def open(self, sandbox_id: str, conn_id: str, now: float) -> ConnMeter:
        """A meter for a new connection; ``now`` is its first activity. The next take reports the
        sandbox (its open connections changed) even if no byte moves."""
        m = ConnMeter(sandbox_id, conn_id, last_activity=now)
        s = self._sandboxes.get(sandbox_id)
        if s is None:
            self._sandboxes[sandbox_id] = m  # _reported None: the next take reports it
        elif type(s) is ConnMeter:
            self._sandboxes[sandbox_id] = _Sandbox({s, m}, now if s._reported is None else s._reported, last=now)
        else:
            assert isinstance(s, _Sandbox)
            s.conns.add(m)
            s.touched = True
            if now > s.last:
                s.last = now
        return m

    def close(self, m: ConnMeter) -> None:
        """The connection is over: its bytes are final. Closing twice, or a meter from another Meter,
        does nothing."""
        s = self._sandboxes.get(m.sandbox_id)
        if s is m:
            s = self._sandboxes[m.sandbox_id] = _Sandbox({m}, 0.0, last=0.0)  # forgotten at the next take
        elif not isinstance(s, _Sandbox) or m not in s.conns:
            return
        s.conns.discard(m)
        s.touched = True
        s.up += m.up - m._taken_up
        s.down += m.down - m._taken_down
        if m.last_activity > s.last:
            s.last = m.last_activity
        m._taken_up, m._taken_down = m.up, m.down
        self._closed_up += m.up
        self._closed_down += m.down

    def take(self, now: float, refresh_s: float | None = None) -> Deltas:
        """What moved per sandbox since the previous take, and forget what is done.
        A sandbox is reported when bytes moved or a connection opened or closed since the previous
        take. One with open connections and nothing new is not (its last report still holds), unless
        its last report is ``refresh_s`` or more old: then it is reported again with no bytes, so the
        scheduler, which forgets a stream's open connections when the stream falls silent, keeps
        seeing them. After the take, a sandbox with no open connection is forgotten."""
        ids: list[str] = []
        ups: list[int] = []
        downs: list[int] = []
        opens: list[int] = []
        lasts: list[float] = []
        # The loop runs for every active sandbox each interval (10,000 at the scale): bound
        # methods, locals, and the common case (one connection, nothing else) with the fewest steps.
        add_id, add_up, add_down, add_open, add_last = ids.append, ups.append, downs.append, opens.append, lasts.append
        sandboxes = self._sandboxes
        gone: list[str] = []
        for sid, s in sandboxes.items():
            if type(s) is ConnMeter:
                u, d, tu, td = s.up, s.down, s._taken_up, s._taken_down
                if u != tu or d != td:
                    s._taken_up, s._taken_down = u, d
                    up, down = u - tu, d - td
                elif s._reported is None or (refresh_s is not None and now - s._reported >= refresh_s):
                    up = down = 0
                else:
                    continue
                s._reported = now
                add_id(sid)
                add_up(up)
                add_down(down)
                add_open(1)
                add_last(s.last_activity)
                continue
            assert isinstance(s, _Sandbox)
            conns = s.conns
            if s.touched:
                up, down, last = s.up, s.down, s.last
                s.up = s.down = 0
                s.last = 0.0
                s.touched = False
                touched = True
            else:
                up = down = 0
                last = 0.0
                touched = False
            for m in conns:
                u, d = m.up, m.down
                if u != m._taken_up or d != m._taken_down:
                    up += u - m._taken_up
                    down += d - m._taken_down
                    m._taken_up, m._taken_down = u, d
                if m.last_activity > last:
                    last = m.last_activity
            if not conns:
                gone.append(sid)
            elif touched or up or down or (refresh_s is not None and now - s.reported >= refresh_s):
                s.reported = now
            else:
                if len(conns) == 1:
                    (m,) = conns
                    m._reported = s.reported
                    sandboxes[sid] = m  # a value replaced, not a key added: the loop goes on
                continue
            add_id(sid)
            add_up(up)
            add_down(down)
            add_open(len(conns))
            add_last(last)
            if len(conns) == 1:  # nothing else left to it: back to the plain ConnMeter
                (m,) = conns
                m._reported = now
                sandboxes[sid] = m
        for sid in gone:
            del sandboxes[sid]
        return Deltas(now, ids, ups, downs, opens, lasts)

    def take_deltas(self, now: float, refresh_s: float | None = None) -> dict[str, SandboxDelta]:
        """``take`` as a dict of ``SandboxDelta`` per sandbox (idle_s = now - last_activity, never negative)."""
        return self.take(now, refresh_s).as_dict()

    def usage(self) -> dict[str, SandboxUsage]:
        """What the next take would report, without taking (bytes since the previous take, or since
        start before the first), for the sandboxes still known."""
        out: dict[str, SandboxUsage] = {}
        for sid, s in self._sandboxes.items():
            if type(s) is ConnMeter:
                out[sid] = SandboxUsage(s.up - s._taken_up, s.down - s._taken_down, 1, s.last_activity)
                continue
            assert isinstance(s, _Sandbox)
            live = s.conns
            last = s.last if s.touched else 0.0
            out[sid] = SandboxUsage(
                bytes_up=(s.up if s.touched else 0) + sum(m.up - m._taken_up for m in live),
                bytes_down=(s.down if s.touched else 0) + sum(m.down - m._taken_down for m in live),
                open_connections=len(live),
                last_activity=max([last, *(m.last_activity for m in live)]),
            )
        return out

    def totals(self) -> tuple[int, int]:
        """Bytes up and down since start, every connection, exact (forgotten sandboxes included)."""
        up, down = self._closed_up, self._closed_down
        for s in self._sandboxes.values():
            if type(s) is ConnMeter:
                up += s.up
                down += s.down
                continue
            assert isinstance(s, _Sandbox)
            for m in s.conns:
                up += m.up
                down += m.down
        return up, down
