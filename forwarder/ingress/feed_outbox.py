"""The forwarder's side of the idle feed (docs/scheduler-api.md, "The idle feed"): what to send, and when.

Pure: deltas, answers and ``now`` in, batches out. Time (``now``, the same monotonic clock the ``Meter``
uses), the next epoch (a callable returning ``sbxnet.protocol.feed.new_epoch(...)``) and the jitter (a
callable returning a uniform float in [0, 1), or a ``random.Random``) all come from the caller; the
adapter owns the HTTP client and the interval.

The adapter's loop, each interval: ``add(meter.take(now), now)``; then, whenever ``next_body(now)``
gives a body, POST it and report the outcome: a 200 or 409 whose body ``pull_answer``
parses goes to ``on_answer``; anything else (no answer, a timeout, 5xx, another status, a body refused)
goes to ``on_failure``. ``wake_at()`` says when ``next_body`` may next give something.

What it guarantees:

- At most one batch in flight. It is frozen when first sent and resent byte for byte (same epoch, seq and
  body) until answered; what the meter reports meanwhile merges per sandbox into ``pending``.
- Merging adds the byte deltas, keeps the latest open-connection count and the latest activity, so memory
  is at most two entries per sandbox (one pending, one in flight) however long the scheduler is away.
- A 200 for the batch's seq: done; the next batch takes seq + 1 and goes at once if anything is pending.
- A 409: counted by its error. If it says the batch was applied (``acked >= seq``) the batch is dropped;
  otherwise its entries merge back into pending, older than what is there, to be reported again once.
  Either way a new epoch starts (seq 1): continuing the old one after a replay or a gap could meet the
  same refusal for every later batch. A new epoch is always newer than the current one: if the supplier's
  is not (a clock stepped back), the current start time + 1 ns is used with the supplier's random part.
- No answer (``on_failure``): the same batch again after a capped, jittered backoff: 0.25 s doubling to
  2 s (``backoff_cap_s``, the forwarder's ``feed_retry_cap``), each delay times a factor in [0.8, 1.2): a
  scheduler that comes back hears from the forwarder within a few seconds, not tens. A 409 or an ack for
  another seq backs off the same way, so a scheduler that keeps refusing is not hammered. A 200 resets the backoff.
- Every interval reports, even when nothing moved: ``add(..., report_empty=True)`` (the adapter's take each
  interval) makes ``next_body`` give an empty batch when nothing else waits, so a live feed is never
  silent and its silence about a sandbox is evidence the sandbox had no traffic (the scheduler idles a
  sandbox only while the feed of its forwarder is live: docs/scheduler-api.md "Feed liveness").
- At most ``MAX_SANDBOXES`` sandboxes per batch (the oldest pending first); a count that would not fit
  the wire (2**63) is sent in parts, so nothing is ever refused by ``push_columns``.

A delta the outbox cannot carry (a sandbox ID outside the feed's rule, a negative count, a count that is
not an int, an activity time that is not a finite number) is dropped and counted in ``dropped``; the meter
never produces one. From a dict, ``add`` drops them; from the meter's columns, ``add`` drops only a
negative byte count (merging would hide it), and the rest is found when the batch is encoded
(``push_columns`` or ``array('q')`` refuses it, or no age can be computed), and that sandbox's entry
dropped then. (``array('q')`` takes a bool as its int: the meter gives none.)

Columns throughout: pending and in flight are a list per field (``_Columns``), as ``Meter.take`` gives
them and ``push_columns`` encodes them, so the usual interval (pending empty, the meter's columns taken
whole, one batch) does no Python work per sandbox: the ages (``ages_ms``) and the number columns are
written by native/feed_text.c where it is built (else by Python, a few ms more at 10,000 sandboxes).
Merging into a non-empty pending (an outage, or a take while a batch is in flight) goes sandbox by
sandbox through an index.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from forwarder.ingress.metering import Deltas, SandboxDelta
from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import (
    COUNT_MAX,
    MAX_SANDBOXES,
    NATIVE_COLUMNS,
    Answer,
    Batch,
    SandboxReport,
    ages_ms,
    epoch_is_newer,
    epoch_start_ns,
    is_epoch,
    is_sandbox_id,
    new_epoch,
    push_columns,
)

if TYPE_CHECKING:
    _Ints = list[int] | array[int]

BACKOFF_INITIAL_S = 0.25
BACKOFF_CAP_S = 2.0  # a scheduler that is back hears from us within about this long
BACKOFF_JITTER = 0.2  # each delay is multiplied by a factor in [1 - j, 1 + j)


class _Uniform(Protocol):
    def random(self) -> float: ...


def backoff_delay(
    failures: int,
    u: float,
    initial: float = BACKOFF_INITIAL_S,
    cap: float = BACKOFF_CAP_S,
    jitter: float = BACKOFF_JITTER,
) -> float:
    """The wait after ``failures`` consecutive failures (>= 1), for a uniform draw ``u`` in [0, 1]: the
    capped doubling first, then the jitter, so retries at the cap do not fall into step."""
    if not 0.0 <= u <= 1.0:
        raise LocalProtocolError("bad_jitter", "the jitter source must give a float in [0, 1)")
    base = min(initial * 2.0 ** min(max(failures, 1) - 1, 64), cap)
    return base * (1.0 + jitter * (2.0 * u - 1.0))


@dataclass(slots=True)
class _Columns:
    """Entries as columns: index ``i`` of each list is sandbox ``sandboxes[i]``, each sandbox once."""

    sandboxes: list[str]
    bytes_in: list[int]
    bytes_out: list[int]
    open: list[int]
    last: list[float]  # the latest activity, the caller's monotonic clock
    index: dict[str, int] | None = None  # sandbox -> its index, made at the first merge into these

    def __len__(self) -> int:
        return len(self.sandboxes)

    @classmethod
    def empty(cls) -> _Columns:
        return cls([], [], [], [], [])

    def append(self, sid: str, b_in: int, b_out: int, n: int, t: float) -> None:
        """One more sandbox (not here yet; the index, if made, is not kept up to date: only for columns
        never merged into)."""
        self.sandboxes.append(sid)
        self.bytes_in.append(b_in)
        self.bytes_out.append(b_out)
        self.open.append(n)
        self.last.append(t)

    def copy(self) -> _Columns:
        return _Columns(self.sandboxes[:], self.bytes_in[:], self.bytes_out[:], self.open[:], self.last[:])

    def merge(self, newer: _Columns) -> None:
        """Add ``newer``'s entries: bytes added, its open count (the later one is current), the latest
        activity; a sandbox not here yet is appended."""
        index = self.index
        if index is None:
            index = self.index = dict(zip(self.sandboxes, range(len(self.sandboxes)), strict=True))
        ids, ins, outs, opens, lasts = self.sandboxes, self.bytes_in, self.bytes_out, self.open, self.last
        for sid, b_in, b_out, n, t in zip(
            newer.sandboxes, newer.bytes_in, newer.bytes_out, newer.open, newer.last, strict=True
        ):
            i = index.get(sid)
            if i is None:
                index[sid] = len(ids)
                ids.append(sid)
                ins.append(b_in)
                outs.append(b_out)
                opens.append(n)
                lasts.append(t)
            else:
                ins[i] += b_in
                outs[i] += b_out
                opens[i] = n
                if t > lasts[i]:
                    lasts[i] = t

    def split(self, k: int) -> tuple[_Columns, _Columns]:
        """The first ``k`` entries, and the rest."""
        return (
            _Columns(self.sandboxes[:k], self.bytes_in[:k], self.bytes_out[:k], self.open[:k], self.last[:k]),
            _Columns(self.sandboxes[k:], self.bytes_in[k:], self.bytes_out[k:], self.open[k:], self.last[k:]),
        )


@dataclass(slots=True)
class _InFlight:
    epoch: str
    seq: int
    entries: _Columns  # what the batch carries, kept to merge back after a 409
    idle_ms: list[int] | array[int]
    body: bytes  # push_columns(...), made once: every resend is these bytes
    since: float  # when the oldest delta it carries was added
    _batch: Batch | None = None

    @property
    def batch(self) -> Batch:
        """The batch as ``pull_batch`` would read the body (made on first use: the reporter needs only the
        body, and a ``SandboxReport`` per sandbox is most of what encoding used to cost)."""
        if self._batch is None:
            e = self.entries
            reports = tuple(
                map(SandboxReport, e.sandboxes, e.bytes_in, e.bytes_out, e.open, [ms / 1000 for ms in self.idle_ms])
            )
            self._batch = Batch(self.epoch, self.seq, reports)
        return self._batch


class Outbox:
    def __init__(
        self,
        epoch_source: Callable[[], str],
        jitter: Callable[[], float] | _Uniform,
        *,
        max_sandboxes: int = MAX_SANDBOXES,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        backoff_jitter: float = BACKOFF_JITTER,
    ) -> None:
        if not 1 <= max_sandboxes <= MAX_SANDBOXES:
            raise LocalProtocolError("bad_config", f"max_sandboxes must be in [1, {MAX_SANDBOXES}]")
        self._epoch_source = epoch_source
        self._uniform: Callable[[], float] = jitter.random if not callable(jitter) else jitter
        self._max_sandboxes = max_sandboxes
        self._backoff = (backoff_initial_s, backoff_cap_s, backoff_jitter)
        self._epoch = self._supplied_epoch()
        self._next_seq = 1
        self._pending = _Columns.empty()
        self._pending_since: float | None = None
        self._empty_due = False  # an interval passed with nothing to report: send an empty batch
        self._flight: _InFlight | None = None
        self._awaiting = False  # the in-flight batch was handed out and not yet answered
        self._retry_at = -math.inf
        self._consecutive = 0
        # Counters for metrics.
        self.failures: dict[str, int] = {}  # by reason: on_failure's, the 409 errors, "mismatch"
        self.epochs_started = 1
        self.batches_acked = 0  # 200s, and 409s saying the batch was applied
        self.sends = 0  # batches handed out, resends included
        self.dropped = 0  # deltas it could not carry
        self.acked_bytes_in = 0
        self.acked_bytes_out = 0

    # --- what the adapter reads ---------------------------------------------------------------------

    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def in_flight(self) -> Batch | None:
        return self._flight.batch if self._flight else None

    @property
    def in_flight_key(self) -> tuple[str, int] | None:
        """The in-flight batch's (epoch, seq), without making its ``Batch``."""
        return (self._flight.epoch, self._flight.seq) if self._flight else None

    @property
    def in_flight_body(self) -> bytes | None:
        """The bytes to POST for the in-flight batch (the same on every resend)."""
        return self._flight.body if self._flight else None

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def in_flight_count(self) -> int:
        return len(self._flight.entries) if self._flight else 0

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive

    @property
    def failures_total(self) -> int:
        return sum(self.failures.values())

    def lag(self, now: float) -> float:
        """How long the oldest delta not yet acknowledged has waited (0 when everything is)."""
        times = [t for t in (self._pending_since, self._flight.since if self._flight else None) if t is not None]
        return max(0.0, now - min(times)) if times else 0.0

    def wake_at(self) -> float | None:
        """The earliest time ``next_batch`` may give a batch (-inf: now); None while a batch awaits its
        answer or nothing waits to be sent."""
        if self._awaiting or (self._flight is None and not self._pending and not self._empty_due):
            return None
        return self._retry_at

    # --- inputs -------------------------------------------------------------------------------------

    def add(self, deltas: Deltas | Mapping[str, SandboxDelta], now: float, *, report_empty: bool = False) -> None:
        """Merge what ``Meter.take`` (columns) or ``Meter.take_deltas`` (a dict) returned into pending
        (bytes_up is the feed's bytes_in). ``report_empty``: this is an interval's take, which is reported
        even when it brought nothing: if no batch is in flight and nothing is pending, ``next_body`` then
        gives an empty batch (the feed's proof of life)."""
        if report_empty:
            self._empty_due = True
        if isinstance(deltas, Deltas):
            cols = self._checked(deltas)
            if cols is None:
                d = deltas
                cols = self._checked_one_by_one(
                    zip(d.sandboxes, d.bytes_up, d.bytes_down, d.open_connections, d.last_activity, strict=False)
                )
        else:
            cols = self._checked_one_by_one(
                (sid, d.bytes_up, d.bytes_down, d.open_connections, d.last_activity) for sid, d in deltas.items()
            )
        if not cols:
            return
        if self._pending:
            self._pending.merge(cols)
        else:
            self._pending = cols  # the usual interval: the meter's columns, taken whole
        if self._pending_since is None:
            self._pending_since = now

    def next_body(self, now: float, *, ignore_backoff: bool = False) -> bytes | None:
        """The body to POST now (also ``in_flight_body``), or None: one is awaiting its answer, the backoff
        has not run out, or there is nothing to report. ``ignore_backoff``: the last attempt of a process
        that is stopping (what it does not send now is lost), so the backoff's wait does not apply; a
        failure still counts and backs off as usual."""
        if self._awaiting or (now < self._retry_at and not ignore_backoff):
            return None
        if self._flight is None:
            if not self._pending and not self._empty_due:
                return None
            self._flight = self._freeze(now)
            if self._flight is None:
                return None  # every pending entry was dropped
        self._awaiting = True
        self.sends += 1
        return self._flight.body

    def next_batch(self, now: float, *, ignore_backoff: bool = False) -> Batch | None:
        """``next_body``, giving the in-flight batch (``in_flight``) instead of its body."""
        if self.next_body(now, ignore_backoff=ignore_backoff) is None:
            return None
        assert self._flight is not None
        return self._flight.batch

    def on_answer(self, answer: Answer, now: float) -> str:
        """The scheduler's parsed answer to the batch handed out last. Returns what was done: ``acked``,
        ``dropped`` (a 409 saying it was applied), ``requeued`` (a 409: reported again under a new epoch),
        or ``mismatch`` (a 200 for another seq: not this batch's answer, so it is sent again)."""
        flight = self._take_awaited()
        seq = flight.seq
        if answer.error is None:
            if answer.acked != seq:
                self._count("mismatch")
                self._schedule_retry(now)
                return "mismatch"
            self._done(flight)
            self._next_seq = seq + 1
            if self._next_seq > COUNT_MAX:
                self._start_epoch()
            self._consecutive = 0
            self._retry_at = -math.inf
            return "acked"
        self._count(answer.error)
        if answer.acked is not None and answer.acked >= seq:
            self._done(flight)
            outcome = "dropped"
        else:
            self._merge_back(flight)
            outcome = "requeued"
        self._flight = None
        self._start_epoch()
        self._schedule_retry(now)
        return outcome

    def on_failure(self, now: float, reason: str = "unanswered") -> None:
        """No usable answer to the batch handed out last (``reason`` is counted: a timeout, a 5xx, ...).
        The same batch goes again after the backoff."""
        self._take_awaited()
        self._count(reason)
        self._schedule_retry(now)

    # --- internals ----------------------------------------------------------------------------------

    def _checked(self, d: Deltas) -> _Columns | None:
        """The meter's columns as they are, or None: then entry by entry through the checks that drop and
        count what cannot be carried. Only what merging needs is checked here, over whole columns (no
        negative byte count, which would cancel bytes it merged with); the rest (IDs, types, times) when
        the batch is encoded (``_freeze``), which is a pass over whole columns anyway."""
        try:
            ok = (
                len(d.bytes_up) == len(d.bytes_down) == len(d.open_connections) == len(d.last_activity)
                == len(d.sandboxes)
                and min(d.bytes_up, default=0) >= 0
                and min(d.bytes_down, default=0) >= 0
            )
        except TypeError:  # a value that is not a number among them
            ok = False
        if not ok:
            return None
        return _Columns(d.sandboxes, d.bytes_up, d.bytes_down, d.open_connections, d.last_activity)

    def _checked_one_by_one(self, entries: Iterable[tuple[object, object, object, object, object]]) -> _Columns:
        cols = _Columns.empty()
        seen: set[object] = set()
        for sid, up, down, n, last in entries:
            if not (
                is_sandbox_id(sid)
                and sid not in seen
                and _is_count(up)
                and _is_count(down)
                and _is_count(n)
                and type(last) in (int, float)
                and math.isfinite(last)  # type: ignore[arg-type]
            ):
                self.dropped += 1
                continue
            seen.add(sid)
            cols.append(sid, up, down, n, float(last))  # type: ignore[arg-type]
        return cols

    def _take_awaited(self) -> _InFlight:
        if not self._awaiting or self._flight is None:
            raise LocalProtocolError("not_in_flight", "no batch was handed out that awaits an answer")
        self._awaiting = False
        return self._flight

    def _count(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def _schedule_retry(self, now: float) -> None:
        self._consecutive += 1
        self._retry_at = now + backoff_delay(self._consecutive, self._uniform(), *self._backoff)

    def _done(self, flight: _InFlight) -> None:
        self._flight = None
        self.batches_acked += 1
        self.acked_bytes_in += sum(flight.entries.bytes_in)
        self.acked_bytes_out += sum(flight.entries.bytes_out)

    def _supplied_epoch(self) -> str:
        epoch = self._epoch_source()
        if not is_epoch(epoch):
            raise LocalProtocolError("bad_epoch", "the epoch source gave something that is not an epoch")
        return epoch

    def _start_epoch(self) -> None:
        epoch = self._supplied_epoch()
        if not epoch_is_newer(epoch, self._epoch):
            epoch = new_epoch(epoch_start_ns(self._epoch) + 1, bytes.fromhex(epoch.partition("-")[2]))
        self._epoch = epoch
        self._next_seq = 1
        self.epochs_started += 1

    def _freeze(self, now: float) -> _InFlight | None:
        since = self._pending_since if self._pending_since is not None else now
        if len(self._pending) > self._max_sandboxes:
            sent, self._pending = self._pending.split(self._max_sandboxes)
        else:
            sent, self._pending = self._pending, _Columns.empty()
        sent.index = None  # what is sent is never merged into (a refusal merges pending into a copy)
        # The ages (ms, clamped to the wire's range) and the number columns as int64 arrays where
        # native/feed_text.c is built: then it writes them, and array('q') has checked their type.
        try:
            idle = ages_ms(now, sent.last)
            if idle is None:
                raise ValueError("a time that is not a finite number")
            if NATIVE_COLUMNS:
                numbers: tuple[_Ints, _Ints, _Ints] = (
                    array("q", sent.bytes_in), array("q", sent.bytes_out), array("q", sent.open)
                )
            else:
                numbers = (sent.bytes_in, sent.bytes_out, sent.open)
            body = push_columns(self._epoch, self._next_seq, sent.sandboxes, *numbers, idle)
        except (LocalProtocolError, TypeError, ValueError, OverflowError):  # the last three: array() refused
            sent, idle = self._carriable(sent, now)
            body = push_columns(self._epoch, self._next_seq, sent.sandboxes, sent.bytes_in, sent.bytes_out,
                                sent.open, idle)
        if not self._pending:
            self._pending_since = None
        if not sent and not self._empty_due:
            return None  # every entry was dropped
        self._empty_due = False  # a batch goes, so this interval is reported
        return _InFlight(self._epoch, self._next_seq, sent, idle, body, since)

    def _carriable(self, sent: _Columns, now: float) -> tuple[_Columns, list[int] | array[int]]:
        """What of ``sent`` the wire carries, entry by entry: an entry with an ID outside the rule, a count
        that is no int or a time that is no finite number is dropped (counted); a count beyond the wire's
        goes in part, the rest back to pending, first; an age out of range is clamped."""
        out, rest = _Columns.empty(), _Columns.empty()
        for sid, b_in, b_out, n, t in zip(sent.sandboxes, sent.bytes_in, sent.bytes_out, sent.open, sent.last,
                                          strict=True):
            if not (
                is_sandbox_id(sid)
                and _is_count(b_in)
                and _is_count(b_out)
                and _is_count(n)
                and type(t) in (int, float)
                and math.isfinite(t)
            ):
                self.dropped += 1
                continue
            if b_in > COUNT_MAX or b_out > COUNT_MAX:
                part_in, part_out = min(b_in, COUNT_MAX), min(b_out, COUNT_MAX)
                rest.append(sid, b_in - part_in, b_out - part_out, n, t)
                b_in, b_out = part_in, part_out
            out.append(sid, b_in, b_out, n, t)
        idle = ages_ms(now, out.last) or []  # every time is finite now (an empty list gives [])
        if rest:
            rest.merge(self._pending)
            self._pending = rest
        return out, idle

    def _merge_back(self, flight: _InFlight) -> None:
        """Put a refused batch's entries back in pending, as older than what pending holds."""
        merged = flight.entries.copy()
        merged.merge(self._pending)
        self._pending = merged  # the refused sandboxes first: they have waited longest
        self._pending_since = flight.since if self._pending_since is None else min(flight.since, self._pending_since)


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0
