"""The idle feed's batch and answer (docs/scheduler-api.md, "The idle feed"): JSON over HTTP, profiled strictly.

Pure: bytes in, a typed ``Batch`` or ``Answer`` or a ``FeedError`` out; typed values in, canonical bytes
out. No sockets, no clock, no randomness: ``new_epoch`` takes the start time and the random bytes from
its caller. The forwarder's outbox (``forwarder/ingress/feed_outbox.py``) and the scheduler's acceptance
rule (``scheduler/feed_ledger.py``) both build on this module.

A batch (``POST /v1/feed``), pushed with exactly these keys in this order, no whitespace: one array per
field, index ``i`` of each array about sandbox ``sandboxes[i]`` (columns, so that an encoder can hand each
array to a C loop: a list of objects costs a formatted object per sandbox)::

    {"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":42,
     "sandboxes":["sbx-1","sbx-2"],"bytes_in":[1200,0],"bytes_out":[88000,17],"open":[2,0],"idle_ms":[350,12000]}

    epoch      "<start ns>-<16 lowercase hex>": the forwarder's start time in ns (decimal, no leading zero,
               below 2**63) and 8 random bytes; new at each start. Epochs are ordered by start time alone.
    seq        1 for an epoch's first batch, +1 per acknowledged batch; 1 <= seq < 2**63
    sandboxes  at most ``MAX_SANDBOXES`` IDs, no sandbox twice; empty arrays are valid (the batch applies
               nothing but its seq; the outbox never sends one)
               each ID 1..64 characters of [A-Za-z0-9._-] (the preamble's rule)
    bytes_in   gateway -> sandbox, bytes_out sandbox -> gateway: deltas since the previous acknowledged
               batch; open: connections open at sending. Each an integer, 0 <= n < 2**63.
    idle_ms    milliseconds since the sandbox's last activity at sending: an integer,
               0 <= idle_ms <= ``IDLE_MS_MAX`` (an integer, not a float: a float's shortest repr is the
               slowest part of encoding one)
    each of bytes_in, bytes_out, open and idle_ms is an array as long as ``sandboxes``

``SandboxReport.idle_s`` is ``idle_ms / 1000``; ``push_batch`` sends an ``idle_s`` rounded to the nearest
millisecond.

``pull_batch`` also takes the row form that forwarders sent before the columns (a batch with exactly the
keys epoch, seq and sandboxes, each entry an object), so a scheduler can be upgraded before its
forwarders; ``push_*`` never make it::

    {"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":42,
     "sandboxes":[{"sandbox":"sbx-1","bytes_in":1200,"bytes_out":88000,"open":2,"idle_s":0.35}]}

    an entry has exactly those keys; idle_s is a JSON number (an integer is taken as a float), finite,
    0 <= idle_s <= ``IDLE_S_MAX``, taken to the nearest ms. Its checks are the same in the same order,
    each entry's keys (unknown before missing) before its values.

The answers, the body of a 200 or a 409 (``Answer.http_status``)::

    200 {"acked":42}                      applied now, or already (a retry after a lost answer)
    409 {"error":"replay","acked":50}     seq below the last applied; acked >= 1 is the last applied
    409 {"error":"gap","acked":41}        seq beyond the last applied + 1, or a newer epoch not at seq 1
    409 {"error":"stale_epoch"}           the epoch is older than the one stored

What is refused, strictly: a body over ``MAX_BODY_BYTES`` (a batch) or ``MAX_ANSWER_BYTES`` (an answer),
bytes that are not UTF-8, text that is not one JSON value (NaN and Infinity are not JSON), anything but
JSON whitespace after it, a key twice in one object, unknown or missing keys, a value of the wrong JSON
type (``true`` is not an integer, ``1.0`` is not an integer), and out-of-range values. The first failing
check names the reason: decoding first, then each object's keys (unknown before missing), then its values
in the order above (the arrays' types and lengths before any entry), then entries in index order, each
entry's values in the order above.

Reason tokens (``FeedError.reason``; stable, counted by metrics, never peer text):

    too_large           the body is longer than the bound
    bad_utf8            the body is not UTF-8
    bad_json            not a JSON text (syntax, NaN/Infinity, nesting too deep)
    trailing_data       something other than whitespace after the JSON value
    duplicate_key       a key twice in one object
    unknown_field       a key this profile does not know
    missing_field       a required key is absent
    bad_type            a value of the wrong JSON type (the batch or a row not an object, a field not an array)
    bad_length          an array of another length than sandboxes
    bad_epoch           epoch not "<ns>-<16 lowercase hex>", ns with a leading zero or >= 2**63
    bad_seq             seq < 1 or >= 2**63
    too_many_sandboxes  more than MAX_SANDBOXES entries
    bad_sandbox_id      not 1..64 of [A-Za-z0-9._-]
    duplicate_sandbox   a sandbox twice in one batch
    bad_count           bytes_in, bytes_out or open negative or >= 2**63
    bad_idle            idle_ms negative or above IDLE_MS_MAX (a row's idle_s: negative, not finite, or above
                        IDLE_S_MAX)
    unknown_error       an answer's "error" is not replay, gap or stale_epoch
    bad_acked           an answer's acked out of range (ok and replay: >= 1; gap: >= 0; below 2**63)
    status_mismatch     the HTTP status given to ``pull_answer`` is not the one the body implies

``push_*`` check the same rules and raise ``LocalProtocolError`` with the same tokens: a value we could
not send is our bug, not the peer's. ``push_columns`` (the outbox's encoder: columns in, no
``SandboxReport`` per sandbox) checks the values on the text its C encoder made (one pass over bytes, not
a Python check per value), and leaves one rule to its caller: no sandbox twice (the outbox's columns are
keyed by sandbox).
"""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from sbxnet.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from native._feed_text import Lib as _FtLib

