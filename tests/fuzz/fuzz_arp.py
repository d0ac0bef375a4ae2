"""Fuzz target for ARP parsing and answering (``one_input(data)``).

Invariant: ``pull_arp`` accepts or raises ``InboundRefused``, nothing else; an accepted packet
re-encodes to its first 28 bytes; a reply is only ever built for a request whose target is an armed
claim (first byte bit 0: the target is armed), from a unicast asker, and it parses back as our reply
to that asker; a gratuitous announcement for the sender's address parses back.
"""

from __future__ import annotations

from forwarder.egress.arp import ARP_LEN, ARPOP_REPLY, ARPOP_REQUEST, arp_reply, gratuitous_arp, pull_arp, push_arp
from forwarder.egress.errors import InboundRefused
from forwarder.egress.vxlan import BROADCAST_MAC, ETH_HDR_LEN, ETH_P_ARP, pull_ethernet

ROUTER_MAC = bytes.fromhex("02005e000001")


def classify(data: bytes) -> str:
    if not data:
        return "ok"
    armed = bool(data[0] & 1)
    body = data[1:]
    try:
        p = pull_arp(body)
    except InboundRefused as exc:
        return exc.reason
    assert push_arp(p) == body[:ARP_LEN]
    claims = {p.tpa} if armed else set()
    reply = arp_reply(p, claims, ROUTER_MAC)
    if reply is not None:
        assert armed and p.op == ARPOP_REQUEST and p.spa != p.tpa and not p.sha[0] & 1
        eth = pull_ethernet(reply)
        r = pull_arp(reply[ETH_HDR_LEN:])
        assert (eth.dst, eth.src, eth.ethertype) == (p.sha, ROUTER_MAC, ETH_P_ARP)
        assert (r.op, r.sha, r.spa, r.tha, r.tpa) == (ARPOP_REPLY, ROUTER_MAC, p.tpa, p.sha, p.spa)
    ann = gratuitous_arp(p.spa, ROUTER_MAC)
    g = pull_arp(ann[ETH_HDR_LEN:])
    assert pull_ethernet(ann).dst == BROADCAST_MAC and g.spa == g.tpa == p.spa
    return "ok"


def one_input(data: bytes) -> None:
    classify(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
