"""Guest packet stream protocol v1: the 12-byte hello and the ``u32 len | virtio_net_hdr | IPv4`` framing.

Sans-I/O: the adapter reads bytes from the socket and calls ``FrameDecoder.feed``; it writes what
``push_hello``/``push_frame`` return. See docs/egress.md for the wire layout.

A ``len`` outside 30..65545 (10-byte vnet header + 20..65535 bytes of IPv4) raises ``FramingLost``
(a ``FrameRefused`` with reason ``bad_frame_length``). That error is fatal for the stream: once framing
is lost there is no way to find the next frame boundary, so the decoder stays failed (every later
``feed`` raises the same reason, with no frames) and the adapter must close the connection after
handling ``exc.frames``, the whole frames that preceded the bad length in that call. Everything a
frame carries is judged afterwards, per frame, by ``validate.validate_outbound``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from forwarder.egress.errors import FramingLost, HelloRefused
from forwarder.egress.vnet import (
    HOST_OFFLOADS,
    TUN_F_ALL,
    TUN_F_CSUM,
    TUN_F_TSO4,
    TUN_F_TSO6,
    TUN_F_TSO_ECN,
    TUN_F_UFO,
    TUN_F_USO4,
    TUN_F_USO6,
    VNET_HDR_LEN,
)
from sbxnet.errors import LocalProtocolError

__all__ = [
    "FRAME_LEN_MAX",
    "FRAME_LEN_MIN",
    "HELLO_FLAG_ON",
    "HELLO_LEN",
    "HOST_OFFLOADS",
    "MTU_MAX",
    "MTU_MIN",
    "TUN_F_ALL",
    "TUN_F_CSUM",
    "TUN_F_TSO4",
    "TUN_F_TSO6",
    "TUN_F_TSO_ECN",
    "TUN_F_UFO",
    "TUN_F_USO4",
    "TUN_F_USO6",
    "VERSION",
    "FrameDecoder",
    "Hello",
    "negotiate",
    "pull_hello",
    "push_frame",
    "push_hello",
]

VERSION = 1
HELLO_LEN = 12
HELLO_FLAG_ON = 0x0001
MTU_MIN = 576
MTU_MAX = 65535

FRAME_PREFIX_LEN = 4
FRAME_LEN_MIN = VNET_HDR_LEN + 20
FRAME_LEN_MAX = VNET_HDR_LEN + 65535

_HELLO = struct.Struct("!HHIHH")
_LEN = struct.Struct("!I")

# Offloads that only make sense together with another one: Linux's TUNSETOFFLOAD refuses segmentation
# without checksum offload, and TSO_ECN is a modifier of TSO.
_NEEDS_CSUM = TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN | TUN_F_UFO | TUN_F_USO4 | TUN_F_USO6


@dataclass(frozen=True, slots=True)
class Hello:
    """One side's hello. ``flags`` bit 0: guest asks on / host answers on; ``offloads``: TUN_F_* bits."""

    version: int = VERSION
    flags: int = HELLO_FLAG_ON
    offloads: int = 0
    mtu: int = 1500
    reserved: int = 0

    @property
    def on(self) -> bool:
        return bool(self.flags & HELLO_FLAG_ON)


def push_hello(h: Hello) -> bytes:
    """Encode ``h`` (12 bytes, big-endian). Raises ``LocalProtocolError("hello_field")`` for values that
    protocol v1 cannot carry: another version, reserved flag bits, unknown offload bits, reserved != 0."""
    if h.version != VERSION or h.flags & ~HELLO_FLAG_ON or h.offloads & ~TUN_F_ALL or h.reserved:
        raise LocalProtocolError("hello_field", repr(h))
    try:
        return _HELLO.pack(h.version, h.flags, h.offloads, h.mtu, h.reserved)
    except struct.error as exc:
        raise LocalProtocolError("hello_field", str(exc)) from None


def pull_hello(buf: bytes | bytearray | memoryview) -> Hello:
    """Decode exactly 12 bytes of hello. Raises ``HelloRefused`` with reason ``hello_length`` (not 12
    bytes), ``hello_version`` (not 1), ``hello_reserved`` (flag bits 1-15, unknown offload bits or the
    reserved field set) or ``hello_mtu`` (below 576)."""
    if len(buf) != HELLO_LEN:
        raise HelloRefused("hello_length", f"{len(buf)} bytes")
    version, flags, offloads, mtu, reserved = _HELLO.unpack_from(buf, 0)
    if version != VERSION:
        raise HelloRefused("hello_version", f"version {version}")
    if flags & ~HELLO_FLAG_ON or offloads & ~TUN_F_ALL or reserved:
        raise HelloRefused("hello_reserved", f"flags {flags:#06x} offloads {offloads:#010x} rsv {reserved}")
    if mtu < MTU_MIN:
        raise HelloRefused("hello_mtu", f"mtu {mtu}")
    return Hello(version, flags, offloads, mtu, reserved)


def _coherent(offloads: int) -> int:
    """Drop offloads whose prerequisite is missing."""
    if not offloads & TUN_F_CSUM:
        offloads &= ~_NEEDS_CSUM
    if not offloads & (TUN_F_TSO4 | TUN_F_TSO6):
        offloads &= ~TUN_F_TSO_ECN
    return offloads