try:
    from native._feed_text import ffi as _ft_ffi
    from native._feed_text import lib as _ft_lib

    _FT: _FtLib | None = _ft_lib
except ImportError:  # not built (native/build_feed_text.py): the Python references do the same, slower
    _FT = None

NATIVE_COLUMNS = _FT is not None  # whether array('q') columns are written by native/feed_text.c

__all__ = [
    "ANSWER_ERRORS",
    "COUNT_MAX",
    "IDLE_MS_MAX",
    "IDLE_S_MAX",
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_SANDBOXES",
    "NATIVE_COLUMNS",
    "Answer",
    "Batch",
    "FeedError",
    "SandboxReport",
    "ages_ms",
    "are_sandbox_ids",
    "epoch_is_newer",
    "epoch_start_ns",
    "is_epoch",
    "is_sandbox_id",
    "new_epoch",
    "pull_answer",
    "pull_batch",
    "push_answer",
    "push_batch",
    "push_columns",
]

COUNT_MAX = 2**63 - 1  # the largest seq, byte count or connection count (fits a signed 64-bit column)
IDLE_S_MAX = float(2**32)  # about 136 years: anything larger is not an age a running forwarder measured
IDLE_MS_MAX = 2**32 * 1000  # IDLE_S_MAX in ms
MAX_SANDBOXES = 100_000
# The longest canonical entry is about 140 bytes (a 64-byte ID and its quotes and comma, three 19-digit
# counts, a 13-digit idle_ms, their commas); 100,000 of them fit in 15 MB. The bound leaves room for a peer
# that adds whitespace.
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_ANSWER_BYTES = 4096
MAX_STREAM = 1023  # the highest ?stream= of POST /v1/feed: one stream per forwarder worker

ERROR_REPLAY = "replay"
ERROR_GAP = "gap"
ERROR_STALE_EPOCH = "stale_epoch"
ANSWER_ERRORS = (ERROR_REPLAY, ERROR_GAP, ERROR_STALE_EPOCH)

_BATCH_KEYS = ("epoch", "seq", "sandboxes", "bytes_in", "bytes_out", "open", "idle_ms")
_COLUMNS = _BATCH_KEYS[3:]  # the arrays beside "sandboxes"
_ROW_BATCH_KEYS = {"epoch", "seq", "sandboxes"}  # the row form's (pull only)
_ROW_KEYS = ("sandbox", "bytes_in", "bytes_out", "open", "idle_s")
_SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}", re.ASCII)
_ID_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"
_NUMBER_CHARS = b"0123456789,"
_EPOCH_RE = re.compile(r"(0|[1-9][0-9]{0,18})-[0-9a-f]{16}", re.ASCII)
_WS = re.compile(r"[ \t\n\r]*")
_MAX_INT_CHARS = 20  # "-" and 19 digits: every integer this profile accepts, and a few it refuses


class FeedError(RemoteProtocolError):
    """The peer's batch or answer is refused; ``reason`` is one of the tokens in the module docstring.

    ``http_status`` is what the scheduler answers a refused batch with (413 for a body too large)."""

    @property
    def http_status(self) -> int:
        return 413 if self.reason == "too_large" else 400


