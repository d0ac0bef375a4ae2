"""The idle feed's codec (sbxnet/protocol/feed.py): golden bytes, round trips, every refusal, epochs."""

from __future__ import annotations

import json
import math
import re
from typing import cast

import pytest
from feed_cases import (
    ANSWER_GOLDEN,
    ANSWER_REFUSALS,
    BATCH_REFUSALS,
    EPOCH,
    EQUIVALENT,
    GOLDEN,
    RAND8,
    ROW_REFUSALS,
    ROWS,
    START_NS,
    body,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from sbxnet.errors import LocalProtocolError, RemoteProtocolError
from sbxnet.protocol import feed
from sbxnet.protocol.feed import (
    COUNT_MAX,
    IDLE_MS_MAX,
    IDLE_S_MAX,
    MAX_ANSWER_BYTES,
    MAX_BODY_BYTES,
    MAX_SANDBOXES,
    Answer,
    Batch,
    FeedError,
    SandboxReport,
    are_sandbox_ids,
    epoch_is_newer,
    epoch_start_ns,
    is_epoch,
    is_sandbox_id,
    new_epoch,
    pull_answer,
    pull_batch,
    push_answer,
    push_batch,
    push_columns,
)

# --- golden bytes and equivalents ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "batch", "data"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden(name: str, batch: Batch, data: bytes) -> None:
    assert push_batch(batch) == data
    assert pull_batch(data) == batch


@pytest.mark.parametrize(("name", "batch", "data"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_agrees_with_json_module(name: str, batch: Batch, data: bytes) -> None:
    # An independent encoder as the oracle: json.dumps of the same object, compact, in the fixed key order.
    assert json.dumps(_as_json(batch), separators=(",", ":"), allow_nan=False).encode() == data
    rs = batch.sandboxes
    assert push_columns(batch.epoch, batch.seq, [r.sandbox for r in rs], [r.bytes_in for r in rs],
                        [r.bytes_out for r in rs], [r.open for r in rs], [round(r.idle_s * 1000) for r in rs]) == data


def _as_json(batch: Batch) -> dict[str, object]:
    rs = batch.sandboxes
    return {
        "epoch": batch.epoch,
        "seq": batch.seq,
        "sandboxes": [r.sandbox for r in rs],
        "bytes_in": [r.bytes_in for r in rs],
        "bytes_out": [r.bytes_out for r in rs],
        "open": [r.open for r in rs],
        "idle_ms": [round(r.idle_s * 1000) for r in rs],
    }


@pytest.mark.parametrize(("name", "batch", "data"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_every_proper_prefix_is_refused(name: str, batch: Batch, data: bytes) -> None:
    # Bodies are parsed whole: a body cut anywhere is never taken for a shorter batch.
    for cut in range(len(data)):
        with pytest.raises(FeedError) as ei:
            pull_batch(data[:cut])
        assert ei.value.reason == "bad_json"


@pytest.mark.parametrize(("name", "batch", "data"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_trailing_whitespace_is_json_and_anything_else_is_not(name: str, batch: Batch, data: bytes) -> None:
    assert pull_batch(b"\n " + data + b" \r\n\t") == batch
    for tail in (b"x", b"\0", b",", b"}", b" 1", data):
        with pytest.raises(FeedError) as ei:
            pull_batch(data + tail)
        assert ei.value.reason == "trailing_data"


@pytest.mark.parametrize(("name", "data", "batch"), EQUIVALENT, ids=[e[0] for e in EQUIVALENT])
def test_equivalent_bodies(name: str, data: bytes, batch: Batch) -> None:
    got = pull_batch(data)
    assert got == batch
    assert pull_batch(push_batch(got)) == got


@pytest.mark.parametrize(("name", "data", "batch"), ROWS, ids=[e[0] for e in ROWS])
def test_the_row_form_is_pulled_and_pushed_as_columns(name: str, data: bytes, batch: Batch) -> None:
    got = pull_batch(data)
    assert got == batch
    again = push_batch(got)
    assert b'"idle_ms":[' in again and pull_batch(again) == got


@pytest.mark.parametrize(("reason", "name", "data"), ROW_REFUSALS, ids=[f"{r}-{n}" for r, n, _ in ROW_REFUSALS])
def test_the_row_form_is_refused_as_strictly(reason: str, name: str, data: bytes) -> None:
    assert _reason(data) == reason


def test_pull_takes_bytearray_and_memoryview() -> None:
    _name, batch, data = GOLDEN[0]
    assert pull_batch(bytearray(data)) == batch
    assert pull_batch(memoryview(data)) == batch


def test_negative_zero_idle_pushes_as_zero() -> None:
    b = Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 0, -0.0),))
    assert b'"idle_ms":[0]}' in push_batch(b)
    got = pull_batch(push_batch(b)).sandboxes[0].idle_s
    assert got == 0.0 and math.copysign(1.0, got) == 1.0


def test_idle_s_pushes_to_the_nearest_ms() -> None:
    b = Batch(EPOCH, 1, (SandboxReport("a", 0, 0, 0, 1 / 7), SandboxReport("b", 0, 0, 0, 0.0004999),
                         SandboxReport("c", 0, 0, 0, 0.0015), SandboxReport("d", 0, 0, 0, IDLE_S_MAX)))
    assert b'"idle_ms":[143,0,2,4294967296000]}' in push_batch(b)
    assert [r.idle_s for r in pull_batch(push_batch(b)).sandboxes] == [0.143, 0.0, 0.002, IDLE_S_MAX]


# --- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reason", "name", "data"), BATCH_REFUSALS, ids=[f"{r}-{n}" for r, n, _ in BATCH_REFUSALS])
def test_refused(reason: str, name: str, data: bytes) -> None:
    with pytest.raises(FeedError) as ei:
        pull_batch(data)
    assert ei.value.reason == reason
    assert isinstance(ei.value, RemoteProtocolError)
    assert ei.value.http_status == 400


def test_every_reason_has_a_case() -> None:
    doc = feed.__doc__ or ""
    listed = set(re.findall(r"^    ([a-z0-9_]+) {2,}", doc.split("Reason tokens")[1], re.M))
    answer_only = {"unknown_error", "bad_acked", "status_mismatch"}
    built_here = {"too_large", "too_many_sandboxes"}
    assert {r for r, _, _ in BATCH_REFUSALS} == listed - answer_only - built_here
    assert {r for r, _ in ANSWER_REFUSALS} | {"status_mismatch"} >= answer_only


def test_too_large() -> None:
    data = b" " * (MAX_BODY_BYTES - len(GOLDEN[0][2])) + GOLDEN[0][2]
    assert pull_batch(data) == GOLDEN[0][1]  # exactly at the bound
    with pytest.raises(FeedError) as ei:
        pull_batch(b" " + data)
    assert ei.value.reason == "too_large" and ei.value.http_status == 413


def test_too_many_sandboxes() -> None:
    # Counted before the other arrays and any entry are judged, so they need not be valid.
    for n, reason in ((MAX_SANDBOXES, "bad_length"), (MAX_SANDBOXES + 1, "too_many_sandboxes")):
        data = (b'{"epoch":"' + EPOCH.encode() + b'","seq":1,"sandboxes":[' + b",".join([b"0"] * n)
                + b'],"bytes_in":[],"bytes_out":[],"open":[],"idle_ms":[]}')
        with pytest.raises(FeedError) as ei:
            pull_batch(data)
        assert ei.value.reason == reason


def test_the_largest_batch_fits_the_body_bound() -> None:
    worst = SandboxReport("x" * 64, COUNT_MAX, COUNT_MAX, COUNT_MAX, IDLE_S_MAX)
    entries = tuple(SandboxReport(f"{i:064d}", *worst[1:]) for i in range(MAX_SANDBOXES))
    data = push_batch(Batch("9223372036854775807-ffffffffffffffff", COUNT_MAX, entries))
    assert len(data) < MAX_BODY_BYTES * 0.7
    assert len(pull_batch(data).sandboxes) == MAX_SANDBOXES


def test_first_failing_check_names_the_reason() -> None:
    # Unknown keys before missing ones, then values in wire order.
    assert _reason(body({"extra": 1}, drop="seq")) == "unknown_field"
    assert _reason(body({"epoch": "x", "seq": 0})) == "bad_epoch"
    assert _reason(body({"seq": 0}, entry={"sandbox": ""})) == "bad_seq"
    assert _reason(body({"seq": 0, "bytes_in": 5})) == "bad_seq"
    assert _reason(body({"bytes_in": 5, "bytes_out": []})) == "bad_type"  # arrays before entries
    assert _reason(body({"bytes_in": [], "bytes_out": 5})) == "bad_length"  # in key order
    assert _reason(body(entry={"sandbox": "", "bytes_in": -1})) == "bad_sandbox_id"
    assert _reason(body(entry={"bytes_out": -1, "idle_ms": -1})) == "bad_count"
    # Entries in index order, each one's values in field order.
    two = b'"bytes_in":[1,-1],"bytes_out":[1.5,1],"open":[0,0],"idle_ms":[0,0]}'
    assert _reason(b'{"epoch":"' + EPOCH.encode() + b'","seq":3,"sandboxes":["a","b"],' + two) == "bad_type"
    assert _reason(b'{"epoch":"' + EPOCH.encode() + b'","seq":3,"sandboxes":["a","a"],' + two) == "bad_type"
    assert _reason(b'{"epoch":"' + EPOCH.encode() + b'","seq":3,"sandboxes":["a","a"],'
                   + two.replace(b"1.5", b"1")) == "duplicate_sandbox"


def test_details_carry_no_peer_text() -> None:
    secret = "tenant-secret-token"
    for data in (body({secret: 1}), body(entry={"sandbox": secret + "/"}), body({"epoch": secret})):
        with pytest.raises(FeedError) as ei:
            pull_batch(data)
        assert secret not in str(ei.value)


# --- push refuses what it cannot carry ------------------------------------------------------------------

_OK_R = SandboxReport("s", 1, 2, 3, 0.5)


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (Batch("nope", 1, ()), "bad_epoch"),
        (Batch(EPOCH, 0, ()), "bad_seq"),
        (Batch(EPOCH, 2**63, ()), "bad_seq"),
        (Batch(EPOCH, True, ()), "bad_type"),
        (Batch(EPOCH, 1, (_OK_R, _OK_R)), "duplicate_sandbox"),
        (Batch(EPOCH, 1, (SandboxReport("a b", 0, 0, 0, 0.0),)), "bad_sandbox_id"),
        (Batch(EPOCH, 1, (SandboxReport('a"', 0, 0, 0, 0.0),)), "bad_sandbox_id"),
        (Batch(EPOCH, 1, (SandboxReport("s", -1, 0, 0, 0.0),)), "bad_count"),
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 2**63, 0, 0.0),)), "bad_count"),
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 1.0, 0.0),)), "bad_type"),  # type: ignore[arg-type]
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 0, math.nan),)), "bad_idle"),
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 0, math.inf),)), "bad_idle"),
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 0, -1.0),)), "bad_idle"),
        (Batch(EPOCH, 1, (SandboxReport("s", 0, 0, 0, "0"),)), "bad_type"),  # type: ignore[arg-type]
        (Batch(EPOCH, 1, ("s",)), "bad_type"),  # type: ignore[arg-type]
        (Batch(EPOCH, 1, None), "bad_type"),  # type: ignore[arg-type]
        (Batch(EPOCH, 1, tuple(SandboxReport(f"s{i}", 0, 0, 0, 0.0) for i in range(MAX_SANDBOXES + 1))),
         "too_many_sandboxes"),
    ],
)
def test_push_refuses(batch: Batch, reason: str) -> None:
    with pytest.raises(LocalProtocolError) as ei:
        push_batch(batch)
    assert ei.value.reason == reason


