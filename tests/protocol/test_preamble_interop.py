"""Interop with an independent PROXY v2 implementation: the ``proxy-protocol`` package.

It parses what we send (addresses, ports, TLVs, and the CRC32C when the ``crc32c`` package it uses is
installed), and we parse what it builds.
"""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from preamble_cases import GOLDEN, golden_bytes

from sbxnet.protocol.preamble import Preamble, PreambleError, pull_preamble, push_preamble

proxyprotocol = pytest.importorskip("proxyprotocol", reason="the proxy-protocol package is the oracle")
from proxyprotocol import ProxyProtocolChecksumError  # noqa: E402
from proxyprotocol.result import (  # noqa: E402
    ProxyResultIPv4,
    ProxyResultIPv6,
    ProxyResultLocal,
)
from proxyprotocol.tlv import ProxyProtocolTLV  # noqa: E402
from proxyprotocol.v2 import ProxyProtocolV2  # noqa: E402

try:
    import crc32c as _crc32c  # noqa: F401  (proxy-protocol computes CRC32C only when this is present)

    HAVE_CRC = True
except ImportError:
    HAVE_CRC = False

needs_crc = pytest.mark.skipif(
    not HAVE_CRC, reason="proxy-protocol verifies/builds CRC32C only with the crc32c package installed"
)

V2 = ProxyProtocolV2()
sandbox_ids = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)


@st.composite
def preambles(draw: st.DrawFn) -> Preamble:
    addrs = draw(st.sampled_from([st.ip_addresses(v=4), st.ip_addresses(v=6)]))
    return Preamble(
        draw(addrs),
        draw(st.integers(0, 65535)),
        draw(addrs),
        draw(st.integers(1, 65535)),
        draw(sandbox_ids),
        draw(st.none() | st.binary(min_size=1, max_size=128)),
        draw(st.none() | st.integers(1, 300_000)),
    )


def theirs_parse(data: bytes) -> ProxyResultIPv4 | ProxyResultIPv6:
    result = V2.unpack(data)
    assert isinstance(result, ProxyResultIPv4 | ProxyResultIPv6)
    return result


def assert_same(result: ProxyResultIPv4 | ProxyResultIPv6, p: Preamble, crc: bool) -> None:
    assert result.protocol == socket.SOCK_STREAM
    assert result.source == (p.src, p.src_port)
    assert result.dest == (p.dst, p.dst_port)
    assert result.tlv[0xE0] == p.sandbox_id.encode()
    assert result.tlv.get(0x05) == p.connection_id
    assert result.tlv.get(0xE1) == (None if p.deadline_ms is None else p.deadline_ms.to_bytes(4, "big"))
    assert (result.tlv.crc32c is not None) == crc


def theirs_build(p: Preamble, crc: bool) -> bytes:
    init = {0xE0: p.sandbox_id.encode()}
    if p.deadline_ms is not None:
        init[0xE1] = p.deadline_ms.to_bytes(4, "big")
    tlv = ProxyProtocolTLV(init=init, unique_id=p.connection_id, auto_crc32c=crc)
    cls = ProxyResultIPv4 if isinstance(p.src, ipaddress.IPv4Address) else ProxyResultIPv6
    result = cls((p.src, p.src_port), (p.dst, p.dst_port), protocol=socket.SOCK_STREAM, tlv=tlv)  # type: ignore[arg-type]
    return V2.pack(result)


@pytest.mark.parametrize(("name", "p", "crc", "hexstr"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_they_parse_our_golden(name: str, p: Preamble, crc: bool, hexstr: str) -> None:
    if crc and not HAVE_CRC:
        pytest.skip("CRC32C verification needs the crc32c package")
    assert_same(theirs_parse(golden_bytes(hexstr)), p, crc)


@settings(max_examples=150, deadline=None)
@given(preambles())
def test_they_parse_what_we_send(p: Preamble) -> None:
    assert_same(theirs_parse(push_preamble(p)), p, crc=False)


@needs_crc
@settings(max_examples=150, deadline=None)
@given(preambles())
def test_they_verify_our_crc(p: Preamble) -> None:
    data = push_preamble(p, crc32c=True)
    assert_same(theirs_parse(data), p, crc=True)
    # and they notice when it is wrong, so the check above is a real one
    bad = bytearray(data)
    bad[-1] ^= 0x01
    with pytest.raises(ProxyProtocolChecksumError):
        V2.unpack(bytes(bad))


@settings(max_examples=150, deadline=None)
@given(preambles())
def test_we_parse_what_they_send(p: Preamble) -> None:
    data = theirs_build(p, crc=False)
    assert pull_preamble(data + b"payload") == (p, len(data))


@needs_crc
@settings(max_examples=150, deadline=None)
@given(preambles())
def test_we_verify_their_crc(p: Preamble) -> None:
    data = theirs_build(p, crc=True)
    assert pull_preamble(data) == (p, len(data))
    # their output is byte-identical to ours: same field order, same CRC
    assert data == push_preamble(p, crc32c=True)


def test_we_refuse_their_local_and_unspec() -> None:
    local = V2.pack(ProxyResultLocal(tlv=ProxyProtocolTLV(init={0xE0: b"sb"})))
    with pytest.raises(PreambleError) as ei:
        pull_preamble(local)
    assert ei.value.reason == "bad_command"
    src = (ipaddress.IPv4Address("1.2.3.4"), 1)
    dst = (ipaddress.IPv4Address("10.0.0.1"), 2)
    unspec = V2.pack(ProxyResultIPv4(src, dst, protocol=None, tlv=ProxyProtocolTLV(init={0xE0: b"sb"})))
    with pytest.raises(PreambleError) as ei:
        pull_preamble(unspec)
    assert ei.value.reason == "bad_family"
    udp = V2.pack(ProxyResultIPv4(src, dst, protocol=socket.SOCK_DGRAM, tlv=ProxyProtocolTLV(init={0xE0: b"sb"})))
    with pytest.raises(PreambleError) as ei:
        pull_preamble(udp)
    assert ei.value.reason == "bad_family"


def test_we_ignore_their_registered_tlvs() -> None:
    p = Preamble(ipaddress.ip_address("1.2.3.4"), 5, ipaddress.ip_address("10.0.0.1"), 6, "sb", b"id")
    tlv = ProxyProtocolTLV(init={0xE0: b"sb"}, unique_id=b"id", alpn=b"h2", authority="example.com", netns="ns1")
    data = V2.pack(ProxyResultIPv4((p.src, 5), (p.dst, 6), protocol=socket.SOCK_STREAM, tlv=tlv))  # type: ignore[arg-type]
    assert pull_preamble(data) == (p, len(data))
