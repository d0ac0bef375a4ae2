"""Fuzz target for the preamble parser (atheris-style: ``one_input(data)``).

Invariant: ``pull_preamble`` returns None, returns a result, or raises ``PreambleError``, nothing else.
A result re-encodes (with and without CRC32C) to bytes that parse back to the same value, the bytes it
consumed parse alone to the same value, and every shorter prefix of them is incomplete. The first byte
of ``data`` picks the ``max_len`` bound, so the bound is fuzzed too.
"""

from __future__ import annotations

from sbxnet.protocol.preamble import DEFAULT_MAX_LEN, PreambleError, pull_preamble, push_preamble

# Bounds the fuzzer can choose among: the default, the smallest workable ones, one that is generous.
MAX_LENS = (DEFAULT_MAX_LEN, 16, 31, 64, 128, 256, 1024, 0xFFFF + 16)


def one_input(data: bytes) -> None:
    max_len = MAX_LENS[data[0] % len(MAX_LENS)] if data else DEFAULT_MAX_LEN
    buf = data[1:]
    try:
        got = pull_preamble(buf, max_len=max_len)
    except PreambleError:
        return
    if got is None:
        return
    p, n = got
    if not 0 < n <= len(buf) or n > max_len:
        raise AssertionError(f"consumed {n} of {len(buf)} under max_len {max_len}")
    if pull_preamble(buf[:n], max_len=max_len) != (p, n):
        raise AssertionError("the consumed bytes alone parse differently")
    for cut in range(n):
        if pull_preamble(buf[:cut], max_len=max_len) is not None:
            raise AssertionError(f"prefix of {cut} bytes is not incomplete")
    for crc in (False, True):
        again = push_preamble(p, crc32c=crc)
        if pull_preamble(again, max_len=0xFFFF + 16) != (p, len(again)):
            raise AssertionError(f"re-encoding (crc={crc}) does not parse back to {p!r}")


if __name__ == "__main__":  # pragma: no cover - run by hand under atheris
    import sys

    import atheris

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
