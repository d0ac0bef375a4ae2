"""The gateway -> forwarder preamble: PROXY protocol v2 (HAProxy spec), profiled strictly.

Pure: bytes in, a typed ``Preamble`` or a ``PreambleError`` out. No sockets, no clocks; the adapter
owns the time bound and the reads.

Wire layout (all integers big-endian)::

    0   12  signature 0D 0A 0D 0A 00 0D 0A 51 55 49 54 0A
    12  1   version/command: 0x21 (v2, PROXY) only
    13  1   family/transport: 0x11 (TCP over IPv4) or 0x21 (TCP over IPv6) only
    14  2   length of everything after these 16 bytes (addresses + TLVs)
    16  12  IPv4: src addr (4), dst addr (4), src port (2), dst port (2)
     or 36  IPv6: src addr (16), dst addr (16), src port (2), dst port (2)
    ..      TLVs: type (1), length (2), value, until ``16 + length``

TLVs, and what this profile does with them:

    0xE0 sandbox ID   required exactly once; 1..64 bytes of [A-Za-z0-9._-] (ASCII, hence UTF-8)
    0xE1 deadline     optional, at most once, 4 bytes: u32 milliseconds, 1..300000, how long the
                      gateway still waits for this connection's status; the forwarder's connect to the
                      sandbox gives up by then (never later than its own ``connect_deadline``)
    0x05 UNIQUE_ID    optional, at most once, 1..128 bytes: the connection ID for tracing
    0x03 CRC32C       optional, at most once, 4 bytes; CRC32C (Castagnoli) of the whole preamble with
                      this field's value zeroed; must match
    0x04 NOOP         ignored (any length, any number of times)
    0x01 ALPN, 0x02 AUTHORITY, 0x20 SSL, 0x30 NETNS   registered by the spec, ignored
    anything else     refused (``unknown_tlv``)

Being strict about unknown types is deliberate. The spec reserves 0xE0-0xEF for application use, so a
type there that we do not know may carry a field the sender relies on ("mandatory"); silently
dropping it could route a connection in a way the gateway did not mean. The experimental and future
ranges (0xF0-0xFF) and unassigned registered numbers are refused for the same reason: gateway and
forwarder ship from one tree, so an unknown type means a version skew worth surfacing.

Reason tokens (``PreambleError.reason``; stable, counted by metrics):

    bad_signature      the first 12 bytes are not the v2 signature (raised on the first wrong byte)
    bad_version        the high nibble of byte 12 is not 2
    bad_command        the low nibble of byte 12 is not 1 (PROXY); LOCAL carries no target
    bad_family         byte 13 is not 0x11 or 0x21 (UDP, UNIX, UNSPEC and unassigned refused)
    too_long           16 + length exceeds ``max_len`` (raised once the 16-byte header is in)
    short_addresses    the length does not cover the address block of the family
    bad_port           destination port 0
    bad_tlv            a TLV header or value runs past the declared length
    duplicate_tlv      CRC32C, UNIQUE_ID or the sandbox ID appears more than once
    missing_sandbox_id no sandbox ID TLV
    bad_sandbox_id     sandbox ID empty, longer than 64 bytes, or outside [A-Za-z0-9._-]
    bad_unique_id      UNIQUE_ID empty or longer than 128 bytes
    bad_crc            CRC32C TLV not 4 bytes, or its value does not match
    bad_deadline       deadline TLV not 4 bytes, or its value outside 1..300000 ms
    unknown_tlv        a TLV type this profile does not know (see above)

Checks run in wire order, so the first failing field names the reason; the CRC, when present, is
verified before any TLV value is judged, so a corrupted preamble reports ``bad_crc``.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from dataclasses import dataclass

from sbxnet.errors import LocalProtocolError, RemoteProtocolError

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
HEADER_LEN = 16
DEFAULT_MAX_LEN = 512

VERSION_COMMAND = 0x21  # v2, PROXY
FAMILY_TCP4 = 0x11
FAMILY_TCP6 = 0x21
ADDR_LEN = {FAMILY_TCP4: 12, FAMILY_TCP6: 36}

TLV_ALPN = 0x01
TLV_AUTHORITY = 0x02
TLV_CRC32C = 0x03
TLV_NOOP = 0x04
TLV_UNIQUE_ID = 0x05
TLV_SSL = 0x20
TLV_NETNS = 0x30
TLV_SANDBOX_ID = 0xE0
TLV_DEADLINE = 0xE1
TLV_HEADER_LEN = 3

IGNORED_TLVS = frozenset({TLV_ALPN, TLV_AUTHORITY, TLV_NOOP, TLV_SSL, TLV_NETNS})
SINGLE_TLVS = frozenset({TLV_CRC32C, TLV_UNIQUE_ID, TLV_SANDBOX_ID, TLV_DEADLINE})

SANDBOX_ID_MAX = 64
UNIQUE_ID_MAX = 128
CRC32C_LEN = 4
DEADLINE_LEN = 4
DEADLINE_MAX_MS = 300_000  # a route's connect_deadline_s is at most 300 s

_SANDBOX_ID_RE = re.compile(rb"[A-Za-z0-9._-]{1,64}")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Preamble:
    """What the gateway tells the forwarder: who the client is, where to connect, for which sandbox."""

    src: IPAddress
    src_port: int
    dst: IPAddress
    dst_port: int
    sandbox_id: str
    connection_id: bytes | None = None
    # How long the gateway still waits for the status, in ms (1..DEADLINE_MAX_MS): the forwarder's
    # connect gives up by then, so its NOT_LISTENING comes while the gateway still listens.
    deadline_ms: int | None = None


class PreambleError(RemoteProtocolError):
    """The peer's preamble is refused; ``reason`` is one of the tokens in the module docstring."""


