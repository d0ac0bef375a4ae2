"""PROXY v2 preamble codec: golden bytes, round trips, truncations, mutations, every reason token."""

from __future__ import annotations

import ipaddress
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from preamble_cases import GOLDEN, V4_ADDRS, V6_ADDRS, build, golden_bytes, tlv

from sbxnet.errors import LocalProtocolError, RemoteProtocolError
from sbxnet.protocol.preamble import (
    DEADLINE_MAX_MS,
    DEFAULT_MAX_LEN,
    HEADER_LEN,
    SIGNATURE,
    TLV_CRC32C,
    TLV_DEADLINE,
    TLV_NOOP,
    TLV_SANDBOX_ID,
    TLV_UNIQUE_ID,
    Preamble,
    PreambleError,
    crc32c_checksum,
    pull_preamble,
    push_preamble,
)

ip = ipaddress.ip_address

# --- strategies ------------------------------------------------------------------------------------

sandbox_ids = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
connection_ids = st.none() | st.binary(min_size=1, max_size=128)
deadlines = st.none() | st.integers(1, 300_000)
ports = st.integers(0, 65535)
dst_ports = st.integers(1, 65535)


@st.composite
def preambles(draw: st.DrawFn) -> Preamble:
    addrs = draw(st.sampled_from([st.ip_addresses(v=4), st.ip_addresses(v=6)]))
    return Preamble(
        src=draw(addrs),
        src_port=draw(ports),
        dst=draw(addrs),
        dst_port=draw(dst_ports),
        sandbox_id=draw(sandbox_ids),
        connection_id=draw(connection_ids),
        deadline_ms=draw(deadlines),
    )


def expect_reason(data: bytes, reason: str, **kw: int) -> PreambleError:
    with pytest.raises(PreambleError) as ei:
        pull_preamble(data, **kw)
    assert ei.value.reason == reason, ei.value
    return ei.value


def assert_every_prefix_incomplete(data: bytes, total: int) -> None:
    for n in range(total):
        assert pull_preamble(data[:n]) is None, n


# --- CRC32C ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (b"", 0x00000000),
        (b"123456789", 0xE3069283),  # the standard check value for CRC-32C
        (b"\x00" * 32, 0x8A9136AA),  # RFC 3720 B.4
        (b"\xff" * 32, 0x62A8AB43),  # RFC 3720 B.4
        (bytes(range(32)), 0x46DD794E),  # RFC 3720 B.4
    ],
)
def test_crc32c_known_values(data: bytes, want: int) -> None:
    assert crc32c_checksum(data) == want


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 600))
def test_crc32c_matches_independent_implementation(data: bytes, cut: int) -> None:
    crc32c = pytest.importorskip("crc32c", reason="the crc32c package is the independent oracle")
    assert crc32c_checksum(data) == crc32c.crc32c(data)
    cut = min(cut, len(data))
    assert crc32c_checksum(data[cut:], crc32c_checksum(data[:cut])) == crc32c.crc32c(data)


# --- golden bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "p", "crc", "hexstr"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_encode(name: str, p: Preamble, crc: bool, hexstr: str) -> None:
    assert push_preamble(p, crc32c=crc) == golden_bytes(hexstr)


