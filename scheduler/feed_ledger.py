"""The scheduler's acceptance rule for idle-feed batches (docs/scheduler-api.md, "Exactly once").

Pure: what is stored for a forwarder identity and a parsed batch in, a ``Decision`` out. The store
adapter reads ``Stored`` for the identity (the certificate's SAN), calls ``decide``, and when
``decision.apply`` is true applies the batch's deltas and writes ``decision.store`` in one transaction;
then it answers ``decision.answer`` (``push_answer``, ``answer.http_status``). Nothing here reads a clock.

The rule, with ``last`` the stored seq:

    nothing stored                 seq == 1: APPLY (a first start)   other seq: GAP, acked 0
    same epoch                     seq == last + 1: APPLY            200 {"acked": seq}
                                   seq == last: DUPLICATE            200 {"acked": seq}, nothing applied
                                   seq < last: REPLAY                409 replay, acked last
                                   seq > last + 1: GAP               409 gap, acked last
    a newer epoch (later start)    seq == 1: APPLY (a restart)       other seq: GAP, acked 0
    any other epoch                STALE_EPOCH                       409 stale_epoch

"Nothing stored" is read as a newer epoch than any: a scheduler that lost its state (or never saw the
forwarder) accepts only an epoch's first batch and tells a forwarder further along to start again
(``gap``, acked 0), which it does under a new epoch, so nothing is applied twice. An epoch that started
in the same nanosecond as the stored one but is not it is not newer, so it is stale.

``reason`` names every outcome but a plain APPLY for metrics: ``restart``, ``duplicate``, ``replay``,
``gap``, ``stale_epoch``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sbxnet.protocol.feed import Answer, Batch, epoch_is_newer


@dataclass(frozen=True)
class Stored:
    """What the store keeps per forwarder identity: the epoch and the last seq applied under it."""

    epoch: str
    last_seq: int


class Verdict(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"  # a retry after a lost answer: ack again, apply nothing
    REPLAY = "replay"
    GAP = "gap"
    STALE_EPOCH = "stale_epoch"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    answer: Answer
    store: Stored | None  # what to write with the deltas (APPLY only); None: the store is unchanged
    reason: str | None  # the metrics token; None for a plain in-order APPLY

    @property
    def apply(self) -> bool:
        return self.verdict is Verdict.APPLY


def decide(stored: Stored | None, batch: Batch) -> Decision:
    """The acceptance rule above, for ``batch`` from an identity whose store holds ``stored``."""
    epoch, seq = batch.epoch, batch.seq
    if stored is None or (epoch != stored.epoch and epoch_is_newer(epoch, stored.epoch)):
        if seq == 1:
            return Decision(Verdict.APPLY, Answer.ok(1), Stored(epoch, 1), None if stored is None else "restart")
        return Decision(Verdict.GAP, Answer.gap(0), None, "gap")
    if epoch != stored.epoch:
        return Decision(Verdict.STALE_EPOCH, Answer.stale_epoch(), None, "stale_epoch")
    last = stored.last_seq
    if seq == last + 1:
        return Decision(Verdict.APPLY, Answer.ok(seq), Stored(epoch, seq), None)
    if seq == last:
        return Decision(Verdict.DUPLICATE, Answer.ok(seq), None, "duplicate")
    if seq < last:
        return Decision(Verdict.REPLAY, Answer.replay(last), None, "replay")
    return Decision(Verdict.GAP, Answer.gap(last), None, "gap")


class MemoryLedger:
    """``decide`` over a dict of identities: the in-memory store (tests, a scheduler without a database).
    ``receive`` stores what an APPLY says to store; applying the deltas is the caller's, in the same step."""

    def __init__(self) -> None:
        self._stored: dict[str, Stored] = {}

    def get(self, identity: str) -> Stored | None:
        return self._stored.get(identity)

    def receive(self, identity: str, batch: Batch) -> Decision:
        d = decide(self._stored.get(identity), batch)
        if d.store is not None:
            self._stored[identity] = d.store
        return d
