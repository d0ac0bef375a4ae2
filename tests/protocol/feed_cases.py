"""Shared idle-feed cases: golden batches and answers, and one refused body per reason and shape.

Used by tests/protocol/test_feed.py and by tests/fuzz/make_feed_seeds.py (the seed corpus).
"""

from __future__ import annotations

import json

from sbxnet.protocol.feed import Answer, Batch, SandboxReport

EPOCH = "1764576000123456789-9f3a0c5e11d24b07"
RAND8 = bytes.fromhex("9f3a0c5e11d24b07")
START_NS = 1764576000123456789

# (name, batch, the canonical bytes), written out by hand so the encoder is held to a literal.
GOLDEN: list[tuple[str, Batch, bytes]] = [
    (
        "contract-example",
        Batch(EPOCH, 42, (SandboxReport("sbx-1", 1200, 88000, 2, 0.35), SandboxReport("sbx-2", 0, 17, 0, 12.0))),
        b'{"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":42,"sandboxes":["sbx-1","sbx-2"],'
        b'"bytes_in":[1200,0],"bytes_out":[88000,17],"open":[2,0],"idle_ms":[350,12000]}',
    ),
    (
        "empty",
        Batch("0-0000000000000000", 1, ()),
        b'{"epoch":"0-0000000000000000","seq":1,"sandboxes":[],"bytes_in":[],"bytes_out":[],"open":[],'
        b'"idle_ms":[]}',
    ),
    (
        "two-sandboxes",
        Batch(EPOCH, 1, (SandboxReport("a", 0, 0, 0, 0.0), SandboxReport("B.c_d-9", 5, 0, 1, 0.001))),
        b'{"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":1,"sandboxes":["a","B.c_d-9"],'
        b'"bytes_in":[0,5],"bytes_out":[0,0],"open":[0,1],"idle_ms":[0,1]}',
    ),
    (
        "extremes",
        Batch(
            "9223372036854775807-ffffffffffffffff",
            2**63 - 1,
            (SandboxReport("x" * 64, 2**63 - 1, 2**63 - 1, 2**63 - 1, 4294967296.0),
             SandboxReport("tiny", 1, 1, 0, 0.0)),
        ),
        b'{"epoch":"9223372036854775807-ffffffffffffffff","seq":9223372036854775807,"sandboxes":["'
        + b"x" * 64 + b'","tiny"],"bytes_in":[9223372036854775807,1],"bytes_out":[9223372036854775807,1],'
        b'"open":[9223372036854775807,0],"idle_ms":[4294967296000,0]}',
    ),
]

_T = '"epoch":"5-0123456789abcdef","seq":1,'


def _cols(ids: str, b_in: str, b_out: str, n_open: str, idle: str, top: str = _T) -> bytes:
    """A batch body with these literal arrays."""
    return (
        "{" + top + f'"sandboxes":[{ids}],"bytes_in":[{b_in}],"bytes_out":[{b_out}],"open":[{n_open}],'
        f'"idle_ms":[{idle}]}}'
    ).encode()


# (name, body, the batch it means): accepted, not canonical.
EQUIVALENT: list[tuple[str, bytes, Batch]] = [
    ("whitespace", b' \r\n\t{ "epoch" : "0-0000000000000000" ,\n "seq" : 1 , "sandboxes" : [ ] ,'
     b' "bytes_in" : [ ] , "bytes_out" : [], "open":[ ],\t"idle_ms" : [\n] }\n ',
     Batch("0-0000000000000000", 1, ())),
    ("key-order", b'{"idle_ms":[1000],"open":[0],"bytes_out":[2],"bytes_in":[3],"sandboxes":["s"],'
     b'"seq":7,"epoch":"5-0123456789abcdef"}',
     Batch("5-0123456789abcdef", 7, (SandboxReport("s", 3, 2, 0, 1.0),))),
    ("negative-zero", _cols('"s"', "-0", "0", "-0", "-0"),
     Batch("5-0123456789abcdef", 1, (SandboxReport("s", 0, 0, 0, 0.0),))),
    ("escaped-id", _cols('"\\u0073bx"', "0", "0", "0", "0"),
     Batch("5-0123456789abcdef", 1, (SandboxReport("sbx", 0, 0, 0, 0.0),))),
    ("spaces-in-arrays", _cols(' "a" , "b" ', " 1 ,2", "3, 4", "0 ,0", " 5 , 6 "),
     Batch("5-0123456789abcdef", 1, (SandboxReport("a", 1, 3, 0, 0.005), SandboxReport("b", 2, 4, 0, 0.006)))),
]

