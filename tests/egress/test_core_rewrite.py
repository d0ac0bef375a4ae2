"""Identity rewrite (C ``eg_rewrite``) against the reference and against dpkt's own checksums.

After the rewrite the source is the claim address, the destination is untouched, and every checksum is
right: full ones checked by dpkt, partial (NEEDS_CSUM) ones after completing them as a NIC would.
"""

from __future__ import annotations

import random

import dpkt
import pytest
from core_packets import (
    CLAIM,
    GUEST,
    PREFIX,
    REMOTE,
    a4,
    complete,
    csum_frame,
    dpkt_checked,
    icmp_echo,
    icmp_error,
    partial_form,
    tcp,
    udp,
    vnet,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress import core_types as ct
from forwarder.egress import fastpath as fp
from forwarder.egress import reference as ref
from forwarder.egress.errors import FrameRefused
from forwarder.egress.validate import validate_outbound


def both(frame: bytes, claim: int = CLAIM) -> tuple[int, bytes]:
    """Rewrite a copy with C and a copy with the reference; they must agree byte for byte."""
    c = bytearray(frame)
    r = bytearray(frame)
    st_c = fp.rewrite(c, claim)
    st_r = ref.rewrite(r, claim)
    assert st_c == st_r, (st_c, st_r)
    assert c == r
    if st_c != ct.OK:
        assert bytes(c) == frame, "a refused frame is left as it was"
    return st_c, bytes(c)


def check_identity(before: bytes, after: bytes, claim: int = CLAIM) -> None:
    assert after[22:26] == a4(claim)
    assert after[26:30] == before[26:30]


PLAIN = [
    pytest.param(tcp(b"hello"), id="tcp"),
    pytest.param(tcp(b"", flags=dpkt.tcp.TH_SYN, opts=b"\x02\x04\x05\xb4\x01\x03\x03\x07"), id="tcp-syn-opts"),
    pytest.param(tcp(bytes(range(256)) * 5), id="tcp-1280"),
    pytest.param(udp(b"q" * 33), id="udp"),
    pytest.param(udp(b""), id="udp-empty"),
    pytest.param(icmp_echo(), id="icmp-echo"),
]


@pytest.mark.parametrize("ip", PLAIN)
@pytest.mark.parametrize("claim", [CLAIM, GUEST, 0, 0xFFFFFFFF, 0x0000FFFF])
def test_full_checksums_stay_right(ip: bytes, claim: int) -> None:
    frame = vnet() + ip
    validate_outbound(frame, 1500)
    status, after = both(frame, claim)
    assert status == ct.OK
    check_identity(frame, after, claim)
    dpkt_checked(after[10:])


@pytest.mark.parametrize(
    "ip", [tcp(b"x" * 100), tcp(b"y"), udp(b"z" * 41), udp(b"")], ids=["tcp", "tcp1", "udp", "udp0"]
)
@pytest.mark.parametrize("claim", [CLAIM, 0, 0xFFFFFFFF, 0x12345678])
def test_partial_checksum_form_completes_right(ip: bytes, claim: int) -> None:
    frame = csum_frame(ip)
    validate_outbound(frame, 1500)
    status, after = both(frame, claim)
    assert status == ct.OK
    check_identity(frame, after, claim)
    # What dpkt computes for the rewritten packet from scratch...
    want = bytearray(ip)
    want[12:16] = a4(claim)
    p = dpkt.ip.IP(bytes(want))
    p.sum = 0
    p.data.sum = 0
    want_full = bytes(p)
    # ...equals the partial field completed as a NIC would (and the partial field itself is the new
    # pseudo-header sum, not its complement).
    assert complete(after[10:]) == want_full
    assert after[10:] == partial_form(want_full)
    # Negative control: updating the field as if it were a full checksum gives a wrong packet.
    wrong = bytearray(frame)
    wrong[0] = 0
    assert fp.rewrite(wrong, claim) == ct.OK
    if frame[22:26] != a4(claim):
        assert complete(wrong[10:]) != want_full


def test_udp_zero_checksum_stays_zero() -> None:
    frame = vnet() + udp(b"no checksum", no_csum=True)
    status, after = both(frame)
    assert status == ct.OK
    assert after[36:38] == b"\x00\x00"
    check_identity(frame, after)


def test_udp_result_zero_becomes_ffff() -> None:
    ip = udp(b"abcdef")
    c = int.from_bytes(ip[26:28], "big")
    old = GUEST
    hi = 0x6440
    # Solve ~C + ~old_hi + ~old_lo + hi + lo == 0 (mod 0xFFFF) for lo, so RFC 1624 yields 0x0000.
    s = (~c & 0xFFFF) + (~(old >> 16) & 0xFFFF) + (~old & 0xFFFF) + hi
    lo = (-s) % 0xFFFF
    claim = (hi << 16) | lo
    assert ref.csum_update32(c, old, claim, False) == 0, "the constructed claim hits a zero result"
    status, after = both(vnet() + ip, claim)
    assert status == ct.OK
    assert after[36:38] == b"\xff\xff"
    dpkt_checked(after[10:])


@pytest.mark.parametrize("icmp_type", [3, 11, 12])
@pytest.mark.parametrize("proto", ["udp", "tcp"])
def test_icmp_error_quotes_claim(icmp_type: int, proto: str) -> None:
    # The packet the guest received: remote -> the guest's own address; it quotes its first bytes.
    got = udp(b"dns?", src=REMOTE, dst=GUEST) if proto == "udp" else tcp(b"data", src=REMOTE, dst=GUEST)
    quoted = got[:28]
    frame = vnet() + icmp_error(icmp_type, quoted, src=GUEST, dst=REMOTE)
    validate_outbound(frame, 1500)
    status, after = both(frame)
    assert status == ct.OK
    check_identity(frame, after)
    ip = dpkt_checked(after[10:])
    emb = bytes(ip.data)[8:]
    assert emb[16:20] == a4(CLAIM), "the quoted destination is the claim address"
    assert emb[12:16] == a4(REMOTE), "the quoted source is untouched"
    assert dpkt.in_cksum(emb[:20]) == 0, "the quoted header's checksum follows"


def test_icmp_error_already_quoting_claim_changes_only_outer() -> None:
    quoted = udp(b"x", src=REMOTE, dst=CLAIM)[:28]
    frame = vnet() + icmp_error(3, quoted)
    status, after = both(frame)
    assert status == ct.OK
    assert after[30:] == frame[30:]


def test_icmp_echo_payload_untouched() -> None:
    frame = vnet() + icmp_echo(b"a" * 56, src=GUEST)
    status, after = both(frame)
    assert status == ct.OK
    assert after[30:] == frame[30:]


def test_source_already_claim_is_a_no_op() -> None:
    frame = vnet() + tcp(b"same", src=CLAIM)
    status, after = both(frame)
    assert status == ct.OK and after == frame


def with_hdr(ip: bytes, **kw: int) -> bytes:
    return vnet(**kw) + ip


T = tcp(b"payload")
U = udp(b"payload")
OTHER_CLAIM = CLAIM + 1  # another claim's overlay address


def mutate(ip: bytes, at: int, value: bytes) -> bytes:
    b = bytearray(ip)
    b[at : at + len(value)] = value
    return bytes(b)


REFUSALS = [
    ("empty", b"", ct.ERR_SHORT_HEADER),
    ("vnet-9", vnet()[:9], ct.ERR_SHORT_HEADER),
    ("vnet-only", vnet(), ct.ERR_IP_HEADER),
    ("ip-19", vnet() + T[:19], ct.ERR_IP_HEADER),
    ("version-6", vnet() + mutate(T, 0, b"\x65"), ct.ERR_IP_HEADER),
    ("ihl-4", vnet() + mutate(T, 0, b"\x44"), ct.ERR_IP_HEADER),
    ("ihl-past-end", vnet() + mutate(T, 0, b"\x4f")[:40], ct.ERR_IP_OPTIONS),
    ("total-over", vnet() + mutate(T, 2, (len(T) + 1).to_bytes(2, "big")), ct.ERR_IP_LENGTH),
    ("total-under-ihl", vnet() + mutate(T, 2, b"\x00\x13"), ct.ERR_IP_LENGTH),
    ("tcp-short", vnet() + mutate(T[:39], 2, (39).to_bytes(2, "big")), ct.ERR_L4_HEADER),
    ("tcp-doff-4", vnet() + mutate(T, 32, b"\x40"), ct.ERR_L4_HEADER),
    ("tcp-doff-past-end", vnet() + mutate(T, 32, b"\xf0"), ct.ERR_L4_HEADER),
    ("udp-short", vnet() + mutate(U[:27], 2, (27).to_bytes(2, "big")), ct.ERR_L4_HEADER),
    ("icmp-error-under-8", vnet() + mutate(icmp_error(3, b"")[:25], 2, (25).to_bytes(2, "big")), ct.ERR_L4_HEADER),
    ("icmp-error-short-quote", vnet() + icmp_error(3, b"\x45" + bytes(10)), ct.ERR_ICMP_QUOTE),
    ("icmp-error-quote-not-v4", vnet() + icmp_error(11, b"\x60" + bytes(27)), ct.ERR_ICMP_QUOTE),
    # An error quoting a packet from another claim (or from anyone but the error's destination) would
    # leave with that quoted source: only the quoted destination is rewritten.
    ("icmp-error-quotes-other-claim",
     vnet() + icmp_error(3, udp(b"q", src=OTHER_CLAIM, dst=GUEST)[:28], dst=REMOTE), ct.ERR_ICMP_QUOTE_SRC),
    ("icmp-error-quotes-own-packet", vnet() + icmp_error(11, udp(b"q")[:28]), ct.ERR_ICMP_QUOTE_SRC),
    ("icmp-error-quote-src-one-bit-off",
     vnet() + icmp_error(12, tcp(b"t", src=REMOTE ^ 1, dst=GUEST)[:28]), ct.ERR_ICMP_QUOTE_SRC),
    # The checksum write aimed at the IPv4 destination (csum_start 0, offset 16) must never happen.
    ("csum-into-ip-dst", with_hdr(T, flags=1, start=0, offset=16), ct.ERR_CSUM_START),
    ("csum-into-ip-src", with_hdr(T, flags=1, start=0, offset=12), ct.ERR_CSUM_START),
    ("csum-into-ip-dst-via-start", with_hdr(T, flags=1, start=16, offset=0), ct.ERR_CSUM_START),
    ("csum-start-off", with_hdr(T, flags=1, start=20, offset=18), ct.ERR_CSUM_OFFSET),
    ("csum-udp-tcp-offset", with_hdr(U, flags=1, start=20, offset=16), ct.ERR_CSUM_OFFSET),
    ("csum-icmp", with_hdr(icmp_echo(), flags=1, start=20, offset=2), ct.ERR_ICMP_CSUM),
    ("csum-gre", with_hdr(mutate(T, 9, b"\x2f"), flags=1, start=20, offset=16), ct.ERR_UNSUPPORTED_PROTO),
    ("csum-fragment", vnet(1, 0, 0, 0, 20, 16) + mutate(T, 6, b"\x20\x00"), ct.ERR_FRAGMENT),
    ("tso-on-udp", with_hdr(U, flags=1, gso_type=1, gso_size=100, start=20, offset=6), ct.ERR_GSO_PROTO),
    ("uso-on-tcp", with_hdr(T, flags=1, gso_type=5, gso_size=100, start=20, offset=16), ct.ERR_GSO_PROTO),
    ("ecn-on-uso", with_hdr(U, flags=1, gso_type=0x85, gso_size=100, start=20, offset=6), ct.ERR_GSO_TYPE),
    ("ecn-without-gso", with_hdr(T, gso_type=0x80), ct.ERR_GSO_TYPE),
    ("gso-ufo", with_hdr(U, gso_type=3, gso_size=100), ct.ERR_GSO_TYPE),
    ("gso-tcpv6", with_hdr(T, gso_type=4, gso_size=100), ct.ERR_GSO_TYPE),
    ("gso-size-0", with_hdr(T, flags=1, gso_type=1, gso_size=0, start=20, offset=16), ct.ERR_ZERO_GSO_SIZE),
    ("gso-fragment", vnet(0, 1, 0, 100) + mutate(T, 6, b"\x20\x00"), ct.ERR_FRAGMENT),
]


@pytest.mark.parametrize(("frame", "status"), [(f, s) for _, f, s in REFUSALS], ids=[n for n, _, _ in REFUSALS])
def test_refusals(frame: bytes, status: int) -> None:
    assert both(frame)[0] == status
    assert status in ct.REASONS


@pytest.mark.parametrize(("frame", "status"), [(f, s) for _, f, s in REFUSALS], ids=[n for n, _, _ in REFUSALS])
def test_refusal_named_as_the_validator_names_it(frame: bytes, status: int) -> None:
    # Each frame above has one fault; the validator, which runs first in the router, refuses it under
    # the same metrics token, so a fault is counted under one name whichever layer saw it.
    with pytest.raises(FrameRefused) as exc:
        validate_outbound(frame, 65535)
    assert exc.value.reason == ct.REASONS[status]


def test_every_outbound_status_has_a_refusal_case() -> None:
    seen = {s for _, _, s in REFUSALS} | {ct.ERR_SIZE, ct.ERR_NO_SPACE, ct.ERR_SLICE}  # test_core_segment
    inbound = {ct.ERR_SHORT_VXLAN, ct.ERR_SHORT_ETHERNET, ct.ERR_VXLAN_FLAGS, ct.ERR_UNKNOWN_VNI, ct.ERR_ETHERTYPE}
    assert seen | inbound == set(ct.REASONS)


def test_later_fragment_rewrites_ip_only() -> None:
    ip = mutate(udp(b"x" * 64), 6, b"\x00\x10")  # fragment offset 128: no UDP header here
    ip = mutate(ip, 10, b"\x00\x00")
    ip = mutate(ip, 10, ref.checksum(ip[:20]).to_bytes(2, "big"))
    status, after = both(vnet() + ip)
    assert status == ct.OK
    assert after[30:] == (vnet() + ip)[30:]
    assert dpkt.in_cksum(after[10:30]) == 0


def with_ip_options(t: bytes, opts: bytes) -> bytes:
    """``t`` with IPv4 options inserted, total length and header checksum right."""
    ihl = 5 + len(opts) // 4
    ip = bytearray(bytes([0x40 | ihl]) + t[1:20] + opts + t[20:])
    ip[2:4] = (len(t) + len(opts)).to_bytes(2, "big")
    ip[10:12] = b"\x00\x00"
    ip[10:12] = ref.checksum(ip[: ihl * 4]).to_bytes(2, "big")
    return bytes(ip)


@pytest.mark.parametrize("opts", [b"\x01\x01\x01\x00", b"\x01" * 40], ids=["ihl-6", "ihl-15"])
@pytest.mark.parametrize("kind", ["plain", "csum-at-ihl", "tso-csum-at-ihl"])
def test_ip_options_refused(opts: bytes, kind: str) -> None:
    # IHL != 5 is refused as validate_outbound refuses it, even with csum_start pointing at the L4
    # header past the options: L4 always starts at 20. C and reference agree; nothing is written.
    ip = with_ip_options(tcp(b"opts" * 100), opts)
    ihl = 20 + len(opts)
    hdr = {"plain": vnet(), "csum-at-ihl": vnet(1, 0, 0, 0, ihl, 16), "tso-csum-at-ihl": vnet(1, 1, 0, 100, ihl, 16)}
    frame = hdr[kind] + ip
    assert both(frame)[0] == ct.ERR_IP_OPTIONS
    p = ct.OutParams(claim=CLAIM, prefix=PREFIX, mtu=65535)
    out = bytearray(1 << 16)
    assert fp.segment(frame, p, out) == (ct.ERR_IP_OPTIONS, None)
    assert ref.segment(frame, p, len(out)) == (ct.ERR_IP_OPTIONS, b"", None)
    with pytest.raises(FrameRefused) as exc:
        validate_outbound(frame, 65535)
    assert exc.value.reason == ct.REASONS[ct.ERR_IP_OPTIONS] == "ip_options"


def test_trailing_bytes_ignored() -> None:
    ip = tcp(b"trail")
    frame = vnet() + ip + b"trailing"
    status, after = both(frame)
    assert status == ct.OK
    assert after.endswith(b"trailing")
    pkt = dpkt_checked(after[10 : 10 + len(ip)])
    assert pkt.src == a4(CLAIM)


def test_random_bytes_c_equals_reference() -> None:
    rnd = random.Random(3)
    base = [vnet() + tcp(b"abc" * 9), vnet() + udp(b"u" * 20), vnet() + icmp_error(3, udp(b"q")[:28]),
            csum_frame(tcp(b"p" * 30)), csum_frame(udp(b"d" * 9))]
    for _ in range(4000):
        f = bytearray(rnd.choice(base))
        for _ in range(rnd.randrange(1, 4)):
            f[rnd.randrange(len(f))] = rnd.randrange(256)
        if rnd.random() < 0.2:
            f = f[: rnd.randrange(len(f) + 1)]
        both(bytes(f), rnd.getrandbits(32))
    for _ in range(1000):
        both(rnd.randbytes(rnd.randrange(80)), rnd.getrandbits(32))


@st.composite
def tcp_udp_frames(draw: st.DrawFn) -> tuple[bytes, int]:
    payload = draw(st.binary(max_size=300))
    src = draw(st.integers(0, 0xFFFFFFFF))
    dst = draw(st.integers(0, 0xFFFFFFFF))
    kind = draw(st.sampled_from(["tcp", "udp", "udp0", "icmp"]))
    if kind == "tcp":
        ip = tcp(payload, src=src, dst=dst, seq=draw(st.integers(0, 0xFFFFFFFF)))
    elif kind == "icmp":
        ip = icmp_error(draw(st.sampled_from([3, 11, 12])), udp(payload, src=dst, dst=src)[:28 + len(payload) % 9],
                        src=src, dst=dst)
    else:
        ip = udp(payload, src=src, dst=dst, no_csum=kind == "udp0")
    frame = csum_frame(ip) if kind in ("tcp", "udp") and draw(st.booleans()) else vnet() + ip
    return frame, draw(st.integers(0, 0xFFFFFFFF))


@settings(max_examples=400, deadline=None)
@given(tcp_udp_frames())
def test_property_valid_frames(fc: tuple[bytes, int]) -> None:
    frame, claim = fc
    validate_outbound(frame, 65535)
    status, after = both(frame, claim)
    assert status == ct.OK
    check_identity(frame, after, claim)
    if frame[0] & 1:
        dpkt_checked(complete(after[10:]))
    else:
        dpkt_checked(after[10:])


@pytest.mark.parametrize(
    ("icmp_type", "quoted", "accepted"),
    [
        (3, udp(b"dns?", src=REMOTE, dst=GUEST)[:28], True),
        (11, tcp(b"t", src=REMOTE, dst=GUEST)[:20], True),
        (12, b"\x46" + bytes(11) + a4(REMOTE) + bytes(12), True),  # quoted options: destination still at 16
        (3, udp(b"q", src=REMOTE, dst=GUEST)[:19], False),
        (11, b"", False),
        (12, b"\x60" + bytes(39), False),
        (3, b"\x44" + bytes(27), False),
    ],
)
def test_icmp_quote_validator_and_core_agree(icmp_type: int, quoted: bytes, accepted: bool) -> None:
    # The validator accepts exactly the ICMP errors whose quote the rewrite can carry the claim into.
    frame = vnet() + icmp_error(icmp_type, quoted)
    status, after = both(frame)
    if accepted:
        validate_outbound(frame, 1500)
        assert status == ct.OK
        assert after[10 + 28 + 16 : 10 + 28 + 20] == a4(CLAIM)
    else:
        with pytest.raises(FrameRefused) as exc:
            validate_outbound(frame, 1500)
        assert exc.value.reason == ct.REASONS[status] == "bad_icmp_quote"
