"""Per-claim byte and packet rates and a byte quota, charged per wire packet.

A GSO frame is charged for everything it puts on the wire: every segment's own IPv4 and L4 headers
and, per packet, the encapsulation (``WIRE_OVERHEAD``), not just the bytes the guest handed over.
Refusal reasons: ``quota``, ``packet_rate``, ``byte_rate``. Time is passed in (seconds, monotonic).
"""

from __future__ import annotations

from forwarder.egress.errors import LimitRefused
from forwarder.egress.validate import MAX_GSO_SEGMENTS, MAX_IP_PACKET, OutboundFrame

# Per wire packet around the inner IPv4 packet: outer Ethernet 14, outer IPv4 20, UDP 8, VXLAN 8,
# inner Ethernet 14.
WIRE_OVERHEAD = 14 + 20 + 8 + 8 + 14
# The most one accepted frame can cost: a 64 KiB GSO frame cut into the most segments, each with
# repeated IPv4 + TCP headers (at most 60 + 20 per segment) and the encapsulation.
MAX_FRAME_COST = MAX_IP_PACKET + MAX_GSO_SEGMENTS * (20 + 60 + WIRE_OVERHEAD)


def wire_cost(frame: OutboundFrame, overhead: int = WIRE_OVERHEAD) -> tuple[int, int]:
    """(bytes, packets) that ``frame`` puts on the wire once segmented and encapsulated."""
    packets = frame.segments
    return frame.payload_len + packets * (frame.l4_offset + frame.l4_header_len + overhead), packets


class TokenBucket:
    """``rate`` tokens per second up to ``burst``; starts full. Time going backwards refills nothing."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate {rate} and burst {burst} must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.last = now

    def refill(self, now: float) -> float:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
        return self.tokens

    def take(self, cost: float, now: float) -> bool:
        """Take ``cost`` tokens if that many are there; otherwise take none and return False."""
        if self.refill(now) < cost:
            return False
        self.tokens -= cost
        return True


class ClaimLimits:
    """One claim's limits. ``None`` disables a limit.

    Bursts default to one second of rate and are raised to at least one maximal frame
    (``MAX_FRAME_COST`` bytes, ``MAX_GSO_SEGMENTS`` packets) so that any frame validation accepts can
    pass once the bucket is full. ``charge`` is all-or-nothing: a refused frame costs nothing.
    """

    __slots__ = ("_bytes", "_packets", "bytes_used", "packets_used", "quota_bytes")

    def __init__(
        self,
        *,
        byte_rate: float | None = None,
        packet_rate: float | None = None,
        byte_burst: float | None = None,
        packet_burst: float | None = None,
        quota_bytes: int | None = None,
        now: float = 0.0,
    ) -> None:
        self._bytes = (
            TokenBucket(byte_rate, max(byte_burst or byte_rate, MAX_FRAME_COST), now) if byte_rate else None
        )
        self._packets = (
            TokenBucket(packet_rate, max(packet_burst or packet_rate, MAX_GSO_SEGMENTS), now)
            if packet_rate
            else None
        )
        self.quota_bytes = quota_bytes
        self.bytes_used = 0
        self.packets_used = 0

    def charge(self, nbytes: int, packets: int, now: float) -> None:
        """Charge ``nbytes`` in ``packets`` wire packets or raise ``LimitRefused`` (quota, packet_rate,
        byte_rate, checked in that order) without charging anything."""
        if self.quota_bytes is not None and self.bytes_used + nbytes > self.quota_bytes:
            raise LimitRefused("quota", f"{self.bytes_used} + {nbytes} > {self.quota_bytes}")
        pb = self._packets
        bb = self._bytes
        if pb is not None and pb.refill(now) < packets:
            raise LimitRefused("packet_rate")
        if bb is not None and bb.refill(now) < nbytes:
            raise LimitRefused("byte_rate")
        if pb is not None:
            pb.tokens -= packets
        if bb is not None:
            bb.tokens -= nbytes
        self.bytes_used += nbytes
        self.packets_used += packets

    def charge_frame(self, frame: OutboundFrame, now: float, overhead: int = WIRE_OVERHEAD) -> tuple[int, int]:
        """Charge what ``frame`` puts on the wire; returns (bytes, packets) charged."""
        nbytes, packets = wire_cost(frame, overhead)
        self.charge(nbytes, packets, now)
        return nbytes, packets