_ENTRY = {"sandbox": "sbx-1", "bytes_in": 1, "bytes_out": 2, "open": 0, "idle_ms": 500}
_COLUMN = {"sandbox": "sandboxes", "bytes_in": "bytes_in", "bytes_out": "bytes_out", "open": "open",
           "idle_ms": "idle_ms"}


def body(top: dict[str, object] | None = None, entry: dict[str, object] | None = None, *, drop: str = "") -> bytes:
    """A batch body of one sandbox, with top-level keys (a whole array, too) or the sandbox's values
    (``entry``: by field, ``sandbox`` for its ID) overridden, or one top-level key dropped."""
    e: dict[str, object] = {**_ENTRY, **(entry or {})}
    b: dict[str, object] = {"epoch": EPOCH, "seq": 3, **{_COLUMN[k]: [v] for k, v in e.items()}, **(top or {})}
    if drop:
        del b[drop]
    return json.dumps(b, separators=(",", ":")).encode()


def raw_columns(ids: str, b_in: str, b_out: str, n_open: str, idle: str) -> bytes:
    """A batch (epoch EPOCH, seq 3) whose arrays hold these literal texts."""
    return _cols(ids, b_in, b_out, n_open, idle, top=f'"epoch":"{EPOCH}","seq":3,')


_VALID = body()

