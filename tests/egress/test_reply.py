"""The inbound flow key and wire size (forwarder/egress/reply.py), against the outbound keys and the core.

The oracle for the key is ``flow_key`` of the packet the reply answers, as the router keys it (source =
the claim); for the wire size, the packets that went into a frame the C core (and its reference) merged.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import dpkt
import pytest
from core_packets import CLAIM, REMOTE, icmp_echo, icmp_error, tcp, udp, vxlan_datagram
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.core_types import MERGED, OK
from forwarder.egress.errors import InboundRefused
from forwarder.egress.fastpath import InboundBatch
from forwarder.egress.flows import flow_key
from forwarder.egress.reference import inbound_batch
from forwarder.egress.reply import pull_reply, wire_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
import fuzz_reply

TH = dpkt.tcp


def frame(ip: bytes) -> bytes:
    return struct.pack("!I", 10 + len(ip)) + bytes(10) + ip


def _swap(out: bytes) -> bytes:
    """The answer a peer sends to the claim's packet ``out`` (TCP or UDP; a plain ACK for TCP)."""
    p = dpkt.ip.IP(out)
    if p.p == 6:
        return tcp(b"answer", src=REMOTE, dst=CLAIM, sport=p.data.dport, dport=p.data.sport)
    return udp(b"answer", src=REMOTE, dst=CLAIM, sport=p.data.dport, dport=p.data.sport)


@pytest.mark.parametrize("out", [tcp(b"q", src=CLAIM, sport=41000, dport=443), udp(b"q", src=CLAIM, sport=5353)])
def test_a_reply_has_the_key_of_the_packet_it_answers(out: bytes) -> None:
    r = pull_reply(frame(_swap(out)))
    assert r.key == flow_key(out, 0, CLAIM)
    assert r.resumable == (out[9] == 6)


def test_an_echo_reply_and_the_errors_a_packet_causes_have_its_key() -> None:
    echo = icmp_echo(src=CLAIM)
    reply = bytearray(icmp_echo(src=REMOTE, dst=CLAIM))
    reply[20] = 0
    assert pull_reply(frame(bytes(reply))).key == flow_key(echo, 0, CLAIM)
    for out in (udp(b"big" * 400, src=CLAIM), tcp(b"t", src=CLAIM), echo):
        for kind, code in ((3, 4), (3, 3), (11, 0), (12, 0)):
            err = icmp_error(kind, out[:28], code=code, src=0x0A000001, dst=CLAIM)
            r = pull_reply(frame(err))
            assert r.key == flow_key(out, 0, CLAIM) and not r.resumable


@pytest.mark.parametrize(("flags", "resumable"), [(TH.TH_ACK, True), (TH.TH_ACK | TH.TH_PUSH, True),
                                                  (TH.TH_FIN | TH.TH_ACK, True), (TH.TH_SYN, False),
                                                  (TH.TH_SYN | TH.TH_ACK, False), (TH.TH_RST, False),
                                                  (TH.TH_RST | TH.TH_ACK, False)])
def test_only_a_segment_with_neither_syn_nor_rst_may_reopen(flags: int, resumable: bool) -> None:
    assert pull_reply(frame(tcp(b"", src=REMOTE, dst=CLAIM, flags=flags))).resumable is resumable


def test_a_quote_that_is_not_the_claims_or_does_not_fit_is_refused() -> None:
    out = udp(b"x", src=CLAIM)
    for quoted in (udp(b"x", src=CLAIM + 1)[:28], out[:22], b"\x60" + out[1:28], b"\x4f" + out[1:28], b""):
        with pytest.raises(InboundRefused) as e:
            pull_reply(frame(icmp_error(3, quoted, src=REMOTE, dst=CLAIM)))
        assert e.value.reason == "bad_reply"


def _segments(n: int, last: int) -> list[bytes]:
    seq = 7000
    segs = []
    for i in range(n):
        size = 1448 if i < n - 1 else last
        segs.append(tcp(bytes([i]) * size, src=REMOTE, dst=CLAIM, sport=443, dport=40000, seq=seq,
                        opts=b"\x01\x01\x08\x0a" + bytes(8)))
        seq += size
    return segs


@pytest.mark.parametrize(("n", "last"), [(1, 1448), (2, 1448), (5, 300), (40, 1)])
def test_a_merged_frame_counts_every_segment_it_was(n: int, last: int) -> None:
    segs = _segments(n, last)
    dgrams = [vxlan_datagram(s) for s in segs]
    buf = b"".join(dgrams)
    offs = [sum(map(len, dgrams[:i])) for i in range(n)]
    lens = [len(d) for d in dgrams]
    k, results, out = inbound_batch(buf, offs, lens, 4242, [CLAIM], 1 << 20)
    assert k == n and results[0].status == OK and all(r.status == MERGED for r in results[1:])
    head = results[0]
    assert wire_size(out[head.off : head.off + head.len]) == (sum(map(len, segs)), n)
    # the C core merges the same way
    b = InboundBatch(4242)
    b.set_gro([CLAIM])
    for i, (o, ln) in enumerate(zip(offs, lens, strict=True)):
        b.offs[i], b.lens[i] = o, ln
    assert b.run(buf, n) == n
    r = b.results[0]
    assert wire_size(bytes(b.out[r.off : r.off + r.len])) == (sum(map(len, segs)), n)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_give_a_key_or_bad_reply(data: bytes) -> None:
    fuzz_reply.one_input(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([tcp(b"abc", src=REMOTE, dst=CLAIM), udp(b"abc", src=REMOTE, dst=CLAIM),
                        icmp_error(3, udp(b"q", src=CLAIM)[:28], src=REMOTE, dst=CLAIM)]),
       st.integers(0, 80), st.integers(0, 255))
def test_a_byte_changed_in_a_reply_is_still_judged_safely(ip: bytes, pos: int, value: int) -> None:
    f = bytearray(frame(ip))
    if pos < len(f):
        f[pos] = value
    fuzz_reply.one_input(bytes(f))
