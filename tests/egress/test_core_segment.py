"""GSO segmentation into the VXLAN send buffer (C ``eg_segment``/``eg_outbound_batch``) against the
reference, and every wire packet checked by dpkt: lengths, IDs, sequence numbers, flags, checksums."""

from __future__ import annotations

import random

import dpkt
import pytest
from core_packets import (
    CLAIM,
    PREFIX,
    REMOTE,
    a4,
    csum_frame,
    dpkt_checked,
    icmp_error,
    inner,
    records,
    tcp,
    udp,
    vnet,
)

from forwarder.egress import core_types as ct
from forwarder.egress import fastpath as fp
from forwarder.egress import reference as ref
from forwarder.egress.errors import FrameRefused
from forwarder.egress.validate import validate_outbound

TH = dpkt.tcp
BIG = 65535 * 90  # room for gso_size 1 on a 64 KiB frame


def params(mtu: int = 65535, max_segs: int = 0, **kw: int) -> ct.OutParams:
    return ct.OutParams(claim=CLAIM, prefix=PREFIX, mtu=mtu, max_segs=max_segs, **kw)


_OUT = bytearray(BIG)


def seg_both(
    frame: bytes, p: ct.OutParams, cap: int = BIG, with_ref: bool = True
) -> tuple[int, bytes, ct.SegInfo | None]:
    st_c, info = fp.segment(frame, p, memoryview(_OUT)[:cap])
    got = bytes(_OUT[: info.bytes]) if info else b""
    if with_ref:
        st_r, want, info_r = ref.segment(frame, p, cap)
        assert (st_c, info) == (st_r, info_r)
        assert got == want
    return st_c, got, info


def sampled(i: int, n: int) -> bool:
    """dpkt parses every record of small frames and a sample of the 65k records of 1-byte segments."""
    return n < 300 or i < 50 or i >= n - 50 or i % 97 == 0


def fast_check(pkt: bytes) -> None:
    """Both checksums of a TCP/UDP packet, summed by the reference (struct-based, not the C)."""
    assert ref.csum(pkt[:20]) == 0xFFFF
    src, dst = int.from_bytes(pkt[12:16], "big"), int.from_bytes(pkt[16:20], "big")
    assert ref.csum(pkt[20:], ref.pseudo_sum(src, dst, pkt[9], len(pkt) - 20)) == 0xFFFF


def check_tcp_segments(frame: bytes, out: bytes, info: ct.SegInfo, p: ct.OutParams) -> None:
    orig = dpkt.ip.IP(frame[10:])
    payload = bytes(orig.data.data)
    thl = orig.data.off * 4
    recs = records(out, info.stride, info.bytes)
    assert len(recs) == info.packets
    assert all(len(r) == info.stride for r in recs[:-1]) and len(recs[-1]) <= info.stride
    pos = 0
    for i, rec in enumerate(recs):
        pkt = rec[22:]
        assert rec[:22] == PREFIX and len(pkt) <= p.mtu
        assert pkt[12:16] == a4(CLAIM) and pkt[16:20] == orig.dst
        assert int.from_bytes(pkt[4:6], "big") == (orig.id + i) & 0xFFFF
        assert int.from_bytes(pkt[24:28], "big") == (orig.data.seq + pos) & 0xFFFFFFFF
        last, first = i == len(recs) - 1, i == 0
        want_flags = orig.data.flags
        if not last:
            want_flags &= ~(TH.TH_FIN | TH.TH_PUSH)
        if not first:
            want_flags &= ~TH.TH_CWR
        assert pkt[33] == want_flags, (i, pkt[33], want_flags)
        seg = pkt[20 + thl :]
        assert seg == payload[pos : pos + len(seg)]
        pos += len(seg)
        fast_check(pkt)
        if sampled(i, len(recs)):
            ip = dpkt_checked(inner(rec))
            t = ip.data
            assert ip.ttl == orig.ttl and ip.df == orig.df and ip.len == len(pkt)
            assert t.ack == orig.data.ack and t.win == orig.data.win and t.opts == orig.data.opts
    assert pos == len(payload)


