"""Typed entry points over the C packet core (``native/egress_core.c``): what the router daemon calls.

Single-packet functions (``csum``, ``rewrite``, ``segment``) serve tests and slow paths; the data path
uses the batch objects, which own every buffer and array once and pay cffi's call overhead once per
batch, not per packet:

- ``OutboundBatch``: guest frames (``vnet hdr | IPv4``, e.g. straight out of the stream receive buffer
  via ``split``) become wire records ``VXLAN | Ethernet | IPv4`` in ``out``, grouped into ``sends``,
  each ready for one ``sendmsg`` on a UDP socket with ``UDP_SEGMENT`` = ``Send.seg``.
- ``InboundBatch``: VXLAN datagrams from an exit become delivery frames ``u32 len | vnet hdr | IPv4``
  in ``out``, TCP segments merged for guests that offered CSUM+TSO4.

Nothing here judges policy, limits or the exit's address: the caller does that first (validate,
flows, guard, limits) and passes only what it accepted. The C still refuses, on its own, every frame it
cannot handle safely (status codes in ``core_types``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from forwarder.egress.core_types import (
    MERGED,
    OK,
    PREFIX_LEN,
    REASONS,
    InResult,
    OutParams,
    OutResult,
    SegInfo,
    Send,
)
from native._egress import ffi, lib

__all__ = [
    "REASONS",
    "InboundBatch",
    "OutboundBatch",
    "checksum",
    "csum",
    "csum_update32",
    "rewrite",
    "segment",
]

Buf = bytes | bytearray | memoryview


def csum(data: Buf, initial: int = 0) -> int:
    """Ones' complement sum of ``data`` plus ``initial`` (0..0xFFFF), folded, not inverted."""
    return int(lib.eg_csum(ffi.from_buffer(data), len(data), initial))


def checksum(data: Buf) -> int:
    """The Internet checksum of ``data``: ``~csum(data)``."""
    return ~lib.eg_csum(ffi.from_buffer(data), len(data), 0) & 0xFFFF


def csum_update32(check: int, frm: int, to: int, partial: bool = False) -> int:
    """RFC 1624 update of a checksum field for a 32-bit word changing ``frm`` -> ``to``."""
    return int(lib.eg_csum_update32(check, frm, to, int(partial)))


def rewrite(frame: bytearray | memoryview, claim: int) -> int:
    """Identity rewrite of ``frame`` (vnet hdr + IPv4) in place; returns a status (``core_types``).

    The source becomes ``claim``; the destination is never touched; the IPv4 header checksum and the
    TCP/UDP checksum (full, or the partial pseudo-header sum when NEEDS_CSUM) follow incrementally; an
    ICMP error's quoted destination becomes ``claim``. On a refusal nothing is written.
    """
    return int(lib.eg_rewrite(ffi.from_buffer(frame, require_writable=True), len(frame), claim))


def _params(p: OutParams) -> Any:
    c = ffi.new("struct eg_out_params *")
    c.claim = p.claim
    c.mtu = p.mtu
    c.max_segs = p.max_segs
    c.max_gso_segs = p.max_gso_segs
    c.max_send_bytes = p.max_send_bytes
    c.prefix = p.prefix
    return c


def segment(frame: Buf, params: OutParams, out: bytearray | memoryview) -> tuple[int, SegInfo | None]:
    """Write ``frame``'s wire records (prefix + rewritten, segmented IPv4 packet) to ``out``.

    Returns (status, info); info is None unless status is ``OK``. GSO frames get full L4 checksums.
    """
    info = ffi.new("struct eg_seg_info *")
    st = lib.eg_segment(
        ffi.from_buffer(frame), len(frame), _params(params), ffi.from_buffer(out, require_writable=True),
        len(out), info,
    )
    if st != OK:
        return int(st), None
    return OK, SegInfo(info.packets, info.bytes, info.stride)


class _Batch:
    def __init__(self, max_frames: int) -> None:
        if max_frames < 1:
            raise ValueError("max_frames must be at least 1")
        self.max_frames = max_frames
        self.offs = ffi.new("uint32_t[]", max_frames)
        self.lens = ffi.new("uint32_t[]", max_frames)
        self._consumed = ffi.new("size_t *")
        self._bad = ffi.new("int *")
        self._used = ffi.new("size_t *")
        self.n = 0  # frames loaded into offs/lens
        self.out_used = 0

    def set_frames(self, frames: Iterable[tuple[int, int]]) -> int:
        """Load (offset, length) pairs into the offsets/lengths arrays; returns how many (<= max_frames)."""
        n = 0
        for off, ln in frames:
            if n == self.max_frames:
                break
            self.offs[n] = off
            self.lens[n] = ln
            n += 1
        self.n = n
        return n


