"""Fuzz target for inbound VXLAN decapsulation (``one_input(data)``).

Invariant: decap, inner IPv4 and ARP parsing accept or raise ``InboundRefused``, nothing else; an
accepted datagram came from a configured VTEP, carries the expected VNI when one is set, is addressed to
our MAC or broadcast when that is checked, re-encapsulates to the same bytes, and an inner IPv4 packet
is trimmed to its own total length. The first byte picks the source (bit 0: a configured VTEP), whether
the VNI (bit 1) and the destination MAC (bit 2) are checked.

The same datagram also goes through the C inbound path (``InboundBatch``, twice in one batch so that
merging is tried), which must agree with its reference byte for byte, accept whatever ``decap`` +
``inner_ipv4`` accept for the same VNI, and deliver the same IPv4 bytes.
"""

from __future__ import annotations

from forwarder.egress import core_types as ct
from forwarder.egress import reference as ref
from forwarder.egress.arp import arp_reply, pull_arp
from forwarder.egress.errors import InboundRefused
from forwarder.egress.fastpath import InboundBatch
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
_CAP = 2 * (4 + 10 + 65535)
_BATCH = InboundBatch(VNI, max_frames=2, out_capacity=_CAP)


def check_core(body: bytes) -> None:
    """C inbound delivery of ``body`` (twice) against the reference and against ``decap``/``inner_ipv4``."""
    dst = int.from_bytes(body[38:42], "big") if len(body) >= 42 else 0
    _BATCH.set_gro([dst])
    _BATCH.set_frames([(0, len(body)), (len(body), len(body))])
    k = _BATCH.run(body + body)
    k_r, res_r, out_r = ref.inbound_batch(body + body, [0, len(body)], [len(body)] * 2, VNI, [dst], _CAP)
    if (k, [_BATCH.result(i) for i in range(k)]) != (k_r, res_r) or bytes(_BATCH.out[: _BATCH.out_used]) != out_r:
        raise AssertionError("C inbound and reference disagree")
    try:
        inb = decap(body, VTEP, VTEPS, VNI)
        pkt = bytes(inner_ipv4(inb)) if inb.eth.ethertype == ETH_P_IP else None
    except InboundRefused:
        return
    first = _BATCH.result(0)
    if first.status != (ct.OK if pkt is not None else ct.ARP):
        raise AssertionError(f"accepted by decap, C status {first.status}")
    if pkt is not None and _BATCH.result(1).status == ct.OK:  # not merged: the frame is the packet as sent
        frame = bytes(_BATCH.out[first.off : first.off + first.len])
        if frame[:4] != (10 + len(pkt)).to_bytes(4, "big") or frame[14:] != pkt:
            raise AssertionError("C delivered other bytes than inner_ipv4")


def classify(data: bytes) -> str:
    if not data:
        return "ok"
    sel = data[0]
    src = VTEP if sel & 1 else STRANGER
    vni = VNI if sel & 2 else None
    mac = ROUTER_MAC if sel & 4 else None
    body = data[1:]
    check_core(body)
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