# (reason, name, body): every reason in pull_batch's list but too_large and too_many_sandboxes (built in
# the tests: a seed that size is not worth storing).
BATCH_REFUSALS: list[tuple[str, str, bytes]] = [
    ("bad_utf8", "ff-in-string", _VALID.replace(b"sbx-1", b"sbx\xff1")),
    ("bad_utf8", "overlong-nul", b'{"epoch":"\xc0\x80"}'),
    ("bad_utf8", "encoded-surrogate", _VALID.replace(b"sbx-1", b"\xed\xa0\x80")),
    ("bad_utf8", "truncated-sequence", _VALID + b"\xe2\x82"),
    ("bad_json", "empty", b""),
    ("bad_json", "only-whitespace", b" \n"),
    ("bad_json", "truncated", _VALID[:-1]),
    ("bad_json", "nan-idle", _VALID.replace(b'"idle_ms":[500]', b'"idle_ms":[NaN]')),
    ("bad_json", "infinity-seq", body({"seq": 3}).replace(b'"seq":3', b'"seq":Infinity')),
    ("bad_json", "single-quotes", b"{'epoch':'x'}"),
    ("bad_json", "trailing-comma", raw_columns('"s",', "1", "1", "0", "0")),
    ("bad_json", "leading-zero", body().replace(b'"seq":3', b'"seq":03')),
    ("bad_json", "bom", b"\xef\xbb\xbf" + _VALID),
    ("bad_json", "deep-nesting", b"[" * 5000 + b"]" * 5000),
    ("bad_json", "control-char-in-string", _VALID.replace(b"sbx-1", b"sbx\n1")),
    ("trailing_data", "garbage", _VALID + b"x"),
    ("trailing_data", "second-object", _VALID + b"{}"),
    ("trailing_data", "nul", _VALID + b"\0"),
    ("trailing_data", "back-to-back", _VALID + b"\n" + _VALID),
    ("duplicate_key", "seq-twice", _VALID.replace(b'"seq":3', b'"seq":3,"seq":4')),
    ("duplicate_key", "open-twice", _VALID.replace(b'"open":[0]', b'"open":[0],"open":[0]')),
    ("unknown_field", "top-level", body({"extra": 1})),
    ("unknown_field", "the-old-idle-s", body({"idle_s": [0.5]}, drop="idle_ms")),
    ("unknown_field", "forwarder-identity-in-body", body({"forwarder": "spiffe://x"})),
    ("missing_field", "no-seq", body(drop="seq")),
    ("missing_field", "no-epoch", body(drop="epoch")),
    ("missing_field", "no-sandboxes", body(drop="sandboxes")),
    ("missing_field", "no-idle", body(drop="idle_ms")),
    ("missing_field", "rows-and-columns", body({"sandboxes": [{"sandbox": "s", "bytes_in": 1, "bytes_out": 1,
                                                              "open": 0, "idle_s": 0.5}]}, drop="idle_ms")),
    ("missing_field", "empty-object", b"{}"),
    ("bad_type", "array", b"[]"),
    ("bad_type", "string", b'"batch"'),
    ("bad_type", "null", b"null"),
    ("bad_type", "epoch-number", body({"epoch": 5})),
    ("bad_type", "seq-string", body({"seq": "3"})),
    ("bad_type", "seq-float", body({"seq": 3.0})),
    ("bad_type", "seq-true", body({"seq": True})),
    ("bad_type", "sandboxes-object", body({"sandboxes": {}})),
    ("bad_type", "bytes-in-number", body({"bytes_in": 1})),
    ("bad_type", "idle-object", body({"idle_ms": {"sbx-1": 500}})),
    ("bad_type", "sandbox-object", raw_columns('{"sandbox":"s"}', "1", "1", "0", "0")),
    ("bad_type", "sandbox-array", raw_columns("[]", "1", "1", "0", "0")),
    ("bad_type", "sandbox-number", body(entry={"sandbox": 7})),
    ("bad_type", "bytes-in-string", body(entry={"bytes_in": "1"})),
    ("bad_type", "bytes-out-float", body(entry={"bytes_out": 1.5})),
    ("bad_type", "open-true", body(entry={"open": True})),
    ("bad_type", "idle-string", body(entry={"idle_ms": "500"})),
    ("bad_type", "idle-null", body(entry={"idle_ms": None})),
    ("bad_type", "idle-false", body(entry={"idle_ms": False})),
    ("bad_type", "idle-float", body(entry={"idle_ms": 0.5})),
    ("bad_type", "idle-integral-float", body(entry={"idle_ms": 500.0})),
    ("bad_type", "idle-exponent", _VALID.replace(b'"idle_ms":[500]', b'"idle_ms":[5E2]')),
    ("bad_length", "bytes-in-short", body({"bytes_in": []})),
    ("bad_length", "idle-long", body({"idle_ms": [1, 2]})),
    ("bad_length", "ids-long", body({"sandboxes": ["a", "b"]})),
    ("bad_epoch", "short-hex", body({"epoch": "1-abc"})),
    ("bad_epoch", "8-hex-as-in-example", body({"epoch": "1764576000123456789-9f3a0c5e"})),
    ("bad_epoch", "17-hex", body({"epoch": "1-0123456789abcdef0"})),
    ("bad_epoch", "upper-hex", body({"epoch": "1-0123456789ABCDEF"})),
    ("bad_epoch", "leading-zero-ns", body({"epoch": "01-0123456789abcdef"})),
    ("bad_epoch", "ns-2-63", body({"epoch": "9223372036854775808-0123456789abcdef"})),
    ("bad_epoch", "negative-ns", body({"epoch": "-1-0123456789abcdef"})),
    ("bad_epoch", "no-dash", body({"epoch": "10123456789abcdef"})),
    ("bad_epoch", "empty", body({"epoch": ""})),
    ("bad_epoch", "arabic-digits", body({"epoch": "\u0661-0123456789abcdef"})),
    ("bad_epoch", "newline", body({"epoch": "1-0123456789abcdef\n"})),
    ("bad_seq", "zero", body({"seq": 0})),
    ("bad_seq", "negative", body({"seq": -1})),
    ("bad_seq", "2-63", body({"seq": 2**63})),
    ("bad_seq", "huge", body({"seq": 10**30})),
    ("bad_seq", "5000-digits", body().replace(b'"seq":3', b'"seq":' + b"9" * 5000)),
    ("bad_sandbox_id", "empty", body(entry={"sandbox": ""})),
    ("bad_sandbox_id", "65-chars", body(entry={"sandbox": "a" * 65})),
    ("bad_sandbox_id", "slash", body(entry={"sandbox": "a/b"})),
    ("bad_sandbox_id", "space", body(entry={"sandbox": "a b"})),
    ("bad_sandbox_id", "non-ascii", body(entry={"sandbox": "\u00e9t\u00e9"})),
    ("bad_sandbox_id", "trailing-newline", body(entry={"sandbox": "sbx\n"})),
    ("bad_sandbox_id", "lone-surrogate", body().replace(b"sbx-1", b"\\ud800")),
    ("bad_sandbox_id", "quote-comma-quote", raw_columns('"a\\",\\"b"', "1", "1", "0", "0")),
    ("duplicate_sandbox", "same-id-twice", raw_columns('"s","s"', "1,1", "1,1", "0,0", "0,0")),
    ("bad_count", "negative-bytes-in", body(entry={"bytes_in": -1})),
    ("bad_count", "bytes-out-2-63", body(entry={"bytes_out": 2**63})),
    ("bad_count", "negative-open", body(entry={"open": -5})),
    ("bad_count", "huge-bytes-in", body(entry={"bytes_in": 10**25})),
    ("bad_idle", "negative", body(entry={"idle_ms": -500})),
    ("bad_idle", "above-max", body(entry={"idle_ms": 2**32 * 1000 + 1})),
    ("bad_idle", "huge-int", body(entry={"idle_ms": 10**30})),
]

