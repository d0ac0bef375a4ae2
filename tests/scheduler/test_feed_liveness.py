"""Idle only on evidence (issue 22, points 1 and 2): the pure feed-liveness core (``scheduler/feed_liveness.py``)
and the timer core gated on it (``TimerCore.gate_on_feeds``), with a fake clock.

Before these, the timer core idled a sandbox by its byte timer whatever its forwarder's feed did: after a
scheduler restart (nothing heard yet) and for a forwarder with no feed at all, sandboxes with traffic were
declared idle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbxnet.errors import LocalProtocolError
from scheduler.feed_liveness import FeedLiveness
from scheduler.timers import Activity, SandboxConfig, State, TimerCore, Why

# -- the liveness core --------------------------------------------------------------------------------


def test_nothing_is_live_at_start_and_a_batch_makes_its_feed_live() -> None:
    lv = FeedLiveness(5.0, started_at=100.0)
    assert lv.live() == {} and lv.live_since("A") is None and lv.silent_since("A") == 100.0
    assert lv.heard("A", 103.0) == 103.0  # the first batch begins a live spell
    assert lv.heard("A", 104.0) is None  # later ones continue it
    assert lv.live() == {"A": 103.0} and lv.silent_since("A") == 104.0 and lv.live_since("B") is None


@pytest.mark.parametrize(
    ("heard_at", "expire_at", "stale"),
    [
        ([10.0], 15.0, []),  # exactly stale_s of silence: still live
        ([10.0], 15.001, ["A"]),
        ([10.0, 14.0], 19.0, []),
        ([10.0, 14.0], 19.5, ["A"]),
    ],
)
def test_a_feed_goes_stale_after_stale_s_of_silence(heard_at: list[float], expire_at: float, stale: list[str]) -> None:
    lv = FeedLiveness(5.0, started_at=0.0)
    for t in heard_at:
        lv.heard("A", t)
    assert lv.expire(expire_at) == stale
    assert (lv.live_since("A") is None) == bool(stale)
    assert lv.expire(expire_at + 100) == ([] if stale else ["A"])  # reported once


def test_after_silence_the_next_batch_begins_a_new_live_spell_even_before_expire() -> None:
    lv = FeedLiveness(5.0, started_at=0.0)
    lv.heard("A", 1.0)
    assert lv.heard("A", 20.0) == 20.0  # 19 s of silence: the timer loop had not expired it yet
    assert lv.live() == {"A": 20.0}
    lv.heard("B", 1.0)
    assert lv.expire(10.0) == ["B"] and lv.silent_since("B") == 1.0
    assert lv.heard("B", 11.0) == 11.0 and lv.live() == {"A": 20.0, "B": 11.0}


def test_a_bad_bound_is_refused() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(LocalProtocolError):
            FeedLiveness(bad, 0.0)


_ops = st.lists(
    st.tuples(st.sampled_from(["heard", "expire"]), st.sampled_from(["A", "B", "C"]), st.floats(0.0, 4.0)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_live_means_heard_within_the_bound(ops: list[tuple[str, str, float]]) -> None:
    stale_s = 2.5
    lv = FeedLiveness(stale_s, started_at=0.0)
    now = 0.0
    last: dict[str, float] = {}
    for op, key, step in ops:
        now += step
        before = lv.live_since(key)
        if op == "heard":
            began = lv.heard(key, now)
            # A new spell exactly when it was not live, or was silent longer than the bound.
            assert (began is not None) == (before is None or now - last[key] > stale_s)
            last[key] = now
            assert lv.live_since(key) == (now if began is not None else before)
        else:
            gone = lv.expire(now)
            assert gone == sorted(gone)
            for k in ("A", "B", "C"):
                if k in gone:
                    assert now - last[k] > stale_s
                if lv.live_since(k) is not None:
                    assert now - last[k] <= stale_s  # nothing live after expire is silent beyond the bound
        for k, since in lv.live().items():
            assert k in last and since <= last[k]  # never live without a batch heard
        for k in ("A", "B", "C"):
            assert lv.silent_since(k) == last.get(k, 0.0)


# -- the timer core gated on feeds ----------------------------------------------------------------------


def cfg(sid: str, key: str = "pin-A", period: float = 4.0, **kw: object) -> SandboxConfig:
    return SandboxConfig(sid, "inc-1", period, feed_keys=(key,), forwarder=f"fwd-{key}", **kw)  # type: ignore[arg-type]


def test_an_ungated_core_idles_by_the_byte_timer_alone() -> None:
    core = TimerCore()
    core.register(cfg("a"), 0.0)
    assert not core.gated and core.next_timer() == 4.0
    assert [e.why for e in core.on_timer(4.0)] == [Why.IDLE_TIMER]


def test_a_gated_core_idles_nothing_without_a_live_feed() -> None:
    core = TimerCore()
    core.gate_on_feeds({})
    core.register(cfg("a"), 0.0)
    core.on_report("a", 10, 10, 0, 1.0, 1.0, "src#0")
    assert core.next_timer() is None and core.due(1000.0) == [] and core.on_timer(1000.0) == []
    assert core.state_of("a") is State.ACTIVE and core.status_of("a", 1000.0).idle_in_s is None


def test_the_idle_period_runs_from_when_the_feed_became_live() -> None:
    core = TimerCore()
    core.register(cfg("a"), 0.0)
    core.register(cfg("b", key="pin-B"), 0.0)
    core.gate_on_feeds({"pin-B": 0.0})
    assert core.next_timer() == 4.0  # b's feed is live; a's is not
    assert [(e.sandbox, e.why) for e in core.on_timer(4.0)] == [("b", Why.IDLE_TIMER)]
    # a's last activity is old (0.0), but the silence before its feed came back is no evidence.
    core.feed_live("pin-A", 10.0)
    assert core.next_timer() == 14.0 and core.on_timer(13.9) == []
    core.on_report("a", 5, 5, 0, 12.0, 12.0, "src#0")  # traffic the feed reports after it came back
    assert core.next_timer() == 16.0
    assert [(e.sandbox, e.why) for e in core.on_timer(16.0)] == [("a", Why.IDLE_TIMER)]


def test_a_stale_feed_stops_the_timers_of_its_sandboxes_only() -> None:
    core = TimerCore()
    core.gate_on_feeds({"pin-A": 0.0, "pin-B": 0.0})
    core.register(cfg("a"), 0.0)
    core.register(cfg("b", key="pin-B", period=6.0), 0.0)
    core.feed_stale("pin-A")
    assert not core.feed_is_live("pin-A") and core.feed_is_live("pin-B")
    assert core.next_timer() == 6.0 and core.due(100.0) == ["b"]
    assert [e.sandbox for e in core.on_timer(100.0)] == ["b"]
    core.feed_live("pin-A", 200.0)
    core.feed_live("pin-A", 300.0)  # live already: the spell's start stays
    assert core.next_timer() == 204.0


def test_holds_wakes_and_the_driver_work_without_a_feed() -> None:
    core = TimerCore()
    core.gate_on_feeds({"pin-A": 0.0})
    core.register(cfg("a"), 0.0)
    assert [e.to_state for e in core.on_timer(4.0)] == [State.IDLE]
    core.feed_stale("pin-A")
    assert core.hold("a", 10.0, 5.0).events[0].to_state is State.ACTIVE
    assert core.driver_stopped("a", 6.0).events[0].to_state is State.STOPPED
    assert core.wake("a", 7.0).start_driver and core.driver_ready("a", 8.0)[0].to_state is State.ACTIVE
    assert core.on_timer(1000.0) == []  # still no feed: active it stays


def test_a_new_registration_follows_its_route_to_another_forwarder() -> None:
    core = TimerCore()
    core.gate_on_feeds({"pin-A": 0.0})
    core.register(cfg("a"), 0.0)
    core.register(cfg("a", key="pin-B"), 1.0)  # the same incarnation, moved to forwarder B
    assert core.next_timer() is None
    core.feed_live("pin-B", 2.0)
    assert core.next_timer() == 6.0
    core.remove("a")
    core.feed_live("pin-C", 3.0)
    assert core.next_timer() is None


def test_restore_keeps_the_gate() -> None:
    core = TimerCore()
    core.register(cfg("a"), 0.0)
    state = core.snapshot("a")
    gated = TimerCore()
    gated.gate_on_feeds({})
    gated.restore(cfg("a"), state)
    assert gated.next_timer() is None
    gated.feed_live("pin-A", 1.0)
    assert gated.next_timer() == 5.0


_core_ops = st.lists(
    st.one_of(
        st.tuples(st.just("report"), st.sampled_from("ab"), st.floats(0.0, 3.0)),
        st.tuples(st.just("live"), st.sampled_from(["pin-A", "pin-B"]), st.floats(0.0, 3.0)),
        st.tuples(st.just("stale"), st.sampled_from(["pin-A", "pin-B"]), st.floats(0.0, 3.0)),
        st.tuples(st.just("timer"), st.just(""), st.floats(0.0, 3.0)),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(_core_ops)
def test_no_sandbox_is_idled_but_on_a_feed_live_for_a_whole_period(ops: list[tuple[str, str, float]]) -> None:
    period = 2.0
    core = TimerCore()
    core.gate_on_feeds({})
    keys = {"a": "pin-A", "b": "pin-B"}
    for sid, key in keys.items():
        core.register(cfg(sid, key=key, period=period, activity=Activity.BYTES), 0.0)
    live: dict[str, float] = {}
    last: dict[str, float] = {"a": 0.0, "b": 0.0}
    now = 0.0
    for op, arg, step in ops:
        now += step
        if op == "report":
            events = core.on_report(arg, 1, 1, 0, now, now, "s#0")
            last[arg] = now
            assert all(e.why is Why.TRAFFIC for e in events)
        elif op == "live":
            core.feed_live(arg, now)
            live.setdefault(arg, now)
        elif op == "stale":
            core.feed_stale(arg)
            live.pop(arg, None)
        for e in core.on_timer(now):
            key = keys[e.sandbox]
            assert key in live, "idled without a live feed"
            assert now >= live[key] + period and now >= last[e.sandbox] + period