_C = ("s", 1, 2, 3, 500)  # one valid entry: sandbox, bytes_in, bytes_out, open, idle_ms


def _columns(*entries: tuple[object, ...]) -> list[list[object]]:
    return [list(col) for col in zip(*entries, strict=True)] if entries else [[], [], [], [], []]


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        (_columns(("a b", *_C[1:])), "bad_sandbox_id"),
        (_columns(('a","b', *_C[1:])), "bad_sandbox_id"),  # what would pass for two IDs in the joined text
        (_columns(("", *_C[1:])), "bad_sandbox_id"),
        (_columns(("x" * 65, *_C[1:])), "bad_sandbox_id"),
        (_columns(("\u00e9", *_C[1:])), "bad_sandbox_id"),
        (_columns(("\u00e9t\u00e9", *_C[1:])), "bad_sandbox_id"),
        (_columns((b"s", *_C[1:])), "bad_type"),
        (_columns((None, *_C[1:])), "bad_type"),
        (_columns(_C, ("t", -1, 0, 0, 0)), "bad_count"),
        (_columns(_C, ("t", 0, 2**63, 0, 0)), "bad_count"),
        (_columns(_C, ("t", 0, 0, 1.0, 0)), "bad_type"),
        (_columns(_C, ("t", 0, 0, True, 0)), "bad_type"),
        (_columns(_C, ("t", "1", 0, 0, 0)), "bad_type"),
        (_columns(_C, ("t", [1], 0, 0, 0)), "bad_type"),
        (_columns(_C, ("t", 0, 0, 0, -1)), "bad_idle"),
        (_columns(_C, ("t", 0, 0, 0, IDLE_MS_MAX + 1)), "bad_idle"),
        (_columns(_C, ("t", 0, 0, 0, 0.5)), "bad_type"),
        (_columns(_C, ("t", 0, 0, 0, math.nan)), "bad_type"),
        (_columns(_C, ("t", 0, 0, 0, None)), "bad_type"),
        ([["s"], [1], [2], [3], []], "bad_length"),
        ([["s"], [1], [2], [3], "5"], "bad_type"),
        ([("s",), (1,), (2,), (3,), None], "bad_type"),
        ([[f"s{i}" for i in range(MAX_SANDBOXES + 1)], [], [], [], []], "too_many_sandboxes"),
    ],
)
def test_push_columns_refuses(columns: list[list[object]], reason: str) -> None:
    with pytest.raises(LocalProtocolError) as ei:
        push_columns(EPOCH, 1, *columns)  # type: ignore[arg-type]
    assert ei.value.reason == reason
    if isinstance(columns[0], list):
        ids_ok = all(type(v) is str and is_sandbox_id(v) for v in columns[0])
        assert are_sandbox_ids(columns[0]) == ids_ok  # type: ignore[arg-type]