@pytest.mark.parametrize(("name", "p", "crc", "hexstr"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_decode(name: str, p: Preamble, crc: bool, hexstr: str) -> None:
    data = golden_bytes(hexstr)
    assert pull_preamble(data) == (p, len(data))
    assert pull_preamble(bytearray(data)) == (p, len(data))
    assert pull_preamble(memoryview(data + b"tail")) == (p, len(data))
    assert_every_prefix_incomplete(data, len(data))


def test_golden_crc_field_is_crc_of_zeroed_header() -> None:
    for _name, _p, crc, hexstr in GOLDEN:
        if not crc:
            continue
        data = golden_bytes(hexstr)
        at = data.index(bytes((TLV_CRC32C, 0, 4)), HEADER_LEN) + 3
        (got,) = struct.unpack_from("!I", data, at)
        assert got == crc32c_checksum(data[:at] + b"\0\0\0\0" + data[at + 4 :])


# --- round trips -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(preambles(), st.booleans(), st.binary(max_size=64))
def test_round_trip_whole_and_with_trailing_data(p: Preamble, crc: bool, tail: bytes) -> None:
    data = push_preamble(p, crc32c=crc)
    assert len(data) <= DEFAULT_MAX_LEN
    assert pull_preamble(data) == (p, len(data))
    assert pull_preamble(data + tail) == (p, len(data))
    # a second preamble straight after the first is left for the caller
    assert pull_preamble(data + data) == (p, len(data))


@settings(max_examples=60, deadline=None)
@given(preambles(), st.booleans())
def test_round_trip_fed_one_byte_at_a_time(p: Preamble, crc: bool) -> None:
    data = push_preamble(p, crc32c=crc)
    buf = bytearray()
    for i, b in enumerate(data):
        buf.append(b)
        got = pull_preamble(buf)
        if i < len(data) - 1:
            assert got is None, i
        else:
            assert got == (p, len(data))


@settings(max_examples=60, deadline=None)
@given(preambles(), st.booleans())
def test_every_truncation_is_incomplete(p: Preamble, crc: bool) -> None:
    data = push_preamble(p, crc32c=crc)
    assert_every_prefix_incomplete(data, len(data))


def test_largest_preamble_fits_default_bound() -> None:
    p = Preamble(ip("::1"), 1, ip("::2"), 2, "a" * 64, b"u" * 128, DEADLINE_MAX_MS)
    data = push_preamble(p, crc32c=True)
    assert len(data) == 16 + 36 + 7 + 3 + 128 + 3 + 64 + 7 == 264
    assert pull_preamble(data) == (p, len(data))


# --- the bound -------------------------------------------------------------------------------------


def test_max_len_is_inclusive() -> None:
    data = golden_bytes(GOLDEN[0][3])
    assert pull_preamble(data, max_len=len(data)) == (GOLDEN[0][1], len(data))
    expect_reason(data, "too_long", max_len=len(data) - 1)


def test_too_long_fails_on_the_header_alone() -> None:
    header = build(length=DEFAULT_MAX_LEN - HEADER_LEN + 1)[:HEADER_LEN]
    expect_reason(header, "too_long")
    assert pull_preamble(build(length=DEFAULT_MAX_LEN - HEADER_LEN)[:HEADER_LEN]) is None
    expect_reason(build(length=0xFFFF)[:HEADER_LEN], "too_long")


# --- fail fast -------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", [b"G", b"\x16", b"\x00", b"\n", b"P"])  # HTTP, TLS, NUL, v1 "PROXY"
def test_bad_first_byte_fails_at_once(first: bytes) -> None:
    expect_reason(first, "bad_signature")


@pytest.mark.parametrize("i", range(12))
def test_any_wrong_signature_byte_fails_at_that_byte(i: int) -> None:
    wrong = bytearray(SIGNATURE[: i + 1])
    wrong[i] ^= 0x40
    expect_reason(bytes(wrong), "bad_signature")
    if i:
        assert pull_preamble(SIGNATURE[:i]) is None


def test_version_command_family_judged_as_they_arrive() -> None:
    expect_reason(SIGNATURE + b"\x11", "bad_version")
    expect_reason(SIGNATURE + b"\x20", "bad_command")
    expect_reason(SIGNATURE + b"\x21\x12", "bad_family")
    assert pull_preamble(SIGNATURE + b"\x21\x11\x00") is None


# --- every reason token ----------------------------------------------------------------------------

REASON_CASES: list[tuple[str, str, bytes]] = [
    ("bad_signature", "http", b"GET / HTTP/1.1\r\n\r\n"),
    ("bad_signature", "v1", b"PROXY TCP4 1.2.3.4 10.0.0.5 1234 8080\r\n"),
    ("bad_signature", "last_byte", SIGNATURE[:11] + b"\x0b" + bytes(40)),
    ("bad_version", "v1_nibble", build(vc=0x11)),
    ("bad_version", "v3_nibble", build(vc=0x31)),
    ("bad_version", "zero", build(vc=0x01)),
    ("bad_command", "local", build(vc=0x20)),
    ("bad_command", "unassigned", build(vc=0x22)),
    ("bad_command", "high", build(vc=0x2F)),
    ("bad_family", "unspec", build(fam=0x00, addrs=b"")),
    ("bad_family", "udp4", build(fam=0x12)),
    ("bad_family", "udp6", build(fam=0x22, addrs=V6_ADDRS)),
    ("bad_family", "unix_stream", build(fam=0x31, addrs=bytes(216))),
    ("bad_family", "inet_unspec_transport", build(fam=0x10)),
    ("bad_family", "unassigned", build(fam=0x41)),
    ("too_long", "declared", build(length=600)),
    ("short_addresses", "v4_empty", build(length=0)),
    ("short_addresses", "v4_11", build(length=11)),
    ("short_addresses", "v6_with_v4_block", build(fam=0x21, addrs=V4_ADDRS)),
    ("bad_port", "dst_0_v4", build(addrs=V4_ADDRS[:10] + b"\0\0")),
    ("bad_port", "dst_0_v6", build(fam=0x21, addrs=V6_ADDRS[:34] + b"\0\0")),
    ("bad_tlv", "header_cut_1", build(length=12 + 7 + 1) + b"\xe0"),
    ("bad_tlv", "header_cut_2", build(length=12 + 7 + 2) + b"\xe0\x00"),
    ("bad_tlv", "value_past_end", build(tlvs=[], length=12 + 7) + b"\xe0\x00\x05sb-1"),
    ("bad_tlv", "value_len_ffff", build(length=12 + 7 + 3) + b"\x04\xff\xff"),
    ("duplicate_tlv", "sandbox_id", build(tlvs=[(0xE0, b"a"), (0xE0, b"a")])),
    ("duplicate_tlv", "unique_id", build(tlvs=[(0x05, b"a"), (0xE0, b"a"), (0x05, b"b")])),
    ("duplicate_tlv", "crc", build(tlvs=[(0x03, b"\0\0\0\0"), (0xE0, b"a")], crc=True)),
    ("duplicate_tlv", "deadline", build(tlvs=[(0xE0, b"a"), (0xE1, b"\0\0\0\1"), (0xE1, b"\0\0\0\1")])),
    ("bad_deadline", "empty", build(tlvs=[(0xE0, b"a"), (0xE1, b"")])),
    ("bad_deadline", "three_bytes", build(tlvs=[(0xE0, b"a"), (0xE1, b"\0\x27\x10")])),
    ("bad_deadline", "five_bytes", build(tlvs=[(0xE0, b"a"), (0xE1, b"\0\0\0\x27\x10")])),
    ("bad_deadline", "zero", build(tlvs=[(0xE0, b"a"), (0xE1, b"\0\0\0\0")])),
    ("bad_deadline", "300001_ms", build(tlvs=[(0xE0, b"a"), (0xE1, struct.pack("!I", 300_001))])),
    ("bad_deadline", "u32_max", build(tlvs=[(0xE1, b"\xff\xff\xff\xff"), (0xE0, b"a")])),
    ("missing_sandbox_id", "no_tlvs", build(tlvs=[])),
    ("missing_sandbox_id", "only_noop", build(tlvs=[(0x04, b"pad")])),
    ("missing_sandbox_id", "only_unique_id", build(tlvs=[(0x05, b"abc")])),
    ("bad_sandbox_id", "empty", build(tlvs=[(0xE0, b"")])),
    ("bad_sandbox_id", "65_bytes", build(tlvs=[(0xE0, b"a" * 65)])),
    ("bad_sandbox_id", "space", build(tlvs=[(0xE0, b"a b")])),
    ("bad_sandbox_id", "slash", build(tlvs=[(0xE0, b"../etc")])),
    ("bad_sandbox_id", "nul", build(tlvs=[(0xE0, b"a\0")])),
    ("bad_sandbox_id", "newline", build(tlvs=[(0xE0, b"a\n")])),
    ("bad_sandbox_id", "non_ascii_utf8", build(tlvs=[(0xE0, "caf\u00e9".encode())])),
    ("bad_sandbox_id", "bad_utf8", build(tlvs=[(0xE0, b"\xff\xfe")])),
    ("bad_unique_id", "empty", build(tlvs=[(0x05, b""), (0xE0, b"a")])),
    ("bad_unique_id", "129_bytes", build(tlvs=[(0x05, b"u" * 129), (0xE0, b"a")])),
    ("bad_crc", "mismatch", build(crc=True, crc_value=0x12345678)),
    ("bad_crc", "zero", build(crc=True, crc_value=0)),
    ("bad_crc", "three_bytes", build(tlvs=[(0x03, b"abc"), (0xE0, b"a")])),
    ("bad_crc", "five_bytes", build(tlvs=[(0x03, b"abcde"), (0xE0, b"a")])),
    ("unknown_tlv", "custom_e2", build(tlvs=[(0xE0, b"a"), (0xE2, b"x")])),
    ("unknown_tlv", "custom_ef", build(tlvs=[(0xEF, b""), (0xE0, b"a")])),
    ("unknown_tlv", "experiment_f0", build(tlvs=[(0xE0, b"a"), (0xF0, b"x")])),
    ("unknown_tlv", "future_ff", build(tlvs=[(0xE0, b"a"), (0xFF, b"x")])),
    ("unknown_tlv", "zero_type", build(tlvs=[(0x00, b""), (0xE0, b"a")])),
    ("unknown_tlv", "unassigned_06", build(tlvs=[(0x06, b"x"), (0xE0, b"a")])),
    ("unknown_tlv", "ssl_subtype_at_top", build(tlvs=[(0x21, b"TLSv1.3"), (0xE0, b"a")])),
]

ALL_REASONS = {
    "bad_signature",
    "bad_version",
    "bad_command",
    "bad_family",
    "too_long",
    "short_addresses",
    "bad_port",
    "bad_tlv",
    "duplicate_tlv",
    "missing_sandbox_id",
    "bad_sandbox_id",
    "bad_unique_id",
    "bad_crc",
    "bad_deadline",
    "unknown_tlv",
}


def test_every_reason_token_has_a_case() -> None:
    assert {r for r, _, _ in REASON_CASES} == ALL_REASONS


@pytest.mark.parametrize(
    ("reason", "name", "data"), REASON_CASES, ids=[f"{r}-{n}" for r, n, _ in REASON_CASES]
)
def test_reason(reason: str, name: str, data: bytes) -> None:
    err = expect_reason(data, reason)
    assert isinstance(err, RemoteProtocolError)
    # also with bytes after it: the verdict does not depend on what follows
    with pytest.raises(PreambleError) as ei:
        pull_preamble(data + b"\0" * 600)
    assert ei.value.reason == reason


def test_error_text_never_carries_peer_bytes() -> None:
    err = expect_reason(build(tlvs=[(0xE0, b"evil\ninjected")]), "bad_sandbox_id")
    assert "evil" not in str(err) and "injected" not in str(err)


def test_src_port_zero_is_accepted() -> None:
    data = build(addrs=V4_ADDRS[:8] + b"\0\0" + V4_ADDRS[10:])
    got = pull_preamble(data)
    assert got is not None and got[0].src_port == 0


@pytest.mark.parametrize("t", [0x01, 0x02, 0x04, 0x20, 0x30])
def test_registered_tlvs_are_ignored(t: int) -> None:
    data = build(tlvs=[(t, b"abc"), (0xE0, b"sb-1"), (t, b"")])
    assert pull_preamble(data) == (
        Preamble(ip("1.2.3.4"), 1234, ip("10.0.0.5"), 8080, "sb-1"),
        len(data),
    )


def test_noop_padding_and_crc_together() -> None:
    data = build(tlvs=[(TLV_NOOP, bytes(100)), (TLV_UNIQUE_ID, b"id"), (TLV_SANDBOX_ID, b"s")], crc=True)
    got = pull_preamble(data)
    assert got is not None and got[0].connection_id == b"id" and got[0].sandbox_id == "s"


def test_corruption_under_crc_reports_bad_crc_first() -> None:
    data = bytearray(build(tlvs=[(0xE0, b"good")], crc=True))
    data[-1] = ord(" ")  # would be bad_sandbox_id without the CRC
    expect_reason(bytes(data), "bad_crc")


def test_ipv6_family_keeps_ipv6_addresses() -> None:
    data = build(fam=0x21)
    got = pull_preamble(data)
    assert got is not None
    assert got[0].src == ip("2001:db8::1") and got[0].dst == ip("fd00::5")
    assert (got[0].src_port, got[0].dst_port) == (443, 80)


# --- push refuses what pull would refuse -----------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "reason"),
    [
        (Preamble(ip("1.2.3.4"), 1, ip("::1"), 2, "s"), "bad_family"),
        (Preamble(ip("::1"), 1, ip("1.2.3.4"), 2, "s"), "bad_family"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 0, "s"), "bad_port"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 65536, "s"), "bad_port"),
        (Preamble(ip("1.2.3.4"), -1, ip("1.2.3.5"), 1, "s"), "bad_port"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, ""), "bad_sandbox_id"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "a" * 65), "bad_sandbox_id"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "caf\u00e9"), "bad_sandbox_id"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "s", b""), "bad_unique_id"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "s", b"x" * 129), "bad_unique_id"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "s", None, 0), "bad_deadline"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "s", None, 300_001), "bad_deadline"),
        (Preamble(ip("1.2.3.4"), 1, ip("1.2.3.5"), 1, "s", None, True), "bad_deadline"),
    ],
)
def test_push_refuses(p: Preamble, reason: str) -> None:
    with pytest.raises(LocalProtocolError) as ei:
        push_preamble(p)
    assert ei.value.reason == reason


