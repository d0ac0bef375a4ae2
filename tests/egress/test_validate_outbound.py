"""Outbound frame validation: frames from an independent encoder (dpkt), and one test per refusal reason."""

from __future__ import annotations

import struct
from collections.abc import Callable

import dpkt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.validate import MAX_GSO_SEGMENTS, FrameRefused, OutboundFrame, validate_outbound
from forwarder.egress.vnet import (
    GSO_ECN,
    GSO_NONE,
    GSO_TCPV4,
    GSO_TCPV6,
    GSO_UDP,
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
    push_vnet_hdr,
)
from sbxnet.errors import LocalProtocolError, RemoteProtocolError

CSUM = VIRTIO_NET_HDR_F_NEEDS_CSUM
SRC = bytes([10, 0, 0, 2])
DST = bytes([93, 184, 216, 34])


def tcp(payload: int = 100, opts: bytes = b"", flags: int = dpkt.tcp.TH_ACK | dpkt.tcp.TH_PUSH) -> bytes:
    seg = dpkt.tcp.TCP(sport=40000, dport=443, seq=1000, ack=5, flags=flags, opts=opts, data=b"a" * payload)
    seg.off = (20 + len(opts)) // 4
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=dpkt.ip.IP_PROTO_TCP, id=7, data=seg))


def udp(payload: int = 100, src: bytes = SRC, dst: bytes = DST) -> bytes:
    dg = dpkt.udp.UDP(sport=5353, dport=53, ulen=8 + payload, data=b"u" * payload)
    return bytes(dpkt.ip.IP(src=src, dst=dst, p=dpkt.ip.IP_PROTO_UDP, data=dg))


def icmp(payload: int = 56) -> bytes:
    echo = dpkt.icmp.ICMP.Echo(id=0x1234, seq=1, data=b"p" * payload)
    msg = dpkt.icmp.ICMP(type=dpkt.icmp.ICMP_ECHO, code=0, data=echo)
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=dpkt.ip.IP_PROTO_ICMP, data=msg))


def icmp_error(icmp_type: int, quoted: bytes) -> bytes:
    msg = dpkt.icmp.ICMP(type=icmp_type, code=3, data=dpkt.icmp.ICMP.Unreach(data=quoted))
    return bytes(dpkt.ip.IP(src=SRC, dst=DST, p=dpkt.ip.IP_PROTO_ICMP, data=msg))


def vnet(flags: int = 0, gso_type: int = GSO_NONE, hdr_len: int = 0, gso_size: int = 0, start: int = 0,
         off: int = 0) -> bytes:
    return push_vnet_hdr(VnetHdr(flags, gso_type, hdr_len, gso_size, start, off))


def refused(frame: bytes, mtu: int = 1500, offloads: int = HOST_OFFLOADS) -> str:
    with pytest.raises(FrameRefused) as exc:
        validate_outbound(frame, mtu, offloads)
    assert isinstance(exc.value, RemoteProtocolError)
    return exc.value.reason