def test_push_columns_takes_tuples_and_an_int_subclass_as_its_value() -> None:
    class Big(int):
        def __repr__(self) -> str:
            return "1.5"

    data = push_columns(EPOCH, 1, ("s",), (Big(7),), (2,), (3,), (500,))
    assert pull_batch(data) == Batch(EPOCH, 1, (SandboxReport("s", 7, 2, 3, 0.5),))


def test_push_refuses_a_non_batch() -> None:
    with pytest.raises(LocalProtocolError):
        push_batch(b"{}")  # type: ignore[arg-type]


# --- property tests ------------------------------------------------------------------------------------

ids = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=64)
counts = st.integers(0, COUNT_MAX)
idles = st.floats(0.0, IDLE_S_MAX, allow_nan=False, allow_infinity=False)
reports = st.builds(SandboxReport, ids, counts, counts, counts, idles)
epochs = st.builds(new_epoch, st.integers(0, COUNT_MAX), st.binary(min_size=8, max_size=8))
batches = st.builds(
    Batch,
    epochs,
    st.integers(1, COUNT_MAX),
    st.lists(reports, max_size=20, unique_by=lambda r: r.sandbox).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_round_trip(batch: Batch) -> None:
    data = push_batch(batch)
    # idle_s travels to the nearest millisecond; everything else as it is.
    sent = Batch(batch.epoch, batch.seq, tuple(
        SandboxReport(r.sandbox, r.bytes_in, r.bytes_out, r.open, round(r.idle_s * 1000) / 1000)
        for r in batch.sandboxes
    ))
    assert pull_batch(data) == sent and push_batch(sent) == data
    assert json.loads(data) == _as_json(batch)
    # Pretty-printed by another encoder, it means the same batch.
    assert pull_batch(json.dumps(json.loads(data), indent=2).encode()) == sent


@settings(max_examples=300, deadline=None)
@given(batches)
def test_push_columns_gives_push_batchs_bytes(batch: Batch) -> None:
    rs = batch.sandboxes
    cols = ([r.sandbox for r in rs], [r.bytes_in for r in rs], [r.bytes_out for r in rs], [r.open for r in rs],
            [round(r.idle_s * 1000) for r in rs])
    assert push_columns(batch.epoch, batch.seq, *cols) == push_batch(batch)
    assert are_sandbox_ids(cols[0])


_anything = st.one_of(st.integers(-(2**64), 2**64), st.floats(), st.booleans(), st.none(), st.text(max_size=3),
                      st.lists(st.integers(0, 3), max_size=2))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.one_of(ids, st.text(max_size=70), _anything), _anything, _anything, _anything,
                          _anything), max_size=6, unique_by=lambda e: repr(e[0])))
