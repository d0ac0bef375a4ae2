"""ARP: golden bytes, dpkt as the independent parser and builder, answers only for armed claims."""

from __future__ import annotations

from ipaddress import IPv4Address

import dpkt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.arp import (
    ARPOP_REPLY,
    ARPOP_REQUEST,
    ZERO_MAC,
    ArpPacket,
    arp_reply,
    gratuitous_arp,
    pull_arp,
    push_arp,
)
from forwarder.egress.errors import InboundRefused
from forwarder.egress.vxlan import BROADCAST_MAC, ETH_P_ARP, pull_ethernet
from sbxnet.errors import LocalProtocolError

ROUTER_MAC = bytes.fromhex("02005e000001")
EXIT_MAC = bytes.fromhex("0200c0ffee01")
CLAIM = int(IPv4Address("100.64.1.2"))
OTHER = int(IPv4Address("100.64.1.3"))
GW = int(IPv4Address("100.64.0.1"))


def request(tpa: int, sha: bytes = EXIT_MAC, spa: int = GW) -> bytes:
    """An ARP request built by dpkt, Ethernet header included, padded to 60 bytes like a NIC would."""
    arp = dpkt.arp.ARP(op=dpkt.arp.ARP_OP_REQUEST, sha=sha, spa=spa.to_bytes(4, "big"), tha=ZERO_MAC,
                       tpa=tpa.to_bytes(4, "big"))
    frame = bytes(dpkt.ethernet.Ethernet(dst=BROADCAST_MAC, src=sha, type=ETH_P_ARP, data=arp))
    return frame + bytes(60 - len(frame))


def test_arp_golden() -> None:
    p = ArpPacket(ARPOP_REPLY, ROUTER_MAC, CLAIM, EXIT_MAC, GW)
    wire = bytes.fromhex("0001 0800 06 04 0002") + ROUTER_MAC + bytes([100, 64, 1, 2]) + EXIT_MAC + \
        bytes([100, 64, 0, 1])
    assert push_arp(p) == wire
    assert pull_arp(wire) == p
    assert pull_arp(wire + bytes(18)) == p  # Ethernet padding ignored
    assert str(p) == "op 2 100.64.1.2 02:00:5e:00:00:01 -> 100.64.0.1"


def test_reply_only_for_armed_claims() -> None:
    req = pull_arp(request(CLAIM)[14:])
    assert req.op == ARPOP_REQUEST
    frame = arp_reply(req, {CLAIM}, ROUTER_MAC)
    assert frame is not None
    eth = dpkt.ethernet.Ethernet(frame)
    assert eth.dst == EXIT_MAC and eth.src == ROUTER_MAC and eth.type == ETH_P_ARP
    a = eth.data
    assert isinstance(a, dpkt.arp.ARP)
    assert a.op == dpkt.arp.ARP_OP_REPLY and a.sha == ROUTER_MAC and a.spa == CLAIM.to_bytes(4, "big")
    assert a.tha == EXIT_MAC and a.tpa == GW.to_bytes(4, "big")
    assert arp_reply(pull_arp(request(OTHER)[14:]), {CLAIM}, ROUTER_MAC) is None  # not ours / not armed
    assert arp_reply(pull_arp(request(CLAIM)[14:]), set(), ROUTER_MAC) is None
    # replies, broadcast or zero sender MACs and gratuitous requests get no answer
    assert arp_reply(ArpPacket(ARPOP_REPLY, EXIT_MAC, GW, ROUTER_MAC, CLAIM), {CLAIM}, ROUTER_MAC) is None
    assert arp_reply(pull_arp(request(CLAIM, sha=BROADCAST_MAC)[14:]), {CLAIM}, ROUTER_MAC) is None
    assert arp_reply(pull_arp(request(CLAIM, sha=ZERO_MAC)[14:]), {CLAIM}, ROUTER_MAC) is None
    assert arp_reply(pull_arp(request(CLAIM, spa=CLAIM)[14:]), {CLAIM}, ROUTER_MAC) is None


def test_gratuitous_parses_in_dpkt() -> None:
    frame = gratuitous_arp(CLAIM, ROUTER_MAC)
    eth = dpkt.ethernet.Ethernet(frame)
    assert eth.dst == BROADCAST_MAC and eth.src == ROUTER_MAC
    a = eth.data
    assert isinstance(a, dpkt.arp.ARP)
    assert (a.hrd, a.pro, a.hln, a.pln, a.op) == (1, 0x0800, 6, 4, dpkt.arp.ARP_OP_REQUEST)
    assert a.spa == a.tpa == CLAIM.to_bytes(4, "big") and a.sha == ROUTER_MAC and a.tha == ZERO_MAC
    assert pull_ethernet(frame).ethertype == ETH_P_ARP
    for bad in (BROADCAST_MAC, ZERO_MAC, b"\x01" + ROUTER_MAC[1:]):
        with pytest.raises(LocalProtocolError):
            gratuitous_arp(CLAIM, bad)


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (request(CLAIM)[14:41], "short_arp"),
        (b"\x00\x06" + request(CLAIM)[16:], "arp_not_ipv4"),  # IEEE 802 htype
        (request(CLAIM)[14:16] + b"\x86\xdd" + request(CLAIM)[18:], "arp_not_ipv4"),
        (request(CLAIM)[14:18] + b"\x08" + request(CLAIM)[19:], "arp_not_ipv4"),
        (request(CLAIM)[14:19] + b"\x10" + request(CLAIM)[20:], "arp_not_ipv4"),
        (request(CLAIM)[14:20] + b"\x00\x03" + request(CLAIM)[22:], "bad_arp_op"),  # RARP
        (request(CLAIM)[14:20] + b"\x00\x00" + request(CLAIM)[22:], "bad_arp_op"),
    ],
)
def test_arp_refused(wire: bytes, reason: str) -> None:
    with pytest.raises(InboundRefused) as exc:
        pull_arp(wire)
    assert exc.value.reason == reason


def test_push_arp_refuses_bad_fields() -> None:
    for p in (ArpPacket(3, ROUTER_MAC, 1, EXIT_MAC, 2), ArpPacket(1, ROUTER_MAC[:5], 1, EXIT_MAC, 2),
              ArpPacket(1, ROUTER_MAC, 1 << 32, EXIT_MAC, 2)):
        with pytest.raises(LocalProtocolError):
            push_arp(p)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_pull_arp_any_bytes(data: bytes) -> None:
    try:
        p = pull_arp(data)
    except InboundRefused:
        return
    assert push_arp(p) == data[:28]
    arp_reply(p, {p.tpa}, ROUTER_MAC)