# --- a model of the profile, against generated well-framed preambles -------------------------------

KNOWN_SINGLE = {TLV_CRC32C, TLV_UNIQUE_ID, TLV_SANDBOX_ID, TLV_DEADLINE}
IGNORED = {0x01, 0x02, 0x04, 0x20, 0x30}


def model(
    fam: int, dst_port: int, tlvs: list[tuple[int, bytes]], crc: bool, crc_ok: bool
) -> str | tuple[str, bytes | None, int | None]:
    """The documented rules, written as plainly as possible: a reason, or (sandbox id, unique id,
    deadline)."""
    addr_len = 36 if fam == 0x21 else 12
    walk = ([(0x03, b"....")] if crc else []) + tlvs
    total = 16 + addr_len + sum(3 + len(v) for _, v in walk)
    if total > DEFAULT_MAX_LEN:
        return "too_long"
    if dst_port == 0:
        return "bad_port"
    seen: dict[int, bytes] = {}
    for t, v in walk:
        if t in KNOWN_SINGLE:
            if t in seen:
                return "duplicate_tlv"
            seen[t] = v
        elif t not in IGNORED:
            return "unknown_tlv"
    if 0x03 in seen and (len(seen[0x03]) != 4 or not crc_ok):
        return "bad_crc"
    if 0x05 in seen and not 1 <= len(seen[0x05]) <= 128:
        return "bad_unique_id"
    deadline = None
    if 0xE1 in seen:
        if len(seen[0xE1]) != 4 or not 1 <= int.from_bytes(seen[0xE1], "big") <= 300_000:
            return "bad_deadline"
        deadline = int.from_bytes(seen[0xE1], "big")
    if 0xE0 not in seen:
        return "missing_sandbox_id"
    sid = seen[0xE0]
    if not (
        1 <= len(sid) <= 64
        and all(c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-" for c in sid)
    ):
        return "bad_sandbox_id"
    return sid.decode(), seen.get(0x05), deadline


tlv_types = st.sampled_from(
    [0x01, 0x02, 0x04, 0x05, 0x20, 0x30, 0xE0, 0xE0, 0xE0, 0xE1, 0xE1, 0xE2, 0xEF, 0xF3, 0x06, 0x21]
)


@st.composite
def tlv_value(draw: st.DrawFn, t: int) -> bytes:
    if t == 0xE0:
        return draw(sandbox_ids.map(str.encode) | st.binary(max_size=70))
    if t == 0x05:
        return draw(st.binary(min_size=0, max_size=130))
    if t == 0xE1:  # valid, at the bounds and past them, or any bytes
        ms = st.sampled_from([0, 1, 299_999, 300_000, 300_001, 0xFFFFFFFF]) | st.integers(0, 400_000)
        return draw(ms.map(lambda n: struct.pack("!I", n)) | st.binary(max_size=6))
    return draw(st.binary(max_size=40))


tlv_lists = st.lists(tlv_types.flatmap(lambda t: tlv_value(t).map(lambda v: (t, v))), max_size=5)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fam=st.sampled_from([0x11, 0x21]),
    dst_port=st.sampled_from([0, 1, 80, 65535]),
    tlvs=tlv_lists,
    crc=st.booleans(),
    crc_ok=st.booleans(),
)
def test_parser_agrees_with_model(
    fam: int, dst_port: int, tlvs: list[tuple[int, bytes]], crc: bool, crc_ok: bool
) -> None:
    addrs = (V6_ADDRS if fam == 0x21 else V4_ADDRS)[:-2] + struct.pack("!H", dst_port)
    data = build(fam=fam, addrs=addrs, tlvs=tlvs, crc=crc, crc_value=None if crc_ok else 0xDEADBEEF)
    want = model(fam, dst_port, tlvs, crc, crc_ok)
    if isinstance(want, str):
        expect_reason(data, want)
    else:
        got = pull_preamble(data)
        assert got is not None
        p, n = got
        assert n == len(data)
        assert (p.sandbox_id, p.connection_id, p.deadline_ms) == want
        assert p.dst_port == dst_port