def test_push_columns_refuses_what_push_batch_would(entries: list[tuple[object, ...]]) -> None:
    # The checks on the encoded text agree with the checks value by value.
    cols = _columns(*entries)
    reasons = []
    for sid, b_in, b_out, n, idle in entries:
        ok_idle = type(idle) is int and 0 <= idle <= IDLE_MS_MAX
        idle_s = cast(int, idle) / 1000 if ok_idle else 0.0
        reports = Batch(EPOCH, 1, (SandboxReport(sid, b_in, b_out, n, idle_s),))  # type: ignore[arg-type]
        try:
            push_batch(reports)
            reasons.append(None if ok_idle or type(idle) is not int else "bad_idle")
        except LocalProtocolError as e:
            reasons.append(e.reason)
    try:
        push_columns(EPOCH, 1, *cols)  # type: ignore[arg-type]
        got = None
    except LocalProtocolError as e:
        got = e.reason
    if any(type(e[4]) is not int for e in entries):
        assert got is not None
    else:  # (the IDs differ: push_columns leaves duplicates to its caller)
        assert (got is None) == all(r is None for r in reasons)
    assert are_sandbox_ids(cols[0]) == all(  # type: ignore[arg-type]
        type(v) is str and is_sandbox_id(v) for v in cols[0]
    )