# The row form (forwarders before the columns; pull only): (name, body, the batch it means).
ROWS: list[tuple[str, bytes, Batch]] = [
    ("contract-example", b'{"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":42,"sandboxes":'
     b'[{"sandbox":"sbx-1","bytes_in":1200,"bytes_out":88000,"open":2,"idle_s":0.35}]}',
     Batch(EPOCH, 42, (SandboxReport("sbx-1", 1200, 88000, 2, 0.35),))),
    ("empty", b'{"epoch":"0-0000000000000000","seq":1,"sandboxes":[]}', GOLDEN[1][1]),
    ("key-order", b'{"sandboxes":[{"idle_s":1,"open":0,"bytes_out":2,"bytes_in":3,"sandbox":"s"}],'
     b'"seq":7,"epoch":"5-0123456789abcdef"}', Batch("5-0123456789abcdef", 7, (SandboxReport("s", 3, 2, 0, 1.0),))),
    ("integer-idle", b'{"epoch":"5-0123456789abcdef","seq":1,"sandboxes":'
     b'[{"sandbox":"s","bytes_in":0,"bytes_out":0,"open":0,"idle_s":4294967296}]}',
     Batch("5-0123456789abcdef", 1, (SandboxReport("s", 0, 0, 0, 4294967296.0),))),
    ("idle-to-the-ms", b'{"epoch":"5-0123456789abcdef","seq":1,"sandboxes":'
     b'[{"sandbox":"s","bytes_in":0,"bytes_out":0,"open":0,"idle_s":0.12345},'
     b'{"sandbox":"t","bytes_in":0,"bytes_out":0,"open":0,"idle_s":5e-324}]}',
     Batch("5-0123456789abcdef", 1, (SandboxReport("s", 0, 0, 0, 0.123), SandboxReport("t", 0, 0, 0, 0.0)))),
]

_ROW = {"sandbox": "sbx-1", "bytes_in": 1, "bytes_out": 2, "open": 0, "idle_s": 0.5}


def row_body(top: dict[str, object] | None = None, entry: dict[str, object] | None = None, *, drop: str = "") -> bytes:
    """A row-form body with the top-level keys or the (single) entry's keys overridden, or one key dropped
    (``drop``: a top-level key, or ``entry.<key>``)."""
    e: dict[str, object] = {**_ROW, **(entry or {})}
    b: dict[str, object] = {"epoch": EPOCH, "seq": 3, "sandboxes": [e], **(top or {})}
    if drop.startswith("entry."):
        del e[drop[6:]]
    elif drop:
        del b[drop]
    return json.dumps(b, separators=(",", ":")).encode()


def raw_rows(text: str) -> bytes:
    """A row-form batch whose sandboxes array is the literal ``text``."""
    return b'{"epoch":"' + EPOCH.encode() + b'","seq":3,"sandboxes":[' + text.encode() + b"]}"


_R = '"sandbox":"s","bytes_in":1,"bytes_out":1,"open":0,"idle_s":0'

