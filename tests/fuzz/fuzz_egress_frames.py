"""Fuzz target for the guest stream: hello, frame decoder and outbound validation (``one_input(data)``).

Invariant: every input parses or is refused with ``FrameRefused``/``HelloRefused``, nothing else; an
accepted frame is self-consistent (lengths, checksum position past the IPv4 header and inside the
packet, MTU and segment bounds) and has a flow key; the decoder returns the same frames, and fails
the same way, whatever the chunking. The first byte picks the MTU, the negotiated offloads and the mode:
0 one frame (vnet header + IPv4) straight into validation, 1 a stream fed whole, 2 a stream fed in
small chunks and compared with 1, 3 a 12-byte hello then a stream. In stream modes the C splitter
(``OutboundBatch.split``, what the daemon uses on its receive buffer) must find the same frames and
the same framing loss as the decoder, and agree with its reference.
"""

from __future__ import annotations

from forwarder.egress import core_types as ct
from forwarder.egress import reference as ref
from forwarder.egress.errors import FrameRefused, FramingLost, HelloRefused
from forwarder.egress.fastpath import OutboundBatch
from forwarder.egress.flows import flow_key
from forwarder.egress.limits import wire_cost
from forwarder.egress.stream import FrameDecoder, negotiate, pull_hello, push_hello
from forwarder.egress.validate import MAX_GSO_SEGMENTS, OutboundFrame, validate_outbound
from forwarder.egress.vnet import (
    GSO_NONE,
    HOST_OFFLOADS,
    TUN_F_CSUM,
    TUN_F_TSO4,
    TUN_F_USO4,
    VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VNET_HDR_LEN,
)

MTUS = (1500, 576, 9000, 65535, 1280, 68, 1400, 16384)
OFFLOADS = (HOST_OFFLOADS, 0, TUN_F_CSUM, TUN_F_CSUM | TUN_F_TSO4, TUN_F_CSUM | TUN_F_USO4, 0x7F, 0x7F, 0x7F)
MODE_FRAME, MODE_STREAM, MODE_CHUNKED, MODE_HELLO = 0, 1, 2, 3
CSUM_FIELD = {6: 16, 17: 6}
_SPLIT_MAX = 4096
_SPLIT = OutboundBatch(ct.OutParams(claim=0, prefix=bytes(ct.PREFIX_LEN)), max_frames=_SPLIT_MAX, out_capacity=1)


def selector(mtu_i: int = 0, off_i: int = 0, mode: int = MODE_FRAME) -> int:
    """The first input byte for a given MTU index, offloads index and mode."""
    return mtu_i | off_i << 3 | mode << 6


def check_frame(frame: bytes | memoryview, mtu: int, offloads: int) -> OutboundFrame:
    """Validate ``frame`` and assert what an accepted frame guarantees; FrameRefused passes through."""
    f = validate_outbound(frame, mtu, offloads)
    pkt = bytes(frame[VNET_HDR_LEN:])
    n = len(pkt)
    assert pkt[0] == 0x45 and int.from_bytes(pkt[2:4], "big") == n
    assert pkt[6] & 0x3F == 0 and pkt[7] == 0  # no MF, no offset
    assert f.l4_offset == 20 and 20 + f.l4_header_len + f.payload_len == n
    assert f.proto in (1, 6, 17)
    if f.hdr.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM:
        # the checksum the offload writes lands on the L4 checksum field: never the judged IPv4 header
        at = f.hdr.csum_start + f.hdr.csum_offset
        assert f.proto != 1 and at == 20 + CSUM_FIELD[f.proto] and at + 2 <= 20 + f.l4_header_len
    if f.hdr.gso_type == GSO_NONE:
        assert n <= mtu and f.segments == 1
    else:
        assert f.hdr.flags & VIRTIO_NET_HDR_F_NEEDS_CSUM
        assert f.hdr.gso_size > 0 and 20 + f.l4_header_len + f.hdr.gso_size <= mtu
        assert 1 <= f.segments <= MAX_GSO_SEGMENTS
    key = flow_key(frame, VNET_HDR_LEN)
    assert key.proto == f.proto and key.dst == int.from_bytes(pkt[16:20], "big")
    nbytes, packets = wire_cost(f)
    assert packets == f.segments and nbytes >= n
    return f


def classify(data: bytes) -> str:
    """Run the target; "ok" or the refusal reason of the first refusal met (for seed names)."""
    if not data:
        return "ok"
    sel = data[0]
    mtu = MTUS[sel & 7]
    offloads = OFFLOADS[(sel >> 3) & 7]
    mode = sel >> 6
    body = data[1:]
    try:
        if mode == MODE_FRAME:
            check_frame(body, mtu, offloads)
            return "ok"
        if mode == MODE_HELLO:
            guest = pull_hello(body[:12])
            assert push_hello(guest) == body[:12]
            answer = negotiate(guest, offloads or HOST_OFFLOADS, max(576, mtu))
            assert answer.offloads & ~guest.offloads == 0 and answer.mtu <= guest.mtu
            mtu, offloads, body = answer.mtu, answer.offloads, body[12:]
        return _stream(body, mtu, offloads, chunked=mode == MODE_CHUNKED)
    except (FrameRefused, HelloRefused) as exc:
        return exc.reason


def _stream(body: bytes, mtu: int, offloads: int, chunked: bool) -> str:
    whole = FrameDecoder()
    whole_err: str | None = None
    try:
        frames = [bytes(f) for f in whole.feed(body)]
    except FramingLost as exc:
        whole_err = exc.reason
        frames = [bytes(f) for f in exc.frames]
    check_split(body, frames, whole_err is not None)
    if chunked:
        dec = FrameDecoder()
        got: list[bytes] = []
        err: str | None = None
        step = 1 + (body[0] % 7 if body else 0)
        try:
            for i in range(0, len(body), step):
                got.extend(bytes(f) for f in dec.feed(body[i : i + step]))
        except FramingLost as exc:
            err = exc.reason
            got.extend(bytes(f) for f in exc.frames)
        assert err == whole_err and got == frames
        if err is None:
            assert dec.pending == whole.pending
    result = "ok"
    for frame in frames:
        try:
            check_frame(frame, mtu, offloads)
        except FrameRefused as exc:  # one frame dropped, the stream goes on
            result = exc.reason if result == "ok" else result
    return whole_err or result


def check_split(body: bytes, frames: list[bytes], lost: bool) -> None:
    """The C splitter on ``body`` finds ``frames`` (what the decoder found) and the same framing loss."""
    n, used, bad = _SPLIT.split(body)
    offs, lens, used_r, bad_r = ref.split_frames(body, _SPLIT_MAX)
    assert (n, used, bad) == (len(offs), used_r, bad_r)
    assert [(_SPLIT.offs[i], _SPLIT.lens[i]) for i in range(n)] == list(zip(offs, lens, strict=True))
    if n < _SPLIT_MAX:
        assert [body[o : o + ln] for o, ln in zip(offs, lens, strict=True)] == frames and bad == lost


def one_input(data: bytes) -> None:
    classify(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