# --- CRC32C (Castagnoli, reflected polynomial 0x82F63B78) --------------------------------------------
# A table-driven pure-Python CRC is fast enough for a preamble of at most a few hundred bytes and keeps
# the protocol core free of native dependencies.


def _make_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _make_table()


def crc32c_checksum(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``crc`` (the value a previous call returned)."""
    c = crc ^ 0xFFFFFFFF
    table = _CRC_TABLE
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# --- parsing ---------------------------------------------------------------------------------------


def _check_prefix(view: memoryview) -> None:
    """Judge whatever part of the first 14 bytes has arrived, so garbage fails on its first byte."""
    n = min(len(view), len(SIGNATURE))
    for i in range(n):
        if view[i] != SIGNATURE[i]:
            raise PreambleError("bad_signature", f"byte {i}")
    if len(view) > 12:
        vc = view[12]
        if vc >> 4 != 2:
            raise PreambleError("bad_version", f"version {vc >> 4}")
        if vc & 0x0F != 1:
            raise PreambleError("bad_command", f"command {vc & 0x0F}")
    if len(view) > 13 and view[13] not in ADDR_LEN:
        raise PreambleError("bad_family", f"family/transport 0x{view[13]:02x}")


def pull_preamble(
    buf: bytes | bytearray | memoryview, *, max_len: int = DEFAULT_MAX_LEN
) -> tuple[Preamble, int] | None:
    """Parse a preamble from the start of ``buf``.

    Returns ``(preamble, consumed)`` once the whole preamble is in ``buf`` (bytes after it are left
    alone: ``consumed`` is exactly the preamble's length), or None while the bytes so far are a valid
    prefix of some preamble. Raises ``PreambleError`` as soon as the bytes so far cannot start an
    acceptable preamble: a wrong signature byte, version, command or family at once, a declared
    length over ``max_len`` as soon as the 16-byte header is in. Never raises anything else.
    """
    view = memoryview(buf).cast("B")
    _check_prefix(view)
    if len(view) < HEADER_LEN:
        return None
    family = view[13]
    (length,) = _U16.unpack_from(view, 14)
    total = HEADER_LEN + length
    if total > max_len:
        raise PreambleError("too_long", f"{total} bytes > {max_len}")
    addr_len = ADDR_LEN[family]
    if length < addr_len:
        raise PreambleError("short_addresses", f"length {length} < {addr_len}")
    if len(view) < total:
        return None
    data = bytes(view[:total])
    return _parse_whole(data, family, addr_len), total


def _parse_whole(data: bytes, family: int, addr_len: int) -> Preamble:
    a = HEADER_LEN
    src: IPAddress
    dst: IPAddress
    if family == FAMILY_TCP4:
        src = ipaddress.IPv4Address(data[a : a + 4])
        dst = ipaddress.IPv4Address(data[a + 4 : a + 8])
        src_port, dst_port = struct.unpack_from("!HH", data, a + 8)
    else:
        src = ipaddress.IPv6Address(data[a : a + 16])
        dst = ipaddress.IPv6Address(data[a + 16 : a + 32])
        src_port, dst_port = struct.unpack_from("!HH", data, a + 32)
    if dst_port == 0:
        raise PreambleError("bad_port", "destination port 0")

    # First pass: structure only (bounds, known types, duplicates), so the CRC can be checked before
    # any value is trusted enough to judge.
    tlvs: dict[int, tuple[int, int]] = {}  # type -> (value start, value end), single-use types only
    off = a + addr_len
    end = len(data)
    while off < end:
        if end - off < TLV_HEADER_LEN:
            raise PreambleError("bad_tlv", f"TLV header at {off} runs past the end")
        t = data[off]
        (vlen,) = _U16.unpack_from(data, off + 1)
        vstart = off + TLV_HEADER_LEN
        vend = vstart + vlen
        if vend > end:
            raise PreambleError("bad_tlv", f"TLV 0x{t:02x} value runs past the end")
        if t in SINGLE_TLVS:
            if t in tlvs:
                raise PreambleError("duplicate_tlv", f"TLV 0x{t:02x}")
            tlvs[t] = (vstart, vend)
        elif t not in IGNORED_TLVS:
            raise PreambleError("unknown_tlv", f"TLV 0x{t:02x}")
        off = vend

    crc_at = tlvs.get(TLV_CRC32C)
    if crc_at is not None:
        s, e = crc_at
        if e - s != CRC32C_LEN:
            raise PreambleError("bad_crc", f"CRC32C TLV of {e - s} bytes")
        (got,) = _U32.unpack_from(data, s)
        want = crc32c_checksum(data[:s] + b"\0\0\0\0" + data[e:])
        if got != want:
            raise PreambleError("bad_crc", "mismatch")

    uid_at = tlvs.get(TLV_UNIQUE_ID)
    connection_id = None
    if uid_at is not None:
        connection_id = data[uid_at[0] : uid_at[1]]
        if not 1 <= len(connection_id) <= UNIQUE_ID_MAX:
            raise PreambleError("bad_unique_id", f"{len(connection_id)} bytes")

    deadline_ms = None
    dl_at = tlvs.get(TLV_DEADLINE)
    if dl_at is not None:
        if dl_at[1] - dl_at[0] != DEADLINE_LEN:
            raise PreambleError("bad_deadline", f"deadline TLV of {dl_at[1] - dl_at[0]} bytes")
        (deadline_ms,) = _U32.unpack_from(data, dl_at[0])
        if not 1 <= deadline_ms <= DEADLINE_MAX_MS:
            raise PreambleError("bad_deadline", f"{deadline_ms} ms")

    sid_at = tlvs.get(TLV_SANDBOX_ID)
    if sid_at is None:
        raise PreambleError("missing_sandbox_id")
    raw_sid = data[sid_at[0] : sid_at[1]]
    if _SANDBOX_ID_RE.fullmatch(raw_sid) is None:
        # The detail never echoes the peer's bytes: logs and metrics must not carry peer text.
        raise PreambleError("bad_sandbox_id", f"{len(raw_sid)} bytes")
    return Preamble(src, src_port, dst, dst_port, raw_sid.decode("ascii"), connection_id, deadline_ms)


# --- writing ---------------------------------------------------------------------------------------


def _tlv(t: int, value: bytes) -> bytes:
    return bytes((t,)) + _U16.pack(len(value)) + value


def push_preamble(p: Preamble, *, crc32c: bool = False) -> bytes:
    """Encode ``p``; with ``crc32c`` add a CRC32C TLV. Raises ``LocalProtocolError`` (reason tokens as
    the parser's) if ``p`` is something ``pull_preamble`` would refuse.

    TLVs go out in ascending type order (CRC32C, UNIQUE_ID, sandbox ID, deadline), the order other
    implementations canonicalise to, so their CRC recomputation agrees with ours.
    """
    if isinstance(p.src, ipaddress.IPv4Address) and isinstance(p.dst, ipaddress.IPv4Address):
        family = FAMILY_TCP4
    elif isinstance(p.src, ipaddress.IPv6Address) and isinstance(p.dst, ipaddress.IPv6Address):
        family = FAMILY_TCP6
    else:
        raise LocalProtocolError("bad_family", "source and destination must be the same IP version")
    if not 0 <= p.src_port <= 0xFFFF:
        raise LocalProtocolError("bad_port", f"source port {p.src_port}")
    if not 1 <= p.dst_port <= 0xFFFF:
        raise LocalProtocolError("bad_port", f"destination port {p.dst_port}")
    sid = p.sandbox_id.encode("utf-8") if isinstance(p.sandbox_id, str) else b""
    if _SANDBOX_ID_RE.fullmatch(sid) is None:
        raise LocalProtocolError("bad_sandbox_id", f"{p.sandbox_id!r}")
    tlvs = b""
    if p.connection_id is not None:
        cid = bytes(p.connection_id)
        if not 1 <= len(cid) <= UNIQUE_ID_MAX:
            raise LocalProtocolError("bad_unique_id", f"{len(cid)} bytes")
        tlvs += _tlv(TLV_UNIQUE_ID, cid)
    tlvs += _tlv(TLV_SANDBOX_ID, sid)
    if p.deadline_ms is not None:
        if isinstance(p.deadline_ms, bool) or not isinstance(p.deadline_ms, int) \
                or not 1 <= p.deadline_ms <= DEADLINE_MAX_MS:
            raise LocalProtocolError("bad_deadline", f"{p.deadline_ms!r} ms")
        tlvs += _tlv(TLV_DEADLINE, _U32.pack(p.deadline_ms))
    if crc32c:
        tlvs = _tlv(TLV_CRC32C, b"\0\0\0\0") + tlvs
    addrs = p.src.packed + p.dst.packed + struct.pack("!HH", p.src_port, p.dst_port)
    body = addrs + tlvs
    out = SIGNATURE + bytes((VERSION_COMMAND, family)) + _U16.pack(len(body)) + body
    if crc32c:
        crc_value = crc32c_checksum(out)
        pos = HEADER_LEN + len(addrs) + TLV_HEADER_LEN
        out = out[:pos] + _U32.pack(crc_value) + out[pos + CRC32C_LEN :]
    return out
