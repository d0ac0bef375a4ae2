"""The forwarder's side of the idle feed (docs/scheduler-api.md, "The idle feed"): what to send, and when.

Pure: deltas, answers and ``now`` in, batches out. Time (``now``, the same monotonic clock the ``Meter``
uses), the next epoch (a callable returning ``sbxnet.protocol.feed.new_epoch(...)``) and the jitter (a
callable returning a uniform float in [0, 1), or a ``random.Random``) all come from the caller; the
adapter owns the HTTP client and the interval.

The adapter's loop, each interval: ``add(meter.take_deltas(now), now)``; then, whenever ``next_batch(now)``
gives a batch, POST ``in_flight_body`` and report the outcome: a 200 or 409 whose body ``pull_answer``
parses goes to ``on_answer``; anything else (no answer, a timeout, 5xx, another status, a body refused)
goes to ``on_failure``. ``wake_at()`` says when ``next_batch`` may next give something.

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
  10 s, each delay times a factor in [0.8, 1.2). A 409 or an ack for another seq backs off the same way,
  so a scheduler that keeps refusing is not hammered. A 200 resets the backoff.
- At most ``MAX_SANDBOXES`` sandboxes per batch (the oldest pending first); a count that would not fit
  the wire (2**63) is sent in parts, so nothing is ever refused by ``push_batch``.

A delta the outbox cannot carry (a sandbox ID outside the feed's rule, a negative count) is dropped and
counted in ``dropped``; the meter never produces one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from forwarder.ingress.metering import SandboxDelta
from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import (
    COUNT_MAX,
    IDLE_S_MAX,
    MAX_SANDBOXES,
    Answer,
    Batch,
    SandboxReport,
    epoch_is_newer,
    epoch_start_ns,
    is_epoch,
    is_sandbox_id,
    new_epoch,
    push_batch,
)

BACKOFF_INITIAL_S = 0.25
BACKOFF_CAP_S = 10.0
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
class _Entry:
    bytes_in: int
    bytes_out: int
    open: int
    last_activity: float  # the caller's monotonic clock


@dataclass(frozen=True, slots=True)
class _InFlight:
    batch: Batch
    body: bytes  # push_batch(batch), made once: every resend is these bytes
    entries: dict[str, _Entry]  # what the batch carries, kept to merge back after a 409
    since: float  # when the oldest delta it carries was added


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
        self._pending: dict[str, _Entry] = {}
        self._pending_since: float | None = None
        self._flight: _InFlight | None = None
        self._awaiting = False  # the in-flight batch was handed out and not yet answered
        self._retry_at = -math.inf
        self._consecutive = 0
        # Counters for metrics.
        self.failures: dict[str, int] = {}  # by reason: on_failure's, the 409 errors, "mismatch"
        self.epochs_started = 1
        self.batches_acked = 0  # 200s, and 409s saying the batch was applied
        self.sends = 0  # batches handed out, resends included
        self.dropped = 0  # deltas add() could not carry
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
        if self._awaiting or (self._flight is None and not self._pending):
            return None
        return self._retry_at

    # --- inputs -------------------------------------------------------------------------------------

    def add(self, deltas: Mapping[str, SandboxDelta], now: float) -> None:
        """Merge what ``Meter.take_deltas`` returned into pending (bytes_up is the feed's bytes_in)."""
        for sid, d in deltas.items():
            if not (
                is_sandbox_id(sid)
                and _is_count(d.bytes_up)
                and _is_count(d.bytes_down)
                and _is_count(d.open_connections)
                and isinstance(d.last_activity, int | float)
            ):
                self.dropped += 1
                continue
            e = self._pending.get(sid)
            if e is None:
                self._pending[sid] = _Entry(d.bytes_up, d.bytes_down, d.open_connections, float(d.last_activity))
            else:
                e.bytes_in += d.bytes_up
                e.bytes_out += d.bytes_down
                e.open = d.open_connections  # the later take's count is the current one
                e.last_activity = max(e.last_activity, float(d.last_activity))
            if self._pending_since is None:
                self._pending_since = now

    def next_batch(self, now: float, *, ignore_backoff: bool = False) -> Batch | None:
        """The batch to send now (then POST ``in_flight_body``), or None: one is awaiting its answer, the
        backoff has not run out, or there is nothing to report. ``ignore_backoff``: the last attempt of a
        process that is stopping (what it does not send now is lost), so the backoff's wait does not apply;
        a failure still counts and backs off as usual."""
        if self._awaiting or (now < self._retry_at and not ignore_backoff):
            return None
        if self._flight is None:
            if not self._pending:
                return None
            self._flight = self._freeze(now)
        self._awaiting = True
        self.sends += 1
        return self._flight.batch

    def on_answer(self, answer: Answer, now: float) -> str:
        """The scheduler's parsed answer to the batch handed out last. Returns what was done: ``acked``,
        ``dropped`` (a 409 saying it was applied), ``requeued`` (a 409: reported again under a new epoch),
        or ``mismatch`` (a 200 for another seq: not this batch's answer, so it is sent again)."""
        flight = self._take_awaited()
        seq = flight.batch.seq
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
        self.acked_bytes_in += sum(r.bytes_in for r in flight.batch.sandboxes)
        self.acked_bytes_out += sum(r.bytes_out for r in flight.batch.sandboxes)

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

    def _freeze(self, now: float) -> _InFlight:
        since = self._pending_since if self._pending_since is not None else now
        entries: dict[str, _Entry] = {}
        reports = []
        pending = self._pending
        for sid in list(itertools.islice(pending, self._max_sandboxes)):
            e = pending[sid]
            if e.bytes_in <= COUNT_MAX and e.bytes_out <= COUNT_MAX:
                sent = pending.pop(sid)  # all of it goes (always, but for counts beyond the wire's)
            else:
                sent = _Entry(min(e.bytes_in, COUNT_MAX), min(e.bytes_out, COUNT_MAX), e.open, e.last_activity)
                e.bytes_in -= sent.bytes_in
                e.bytes_out -= sent.bytes_out
            entries[sid] = sent
            idle = min(max(0.0, now - e.last_activity), IDLE_S_MAX)
            reports.append(SandboxReport(sid, sent.bytes_in, sent.bytes_out, sent.open, idle))
        if not self._pending:
            self._pending_since = None
        batch = Batch(self._epoch, self._next_seq, tuple(reports))
        return _InFlight(batch, push_batch(batch), entries, since)

    def _merge_back(self, flight: _InFlight) -> None:
        """Put a refused batch's entries back in pending, as older than what pending holds."""
        merged: dict[str, _Entry] = {}
        for sid, old in flight.entries.items():
            newer = self._pending.get(sid)
            if newer is not None:
                old.bytes_in += newer.bytes_in
                old.bytes_out += newer.bytes_out
                old.open = newer.open
                old.last_activity = max(old.last_activity, newer.last_activity)
            merged[sid] = old
        for sid, e in self._pending.items():
            merged.setdefault(sid, e)
        self._pending = merged  # the refused sandboxes first: they have waited longest
        self._pending_since = flight.since if self._pending_since is None else min(flight.since, self._pending_since)


def _is_count(v: object) -> bool:
    return type(v) is int and v >= 0