class SandboxReport(NamedTuple):
    """One sandbox's entry in a batch (the wire's names). A named tuple rather than a frozen dataclass:
    a scheduler makes 100,000 a second, and a tuple is made three times faster."""

    sandbox: str
    bytes_in: int  # gateway -> sandbox since the previous acknowledged batch
    bytes_out: int  # sandbox -> gateway
    open: int  # connections open at sending
    idle_s: float  # seconds since its last activity, at sending


@dataclass(frozen=True)
class Batch:
    epoch: str
    seq: int
    sandboxes: tuple[SandboxReport, ...]


@dataclass(frozen=True)
class Answer:
    """The scheduler's answer to a batch. ``error`` None is a 200; otherwise a 409 of that kind."""

    error: str | None
    acked: int | None

    @classmethod
    def ok(cls, seq: int) -> Answer:
        return cls(None, seq)

    @classmethod
    def replay(cls, last: int) -> Answer:
        return cls(ERROR_REPLAY, last)

    @classmethod
    def gap(cls, last: int) -> Answer:
        return cls(ERROR_GAP, last)

    @classmethod
    def stale_epoch(cls) -> Answer:
        return cls(ERROR_STALE_EPOCH, None)

    @property
    def http_status(self) -> int:
        return 200 if self.error is None else 409


# --- epochs --------------------------------------------------------------------------------------------


def is_sandbox_id(value: object) -> bool:
    """Whether ``value`` is a sandbox ID the feed carries (1..64 of [A-Za-z0-9._-])."""
    return type(value) is str and _SANDBOX_ID_RE.fullmatch(value) is not None


def is_epoch(value: object) -> bool:
    """Whether ``value`` is an epoch string in canonical form."""
    if type(value) is not str or _EPOCH_RE.fullmatch(value) is None:
        return False
    return int(value.partition("-")[0]) <= COUNT_MAX


def new_epoch(start_ns: int, rand8: bytes) -> str:
    """The epoch for a forwarder that started at ``start_ns`` (ns since the Unix epoch, the caller's wall
    clock) with ``rand8`` (8 random bytes, the caller's randomness). LocalProtocolError otherwise."""
    if type(start_ns) is not int or not 0 <= start_ns <= COUNT_MAX:
        raise LocalProtocolError("bad_epoch", "start_ns must be an int in [0, 2**63)")
    if not isinstance(rand8, bytes | bytearray) or len(rand8) != 8:
        raise LocalProtocolError("bad_epoch", "rand8 must be 8 bytes")
    return f"{start_ns}-{bytes(rand8).hex()}"


def epoch_start_ns(epoch: str) -> int:
    """The start time an epoch names. LocalProtocolError for a string that is not an epoch."""
    if not is_epoch(epoch):
        raise LocalProtocolError("bad_epoch", "not an epoch")
    return int(epoch.partition("-")[0])


def epoch_is_newer(candidate: str, than: str) -> bool:
    """Whether ``candidate`` started strictly later than ``than``: the contract orders epochs by start
    time alone, so two epochs of the same nanosecond are neither newer than the other."""
    return epoch_start_ns(candidate) > epoch_start_ns(than)


# --- checks shared by push and pull --------------------------------------------------------------------

_Err = Callable[..., Exception]


