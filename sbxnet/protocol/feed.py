"""The idle feed's batch and answer (docs/scheduler-api.md, "The idle feed"): JSON over HTTP, profiled strictly.

Pure: bytes in, a typed ``Batch`` or ``Answer`` or a ``FeedError`` out; typed values in, canonical bytes
out. No sockets, no clock, no randomness: ``new_epoch`` takes the start time and the random bytes from
its caller. The forwarder's outbox (``forwarder/ingress/feed_outbox.py``) and the scheduler's acceptance
rule (``scheduler/feed_ledger.py``) both build on this module.

A batch (``POST /v1/feed``), pushed with exactly these keys in this order, no whitespace::

    {"epoch":"1764576000123456789-9f3a0c5e11d24b07","seq":42,
     "sandboxes":[{"sandbox":"sbx-1","bytes_in":1200,"bytes_out":88000,"open":2,"idle_s":0.35}]}

    epoch      "<start ns>-<16 lowercase hex>": the forwarder's start time in ns (decimal, no leading zero,
               below 2**63) and 8 random bytes; new at each start. Epochs are ordered by start time alone.
    seq        1 for an epoch's first batch, +1 per acknowledged batch; 1 <= seq < 2**63
    sandboxes  at most ``MAX_SANDBOXES`` entries, no sandbox twice; an empty list is valid (it applies
               nothing but its seq; the outbox never sends one)
    sandbox    1..64 characters of [A-Za-z0-9._-] (the preamble's rule)
    bytes_in   gateway -> sandbox, bytes_out sandbox -> gateway: deltas since the previous acknowledged
               batch; open: connections open at sending. Each an integer, 0 <= n < 2**63.
    idle_s     seconds since the sandbox's last activity at sending: a JSON number (an integer is taken
               as a float), finite, 0 <= idle_s <= ``IDLE_S_MAX``

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
in the order above, entries in array order.

Reason tokens (``FeedError.reason``; stable, counted by metrics, never peer text):

    too_large           the body is longer than the bound
    bad_utf8            the body is not UTF-8
    bad_json            not a JSON text (syntax, NaN/Infinity, nesting too deep)
    trailing_data       something other than whitespace after the JSON value
    duplicate_key       a key twice in one object
    unknown_field       a key this profile does not know
    missing_field       a required key is absent
    bad_type            a value of the wrong JSON type (the batch or an entry not an object, too)
    bad_epoch           epoch not "<ns>-<16 lowercase hex>", ns with a leading zero or >= 2**63
    bad_seq             seq < 1 or >= 2**63
    too_many_sandboxes  more than MAX_SANDBOXES entries
    bad_sandbox_id      not 1..64 of [A-Za-z0-9._-]
    duplicate_sandbox   a sandbox twice in one batch
    bad_count           bytes_in, bytes_out or open negative or >= 2**63
    bad_idle            idle_s negative, not finite, or above IDLE_S_MAX
    unknown_error       an answer's "error" is not replay, gap or stale_epoch
    bad_acked           an answer's acked out of range (ok and replay: >= 1; gap: >= 0; below 2**63)
    status_mismatch     the HTTP status given to ``pull_answer`` is not the one the body implies

``push_*`` check the same rules and raise ``LocalProtocolError`` with the same tokens: a value we could
not send is our bug, not the peer's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from sbxnet.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "ANSWER_ERRORS",
    "COUNT_MAX",
    "IDLE_S_MAX",
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_SANDBOXES",
    "Answer",
    "Batch",
    "FeedError",
    "SandboxReport",
    "epoch_is_newer",
    "epoch_start_ns",
    "is_epoch",
    "is_sandbox_id",
    "new_epoch",
    "pull_answer",
    "pull_batch",
    "push_answer",
    "push_batch",
]

COUNT_MAX = 2**63 - 1  # the largest seq, byte count or connection count (fits a signed 64-bit column)
IDLE_S_MAX = float(2**32)  # about 136 years: anything larger is not an age a running forwarder measured
MAX_SANDBOXES = 100_000
# The longest canonical entry is about 190 bytes (a 64-byte ID, three 19-digit counts, a 23-character
# float); 100,000 of them fit in 20 MB. The bound leaves room for a peer that adds whitespace.
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_ANSWER_BYTES = 4096
MAX_STREAM = 1023  # the highest ?stream= of POST /v1/feed: one stream per forwarder worker

ERROR_REPLAY = "replay"
ERROR_GAP = "gap"
ERROR_STALE_EPOCH = "stale_epoch"
ANSWER_ERRORS = (ERROR_REPLAY, ERROR_GAP, ERROR_STALE_EPOCH)

_BATCH_KEYS = ("epoch", "seq", "sandboxes")
_ENTRY_KEYS = ("sandbox", "bytes_in", "bytes_out", "open", "idle_s")
_SANDBOX_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}", re.ASCII)
_EPOCH_RE = re.compile(r"(0|[1-9][0-9]{0,18})-[0-9a-f]{16}", re.ASCII)
_WS = re.compile(r"[ \t\n\r]*")
_MAX_INT_CHARS = 20  # "-" and 19 digits: every integer this profile accepts, and a few it refuses


class FeedError(RemoteProtocolError):
    """The peer's batch or answer is refused; ``reason`` is one of the tokens in the module docstring.

    ``http_status`` is what the scheduler answers a refused batch with (413 for a body too large)."""

    @property
    def http_status(self) -> int:
        return 413 if self.reason == "too_large" else 400


@dataclass(frozen=True)
class SandboxReport:
    """One sandbox's entry in a batch (the wire's names)."""

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
    if isinstance(value, _Huge):
        _fail(err, "bad_idle", "idle_s out of range")
    if type(value) is int:
        value = float(value) if value <= IDLE_S_MAX else math.inf
    if type(value) is not float:
        _fail(err, "bad_type", "idle_s must be a number")
    if not (math.isfinite(value) and 0.0 <= value <= IDLE_S_MAX):
        _fail(err, "bad_idle", "idle_s must be finite, >= 0 and <= IDLE_S_MAX")
    return value + 0.0  # -0.0 becomes 0.0, so equal values push to equal bytes


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


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _decode(data: bytes | bytearray | memoryview, limit: int) -> object:
    if len(data) > limit:
        raise FeedError("too_large", f"{len(data)} bytes, at most {limit}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise FeedError("bad_utf8") from None
    try:
        value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
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
    _check_keys(obj, _BATCH_KEYS, "the batch", err)
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
        # The common case judged inline (the scheduler's ingest is per entry); anything it does not
        # accept goes through the full checks below, which name the reason or accept it (an integer idle_s).
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
                out.append(SandboxReport(sid, bytes_in, bytes_out, n_open, idle + 0.0))
                continue
        if type(e) is not dict:
            _fail(err, "bad_type", "a sandboxes entry must be an object")
        _check_keys(e, _ENTRY_KEYS, "a sandboxes entry", err)
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
                _idle(e["idle_s"], err),
            )
        )
    return Batch(epoch, seq, tuple(out))


def push_batch(batch: Batch) -> bytes:
    """The canonical body for ``batch``: equal batches give equal bytes, and ``pull_batch`` gives the batch
    back. LocalProtocolError (the tokens above) for a batch the profile cannot carry."""
    err = LocalProtocolError
    if not isinstance(batch, Batch):
        _fail(err, "bad_type", "push_batch takes a Batch")
    epoch = _epoch(batch.epoch, err)
    seq = _count(batch.seq, "bad_seq", "seq", err, low=1)
    if not isinstance(batch.sandboxes, tuple | list):
        _fail(err, "bad_type", "sandboxes must be a tuple")
    _check_sandbox_count(len(batch.sandboxes), err)
    seen: set[str] = set()
    parts = []
    for r in batch.sandboxes:
        if not isinstance(r, SandboxReport):
            _fail(err, "bad_type", "sandboxes holds SandboxReport values")
        sid = _sandbox_id(r.sandbox, err)
        if sid in seen:
            _fail(err, "duplicate_sandbox", f"{sid} twice")
        seen.add(sid)
        bytes_in = _count(r.bytes_in, "bad_count", "bytes_in", err)
        bytes_out = _count(r.bytes_out, "bad_count", "bytes_out", err)
        n_open = _count(r.open, "bad_count", "open", err)
        idle = _idle(r.idle_s, err)
        # The ID is plain ASCII without quotes or backslashes, and repr() of a finite float is a JSON
        # number, so the entry is built directly (json.dumps would give the same bytes, slower).
        parts.append(
            f'{{"sandbox":"{sid}","bytes_in":{bytes_in},"bytes_out":{bytes_out},"open":{n_open},'
            f'"idle_s":{idle!r}}}'
        )
    return f'{{"epoch":"{epoch}","seq":{seq},"sandboxes":[{",".join(parts)}]}}'.encode("ascii")


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
