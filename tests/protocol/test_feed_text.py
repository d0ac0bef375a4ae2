"""native/feed_text.c (the feed's number columns as JSON text, and the ages in ms) against its Python
references in sbxnet/protocol/feed.py, and push_columns the same with arrays as with lists."""

from __future__ import annotations

import math
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol import feed
from sbxnet.protocol.feed import COUNT_MAX, IDLE_MS_MAX, ages_ms, pull_batch, push_columns

native = pytest.mark.skipif(not feed.NATIVE_COLUMNS, reason="native/_feed_text is not built "
                            "(native/build_feed_text.py, built by pip install -e . via setup.py)")
EPOCH = "5-0123456789abcdef"
int64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-3, 1100)


@native
@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(int64, small), max_size=40), st.one_of(st.sampled_from([COUNT_MAX, IDLE_MS_MAX, 0, 1000]),
                                                               int64))
def test_int_array_is_its_reference(values: list[int], high: int) -> None:
    a = array("q", values)
    got = feed._int_array_native(a, high)
    assert got == feed._int_array_py(values, high)
    if got is not None:
        assert got == ("[" + ",".join(map(str, values)) + "]").encode()


@native
def test_int_array_every_digit_count() -> None:
    values = [0, *(10**k for k in range(19)), *(10**k - 1 for k in range(1, 19)), COUNT_MAX]
    assert feed._int_array_native(array("q", values), COUNT_MAX) == ("[" + ",".join(map(str, values)) + "]").encode()
    assert feed._int_array_native(array("q", [5, -1]), COUNT_MAX) is None
    assert feed._int_array_native(array("q", [1001]), 1000) is None
    assert feed._int_array_native(array("q"), -1) == b"[]"


times = st.one_of(st.floats(), st.floats(-1e6, 1e6), st.integers(-(10**6), 10**6).map(lambda ms: 100.0 - ms / 1000),
                  st.integers(0, 10**7).map(lambda h: 100.0 - (h + 0.5) / 1000))  # ties at half a ms


@native
@settings(max_examples=500, deadline=None)
@given(st.one_of(st.just(100.0), st.floats()), st.lists(times, max_size=30),
       st.sampled_from([IDLE_MS_MAX, 0, 1, 5000, 2**53 - 1]))
def test_ages_ms_is_its_reference(now: float, last: list[float], high_ms: int) -> None:
    got = ages_ms(now, last, high_ms)
    want = feed._ages_ms_py(now, last, high_ms)
    assert (None if got is None else list(got)) == want
    if want is not None and math.isfinite(now):
        for t, ms in zip(last, want, strict=True):
            assert 0 <= ms <= high_ms
            x = (now - t) * 1000.0
            if 0 < x < high_ms:
                assert ms == round(x)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.just(100.0), st.floats()), st.lists(times, max_size=30),
       st.sampled_from([IDLE_MS_MAX, 0, 1, 5000]))
def test_ages_ms_without_the_extension_is_the_reference(now: float, last: list[float], high_ms: int) -> None:
    saved = feed._FT
    feed._FT = None
    try:
        got = ages_ms(now, last, high_ms)
    finally:
        feed._FT = saved
    assert got == feed._ages_ms_py(now, last, high_ms)


def test_ages_ms_rounds_like_python_and_clamps() -> None:
    # Ties to even, a time ahead of now, one older than the bound; a time that is not a number.
    assert list(ages_ms(1.0, [1.0, 0.75, 2.0, -1e300]) or []) == [0, 250, 0, IDLE_MS_MAX]
    ties = [-(k + 0.5) / 1000 for k in range(6)]
    got = list(ages_ms(0.0, ties) or [])
    assert got == [round(-t * 1000.0) for t in ties]
    assert all(ms % 2 == 0 for t, ms in zip(ties, got, strict=True) if -t * 1000.0 % 1 == 0.5)  # ties to even
    assert ages_ms(1.0, [math.nan]) is None and ages_ms(1.0, [math.inf]) is None and ages_ms(math.nan, [1.0]) is None
    assert ages_ms(1.0, ["x"]) is None  # type: ignore[list-item]
    empty = ages_ms(1.0, [])
    assert empty is not None and list(empty) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, COUNT_MAX), st.integers(0, COUNT_MAX), st.integers(0, 5),
                          st.integers(0, IDLE_MS_MAX)), max_size=20))
def test_push_columns_takes_arrays_for_lists(entries: list[tuple[int, int, int, int]]) -> None:
    ids = [f"s{i}" for i in range(len(entries))]
    cols = [[e[k] for e in entries] for k in range(4)]
    data = push_columns(EPOCH, 1, ids, *cols)
    assert push_columns(EPOCH, 1, ids, *(array("q", c) for c in cols)) == data
    assert len(pull_batch(data).sandboxes) == len(entries)


@pytest.mark.parametrize(("column", "value", "reason"), [(0, -1, "bad_count"), (2, -5, "bad_count"),
                                                          (3, IDLE_MS_MAX + 1, "bad_idle"), (3, -1, "bad_idle")])
def test_push_columns_refuses_arrays_as_lists(column: int, value: int, reason: str) -> None:
    cols = [array("q", [1, 1]) for _ in range(4)]
    cols[column][1] = value
    with pytest.raises(LocalProtocolError) as ei:
        push_columns(EPOCH, 1, ["a", "b"], *cols)
    assert ei.value.reason == reason
