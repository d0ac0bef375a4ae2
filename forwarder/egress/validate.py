"""Judge one outbound guest frame (virtio_net_hdr + IPv4 packet) before any other work touches it.

Everything in the frame is the guest's word and is checked against the packet itself: a header that
does not fit its packet is refused with a named reason (``FrameRefused.reason``), never an IndexError.
The checks run in this order, so a frame with several faults always gets the same reason:

1. ``short_header`` fewer than 10 bytes of virtio_net_hdr; ``bad_ip_header`` fewer than 20 bytes of
   IPv4, version not 4, IHL under 5, or the reserved ("evil") fragment bit set; ``size`` a packet over
   65535 bytes; ``ip_options`` IHL over 5; ``bad_ip_length`` total length differs from the packet's
   length; ``fragment`` MF set or a fragment offset.
2. ``unsupported_proto`` anything but TCP (6), UDP (17), ICMP (1); ``bad_l4_header`` the L4 header
   does not fit (TCP data offset under 5 or past the end; UDP length field not the packet's UDP length;
   ICMP under 8 bytes); ``bad_icmp_quote`` an ICMP error (3, 11, 12) that does not quote at least an
   IPv4 header's 20 bytes (version 4, IHL >= 5): the rewrite puts the claim address in that quote;
   ``icmp_quote_source`` an ICMP error whose quoted source is not its own destination (a genuine error
   goes back to the sender of the packet it quotes).
3. ``bad_vnet_flags`` flag bits other than NEEDS_CSUM/DATA_VALID; ``bad_hdr_len`` hdr_len larger than
   the packet (it is otherwise ignored: the header length is recomputed from the packet).
4. Checksum request: ``icmp_csum`` ICMP with NEEDS_CSUM; ``offload_not_negotiated`` NEEDS_CSUM without
   TUN_F_CSUM; ``bad_csum_start`` not 20 (or not 0 when no checksum is requested); ``bad_csum_offset``
   not 16 for TCP / 6 for UDP (or not 0 when none is requested). The checksum write can therefore only
   ever land on the L4 checksum field, never on the IPv4 header the policy judged.
5. GSO: ``bad_gso_type`` unknown type, UFO (3), TCPV6 (4), or the ECN bit on anything but TCPV4;
   ``gso_proto_mismatch`` TCPV4 on a non-TCP packet or UDP_L4 on a non-UDP packet;
   ``offload_not_negotiated`` a GSO type (or ECN) the stream did not negotiate; ``gso_needs_csum`` GSO
   without NEEDS_CSUM; ``zero_gso_size`` gso_size 0 with GSO; ``bad_gso_size`` gso_size set without GSO.
6. ``size`` a non-GSO packet over the MTU, a GSO segment over the MTU (20 + L4 header + gso_size > mtu),
   or a GSO frame that would become more than 128 wire packets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from forwarder.egress.errors import FrameRefused
from forwarder.egress.vnet import (
    GSO_ECN,
    GSO_NONE,
    GSO_TCPV4,
    GSO_UDP_L4,
    HOST_OFFLOADS,
    TUN_F_CSUM,
    TUN_F_TSO4,
    TUN_F_TSO_ECN,
    TUN_F_USO4,
    VIRTIO_NET_HDR_F_DATA_VALID,
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VNET_HDR_LEN,
    VnetHdr,
    pull_vnet_hdr,
)
from sbxnet.errors import LocalProtocolError

__all__ = ["MAX_GSO_SEGMENTS", "FrameRefused", "OutboundFrame", "validate_outbound"]

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17

IPV4_HDR_LEN = 20
MAX_IP_PACKET = 65535
MAX_GSO_SEGMENTS = 128
MIN_MTU = 68

# Destination unreachable, time exceeded, parameter problem: they quote the packet that caused them.
ICMP_ERROR_TYPES = frozenset({3, 11, 12})

TCP_CSUM_OFFSET = 16
UDP_CSUM_OFFSET = 6

_KNOWN_VNET_FLAGS = VIRTIO_NET_HDR_F_NEEDS_CSUM | VIRTIO_NET_HDR_F_DATA_VALID
_IP_RF = 0x8000
_IP_MF = 0x2000
_IP_OFFSET = 0x1FFF

# version/IHL, total length, flags+fragment offset, protocol
_IP = struct.Struct("!BxHxxHxB")
_U16 = struct.Struct("!H")


@dataclass(frozen=True, slots=True)
class OutboundFrame:
    """What validation learnt about a frame; every offset here is derived from the packet, not the guest."""

    hdr: VnetHdr
    proto: int  # 6 TCP, 17 UDP, 1 ICMP
    l4_offset: int  # always 20: IPv4 options are refused
    l4_header_len: int  # TCP data offset * 4 (20..60), 8 for UDP and ICMP
    payload_len: int  # L4 payload bytes
    segments: int  # wire packets this frame becomes (1 if not GSO)


def validate_outbound(
    frame: bytes | bytearray | memoryview, mtu: int, offloads: int = HOST_OFFLOADS
) -> OutboundFrame:
    """Validate ``frame`` (10-byte virtio_net_hdr followed by one IPv4 packet) from a guest.

    ``mtu`` is the stream's negotiated MTU; ``offloads`` the negotiated TUN_F_* bits (default: all this
    host implements). Returns the frame's shape on success; raises ``FrameRefused`` with one of the
    reasons in the module docstring otherwise. Nothing else escapes for any input bytes. The IPv4
    header checksum is not verified here: the rewrite updates it incrementally, so a wrong one stays
    wrong and the exit's kernel drops the packet.
    """
    if not MIN_MTU <= mtu <= MAX_IP_PACKET:
        raise LocalProtocolError("mtu", f"{mtu} outside {MIN_MTU}..{MAX_IP_PACKET}")
    hdr = pull_vnet_hdr(frame)
    n = len(frame) - VNET_HDR_LEN
    if n < IPV4_HDR_LEN:
        raise FrameRefused("bad_ip_header", f"{n} bytes of IPv4")
    if n > MAX_IP_PACKET:
        raise FrameRefused("size", f"{n} byte packet")
    ver_ihl, total_len, frag, proto = _IP.unpack_from(frame, VNET_HDR_LEN)
    if ver_ihl >> 4 != 4 or ver_ihl & 0xF < 5:
        raise FrameRefused("bad_ip_header", f"version/IHL byte {ver_ihl:#04x}")
    if ver_ihl & 0xF != 5:
        raise FrameRefused("ip_options")
    if total_len != n:
        raise FrameRefused("bad_ip_length", f"total length {total_len}, packet {n}")
    if frag & _IP_RF:
        raise FrameRefused("bad_ip_header", "reserved fragment bit")
    if frag & (_IP_MF | _IP_OFFSET):
        raise FrameRefused("fragment")

    l4 = VNET_HDR_LEN + IPV4_HDR_LEN
    l4_len = n - IPV4_HDR_LEN
    if proto == PROTO_TCP:
        if l4_len < 20:
            raise FrameRefused("bad_l4_header", f"{l4_len} bytes of TCP")
        l4_header_len = (frame[l4 + 12] >> 4) * 4
        if l4_header_len < 20 or l4_header_len > l4_len:
            raise FrameRefused("bad_l4_header", f"TCP data offset {l4_header_len} in {l4_len} bytes")
        csum_offset = TCP_CSUM_OFFSET
    elif proto == PROTO_UDP:
        if l4_len < 8:
            raise FrameRefused("bad_l4_header", f"{l4_len} bytes of UDP")
        (udp_len,) = _U16.unpack_from(frame, l4 + 4)
        if udp_len != l4_len:
            raise FrameRefused("bad_l4_header", f"UDP length {udp_len}, datagram {l4_len}")
        l4_header_len = 8
        csum_offset = UDP_CSUM_OFFSET
    elif proto == PROTO_ICMP:
        if l4_len < 8:
            raise FrameRefused("bad_l4_header", f"{l4_len} bytes of ICMP")
        if frame[l4] in ICMP_ERROR_TYPES:
            # the quoted destination (the guest's address) becomes the claim address: it must be there
            if l4_len < 8 + IPV4_HDR_LEN:
                raise FrameRefused("bad_icmp_quote", f"{l4_len - 8} quoted bytes")
            quoted = frame[l4 + 8]
            if quoted >> 4 != 4 or quoted & 0xF < 5:
                raise FrameRefused("bad_icmp_quote", f"quoted version/IHL byte {quoted:#04x}")
            # A genuine error goes back to the sender of what it quotes; any other quoted source (another
            # claim's overlay address, say) would leave unchanged, since only the quoted destination is
            # rewritten.
            if frame[l4 + 20 : l4 + 24] != frame[VNET_HDR_LEN + 16 : VNET_HDR_LEN + 20]:
                raise FrameRefused("icmp_quote_source", "quoted source is not the destination")
        l4_header_len = 8
        csum_offset = -1
    else:
        raise FrameRefused("unsupported_proto", f"protocol {proto}")
    payload_len = l4_len - l4_header_len

    if hdr.flags & ~_KNOWN_VNET_FLAGS:
        raise FrameRefused("bad_vnet_flags", f"flags {hdr.flags:#04x}")
    if hdr.hdr_len > n:
        raise FrameRefused("bad_hdr_len", f"hdr_len {hdr.hdr_len} in a {n} byte packet")

    needs_csum = hdr.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM
    if needs_csum:
        if proto == PROTO_ICMP:
            raise FrameRefused("icmp_csum")
        if not offloads & TUN_F_CSUM:
            raise FrameRefused("offload_not_negotiated", "checksum offload")
        if hdr.csum_start != IPV4_HDR_LEN:
            raise FrameRefused("bad_csum_start", f"csum_start {hdr.csum_start}")
        if hdr.csum_offset != csum_offset:
            raise FrameRefused("bad_csum_offset", f"csum_offset {hdr.csum_offset}")
    else:
        if hdr.csum_start:
            raise FrameRefused("bad_csum_start", f"csum_start {hdr.csum_start} without NEEDS_CSUM")
        if hdr.csum_offset:
            raise FrameRefused("bad_csum_offset", f"csum_offset {hdr.csum_offset} without NEEDS_CSUM")

    gso = hdr.gso_type & ~GSO_ECN
    ecn = hdr.gso_type & GSO_ECN
    if gso == GSO_NONE:
        if ecn:
            raise FrameRefused("bad_gso_type", "ECN bit without GSO")
        if hdr.gso_size:
            raise FrameRefused("bad_gso_size", f"gso_size {hdr.gso_size} without GSO")
        if n > mtu:
            raise FrameRefused("size", f"{n} byte packet over MTU {mtu}")
        return OutboundFrame(hdr, proto, IPV4_HDR_LEN, l4_header_len, payload_len, 1)

    if gso == GSO_TCPV4:
        if proto != PROTO_TCP:
            raise FrameRefused("gso_proto_mismatch", f"TCPV4 GSO on protocol {proto}")
        if not offloads & TUN_F_TSO4:
            raise FrameRefused("offload_not_negotiated", "TSO4")
        if ecn and not offloads & TUN_F_TSO_ECN:
            raise FrameRefused("offload_not_negotiated", "TSO_ECN")
    elif gso == GSO_UDP_L4:
        if proto != PROTO_UDP:
            raise FrameRefused("gso_proto_mismatch", f"UDP_L4 GSO on protocol {proto}")
        if ecn:
            raise FrameRefused("bad_gso_type", "ECN bit on UDP_L4")
        if not offloads & TUN_F_USO4:
            raise FrameRefused("offload_not_negotiated", "USO4")
    else:
        raise FrameRefused("bad_gso_type", f"gso_type {hdr.gso_type:#04x}")
    if not needs_csum:
        raise FrameRefused("gso_needs_csum")
    if hdr.gso_size == 0:
        raise FrameRefused("zero_gso_size")
    if IPV4_HDR_LEN + l4_header_len + hdr.gso_size > mtu:
        raise FrameRefused("size", f"segment of {IPV4_HDR_LEN + l4_header_len + hdr.gso_size} over MTU {mtu}")
    segments = max(1, -(-payload_len // hdr.gso_size))
    if segments > MAX_GSO_SEGMENTS:
        raise FrameRefused("size", f"{segments} segments")
    return OutboundFrame(hdr, proto, IPV4_HDR_LEN, l4_header_len, payload_len, segments)
