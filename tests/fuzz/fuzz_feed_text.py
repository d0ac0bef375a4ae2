"""Fuzz target for native/feed_text.c (``one_input(data)``): the C against its Python references.

The input is read as a time ``now`` (the first 8 bytes, a double), a bound (the next 8, an int64
taken modulo 2**53 for the ages), then as many 8-byte values as follow, each both an int64 and a double
(the same bytes). Invariant: ``ft_int_array`` gives the bytes of ``_int_array_py`` for those ints and that
bound (both None, or the same text), and ``ages_ms`` gives ``_ages_ms_py`` for those doubles. Without the
extension built, only the references run.
"""

from __future__ import annotations

import struct
from array import array

from sbxnet.protocol import feed


def split(data: bytes) -> tuple[float, int, array[int], array[float]]:
    data = data.ljust(16, b"\0")
    now, high = struct.unpack_from("<dq", data)
    body = data[16 : 16 + (len(data) - 16) // 8 * 8]
    ints, times = array("q"), array("d")
    ints.frombytes(body)
    times.frombytes(body)
    return now, high, ints, times


def one_input(data: bytes) -> None:
    now, high, ints, times = split(data)
    want = feed._int_array_py(ints, high)
    if feed.NATIVE_COLUMNS and feed._int_array_native(ints, high) != want:
        raise AssertionError(f"ft_int_array differs for {ints.tolist()!r} at {high}")
    high_ms = abs(high) % 2**53
    want_ages = feed._ages_ms_py(now, times.tolist(), high_ms)
    got = feed.ages_ms(now, times.tolist(), high_ms)
    if (None if got is None else list(got)) != want_ages:
        raise AssertionError(f"ages differ for {times.tolist()!r} at {now!r}: {got!r} != {want_ages!r}")


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
