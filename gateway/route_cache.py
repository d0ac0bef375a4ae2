"""The gateway's route cache: positive and negative entries with the scheduler's TTLs, bounded, LRU.

Pure: ``now`` (seconds on one monotonic clock) comes from the caller; no clock is read here.

The scheduler answers a route lookup with ``Cache-Control: max-age=<s>`` (docs/scheduler-api.md): a found
route for ``route_cache_s`` (default 2 s), an unknown sandbox for ``negative_cache_s`` (default 1 s). The
gateway serves from here until the entry expires, and must look again after a failed connect
(``invalidate``). ``ttl_from_cache_control`` turns the header into a TTL; anything it cannot read
caches nothing, so a malformed header costs a lookup, never a stale route.

Bounded: at most ``max_entries`` (the least recently used goes first) and no entry lives longer than
``max_ttl`` whatever the header says. Counters (``stats``) for metrics: hits, negative_hits, misses,
expired, evictions, invalidations, stale.

The last route known (``max_stale``, 0: none): besides the entries, the cache remembers the last route
the source gave for each sandbox (``max_entries`` of them, LRU, apart from the entries), and ``stale``
hands it out for ``max_stale`` seconds from when the source gave it, for a caller whose lookup failed
(the scheduler down or restarting). An answer "unknown" forgets it at once, a new route replaces it, and
an answer the source said not to cache (a TTL of 0) forgets it: a stale route is only ever the one the
source last gave, and never served for a name the source since said it does not know.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from sbxnet.errors import ConfigError

V = TypeVar("V")

_MAX_AGE = re.compile(r'max-age\s*=\s*(?:([0-9]{1,10})|"([0-9]{1,10})")', re.I)


def ttl_from_cache_control(value: str | bytes | None, *, default: float) -> float:
    """The TTL a ``Cache-Control`` header allows: ``max-age``; 0 for ``no-store``, ``no-cache``, a
    malformed or repeated ``max-age`` or a header without one; ``default`` when there is no header."""
    if value is None:
        return default
    if isinstance(value, bytes):
        if not value.isascii():
            return 0.0
        value = value.decode("ascii")
    ttl: float | None = None
    for directive in value.split(","):
        d = directive.strip()
        name = d.split("=", 1)[0].strip().lower()
        if name in ("no-store", "no-cache"):
            return 0.0
        if name == "max-age":
            m = _MAX_AGE.fullmatch(d)
            if m is None or ttl is not None:
                return 0.0
            ttl = float(m.group(1) or m.group(2))
    return 0.0 if ttl is None else ttl


@dataclass(frozen=True)
class Stale(Generic[V]):
    """The last route the source gave, served while it cannot be asked."""

    route: V
    age: float  # seconds since the source gave it
    first: bool  # the first time it is served stale since the source gave it (say so once)


@dataclass
class _Known(Generic[V]):
    route: V
    given_at: float
    served: bool = False


@dataclass(frozen=True)
class Hit(Generic[V]):
    """A cached answer: ``route`` is the route, or None when the scheduler said the sandbox is unknown."""

    route: V | None
    expires: float


class RouteCache(Generic[V]):
    """``sandbox -> Hit`` with expiry at ``now + ttl`` and LRU eviction past ``max_entries``."""

    def __init__(self, *, max_entries: int = 10_000, max_ttl: float = 60.0, max_stale: float = 0.0) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"gateway.route_cache_entries = {max_entries!r}: a positive integer")
        if not math.isfinite(max_ttl) or max_ttl <= 0:
            raise ConfigError(f"gateway.route_cache_max_ttl_s = {max_ttl!r}: a positive number of seconds")
        if not math.isfinite(max_stale) or max_stale < 0:
            raise ConfigError(f"gateway.route_stale_s = {max_stale!r}: 0 or a positive number of seconds")
        self.max_entries = max_entries
        self.max_ttl = float(max_ttl)
        self.max_stale = float(max_stale)
        self._entries: OrderedDict[str, Hit[V]] = OrderedDict()
        self._known: OrderedDict[str, _Known[V]] = OrderedDict()
        self.hits = 0
        self.negative_hits = 0
        self.misses = 0
        self.expired = 0
        self.evictions = 0
        self.invalidations = 0
        self.stale_served = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sandbox: str, now: float) -> Hit[V] | None:
        """The live entry for ``sandbox`` (counted as a hit, or a negative hit), or None (a miss: look it up)."""
        hit = self._entries.get(sandbox)
        if hit is not None and now >= hit.expires:
            del self._entries[sandbox]
            self.expired += 1
            hit = None
        if hit is None:
            self.misses += 1
            return None
        self._entries.move_to_end(sandbox)
        if hit.route is None:
            self.negative_hits += 1
        else:
            self.hits += 1
        return hit

    def put_found(self, sandbox: str, route: V, ttl: float, now: float) -> None:
        """Cache ``route`` for ``ttl`` seconds (capped at ``max_ttl``); a TTL of 0 or less removes the entry.
        It is the last route known for ``sandbox`` from ``now`` (with a TTL of 0 or less, none is)."""
        self._put(sandbox, route, ttl, now)
        if self.max_stale > 0 and ttl > 0 and math.isfinite(now):
            self._known[sandbox] = _Known(route, now)
            self._known.move_to_end(sandbox)
            while len(self._known) > self.max_entries:
                self._known.popitem(last=False)
        else:
            self._known.pop(sandbox, None)

    def put_unknown(self, sandbox: str, ttl: float, now: float) -> None:
        """Cache "unknown sandbox" for ``ttl`` seconds (capped at ``max_ttl``); no route is known for it
        any more, stale or not."""
        self._put(sandbox, None, ttl, now)
        self._known.pop(sandbox, None)

    def stale(self, sandbox: str, now: float) -> Stale[V] | None:
        """The last route the source gave for ``sandbox``, if it gave it less than ``max_stale`` seconds
        before ``now`` (counted: ``stale``); None otherwise. For a caller whose lookup failed."""
        known = self._known.get(sandbox)
        if known is None:
            return None
        age = now - known.given_at
        if not 0 <= age < self.max_stale:
            del self._known[sandbox]
            return None
        first = not known.served
        known.served = True
        self._known.move_to_end(sandbox)
        self.stale_served += 1
        return Stale(known.route, age, first)

    def _put(self, sandbox: str, route: V | None, ttl: float, now: float) -> None:
        if not ttl > 0 or not math.isfinite(now):  # `not >` so that NaN caches nothing too
            self._entries.pop(sandbox, None)
            return
        self._entries[sandbox] = Hit(route, now + min(ttl, self.max_ttl))
        self._entries.move_to_end(sandbox)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evictions += 1

    def invalidate(self, sandbox: str) -> bool:
        """Forget ``sandbox`` (after a failed connect: the next request looks it up again)."""
        if self._entries.pop(sandbox, None) is None:
            return False
        self.invalidations += 1
        return True

    def purge(self, now: float) -> int:
        """Drop every expired entry; how many went (a periodic sweep, so dead entries do not wait for LRU)."""
        dead = [k for k, h in self._entries.items() if now >= h.expires]
        for k in dead:
            del self._entries[k]
        self.expired += len(dead)
        for k in [k for k, known in self._known.items() if not 0 <= now - known.given_at < self.max_stale]:
            del self._known[k]  # too old to be served stale: forgotten (not counted as an entry)
        return len(dead)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "hits": self.hits,
            "negative_hits": self.negative_hits,
            "misses": self.misses,
            "expired": self.expired,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
            "known": len(self._known),
            "stale": self.stale_served,
        }
