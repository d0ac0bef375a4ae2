"""ARP (RFC 826) for Ethernet/IPv4 on the overlay: parse, answer for armed claims, announce.

The router owns ARP for its claims: exits ask who has a claim address, the router answers for the
claims it holds armed (nobody else's) with its own MAC, and announces a claim with a gratuitous ARP on
arm, after an exit reload and periodically. ARP never reaches a guest and a guest never sends one (its
frames are IPv4 only). Refusal reasons (``InboundRefused``): short_arp, arp_not_ipv4, bad_arp_op.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from ipaddress import IPv4Address

from forwarder.egress.errors import InboundRefused
from forwarder.egress.vxlan import BROADCAST_MAC, ETH_ALEN, ETH_P_ARP, ETH_P_IP, push_ethernet
from sbxnet.errors import LocalProtocolError

ARP_LEN = 28
ARPHRD_ETHER = 1
ARPOP_REQUEST = 1
ARPOP_REPLY = 2
ZERO_MAC = b"\x00" * ETH_ALEN

_ARP = struct.Struct("!HHBBH6sI6sI")


@dataclass(frozen=True, slots=True)
class ArpPacket:
    """Addresses are host-order ints (``spa``/``tpa``) and 6-byte MACs (``sha``/``tha``)."""

    op: int
    sha: bytes
    spa: int
    tha: bytes
    tpa: int

    def __str__(self) -> str:
        return f"op {self.op} {IPv4Address(self.spa)} {self.sha.hex(':')} -> {IPv4Address(self.tpa)}"


def pull_arp(buf: bytes | bytearray | memoryview) -> ArpPacket:
    """The ARP packet at the start of ``buf`` (bytes after 28 are Ethernet padding and ignored).
    Only Ethernet (htype 1, hlen 6) over IPv4 (ptype 0x0800, plen 4), request or reply."""
    if len(buf) < ARP_LEN:
        raise InboundRefused("short_arp", f"{len(buf)} bytes")
    htype, ptype, hlen, plen, op, sha, spa, tha, tpa = _ARP.unpack_from(buf, 0)
    if htype != ARPHRD_ETHER or ptype != ETH_P_IP or hlen != ETH_ALEN or plen != 4:
        raise InboundRefused("arp_not_ipv4", f"htype {htype} ptype {ptype:#06x} hlen {hlen} plen {plen}")
    if op not in (ARPOP_REQUEST, ARPOP_REPLY):
        raise InboundRefused("bad_arp_op", f"op {op}")
    return ArpPacket(op, sha, spa, tha, tpa)


def push_arp(p: ArpPacket) -> bytes:
    if len(p.sha) != ETH_ALEN or len(p.tha) != ETH_ALEN or p.op not in (ARPOP_REQUEST, ARPOP_REPLY):
        raise LocalProtocolError("arp_field", repr(p))
    try:
        return _ARP.pack(ARPHRD_ETHER, ETH_P_IP, ETH_ALEN, 4, p.op, p.sha, p.spa, p.tha, p.tpa)
    except struct.error as exc:
        raise LocalProtocolError("arp_field", str(exc)) from None


def _unicast(mac: bytes) -> bool:
    return mac != ZERO_MAC and not mac[0] & 1


def arp_reply(req: ArpPacket, claims: Container[int], mac: bytes) -> bytes | None:
    """The Ethernet frame answering ``req`` with ``mac``, or None when we do not answer: not a request,
    the target is not an armed claim (``claims``), the asker's MAC is not unicast, or it is a
    gratuitous announcement (sender address == target address)."""
    if req.op != ARPOP_REQUEST or req.tpa not in claims or not _unicast(req.sha) or req.spa == req.tpa:
        return None
    reply = ArpPacket(ARPOP_REPLY, mac, req.tpa, req.sha, req.spa)
    return push_ethernet(req.sha, mac, ETH_P_ARP) + push_arp(reply)


def gratuitous_arp(addr: int, mac: bytes) -> bytes:
    """A broadcast announcement that ``addr`` is at ``mac`` (RFC 5227 form: a request with sender and
    target address both ``addr`` and a zero target MAC), which exits accept with ``arp_accept``."""
    if not _unicast(mac):
        raise LocalProtocolError("arp_field", f"announce with MAC {mac.hex(':')}")
    ann = ArpPacket(ARPOP_REQUEST, mac, addr, ZERO_MAC, addr)
    return push_ethernet(BROADCAST_MAC, mac, ETH_P_ARP) + push_arp(ann)
