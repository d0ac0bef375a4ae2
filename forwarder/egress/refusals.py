"""Outbound flows refused at their first packet, kept until the next audit round (router/audit.py): one
entry per refused 5-tuple and reason, with how many of its packets were refused, the first and the last.
At most ``cap`` tuples a round; past that only a count, so a guest that sends a stream of denied SYNs
costs the audit a bounded number of lines per round (the daemon's tick: one a second)."""

from __future__ import annotations

from forwarder.egress.flows import FlowKey

REFUSED_PER_ROUND = 64


class RefusalLog:
    __slots__ = ("_entries", "cap", "suppressed")

    def __init__(self, cap: int = REFUSED_PER_ROUND) -> None:
        self.cap = cap
        self._entries: dict[tuple[FlowKey, str], list[float]] = {}  # [packets, first, last]
        self.suppressed = 0  # refused packets of tuples past the cap, this round

    def note(self, key: FlowKey, reason: str, now: float) -> None:
        e = self._entries.get((key, reason))
        if e is not None:
            e[0] += 1
            e[2] = now
        elif len(self._entries) < self.cap:
            self._entries[(key, reason)] = [1, now, now]
        else:
            self.suppressed += 1

    def take(self) -> tuple[list[tuple[FlowKey, str, int, float, float]], int]:
        """This round's refused tuples (key, reason, packets, first, last) in the order first refused, and
        the suppressed count; the log starts empty again."""
        out = [(key, reason, int(e[0]), e[1], e[2]) for (key, reason), e in self._entries.items()]
        suppressed = self.suppressed
        self._entries = {}
        self.suppressed = 0
        return out, suppressed
