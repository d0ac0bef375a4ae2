"""Claim addresses on a single node: the choice, in memory, with no clock and no disk (``now`` passed in).

``AddressPool(pool, reuse_window)`` hands out the host addresses of ``pool`` (the overlay, unless a
narrower pool is configured) but its network and broadcast addresses and its first host (the exits'
overlay gateway address, ``100.64.0.1`` in the reference configuration), plus any ``exclude``. An address
is in one of three states: free, held by a claim, or cooling (released less than ``reuse_window`` seconds
ago). ``allocate`` takes the next free address after the last one handed out (round robin, so a
released address is the last to come back even once its window is over); ``reserve`` takes a given
one (a claim restored from the state file, imported from another host or pinned by the claims file);
``release`` starts its window. A cooling address is given back early only to the claim that released
it (a claim moved away and back, or re-armed), never to another.

Time is wall-clock seconds (``time.time()`` in the adapter): the window must hold across a restart,
and the release log (``release_log.py``) is what carries the cooling addresses over one.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from sbxnet.errors import SbxnetError


class AllocationError(SbxnetError):
    """No address for this claim. ``reason``: ``pool_exhausted``, ``address_in_use``, ``address_cooling``,
    ``outside_pool``, ``allocator_unavailable`` (the mesh's database), ``claim_has_address``."""


@dataclass(frozen=True, slots=True)
class Released:
    address: int
    at: float  # wall-clock seconds
    claim: str


class AddressPool:
    def __init__(
        self, pool: ipaddress.IPv4Network, reuse_window: float, *, exclude: Iterable[int] = (),
        released: Iterable[Released] = (), now: float = 0.0,
    ) -> None:
        if pool.num_addresses < 4:
            raise ValueError(f"address pool {pool} leaves no claim addresses (want /30 or wider)")
        self.pool = pool
        self.window = reuse_window
        self.first = int(pool.network_address) + 2  # network and the exits' gateway address skipped
        self.last = int(pool.broadcast_address) - 1
        self.excluded = {a for a in exclude if self.first <= a <= self.last}
        self.size = self.last - self.first + 1 - len(self.excluded)
        self.held: dict[int, str] = {}  # address -> claim
        self.cooling: dict[int, Released] = {}
        self._order: deque[Released] = deque()  # releases in the order they came, to expire them
        self._next = self.first
        for r in sorted(released, key=lambda r: r.at):
            self._cool(r)
        self.expire(now)

    def __contains__(self, address: int) -> bool:
        return self.first <= address <= self.last and address not in self.excluded

    def expire(self, now: float) -> None:
        """Forget the releases whose window is over."""
        order = self._order
        while order and now - order[0].at >= self.window:
            r = order.popleft()
            if self.cooling.get(r.address) is r:
                del self.cooling[r.address]

    def allocate(self, claim: str, now: float) -> int:
        """The next free address for ``claim``; ``AllocationError("pool_exhausted")`` if none is."""
        self.expire(now)
        if len(self.held) + len(self.cooling) >= self.size:
            raise AllocationError("pool_exhausted", f"all {self.size} addresses of {self.pool} are held or cooling")
        a = self._next
        # At most held + cooling + excluded addresses are skipped before a free one: the count above
        # says one exists.
        while a in self.held or a in self.cooling or a in self.excluded:
            a = a + 1 if a < self.last else self.first
        self.held[a] = claim
        self._next = a + 1 if a < self.last else self.first
        return a

    def reserve(self, claim: str, address: int, now: float) -> None:
        """Take ``address`` for ``claim``, or ``AllocationError`` saying why it cannot be had."""
        self.expire(now)
        if address not in self:
            raise AllocationError("outside_pool", f"{ipaddress.IPv4Address(address)} is not a claim address of "
                                                  f"{self.pool}")
        holder = self.held.get(address)
        if holder is not None and holder != claim:
            raise AllocationError("address_in_use", f"{ipaddress.IPv4Address(address)} is held by claim {holder}")
        cool = self.cooling.get(address)
        if cool is not None:
            if cool.claim != claim:
                left = self.window - (now - cool.at)
                raise AllocationError("address_cooling", f"{ipaddress.IPv4Address(address)} was released by claim "
                                                         f"{cool.claim}; reusable in {left:.0f} s")
            del self.cooling[address]  # the _order entry stays and is skipped when it expires
        self.held[address] = claim

    def release(self, claim: str, address: int, now: float) -> Released | None:
        """``claim`` gives ``address`` back; its reuse window starts. Returns the release to log (None if the
        claim did not hold it)."""
        if self.held.get(address) != claim:
            return None
        del self.held[address]
        r = Released(address, now, claim)
        self._cool(r)
        return r

    def _cool(self, r: Released) -> None:
        if r.address not in self or r.address in self.held:
            return
        self.cooling[r.address] = r
        self._order.append(r)

    def still_cooling(self, now: float) -> list[Released]:
        """The releases inside their window at ``now``, oldest first (what the log keeps when compacted)."""
        self.expire(now)
        return sorted(self.cooling.values(), key=lambda r: r.at)
