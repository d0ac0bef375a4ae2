"""VXLAN and Ethernet: golden bytes, dpkt as the independent parser, decap refusals."""

from __future__ import annotations

from collections.abc import Hashable

import dpkt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.errors import InboundRefused
from forwarder.egress.vxlan import (
    BROADCAST_MAC,
    ETH_P_ARP,
    ETH_P_IP,
    EthernetHdr,
    decap,
    encap,
    inner_ipv4,
    pull_ethernet,
    pull_vxlan,
    push_ethernet,
    push_vxlan,
)
from sbxnet.errors import LocalProtocolError

ROUTER_MAC = bytes.fromhex("02005e000001")
EXIT_MAC = bytes.fromhex("0200c0ffee01")
VTEPS = {"192.0.2.10", "192.0.2.11"}


def ip_packet(payload: bytes = b"hello") -> bytes:
    dg = dpkt.udp.UDP(sport=53, dport=5353, ulen=8 + len(payload), data=payload)
    return bytes(dpkt.ip.IP(src=bytes([8, 8, 8, 8]), dst=bytes([100, 64, 1, 2]), p=17, data=dg))


def test_vxlan_golden() -> None:
    assert push_vxlan(42) == bytes.fromhex("08000000 00002a00")
    assert push_vxlan(0xFFFFFF) == bytes.fromhex("08000000 ffffff00")
    assert pull_vxlan(bytes.fromhex("08000000 00002a00")) == 42
    for bad in (-1, 1 << 24):
        with pytest.raises(LocalProtocolError):
            push_vxlan(bad)


def test_ethernet_golden() -> None:
    assert push_ethernet(EXIT_MAC, ROUTER_MAC, ETH_P_IP) == EXIT_MAC + ROUTER_MAC + b"\x08\x00"
    assert pull_ethernet(EXIT_MAC + ROUTER_MAC + b"\x08\x06") == EthernetHdr(EXIT_MAC, ROUTER_MAC, ETH_P_ARP)
    with pytest.raises(LocalProtocolError):
        push_ethernet(EXIT_MAC[:5], ROUTER_MAC, ETH_P_IP)
    with pytest.raises(LocalProtocolError):
        push_ethernet(EXIT_MAC, ROUTER_MAC, 0x86DD)


def test_encap_parses_in_dpkt() -> None:
    pkt = ip_packet()
    payload = encap(7, EXIT_MAC, ROUTER_MAC, ETH_P_IP, pkt)
    # the whole outer datagram, as the kernel would put it on the wire, parses in dpkt
    outer = dpkt.ip.IP(src=bytes([192, 0, 2, 1]), dst=bytes([192, 0, 2, 10]), p=17,
                       data=dpkt.udp.UDP(sport=40000, dport=4789, ulen=8 + len(payload), data=payload))
    again = dpkt.ip.IP(bytes(outer))
    assert again.data.dport == 4789
    vx = again.data.data
    assert vx[0] == 0x08 and int.from_bytes(vx[4:7], "big") == 7
    eth = dpkt.ethernet.Ethernet(vx[8:])
    assert eth.dst == EXIT_MAC and eth.src == ROUTER_MAC and eth.type == ETH_P_IP
    assert isinstance(eth.data, dpkt.ip.IP) and bytes(eth.data) == pkt
    assert eth.data.data.data == b"hello"


def test_decap_frames_built_by_dpkt() -> None:
    pkt = ip_packet(b"x")  # 29 bytes: an Ethernet sender would pad it
    eth = bytes(dpkt.ethernet.Ethernet(dst=ROUTER_MAC, src=EXIT_MAC, type=ETH_P_IP, data=pkt)) + bytes(17)
    inb = decap(push_vxlan(7) + eth, "192.0.2.10", VTEPS, vni=7, local_mac=ROUTER_MAC)
    assert (inb.vni, inb.eth.src, inb.eth.ethertype) == (7, EXIT_MAC, ETH_P_IP)
    assert bytes(inner_ipv4(inb)) == pkt  # padding trimmed
    arp = bytes(dpkt.ethernet.Ethernet(dst=BROADCAST_MAC, src=EXIT_MAC, type=ETH_P_ARP,
                                       data=dpkt.arp.ARP()))
    assert decap(push_vxlan(7) + arp, "192.0.2.11", VTEPS, local_mac=ROUTER_MAC).eth.ethertype == ETH_P_ARP


