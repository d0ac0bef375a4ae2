"""The takeover control messages (forwarder/ingress/takeover_codec.py): every message round-trips; any
other bytes raise TakeoverError with a known reason, never anything else; fed whole, truncated at every
length, and with bytes after the object. The seed table below runs on every run."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.ingress.takeover_codec import (
    HEADER,
    MAGIC,
    MAX_COUNT,
    MAX_MESSAGE,
    MAX_PID,
    PUMP_STATE,
    ROLES,
    VERSION,
    Adopted,
    Commit,
    Done,
    Hello,
    Kind,
    Message,
    Offer,
    Ready,
    Refused,
    Released,
    TakeoverError,
    Tunnel,
    pull_message,
    push_message,
)
from sbxnet.protocol.feed import MAX_STREAM

REASONS = {"short", "too_long", "bad_magic", "bad_version", "bad_kind", "bad_json", "bad_field"}

pids = st.integers(1, MAX_PID)
texts = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=200)
roles = st.sampled_from([("tls",), ("tls", "control")])
conn_ids = st.text("0123456789abcdef", min_size=16, max_size=16)
pump_states = st.tuples(*(st.tuples(st.just(k), st.integers(lo, hi)) for k, (lo, hi) in PUMP_STATE.items()))
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, pids),
    st.builds(Offer, pids, texts, st.integers(0, MAX_STREAM), roles),
    st.builds(Ready, pids, st.booleans()),
    st.builds(Released, pids, st.integers(0, MAX_COUNT), st.integers(0, MAX_COUNT)),
    st.builds(Refused, texts),
    st.builds(Tunnel, conn_ids, texts, st.integers(0, MAX_COUNT), pump_states),
    st.builds(Adopted, conn_ids),
    st.builds(Commit, st.integers(0, MAX_COUNT)),
    st.builds(Done, pids),
)
PUMP = {"up_pipe_bytes": 5, "down_pipe_bytes": 0, "flags": 1, "evflags": 1, "close_timeout_ms": 30000,
        "close_left_ms": -1, "dir_state": 0, "bytes_up": 10, "bytes_down": 2}
CID = "00112233aabbccdd"


def raw(kind: int, body: object, *, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body)
    return magic + bytes((version, kind)) + text.encode()


def reason_of(data: bytes) -> str:
    try:
        pull_message(data)
    except TakeoverError as e:
        assert e.reason in REASONS
        return e.reason
    return "ok"


# Seeds: (expected, what, bytes). Each is replayed on every run; each refusal names its reason.
SEEDS: list[tuple[str, str, bytes]] = [
    ("ok", "hello", raw(Kind.HELLO, {"pid": 1})),
    ("ok", "offer-both-fds", raw(Kind.OFFER, {"pid": 7, "listen": "0.0.0.0:8443", "stream": 1,
                                               "fds": ["tls", "control"]})),
    ("ok", "offer-tls-only", raw(Kind.OFFER, {"pid": 7, "listen": "[::]:8443", "stream": MAX_STREAM,
                                               "fds": ["tls"]})),
    ("ok", "released-zero-open", raw(Kind.RELEASED, {"pid": MAX_PID, "open_connections": 0, "moving": 0})),
    ("ok", "ready-tunnels", raw(Kind.READY, {"pid": 9, "tunnels": True})),
    ("ok", "tunnel", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "sbx-1", "head": 0, "pump": PUMP})),
    ("ok", "adopted", raw(Kind.ADOPTED, {"conn_id": CID})),
    ("ok", "commit", raw(Kind.COMMIT, {"count": 3})),
    ("ok", "done", raw(Kind.DONE, {"pid": 9})),
    ("bad_field", "done-pid-zero", raw(Kind.DONE, {"pid": 0})),
    ("bad_field", "done-count-not-pid", raw(Kind.DONE, {"count": 3})),
    ("bad_field", "ready-tunnels-int", raw(Kind.READY, {"pid": 9, "tunnels": 1})),
    ("bad_field", "tunnel-conn-id-upper", raw(Kind.TUNNEL, {"conn_id": CID.upper(), "sandbox_id": "s", "head": 0,
                                                             "pump": PUMP})),
    ("bad_field", "tunnel-conn-id-short", raw(Kind.ADOPTED, {"conn_id": CID[:15]})),
    ("bad_field", "tunnel-pump-missing-key", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "s", "head": 0,
                                                                "pump": {k: PUMP[k] for k in list(PUMP)[:-1]}})),
    ("bad_field", "tunnel-pump-extra-key", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "s", "head": 0,
                                                              "pump": {**PUMP, "x": 1}})),
    ("bad_field", "tunnel-pump-flags-over", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "s", "head": 0,
                                                               "pump": {**PUMP, "flags": 2}})),
    ("bad_field", "tunnel-pump-left-under", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "s", "head": 0,
                                                               "pump": {**PUMP, "close_left_ms": -2}})),
    ("bad_field", "tunnel-pump-not-object", raw(Kind.TUNNEL, {"conn_id": CID, "sandbox_id": "s", "head": 0,
                                                               "pump": list(PUMP.values())})),
    ("ok", "refused", raw(Kind.REFUSED, {"reason": "busy"})),
    ("short", "empty", b""),
    ("short", "header-only-less-one", MAGIC + bytes((VERSION,))),
    ("bad_json", "header-only", MAGIC + bytes((VERSION, Kind.READY))),
    ("bad_magic", "http", b"GET / HTTP/1.1\r\n\r\n"),
    ("bad_version", "version-2", raw(Kind.HELLO, {"pid": 1}, version=2)),
    ("bad_kind", "kind-0", raw(0, {"pid": 1})),
    ("bad_kind", "kind-10", raw(10, {"pid": 1})),
    ("ok", "at-limit", raw(Kind.REFUSED, {"reason": "x"}).ljust(MAX_MESSAGE)),  # JSON takes trailing spaces
    ("too_long", "one-over", raw(Kind.REFUSED, {"reason": "x"}).ljust(MAX_MESSAGE + 1)),
    ("bad_json", "nan", raw(Kind.HELLO, '{"pid": NaN}')),
    ("bad_json", "array", raw(Kind.HELLO, "[1]")),
    ("bad_json", "trailing-bytes", raw(Kind.HELLO, '{"pid": 1}x')),
    ("bad_json", "not-utf8", MAGIC + bytes((VERSION, Kind.HELLO)) + b'{"pid": "\xff"}'),
    ("bad_json", "deep-nesting", raw(Kind.HELLO, "[" * 1015 + "]" * 1015)),
    ("bad_field", "pid-bool", raw(Kind.HELLO, {"pid": True})),
    ("bad_field", "pid-zero", raw(Kind.HELLO, {"pid": 0})),
    ("bad_field", "pid-float", raw(Kind.READY, {"pid": 1.0, "tunnels": False})),
    ("bad_field", "pid-over", raw(Kind.READY, {"pid": MAX_PID + 1, "tunnels": False})),
    ("bad_field", "unknown-key", raw(Kind.HELLO, {"pid": 1, "x": 1})),
    ("bad_field", "missing-key", raw(Kind.RELEASED, {"pid": 1, "open_connections": 0})),
    ("bad_field", "duplicate-key-last-wins-then-extra", raw(Kind.HELLO, '{"pid": 1, "pid": 2, "z": 0}')),
    ("bad_field", "stream-over", raw(Kind.OFFER, {"pid": 7, "listen": "a:1", "stream": MAX_STREAM + 1,
                                                   "fds": ["tls"]})),
    ("bad_field", "fds-control-first", raw(Kind.OFFER, {"pid": 7, "listen": "a:1", "stream": 0,
                                                         "fds": ["control", "tls"]})),
    ("bad_field", "fds-twice", raw(Kind.OFFER, {"pid": 7, "listen": "a:1", "stream": 0, "fds": ["tls", "tls"]})),
    ("bad_field", "fds-unknown", raw(Kind.OFFER, {"pid": 7, "listen": "a:1", "stream": 0, "fds": ["tls", "ops"]})),
    ("bad_field", "fds-empty", raw(Kind.OFFER, {"pid": 7, "listen": "a:1", "stream": 0, "fds": []})),
    ("bad_field", "listen-control-char", raw(Kind.OFFER, {"pid": 7, "listen": "a\n:1", "stream": 0,
                                                           "fds": ["tls"]})),
    ("bad_field", "reason-empty", raw(Kind.REFUSED, {"reason": ""})),
    ("bad_field", "reason-non-ascii", raw(Kind.REFUSED, {"reason": "bus\u00ff"})),
    ("bad_field", "open-negative", raw(Kind.RELEASED, {"pid": 1, "open_connections": -1, "moving": 0})),
]


@pytest.mark.parametrize(("expected", "data"), [(e, d) for e, _, d in SEEDS], ids=[w for _, w, _ in SEEDS])
def test_seed(expected: str, data: bytes) -> None:
    assert reason_of(data) == expected


def test_seeds_cover_every_reason() -> None:
    assert {e for e, _, _ in SEEDS} == REASONS | {"ok"}


@given(messages)
@settings(max_examples=300, deadline=None)
def test_round_trip(msg: Message) -> None:
    data = push_message(msg)
    assert len(data) <= MAX_MESSAGE
    assert pull_message(data) == msg


@given(messages)
@settings(max_examples=100, deadline=None)
def test_every_truncation_and_trailing_byte_refused(msg: Message) -> None:
    data = push_message(msg)
    for n in range(len(data)):
        assert reason_of(data[:n]) != "ok"
    assert reason_of(data + b"}") == "bad_json"


@given(st.binary(max_size=300))
@settings(max_examples=500, deadline=None)
def test_any_bytes_parse_or_raise_takeover_error(data: bytes) -> None:
    reason_of(data)
    reason_of(MAGIC + bytes((VERSION,)) + data)


@given(st.sampled_from(list(Kind)), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["pid", "listen", "stream", "fds", "open_connections", "reason", "x", "tunnels", "moving", "conn_id",
         "sandbox_id", "head", "pump", "count", *PUMP_STATE]), inner, max_size=5),
    max_leaves=12,
))
@settings(max_examples=500, deadline=None)
def test_any_json_body_parses_or_raises_takeover_error(kind: Kind, body: object) -> None:
    data = MAGIC + bytes((VERSION, kind)) + json.dumps(body).encode()
    if reason_of(data) == "ok":
        assert push_message(pull_message(data)) is not None  # what we take, we could send


def test_push_refuses_what_pull_would() -> None:
    with pytest.raises(ValueError):
        push_message(Hello(0))
    with pytest.raises(ValueError):
        push_message(Offer(1, "a:1", 0, ("control",)))
    assert HEADER == 6 and ROLES == ("tls", "control")