def patch(pkt: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(pkt)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


# ---------------------------------------------------------------- accepted frames


def test_vnet_golden_and_round_trip() -> None:
    h = VnetHdr(1, GSO_TCPV4, 54, 1448, 20, 16)
    assert push_vnet_hdr(h) == bytes.fromhex("01 01 3600 a805 1400 1000")
    assert pull_vnet_hdr(push_vnet_hdr(h)) == h
    with pytest.raises(FrameRefused) as exc:
        pull_vnet_hdr(bytes(9))
    assert exc.value.reason == "short_header"
    with pytest.raises(LocalProtocolError):
        push_vnet_hdr(VnetHdr(256, 0, 0, 0, 0, 0))


def test_plain_frames_from_dpkt() -> None:
    assert validate_outbound(vnet() + tcp(100), 1500) == OutboundFrame(
        VnetHdr(0, 0, 0, 0, 0, 0), 6, 20, 20, 100, 1)
    assert validate_outbound(vnet() + udp(0), 1500).payload_len == 0
    f = validate_outbound(vnet() + icmp(56), 1500)
    assert (f.proto, f.l4_header_len, f.payload_len, f.segments) == (1, 8, 56, 1)
    f = validate_outbound(vnet() + tcp(10, opts=b"\x01" * 40), 1500)
    assert (f.l4_header_len, f.payload_len) == (60, 10)
    assert validate_outbound(vnet(CSUM, start=20, off=16) + tcp(1460), 1500).payload_len == 1460
    assert validate_outbound(vnet(CSUM, start=20, off=6) + udp(1472), 1500).payload_len == 1472
    assert validate_outbound(vnet(VIRTIO_NET_HDR_F_DATA_VALID) + udp(10), 1500).proto == 17
    # bytearray and memoryview inputs are the same frame
    frame = vnet() + tcp(3)
    assert validate_outbound(bytearray(frame), 1500) == validate_outbound(memoryview(frame), 1500)


def test_gso_frames_from_dpkt() -> None:
    f = validate_outbound(vnet(CSUM, GSO_TCPV4, 54, 1448, 20, 16) + tcp(65535 - 40), 1500)
    assert (f.segments, f.payload_len) == (46, 65495)
    f = validate_outbound(vnet(CSUM, GSO_TCPV4 | GSO_ECN, 54, 1000, 20, 16) + tcp(3000), 1500)
    assert f.segments == 3
    f = validate_outbound(vnet(CSUM, GSO_UDP_L4, 28, 1200, 20, 6) + udp(2401), 1500)
    assert f.segments == 3
    # a GSO frame smaller than one segment is one packet; an empty one too
    assert validate_outbound(vnet(CSUM, GSO_TCPV4, 0, 1448, 20, 16) + tcp(10), 1500).segments == 1
    assert validate_outbound(vnet(CSUM, GSO_TCPV4, 0, 1448, 20, 16) + tcp(0), 1500).segments == 1
    # exact bounds: a segment of exactly the MTU, exactly 128 segments
    assert validate_outbound(vnet(CSUM, GSO_TCPV4, 0, 1460, 20, 16) + tcp(2920), 1500).segments == 2
    f = validate_outbound(vnet(CSUM, GSO_UDP_L4, 0, 100, 20, 6) + udp(100 * MAX_GSO_SEGMENTS), 1500)
    assert f.segments == MAX_GSO_SEGMENTS
    # non-GSO packet of exactly the MTU
    assert validate_outbound(vnet() + udp(1472), 1500).segments == 1


def test_hdr_len_is_not_trusted() -> None:
    # any hdr_len up to the packet length is accepted and changes nothing about the result
    a = validate_outbound(vnet(CSUM, GSO_TCPV4, 0, 1448, 20, 16) + tcp(3000), 1500)
    b = validate_outbound(vnet(CSUM, GSO_TCPV4, 3040, 1448, 20, 16) + tcp(3000), 1500)
    c = validate_outbound(vnet(CSUM, GSO_TCPV4, 1, 1448, 20, 16) + tcp(3000), 1500)
    assert (a.l4_header_len, a.payload_len, a.segments) == (b.l4_header_len, b.payload_len, b.segments)
    assert (a.l4_header_len, a.payload_len, a.segments) == (c.l4_header_len, c.payload_len, c.segments)


# ---------------------------------------------------------------- one test per reason

GOOD_TCP = tcp(100)
# What an ICMP error quotes: the IPv4 header and 8 bytes of the packet that caused it, which came from
# the error's destination to the guest.
QUOTED = udp(10, src=DST, dst=SRC)[:28]
OTHER_CLAIM = bytes([100, 64, 10, 8])


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "short_header"),
        (bytes(9), "short_header"),
        (vnet() + GOOD_TCP[:19], "bad_ip_header"),
        (vnet() + patch(GOOD_TCP, 0, "!B", 0x65), "bad_ip_header"),  # version 6
        (vnet() + patch(GOOD_TCP, 0, "!B", 0x44), "bad_ip_header"),  # IHL 4
        (vnet() + patch(GOOD_TCP, 6, "!H", 0x8000), "bad_ip_header"),  # reserved fragment bit
        (vnet() + patch(GOOD_TCP, 0, "!B", 0x46), "ip_options"),
        (vnet() + patch(GOOD_TCP, 2, "!H", len(GOOD_TCP) - 1), "bad_ip_length"),
        (vnet() + patch(GOOD_TCP, 2, "!H", len(GOOD_TCP) + 1), "bad_ip_length"),
        (vnet() + GOOD_TCP + b"\x00", "bad_ip_length"),
        (vnet() + patch(GOOD_TCP, 6, "!H", 0x2000), "fragment"),  # MF
        (vnet() + patch(GOOD_TCP, 6, "!H", 0x0001), "fragment"),  # offset
        (vnet() + patch(GOOD_TCP, 6, "!H", 0x4000), None),  # DF alone is fine
        (vnet() + patch(GOOD_TCP, 9, "!B", 47), "unsupported_proto"),  # GRE
        (vnet() + patch(GOOD_TCP, 9, "!B", 58), "unsupported_proto"),
        (vnet() + patch(tcp(0)[:39], 2, "!H", 39), "bad_l4_header"),  # 19 bytes of TCP
        (vnet() + patch(GOOD_TCP, 32, "!B", 0x40), "bad_l4_header"),  # data offset 4
        (vnet() + patch(tcp(0), 32, "!B", 0x60), "bad_l4_header"),  # data offset past the end
        (vnet() + patch(udp(0)[:27], 2, "!H", 27), "bad_l4_header"),
        (vnet() + patch(udp(10), 24, "!H", 17), "bad_l4_header"),  # UDP length short
        (vnet() + patch(udp(10), 24, "!H", 19), "bad_l4_header"),  # UDP length long
        (vnet() + patch(icmp(0)[:27], 2, "!H", 27), "bad_l4_header"),
        (vnet() + icmp_error(3, QUOTED[:20]), None),  # an IPv4 header is enough to rewrite
        (vnet() + icmp_error(3, QUOTED[:19]), "bad_icmp_quote"),
        (vnet() + icmp_error(11, b""), "bad_icmp_quote"),
        (vnet() + icmp_error(12, b"\x60" + QUOTED[1:]), "bad_icmp_quote"),  # quotes IPv6
        (vnet() + icmp_error(3, b"\x44" + QUOTED[1:]), "bad_icmp_quote"),  # quoted IHL 4
        # the quoted source must be the error's destination: not another claim, not the guest's own packet
        (vnet() + icmp_error(3, udp(10, src=OTHER_CLAIM, dst=SRC)[:28]), "icmp_quote_source"),
        (vnet() + icmp_error(11, udp(10)[:28]), "icmp_quote_source"),
        (vnet() + icmp_error(12, patch(QUOTED, 15, "!B", DST[3] ^ 1)), "icmp_quote_source"),
        (vnet() + patch(icmp_error(3, b"")[:27], 2, "!H", 27), "bad_l4_header"),  # not even 8 bytes
        (vnet(0x04) + GOOD_TCP, "bad_vnet_flags"),
        (vnet(0x80) + GOOD_TCP, "bad_vnet_flags"),
        (vnet(hdr_len=len(GOOD_TCP) + 1) + GOOD_TCP, "bad_hdr_len"),
        (vnet(CSUM, start=20, off=2) + icmp(), "icmp_csum"),
        (vnet(CSUM, start=0, off=16) + GOOD_TCP, "bad_csum_start"),  # aimed at the IPv4 destination
        (vnet(CSUM, start=0, off=10) + GOOD_TCP, "bad_csum_start"),  # at the IPv4 header checksum
        (vnet(CSUM, start=12, off=4) + GOOD_TCP, "bad_csum_start"),  # at the IPv4 destination
        (vnet(CSUM, start=40, off=16) + GOOD_TCP, "bad_csum_start"),
        (vnet(start=20) + GOOD_TCP, "bad_csum_start"),  # set without NEEDS_CSUM
        (vnet(CSUM, start=20, off=6) + GOOD_TCP, "bad_csum_offset"),  # UDP's offset on TCP
        (vnet(CSUM, start=20, off=16) + udp(), "bad_csum_offset"),  # TCP's offset on UDP
        (vnet(CSUM, start=20, off=0xFFFF) + udp(), "bad_csum_offset"),
        (vnet(off=16) + GOOD_TCP, "bad_csum_offset"),
        (vnet(gso_type=GSO_ECN) + GOOD_TCP, "bad_gso_type"),
        (vnet(CSUM, GSO_UDP, 0, 1000, 20, 6) + udp(3000), "bad_gso_type"),  # UFO
        (vnet(CSUM, GSO_TCPV6, 0, 1000, 20, 16) + tcp(3000), "bad_gso_type"),
        (vnet(CSUM, 2, 0, 1000, 20, 16) + tcp(3000), "bad_gso_type"),
        (vnet(CSUM, 0x7F, 0, 1000, 20, 16) + tcp(3000), "bad_gso_type"),
        (vnet(CSUM, GSO_UDP_L4 | GSO_ECN, 0, 1000, 20, 6) + udp(3000), "bad_gso_type"),
        (vnet(CSUM, GSO_TCPV4, 0, 1000, 20, 6) + udp(3000), "gso_proto_mismatch"),  # TCP GSO on UDP
        (vnet(CSUM, GSO_UDP_L4, 0, 1000, 20, 16) + tcp(3000), "gso_proto_mismatch"),
        (vnet(0, GSO_TCPV4, 0, 1000, 0, 0) + icmp(3000), "gso_proto_mismatch"),
        (vnet(0, GSO_TCPV4, 0, 1000, 0, 0) + tcp(3000), "gso_needs_csum"),
        (vnet(0, GSO_UDP_L4, 0, 1000, 0, 0) + udp(3000), "gso_needs_csum"),
        (vnet(CSUM, GSO_TCPV4, 0, 0, 20, 16) + tcp(3000), "zero_gso_size"),
        (vnet(gso_size=100) + GOOD_TCP, "bad_gso_size"),
        (vnet() + tcp(1461), "size"),  # non-GSO over the MTU
        (vnet(CSUM, start=20, off=6) + udp(1473), "size"),
        (vnet(CSUM, GSO_TCPV4, 0, 1461, 20, 16) + tcp(3000), "size"),  # segment over the MTU
        (vnet(CSUM, GSO_TCPV4, 0, 1421, 20, 16) + tcp(3000, opts=b"\x01" * 40), "size"),
        (vnet(CSUM, GSO_UDP_L4, 0, 100, 20, 6) + udp(100 * MAX_GSO_SEGMENTS + 1), "size"),  # 129 segments
        (vnet(CSUM, GSO_TCPV4, 0, 1, 20, 16) + tcp(129), "size"),
        (vnet() + bytes([0x45]) + bytes(65535), "size"),  # longer than any IPv4 packet
    ],
)
def test_refusal_reasons(frame: bytes, reason: str | None) -> None:
    if reason is None:
        validate_outbound(frame, 1500)
    else:
        assert refused(frame) == reason