@settings(max_examples=300, deadline=None)
@given(batches, st.data())
def test_one_byte_changed_is_refused_or_another_valid_batch(batch: Batch, data: st.DataObject) -> None:
    raw = bytearray(push_batch(batch))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255))
    try:
        got = pull_batch(bytes(raw))
    except FeedError:
        return
    assert pull_batch(push_batch(got)) == got


@settings(max_examples=500, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["epoch", "seq", "sandboxes", "bytes_in", "bytes_out", "open", "idle_ms", "acked", "error", "x"]
    ), inner, max_size=6),
    max_leaves=20,
))
def test_any_json_value_parses_or_is_refused(value: object) -> None:
    data = json.dumps(value).encode()
    for pull in (pull_batch, pull_answer):
        try:
            pull(data)
        except FeedError:
            pass


# Values a column may hold after decoding: mostly in range (so whole batches pass), and each kind the
# per-entry checks refuse (a bool is not an int; an integer literal too long is kept as text).
_column_value = st.one_of(
    st.integers(0, 3), st.integers(0, COUNT_MAX), st.sampled_from([0, COUNT_MAX, COUNT_MAX + 1, -1, IDLE_MS_MAX,
                                                                   IDLE_MS_MAX + 1]),
    st.booleans(), st.floats(0, 10), st.none(), st.text(max_size=2), st.builds(feed._Huge, st.just("9" * 25)),
)
_column_id = st.one_of(st.sampled_from(["a", "b", "sbx-1", "x" * 64]), ids, st.text(max_size=66), _anything)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.tuples(_column_id, _column_value, _column_value, _column_value, _column_value), max_size=6))
def test_the_column_fast_path_accepts_exactly_what_the_entry_checks_do(entries: list[tuple[object, ...]]) -> None:
    """pull_batch judges a batch's columns a whole column at a time and, when that refuses, entry by entry
    (which names the reason): the two must accept the same batches and give the same reports."""
    ids_, *columns = ([e[i] for e in entries] for i in range(5))
    fast = feed._columns_fast(ids_, columns)
    try:
        checked = feed._columns_checked(ids_, columns, FeedError)
    except FeedError:
        assert fast is None
    else:
        assert fast == checked and all(type(r) is SandboxReport for r in fast)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.one_of(st.integers(-(10**30), 10**30), st.text("0123456789-x", max_size=30)), max_size=5))