def negotiate(
    guest: Hello, host_offloads: int = HOST_OFFLOADS, host_mtu: int = 1500, enable: bool = True
) -> Hello:
    """The host's answer to ``guest`` (already accepted by ``pull_hello``).

    Offloads: the subset both accept, reduced so that every granted bit has its prerequisite (CSUM
    under any segmentation offload, TSO4/TSO6 under TSO_ECN). MTU: the smaller of the two, which the
    stream keeps. Flags: on only if the guest asked and ``enable`` is true. ``host_mtu`` outside
    576..65535 is our configuration error (``LocalProtocolError("mtu")``).
    """
    if not MTU_MIN <= host_mtu <= MTU_MAX:
        raise LocalProtocolError("mtu", f"host mtu {host_mtu} outside {MTU_MIN}..{MTU_MAX}")
    on = HELLO_FLAG_ON if guest.on and enable else 0
    offloads = _coherent(guest.offloads & host_offloads & TUN_F_ALL)
    mtu = max(MTU_MIN, min(guest.mtu, host_mtu))
    return Hello(VERSION, on, offloads, mtu, 0)


def push_frame(vnet: bytes | bytearray | memoryview, packet: bytes | bytearray | memoryview) -> bytes:
    """One frame: ``u32 len | vnet | packet``. ``vnet`` must be 10 bytes and ``packet`` 20..65535 bytes
    (``LocalProtocolError("bad_frame_length")`` otherwise); their content is not judged here."""
    if len(vnet) != VNET_HDR_LEN:
        raise LocalProtocolError("bad_frame_length", f"vnet header of {len(vnet)} bytes")
    n = VNET_HDR_LEN + len(packet)
    if not FRAME_LEN_MIN <= n <= FRAME_LEN_MAX:
        raise LocalProtocolError("bad_frame_length", f"frame of {n} bytes")
    return b"".join((_LEN.pack(n), vnet, packet))


class FrameDecoder:
    """Incremental frame splitter over a byte stream.

    ``feed(data)`` returns every whole frame (vnet header + packet, without the length prefix) that the
    bytes received so far complete, in order, and keeps a partial frame for the next call. Frames cut
    from an immutable input (``bytes`` or a read-only memoryview) with nothing pending are returned as
    zero-copy memoryviews of it; anything else is copied once into ``bytes``, so the caller may reuse
    its receive buffer at once. Each byte is copied at most twice (into the pending buffer, then out),
    and the pending buffer is compacted once per call, so feeding is linear in the bytes fed whatever
    the chunking. A bad length raises ``FramingLost`` (reason ``bad_frame_length``) and fails the decoder for
    good (see the module docstring), carrying the frames completed before it.
    """

    __slots__ = ("_buf", "_error", "_need", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._need = FRAME_PREFIX_LEN  # bytes of the current item (prefix, then prefix + frame)
        self._error: str | None = None

    @property
    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buf) - self._pos

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _fail(self, n: int, out: list[memoryview | bytes]) -> FramingLost:
        self._error = f"len {n} outside {FRAME_LEN_MIN}..{FRAME_LEN_MAX}"
        return FramingLost(self._error, out)

    def feed(self, data: bytes | bytearray | memoryview) -> list[memoryview | bytes]:
        if self._error is not None:
            raise FramingLost(self._error, [])
        out: list[memoryview | bytes] = []
        if not self._buf:
            mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
            zero_copy = mv.readonly
            pos = 0
            end = len(mv)
            while end - pos >= FRAME_PREFIX_LEN:
                (n,) = _LEN.unpack_from(mv, pos)
                if not FRAME_LEN_MIN <= n <= FRAME_LEN_MAX:
                    raise self._fail(n, out)
                if end - pos - FRAME_PREFIX_LEN < n:
                    break
                frame = mv[pos + FRAME_PREFIX_LEN : pos + FRAME_PREFIX_LEN + n]
                out.append(frame if zero_copy else bytes(frame))
                pos += FRAME_PREFIX_LEN + n
            if pos < end:
                self._buf += mv[pos:]
                self._pos = 0
                self._need = FRAME_PREFIX_LEN
                self._scan(out)
            return out
        self._buf += data
        self._scan(out)
        return out

    def _scan(self, out: list[memoryview | bytes]) -> None:
        buf = self._buf
        pos = self._pos
        end = len(buf)
        need = self._need
        while end - pos >= need:
            if need == FRAME_PREFIX_LEN:
                (n,) = _LEN.unpack_from(buf, pos)
                if not FRAME_LEN_MIN <= n <= FRAME_LEN_MAX:
                    self._pos = pos
                    raise self._fail(n, out)
                need = FRAME_PREFIX_LEN + n
                continue
            out.append(bytes(buf[pos + FRAME_PREFIX_LEN : pos + need]))
            pos += need
            need = FRAME_PREFIX_LEN
        self._need = need
        if pos == end:
            buf.clear()
            self._pos = 0
        elif pos:
            # Deleting a bytearray's prefix is cheap (CPython moves its start), once per feed.
            del buf[:pos]
            self._pos = 0
        else:
            self._pos = pos
