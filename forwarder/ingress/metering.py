"""Exact byte counts per connection and per sandbox, each direction. Time comes from the caller.

The hot path touches only its own ``ConnMeter`` (two integer adds per chunk, and ``last_activity`` set to
the time the plane read). Per-sandbox totals are
derived when someone asks (the idle-timer feed, the metrics flush): closed connections are folded into
the sandbox's totals once, live ones are summed at read time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class ConnMeter:
    sandbox_id: str
    conn_id: str
    last_activity: float  # the caller's monotonic clock
    up: int = 0  # gateway -> sandbox
    down: int = 0  # sandbox -> gateway


@dataclass
class SandboxUsage:
    bytes_up: int
    bytes_down: int
    open_connections: int
    last_activity: float


@dataclass
class _Closed:
    up: int = 0
    down: int = 0
    last_activity: float = 0.0


class Meter:
    def __init__(self) -> None:
        self._live: dict[str, set[ConnMeter]] = {}
        self._closed: dict[str, _Closed] = {}

    def open(self, sandbox_id: str, conn_id: str, now: float) -> ConnMeter:
        """A meter for a new connection; ``now`` is its first activity."""
        m = ConnMeter(sandbox_id, conn_id, last_activity=now)
        self._live.setdefault(sandbox_id, set()).add(m)
        return m

    def close(self, m: ConnMeter) -> None:
        live = self._live.get(m.sandbox_id)
        if live is None or m not in live:
            return
        live.discard(m)
        if not live:
            del self._live[m.sandbox_id]
        c = self._closed.setdefault(m.sandbox_id, _Closed())
        c.up += m.up
        c.down += m.down
        c.last_activity = max(c.last_activity, m.last_activity)

    def usage(self) -> dict[str, SandboxUsage]:
        """Cumulative totals per sandbox since start (monotonic; callers diff for deltas)."""
        out: dict[str, SandboxUsage] = {}
        for sid in set(self._live) | set(self._closed):
            c = self._closed.get(sid, _Closed())
            live = self._live.get(sid, set())
            out[sid] = SandboxUsage(
                bytes_up=c.up + sum(m.up for m in live),
                bytes_down=c.down + sum(m.down for m in live),
                open_connections=len(live),
                last_activity=max([c.last_activity, *(m.last_activity for m in live)]),
            )
        return out

    def totals(self) -> tuple[int, int]:
        up = down = 0
        for u in self.usage().values():
            up += u.bytes_up
            down += u.bytes_down
        return up, down
