"""Exact byte counts per connection and per sandbox, each direction. Time comes from the caller.

The hot path touches only its own ``ConnMeter``: two integer adds per chunk, and ``last_activity`` set to
the time the plane read. The ``Meter`` derives the rest when asked:

- ``take_deltas(now)``: what moved per sandbox since the previous take (the idle-timer feed). Every byte
  a connection counted appears in exactly one take: live connections carry what earlier takes already
  reported, and a closing connection folds what no take has reported yet into its sandbox's pending
  entry.
- ``totals()``: bytes since start, for the metrics flush: a running sum over closed connections plus the
  live ones, so it stays exact after sandboxes are forgotten.

Memory is bounded by the live connections plus the sandboxes touched since the previous take: a sandbox
is forgotten at the take that reports it with no connection open.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class ConnMeter:
    sandbox_id: str
    conn_id: str
    last_activity: float  # the caller's monotonic clock
    up: int = 0  # gateway -> sandbox; only ever grows
    down: int = 0  # sandbox -> gateway; only ever grows
    # How much of up/down earlier takes reported. The Meter's bookkeeping: planes never touch it.
    _taken_up: int = field(default=0, init=False, repr=False)
    _taken_down: int = field(default=0, init=False, repr=False)


@dataclass(frozen=True)
class SandboxDelta:
    bytes_up: int  # since the previous take
    bytes_down: int
    open_connections: int  # at this take
    last_activity: float  # the latest of any of its connections, open or closed since the previous take
    idle_s: float  # now - last_activity (never negative): the age a peer on another clock can use


@dataclass
class SandboxUsage:
    bytes_up: int
    bytes_down: int
    open_connections: int
    last_activity: float


@dataclass
class _Pending:
    """A sandbox's closed connections' bytes that no take has reported yet."""

    up: int = 0
    down: int = 0
    last_activity: float = 0.0


class Meter:
    def __init__(self) -> None:
        self._live: dict[str, set[ConnMeter]] = {}
        # Sandboxes with a connection opened or closed since the previous take (reported by the next).
        self._pending: dict[str, _Pending] = {}
        self._closed_up = 0  # every closed connection's bytes since start
        self._closed_down = 0
        # When each sandbox with open connections was last reported (for ``refresh_s``); a sandbox
        # leaves it at the take that reports it with nothing open, so it is bounded by the live ones.
        self._reported: dict[str, float] = {}

    def open(self, sandbox_id: str, conn_id: str, now: float) -> ConnMeter:
        """A meter for a new connection; ``now`` is its first activity. The next take reports the
        sandbox (its open connections changed) even if no byte moves."""
        m = ConnMeter(sandbox_id, conn_id, last_activity=now)
        self._live.setdefault(sandbox_id, set()).add(m)
        p = self._pending.setdefault(sandbox_id, _Pending())
        p.last_activity = max(p.last_activity, now)
        return m

    def close(self, m: ConnMeter) -> None:
        """The connection is over: its bytes are final. Closing twice, or a meter from another Meter,
        does nothing."""
        live = self._live.get(m.sandbox_id)
        if live is None or m not in live:
            return
        live.discard(m)
        if not live:
            del self._live[m.sandbox_id]
        p = self._pending.setdefault(m.sandbox_id, _Pending())
        p.up += m.up - m._taken_up
        p.down += m.down - m._taken_down
        p.last_activity = max(p.last_activity, m.last_activity)
        m._taken_up, m._taken_down = m.up, m.down
        self._closed_up += m.up
        self._closed_down += m.down

    def take_deltas(self, now: float, refresh_s: float | None = None) -> dict[str, SandboxDelta]:
        """What moved per sandbox since the previous take, and forget what is done.
        A sandbox is reported when bytes moved or a connection opened or closed since the previous
        take. One with open connections and nothing new is not (its last report still holds), unless
        its last report is ``refresh_s`` or more old: then it is reported again with no bytes, so the
        scheduler, which forgets a stream's open connections when the stream falls silent, keeps
        seeing them. After the take, a sandbox with no open connection is forgotten."""
        out: dict[str, SandboxDelta] = {}
        reported = self._reported
        pending = self._pending
        # One pass over the live sandboxes (most of them, at scale: one plain loop, no generators), then
        # the sandboxes whose last connection closed since the previous take.
        for sid, live in self._live.items():
            p = pending.pop(sid, None)
            up = down = 0
            last = 0.0 if p is None else p.last_activity
            for m in live:
                du, dd = m.up - m._taken_up, m.down - m._taken_down
                if du or dd:
                    up += du
                    down += dd
                    m._taken_up, m._taken_down = m.up, m.down
                if m.last_activity > last:
                    last = m.last_activity
            if p is not None:
                up += p.up
                down += p.down
            elif not up and not down and (refresh_s is None or now - reported.get(sid, now) < refresh_s):
                continue
            out[sid] = SandboxDelta(up, down, len(live), last, max(0.0, now - last))
            reported[sid] = now
        for sid, p in pending.items():
            out[sid] = SandboxDelta(p.up, p.down, 0, p.last_activity, max(0.0, now - p.last_activity))
            reported.pop(sid, None)
        self._pending.clear()
        return out

    def usage(self) -> dict[str, SandboxUsage]:
        """What the next take would report, without taking (bytes since the previous take, or since
        start before the first), for the sandboxes still known."""
        out: dict[str, SandboxUsage] = {}
        for sid in self._live.keys() | self._pending.keys():
            p = self._pending.get(sid, _Pending())
            live = self._live.get(sid, ())
            out[sid] = SandboxUsage(
                bytes_up=p.up + sum(m.up - m._taken_up for m in live),
                bytes_down=p.down + sum(m.down - m._taken_down for m in live),
                open_connections=len(live),
                last_activity=max([p.last_activity, *(m.last_activity for m in live)]),
            )
        return out

    def totals(self) -> tuple[int, int]:
        """Bytes up and down since start, every connection, exact (forgotten sandboxes included)."""
        up, down = self._closed_up, self._closed_down
        for live in self._live.values():
            for m in live:
                up += m.up
                down += m.down
        return up, down
