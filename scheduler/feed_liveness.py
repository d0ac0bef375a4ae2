"""Which forwarders' idle feeds are live, as a pure core (docs/scheduler-api.md "Feed liveness").

No I/O and no clock: ``now`` (the scheduler's wall seconds) comes with every call. The feed adapter
(``feed_http.FeedService``) calls ``heard`` for each batch the store applied (or acknowledged again as a
duplicate of an applied one), and the timer loop calls ``expire`` each round; the timer core is told
what changes (``TimerCore.feed_live``, ``TimerCore.feed_stale``) and idles a sandbox by its byte timer
only while the feed of the forwarder its route names is live.

A forwarder is known by its key: the SPKI pin of the certificate its feed presents, which is the pin a
route names it by (one of ``forwarder.spki_pins``). All its streams (workers) are one feed: a batch from any of
them is the forwarder's proof of life. A forwarder reports on every interval even when nothing moved,
so a live feed is never silent longer than an interval plus its retries.

- A feed is live from its first applied batch after this scheduler started (nothing is live at start:
  a scheduler that was down does not know what moved meanwhile) or after it went stale.
- It goes stale once ``stale_s`` has passed since its last applied batch (``expire``; ``heard`` after
  that much silence starts a new live spell even if ``expire`` has not run).
- ``live_since`` is when the current live spell began: the timer core runs no idle period from earlier
  (what moved while the feed was silent reaches the scheduler in the batches after the first).
- ``silent_since`` says, for a feed that is not live, since when nothing was heard: its last batch, or
  this scheduler's start when none was heard since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sbxnet.errors import LocalProtocolError


@dataclass(slots=True)
class _Feed:
    last_at: float  # the latest batch heard from any of its streams
    live_since: float | None  # when the current live spell began; None: stale


class FeedLiveness:
    """Per forwarder key: the last batch heard and whether the feed is live. Not thread-safe."""

    def __init__(self, stale_s: float, started_at: float) -> None:
        if not (math.isfinite(stale_s) and stale_s > 0):
            raise LocalProtocolError("bad_config", f"stale_s must be positive, not {stale_s!r}")
        self.stale_s = stale_s
        self.started_at = started_at
        self._feeds: dict[str, _Feed] = {}

    def heard(self, key: str, now: float) -> float | None:
        """A batch of forwarder ``key`` was applied at ``now``. Returns the start of its live spell when
        this batch began one (the feed was not live), else None."""
        feed = self._feeds.get(key)
        if feed is None:
            self._feeds[key] = _Feed(now, now)
            return now
        began: float | None = None
        if feed.live_since is None or now - feed.last_at > self.stale_s:
            feed.live_since = began = now
        if now > feed.last_at:
            feed.last_at = now
        return began

    def expire(self, now: float) -> list[str]:
        """The feeds that were live and have been silent longer than ``stale_s`` at ``now``, sorted: they
        are stale from here until their next batch."""
        out: list[str] = []
        limit = now - self.stale_s
        for key, feed in self._feeds.items():
            if feed.live_since is not None and feed.last_at < limit:
                feed.live_since = None
                out.append(key)
        out.sort()
        return out

    def live_since(self, key: str) -> float | None:
        """When the feed's current live spell began; None when it is not live."""
        feed = self._feeds.get(key)
        return None if feed is None else feed.live_since

    def live(self) -> dict[str, float]:
        """Every live feed's key and the start of its live spell."""
        return {k: f.live_since for k, f in self._feeds.items() if f.live_since is not None}

    def silent_since(self, key: str) -> float:
        """The last batch heard from ``key``, or this scheduler's start when none was."""
        feed = self._feeds.get(key)
        return self.started_at if feed is None else feed.last_at