# --- byte-level mutations: parse or PreambleError, never anything else ------------------------------

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 600), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 600), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 600), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 600), st.integers(1, 8)),
    st.tuples(st.just("length"), st.integers(0, 0xFFFF), st.just(0)),
    st.tuples(st.just("length_delta"), st.integers(-8, 8), st.just(0)),
    st.tuples(st.just("tlv"), st.integers(0, 255), st.binary(max_size=70)),
    st.tuples(st.just("tlv_lie"), st.integers(0, 255), st.integers(0, 0xFFFF)),
)


def mutate(data: bytes, muts: list[tuple[str, int, Any]], fix_length: bool) -> bytes:
    b = bytearray(data)
    for kind, a, x in muts:
        if kind == "flip" and b:
            b[a % len(b)] ^= int(x)
        elif kind == "set" and b:
            b[a % len(b)] = int(x)
        elif kind == "insert":
            at = a % (len(b) + 1)
            b[at:at] = x
        elif kind == "delete" and b:
            at = a % len(b)
            del b[at : at + int(x)]
        elif kind == "length" and len(b) >= 16:
            b[14:16] = struct.pack("!H", a)
        elif kind == "length_delta" and len(b) >= 16:
            b[14:16] = struct.pack("!H", (struct.unpack_from("!H", b, 14)[0] + a) % 0x10000)
        elif kind == "tlv":
            b += tlv(a, x)
        elif kind == "tlv_lie":
            b += bytes((a,)) + struct.pack("!H", int(x)) + b"abc"
    if fix_length and len(b) >= 16:
        b[14:16] = struct.pack("!H", (len(b) - 16) % 0x10000)
    return bytes(b)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([golden_bytes(g[3]) for g in GOLDEN]) | preambles().map(push_preamble),
    st.lists(mutation, min_size=1, max_size=4),
    st.booleans(),
)
def test_mutations_parse_or_refuse(data: bytes, muts: list[tuple[str, int, Any]], fix: bool) -> None:
    m = mutate(data, muts, fix)
    try:
        got = pull_preamble(m)
    except PreambleError:
        return
    if got is None:
        assert len(m) < DEFAULT_MAX_LEN
        return
    p, n = got
    assert 0 < n <= len(m)
    # whatever we accept re-encodes to something we accept as the same value
    for crc in (False, True):
        again = push_preamble(p, crc32c=crc)
        assert pull_preamble(again) == (p, len(again))
    # and the accepted bytes alone parse the same; every shorter prefix is incomplete
    assert pull_preamble(m[:n]) == (p, n)
    assert_every_prefix_incomplete(m, n)
