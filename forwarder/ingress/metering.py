"""Exact byte counts per connection and per sandbox, each direction.

The hot path touches only its own ``ConnMeter`` (two integer adds per chunk). Per-sandbox totals are
derived when someone asks (the idle-timer feed, the metrics flush): closed connections are folded into
the sandbox's totals once, live ones are summed at read time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class ConnMeter:
    sandbox_id: str
    conn_id: str
    up: int = 0  # gateway -> sandbox
    down: int = 0  # sandbox -> gateway
    last_activity: float = field(default_factory=time.monotonic)


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

    def open(self, sandbox_id: str, conn_id: str) -> ConnMeter:
        m = ConnMeter(sandbox_id, conn_id)
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
