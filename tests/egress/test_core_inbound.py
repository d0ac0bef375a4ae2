"""Inbound delivery (C ``eg_inbound_batch``): VXLAN datagrams from the exit become delivery frames
``u32 len | vnet hdr | IPv4``; TCP segments of one flow merge into a GSO frame for a guest that offered
CSUM+TSO4. Checked against the reference and, after completing the partial checksum, against dpkt."""

from __future__ import annotations

import random
import struct

import dpkt
import pytest
from core_packets import CLAIM, REMOTE, VNI, complete, dpkt_checked, tcp, udp, vxlan_datagram
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress import core_types as ct
from forwarder.egress import fastpath as fp
from forwarder.egress import reference as ref
from forwarder.egress.core_types import VNET_HDR_LEN
from forwarder.egress.errors import InboundRefused
from forwarder.egress.stream import FrameDecoder
from forwarder.egress.vxlan import decap, inner_ipv4

TH = dpkt.tcp
OTHER = CLAIM + 1  # a claim whose guest did not offer TSO4


def down(payload: bytes, seq: int, **kw: object) -> bytes:
    """A segment from the internet to the claim."""
    args: dict[str, object] = {"src": REMOTE, "dst": CLAIM, "sport": 443, "dport": 40000, "ack": 777}
    args.update(kw)
    return tcp(payload, seq=seq & 0xFFFFFFFF, **args)  # type: ignore[arg-type]


def run_both(dgrams: list[bytes], gro: list[int], out_cap: int = 1 << 20) -> tuple[int, fp.InboundBatch]:
    inbuf = bytearray()
    pairs = []
    for d in dgrams:
        inbuf += b"\xee"  # odd offsets: nothing may assume alignment
        pairs.append((len(inbuf), len(d)))
        inbuf += d
    b = fp.InboundBatch(VNI, max_frames=max(1, len(dgrams)), out_capacity=out_cap)
    b.set_gro(gro)
    b.set_frames(pairs)
    k = b.run(inbuf)
    k_r, res_r, out_r = ref.inbound_batch(
        bytes(inbuf), [o for o, _ in pairs], [n for _, n in pairs], VNI, gro, out_cap
    )
    assert k == k_r
    assert [b.result(i) for i in range(k)] == res_r
    assert bytes(b.out[: b.out_used]) == out_r
    return k, b


def delivered(b: fp.InboundBatch, k: int) -> list[tuple[int, bytes]]:
    return [(dst, bytes(f)) for dst, f in b.frames(k)]


def split(frame: bytes) -> tuple[tuple[int, ...], bytes]:
    """(vnet header fields, IPv4 packet) of a delivery frame, checked by the stream decoder."""
    (n,) = struct.unpack_from("!I", frame)
    assert n == len(frame) - 4
    assert [bytes(f) for f in FrameDecoder().feed(frame)] == [frame[4:]]
    return struct.unpack_from("<BBHHHH", frame, 4), frame[4 + VNET_HDR_LEN :]


def flow(
    n: int, mss: int = 1448, seq0: int = 0xFFFFF000, last: bytes | None = None, **kw: object
) -> list[bytes]:
    rnd = random.Random(n)
    segs = [down(rnd.randbytes(mss), seq0 + i * mss, **kw) for i in range(n)]
    if last is not None:
        segs.append(down(last, seq0 + n * mss, **kw))
    return segs


def test_plain_delivery_framing() -> None:
    ip = udp(b"answer", src=REMOTE, dst=CLAIM)
    k, b = run_both([vxlan_datagram(ip)], [])
    assert k == 1 and b.result(0).status == ct.OK and b.result(0).dst == CLAIM
    [(dst, frame)] = delivered(b, 1)
    hdr, pkt = split(frame)
    assert hdr == (0, 0, 0, 0, 0, 0) and pkt == ip and dst == CLAIM