class _Huge:
    """An integer literal longer than any this profile accepts, kept as text (never converted: Python
    refuses to convert more than 4300 digits, and a long one costs quadratic time)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _fail(err: _Err, reason: str, detail: str = "") -> NoReturn:
    raise err(reason, detail)


def _check_keys(obj: dict[str, Any], keys: tuple[str, ...], what: str, err: _Err) -> None:
    if len(obj) != len(keys) or any(k not in obj for k in keys):
        unknown = [k for k in obj if k not in keys]
        if unknown:
            # Only our own key names go into the detail, never the peer's.
            _fail(err, "unknown_field", f"{len(unknown)} unknown key(s) in {what}")
        missing = next(k for k in keys if k not in obj)
        _fail(err, "missing_field", f"{what} has no {missing!r}")


def _count(value: object, reason: str, field: str, err: _Err, low: int = 0) -> int:
    if isinstance(value, _Huge):
        _fail(err, reason, f"{field} out of range")
    if type(value) is not int:
        _fail(err, "bad_type", f"{field} must be an integer")
    if not low <= value <= COUNT_MAX:
        _fail(err, reason, f"{field} out of range")
    return value


def _idle(value: object, err: _Err) -> float:
    """An ``idle_s`` (the row form's, or a ``SandboxReport``'s to push; an int is taken as a float)."""
    if isinstance(value, _Huge):
        _fail(err, "bad_idle", "idle_s out of range")
    if type(value) is int:
        value = float(value) if value <= IDLE_S_MAX else math.inf
    if type(value) is not float:
        _fail(err, "bad_type", "idle_s must be a number")
    if not (math.isfinite(value) and 0.0 <= value <= IDLE_S_MAX):
        _fail(err, "bad_idle", "idle_s must be finite, >= 0 and <= IDLE_S_MAX")
    return value


def _idle_ms(value: object, err: _Err) -> int:
    if isinstance(value, _Huge):
        _fail(err, "bad_idle", "idle_ms out of range")
    if type(value) is not int:
        _fail(err, "bad_type", "idle_ms must be an integer")
    if not 0 <= value <= IDLE_MS_MAX:
        _fail(err, "bad_idle", "idle_ms must be >= 0 and <= IDLE_MS_MAX")
    return value


def _sandbox_id(value: object, err: _Err) -> str:
    if type(value) is not str:
        _fail(err, "bad_type", "sandbox must be a string")
    if _SANDBOX_ID_RE.fullmatch(value) is None:
        _fail(err, "bad_sandbox_id", "sandbox must be 1..64 of [A-Za-z0-9._-]")
    return value


def _epoch(value: object, err: _Err) -> str:
    if type(value) is not str:
        _fail(err, "bad_type", "epoch must be a string")
    if not is_epoch(value):
        _fail(err, "bad_epoch", "epoch must be <ns>-<16 lowercase hex>, ns < 2**63")
    return value


def _check_sandbox_count(n: int, err: _Err) -> None:
    if n > MAX_SANDBOXES:
        _fail(err, "too_many_sandboxes", f"{n} entries, at most {MAX_SANDBOXES}")


# --- decoding ------------------------------------------------------------------------------------------


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise FeedError("duplicate_key", "a key appears twice in one object")
    return obj


def _parse_int(text: str) -> int | _Huge:
    return _Huge(text) if len(text) > _MAX_INT_CHARS else int(text)


def _parse_constant(text: str) -> NoReturn:
    raise FeedError("bad_json", "NaN and Infinity are not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_int=_parse_int, parse_constant=_parse_constant)
# The same decoder without the per-integer hook (a Python call for each number: most of decoding a batch),
# for a text with no run of digits long enough to be an integer literal over _MAX_INT_CHARS: there every
# integer the hook would see is short, and it would return int(text), what the C scanner makes itself.
_PLAIN_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_parse_constant)
# Found with a translate and two substring searches (a regex scan costs 30 times as much): digits become 9.
_DIGITS_AS_9 = bytes.maketrans(b"0123456789", b"9" * 10)
_LONG_INT = b"9" * (_MAX_INT_CHARS + 1)
_LONG_NEGATIVE = b"-" + b"9" * _MAX_INT_CHARS


def _has_long_digits(raw: bytes) -> bool:
    """Whether ``raw`` holds a run of digits that may be an integer literal over _MAX_INT_CHARS."""
    shape = raw.translate(_DIGITS_AS_9)
    return _LONG_INT in shape or _LONG_NEGATIVE in shape


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _decode(data: bytes | bytearray | memoryview, limit: int) -> object:
    if len(data) > limit:
        raise FeedError("too_large", f"{len(data)} bytes, at most {limit}")
    raw = bytes(data)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FeedError("bad_utf8") from None
    decoder = _DECODER if _has_long_digits(raw) else _PLAIN_DECODER
    try:
        value, end = decoder.raw_decode(text, _skip_ws(text, 0))
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; deep nesting recurses
        raise FeedError("bad_json") from None
    if _skip_ws(text, end) != len(text):
        raise FeedError("trailing_data", "more than whitespace after the JSON value")
    return value


# --- batches -------------------------------------------------------------------------------------------


def pull_batch(data: bytes | bytearray | memoryview) -> Batch:
    """Parse a whole request body. Raises ``FeedError`` (and nothing else) for anything refused."""
    obj = _decode(data, MAX_BODY_BYTES)
    err = FeedError
    if type(obj) is not dict:
        _fail(err, "bad_type", "the batch must be an object")
    if obj.keys() == _ROW_BATCH_KEYS:
        return _pull_rows(obj, err)
    _check_keys(obj, _BATCH_KEYS, "the batch", err)
    epoch = _epoch(obj["epoch"], err)
    seq = _count(obj["seq"], "bad_seq", "seq", err, low=1)
    ids = obj["sandboxes"]
    if type(ids) is not list:
        _fail(err, "bad_type", "sandboxes must be an array")
    _check_sandbox_count(len(ids), err)
    columns = []
    for key in _COLUMNS:
        column = obj[key]
        if type(column) is not list:
            _fail(err, "bad_type", f"{key} must be an array")
        if len(column) != len(ids):
            _fail(err, "bad_length", f"{key} has {len(column)} values for {len(ids)} sandboxes")
        columns.append(column)
    reports = _columns_fast(ids, columns)
    if reports is None:
        reports = _columns_checked(ids, columns, err)
    return Batch(epoch, seq, reports)


def _columns_checked(ids: list[Any], columns: list[list[Any]], err: _Err) -> tuple[SandboxReport, ...]:
    """The reports of a batch's columns, each entry judged on its own: the first one refused names the
    reason (``err``)."""
    seen: set[str] = set()
    out = []
    match = _SANDBOX_ID_RE.fullmatch
    for sid, bytes_in, bytes_out, n_open, idle in zip(ids, *columns, strict=True):
        # The common case judged inline (the scheduler's ingest is per entry); anything it does not
        # accept goes through the full checks below, which name the reason.
        if (
            type(sid) is str
            and match(sid) is not None
            and sid not in seen
            and type(bytes_in) is int
            and 0 <= bytes_in <= COUNT_MAX
            and type(bytes_out) is int
            and 0 <= bytes_out <= COUNT_MAX
            and type(n_open) is int
            and 0 <= n_open <= COUNT_MAX
            and type(idle) is int
            and 0 <= idle <= IDLE_MS_MAX
        ):
            seen.add(sid)
            out.append(SandboxReport(sid, bytes_in, bytes_out, n_open, idle / 1000))
            continue
        sid = _sandbox_id(sid, err)
        if sid in seen:
            _fail(err, "duplicate_sandbox", "a sandbox appears twice in one batch")
        seen.add(sid)
        out.append(
            SandboxReport(
                sid,
                _count(bytes_in, "bad_count", "bytes_in", err),
                _count(bytes_out, "bad_count", "bytes_out", err),
                _count(n_open, "bad_count", "open", err),
                _idle_ms(idle, err) / 1000,
            )
        )
    return tuple(out)


_COLUMN_HIGHS = (COUNT_MAX, COUNT_MAX, COUNT_MAX, IDLE_MS_MAX)  # bytes_in, bytes_out, open, idle_ms
_INT_ONLY = {int}
_STR_ONLY = {str}


def _columns_fast(ids: list[Any], columns: list[list[Any]]) -> tuple[SandboxReport, ...] | None:
    """The reports of a batch every entry of which ``_columns_checked`` accepts, judged a
    column at a time (the ID rule on the joined text, uniqueness by a set, the number columns by their
    types, minimum and maximum), or None: then ``_columns_checked`` judges it and names what it refuses.
    Both paths give the same reports for a batch they accept (tests/protocol/test_feed.py compares them)."""
    if not ids:
        return ()
    if set(map(type, ids)) != _STR_ONLY or not are_sandbox_ids(ids) or len(set(ids)) != len(ids):
        return None
    for column, high in zip(columns, _COLUMN_HIGHS, strict=True):
        if set(map(type, column)) != _INT_ONLY or min(column) < 0 or max(column) > high:
            return None
    bytes_in, bytes_out, n_open, idle_ms = columns
    # tuple.__new__ on zip's tuples: the named tuple's own __new__ is a Python call per entry (twice the cost).
    rows = zip(ids, bytes_in, bytes_out, n_open, [ms / 1000 for ms in idle_ms], strict=True)
    return tuple(map(tuple.__new__, repeat(SandboxReport), rows))


def _pull_rows(obj: dict[str, Any], err: _Err) -> Batch:
    """The row form (forwarders from before the columns): ``sandboxes`` a list of objects, each with
    exactly the keys sandbox, bytes_in, bytes_out, open and idle_s (a number of seconds, taken to the
    nearest ms like every ``idle_s`` the columns carry)."""
    epoch = _epoch(obj["epoch"], err)
    seq = _count(obj["seq"], "bad_seq", "seq", err, low=1)
    entries = obj["sandboxes"]
    if type(entries) is not list:
        _fail(err, "bad_type", "sandboxes must be an array")
    _check_sandbox_count(len(entries), err)
    seen: set[str] = set()
    out = []
    match = _SANDBOX_ID_RE.fullmatch
    for e in entries:
        # The common case judged inline; anything it does not accept goes through the full checks
        # below, which name the reason or accept it (an integer idle_s).
        if type(e) is dict and len(e) == 5:
            sid, bytes_in, bytes_out, n_open, idle = (
                e.get("sandbox"), e.get("bytes_in"), e.get("bytes_out"), e.get("open"), e.get("idle_s")
            )
            if (
                type(sid) is str
                and match(sid) is not None
                and sid not in seen
                and type(bytes_in) is int
                and 0 <= bytes_in <= COUNT_MAX
                and type(bytes_out) is int
                and 0 <= bytes_out <= COUNT_MAX
                and type(n_open) is int
                and 0 <= n_open <= COUNT_MAX
                and type(idle) is float
                and 0.0 <= idle <= IDLE_S_MAX  # false for NaN
            ):
                seen.add(sid)
                out.append(SandboxReport(sid, bytes_in, bytes_out, n_open, round(idle * 1000) / 1000))
                continue
        if type(e) is not dict:
            _fail(err, "bad_type", "a sandboxes entry must be an object")
        _check_keys(e, _ROW_KEYS, "a sandboxes entry", err)
        sid = _sandbox_id(e["sandbox"], err)
        if sid in seen:
            _fail(err, "duplicate_sandbox", "a sandbox appears twice in one batch")
        seen.add(sid)
        out.append(
            SandboxReport(
                sid,
                _count(e["bytes_in"], "bad_count", "bytes_in", err),
                _count(e["bytes_out"], "bad_count", "bytes_out", err),
                _count(e["open"], "bad_count", "open", err),
                round(_idle(e["idle_s"], err) * 1000) / 1000,
            )
        )
    return Batch(epoch, seq, tuple(out))


def push_batch(batch: Batch) -> bytes:
    """The canonical body for ``batch``: equal batches give equal bytes, and ``pull_batch`` gives the batch
    back (``idle_s`` to the millisecond). LocalProtocolError (the tokens above) for a batch the profile
    cannot carry."""
    err = LocalProtocolError
    if not isinstance(batch, Batch):
        _fail(err, "bad_type", "push_batch takes a Batch")
    epoch = _epoch(batch.epoch, err)
    seq = _count(batch.seq, "bad_seq", "seq", err, low=1)
    if not isinstance(batch.sandboxes, tuple | list):
        _fail(err, "bad_type", "sandboxes must be a tuple")
    _check_sandbox_count(len(batch.sandboxes), err)
    seen: set[str] = set()
    ids, ins, outs, opens, idles = [], [], [], [], []
    for r in batch.sandboxes:
        if not isinstance(r, SandboxReport):
            _fail(err, "bad_type", "sandboxes holds SandboxReport values")
        sid = _sandbox_id(r.sandbox, err)
        if sid in seen:
            _fail(err, "duplicate_sandbox", f"{sid} twice")
        seen.add(sid)
        ids.append(sid)
        ins.append(_count(r.bytes_in, "bad_count", "bytes_in", err))
        outs.append(_count(r.bytes_out, "bad_count", "bytes_out", err))
        opens.append(_count(r.open, "bad_count", "open", err))
        idles.append(round(_idle(r.idle_s, err) * 1000))
    return _body(epoch, seq, _id_array(ids, err), ins, outs, opens, idles, err)


def push_columns(
    epoch: str,
    seq: int,
    sandboxes: list[str] | tuple[str, ...],
    bytes_in: _Ints,
    bytes_out: _Ints,
    open_: _Ints,
    idle_ms: _Ints,
) -> bytes:
    """The canonical body for a batch given as columns (index ``i`` of each about ``sandboxes[i]``): the
    bytes ``push_batch`` gives for the same batch. The caller guarantees no sandbox twice; everything else
    is checked (LocalProtocolError, the tokens above), on the text the C encoder made where it can. A
    number column may be an ``array('q')`` (as ``ages_ms`` gives, or ``array('q', list)`` makes: it takes
    a bool as its int): native/feed_text.c then writes it, if built."""
    err = LocalProtocolError
    epoch = _epoch(epoch, err)
    seq = _count(seq, "bad_seq", "seq", err, low=1)
    columns = (sandboxes, bytes_in, bytes_out, open_, idle_ms)
    if not isinstance(sandboxes, list | tuple) or not all(isinstance(c, list | tuple | array) for c in columns):
        _fail(err, "bad_type", "each column must be a list or tuple (or an array('q') of integers)")
    _check_sandbox_count(len(sandboxes), err)
    if any(len(c) != len(sandboxes) for c in columns):
        _fail(err, "bad_length", "the columns differ in length")
    return _body(epoch, seq, _id_array(sandboxes, err), bytes_in, bytes_out, open_, idle_ms, err)


def are_sandbox_ids(values: list[str] | tuple[str, ...]) -> bool:
    """Whether every value is a sandbox ID the feed carries (``is_sandbox_id``), in a few passes over one
    joined string rather than a regex match per value."""
    try:
        _id_array(values, LocalProtocolError)
    except LocalProtocolError:
        return False
    return True


_INTS = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
if TYPE_CHECKING:
    _Ints = list[int] | tuple[int, ...] | array[int]  # a number column (array is not subscriptable at run time)


def _id_array(ids: list[str] | tuple[str, ...], err: _Err) -> str:
    """``ids`` as a JSON array, each checked by the ID rule: their characters, lengths and count are read
    off the joined text (the rule's characters need no escaping, so the join is the JSON)."""
    if not ids:
        return "[]"
    try:
        text = '["' + '","'.join(ids) + '"]'
    except TypeError:
        text = ""
    if text.isascii():
        raw = text.encode("ascii")
        # Only the rule's characters and the n - 1 separators; no empty ID; none longer than 64.
        if (
            raw.translate(None, _ID_CHARS) == b'["' + b'","' * (len(ids) - 1) + b'"]'
            and b'""' not in raw
            and max(map(len, ids)) <= 64
        ):
            return text
    for v in ids:  # the reason, from the first value refused
        _sandbox_id(v, err)
    _fail(err, "bad_type", "sandboxes must hold strings")  # a str subclass spelling another text


def _int_array(values: _Ints, field: str, reason: str, high: int, err: _Err) -> bytes:
    """``values`` as a JSON array of integers in [0, high]: by native/feed_text.c for an ``array('q')``
    (its type leaves only the range to check), else by the C JSON encoder, checked on its text."""
    text = _int_array_native(values, high) if type(values) is array else _int_array_py(values, high)
    if text is not None:
        return text
    for v in values:  # the reason, from the first value refused
        if reason == "bad_idle":
            _idle_ms(v, err)
        else:
            _count(v, reason, field, err)
    _fail(err, "bad_type", f"{field} must hold integers")


def _int_array_py(values: _Ints, high: int) -> bytes | None:
    """The JSON array, or None unless every value is an int in [0, high]: judged on the C encoder's text
    rather than value by value (digits and commas only: no sign, point, exponent, literal or nesting),
    then the largest compared with ``high``. The reference for ``ft_int_array``."""
    if type(values) is array:
        values = values.tolist()
    raw = _INTS(values).encode("ascii")
    if raw[:1] == b"[" and not raw[1:-1].translate(None, _NUMBER_CHARS) and (not values or max(values) <= high):
        return raw
    return None


def _int_array_native(values: array[int], high: int) -> bytes | None:
    if _FT is None or values.typecode != "q":
        return _int_array_py(values, high)
    if not values:
        return b"[]"
    room = 2 + len(values) * (_FT.FT_DIGITS + 1)
    out = bytearray(room)
    n = _FT.ft_int_array(_ft_ffi.cast("int64_t *", _ft_ffi.from_buffer(values)), len(values), high,
                         _ft_ffi.from_buffer(out), room)
    return bytes(memoryview(out)[:n]) if n >= 0 else None


def ages_ms(
    now: float, last: list[float] | tuple[float, ...], high_ms: int = IDLE_MS_MAX
) -> list[int] | array[int] | None:
    """Each time's age at ``now`` in whole milliseconds, as ``idle_ms`` carries it: rounded to the
    nearest, ties to even, 0 for a time ahead of ``now``, ``high_ms`` for one older; None if a time (or
    ``now``) is not a finite number. An ``array('q')`` where native/feed_text.c is built (push_columns
    then encodes it there too), else a list."""
    if not isinstance(now, int | float) or not math.isfinite(now):
        return None
    if _FT is None:
        # The plain rounding when every age is in range (the usual case), else the careful reference.
        try:
            ages = [round((now - t) * 1000.0) for t in last]
        except (TypeError, ValueError, OverflowError):  # a time that is no number, NaN, an infinity
            return _ages_ms_py(now, last, high_ms)
        return ages if not ages or (min(ages) >= 0 and max(ages) <= high_ms) else _ages_ms_py(now, last, high_ms)
    try:
        times = array("d", last)
    except TypeError:
        return None
    out = array("q", bytes(8 * len(times)))
    if times and _FT.ft_ages_ms(now, _ft_ffi.cast("double *", _ft_ffi.from_buffer(times)), len(times), high_ms,
                                _ft_ffi.cast("int64_t *", _ft_ffi.from_buffer(out))) != 0:
        return None
    return out


def _ages_ms_py(now: float, last: list[float] | tuple[float, ...], high_ms: int) -> list[int] | None:
    """The reference for ``ft_ages_ms`` (the same double arithmetic, then Python's round())."""
    if not isinstance(now, int | float) or not math.isfinite(now):
        return None
    out = []
    for t in last:
        if not isinstance(t, int | float) or not math.isfinite(t):
            return None
        x = (now - t) * 1000.0
        out.append(high_ms if x >= high_ms else 0 if x <= 0 else min(round(x), high_ms))
    return out


def _body(
    epoch: str,
    seq: int,
    ids: str,
    bytes_in: _Ints,
    bytes_out: _Ints,
    open_: _Ints,
    idle_ms: _Ints,
    err: _Err,
) -> bytes:
    return b"".join((
        b'{"epoch":"', epoch.encode("ascii"), b'","seq":', str(seq).encode("ascii"), b',"sandboxes":',
        ids.encode("ascii"),
        b',"bytes_in":', _int_array(bytes_in, "bytes_in", "bad_count", COUNT_MAX, err),
        b',"bytes_out":', _int_array(bytes_out, "bytes_out", "bad_count", COUNT_MAX, err),
        b',"open":', _int_array(open_, "open", "bad_count", COUNT_MAX, err),
        b',"idle_ms":', _int_array(idle_ms, "idle_ms", "bad_idle", IDLE_MS_MAX, err),
        b"}",
    ))


# --- answers -------------------------------------------------------------------------------------------


def _answer(error: object, acked: object, err: _Err) -> Answer:
    if error is None:
        return Answer(None, _count(acked, "bad_acked", "acked", err, low=1))
    if type(error) is not str:
        _fail(err, "bad_type", "error must be a string")
    if error not in ANSWER_ERRORS:
        _fail(err, "unknown_error", "error is not replay, gap or stale_epoch")
    if error == ERROR_STALE_EPOCH:
        if acked is not None:
            _fail(err, "unknown_field", "stale_epoch carries no acked")
        return Answer(error, None)
    if acked is None:
        _fail(err, "missing_field", f"{error} has no 'acked'")
    return Answer(error, _count(acked, "bad_acked", "acked", err, low=1 if error == ERROR_REPLAY else 0))


def pull_answer(data: bytes | bytearray | memoryview, http_status: int | None = None) -> Answer:
    """Parse a whole answer body; with ``http_status``, the status it came with must be the one the body
    implies (200 for an ack, 409 for the others). Raises ``FeedError`` (and nothing else) when refused."""
    obj = _decode(data, MAX_ANSWER_BYTES)
    err = FeedError
    if type(obj) is not dict:
        _fail(err, "bad_type", "the answer must be an object")
    unknown = [k for k in obj if k not in ("error", "acked")]
    if unknown:
        _fail(err, "unknown_field", f"{len(unknown)} unknown key(s) in the answer")
    if "error" not in obj and "acked" not in obj:
        _fail(err, "missing_field", "the answer has no 'acked'")
    if "error" in obj and obj["error"] is None:
        _fail(err, "bad_type", "error must be a string")
    if "acked" in obj and obj["acked"] is None:
        _fail(err, "bad_type", "acked must be an integer")
    answer = _answer(obj.get("error"), obj.get("acked"), err)
    if http_status is not None and http_status != answer.http_status:
        _fail(err, "status_mismatch", f"HTTP {http_status} with a body for {answer.http_status}")
    return answer


def push_answer(answer: Answer) -> bytes:
    """The canonical body for ``answer`` (send it with ``answer.http_status``). LocalProtocolError for an
    answer the profile cannot carry."""
    err = LocalProtocolError
    if not isinstance(answer, Answer):
        _fail(err, "bad_type", "push_answer takes an Answer")
    if answer.error is None and answer.acked is None:
        _fail(err, "missing_field", "an ack needs acked")
    a = _answer(answer.error, answer.acked, err)
    if a.error is None:
        return f'{{"acked":{a.acked}}}'.encode("ascii")
    if a.acked is None:
        return f'{{"error":"{a.error}"}}'.encode("ascii")
    return f'{{"error":"{a.error}","acked":{a.acked}}}'.encode("ascii")