# (reason, name, body): the row form's own refusals.
ROW_REFUSALS: list[tuple[str, str, bytes]] = [
    ("bad_json", "rows-nan-idle", row_body().replace(b'"idle_s":0.5', b'"idle_s":NaN')),
    ("bad_json", "rows-trailing-comma", raw_rows("{" + _R + "},")),
    ("duplicate_key", "rows-entry-open-twice", row_body().replace(b'"open":0', b'"open":0,"open":0')),
    ("unknown_field", "rows-in-entry", row_body(entry={"last_activity": 1.0})),
    ("unknown_field", "rows-an-idle-ms", row_body(entry={"idle_ms": 500}, drop="entry.idle_s")),
    ("missing_field", "rows-entry-no-idle", row_body(drop="entry.idle_s")),
    ("bad_type", "rows-sandboxes-object", row_body({"sandboxes": {}})),
    ("bad_type", "rows-entry-number", raw_rows("5")),
    ("bad_type", "rows-entry-array", raw_rows("[]")),
    ("bad_type", "rows-sandbox-number", row_body(entry={"sandbox": 7})),
    ("bad_type", "rows-bytes-out-float", row_body(entry={"bytes_out": 1.5})),
    ("bad_type", "rows-open-true", row_body(entry={"open": True})),
    ("bad_type", "rows-idle-string", row_body(entry={"idle_s": "0.5"})),
    ("bad_type", "rows-idle-null", row_body(entry={"idle_s": None})),
    ("bad_epoch", "rows-short-hex", row_body({"epoch": "1-abc"})),
    ("bad_seq", "rows-zero", row_body({"seq": 0})),
    ("bad_sandbox_id", "rows-slash", row_body(entry={"sandbox": "a/b"})),
    ("duplicate_sandbox", "rows-same-id-twice", raw_rows("{" + _R + "},{" + _R + "}")),
    ("bad_count", "rows-negative-bytes-in", row_body(entry={"bytes_in": -1})),
    ("bad_count", "rows-huge-bytes-in", row_body(entry={"bytes_in": 10**25})),
    ("bad_idle", "rows-negative", row_body(entry={"idle_s": -0.5})),
    ("bad_idle", "rows-overflows-to-inf", row_body().replace(b'"idle_s":0.5', b'"idle_s":1e400')),
    ("bad_idle", "rows-above-max", row_body(entry={"idle_s": 2.0**32 + 1})),
    ("bad_idle", "rows-huge-int", row_body(entry={"idle_s": 10**30})),
]

ANSWER_GOLDEN: list[tuple[Answer, bytes, int]] = [
    (Answer.ok(42), b'{"acked":42}', 200),
    (Answer.ok(2**63 - 1), b'{"acked":9223372036854775807}', 200),
    (Answer.replay(50), b'{"error":"replay","acked":50}', 409),
    (Answer.gap(41), b'{"error":"gap","acked":41}', 409),
    (Answer.gap(0), b'{"error":"gap","acked":0}', 409),
    (Answer.stale_epoch(), b'{"error":"stale_epoch"}', 409),
]

ANSWER_REFUSALS: list[tuple[str, bytes]] = [
    ("too_large", b" " * 4097),
    ("bad_utf8", b'{"error":"\xff"}'),
    ("bad_json", b""),
    ("bad_json", b"{"),
    ("bad_json", b"<html>500</html>"),
    ("trailing_data", b'{"acked":1}x'),
    ("duplicate_key", b'{"acked":1,"acked":2}'),
    ("unknown_field", b'{"acked":1,"seq":1}'),
    ("unknown_field", b'{"error":"stale_epoch","acked":3}'),
    ("missing_field", b"{}"),
    ("missing_field", b'{"error":"gap"}'),
    ("missing_field", b'{"error":"replay"}'),
    ("bad_type", b"[]"),
    ("bad_type", b'{"acked":"1"}'),
    ("bad_type", b'{"acked":true}'),
    ("bad_type", b'{"acked":1.0}'),
    ("bad_type", b'{"acked":null}'),
    ("bad_type", b'{"error":null,"acked":1}'),
    ("bad_type", b'{"error":1,"acked":1}'),
    ("unknown_error", b'{"error":"nope","acked":1}'),
    ("unknown_error", b'{"error":"unknown sandbox"}'),
    ("bad_acked", b'{"acked":0}'),
    ("bad_acked", b'{"acked":-1}'),
    ("bad_acked", b'{"acked":9223372036854775808}'),
    ("bad_acked", b'{"acked":' + b"1" * 100 + b"}"),
    ("bad_acked", b'{"error":"replay","acked":0}'),
    ("bad_acked", b'{"error":"gap","acked":-1}'),
]