@pytest.mark.parametrize(
    ("frame", "offloads"),
    [
        (vnet(CSUM, start=20, off=16) + GOOD_TCP, 0),
        (vnet(CSUM, GSO_TCPV4, 0, 1000, 20, 16) + tcp(3000), TUN_F_CSUM | TUN_F_USO4),
        (vnet(CSUM, GSO_TCPV4 | GSO_ECN, 0, 1000, 20, 16) + tcp(3000), TUN_F_CSUM | TUN_F_TSO4),
        (vnet(CSUM, GSO_UDP_L4, 0, 1000, 20, 6) + udp(3000), TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO_ECN),
    ],
)
def test_offload_not_negotiated(frame: bytes, offloads: int) -> None:
    assert refused(frame, offloads=offloads) == "offload_not_negotiated"
    validate_outbound(frame, 1500)  # fine once negotiated


@pytest.mark.parametrize("mtu", [0, 67, 65536])
def test_mtu_is_our_parameter(mtu: int) -> None:
    with pytest.raises(LocalProtocolError):
        validate_outbound(vnet() + GOOD_TCP, mtu)


# ---------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_parse_or_refuse(data: bytes) -> None:
    try:
        f = validate_outbound(data, 1500)
    except FrameRefused:
        return
    assert f.l4_offset == 20
    assert 20 + f.l4_header_len + f.payload_len == len(data) - VNET_HDR_LEN


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["tcp", "udp", "icmp"]), st.integers(0, 4000),
    st.integers(0, 3), st.integers(0, 0xFF), st.integers(0, 3000), st.integers(0, 64), st.integers(0, 64),
    st.integers(576, 9000),
)
def test_accepted_frames_keep_the_invariants(kind: str, payload: int, flags: int, gso_type: int,
                                             gso_size: int, start: int, off: int, mtu: int) -> None:
    build: dict[str, Callable[[int], bytes]] = {"tcp": tcp, "udp": udp, "icmp": icmp}
    pkt = build[kind](payload)
    frame = vnet(flags, gso_type, 0, gso_size, start, off) + pkt
    try:
        f = validate_outbound(frame, mtu)
    except FrameRefused as exc:
        assert exc.reason
        return
    if f.hdr.flags & CSUM:
        # the checksum write lands on the L4 checksum field, past the IPv4 header
        assert f.hdr.csum_start == 20
        assert f.hdr.csum_offset == {6: 16, 17: 6}[f.proto]
    if f.hdr.gso_type == GSO_NONE:
        assert len(pkt) <= mtu and f.segments == 1
    else:
        assert 20 + f.l4_header_len + f.hdr.gso_size <= mtu
        assert 1 <= f.segments <= MAX_GSO_SEGMENTS
        assert f.segments == max(1, -(-f.payload_len // f.hdr.gso_size))