def test_a_body_decoded_without_the_integer_hook_decodes_as_with_it(values: list[object]) -> None:
    """Where no digit run is long enough for an integer over the profile's length, the decoder without the
    per-integer hook is used: it must give what the hooked one gives (no integer kept as text)."""
    raw = json.dumps(values).encode()
    hooked = feed._DECODER.decode(raw.decode())
    if not feed._has_long_digits(raw):
        assert feed._PLAIN_DECODER.decode(raw.decode()) == hooked
        assert not any(isinstance(v, feed._Huge) for v in hooked)
    if any(isinstance(v, feed._Huge) for v in hooked):
        assert feed._has_long_digits(raw)


def test_an_integer_literal_at_the_length_bound_is_found_either_way() -> None:
    for text, long in (("9" * 20, False), ("9" * 21, True), ("-" + "9" * 19, False), ("-" + "9" * 20, True)):
        assert feed._has_long_digits(f"[{text}]".encode()) is long, text
        assert isinstance(feed._DECODER.decode(f"[{text}]")[0], feed._Huge) is long, text


# --- answers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("answer", "data", "status"), ANSWER_GOLDEN)
def test_answer_golden(answer: Answer, data: bytes, status: int) -> None:
    assert push_answer(answer) == data
    assert answer.http_status == status
    assert pull_answer(data) == answer
    assert pull_answer(data, status) == answer
    assert pull_answer(b" " + data + b"\n") == answer
    for cut in range(len(data)):
        with pytest.raises(FeedError):
            pull_answer(data[:cut])


@pytest.mark.parametrize(("reason", "data"), ANSWER_REFUSALS)
def test_answer_refused(reason: str, data: bytes) -> None:
    with pytest.raises(FeedError) as ei:
        pull_answer(data)
    assert ei.value.reason == reason


@pytest.mark.parametrize(("data", "status"), [(b'{"acked":1}', 409), (b'{"error":"gap","acked":0}', 200),
                                              (b'{"acked":1}', 500), (b'{"error":"stale_epoch"}', 400)])
def test_answer_status_must_match_the_body(data: bytes, status: int) -> None:
    with pytest.raises(FeedError) as ei:
        pull_answer(data, status)
    assert ei.value.reason == "status_mismatch"


