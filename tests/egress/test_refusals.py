"""refusals.RefusalLog: one entry per refused tuple and reason a round, in the order first refused, with
its packets, first and last; past the cap only a count; every note is in one or the other; take empties
it. Hypothesis over any sequence of notes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from forwarder.egress.flows import FlowKey
from forwarder.egress.refusals import RefusalLog

K1, K2 = FlowKey(6, 1, 40000, 2, 25), FlowKey(17, 1, 5353, 3, 53)


def test_aggregates_by_tuple_and_reason_and_take_empties() -> None:
    log = RefusalLog(cap=2)
    log.note(K1, "policy_denied", 1.0)
    log.note(K2, "flow_rate", 1.5)
    log.note(K1, "policy_denied", 2.0)
    log.note(K1, "flow_cap", 2.5)  # a third entry: past the cap
    assert log.take() == ([(K1, "policy_denied", 2, 1.0, 2.0), (K2, "flow_rate", 1, 1.5, 1.5)], 1)
    assert log.take() == ([], 0)
    log.note(K1, "flow_cap", 3.0)
    assert log.take() == ([(K1, "flow_cap", 1, 3.0, 3.0)], 0)


notes = st.lists(st.tuples(st.sampled_from([K1, K2, FlowKey(1, 1, 0, 4, 0)]),
                           st.sampled_from(["policy_denied", "flow_cap", "internal_address"]),
                           st.floats(0, 1e6)), max_size=60)


@given(notes, st.integers(0, 5))
def test_every_note_is_listed_or_counted(seq: list[tuple[FlowKey, str, float]], cap: int) -> None:
    log = RefusalLog(cap=cap)
    for key, reason, at in seq:
        log.note(key, reason, at)
    listed, suppressed = log.take()
    assert sum(n for _, _, n, _, _ in listed) + suppressed == len(seq)
    assert len(listed) <= cap and len({(k, r) for k, r, _, _, _ in listed}) == len(listed)
    firsts = [(k, r) for k, r, _ in seq]
    assert [(k, r) for k, r, _, _, _ in listed] == list(dict.fromkeys(firsts))[: len(listed)]
    for key, reason, n, first, last in listed:
        times = [t for k, r, t in seq if (k, r) == (key, reason)]
        assert (n, first, last) == (len(times), times[0], times[-1])