def test_ethernet_padding_is_trimmed() -> None:
    ip = tcp(b"", src=REMOTE, dst=CLAIM, flags=TH.TH_ACK)
    k, b = run_both([vxlan_datagram(ip, pad_to=8 + 60)], [CLAIM])
    [(_, frame)] = delivered(b, k)
    assert split(frame)[1] == ip


def test_segments_of_one_flow_merge() -> None:
    segs = flow(10, last=b"tail" * 10)
    k, b = run_both([vxlan_datagram(s) for s in segs], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [ct.OK] + [ct.MERGED] * 10
    [(dst, frame)] = delivered(b, k)
    hdr, pkt = split(frame)
    assert hdr == (1, 1, 40, 1448, 20, 16)
    want_payload = b"".join(bytes(dpkt.ip.IP(s).data.data) for s in segs)
    got = dpkt_checked(complete(pkt))
    assert bytes(got.data.data) == want_payload
    assert got.data.seq == 0xFFFFF000 and got.len == 40 + len(want_payload) and dst == CLAIM
    # the field holds the partial (pseudo-header) sum, as virtio NEEDS_CSUM requires
    s = ref.pseudo_sum(REMOTE, CLAIM, 6, len(pkt) - 20)
    assert pkt[36:38] == s.to_bytes(2, "big")


def test_psh_on_a_segment_closes_the_frame() -> None:
    segs = flow(3)
    psh = down(b"p" * 1448, 0xFFFFF000 + 3 * 1448, flags=TH.TH_ACK | TH.TH_PUSH)
    after = down(b"q" * 1448, 0xFFFFF000 + 4 * 1448)
    k, b = run_both([vxlan_datagram(s) for s in [*segs, psh, after]], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [0, 1, 1, 1, 0]
    (_, f1), _ = delivered(b, k)
    assert split(f1)[1][33] & TH.TH_PUSH


def test_not_merged_for_a_guest_without_tso() -> None:
    segs = flow(4, dst=OTHER)
    k, b = run_both([vxlan_datagram(s) for s in segs], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [ct.OK] * 4
    assert all(split(f)[0] == (0,) * 6 for _, f in delivered(b, k))


def mut(ip: bytes, at: int, value: bytes, fix: bool = True) -> bytes:
    """``ip`` with bytes replaced, checksums recomputed by dpkt unless ``fix`` is False."""
    b = bytearray(ip)
    b[at : at + len(value)] = value
    if not fix:
        return bytes(b)
    p = dpkt.ip.IP(bytes(b))
    p.sum = 0
    p.data.sum = 0
    return bytes(p)


BASE = flow(1)[0]
SECOND = down(b"s" * 1448, 0xFFFFF000 + 1448)
NO_MERGE = {
    "other-port": mut(SECOND, 20, b"\x01\xbc"),
    "other-source": mut(SECOND, 12, b"\x01\x02\x03\x04"),
    "out-of-order": mut(SECOND, 24, (0xFFFFF000 + 1449).to_bytes(4, "big")),
    "other-ack": mut(SECOND, 28, b"\x00\x00\x00\x01"),
    "other-window": mut(SECOND, 34, b"\x00\x01"),
    "syn": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_SYN])),
    "fin": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_FIN])),
    "rst": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_RST])),
    "urg": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_URG])),
    "cwr": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_CWR])),
    "ece-differs": mut(SECOND, 33, bytes([TH.TH_ACK | TH.TH_ECE])),
    "no-ack": mut(SECOND, 33, b"\x00"),
    "bad-tcp-checksum": mut(SECOND, 36, b"\x12\x34", fix=False),
    "bad-ip-checksum": mut(SECOND, 10, b"\x12\x34", fix=False),
    "no-df": mut(SECOND, 6, b"\x00\x00"),
    "other-tos": mut(SECOND, 1, b"\x10"),
    "other-ttl": mut(SECOND, 8, b"\x07"),
    "bigger-than-mss": down(b"s" * 1449, 0xFFFFF000 + 1448),
    "options-differ": down(b"s" * 1436, 0xFFFFF000 + 1448, opts=b"\x01\x01\x08\x0a" + bytes(8)),
    "ip-options": b"",  # filled below
}