def test_answer_at_its_bound() -> None:
    assert pull_answer(b'{"acked":1}'.ljust(MAX_ANSWER_BYTES)) == Answer.ok(1)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (Answer(None, None), "missing_field"),
        (Answer(None, 0), "bad_acked"),
        (Answer("replay", 0), "bad_acked"),
        (Answer("gap", -1), "bad_acked"),
        (Answer("gap", None), "missing_field"),
        (Answer("stale_epoch", 3), "unknown_field"),
        (Answer("nope", 3), "unknown_error"),
        (Answer(None, True), "bad_type"),
    ],
)
def test_push_answer_refuses(answer: Answer, reason: str) -> None:
    with pytest.raises(LocalProtocolError) as ei:
        push_answer(answer)
    assert ei.value.reason == reason


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.integers(1, COUNT_MAX).map(Answer.ok),
    st.integers(1, COUNT_MAX).map(Answer.replay),
    st.integers(0, COUNT_MAX).map(Answer.gap),
    st.just(Answer.stale_epoch()),
))
def test_answer_round_trip(answer: Answer) -> None:
    data = push_answer(answer)
    assert pull_answer(data, answer.http_status) == answer
    assert json.loads(data) == {k: v for k, v in (("error", answer.error), ("acked", answer.acked)) if v is not None}


# --- epochs --------------------------------------------------------------------------------------------


def test_new_epoch() -> None:
    assert new_epoch(START_NS, RAND8) == EPOCH
    assert new_epoch(0, bytes(8)) == "0-0000000000000000"
    assert new_epoch(COUNT_MAX, b"\xff" * 8) == "9223372036854775807-ffffffffffffffff"
    assert new_epoch(5, bytes(range(8))) == "5-0001020304050607"
    assert epoch_start_ns(EPOCH) == START_NS


@pytest.mark.parametrize(
    ("start_ns", "rand8"),
    [(-1, bytes(8)), (2**63, bytes(8)), (True, bytes(8)), (1.0, bytes(8)), (1, bytes(7)), (1, bytes(9)), (1, "a" * 8)],
)
def test_new_epoch_refuses(start_ns: object, rand8: object) -> None:
    with pytest.raises(LocalProtocolError) as ei:
        new_epoch(start_ns, rand8)  # type: ignore[arg-type]
    assert ei.value.reason == "bad_epoch"


def test_epoch_order_is_by_start_time_alone() -> None:
    a, b = new_epoch(100, bytes(8)), new_epoch(101, bytes(8))
    assert epoch_is_newer(b, a) and not epoch_is_newer(a, b)
    assert not epoch_is_newer(a, a)
    same_ns = new_epoch(100, b"\xff" * 8)
    assert not epoch_is_newer(same_ns, a) and not epoch_is_newer(a, same_ns)
    # Numeric, not textual: "99" sorts after "100" as text.
    assert epoch_is_newer(new_epoch(100, bytes(8)), new_epoch(99, b"\xff" * 8))
    with pytest.raises(LocalProtocolError):
        epoch_is_newer("x", a)
    with pytest.raises(LocalProtocolError):
        epoch_start_ns("01-0000000000000000")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, COUNT_MAX), st.integers(0, COUNT_MAX), st.binary(min_size=8, max_size=8))
def test_epoch_order_matches_start_times(a: int, b: int, r: bytes) -> None:
    ea, eb = new_epoch(a, r), new_epoch(b, r)
    assert is_epoch(ea) and epoch_start_ns(ea) == a
    assert epoch_is_newer(ea, eb) == (a > b)


def test_is_epoch_and_is_sandbox_id() -> None:
    assert is_epoch(EPOCH) and not is_epoch(EPOCH.upper()) and not is_epoch(None) and not is_epoch(EPOCH + "\n")
    assert is_sandbox_id("a" * 64) and not is_sandbox_id("a" * 65) and not is_sandbox_id("") and not is_sandbox_id(5)
    assert not is_sandbox_id("sbx\n")


def _reason(data: bytes) -> str:
    try:
        pull_batch(data)
    except FeedError as exc:
        return exc.reason
    return "ok"
