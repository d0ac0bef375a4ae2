"""The upstream retry schedule both ends of the link follow (DESIGN.md, "Cold start").

A refused attempt (nothing listening yet) waits ``initial``, doubling up to ``cap``, before the next
one; an attempt that gets no answer at all is replaced by a fresh SYN after ``SYN_INTERVAL_S`` instead of
waiting for the kernel's 1 s retransmit. Pure: the callers own the clock and the sockets.
"""

from __future__ import annotations

from collections.abc import Iterator

BACKOFF_INITIAL_S = 0.005
BACKOFF_CAP_S = 0.05
SYN_INTERVAL_S = 0.05


def backoff_delays(initial: float = BACKOFF_INITIAL_S, cap: float = BACKOFF_CAP_S) -> Iterator[float]:
    """initial, 2*initial, 4*initial, ... capped at ``cap``."""
    delay = initial
    while True:
        yield min(delay, cap)
        delay = min(delay * 2, cap)