def _with_ip_options(ip: bytes) -> bytes:
    b = bytearray(b"\x46" + ip[1:20] + b"\x01\x01\x01\x00" + ip[20:])
    b[2:4] = (len(ip) + 4).to_bytes(2, "big")
    p = dpkt.ip.IP(bytes(b))
    p.sum = 0
    p.data.sum = 0
    return bytes(p)


NO_MERGE["ip-options"] = _with_ip_options(SECOND)


@pytest.mark.parametrize("name", sorted(NO_MERGE))
def test_no_merge(name: str) -> None:
    k, b = run_both([vxlan_datagram(BASE), vxlan_datagram(NO_MERGE[name])], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [ct.OK, ct.OK]
    (_, f1), (_, f2) = delivered(b, k)
    assert split(f1)[1] == BASE and split(f2)[1] == NO_MERGE[name]


def test_merge_stops_at_64k() -> None:
    segs = flow(50, mss=1448)
    k, b = run_both([vxlan_datagram(s) for s in segs], [CLAIM])
    frames = delivered(b, k)
    assert len(frames) == 2
    for _, f in frames:
        hdr, pkt = split(f)
        assert len(pkt) <= 65535
        dpkt_checked(complete(pkt) if hdr[0] else pkt)
    assert sum(len(split(f)[1]) - 40 for _, f in frames) == 50 * 1448


def test_interleaved_flows_and_arp_between() -> None:
    a = flow(3, sport=443)
    c = flow(3, sport=8443, seq0=5)
    arp = bytes(vxlan_datagram(b""))[:20] + b"\x08\x06" + bytes(28)
    order = [a[0], a[1], arp, a[2], c[0], c[1], a[0], c[2]]
    k, b = run_both([d if d is arp else vxlan_datagram(d) for d in order], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [0, 1, ct.ARP, 1, 0, 1, 0, 0]


REFUSED = {
    "short-vxlan": (vxlan_datagram(BASE)[:7], ct.ERR_SHORT_VXLAN),
    "short-ethernet": (vxlan_datagram(BASE)[:21], ct.ERR_SHORT_ETHERNET),
    "no-i-flag": (b"\x00" + vxlan_datagram(BASE)[1:], ct.ERR_VXLAN_FLAGS),
    "other-vni": (vxlan_datagram(BASE, vni=VNI + 1), ct.ERR_UNKNOWN_VNI),
    "ipv6-ethertype": (vxlan_datagram(BASE)[:20] + b"\x86\xdd" + BASE, ct.ERR_ETHERTYPE),
    "ip-short": (vxlan_datagram(BASE[:19]), ct.ERR_IP_HEADER),
    "ip-version": (vxlan_datagram(b"\x65" + BASE[1:]), ct.ERR_IP_HEADER),
    "ihl-past-end": (vxlan_datagram(b"\x4f" + BASE[1:40]), ct.ERR_IP_LENGTH),
    "total-over": (vxlan_datagram(BASE[:2] + (len(BASE) + 1).to_bytes(2, "big") + BASE[4:]), ct.ERR_IP_LENGTH),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name: str) -> None:
    d, status = REFUSED[name]
    _, b = run_both([d, vxlan_datagram(BASE)], [CLAIM])
    assert b.result(0).status == status and status in ct.REASONS
    assert b.result(1).status == ct.OK and b.result(1).off == 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusal_named_as_vxlan_py_names_it(name: str) -> None:
    # The same datagram through the Python codec (decap, then inner_ipv4) is refused under the same
    # metrics token: one fault, one name.
    d, status = REFUSED[name]
    with pytest.raises(InboundRefused) as exc:
        inner_ipv4(decap(d, "exit", {"exit"}, vni=VNI))
    assert exc.value.reason == ct.REASONS[status]


def test_out_of_space_stops_and_oversize_is_refused() -> None:
    segs = [vxlan_datagram(udp(b"x" * 100, src=REMOTE, dst=CLAIM)) for _ in range(5)]
    one = 4 + 10 + 128
    k, _ = run_both(segs, [], out_cap=2 * one + 5)
    assert k == 2
    k, b = run_both(segs, [], out_cap=one - 1)
    assert k == 5 and all(b.result(i).status == ct.ERR_NO_SPACE for i in range(5))
    # a merge that does not fit ends the batch as well
    k, b = run_both([vxlan_datagram(s) for s in flow(3)], [CLAIM], out_cap=14 + 1488 + 1448 + 100)
    assert k == 2 and b.result(1).status == ct.MERGED


@st.composite
def batches(draw: st.DrawFn) -> list[bytes]:
    n = draw(st.integers(1, 12))
    mss = draw(st.sampled_from([1, 536, 1448]))
    seq = draw(st.integers(0, 0xFFFFFFFF))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["next", "next", "next", "short", "psh", "dup", "other", "garbage"]))
        if kind == "garbage":
            out.append(draw(st.binary(max_size=80)))
            continue
        ln = {"short": max(1, mss // 2), "other": mss}.get(kind, mss)
        flags = TH.TH_ACK | (TH.TH_PUSH if kind == "psh" else 0)
        dst = OTHER if kind == "other" else CLAIM
        s = seq if kind != "dup" else (seq - mss) & 0xFFFFFFFF
        out.append(vxlan_datagram(down(draw(st.binary(min_size=ln, max_size=ln)), s, flags=flags, dst=dst)))
        if kind in ("next", "short", "psh"):
            seq = (seq + ln) & 0xFFFFFFFF
    return out


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
def test_property_c_equals_reference_and_frames_are_valid(dgrams: list[bytes], gro: bool) -> None:
    k, b = run_both(dgrams, [CLAIM, 1, 0xFFFFFFFF] if gro else [])
    assert k == len(dgrams)
    for _, f in delivered(b, k):
        hdr, pkt = split(f)
        if pkt[9] == 6:
            dpkt_checked(complete(pkt) if hdr[0] else pkt)


def test_random_bytes_c_equals_reference() -> None:
    rnd = random.Random(11)
    base = [vxlan_datagram(s) for s in flow(3)] + [vxlan_datagram(udp(b"u", src=REMOTE, dst=CLAIM))]
    for _ in range(300):
        batch = []
        for _ in range(rnd.randrange(1, 6)):
            d = bytearray(rnd.choice(base))
            for _ in range(rnd.randrange(0, 3)):
                d[rnd.randrange(len(d))] = rnd.randrange(256)
            if rnd.random() < 0.2:
                d = d[: rnd.randrange(len(d) + 1)]
            batch.append(bytes(d))
        run_both(batch, [CLAIM])


def test_options_must_be_identical() -> None:
    ts = b"\x01\x01\x08\x0a"
    head = down(b"h" * 1436, 100, opts=ts + bytes(8))
    same = down(b"s" * 1436, 100 + 1436, opts=ts + bytes(8))
    other = down(b"o" * 1436, 100 + 1436, opts=ts + b"\x00\x00\x00\x01" + bytes(4))
    k, b = run_both([vxlan_datagram(head), vxlan_datagram(same)], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [ct.OK, ct.MERGED]
    [(_, f)] = delivered(b, k)
    assert split(f)[0] == (1, 1, 52, 1436, 20, 16)
    k, b = run_both([vxlan_datagram(head), vxlan_datagram(other)], [CLAIM])
    assert [b.result(i).status for i in range(k)] == [ct.OK, ct.OK]
