"""Slow pure-Python references for every function of ``native/egress_core.c``.

Written for reading, not speed: one byte or one 16-bit word at a time, checks in the same order as the
C so that both return the same status for the same bytes. The tests compare the C against these on
random, edge and fuzzed inputs; nothing in the data path calls them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from forwarder.egress.core_types import (
    ARP,
    ERR_CSUM_OFFSET,
    ERR_CSUM_START,
    ERR_ETHERTYPE,
    ERR_FRAGMENT,
    ERR_GSO_PROTO,
    ERR_GSO_TYPE,
    ERR_ICMP_CSUM,
    ERR_ICMP_QUOTE,
    ERR_ICMP_QUOTE_SRC,
    ERR_IP_HEADER,
    ERR_IP_LENGTH,
    ERR_IP_OPTIONS,
    ERR_L4_HEADER,
    ERR_NO_SPACE,
    ERR_SHORT_ETHERNET,
    ERR_SHORT_HEADER,
    ERR_SHORT_VXLAN,
    ERR_SIZE,
    ERR_SLICE,
    ERR_UNKNOWN_VNI,
    ERR_UNSUPPORTED_PROTO,
    ERR_VXLAN_FLAGS,
    ERR_ZERO_GSO_SIZE,
    MERGED,
    OK,
    PREFIX_LEN,
    VNET_HDR_LEN,
    InResult,
    OutParams,
    OutResult,
    SegInfo,
    Send,
)
from forwarder.egress.stream import FRAME_LEN_MAX, FRAME_LEN_MIN
from forwarder.egress.validate import ICMP_ERROR_TYPES
from forwarder.egress.vnet import GSO_ECN, GSO_NONE, GSO_TCPV4, GSO_UDP_L4
from forwarder.egress.vnet import VIRTIO_NET_HDR_F_NEEDS_CSUM as NEEDS_CSUM

Buf = bytes | bytearray | memoryview

IP_DF = 0x4000
IP_MF = 0x2000
IP_OFFMASK = 0x1FFF
TH_FIN, TH_SYN, TH_RST, TH_PSH, TH_ACK, TH_URG, TH_CWR = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x80


def _u16(b: Buf, o: int) -> int:
    return (b[o] << 8) | b[o + 1]


def _u32(b: Buf, o: int) -> int:
    return (b[o] << 24) | (b[o + 1] << 16) | (b[o + 2] << 8) | b[o + 3]


def _le16(b: Buf, o: int) -> int:
    return b[o] | (b[o + 1] << 8)


def _put16(b: bytearray | memoryview, o: int, v: int) -> None:
    b[o] = (v >> 8) & 0xFF
    b[o + 1] = v & 0xFF


def _put32(b: bytearray | memoryview, o: int, v: int) -> None:
    _put16(b, o, v >> 16)
    _put16(b, o + 2, v & 0xFFFF)


def _fold(s: int) -> int:
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def csum(data: Buf, initial: int = 0) -> int:
    """Ones' complement sum of ``data`` as big-endian 16-bit words (an odd last byte padded with zero),
    plus ``initial``, folded to 16 bits and not inverted (RFC 1071)."""
    n = len(data)
    s = initial + sum(struct.unpack_from(f">{n // 2}H", data))
    if n & 1:
        s += data[n - 1] << 8
    return _fold(s)


def checksum(data: Buf) -> int:
    """The Internet checksum of ``data`` (the value a header's checksum field holds)."""
    return ~csum(data) & 0xFFFF


def csum_update16(check: int, frm: int, to: int, partial: bool) -> int:
    """RFC 1624 eqn. 3 for one 16-bit word; ``partial``: the field holds a non-inverted running sum."""
    s = check if partial else ~check & 0xFFFF
    r = _fold(s + (~frm & 0xFFFF) + to)
    return r if partial else ~r & 0xFFFF


def csum_update32(check: int, frm: int, to: int, partial: bool) -> int:
    """RFC 1624 eqn. 3 for a 32-bit word (an address) changing from ``frm`` to ``to``."""
    s = check if partial else ~check & 0xFFFF
    s += (~(frm >> 16) & 0xFFFF) + (~frm & 0xFFFF) + (to >> 16) + (to & 0xFFFF)
    r = _fold(s)
    return r if partial else ~r & 0xFFFF


def pseudo_sum(src: int, dst: int, proto: int, l4len: int) -> int:
    return _fold((src >> 16) + (src & 0xFFFF) + (dst >> 16) + (dst & 0xFFFF) + proto + l4len)


@dataclass(frozen=True, slots=True)
class Outbound:
    """What ``parse_out`` learnt; ``ip`` is the offset of the IPv4 header in the frame."""

    ip_len: int
    ihl: int
    proto: int
    l4h: int
    flags: int
    gso: int
    gso_size: int
    has_l4: bool
    icmp_err: bool


def parse_out(f: Buf) -> tuple[int, Outbound | None]:
    """Judge a frame (vnet hdr + IPv4) the way ``parse_out`` in C does: (status, shape)."""
    if len(f) < VNET_HDR_LEN:
        return ERR_SHORT_HEADER, None
    if len(f) < VNET_HDR_LEN + 20:
        return ERR_IP_HEADER, None
    ip = VNET_HDR_LEN
    avail = len(f) - VNET_HDR_LEN
    if f[ip] >> 4 != 4 or f[ip] & 15 < 5:
        return ERR_IP_HEADER, None
    if f[ip] & 15 != 5:
        return ERR_IP_OPTIONS, None
    ihl = 20
    tot = _u16(f, ip + 2)
    if tot < ihl or tot > avail:
        return ERR_IP_LENGTH, None
    fragw = _u16(f, ip + 6)
    frag = bool(fragw & (IP_MF | IP_OFFMASK))
    has_l4 = not fragw & IP_OFFMASK
    proto = f[ip + 9]
    l4len = tot - ihl
    l4 = ip + ihl
    l4h = 0
    icmp_err = False
    if has_l4:
        if proto == 6:
            if l4len < 20:
                return ERR_L4_HEADER, None
            l4h = (f[l4 + 12] >> 4) * 4
            if l4h < 20 or l4h > l4len:
                return ERR_L4_HEADER, None
        elif proto == 17:
            if l4len < 8:
                return ERR_L4_HEADER, None
            l4h = 8
        elif proto == 1 and l4len >= 1 and f[l4] in ICMP_ERROR_TYPES:
            if l4len < 8:
                return ERR_L4_HEADER, None
            if l4len < 28:
                return ERR_ICMP_QUOTE, None
            e = l4 + 8
            if f[e] >> 4 != 4 or f[e] & 15 < 5:
                return ERR_ICMP_QUOTE, None
            if _u32(f, e + 12) != _u32(f, ip + 16):
                return ERR_ICMP_QUOTE_SRC, None
            icmp_err = True
    flags, gso_type = f[0], f[1]
    gso_size, csum_start, csum_offset = _le16(f, 4), _le16(f, 6), _le16(f, 8)
    if flags & NEEDS_CSUM:
        if frag:
            return ERR_FRAGMENT, None
        if proto == 1:
            return ERR_ICMP_CSUM, None
        if proto not in (6, 17):
            return ERR_UNSUPPORTED_PROTO, None
        if csum_start != ihl:
            return ERR_CSUM_START, None
        if csum_offset != (16 if proto == 6 else 6):
            return ERR_CSUM_OFFSET, None
    gso = gso_type & ~GSO_ECN
    ecn = gso_type & GSO_ECN
    if gso == GSO_NONE:
        if ecn:
            return ERR_GSO_TYPE, None
    elif gso == GSO_TCPV4:
        if proto != 6:
            return ERR_GSO_PROTO, None
    elif gso == GSO_UDP_L4:
        if proto != 17:
            return ERR_GSO_PROTO, None
        if ecn:
            return ERR_GSO_TYPE, None
    else:
        return ERR_GSO_TYPE, None
    if gso != GSO_NONE and frag:
        return ERR_FRAGMENT, None
    if gso != GSO_NONE and gso_size == 0:
        return ERR_ZERO_GSO_SIZE, None
    return OK, Outbound(tot, ihl, proto, l4h, flags, gso, gso_size, has_l4, icmp_err)


def _rewrite_ip(q: bytearray | memoryview, k: Outbound, claim: int) -> None:
    """Rewrite the IPv4 packet at ``q`` (already judged by ``parse_out``) in place."""
    old = _u32(q, 12)
    if old != claim:
        _put32(q, 12, claim)
        _put16(q, 10, csum_update32(_u16(q, 10), old, claim, False))
        partial = bool(k.flags & NEEDS_CSUM)
        if k.has_l4 and k.proto == 6:
            c = k.ihl + 16
            _put16(q, c, csum_update32(_u16(q, c), old, claim, partial))
        elif k.has_l4 and k.proto == 17:
            c = k.ihl + 6
            v = _u16(q, c)
            if partial:
                _put16(q, c, csum_update32(v, old, claim, True))
            elif v:
                v = csum_update32(v, old, claim, False)
                _put16(q, c, v or 0xFFFF)
    if k.icmp_err:
        icmp = k.ihl
        e = icmp + 8
        eold = _u32(q, e + 16)
        if eold != claim:
            ecs_old = _u16(q, e + 10)
            ecs_new = csum_update32(ecs_old, eold, claim, False)
            _put32(q, e + 16, claim)
            _put16(q, e + 10, ecs_new)
            ic = csum_update32(_u16(q, icmp + 2), eold, claim, False)
            _put16(q, icmp + 2, csum_update16(ic, ecs_old, ecs_new, False))


def rewrite(frame: bytearray, claim: int) -> int:
    """Identity rewrite in place: the source becomes ``claim``, checksums follow (see ``eg_rewrite``)."""
    st, k = parse_out(frame)
    if k is None:
        return st
    _rewrite_ip(memoryview(frame)[VNET_HDR_LEN:], k, claim)
    return OK


def _plan(k: Outbound, p: OutParams) -> tuple[int, SegInfo | None]:
    if k.gso == GSO_NONE:
        if k.ip_len > p.mtu:
            return ERR_SIZE, None
        return OK, SegInfo(1, PREFIX_LEN + k.ip_len, PREFIX_LEN + k.ip_len)
    hl = k.ihl + k.l4h
    payload = k.ip_len - hl
    if hl + k.gso_size > p.mtu:
        return ERR_SIZE, None
    nseg = -(-payload // k.gso_size) if payload else 1
    if p.max_segs and nseg > p.max_segs:
        return ERR_SIZE, None
    first = min(payload, k.gso_size)
    return OK, SegInfo(nseg, nseg * (PREFIX_LEN + hl) + payload, PREFIX_LEN + hl + first)


def _build(f: Buf, k: Outbound, p: OutParams) -> list[bytes]:
    """The wire records for a judged frame, each built from scratch."""
    ip = bytes(f[VNET_HDR_LEN : VNET_HDR_LEN + k.ip_len])
    if k.gso == GSO_NONE:
        q = bytearray(ip)
        _rewrite_ip(q, k, p.claim)
        if k.flags & NEEDS_CSUM:
            c = k.ihl + (16 if k.proto == 6 else 6)
            v = ~csum(q[k.ihl :]) & 0xFFFF
            _put16(q, c, 0xFFFF if k.proto == 17 and v == 0 else v)
        return [p.prefix + bytes(q)]
    hl = k.ihl + k.l4h
    payload = ip[hl:]
    dst = _u32(ip, 16)
    tcp = k.proto == 6
    nseg = -(-len(payload) // k.gso_size) if payload else 1
    recs = []
    for i in range(nseg):
        chunk = payload[i * k.gso_size : (i + 1) * k.gso_size]
        iph = bytearray(ip[: k.ihl])
        _put32(iph, 12, p.claim)
        _put16(iph, 2, hl + len(chunk))
        _put16(iph, 4, (_u16(ip, 4) + i) & 0xFFFF)
        _put16(iph, 10, 0)
        _put16(iph, 10, checksum(iph))
        l4 = bytearray(ip[k.ihl : hl])
        if tcp:
            _put32(l4, 4, (_u32(ip, k.ihl + 4) + i * k.gso_size) & 0xFFFFFFFF)
            if i != nseg - 1:
                l4[13] &= ~(TH_FIN | TH_PSH) & 0xFF
            if i != 0:
                l4[13] &= ~TH_CWR & 0xFF
            c = 16
        else:
            _put16(l4, 4, 8 + len(chunk))
            c = 6
        _put16(l4, c, 0)
        v = ~csum(bytes(l4) + chunk, pseudo_sum(p.claim, dst, k.proto, len(l4) + len(chunk))) & 0xFFFF
        _put16(l4, c, 0xFFFF if not tcp and v == 0 else v)
        recs.append(p.prefix + bytes(iph) + bytes(l4) + chunk)
    return recs


def segment(frame: Buf, p: OutParams, cap: int) -> tuple[int, bytes, SegInfo | None]:
    """One frame into wire records (see ``eg_segment``): (status, records, info)."""
    st, k = parse_out(frame)
    if k is None:
        return st, b"", None
    st, info = _plan(k, p)
    if info is None:
        return st, b"", None
    if info.bytes > cap:
        return ERR_NO_SPACE, b"", None
    return OK, b"".join(_build(frame, k, p)), info


def group_sends(records: Sequence[tuple[int, int]], max_count: int, max_bytes: int) -> list[Send]:
    """Group contiguous (offset, length) records into UDP GSO sends, greedily, as ``group_add`` does."""
    sends: list[Send] = []
    closed = False
    for off, ln in records:
        if sends and not closed:
            s = sends[-1]
            if ln <= s.seg and s.count < max_count and s.len + ln <= max_bytes:
                sends[-1] = Send(s.off, s.len + ln, s.seg, s.count + 1)
                closed = ln < s.seg
                continue
        sends.append(Send(off, ln, ln, 1))
        closed = False
    return sends


def outbound_batch(
    inbuf: Buf, offs: Sequence[int], lens: Sequence[int], p: OutParams, out_cap: int, max_sends: int
) -> tuple[int, list[OutResult], list[Send], bytes]:
    """``eg_outbound_batch``: (frames consumed, per-frame results, sends, send buffer contents)."""
    out = bytearray()
    results: list[OutResult] = []
    records: list[tuple[int, int]] = []
    sends_used = 0
    for off, ln in zip(offs, lens, strict=True):
        pos = len(out)
        if off > len(inbuf) or ln > len(inbuf) - off:
            results.append(OutResult(ERR_SLICE, 0, pos, 0))
            continue
        f = inbuf[off : off + ln]
        st, k = parse_out(f)
        info = None
        if k is not None:
            st, info = _plan(k, p)
        if k is None or info is None:
            results.append(OutResult(st, 0, pos, 0))
            continue
        if info.bytes > out_cap - pos or info.packets > max_sends - sends_used:
            if pos == 0 and sends_used == 0:
                results.append(OutResult(ERR_NO_SPACE, 0, pos, 0))
                continue
            break
        recs = _build(f, k, p)
        for r in recs:
            records.append((len(out), len(r)))
            out += r
        sends_used = len(group_sends(records, p.max_gso_segs, p.max_send_bytes))
        results.append(OutResult(OK, info.packets, pos, info.bytes))
    return len(results), results, group_sends(records, p.max_gso_segs, p.max_send_bytes), bytes(out)


def _gro_candidate(ip: Buf, ip_len: int) -> bool:
    if ip[0] != 0x45 or ip[9] != 6 or ip_len < 40:
        return False
    if _u16(ip, 6) != IP_DF:
        return False
    thlen = (ip[32] >> 4) * 4
    if thlen < 20 or thlen >= ip_len - 20:
        return False
    fl = ip[33]
    if not fl & TH_ACK or fl & (TH_SYN | TH_FIN | TH_RST | TH_URG | TH_CWR):
        return False
    if checksum(ip[:20]) != 0:
        return False
    return csum(ip[20:ip_len], pseudo_sum(_u32(ip, 12), _u32(ip, 16), 6, ip_len - 20)) == 0xFFFF


def inbound_batch(
    inbuf: Buf,
    offs: Sequence[int],
    lens: Sequence[int],
    vni: int,
    gro_addrs: Sequence[int],
    out_cap: int,
) -> tuple[int, list[InResult], bytes]:
    """``eg_inbound_batch``: (datagrams consumed, per-datagram results, delivery frames)."""
    out = bytearray()
    results: list[InResult] = []
    gro = frozenset(gro_addrs)
    # the open merged frame: [head result index, frame offset, mss, next seq, closed]
    open_: list[int] | None = None
    for off, ln in zip(offs, lens, strict=True):
        if off > len(inbuf) or ln > len(inbuf) - off:
            results.append(InResult(ERR_SLICE, 0, 0, 0))
            continue
        d = inbuf[off : off + ln]
        st = OK
        if ln < 8:
            st = ERR_SHORT_VXLAN
        elif ln < PREFIX_LEN:
            st = ERR_SHORT_ETHERNET
        elif not d[0] & 0x08:
            st = ERR_VXLAN_FLAGS
        elif int.from_bytes(d[4:7], "big") != vni:
            st = ERR_UNKNOWN_VNI
        elif _u16(d, 20) == 0x0806:
            st = ARP
        elif _u16(d, 20) != 0x0800:
            st = ERR_ETHERTYPE
        elif ln - PREFIX_LEN < 20 or d[22] >> 4 != 4 or d[22] & 15 < 5:
            st = ERR_IP_HEADER
        elif not (d[22] & 15) * 4 <= _u16(d, 24) <= ln - PREFIX_LEN:
            st = ERR_IP_LENGTH
        if st != OK:
            results.append(InResult(st, 0, 0, 0))
            continue
        tot = _u16(d, 24)
        ip = bytes(d[PREFIX_LEN : PREFIX_LEN + tot])
        dst = _u32(ip, 16)
        cand = ip[9] == 6 and dst in gro and _gro_candidate(ip, tot)
        if cand and open_ is not None:
            head_i, foff, mss, next_seq, closed = open_
            head = out[foff + 14 :]
            thlen = (ip[32] >> 4) * 4
            payload = tot - 20 - thlen
            hthlen = (head[32] >> 4) * 4
            fits = (
                not closed
                and thlen == hthlen
                and payload <= mss
                and _u16(head, 2) + payload <= 65535
                and ip[1] == head[1]
                and ip[8] == head[8]
                and ip[12:24] == head[12:24]
                and ip[28:32] == head[28:32]
                and ip[33] & ~TH_PSH == head[33] & ~TH_PSH
                and ip[34:36] == head[34:36]
                and ip[40 : 20 + thlen] == head[40 : 20 + thlen]
                and _u32(ip, 24) == next_seq
                and payload <= out_cap - len(out)
            )
            if fits:
                out += ip[20 + thlen :]
                new_len = _u16(head, 2) + payload
                closed = payload < mss
                h = foff + 14  # the head's IPv4 header in out
                if ip[33] & TH_PSH:
                    out[h + 33] |= TH_PSH
                    closed = True
                _put32(out, foff, VNET_HDR_LEN + new_len)
                vh = bytes([1, 1]) + (20 + thlen).to_bytes(2, "little") + mss.to_bytes(2, "little")
                out[foff + 4 : foff + 14] = vh + (20).to_bytes(2, "little") + (16).to_bytes(2, "little")
                _put16(out, h + 2, new_len)
                _put16(out, h + 10, 0)
                _put16(out, h + 10, checksum(out[h : h + 20]))
                _put16(out, h + 36, pseudo_sum(_u32(out, h + 12), dst, 6, new_len - 20))
                flen = 14 + new_len
                hr = results[head_i]
                results[head_i] = InResult(hr.status, hr.dst, hr.off, flen)
                results.append(InResult(MERGED, dst, foff, flen))
                open_ = [head_i, foff, mss, (next_seq + payload) & 0xFFFFFFFF, int(closed)]
                continue
        need = 14 + tot
        if need > out_cap - len(out):
            if not out:
                results.append(InResult(ERR_NO_SPACE, 0, 0, 0))
                continue
            break
        foff = len(out)
        out += (10 + tot).to_bytes(4, "big") + bytes(10) + ip
        results.append(InResult(OK, dst, foff, need))
        if cand:
            thlen = (ip[32] >> 4) * 4
            mss = tot - 20 - thlen
            open_ = [len(results) - 1, foff, mss, (_u32(ip, 24) + mss) & 0xFFFFFFFF, int(bool(ip[33] & TH_PSH))]
        else:
            open_ = None
    return len(results), results, bytes(out)


def split_frames(buf: Buf, max_frames: int) -> tuple[list[int], list[int], int, bool]:
    """``eg_split_frames``: (frame offsets, frame lengths, bytes consumed, bad length seen)."""
    offs: list[int] = []
    lens: list[int] = []
    pos = 0
    while len(offs) < max_frames and len(buf) - pos >= 4:
        fl = _u32(buf, pos)
        if not FRAME_LEN_MIN <= fl <= FRAME_LEN_MAX:
            return offs, lens, pos, True
        if fl > len(buf) - pos - 4:
            break
        offs.append(pos + 4)
        lens.append(fl)
        pos += 4 + fl
    return offs, lens, pos, False
