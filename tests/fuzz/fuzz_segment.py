"""Fuzz target: GSO segmentation into the VXLAN send buffer (``one_input(data)``, atheris-style).

``data[0]`` picks the MTU (low 2 bits), the packet cap per frame (next 2 bits) and the records per send
(next 2); the rest is a frame. Invariants, for any bytes: C and reference agree on status, records and
sizes, for one frame and for a batch of two; every record starts with the prefix and carries an IPv4
packet no longer than the MTU, from the claim address to the original destination, with a right header
checksum; a GSO frame's records carry exactly its payload, in order, each with a right full L4
checksum; an ICMP error's record quotes only its destination (as the quoted source) and the claim;
whatever the validator accepts (same MTU, 128 packets) is segmented, unless the selector capped the
packets per frame below 128.
"""

from __future__ import annotations

from forwarder.egress import core_types as ct
from forwarder.egress import reference as ref
from forwarder.egress.errors import FrameRefused
from forwarder.egress.fastpath import OutboundBatch, segment
from forwarder.egress.validate import ICMP_ERROR_TYPES, validate_outbound

CLAIM = 0x64400A07
PREFIX = ct.vxlan_eth_prefix(4242, b"\x02\x00\x00\x00\x00\x01", b"\x02\x00\x00\x00\x00\x02")
MTUS = (1500, 576, 9000, 65535)
MAX_SEGS = (128, 64, 2, 1)
MAX_GSO = (64, 1, 3, 128)
H = ct.VNET_HDR_LEN
_OUT = bytearray(128 * (ct.PREFIX_LEN + 120) + 65535 + 4096)


def _l4_ok(pkt: bytes) -> bool:
    ihl = (pkt[0] & 15) * 4
    src, dst = int.from_bytes(pkt[12:16], "big"), int.from_bytes(pkt[16:20], "big")
    return ref.csum(pkt[ihl:], ref.pseudo_sum(src, dst, pkt[9], len(pkt) - ihl)) == 0xFFFF


def one_input(data: bytes) -> None:
    sel = data[0] if data else 0
    mtu, max_segs, max_gso = MTUS[sel & 3], MAX_SEGS[(sel >> 2) & 3], MAX_GSO[(sel >> 4) & 3]
    frame = bytes(data[1:])
    p = ct.OutParams(claim=CLAIM, prefix=PREFIX, mtu=mtu, max_segs=max_segs, max_gso_segs=max_gso)
    try:
        validate_outbound(frame, mtu)
        accepted = True
    except FrameRefused:
        accepted = False
    status, info = segment(frame, p, _OUT)
    got = bytes(_OUT[: info.bytes]) if info else b""
    want_status, want, want_info = ref.segment(frame, p, len(_OUT))
    if (status, info) != (want_status, want_info) or got != want:
        raise AssertionError(f"C and reference disagree: {status}/{info} vs {want_status}/{want_info}")
    if status != ct.OK or info is None:
        if accepted and not (status == ct.ERR_SIZE and max_segs < 128):
            raise AssertionError(f"validated frame refused by the segmenter: {ct.REASONS.get(status)}")
    else:
        _check_records(frame, got, info, mtu)
    _check_batch(frame, p)


def _quote_wrong(pkt: bytes) -> bool:
    """An ICMP error (not a later fragment) whose quote is not (source = its destination, destination =
    the claim): the core refuses any other quoted source, and rewrites the quoted destination."""
    if pkt[9] != 1 or pkt[6] & 0x1F or pkt[7] or pkt[20] not in ICMP_ERROR_TYPES:
        return False
    q = 20 + 8
    return pkt[q + 12 : q + 16] != pkt[16:20] or pkt[q + 16 : q + 20] != CLAIM.to_bytes(4, "big")


def _check_records(frame: bytes, out: bytes, info: ct.SegInfo, mtu: int) -> None:
    ihl = (frame[H] & 15) * 4
    gso = frame[1] & 0x7F
    proto = frame[H + 9]
    l4h = ((frame[H + ihl + 12] >> 4) * 4 if proto == 6 else 8) if gso else 0
    payload = b""
    for i in range(info.packets):
        rec = out[i * info.stride : (i + 1) * info.stride]
        if rec[: ct.PREFIX_LEN] != PREFIX:
            raise AssertionError("record prefix")
        pkt = rec[ct.PREFIX_LEN :]
        if len(pkt) > mtu or int.from_bytes(pkt[2:4], "big") != len(pkt):
            raise AssertionError("record length")
        if pkt[12:16] != CLAIM.to_bytes(4, "big") or pkt[16:20] != frame[H + 16 : H + 20]:
            raise AssertionError("record addresses")
        if ref.csum(pkt[:ihl]) != 0xFFFF and gso:
            raise AssertionError("record IPv4 header checksum")
        if not gso and _quote_wrong(pkt):
            raise AssertionError("an ICMP error's quote names an address other than its destination and the claim")
        if gso:
            if not _l4_ok(pkt):
                raise AssertionError(f"record {i} L4 checksum")
            payload += pkt[ihl + l4h :]
    if gso and payload != frame[H + ihl + l4h : H + int.from_bytes(frame[H + 2 : H + 4], "big")]:
        raise AssertionError("payload not carried exactly")


def _check_batch(frame: bytes, p: ct.OutParams) -> None:
    inbuf = b"\x00" + frame + frame
    b = OutboundBatch(p, max_frames=2, out_capacity=len(_OUT), max_sends=256)
    b.set_frames([(1, len(frame)), (1 + len(frame), len(frame))])
    k = b.run(inbuf)
    k_r, res_r, sends_r, out_r = ref.outbound_batch(inbuf, [1, 1 + len(frame)], [len(frame)] * 2, p,
                                                    len(_OUT), 256)
    if (k, [b.result(i) for i in range(k)], b.send_list()) != (k_r, res_r, sends_r):
        raise AssertionError("batch: C and reference disagree")
    if bytes(b.out[: b.out_used]) != out_r:
        raise AssertionError("batch: records differ")


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
