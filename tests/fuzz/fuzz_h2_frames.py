"""Fuzz target for the HTTP/2 frame size guard (gateway/h2c_upstream.py ``FrameSizeGuard``).

The first byte of ``data`` says whose connection it is, the rest is the byte stream that peer sends:
``P`` (0x50) a client's (``skip=24``: the connection preface comes first and is not judged), any other
byte an app's (``skip=0``). No first byte at all is an app's empty stream. ``classify(data)`` judges the
stream with ``LIMIT`` (16384, SETTINGS_MAX_FRAME_SIZE's initial value): "ok" when no frame header in it
names a payload over the limit, "too_large" otherwise (seed names are ``<expected>-<what>``).

Invariant (``one_input``): for both starts and for several limits (``LIMIT``, 0, the largest 24-bit
length, the first frame's own length and one less), the guard agrees with ``first_refusal``, a walk of
the frame boundaries written here from RFC 9113 4.1, whatever the chunking: whole, one byte at a time,
cut in the middle of every frame header, and cut at positions derived from the data. Every ``feed``
before the one that completes the first over-limit header says True, that one says False, and nothing
raises. What the guard says after a False is not judged: both callers close the connection there.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator

from gateway.h2c_upstream import FrameSizeGuard

HEADER = 9  # RFC 9113 4.1: length (24 bits), type, flags, R + stream identifier (32 bits)
LIMIT = 16384
MAX_LENGTH = (1 << 24) - 1
PREFACE_LEN = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
CLIENT = b"P"
BYTEWISE = 2048  # bytes fed one at a time before the rest goes in whole (keeps 16 KiB seeds quick)


def start(data: bytes) -> tuple[int, bytes]:
    """``(skip, stream)`` as the module docstring says."""
    return (PREFACE_LEN if data[:1] == CLIENT else 0), data[1:]


def frame_starts(stream: bytes, skip: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of each frame header that is whole in ``stream``, in order."""
    pos = skip
    while pos + HEADER <= len(stream):
        length = (stream[pos] << 16) | (stream[pos + 1] << 8) | stream[pos + 2]
        yield pos, length
        pos += HEADER + length


def first_refusal(stream: bytes, skip: int, limit: int) -> int | None:
    """The offset just past the first whole header naming more than ``limit`` bytes; None if there is none."""
    for pos, length in frame_starts(stream, skip):
        if length > limit:
            return pos + HEADER
    return None


def _pieces(stream: bytes, points: set[int]) -> list[bytes]:
    cuts = sorted({p for p in points if 0 < p < len(stream)} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(cuts)]


def chunkings(stream: bytes, skip: int) -> Iterator[list[bytes]]:
    """The same bytes cut in different ways (an empty feed first in one of them)."""
    n = len(stream)
    yield [stream]
    yield [b"", *(stream[i : i + 1] for i in range(min(n, BYTEWISE))), stream[BYTEWISE:]]
    yield _pieces(stream, {skip - 1, skip + 1} | {pos + k for pos, _ in frame_starts(stream, skip) for k in (1, 4, 8)})
    digest = hashlib.sha256(stream).digest()
    yield _pieces(stream, {int.from_bytes(digest[i : i + 3], "big") % (n + 1) for i in range(0, 24, 3)})


def check(stream: bytes, skip: int, limit: int, pieces: list[bytes]) -> bool:
    """Feed ``pieces`` to a fresh guard; raise unless each verdict is the reference's. The stream's verdict."""
    if b"".join(pieces) != stream:
        raise AssertionError("the chunking lost bytes")  # a fault of this target, not the guard's
    refuse_at = first_refusal(stream, skip, limit)
    guard = FrameSizeGuard(skip=skip)
    fed = 0
    for piece in pieces:
        verdict = guard.feed(piece, limit)
        fed += len(piece)
        if verdict is not True and verdict is not False:
            raise AssertionError(f"feed returned {verdict!r}, not a bool")
        refused = refuse_at is not None and fed >= refuse_at
        if verdict is refused:
            raise AssertionError(f"skip={skip} limit={limit}: after {fed} bytes the guard said {verdict}, the "
                                 f"reference refuses at {refuse_at} (pieces {[len(p) for p in pieces]})")
        if not verdict:
            return False
    return True


def classify(data: bytes) -> str:
    skip, stream = start(data)
    ok = check(stream, skip, LIMIT, [stream])
    return "ok" if ok else "too_large"


def one_input(data: bytes) -> None:
    _, stream = start(data)
    for skip in (0, PREFACE_LEN):
        limits = {LIMIT, 0, MAX_LENGTH}
        for _, first in frame_starts(stream, skip):
            limits |= {first, max(0, first - 1)}  # the first frame exactly at the limit, and one over it
            break
        for limit in sorted(limits):
            for pieces in chunkings(stream, skip):
                check(stream, skip, limit, pieces)
    classify(data)


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