def check_udp_segments(frame: bytes, out: bytes, info: ct.SegInfo) -> None:
    orig = dpkt.ip.IP(frame[10:])
    payload = bytes(orig.data.data)
    recs = records(out, info.stride, info.bytes)
    pos = 0
    for i, rec in enumerate(recs):
        pkt = rec[22:]
        assert rec[:22] == PREFIX and pkt[12:16] == a4(CLAIM)
        assert int.from_bytes(pkt[4:6], "big") == (orig.id + i) & 0xFFFF
        assert int.from_bytes(pkt[24:26], "big") == len(pkt) - 20
        assert pkt[26:28] != b"\x00\x00"
        assert pkt[20:24] == bytes(orig.data)[:4]
        assert pkt[28:] == payload[pos : pos + len(pkt) - 28]
        pos += len(pkt) - 28
        fast_check(pkt)
        if sampled(i, len(recs)):
            dpkt_checked(inner(rec))
    assert pos == len(payload)


def tso(payload_len: int, gso_size: int, *, flags: int = TH.TH_ACK | TH.TH_PUSH, opts: bytes = b"",
        seed: int = 0, ecn: bool = False) -> bytes:
    data = random.Random(seed).randbytes(payload_len)
    ip = tcp(data, flags=flags, opts=opts, seq=0xFFFFF000, ident=0xFFF0)
    return csum_frame(ip, 0x81 if ecn else 1, gso_size)


def uso(payload_len: int, gso_size: int, seed: int = 0) -> bytes:
    return csum_frame(udp(random.Random(seed).randbytes(payload_len), ident=0xFFFE), 5, gso_size)


