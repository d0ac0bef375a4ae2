"""The scheduler's acceptance rule for feed batches (scheduler/feed_ledger.py), case by case as
docs/scheduler-api.md lists them, and as a property: whatever arrives, nothing is applied twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbxnet.protocol.feed import Answer, Batch, SandboxReport, new_epoch, pull_answer, push_answer
from scheduler.feed_ledger import Decision, MemoryLedger, Stored, Verdict, decide

E1 = new_epoch(1_000, bytes(8))
E2 = new_epoch(2_000, bytes.fromhex("0123456789abcdef"))
E1_TWIN = new_epoch(1_000, b"\xff" * 8)  # the same start time as E1, another epoch


def b(epoch: str, seq: int) -> Batch:
    return Batch(epoch, seq, (SandboxReport("sbx-1", 10, 20, 1, 0.5),))


CASES = [
    # stored, epoch, seq -> verdict, answer, what is stored after, reason
    (None, E1, 1, Verdict.APPLY, Answer.ok(1), Stored(E1, 1), None),
    (None, E1, 2, Verdict.GAP, Answer.gap(0), None, "gap"),
    (None, E1, 42, Verdict.GAP, Answer.gap(0), None, "gap"),
    (Stored(E1, 5), E1, 6, Verdict.APPLY, Answer.ok(6), Stored(E1, 6), None),
    (Stored(E1, 5), E1, 5, Verdict.DUPLICATE, Answer.ok(5), None, "duplicate"),
    (Stored(E1, 5), E1, 4, Verdict.REPLAY, Answer.replay(5), None, "replay"),
    (Stored(E1, 5), E1, 1, Verdict.REPLAY, Answer.replay(5), None, "replay"),
    (Stored(E1, 5), E1, 7, Verdict.GAP, Answer.gap(5), None, "gap"),
    (Stored(E1, 5), E1, 2**63 - 1, Verdict.GAP, Answer.gap(5), None, "gap"),
    (Stored(E1, 5), E2, 1, Verdict.APPLY, Answer.ok(1), Stored(E2, 1), "restart"),
    (Stored(E1, 5), E2, 2, Verdict.GAP, Answer.gap(0), None, "gap"),
    (Stored(E1, 5), E2, 6, Verdict.GAP, Answer.gap(0), None, "gap"),
    (Stored(E2, 3), E1, 1, Verdict.STALE_EPOCH, Answer.stale_epoch(), None, "stale_epoch"),
    (Stored(E2, 3), E1, 4, Verdict.STALE_EPOCH, Answer.stale_epoch(), None, "stale_epoch"),
    # Not newer (same start time) and not the stored one: stale, so it is never applied beside it.
    (Stored(E1, 5), E1_TWIN, 1, Verdict.STALE_EPOCH, Answer.stale_epoch(), None, "stale_epoch"),
    (Stored(E1, 5), E1_TWIN, 6, Verdict.STALE_EPOCH, Answer.stale_epoch(), None, "stale_epoch"),
]


@pytest.mark.parametrize(("stored", "epoch", "seq", "verdict", "answer", "store", "reason"), CASES)
def test_rule(
    stored: Stored | None, epoch: str, seq: int, verdict: Verdict, answer: Answer, store: Stored | None,
    reason: str | None,
) -> None:
    d = decide(stored, b(epoch, seq))
    assert d == Decision(verdict, answer, store, reason)
    assert d.apply is (verdict is Verdict.APPLY)
    assert (d.store is not None) is d.apply
    # Every answer is one the codec carries, with the status the contract gives it.
    assert pull_answer(push_answer(d.answer), 200 if verdict in (Verdict.APPLY, Verdict.DUPLICATE) else 409) == answer


def test_every_verdict_is_covered() -> None:
    assert {c[3] for c in CASES} == set(Verdict)


def test_a_forwarder_sees_its_batch_applied_only_from_the_acks_it_acts_on() -> None:
    # The forwarder's reading of an answer (acked >= seq: applied) is right for every refusal: only
    # a replay says acked >= seq, and a replayed seq was applied earlier.
    for stored, epoch, seq, verdict, answer, _store, _reason in CASES:
        if answer.error is not None and answer.acked is not None and answer.acked >= seq:
            assert verdict is Verdict.REPLAY and stored is not None and stored.epoch == epoch


def test_memory_ledger_stores_per_identity() -> None:
    led = MemoryLedger()
    assert led.receive("fwd-a", b(E1, 1)).apply
    assert led.receive("fwd-b", b(E2, 1)).apply  # another identity, its own state
    assert led.receive("fwd-a", b(E1, 1)).verdict is Verdict.DUPLICATE
    assert led.receive("fwd-a", b(E1, 3)).verdict is Verdict.GAP
    assert led.get("fwd-a") == Stored(E1, 1)
    assert led.receive("fwd-a", b(E1, 2)).apply
    assert led.receive("fwd-a", b(E2, 1)).reason == "restart"
    assert led.receive("fwd-a", b(E1, 3)).verdict is Verdict.STALE_EPOCH
    assert led.get("fwd-a") == Stored(E2, 1) and led.get("fwd-b") == Stored(E2, 1)
    assert led.get("fwd-c") is None


EPOCHS = [new_epoch(ns, bytes([i]) * 8) for i, ns in enumerate((10, 20, 20, 30, 40))]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(EPOCHS), st.integers(1, 8)), max_size=60))
def test_whatever_arrives_nothing_is_applied_twice(arrivals: list[tuple[str, int]]) -> None:
    led = MemoryLedger()
    applied: list[tuple[str, int]] = []
    for epoch, seq in arrivals:
        before = led.get("f")
        d = led.receive("f", b(epoch, seq))
        if d.apply:
            applied.append((epoch, seq))
            assert led.get("f") == Stored(epoch, seq)
        else:
            assert led.get("f") == before
        # An ack names the batch's own seq; a 409 never does unless it was applied before (a replay).
        if d.answer.error is None:
            assert d.answer.acked == seq and (epoch, seq) in applied
    assert len(applied) == len(set(applied))
    # Under each epoch the applied seqs run 1, 2, 3, ... and epochs follow one another by start time.
    order: list[str] = []
    for epoch, seq in applied:
        if not order or order[-1] != epoch:
            assert epoch not in order
            assert seq == 1
            order.append(epoch)
        else:
            assert seq == [s for e, s in applied if e == epoch].index(seq) + 1
    starts = [int(e.split("-")[0]) for e in order]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