class OutboundBatch(_Batch):
    """Outbound frames of one claim to one exit, segmented into a send buffer owned by this object.

    ``out_capacity`` defaults to room for ``max_frames`` frames of ``params.max_segs`` full-MTU packets,
    capped at 8 MiB; a batch that does not fit stops early and ``run`` reports how many it consumed.
    """

    def __init__(
        self, params: OutParams, *, max_frames: int = 64, out_capacity: int | None = None,
        max_sends: int | None = None,
    ) -> None:
        super().__init__(max_frames)
        self.params = params
        self._p = _params(params)
        segs = max(params.max_segs, 1)
        if out_capacity is None:
            out_capacity = min(max_frames * segs * (PREFIX_LEN + params.mtu), 8 << 20)
        self.out = bytearray(out_capacity)
        self._out = ffi.from_buffer(self.out)
        self.max_sends = max_sends if max_sends is not None else max_frames * segs
        self.sends = ffi.new("struct eg_send[]", self.max_sends)
        self.results = ffi.new("struct eg_out_result[]", max_frames)
        self._n_sends = ffi.new("uint32_t *")
        self.n_sends = 0

    def set_claim(self, claim: int) -> None:
        self._p.claim = claim

    def split(self, stream: Buf) -> tuple[int, int, bool]:
        """Find whole frames (``u32 len | frame``) at the start of ``stream``: (frames, bytes consumed,
        bad length). A bad length (outside 30..65545) is fatal for the stream: close it."""
        n = lib.eg_split_frames(
            ffi.from_buffer(stream), len(stream), self.offs, self.lens, self.max_frames, self._consumed,
            self._bad,
        )
        self.n = n
        return n, self._consumed[0], bool(self._bad[0])

    def run(self, inbuf: Buf, n: int | None = None) -> int:
        """Segment the first ``n`` loaded frames (default: all) of ``inbuf``; returns frames consumed.

        Afterwards ``results[i]`` holds each frame's status/packets/offset/length, ``sends[:n_sends]``
        the sends, ``out[:out_used]`` the records. Frames past the returned count did not fit: send,
        then run again with them.
        """
        k = lib.eg_outbound_batch(
            ffi.from_buffer(inbuf), len(inbuf), self.offs, self.lens, self.n if n is None else n, self._p,
            self._out, len(self.out), self.results, self.sends, self.max_sends, self._n_sends, self._used,
        )
        self.n_sends = self._n_sends[0]
        self.out_used = self._used[0]
        return int(k)

    def result(self, i: int) -> OutResult:
        r = self.results[i]
        return OutResult(r.status, r.packets, r.off, r.len)

    def send_list(self) -> list[Send]:
        return [Send(s.off, s.len, s.seg, s.count) for s in self.sends[0 : self.n_sends]]


_RESULT_WORDS = ffi.sizeof("struct eg_in_result") // 4
assert ffi.sizeof("struct eg_in_result") == 4 * _RESULT_WORDS
assert ffi.offsetof("struct eg_in_result", "status") == 0  # type: ignore[attr-defined]


class InboundBatch(_Batch):
    """VXLAN datagrams from the exit side, made into delivery frames in a buffer owned by this object.

    ``set_gro`` names the claim addresses whose guests offered CSUM+TSO4; only their TCP segments are
    merged. The caller has already checked that the datagrams came from a configured exit VTEP.
    """

    def __init__(self, vni: int, *, max_frames: int = 64, out_capacity: int = 1 << 20) -> None:
        super().__init__(max_frames)
        self.vni = vni
        self.out = bytearray(out_capacity)
        self._out = ffi.from_buffer(self.out)
        self.results = ffi.new("struct eg_in_result[]", max_frames)
        self._status = memoryview(ffi.buffer(self.results)).cast("i")  # status is each result's first word
        self._gro = ffi.new("uint32_t[]", 1)
        self._n_gro = 0

    def set_gro(self, addrs: Iterable[int]) -> None:
        a = sorted(set(addrs))
        self._gro = ffi.new("uint32_t[]", a or [0])
        self._n_gro = len(a)

    def load(self, offs: list[int], lens: list[int]) -> int:
        """Load datagram offsets and lengths given as lists, in one slice assignment each (no Python step
        per datagram, unlike ``set_frames``); returns how many (at most ``max_frames``, else ValueError)."""
        n = len(offs)
        if n > self.max_frames or len(lens) != n:
            raise ValueError(f"{n} offsets and {len(lens)} lengths for a batch of {self.max_frames}")
        self.offs[0:n] = offs
        self.lens[0:n] = lens
        self.n = n
        return n

    def statuses(self, k: int) -> list[int]:
        """The status of each of the first ``k`` results, read as one strided view (a datagram merged into
        an earlier frame, most of a TCP download, then costs the caller one list item, not a cdata read)."""
        return self._status[0 : _RESULT_WORDS * k : _RESULT_WORDS].tolist()

    def run(self, inbuf: Buf, n: int | None = None) -> int:
        """Deliver the first ``n`` loaded datagrams (default: all); returns datagrams consumed.

        ``results[i]``: status (``OK`` a new frame, ``MERGED`` appended to the frame at ``off``, ``ARP``
        left to the caller, < 0 refused), inner destination, frame offset and length in ``out``.
        """
        k = lib.eg_inbound_batch(
            ffi.from_buffer(inbuf), len(inbuf), self.offs, self.lens, self.n if n is None else n, self.vni,
            self._gro, self._n_gro, self._out, len(self.out), self.results, self._used,
        )
        self.out_used = self._used[0]
        return int(k)

    def result(self, i: int) -> InResult:
        r = self.results[i]
        return InResult(r.status, r.dst, r.off, r.len)

    def frames(self, k: int) -> Iterator[tuple[int, memoryview]]:
        """(destination, delivery frame) for each frame of the first ``k`` results, merged ones whole."""
        mv = memoryview(self.out)
        for r in self.results[0:k]:
            if r.status == OK:
                yield r.dst, mv[r.off : r.off + r.len]
            elif r.status == MERGED:
                continue