def test_every_gso_size_tcp_3000_byte_frame() -> None:
    frame = tso(3000, 1, opts=b"\x01\x01\x08\x0a" + bytes(8))
    for g in range(1, 1501):
        f = bytearray(frame)
        f[4:6] = g.to_bytes(2, "little")
        st, out, info = seg_both(bytes(f), params())
        assert st == ct.OK and info is not None
        assert info.packets == -(-3000 // g)
        if g in (1, 2, 3, 7, 536, 999, 1000, 1448, 1460, 1500) or g % 97 == 0:
            check_tcp_segments(bytes(f), out, info, params())


def test_every_gso_size_udp_1600_byte_frame() -> None:
    frame = uso(1600, 1)
    for g in range(1, 1501):
        f = bytearray(frame)
        f[4:6] = g.to_bytes(2, "little")
        st, out, info = seg_both(bytes(f), params())
        assert st == ct.OK and info is not None
        if g in (1, 2, 5, 8, 1000, 1472, 1500) or g % 101 == 0:
            check_udp_segments(bytes(f), out, info)


def test_every_gso_size_on_a_64k_tcp_frame() -> None:
    # Every gso_size a 1500-byte MTU allows on one 64 KiB TSO frame, each record checked for what it must be
    # (prefix, addresses, lengths, IP ID, sequence number, both checksums, payload carried exactly, in
    # order); the reference compares byte for byte on the sizes test_64k_tcp_frame names.
    opts = b"\x01\x01\x08\x0a" + bytes(8)
    frame = bytearray(tso(65535 - 40 - 12, 1, opts=opts, seed=64))
    hl = 20 + 20 + len(opts)
    payload = bytes(frame[10 + hl :])
    claim_dst = a4(CLAIM) + a4(REMOTE)
    mv = memoryview(_OUT)
    for g in range(1, 1500 - hl + 2):
        frame[4:6] = g.to_bytes(2, "little")
        st, info = fp.segment(frame, params(1500), _OUT)
        if g == 1500 - hl + 1:  # one byte more and a segment is over the MTU
            assert st == ct.ERR_SIZE
            break
        n = -(-len(payload) // g)
        assert st == ct.OK and info is not None
        assert (info.packets, info.bytes) == (n, n * (22 + hl) + len(payload))
        assert info.stride == 22 + hl + min(g, len(payload))
        got = []
        for i in range(n):
            rec = mv[i * info.stride : min((i + 1) * info.stride, info.bytes)]
            pkt = rec[22:]
            assert rec[:22] == PREFIX and pkt[12:20] == claim_dst
            assert int.from_bytes(pkt[2:4], "big") == len(pkt)
            assert int.from_bytes(pkt[4:6], "big") == (0xFFF0 + i) & 0xFFFF
            assert int.from_bytes(pkt[24:28], "big") == (0xFFFFF000 + i * g) & 0xFFFFFFFF
            assert fp.csum(pkt[:20]) == 0xFFFF
            assert fp.csum(pkt[20:], ref.pseudo_sum(CLAIM, REMOTE, 6, len(pkt) - 20)) == 0xFFFF
            got.append(pkt[hl:])
        assert b"".join(got) == payload, g


@pytest.mark.parametrize("gso_size", [1, 3, 100, 536, 1000, 1447, 1448, 1460, 1500])
def test_64k_tcp_frame(gso_size: int) -> None:
    frame = tso(65535 - 40 - 12, gso_size, opts=b"\x01\x01\x08\x0a" + bytes(8), seed=gso_size)
    # the reference is too slow for tens of thousands of tiny segments: below 100 bytes the C is
    # checked field by field instead (and against the reference on smaller frames above)
    st, out, info = seg_both(frame, params(), with_ref=gso_size >= 100)
    assert st == ct.OK and info is not None
    check_tcp_segments(frame, out, info, params())


@pytest.mark.parametrize("gso_size", [1, 2, 1472, 1500])
def test_64k_udp_frame(gso_size: int) -> None:
    frame = uso(65535 - 28, gso_size, seed=gso_size)
    st, out, info = seg_both(frame, params(), with_ref=gso_size >= 100)
    assert st == ct.OK and info is not None
    check_udp_segments(frame, out, info)


@pytest.mark.parametrize(
    "flags",
    [
        TH.TH_ACK,
        TH.TH_ACK | TH.TH_PUSH | TH.TH_FIN,
        TH.TH_ACK | TH.TH_CWR | TH.TH_ECE | TH.TH_PUSH,
        TH.TH_ACK | TH.TH_URG,
    ],
)
def test_flags_per_segment(flags: int) -> None:
    frame = tso(5000, 1448, flags=flags, ecn=bool(flags & TH.TH_CWR))
    validate_outbound(frame, 1500)
    st, out, info = seg_both(frame, params(1500, 128))
    assert st == ct.OK and info is not None and info.packets == 4
    check_tcp_segments(frame, out, info, params(1500))


def test_gso_payload_smaller_than_gso_size_is_one_segment() -> None:
    frame = tso(10, 1448)
    st, out, info = seg_both(frame, params(1500))
    assert st == ct.OK and info == ct.SegInfo(1, 22 + 40 + 10, 22 + 40 + 10)
    check_tcp_segments(frame, out, info, params(1500))


def test_gso_without_payload() -> None:
    frame = tso(0, 1448)
    st, out, info = seg_both(frame, params(1500))
    assert st == ct.OK and info is not None and info.packets == 1
    dpkt_checked(inner(out))


@pytest.mark.parametrize(
    "ip", [tcp(b"plain"), udp(b"plain"), udp(b"zero", no_csum=True), icmp_error(3, udp(b"x", src=REMOTE)[:28])],
    ids=["tcp", "udp", "udp-nocsum", "icmp-error"],
)
def test_plain_frame_is_one_rewritten_record(ip: bytes) -> None:
    frame = vnet() + ip
    st, out, info = seg_both(frame, params(1500))
    assert st == ct.OK and info == ct.SegInfo(1, 22 + len(ip), 22 + len(ip))
    rewritten = bytearray(frame)
    assert fp.rewrite(rewritten, CLAIM) == ct.OK
    assert out == PREFIX + bytes(rewritten[10:])
    dpkt_checked(inner(out))


@pytest.mark.parametrize("ip", [tcp(b"p" * 99), udp(b"q" * 77)], ids=["tcp", "udp"])
def test_plain_needs_csum_frame_gets_full_checksum(ip: bytes) -> None:
    st, out, info = seg_both(csum_frame(ip), params(1500))
    assert st == ct.OK and info is not None
    pkt = dpkt_checked(inner(out))
    assert pkt.src == a4(CLAIM)
    assert bytes(pkt.data.data) == bytes(dpkt.ip.IP(ip).data.data)


@pytest.mark.parametrize(
    ("frame", "mtu"),
    [(vnet() + tcp(b"x" * 1461), 1500), (tso(3000, 1461), 1500), (tso(129, 1), 65535)],
    ids=["plain-over-mtu", "segment-over-mtu", "129-packets"],
)
def test_size_refusals(frame: bytes, mtu: int) -> None:
    assert seg_both(frame, params(mtu, 128))[0] == ct.ERR_SIZE
    with pytest.raises(FrameRefused) as exc:  # the validator's name for the same fault
        validate_outbound(frame, mtu)
    assert exc.value.reason == ct.REASONS[ct.ERR_SIZE]


def test_size_bounds_pass() -> None:
    assert seg_both(vnet() + tcp(b"x" * 1460), params(1500))[0] == ct.OK
    assert seg_both(tso(3000, 1460), params(1500))[0] == ct.OK
    assert seg_both(tso(128, 1), params(65535, 128))[0] == ct.OK


def test_space_refusal_writes_nothing() -> None:
    frame = tso(3000, 1000)
    need = 3 * (22 + 40) + 3000
    assert seg_both(frame, params(1500), cap=need - 1)[0] == ct.ERR_NO_SPACE
    assert seg_both(frame, params(1500), cap=need)[0] == ct.OK


def test_seeds_of_the_spec_are_refused() -> None:
    # A TCP GSO type on a UDP packet, and a checksum offset aimed into the IPv4 header.
    assert seg_both(vnet(1, 1, 28, 100, 20, 6) + udp(b"u" * 500), params())[0] == ct.ERR_GSO_PROTO
    assert seg_both(vnet(1, 0, 0, 0, 0, 16) + tcp(b"t"), params())[0] == ct.ERR_CSUM_START


def test_frames_validated_by_the_validator_all_segment() -> None:
    rnd = random.Random(5)
    for _ in range(150):
        mtu = rnd.choice([576, 1280, 1500, 9000])
        kind = rnd.choice(["tso", "uso", "plain"])
        if kind == "tso":
            g = rnd.randrange(1, mtu - 40 + 1)
            frame = tso(rnd.randrange(0, min(65495, g * 128)), g, seed=rnd.randrange(1 << 30))
        elif kind == "uso":
            g = rnd.randrange(1, mtu - 28 + 1)
            frame = uso(rnd.randrange(0, min(65507, g * 128)), g, seed=rnd.randrange(1 << 30))
        else:
            frame = vnet() + tcp(rnd.randbytes(rnd.randrange(mtu - 40)))
        validate_outbound(frame, mtu)
        st, out, info = seg_both(frame, params(mtu, 128))
        assert st == ct.OK and info is not None
        for rec in records(out, info.stride, info.bytes):
            assert len(inner(rec)) <= mtu
            dpkt_checked(inner(rec))


# ---- batches -------------------------------------------------------------------------------------


def batch_both(frames: list[bytes], p: ct.OutParams, out_cap: int, max_sends: int,
               gap: int = 3) -> tuple[int, fp.OutboundBatch]:
    inbuf = bytearray()
    pairs = []
    for f in frames:
        inbuf += bytes(gap)
        pairs.append((len(inbuf), len(f)))
        inbuf += f
    b = fp.OutboundBatch(p, max_frames=max(1, len(frames)), out_capacity=out_cap, max_sends=max_sends)
    b.set_frames(pairs)
    k = b.run(inbuf)
    k_r, res_r, sends_r, out_r = ref.outbound_batch(
        bytes(inbuf), [o for o, _ in pairs], [n for _, n in pairs], p, out_cap, max_sends
    )
    assert k == k_r
    assert [b.result(i) for i in range(k)] == res_r
    assert b.send_list() == sends_r
    assert bytes(b.out[: b.out_used]) == out_r
    return k, b


def check_sends(b: fp.OutboundBatch, p: ct.OutParams) -> None:
    pos = 0
    for s in b.send_list():
        assert s.off == pos, "sends cover the buffer in order"
        assert s.count <= max(p.max_gso_segs, 1)
        assert s.count == 1 or s.len <= p.max_send_bytes
        assert (s.count - 1) * s.seg < s.len <= s.count * s.seg
        pos += s.len
    assert pos == b.out_used


def test_batch_mixed_frames_and_sends() -> None:
    p = params(1500, 128)
    frames = [
        tso(63000, 1448),
        vnet() + tcp(b"a" * 10),
        vnet() + tcp(b"b" * 10),  # same size: joins the previous send
        vnet() + tcp(b"c" * 5),  # shorter: ends it
        vnet() + tcp(b"d" * 10),
        b"\x00" * 12,  # refused: bad_ip_header (2 bytes of IPv4)
        uso(10000, 1000),
        csum_frame(udp(b"x" * 100)),
        vnet(1, 1, 0, 100, 20, 6) + udp(b"u" * 500),  # refused: TCP GSO on UDP
    ]
    k, b = batch_both(frames, p, 1 << 20, 1024)
    assert k == len(frames)
    assert [b.result(i).status for i in range(k)] == [0, 0, 0, 0, 0, ct.ERR_IP_HEADER, 0, 0, ct.ERR_GSO_PROTO]
    check_sends(b, p)
    sends = b.send_list()
    assert sends[0].count == ct.UDP_MAX_SEGMENTS - 20 or sends[0].len <= p.max_send_bytes
    # 63000 bytes in 1448-byte segments: 44 packets of 1530 bytes, 65507 bytes per send at most.
    assert b.result(0).packets == 44


def test_batch_stops_when_the_buffer_is_full_and_resumes() -> None:
    p = params(1500, 128)
    frames = [tso(20000, 1448, seed=i) for i in range(5)]
    one = 14 * (22 + 40) + 20000
    k, _ = batch_both(frames, p, 2 * one + 10, 1024)
    assert k == 2
    k2, _ = batch_both(frames[k:], p, 2 * one + 10, 1024)
    assert k2 == 2
    # A frame that cannot fit even an empty buffer is consumed as refused, not retried forever.
    k3, b3 = batch_both([tso(20000, 1448)], p, one - 1, 1024)
    assert k3 == 1 and b3.result(0).status == ct.ERR_NO_SPACE
    # Too few send slots stops the batch as well.
    k4, _ = batch_both(frames, p, 1 << 20, 14)
    assert k4 == 1


def test_batch_bad_offsets_are_refused_not_read() -> None:
    p = params()
    b = fp.OutboundBatch(p, max_frames=3, out_capacity=1 << 16)
    b.set_frames([(0, 100), (1 << 31, 40), (50, 1 << 31)])
    assert b.run(bytes(40)) == 3
    assert [b.result(i).status for i in range(3)] == [ct.ERR_SLICE] * 3


@pytest.mark.parametrize("max_gso_segs", [1, 2, 64, 128])
def test_batch_send_groups_respect_limits(max_gso_segs: int) -> None:
    p = params(9000, 128, max_gso_segs=max_gso_segs)
    rnd = random.Random(max_gso_segs)
    frames = [tso(rnd.randrange(40000), rnd.choice([500, 1448, 8960]), seed=i) for i in range(6)]
    frames += [vnet() + tcp(b"z" * 20)] * 70
    k, b = batch_both(frames, p, 1 << 21, 1 << 14)
    assert k == len(frames)
    check_sends(b, p)


def test_split_frames_matches_reference_and_stream_decoder() -> None:
    from forwarder.egress.stream import FrameDecoder, push_frame

    frames = [vnet() + tcp(b"a" * n) for n in (0, 1, 100, 1400)] + [tso(30000, 1448)]
    stream = b"".join(push_frame(f[:10], f[10:]) for f in frames)
    b = fp.OutboundBatch(params(), max_frames=8)
    for cut in (len(stream), len(stream) - 1, 3, 0):
        n, used, bad = b.split(stream[:cut])
        offs, lens, used_r, bad_r = ref.split_frames(stream[:cut], 8)
        assert (n, used, bad) == (len(offs), used_r, bad_r)
        assert [b.offs[i] for i in range(n)] == offs and [b.lens[i] for i in range(n)] == lens
        dec = FrameDecoder()
        want = [stream[o : o + ln] for o, ln in zip(offs, lens, strict=True)]
        assert [bytes(f) for f in dec.feed(stream[:cut])] == want
    assert b.split(stream)[0] == len(frames)
    assert b.split(b"\x00\x00\x00\x05" + bytes(30)) == (0, 0, True)
    assert b.split(b"\x00\x01\x00\x0a" + bytes(30)) == (0, 0, True)
