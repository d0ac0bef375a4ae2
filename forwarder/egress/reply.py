"""What an inbound delivery frame is to the claim's flows: the outbound key it answers, and its wire size.

The exits' packets reach a guest only as part of a flow the claim has (docs/egress.md, "Resume"); the
flow table is keyed the outbound way (``flows.flow_key``: source = the claim), so an inbound packet is
looked up by the key of the packet it answers. The frame is a delivery frame of ``InboundBatch``
(``u32 len | virtio_net_hdr | IPv4``), which the C core has checked for version, IHL and total length;
everything past the IPv4 header is still the far side's word and is checked here before it is read.

``pull_reply(frame)`` gives a ``Reply`` or raises ``InboundRefused`` with ``bad_reply`` (too short for
its key, a quote that does not fit, a quote whose source is not the claim, a protocol or ICMP type that
answers no flow).

- TCP, UDP: the ports swapped. ``resumable`` for a TCP segment with neither SYN nor RST: a segment of
  a stream that predates an arm (a restart, a move) reopens its flow; a SYN from outside opens nothing
  (the claim only ever dials out) and a reset would only reopen a flow to end it.
- ICMP query messages: the identifier, as ``flow_key`` takes it.
- ICMP errors (destination unreachable, source quench, redirect, time exceeded, parameter problem):
  the key of the quoted packet, which the claim sent (its quoted source must be the claim), so
  fragmentation-needed and port-unreachable reach the socket whose packet caused them.

``wire_size(frame)`` is what the frame was on the wire (IPv4 bytes, packets): a TCP frame the core
merged (``gso_type`` TCPV4, ``gso_size`` the segment payload) counts each segment's own headers.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from forwarder.egress.errors import InboundRefused
from forwarder.egress.flows import ICMP_QUERY_TYPES, FlowKey
from forwarder.egress.validate import PROTO_ICMP, PROTO_TCP, PROTO_UDP
from forwarder.egress.vnet import GSO_TCPV4, VNET_HDR_LEN

IP_OFF = 4 + VNET_HDR_LEN  # the IPv4 packet inside a delivery frame
ICMP_ERROR_TYPES = frozenset({3, 4, 5, 11, 12})
TCP_SYN, TCP_RST = 0x02, 0x04

_ADDRS = struct.Struct("!II")
_PORTS = struct.Struct("!HH")
_U16 = struct.Struct("!H")
_VNET = struct.Struct("<xBxxH")  # gso_type, gso_size


class Reply(NamedTuple):
    key: FlowKey  # the outbound flow this packet answers
    resumable: bool  # a TCP segment that may reopen its flow (neither SYN nor RST)


def _ip(buf: bytes | bytearray | memoryview, off: int, end: int) -> tuple[int, int, int, int]:
    """(proto, src, dst, L4 offset) of the IPv4 header at ``off``; ``bad_reply`` if it does not fit."""
    if end - off < 20 or buf[off] >> 4 != 4:
        raise InboundRefused("bad_reply", "no IPv4 header")
    ihl = (buf[off] & 15) * 4
    if ihl < 20 or end - off < ihl:
        raise InboundRefused("bad_reply", f"IHL {ihl}")
    src, dst = _ADDRS.unpack_from(buf, off + 12)
    return buf[off + 9], src, dst, off + ihl


def pull_reply(frame: bytes | bytearray | memoryview) -> Reply:
    end = len(frame)
    proto, src, dst, l4 = _ip(frame, IP_OFF, end)
    if proto in (PROTO_TCP, PROTO_UDP):
        if end - l4 < (14 if proto == PROTO_TCP else 4):
            raise InboundRefused("bad_reply", "too short for ports")
        sport, dport = _PORTS.unpack_from(frame, l4)
        resumable = proto == PROTO_TCP and not frame[l4 + 13] & (TCP_SYN | TCP_RST)
        return Reply(FlowKey(proto, dst, dport, src, sport), resumable)
    if proto != PROTO_ICMP:
        raise InboundRefused("bad_reply", f"protocol {proto}")
    if end - l4 < 8:
        raise InboundRefused("bad_reply", "too short for ICMP")
    kind = frame[l4]
    if kind in ICMP_QUERY_TYPES:
        return Reply(FlowKey(PROTO_ICMP, dst, _U16.unpack_from(frame, l4 + 4)[0], src, 0), False)
    if kind not in ICMP_ERROR_TYPES:
        raise InboundRefused("bad_reply", f"ICMP type {kind}")
    qproto, qsrc, qdst, ql4 = _ip(frame, l4 + 8, end)
    if qsrc != dst:
        raise InboundRefused("bad_reply", "the quoted packet is not the claim's")
    if qproto in (PROTO_TCP, PROTO_UDP):
        if end - ql4 < 4:
            raise InboundRefused("bad_reply", "quote too short for ports")
        qsport, qdport = _PORTS.unpack_from(frame, ql4)
        return Reply(FlowKey(qproto, qsrc, qsport, qdst, qdport), False)
    if qproto == PROTO_ICMP:
        if end - ql4 < 8:
            raise InboundRefused("bad_reply", "quote too short for ICMP")
        if frame[ql4] in ICMP_QUERY_TYPES:
            return Reply(FlowKey(PROTO_ICMP, qsrc, _U16.unpack_from(frame, ql4 + 4)[0], qdst, 0), False)
        return Reply(FlowKey(PROTO_ICMP, qsrc, 0, qdst, 0), False)
    raise InboundRefused("bad_reply", f"quoted protocol {qproto}")


def wire_size(frame: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(IPv4 bytes, packets) the frame was on the wire. For a merged TCP frame each segment carried
    its own IPv4 and TCP headers; anything that does not parse as one counts as one packet."""
    end = len(frame)
    if end < IP_OFF + 20:
        return max(0, end - IP_OFF), 1
    total = _U16.unpack_from(frame, IP_OFF + 2)[0]
    gso_type, gso_size = _VNET.unpack_from(frame, 4)
    if gso_type & 0x7F != GSO_TCPV4 or gso_size == 0:
        return total, 1
    hdr = (frame[IP_OFF] & 15) * 4
    l4 = IP_OFF + hdr
    if end - l4 < 13:
        return total, 1
    hdr += (frame[l4 + 12] >> 4) * 4
    payload = total - hdr
    if payload <= gso_size:
        return total, 1
    packets = -(-payload // gso_size)
    return payload + packets * hdr, packets
