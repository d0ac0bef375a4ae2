"""Fuzz target for inbound VXLAN decapsulation (``one_input(data)``).

Invariant: decap, inner IPv4 and ARP parsing accept or raise ``InboundRefused``, nothing else; an
accepted datagram came from a configured VTEP, carries the expected VNI when one is set, is addressed to
our MAC or broadcast when that is checked, re-encapsulates to the same bytes, and an inner IPv4 packet
is trimmed to its own total length. The first byte picks the source (bit 0: a configured VTEP), whether
the VNI (bit 1) and the destination MAC (bit 2) are checked.
"""

from __future__ import annotations

from forwarder.egress.arp import arp_reply, pull_arp
from forwarder.egress.errors import InboundRefused
from forwarder.egress.vxlan import (
    BROADCAST_MAC,
    ETH_HDR_LEN,
    ETH_P_ARP,
    ETH_P_IP,
    VXLAN_HDR_LEN,
    decap,
    encap,
    inner_ipv4,
)

VTEP = "192.0.2.10"
STRANGER = "198.51.100.1"
VTEPS = frozenset({VTEP})
VNI = 7
ROUTER_MAC = bytes.fromhex("02005e000001")


def classify(data: bytes) -> str:
    if not data:
        return "ok"
    sel = data[0]
    src = VTEP if sel & 1 else STRANGER
    vni = VNI if sel & 2 else None
    mac = ROUTER_MAC if sel & 4 else None
    body = data[1:]
    try:
        inb = decap(body, src, VTEPS, vni, mac)
        assert src in VTEPS and (vni is None or inb.vni == vni)
        assert mac is None or inb.eth.dst in (mac, BROADCAST_MAC)
        assert len(inb.payload) == len(body) - VXLAN_HDR_LEN - ETH_HDR_LEN
        assert encap(inb.vni, inb.eth.dst, inb.eth.src, inb.eth.ethertype, inb.payload) == body
        if inb.eth.ethertype == ETH_P_IP:
            pkt = inner_ipv4(inb)
            assert 20 <= len(pkt) == int.from_bytes(pkt[2:4], "big") <= len(inb.payload)
        else:
            assert inb.eth.ethertype == ETH_P_ARP
            req = pull_arp(inb.payload)
            arp_reply(req, {req.tpa}, ROUTER_MAC)
    except InboundRefused as exc:
        return exc.reason
    return "ok"


def one_input(data: bytes) -> None:
    classify(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
