"""VXLAN (RFC 7348) and Ethernet headers between the router and its exits.

Outbound, every Ethernet header on the wire is built here by the router (``push_ethernet``/``encap``):
guest frames are IPv4 packets only (``validate.validate_outbound`` refuses anything whose first byte
is not IPv4 version 4), so a guest can never put its own Ethernet frame, ARP or other ethertype on the
overlay. Inbound, ``decap`` accepts a datagram only from a configured exit VTEP and only IPv4 or ARP
inside; ``inner_ipv4`` trims an inbound IPv4 packet to its own length before delivery to a guest.
Refusal reasons (``InboundRefused``): unknown_vtep, short_vxlan, vxlan_flags, vxlan_reserved,
unknown_vni, short_ethernet, unsupported_ethertype, foreign_mac, bad_ip_header, bad_ip_length.
"""

from __future__ import annotations

import struct
from collections.abc import Container, Hashable
from dataclasses import dataclass

from forwarder.egress.errors import InboundRefused
from sbxnet.errors import LocalProtocolError

VXLAN_PORT = 4789
VXLAN_HDR_LEN = 8
VXLAN_FLAG_I = 0x08
VNI_MAX = 0xFFFFFF
ETH_HDR_LEN = 14
ETH_P_IP = 0x0800
ETH_P_ARP = 0x0806
ETH_ALEN = 6
BROADCAST_MAC = b"\xff" * ETH_ALEN
_ACCEPTED_ETHERTYPES = (ETH_P_IP, ETH_P_ARP)

_VXLAN = struct.Struct("!B3sI")  # flags, reserved, VNI << 8 | reserved
_ETH = struct.Struct("!6s6sH")
_IPLEN = struct.Struct("!H")


def pull_vxlan(buf: bytes | bytearray | memoryview) -> int:
    """The VNI of the VXLAN header at the start of ``buf``. Flags must be exactly I (0x08) and every
    reserved bit 0, as Linux sends them and as Linux's own receiver insists (no extensions here)."""
    if len(buf) < VXLAN_HDR_LEN:
        raise InboundRefused("short_vxlan", f"{len(buf)} bytes")
    flags, rsv, word = _VXLAN.unpack_from(buf, 0)
    if flags != VXLAN_FLAG_I:
        raise InboundRefused("vxlan_flags", f"flags {flags:#04x}")
    if rsv != b"\x00\x00\x00" or word & 0xFF:
        raise InboundRefused("vxlan_reserved")
    return int(word >> 8)


def push_vxlan(vni: int) -> bytes:
    if not 0 <= vni <= VNI_MAX:
        raise LocalProtocolError("vni", f"{vni}")
    return _VXLAN.pack(VXLAN_FLAG_I, b"\x00\x00\x00", vni << 8)


@dataclass(frozen=True, slots=True)
class EthernetHdr:
    dst: bytes
    src: bytes
    ethertype: int


def pull_ethernet(buf: bytes | bytearray | memoryview) -> EthernetHdr:
    """The untagged Ethernet II header at the start of ``buf``; only IPv4 and ARP are accepted (a VLAN
    tag or any other ethertype is ``unsupported_ethertype``)."""
    if len(buf) < ETH_HDR_LEN:
        raise InboundRefused("short_ethernet", f"{len(buf)} bytes")
    dst, src, ethertype = _ETH.unpack_from(buf, 0)
    if ethertype not in _ACCEPTED_ETHERTYPES:
        raise InboundRefused("unsupported_ethertype", f"{ethertype:#06x}")
    return EthernetHdr(dst, src, ethertype)


def push_ethernet(dst: bytes, src: bytes, ethertype: int) -> bytes:
    if len(dst) != ETH_ALEN or len(src) != ETH_ALEN or ethertype not in _ACCEPTED_ETHERTYPES:
        raise LocalProtocolError("ethernet_field", f"{dst!r} {src!r} {ethertype:#x}")
    return _ETH.pack(dst, src, ethertype)


def encap(vni: int, dst_mac: bytes, src_mac: bytes, ethertype: int,
          payload: bytes | bytearray | memoryview) -> bytes:
    """A VXLAN UDP payload: VXLAN header, our Ethernet header, ``payload``."""
    return b"".join((push_vxlan(vni), push_ethernet(dst_mac, src_mac, ethertype), payload))


@dataclass(frozen=True, slots=True)
class Inbound:
    vni: int
    eth: EthernetHdr
    payload: memoryview  # what follows the Ethernet header (may include Ethernet padding)


def decap(
    datagram: bytes | bytearray | memoryview,
    src: Hashable,
    vteps: Container[Hashable],
    vni: int | None = None,
    local_mac: bytes | None = None,
) -> Inbound:
    """Decapsulate one VXLAN UDP payload received from ``src``.

    ``src`` is compared with ``vteps`` as given (use the form the socket reports, e.g. the host string)
    before any byte is parsed: ``unknown_vtep``. With ``vni`` set, another VNI is ``unknown_vni``. With
    ``local_mac`` set, an Ethernet destination other than it (or broadcast, for ARP requests) is
    ``foreign_mac``. ``payload`` is a view of ``datagram``: copy it if the buffer is reused.
    """
    if src not in vteps:
        raise InboundRefused("unknown_vtep", str(src))
    got = pull_vxlan(datagram)
    if vni is not None and got != vni:
        raise InboundRefused("unknown_vni", f"{got}")
    mv = memoryview(datagram)[VXLAN_HDR_LEN:]
    eth = pull_ethernet(mv)
    if local_mac is not None and eth.dst != local_mac and eth.dst != BROADCAST_MAC:
        raise InboundRefused("foreign_mac", eth.dst.hex(":"))
    return Inbound(got, eth, mv[ETH_HDR_LEN:])


def inner_ipv4(inbound: Inbound) -> memoryview:
    """The IPv4 packet an inbound IPv4 frame carries, trimmed to its total length (Ethernet padding
    dropped). Only the IPv4 framing is checked here (version 4, IHL >= 5, total length within the
    frame); the router judges the destination and the guest's kernel the rest."""
    p = inbound.payload
    if inbound.eth.ethertype != ETH_P_IP or len(p) < 20 or p[0] >> 4 != 4 or p[0] & 0xF < 5:
        raise InboundRefused("bad_ip_header")
    (total,) = _IPLEN.unpack_from(p, 2)
    if not (p[0] & 0xF) * 4 <= total <= len(p):
        raise InboundRefused("bad_ip_length", f"total length {total} in {len(p)} bytes")
    return p[:total]
