"""Internet checksum in C against the pure-Python reference: every length 0-9001 at every alignment
class, edge patterns, and RFC 1624 incremental updates against recomputation."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress import fastpath as fp
from forwarder.egress import reference as ref


def bigint_sum(data: bytes, initial: int = 0) -> int:
    """A second, independent oracle: 2^16 = 1 (mod 0xFFFF), so the folded word sum is the data read as
    one big integer, mod 0xFFFF, with zero written 0xFFFF unless everything was zero."""
    v = int.from_bytes(data + b"\x00" * (len(data) & 1), "big") + initial
    if v == 0:
        return 0
    return v % 0xFFFF or 0xFFFF


def test_every_length_to_9001_random_data_random_alignment() -> None:
    rnd = random.Random(9001)
    blob = rnd.randbytes(9001 + 16)
    view = memoryview(blob)
    for n in range(9002):
        start = rnd.randrange(16)
        data = view[start : start + n]
        initial = rnd.randrange(0x10000) if n % 7 == 0 else 0
        got = fp.csum(data, initial)
        assert got == ref.csum(bytes(data), initial), (n, start, initial)


def test_every_length_edge_patterns() -> None:
    ones = b"\xff" * 9010
    for n in range(9002):
        for start in (0, 1, 3):
            d = ones[start : start + n]
            assert fp.csum(d) == bigint_sum(d), n
    zeros = bytes(9002)
    for n in range(0, 9002, 97):
        assert fp.csum(zeros[:n]) == 0
        assert fp.checksum(zeros[:n]) == 0xFFFF


def test_carry_heavy_lengths_match_bigint_oracle() -> None:
    rnd = random.Random(1)
    for n in [*range(60), 255, 256, 257, 1499, 1500, 1501, 4095, 4096, 9000, 9001, 65535, 65536]:
        d = bytes(rnd.choice((0x00, 0x01, 0xFE, 0xFF)) for _ in range(n))
        assert fp.csum(d) == bigint_sum(d) == ref.csum(d), n


def test_known_vector_rfc1071() -> None:
    # RFC 1071 section 3: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2.
    assert fp.csum(bytes.fromhex("0001f203f4f5f6f7")) == 0xDDF2
    assert fp.checksum(bytes.fromhex("0001f203f4f5f6f7")) == 0x220D


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(min_size=4, max_size=200).filter(lambda b: len(b) % 2 == 0),
    pos=st.integers(min_value=0),
    new=st.integers(min_value=0, max_value=0xFFFFFFFF),
)
def test_incremental_update_matches_recompute(data: bytes, pos: int, new: int) -> None:
    pos = (pos % (len(data) // 2 - 1)) * 2 if len(data) > 4 else 0
    old = int.from_bytes(data[pos : pos + 4], "big")
    check = fp.checksum(data)
    after = data[:pos] + new.to_bytes(4, "big") + data[pos + 4 :]
    upd = fp.csum_update32(check, old, new)
    assert upd == ref.csum_update32(check, old, new, False)
    # Same value in ones' complement arithmetic (0x0000 and 0xFFFF both mean zero).
    assert upd % 0xFFFF == fp.checksum(after) % 0xFFFF
    # The partial (non-inverted) form is a running sum of the same words.
    part = fp.csum(data)
    pupd = fp.csum_update32(part, old, new, partial=True)
    assert pupd == ref.csum_update32(part, old, new, True)
    assert pupd % 0xFFFF == fp.csum(after) % 0xFFFF


@settings(max_examples=500, deadline=None)
@given(
    check=st.integers(0, 0xFFFF), frm=st.integers(0, 0xFFFFFFFF), to=st.integers(0, 0xFFFFFFFF),
    partial=st.booleans(),
)
def test_update_c_equals_reference_on_all_words(check: int, frm: int, to: int, partial: bool) -> None:
    assert fp.csum_update32(check, frm, to, partial) == ref.csum_update32(check, frm, to, partial)