def _eth(ethertype: int = ETH_P_IP, dst: bytes = ROUTER_MAC) -> bytes:
    return dst + EXIT_MAC + ethertype.to_bytes(2, "big")


@pytest.mark.parametrize(
    ("src", "datagram", "reason"),
    [
        ("192.0.2.99", push_vxlan(7) + _eth() + ip_packet(), "unknown_vtep"),
        (("192.0.2.10", 4789), push_vxlan(7) + _eth() + ip_packet(), "unknown_vtep"),
        ("192.0.2.10", push_vxlan(7)[:7], "short_vxlan"),
        ("192.0.2.10", b"\x00" + push_vxlan(7)[1:] + _eth() + ip_packet(), "vxlan_flags"),
        ("192.0.2.10", b"\x0c" + push_vxlan(7)[1:] + _eth() + ip_packet(), "vxlan_flags"),  # GPE P bit
        ("192.0.2.10", bytes.fromhex("08000100 00000700") + _eth() + ip_packet(), "vxlan_reserved"),
        ("192.0.2.10", bytes.fromhex("08000000 00000701") + _eth() + ip_packet(), "vxlan_reserved"),
        ("192.0.2.10", push_vxlan(8) + _eth() + ip_packet(), "unknown_vni"),
        ("192.0.2.10", push_vxlan(7) + _eth()[:13], "short_ethernet"),
        ("192.0.2.10", push_vxlan(7) + _eth(0x86DD) + ip_packet(), "unsupported_ethertype"),
        ("192.0.2.10", push_vxlan(7) + _eth(0x8100) + b"\x00\x07\x08\x00" + ip_packet(), "unsupported_ethertype"),
        ("192.0.2.10", push_vxlan(7) + _eth(dst=EXIT_MAC) + ip_packet(), "foreign_mac"),
    ],
)
def test_decap_refused(src: Hashable, datagram: bytes, reason: str) -> None:
    with pytest.raises(InboundRefused) as exc:
        decap(datagram, src, VTEPS, vni=7, local_mac=ROUTER_MAC)
    assert exc.value.reason == reason


@pytest.mark.parametrize(
    ("payload", "ethertype", "reason"),
    [
        (ip_packet()[:19], ETH_P_IP, "bad_ip_header"),
        (b"\x60" + ip_packet()[1:], ETH_P_IP, "bad_ip_header"),
        (b"\x44" + ip_packet()[1:], ETH_P_IP, "bad_ip_header"),
        (ip_packet()[:-1], ETH_P_IP, "bad_ip_length"),
        (ip_packet()[:2] + b"\x00\x13" + ip_packet()[4:], ETH_P_IP, "bad_ip_length"),
        (b"\x46" + ip_packet()[1:], ETH_P_IP, None),  # options are the guest kernel's business inbound
        (ip_packet(), ETH_P_ARP, "bad_ip_header"),
    ],
)
def test_inner_ipv4(payload: bytes, ethertype: int, reason: str | None) -> None:
    inb = decap(push_vxlan(7) + _eth(ethertype) + payload, "192.0.2.10", VTEPS)
    if reason is None:
        inner_ipv4(inb)
        return
    with pytest.raises(InboundRefused) as exc:
        inner_ipv4(inb)
    assert exc.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.sampled_from(["192.0.2.10", "192.0.2.1"]))
def test_decap_any_bytes(data: bytes, src: str) -> None:
    try:
        inb = decap(data, src, VTEPS, local_mac=ROUTER_MAC)
        if inb.eth.ethertype == ETH_P_IP:
            assert len(inner_ipv4(inb)) >= 20
    except InboundRefused:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 0xFFFFFF), st.binary(min_size=6, max_size=6), st.binary(max_size=64))
def test_encap_decap_round_trip(vni: int, mac: bytes, payload: bytes) -> None:
    inb = decap(encap(vni, ROUTER_MAC, mac, ETH_P_IP, payload), "192.0.2.10", VTEPS, vni=vni)
    assert (inb.vni, inb.eth.src, bytes(inb.payload)) == (vni, mac, payload)
