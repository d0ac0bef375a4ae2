"""Shared tables and builders for the preamble tests, the interop tests and the fuzz seeds.

GOLDEN: (name, Preamble, with_crc, wire hex split by field). The hex was laid out by hand from the
HAProxy spec; the CRC values are checked against an independent CRC32C and an independent PROXY v2
implementation in test_preamble.py.
"""

from __future__ import annotations

import ipaddress
import struct

from sbxnet.protocol.preamble import SIGNATURE, Preamble, crc32c_checksum

ip = ipaddress.ip_address
SIG = "0d0a0d0a000d0a515549540a"

GOLDEN: list[tuple[str, Preamble, bool, str]] = [
    (
        "v4_minimal",
        Preamble(ip("1.2.3.4"), 1234, ip("10.0.0.5"), 8080, "sb-1"),
        False,
        SIG + "21 11 0013 01020304 0a000005 04d2 1f90 e0000473622d31",
    ),
    (
        "v4_minimal_crc",
        Preamble(ip("1.2.3.4"), 1234, ip("10.0.0.5"), 8080, "sb-1"),
        True,
        SIG + "21 11 001a 01020304 0a000005 04d2 1f90 0300045ff98a6d e0000473622d31",
    ),
    (
        "v4_unique_id",
        Preamble(ip("192.0.2.10"), 50000, ip("10.1.2.3"), 3000, "sandbox.A_b-9", b"conn-42"),
        False,
        SIG + "21 11 0026 c000020a 0a010203 c350 0bb8 050007636f6e6e2d3432 e0000d73616e64626f782e415f622d39",
    ),
    (
        "v4_unique_id_crc",
        Preamble(ip("192.0.2.10"), 50000, ip("10.1.2.3"), 3000, "sandbox.A_b-9", b"conn-42"),
        True,
        SIG
        + "21 11 002d c000020a 0a010203 c350 0bb8 0300049afb64b2 050007636f6e6e2d3432"
        + " e0000d73616e64626f782e415f622d39",
    ),
    (
        "v6_unique_id",
        Preamble(ip("2001:db8::1"), 443, ip("fd00::5"), 80, "x", bytes(range(16))),
        False,
        SIG
        + "21 21 003b 20010db8000000000000000000000001 fd000000000000000000000000000005 01bb 0050"
        + " 050010 000102030405060708090a0b0c0d0e0f e0000178",
    ),
    (
        "v6_unique_id_crc",
        Preamble(ip("2001:db8::1"), 443, ip("fd00::5"), 80, "x", bytes(range(16))),
        True,
        SIG
        + "21 21 0042 20010db8000000000000000000000001 fd000000000000000000000000000005 01bb 0050"
        + " 030004ce26f542 050010 000102030405060708090a0b0c0d0e0f e0000178",
    ),
    (
        "v4_deadline",
        Preamble(ip("1.2.3.4"), 1234, ip("10.0.0.5"), 8080, "sb-1", None, 10_000),
        False,
        SIG + "21 11 001a 01020304 0a000005 04d2 1f90 e0000473622d31 e1000400002710",
    ),
    (
        "v4_unique_id_deadline_crc",
        Preamble(ip("192.0.2.10"), 50000, ip("10.1.2.3"), 3000, "sandbox.A_b-9", b"conn-42", 300_000),
        True,
        SIG
        + "21 11 0034 c000020a 0a010203 c350 0bb8 0300043654652f 050007636f6e6e2d3432"
        + " e0000d73616e64626f782e415f622d39 e10004000493e0",
    ),
    (
        "v6_mapped_longest_sandbox_id",
        Preamble(ip("::ffff:198.51.100.7"), 65535, ip("fd00:1:2:3::a"), 1, "Z" * 64),
        False,
        SIG
        + "21 21 0067 00000000000000000000ffffc6336407 fd00000100020003000000000000000a ffff 0001"
        + " e00040"
        + "5a" * 64,
    ),
    (
        "v6_mapped_longest_sandbox_id_crc",
        Preamble(ip("::ffff:198.51.100.7"), 65535, ip("fd00:1:2:3::a"), 1, "Z" * 64),
        True,
        SIG
        + "21 21 006e 00000000000000000000ffffc6336407 fd00000100020003000000000000000a ffff 0001"
        + " 03000474d90c4a e00040"
        + "5a" * 64,
    ),
]


def golden_bytes(hexstr: str) -> bytes:
    return bytes.fromhex(hexstr.replace(" ", ""))


def tlv(t: int, value: bytes) -> bytes:
    return bytes((t,)) + struct.pack("!H", len(value)) + value


V4_ADDRS = ip("1.2.3.4").packed + ip("10.0.0.5").packed + struct.pack("!HH", 1234, 8080)
V6_ADDRS = ip("2001:db8::1").packed + ip("fd00::5").packed + struct.pack("!HH", 443, 80)


def build(
    *,
    vc: int = 0x21,
    fam: int = 0x11,
    addrs: bytes | None = None,
    tlvs: list[tuple[int, bytes]] | None = None,
    length: int | None = None,
    crc: bool = False,
    crc_value: int | None = None,
) -> bytes:
    """Raw preamble bytes from parts, for making malformed ones.

    ``addrs`` defaults to a valid block for ``fam``; ``tlvs`` defaults to one sandbox ID. ``length``
    overrides the length field. With ``crc`` a CRC32C TLV goes first, holding ``crc_value`` or, if
    None, the correct CRC of the final bytes.
    """
    if addrs is None:
        addrs = V6_ADDRS if fam == 0x21 else V4_ADDRS
    if tlvs is None:
        tlvs = [(0xE0, b"sb-1")]
    body = addrs + b"".join(tlv(t, v) for t, v in tlvs)
    crc_pos = -1
    if crc:
        crc_pos = 16 + len(addrs) + 3
        body = addrs + tlv(0x03, b"\0\0\0\0") + body[len(addrs) :]
    n = len(body) if length is None else length
    out = SIGNATURE + bytes((vc, fam)) + struct.pack("!H", n) + body
    if crc:
        value = crc32c_checksum(out) if crc_value is None else crc_value
        out = out[:crc_pos] + struct.pack("!I", value) + out[crc_pos + 4 :]
    return out
