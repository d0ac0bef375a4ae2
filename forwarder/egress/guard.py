"""Internal-address guard: the destinations a guest's flow may never reach through the exit.

Judged on a flow's first packet (``flows.FlowTable``), on the destination only: the source is always
rewritten to the claim's address. Refusal reason: ``internal_address``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network

from forwarder.egress.errors import FlowRefused

# (network, why). Ranges that are not the public Internet: private, shared, loopback, link-local,
# documentation, benchmarking, protocol assignments, multicast, reserved and broadcast.
INTERNAL_RANGES: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space / CGNAT (RFC 6598)"),
    ("100.64.0.0/30", "overlay control addresses"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved, including 255.255.255.255 broadcast"),
)


def _as_int(addr: int | str | IPv4Address) -> int:
    return addr if isinstance(addr, int) else int(IPv4Address(addr))


class AddressGuard:
    """Refuses destinations in ``INTERNAL_RANGES``, the overlay subnet and any ``extra`` networks.

    Lookups are a binary search over merged intervals: O(log n) per first packet, no allocation.
    """

    __slots__ = ("_ends", "_starts")

    def __init__(self, overlay: str | IPv4Network | None = None, extra: Iterable[str | IPv4Network] = ()) -> None:
        nets = [IPv4Network(n) for n, _ in INTERNAL_RANGES]
        if overlay is not None:
            nets.append(IPv4Network(overlay))
        nets.extend(IPv4Network(n) for n in extra)
        spans = sorted((int(n.network_address), int(n.broadcast_address)) for n in nets)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._starts = [lo for lo, _ in merged]
        self._ends = [hi for _, hi in merged]

    def is_internal(self, addr: int | str | IPv4Address) -> bool:
        a = _as_int(addr)
        i = bisect.bisect_right(self._starts, a) - 1
        return i >= 0 and a <= self._ends[i]

    def check(self, addr: int | str | IPv4Address) -> None:
        """Raise ``FlowRefused("internal_address")`` if ``addr`` may not be reached."""
        if self.is_internal(addr):
            raise FlowRefused("internal_address", str(IPv4Address(_as_int(addr))))
