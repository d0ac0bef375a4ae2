"""The timer core with a fake clock: idle exactly at the period after the last activity, the activity
policies, holds, incarnations, wake coalescing and the stop fence, one event per transition, and a
stateful test against a plain reference model (docs/scheduler-api.md "States", "Holds", "Wake")."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sbxnet.errors import LocalProtocolError
from scheduler.timers import (
    METER_FIELDS,
    TRANSITIONS,
    Activity,
    Event,
    Input,
    SandboxConfig,
    SandboxState,
    State,
    TimerCore,
    UnknownSandbox,
    Why,
)

ACTIVE, IDLE, STOPPING, STOPPED, WAKING = State.ACTIVE, State.IDLE, State.STOPPING, State.STOPPED, State.WAKING


def core_with(
    sid: str = "sbx-1", period: float = 10.0, activity: Activity = Activity.BYTES, now: float = 0.0
) -> TimerCore:
    core = TimerCore()
    core.register(SandboxConfig(sid, "inc-1", period, activity, registered_at=now), now)
    return core


def besides_meters(state: SandboxState) -> dict[str, object]:
    """What a report or a forgotten source may change only with an event (a store writes the rest alone)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in METER_FIELDS}


def moves(events: list[Event]) -> list[tuple[str, State | None, State, Why]]:
    return [(e.sandbox, e.from_state, e.to_state, e.why) for e in events]


def report(
    core: TimerCore, now: float, *, n: int = 1, open_: int = 0, age: float = 0.0, sid: str = "sbx-1"
) -> list[Event]:
    return core.on_report(sid, n, n, open_, now - age, now)


def go_idle(core: TimerCore, sid: str = "sbx-1") -> float:
    at = core.next_timer()
    assert at is not None
    assert moves(core.on_timer(at)) == [(sid, ACTIVE, IDLE, Why.IDLE_TIMER)]
    return at


# -- idle timers and the activity policies ---------------------------------------------------------


def test_traffic_keeps_a_sandbox_active_past_its_period() -> None:
    core = core_with(period=10.0)
    for t in range(1, 61):
        assert report(core, float(t), age=0.4) == []
        assert core.on_timer(float(t) + 0.5) == []
    assert core.state_of("sbx-1") is ACTIVE


def test_idle_exactly_at_the_period_after_the_last_byte_and_once() -> None:
    core = core_with(period=10.0)
    report(core, 3.5, age=0.5)  # the last byte at 3.0
    assert core.next_timer() == 13.0
    assert core.on_timer(12.999) == []
    assert core.state_of("sbx-1") is ACTIVE
    (ev,) = core.on_timer(13.0)
    assert (ev.from_state, ev.to_state, ev.why, ev.at) == (ACTIVE, IDLE, Why.IDLE_TIMER, 13.0)
    assert core.next_timer() is None
    assert core.on_timer(1000.0) == []


def test_a_silent_new_sandbox_goes_idle_one_period_after_registration() -> None:
    core = core_with(period=30.0, now=100.0)
    assert core.next_timer() == 130.0
    assert core.on_timer(129.9) == []
    assert len(core.on_timer(130.0)) == 1


def test_a_byte_every_few_seconds_keeps_it_alive_then_silence_idles_it() -> None:
    core = core_with(period=5.0)
    t = 0.0
    while t < 100.0:
        t += 4.0
        report(core, t + 1.0, age=1.0)  # the byte at t, reported one interval later
        assert core.on_timer(t + 1.0) == []
    assert core.next_timer() == t + 5.0
    assert core.on_timer(t + 4.99) == []
    assert len(core.on_timer(t + 5.0)) == 1


def test_reports_without_bytes_do_not_reset_the_timer_under_bytes() -> None:
    core = core_with(period=10.0)
    report(core, 1.0)
    for t in (2.0, 5.0, 9.0):
        core.on_report("sbx-1", 0, 0, 1, t, t)  # an open, silent connection
    assert core.next_timer() == 11.0
    assert len(core.on_timer(11.0)) == 1
    assert core.status_of("sbx-1", 11.0).open_connections == 1


def test_open_silent_connection_keeps_it_active_only_under_connections() -> None:
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    report(core, 1.0, open_=1)  # a byte at 1.0, and the connection stays open, silent (never reported again)
    assert core.next_timer() is None
    assert core.on_timer(10_000.0) == []
    assert core.status_of("sbx-1", 10_000.0).idle_in_s is None
    # The last connection closes; the feed has no close time, so its receive time counts.
    assert core.on_report("sbx-1", 0, 0, 0, 1.0, 10_000.5) == []
    assert core.next_timer() == 10_010.5
    assert len(core.on_timer(10_010.5)) == 1


def test_open_counts_are_kept_per_source_and_summed() -> None:
    """Two forwarder workers (two sources) each carry a connection to one sandbox: one closing leaves the
    other's count, and it stays active until both have closed."""
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    assert core.on_report("sbx-1", 5, 5, 1, 1.0, 1.0, "fwd#0") == []
    assert core.on_report("sbx-1", 5, 5, 2, 1.5, 1.5, "fwd#1") == []
    assert (core.snapshot("sbx-1").open_by, core.status_of("sbx-1", 2.0).open_connections) == (
        {"fwd#0": 1, "fwd#1": 2}, 3)
    assert core.on_report("sbx-1", 0, 0, 0, 1.0, 50.0, "fwd#0") == []  # fwd#0's one closed
    assert core.snapshot("sbx-1").open_by == {"fwd#1": 2}
    assert core.next_timer() is None and core.on_timer(1000.0) == []
    assert core.on_report("sbx-1", 0, 0, 2, 1.5, 1000.0, "fwd#1") == []  # still two (a report about bytes)
    assert core.next_timer() is None
    assert core.on_report("sbx-1", 0, 0, 0, 1.5, 1001.0, "fwd#1") == []
    st = core.snapshot("sbx-1")
    assert (st.open_by, st.open_connections, st.last_activity) == ({}, 0, 1001.0)
    assert core.next_timer() == 1011.0
    assert moves(core.on_timer(1011.0)) == [("sbx-1", ACTIVE, IDLE, Why.IDLE_TIMER)]


def test_forget_source_drops_its_counts_and_the_period_runs_from_then() -> None:
    core = core_with("sbx-1", period=10.0, activity=Activity.CONNECTIONS)
    core.register(SandboxConfig("sbx-2", "inc-1", 20.0, Activity.CONNECTIONS), 0.0)
    core.register(SandboxConfig("sbx-3", "inc-1", 5.0), 0.0)  # bytes: counts do not keep it active
    for sid in ("sbx-1", "sbx-2", "sbx-3"):
        core.on_report(sid, 1, 1, 1, 2.0, 2.0, "fwd#0")
    core.on_report("sbx-1", 0, 0, 1, 2.0, 3.0, "fwd#1")
    assert core.holding("fwd#0") == ["sbx-1", "sbx-2", "sbx-3"] and core.holding("fwd#1") == ["sbx-1"]
    assert core.next_timer() == 7.0  # sbx-3's byte at 2.0
    assert moves(core.on_timer(7.0)) == [("sbx-3", ACTIVE, IDLE, Why.IDLE_TIMER)]
    assert core.forget_source("fwd#0", 40.0) == []  # fwd#0 died with its connections open
    assert core.holding("fwd#0") == [] and core.holding("fwd#1") == ["sbx-1"]
    assert core.snapshot("sbx-1").open_by == {"fwd#1": 1}  # fwd#1's connection keeps sbx-1 active
    assert core.snapshot("sbx-2").last_activity == 40.0 and core.next_timer() == 60.0
    s3 = core.snapshot("sbx-3")  # idle, bytes policy: only its count changed, not its state or activity
    assert (s3.state, s3.open_by, s3.last_activity) == (IDLE, {}, 2.0)
    assert core.forget_source("fwd#0", 41.0) == [] and core.forget_source("nobody", 41.0) == []
    assert core.forget_source("fwd#1", 45.0) == []
    assert core.next_timer() == 55.0  # sbx-1: its period from the forgetting
    assert [e.sandbox for e in core.on_timer(60.0)] == ["sbx-1", "sbx-2"]


def test_forget_source_keeps_a_later_activity_and_wakes_nothing() -> None:
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    core.on_report("sbx-1", 1, 1, 1, 30.0, 30.0, "fwd#0")
    core.forget_source("fwd#0", 25.0)  # a clock behind the last activity: the later one stands
    assert core.snapshot("sbx-1").last_activity == 30.0 and core.next_timer() == 40.0
    go_idle(core)
    core.register(SandboxConfig("sbx-1", "inc-1", 10.0, Activity.BYTES), 41.0)
    core.on_report("sbx-1", 0, 0, 1, 41.0, 41.0, "fwd#0")  # under bytes: counted, no activity
    core.register(SandboxConfig("sbx-1", "inc-1", 10.0, Activity.CONNECTIONS), 42.0)
    assert core.forget_source("fwd#0", 50.0) == []
    assert core.state_of("sbx-1") is IDLE and core.snapshot("sbx-1").last_activity == 30.0


def test_a_stop_a_new_incarnation_and_a_removal_clear_the_index() -> None:
    core = core_with("sbx-1", period=10.0, activity=Activity.CONNECTIONS)
    core.register(SandboxConfig("sbx-2", "inc-1", 10.0, Activity.CONNECTIONS), 0.0)
    core.register(SandboxConfig("sbx-3", "inc-1", 10.0, Activity.CONNECTIONS), 0.0)
    for sid in ("sbx-1", "sbx-2", "sbx-3"):
        core.on_report(sid, 0, 0, 2, 1.0, 1.0, "fwd#0")
    core.driver_stopped("sbx-1", 2.0)
    core.register(SandboxConfig("sbx-2", "inc-2", 10.0, Activity.CONNECTIONS), 2.0)
    assert core.holding("fwd#0") == ["sbx-3"]
    assert core.snapshot("sbx-1").open_by == {} and core.snapshot("sbx-2").open_by == {}
    assert core.remove("sbx-3") and core.holding("fwd#0") == []
    assert core.forget_source("fwd#0", 3.0) == []


def test_restore_rebuilds_the_index_and_a_restored_row_replaces_it() -> None:
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    core.on_report("sbx-1", 0, 0, 1, 1.0, 1.0, "fwd#0")
    core.on_report("sbx-1", 0, 0, 3, 1.0, 1.0, "fwd#1")
    again = TimerCore()
    again.restore(core.config("sbx-1"), core.snapshot("sbx-1"))
    assert (again.holding("fwd#0"), again.holding("fwd#1")) == (["sbx-1"], ["sbx-1"])
    other = core.snapshot("sbx-1")  # another replica's write: fwd#0 forgotten there
    del other.open_by["fwd#0"]
    other.open_connections = 3
    again.restore(core.config("sbx-1"), other)
    assert (again.holding("fwd#0"), again.holding("fwd#1")) == ([], ["sbx-1"])
    assert again.status_of("sbx-1", 2.0).open_connections == 3


def test_the_stored_version_is_kept_until_a_change_and_set_again_by_mark_stored() -> None:
    """A store compares versions instead of rows (``stored_version``): every call that can change a
    sandbox forgets its version, and what only reads keeps it."""
    cfg = SandboxConfig("sbx-1", "inc-1", 10.0, Activity.CONNECTIONS, registered_at=0.0)
    states = {
        "active": SandboxState(0.0, ACTIVE, 0.0, open_connections=1, open_by={"fwd#0": 1}),
        "idle": SandboxState(0.0, IDLE),
        "waking": SandboxState(0.0, WAKING, wake_from=IDLE),
    }
    changes = [
        ("active", lambda c: c.on_report("sbx-1", 1, 0, 1, 1.0, 1.0, "fwd#0")),
        ("active", lambda c: c.on_report("sbx-1", 0, 0, 0, 1.0, 1.0, "fwd#0")),
        ("active", lambda c: c.forget_source("fwd#0", 1.0)),
        ("active", lambda c: c.hold("sbx-1", 5.0, 1.0)),
        ("idle", lambda c: c.wake("sbx-1", 1.0)),
        ("idle", lambda c: c.driver_stopping("sbx-1", 1.0)),
        ("active", lambda c: c.driver_stopped("sbx-1", 1.0)),
        ("waking", lambda c: c.driver_ready("sbx-1", 1.0)),
        ("waking", lambda c: c.driver_failed("sbx-1", 1.0)),
        ("active", lambda c: c.register(dataclasses.replace(cfg, idle_period_s=20.0), 1.0)),
    ]
    for kind, change in changes:
        core = TimerCore()
        core.restore(cfg, states[kind], stored=7)
        assert core.stored_version("sbx-1") == 7
        change(core)
        assert core.stored_version("sbx-1") is None, change
        core.mark_stored(["sbx-1", "nope"], 8)
        assert core.stored_version("sbx-1") == 8 and core.stored_version("nope") is None
    core = TimerCore()
    core.restore(dataclasses.replace(cfg, activity=Activity.BYTES), SandboxState(0.0), stored=7)
    assert core.on_timer(9.0) == [] and core.stored_version("sbx-1") == 7  # not due yet
    assert moves(core.on_timer(10.0)) == [("sbx-1", ACTIVE, IDLE, Why.IDLE_TIMER)]
    assert core.stored_version("sbx-1") is None
    core.restore(cfg, states["active"], stored=7)
    core.snapshot("sbx-1"), core.status(1.0), core.next_timer(), core.due(1.0), core.holding("fwd#0")
    assert core.on_report("nope", 1, 1, 0, 1.0, 1.0) == []
    assert core.on_report("sbx-1", 1, 1, 0, -1.0, 1.0) == []  # before this incarnation: dropped
    assert core.stored_version("sbx-1") == 7 and core.snapshot("sbx-1").bytes_in == 0
    assert core.remove("sbx-1") and core.stored_version("sbx-1") is None


def test_counts_changed_says_whether_the_open_counts_moved_since_restore_or_mark_stored() -> None:
    cfg = SandboxConfig("sbx-1", "inc-1", 10.0, Activity.CONNECTIONS, registered_at=0.0)
    core = TimerCore()
    core.restore(cfg, SandboxState(0.0, ACTIVE, 0.0, open_connections=1, open_by={"fwd#0": 1}), stored=3)
    assert not core.counts_changed("sbx-1")
    core.on_report("sbx-1", 5, 5, 1, 1.0, 1.0, "fwd#0")  # the same count: bytes only
    assert not core.counts_changed("sbx-1") and core.stored_version("sbx-1") is None
    for change in (
        lambda: core.on_report("sbx-1", 0, 0, 2, 2.0, 2.0, "fwd#0"),
        lambda: core.on_report("sbx-1", 0, 0, 1, 2.0, 2.0, "fwd#1"),
        lambda: core.on_report("sbx-1", 0, 0, 0, 2.0, 2.0, "fwd#1"),
        lambda: core.forget_source("fwd#0", 3.0),
        lambda: core.driver_stopped("sbx-1", 4.0),
    ):
        core.mark_stored(["sbx-1"], 4)
        assert not core.counts_changed("sbx-1")
        change()
        assert core.counts_changed("sbx-1"), change
    core.restore(cfg, core.snapshot("sbx-1"))
    assert not core.counts_changed("sbx-1")
    with pytest.raises(UnknownSandbox):
        core.counts_changed("nope")


def test_rows_to_write_parts_the_sandboxes_as_state_and_counts_changed_say() -> None:
    core = TimerCore()
    for i in range(6):
        core.restore(SandboxConfig(f"sbx-{i}", "inc-1", 10.0, registered_at=0.0), SandboxState(0.0, ACTIVE, 0.0), 1)
    core.on_report("sbx-1", 5, 5, 2, 1.0, 1.0, "fwd#0")  # open counts moved
    core.on_report("sbx-2", 5, 5, 0, 1.0, 1.0, "fwd#0")  # bytes only
    core.on_report("sbx-4", 0, 0, 1, 1.0, 1.0, "fwd#0")
    order = ["sbx-4", "nope", "sbx-0", "sbx-1", "sbx-2", "sbx-3", "sbx-5"]
    present, whole, counted, traffic = core.rows_to_write(order, {"sbx-3", "sbx-1"})
    assert present == [sid for sid in order if sid in core]
    assert list(whole) == ["sbx-1", "sbx-3"] and list(counted) == ["sbx-4"]
    assert list(traffic) == ["sbx-0", "sbx-2", "sbx-5"]
    for part in (whole, counted, traffic):
        assert all(st is core.state(sid) for sid, st in part.items())  # the core's own, not copies
    assert all(core.counts_changed(sid) for sid in counted) and not any(core.counts_changed(s) for s in traffic)


def test_not_stored_at_names_the_sandboxes_whose_stored_version_is_not_the_given_one() -> None:
    core = TimerCore()
    for i in range(4):
        core.restore(SandboxConfig(f"sbx-{i}", "inc-1", 10.0, registered_at=0.0), SandboxState(0.0, ACTIVE, 0.0), 5)
    core.on_report("sbx-2", 1, 1, 0, 1.0, 1.0)  # changed since: its stored version is unknown
    versions = {"sbx-0": 5, "sbx-1": 6, "sbx-2": 5, "nope": 5}  # sbx-3: not in the store's answer
    order = ["nope", "sbx-3", "sbx-2", "sbx-1", "sbx-0"]
    expected = [s for s in order if core.stored_version(s) is None or versions.get(s) != core.stored_version(s)]
    assert core.not_stored_at(order, versions) == expected == ["nope", "sbx-3", "sbx-2", "sbx-1"]


def test_connections_policy_open_report_wakes_an_idle_sandbox() -> None:
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    go_idle(core)
    assert moves(core.on_report("sbx-1", 0, 0, 1, 20.0, 20.0)) == [("sbx-1", IDLE, ACTIVE, Why.TRAFFIC)]
    core_b = core_with(period=10.0)  # the same report under "bytes" changes nothing
    go_idle(core_b)
    assert core_b.on_report("sbx-1", 0, 0, 1, 20.0, 20.0) == []


def test_traffic_while_idle_or_stopped_or_waking_goes_back_to_active() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    assert moves(report(core, 11.0)) == [("sbx-1", IDLE, ACTIVE, Why.TRAFFIC)]
    assert core.next_timer() == 21.0
    go_idle(core)
    core.driver_stopping("sbx-1", 22.0)
    core.driver_stopped("sbx-1", 23.0)
    assert moves(report(core, 24.0)) == [("sbx-1", STOPPED, ACTIVE, Why.TRAFFIC)]
    go_idle(core)
    core.driver_stopped("sbx-1", 35.0)
    core.wake("sbx-1", 36.0)
    assert moves(report(core, 37.0)) == [("sbx-1", WAKING, ACTIVE, Why.TRAFFIC)]
    assert core.driver_ready("sbx-1", 38.0) == []  # already active


def test_a_report_from_before_the_stop_changes_no_state_but_its_bytes_count() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    core.driver_stopped("sbx-1", 12.0)
    assert report(core, 30.0, n=7, age=19.0) == []  # last activity 11.0: the stopped run's
    s = core.status_of("sbx-1", 30.0)
    assert (s.state, s.bytes_in, s.bytes_out) == (STOPPED, 7, 7)
    assert core.on_report("sbx-1", 0, 0, 2, 11.5, 30.5) == []  # its connections died with it
    assert core.status_of("sbx-1", 30.5).open_connections == 0
    core.wake("sbx-1", 31.0)
    assert report(core, 32.0, n=1, age=21.0) == []  # not ready: an old report does not say it runs
    assert core.state_of("sbx-1") is WAKING


def test_becoming_active_restarts_the_period_even_if_the_last_byte_is_old() -> None:
    core = core_with(period=10.0)
    report(core, 5.0)
    go_idle(core)
    core.driver_stopped("sbx-1", 16.0)
    core.wake("sbx-1", 100.0)
    core.driver_ready("sbx-1", 103.0)
    assert core.next_timer() == 113.0


# -- holds ------------------------------------------------------------------------------------


def test_hold_keeps_active_then_idle_one_period_after_it_ends() -> None:
    core = core_with(period=10.0)
    h = core.hold("sbx-1", 30.0, 0.0)
    assert (h.hold_until, h.events) == (30.0, [])
    assert core.next_timer() == 40.0
    assert core.on_timer(39.99) == []
    assert core.status_of("sbx-1", 20.0).hold_until == 30.0
    assert core.status_of("sbx-1", 31.0).hold_until is None  # expired on its own
    assert len(core.on_timer(40.0)) == 1


def test_hold_is_extend_only() -> None:
    core = core_with(period=10.0)
    assert core.hold("sbx-1", 100.0, 0.0).hold_until == 100.0
    assert core.hold("sbx-1", 50.0, 10.0).hold_until == 100.0
    assert core.next_timer() == 110.0
    assert core.hold("sbx-1", 100.0, 10.0).hold_until == 110.0
    assert core.next_timer() == 120.0


def test_activity_after_the_hold_end_runs_the_period_from_the_activity() -> None:
    core = core_with(period=10.0)
    core.hold("sbx-1", 30.0, 0.0)
    report(core, 35.0)
    assert core.next_timer() == 45.0
    report(core, 20.0)  # activity during the hold: the hold's end is later
    assert core.next_timer() == 45.0


def test_hold_on_idle_or_stopping_goes_active_on_stopped_waits() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    assert moves(core.hold("sbx-1", 5.0, 11.0).events) == [("sbx-1", IDLE, ACTIVE, Why.HOLD)]
    go_idle(core)
    core.driver_stopping("sbx-1", 27.0)
    assert moves(core.hold("sbx-1", 5.0, 28.0).events) == [("sbx-1", STOPPING, ACTIVE, Why.HOLD)]
    go_idle(core)
    core.driver_stopped("sbx-1", 44.0)
    assert core.hold("sbx-1", 100.0, 45.0).events == []  # a hold does not start a sandbox
    assert core.state_of("sbx-1") is STOPPED
    core.wake("sbx-1", 46.0)
    core.driver_ready("sbx-1", 50.0)
    assert core.next_timer() == 155.0  # the hold counts once it runs


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.inf, math.nan])
def test_hold_refuses_a_ttl_that_is_not_positive_and_finite(ttl: float) -> None:
    with pytest.raises(LocalProtocolError) as e:
        core_with().hold("sbx-1", ttl, 0.0)
    assert e.value.reason == "bad_hold"


# -- incarnations and the registry ------------------------------------------------------------


def test_a_new_incarnation_resets_meters_state_and_hold_and_drops_older_reports() -> None:
    core = core_with(period=10.0)
    report(core, 1.0, n=100)
    core.hold("sbx-1", 500.0, 1.0)
    core.on_timer(600.0)
    evs = core.register(SandboxConfig("sbx-1", "inc-2", 10.0, registered_at=700.0), 700.0)
    assert [e.to_json() for e in evs] == [
        {"sandbox": "sbx-1", "incarnation": "inc-2", "from": "idle", "to": "active", "at": 700.0, "why": "registered"}
    ]
    s = core.status_of("sbx-1", 700.0)
    assert (s.state, s.bytes_in, s.bytes_out, s.hold_until, s.last_activity) == (ACTIVE, 0, 0, None, None)
    assert core.on_report("sbx-1", 5, 5, 0, 699.9, 701.0) == []  # about inc-1
    assert core.counters["report_stale_incarnation"] == 1
    assert core.status_of("sbx-1", 701.0).bytes_in == 0
    core.on_report("sbx-1", 5, 6, 0, 700.0, 701.0)
    assert (core.status_of("sbx-1", 701.0).bytes_in, core.status_of("sbx-1", 701.0).bytes_out) == (5, 6)
    assert core.next_timer() == 710.0  # inc-1's timer entry is gone


def test_first_registration_event_has_no_from_state() -> None:
    core = TimerCore()
    (ev,) = core.register(SandboxConfig("s", "i", 1.0), 5.0)
    assert ev.to_json() == {
        "sandbox": "s",
        "incarnation": "i",
        "from": None,
        "to": "active",
        "at": 5.0,
        "why": "registered",
    }


def test_same_incarnation_updates_period_and_policy_keeping_state() -> None:
    core = core_with(period=100.0)
    report(core, 10.0, n=3)
    assert core.register(SandboxConfig("sbx-1", "inc-1", 5.0, registered_at=50.0), 50.0) == []
    assert core.next_timer() == 15.0  # earlier now
    assert core.config("sbx-1").registered_at == 0.0  # the incarnation's start stays
    assert core.status_of("sbx-1", 12.0).bytes_in == 3
    report(core, 12.0, open_=1)
    core.register(SandboxConfig("sbx-1", "inc-1", 5.0, Activity.CONNECTIONS), 13.0)
    assert core.next_timer() is None


def test_unknown_sandbox_reports_are_counted_and_calls_refused() -> None:
    core = core_with()
    assert core.on_report("nope", 1, 1, 0, 1.0, 1.0) == []
    assert core.counters["report_unknown_sandbox"] == 1
    for call in (core.wake, core.driver_stopping, core.driver_stopped, core.driver_ready, core.driver_failed):
        with pytest.raises(UnknownSandbox):
            call("nope", 1.0)
    assert core.remove("sbx-1") and not core.remove("sbx-1")
    assert core.next_timer() is None and core.on_timer(1e9) == []


def test_config_refuses_a_bad_period() -> None:
    for period in (0.0, -5.0, math.inf, math.nan):
        with pytest.raises(LocalProtocolError):
            SandboxConfig("s", "i", period)
    assert SandboxConfig("s", "i", 1.0, "connections").activity is Activity.CONNECTIONS  # type: ignore[arg-type]


def test_snapshot_and_restore_give_the_same_timers_and_status() -> None:
    core = core_with(period=10.0)
    report(core, 3.0, n=9)
    core.hold("sbx-1", 20.0, 4.0)
    again = TimerCore()
    again.restore(core.config("sbx-1"), core.snapshot("sbx-1"))
    assert again.status(5.0) == core.status(5.0)
    assert again.next_timer() == core.next_timer() == 34.0


# -- wake and the driver ----------------------------------------------------------------------


def test_fifty_wakes_ask_the_driver_once() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    core.driver_stopping("sbx-1", 11.0)
    core.driver_stopped("sbx-1", 12.0)
    outcomes = [core.wake("sbx-1", 20.0 + i / 100) for i in range(50)]
    assert sum(o.start_driver for o in outcomes) == 1
    assert [moves(o.events) for o in outcomes if o.events] == [[("sbx-1", STOPPED, WAKING, Why.WAKE)]]
    assert moves(core.driver_ready("sbx-1", 21.0)) == [("sbx-1", WAKING, ACTIVE, Why.DRIVER)]
    assert core.wake("sbx-1", 21.5) == ([], False)  # active: nothing to do


def test_wake_from_idle_asks_the_driver_too() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    events, start = core.wake("sbx-1", 11.0)
    assert start and moves(events) == [("sbx-1", IDLE, WAKING, Why.WAKE)]


def test_driver_failure_returns_to_where_the_wake_came_from() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    core.wake("sbx-1", 11.0)
    assert moves(core.driver_failed("sbx-1", 12.0)) == [("sbx-1", WAKING, IDLE, Why.DRIVER)]
    core.driver_stopped("sbx-1", 13.0)
    core.wake("sbx-1", 14.0)
    assert moves(core.driver_failed("sbx-1", 15.0)) == [("sbx-1", WAKING, STOPPED, Why.DRIVER)]
    assert core.wake("sbx-1", 16.0).start_driver  # the next wake asks again
    # A stop that completes while waking from idle: a failed start then leaves it stopped.
    core2 = core_with(period=10.0)
    go_idle(core2)
    core2.wake("sbx-1", 11.0)
    assert core2.driver_stopped("sbx-1", 11.5) == ([], False)
    assert moves(core2.driver_failed("sbx-1", 12.0)) == [("sbx-1", WAKING, STOPPED, Why.DRIVER)]


def test_stop_fence_wake_or_traffic_while_stopping_goes_back_to_active() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    events, proceed = core.driver_stopping("sbx-1", 11.0)
    assert proceed and moves(events) == [("sbx-1", IDLE, STOPPING, Why.DRIVER)]
    events, start = core.wake("sbx-1", 12.0)
    assert not start and moves(events) == [("sbx-1", STOPPING, ACTIVE, Why.WAKE)]
    assert core.next_timer() == 22.0
    go_idle(core)
    core.driver_stopping("sbx-1", 23.0)
    assert moves(report(core, 24.0)) == [("sbx-1", STOPPING, ACTIVE, Why.TRAFFIC)]
    # The driver asks again while it is active: refused, the fence holds.
    assert core.driver_stopping("sbx-1", 25.0) == ([], False)
    assert core.state_of("sbx-1") is ACTIVE


def test_stop_that_went_through_despite_the_fence_is_undone_by_a_start() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    core.driver_stopping("sbx-1", 11.0)
    core.wake("sbx-1", 12.0)
    events, start = core.driver_stopped("sbx-1", 13.0)
    assert start
    assert moves(events) == [("sbx-1", ACTIVE, STOPPED, Why.DRIVER), ("sbx-1", STOPPED, WAKING, Why.WAKE)]
    # Without a fence, the platform's word wins and nothing is restarted.
    core2 = core_with(period=10.0)
    events, start = core2.driver_stopped("sbx-1", 1.0)
    assert not start and moves(events) == [("sbx-1", ACTIVE, STOPPED, Why.DRIVER)]


def test_driver_stopping_from_stopped_or_waking() -> None:
    core = core_with(period=10.0)
    go_idle(core)
    core.driver_stopped("sbx-1", 11.0)
    assert core.driver_stopping("sbx-1", 12.0) == ([], True)
    core.wake("sbx-1", 13.0)
    assert core.driver_stopping("sbx-1", 14.0) == ([], False)


def test_stopped_clears_open_connections() -> None:
    core = core_with(period=10.0, activity=Activity.CONNECTIONS)
    report(core, 1.0, open_=3)
    core.driver_stopped("sbx-1", 2.0)
    assert core.status_of("sbx-1", 2.0).open_connections == 0
    core.wake("sbx-1", 3.0)
    core.driver_ready("sbx-1", 4.0)
    assert core.next_timer() == 14.0


def test_a_full_cycle_is_a_chain_of_single_events() -> None:
    core = core_with(period=10.0)
    trail: list[Event] = []
    trail += core.on_timer(10.0)
    trail += core.driver_stopping("sbx-1", 11.0).events
    trail += core.driver_stopped("sbx-1", 12.0).events
    for i in range(5):
        trail += core.wake("sbx-1", 13.0 + i).events
    trail += core.driver_ready("sbx-1", 20.0)
    trail += report(core, 21.0)
    trail += core.on_timer(31.0)
    assert [(e.from_state, e.to_state) for e in trail] == [
        (ACTIVE, IDLE),
        (IDLE, STOPPING),
        (STOPPING, STOPPED),
        (STOPPED, WAKING),
        (WAKING, ACTIVE),
        (ACTIVE, IDLE),
    ]
    assert all(a.to_state == b.from_state for a, b in itertools.pairwise(trail))


def test_status_rows_and_json_shape() -> None:
    core = core_with(period=10.0)
    core.register(SandboxConfig("sbx-0", "x", 5.0), 0.0)
    report(core, 2.0, n=4, open_=1)
    rows = core.status(4.0)
    assert [r.sandbox for r in rows] == ["sbx-0", "sbx-1"]
    assert rows[1].to_json() == {
        "sandbox": "sbx-1",
        "incarnation": "inc-1",
        "state": "active",
        "last_activity": 2.0,
        "bytes_in": 4,
        "bytes_out": 4,
        "open_connections": 1,
        "hold_until": None,
        "idle_in_s": 8.0,
        "idle_blocked": None,
    }
    core.on_timer(100.0)
    assert core.status_of("sbx-1", 100.0).idle_in_s is None


def test_the_transition_table_matches_the_documented_diagram() -> None:
    targets = {(s, i): t for (s, i), t in TRANSITIONS.items()}
    assert targets[(ACTIVE, Input.TIMER)] is IDLE
    assert {s for (s, i) in targets if i is Input.WAKE} == {IDLE, STOPPED, STOPPING}
    assert all(t is ACTIVE for (s, i), t in targets.items() if i is Input.TRAFFIC)
    assert (ACTIVE, Input.TRAFFIC) not in targets and (WAKING, Input.WAKE) not in targets


# -- the heap ---------------------------------------------------------------------------------


def test_next_timer_is_exact_as_deadlines_move_both_ways() -> None:
    core = TimerCore()
    for i in range(20):
        core.register(SandboxConfig(f"s{i}", "i", 100.0 + i), 0.0)
    assert core.next_timer() == 100.0
    report(core, 50.0, sid="s0")
    assert core.next_timer() == 101.0
    core.register(SandboxConfig("s7", "i", 3.0), 1.0)  # earlier
    assert core.next_timer() == 3.0
    core.remove("s7")
    assert core.next_timer() == 101.0
    for _ in range(5000):  # many earlier-moving deadlines: the heap stays bounded
        core.register(SandboxConfig("s3", "i", 200.0), 0.0)
        core.register(SandboxConfig("s3", "i", 199.0), 0.0)
    assert len(core._heap) < 2 * len(core) + 1100
    assert core.next_timer() == 101.0


def test_one_hundred_thousand_sandboxes() -> None:
    """A sanity check of the heap's cost, not a speed assertion."""
    n = 100_000
    core = TimerCore()
    t0 = time.perf_counter()
    for i in range(n):
        core.register(SandboxConfig(f"s{i}", "i", 300.0), 0.0)
    for i in range(n):
        core.on_report(f"s{i}", 10, 10, 0, float(i % 100), 100.0)
    assert core.next_timer() == 300.0
    assert core.on_timer(299.5) == []
    first = core.on_timer(349.5)  # last activity 0..49
    assert len(first) == n // 2 and core.next_timer() == 350.0
    events = first + core.on_timer(400.0)
    assert len(events) == n and core.next_timer() is None
    assert len({e.sandbox for e in events}) == n
    assert time.perf_counter() - t0 < 30.0  # only catches a quadratic blow-up


# -- the stateful test against a reference model ------------------------------------------------


@dataclass
class Model:
    """One sandbox, the rules of docs/scheduler-api.md written out plainly."""

    incarnation: str
    period: float
    policy: Activity
    start: float
    active_since: float
    state: State = ACTIVE
    last: float | None = None
    hold: float | None = None
    open_by: dict[str, int] = dataclasses.field(default_factory=dict)  # source -> count, no zeros
    bytes_in: int = 0
    bytes_out: int = 0
    stopped_at: float | None = None
    wake_from: State | None = None
    fenced: bool = False

    @property
    def open(self) -> int:
        return sum(self.open_by.values())

    def deadline(self) -> float | None:
        if self.state is not ACTIVE or (self.policy is Activity.CONNECTIONS and self.open > 0):
            return None
        base = self.active_since
        for t in (self.last, self.hold):
            if t is not None and t > base:
                base = t
        return base + self.period


SIDS = ("a", "b", "c")
SOURCES = ("", "fwd#0", "fwd#1")  # "": a caller that names no source
TICKS = st.integers(0, 80).map(lambda q: q / 4)  # a quarter-second grid: exact deadlines get hit


class TimerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = TimerCore()
        self.models: dict[str, Model] = {}
        self.now = 0.0
        self.inc = 0

    # The model's transitions: each returns the (sandbox, from, to, why) it produced.
    def go(self, sid: str, to: State, why: Why) -> tuple[str, State | None, State, Why]:
        m = self.models[sid]
        frm = m.state
        if to is ACTIVE:
            m.active_since = self.now
            m.fenced = m.fenced or frm is STOPPING
        if to is WAKING:
            m.wake_from = frm
        if frm is WAKING:
            m.wake_from = None
        if to is IDLE:
            m.fenced = False
        if to is STOPPED:
            m.stopped_at, m.open_by, m.fenced = self.now, {}, False
        m.state = to
        return (sid, frm, to, why)

    def check(self, events: list[Event], expected: list[tuple[str, State | None, State, Why]]) -> None:
        assert moves(events) == expected
        assert all(e.at == self.now for e in events)

    @rule(dt=TICKS)
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def advance_to_the_next_timer(self) -> None:
        at = self.core.next_timer()
        if at is not None and at > self.now:
            self.now = at

    @rule(sid=st.sampled_from(SIDS), period=st.integers(1, 40).map(lambda q: q / 4), policy=st.sampled_from(Activity))
    def register_new(self, sid: str, period: float, policy: Activity) -> None:
        self.inc += 1
        old = self.models.get(sid)
        events = self.core.register(SandboxConfig(sid, f"i{self.inc}", period, policy, self.now), self.now)
        self.models[sid] = Model(f"i{self.inc}", period, policy, self.now, self.now)
        self.check(events, [(sid, None if old is None else old.state, ACTIVE, Why.REGISTERED)])

    @precondition(lambda self: self.models)
    @rule(data=st.data(), period=st.integers(1, 40).map(lambda q: q / 4), policy=st.sampled_from(Activity))
    def register_same(self, data: st.DataObject, period: float, policy: Activity) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        assert self.core.register(SandboxConfig(sid, m.incarnation, period, policy, self.now), self.now) == []
        m.period, m.policy = period, policy

    @rule(sid=st.sampled_from(SIDS))
    def remove(self, sid: str) -> None:
        assert self.core.remove(sid) == (self.models.pop(sid, None) is not None)

    @rule(
        sid=st.sampled_from((*SIDS, "unknown")),
        b_in=st.integers(0, 3),
        b_out=st.integers(0, 3),
        open_=st.integers(0, 2),
        age=TICKS,
        source=st.sampled_from(SOURCES),
    )
    def report(self, sid: str, b_in: int, b_out: int, open_: int, age: float, source: str) -> None:
        last = self.now - age
        unknown = self.core.counters["report_unknown_sandbox"]
        stale = self.core.counters["report_stale_incarnation"]
        before = self.core.snapshot(sid) if sid in self.core else None
        events = self.core.on_report(sid, b_in, b_out, open_, last, self.now, source)
        if before is not None and not events:
            assert besides_meters(self.core.snapshot(sid)) == besides_meters(before)
        m = self.models.get(sid)
        if m is None:
            assert self.core.counters["report_unknown_sandbox"] == unknown + 1
            return self.check(events, [])
        if last < m.start:
            assert self.core.counters["report_stale_incarnation"] == stale + 1
            return self.check(events, [])
        m.bytes_in += b_in
        m.bytes_out += b_out
        expected = []
        if m.stopped_at is None or last > m.stopped_at:
            was = m.open_by.pop(source, 0)
            if open_:
                m.open_by[source] = open_
            times = [last] if b_in + b_out > 0 else []
            if m.policy is Activity.CONNECTIONS and (open_ > 0 or was > 0):
                times.append(self.now)
            if times:
                m.last = max([*times, *([m.last] if m.last is not None else [])])
                if m.state is not ACTIVE:
                    expected.append(self.go(sid, ACTIVE, Why.TRAFFIC))
        self.check(events, expected)

    @precondition(lambda self: self.models)
    @rule(
        data=st.data(),
        b=st.integers(0, 3),
        open_=st.integers(0, 3),
        age=st.sampled_from((0.0, 0.25, 1.0)),
        source=st.sampled_from(SOURCES),
    )
    def report_from_this_run(self, data: st.DataObject, b: int, open_: int, age: float, source: str) -> None:
        """A report about a registered sandbox's current incarnation (the plain ``report`` mostly names
        unknown sandboxes or earlier incarnations): where open counts are made."""
        sid = data.draw(st.sampled_from(sorted(self.models)))
        self.report(sid, b, b, open_, min(age, self.now - self.models[sid].start), source)

    @precondition(lambda self: any(m.stopped_at is not None for m in self.models.values()))
    @rule(data=st.data(), b=st.integers(0, 3), open_=st.integers(0, 2), where=st.sampled_from((0.0, 0.5, 1.0)))
    def report_about_the_stopped_run(self, data: st.DataObject, b: int, open_: int, where: float) -> None:
        """A late report whose activity lies between the incarnation's start and its last stop."""
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.models.items() if m.stopped_at is not None)))
        m = self.models[sid]
        assert m.stopped_at is not None
        last = m.start + (m.stopped_at - m.start) * where
        self.now += 0.25
        self.check(self.core.on_report(sid, b, b, open_, last, self.now, "fwd#0"), [])
        m.bytes_in += b
        m.bytes_out += b

    @precondition(lambda self: self.models)
    @rule(data=st.data(), ttl=st.integers(1, 80).map(lambda q: q / 4))
    def hold(self, data: st.DataObject, ttl: float) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        out = self.core.hold(sid, ttl, self.now)
        m.hold = self.now + ttl if m.hold is None else max(m.hold, self.now + ttl)
        assert out.hold_until == m.hold
        self.check(out.events, [self.go(sid, ACTIVE, Why.HOLD)] if m.state in (IDLE, STOPPING) else [])

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def wake(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        events, start = self.core.wake(sid, self.now)
        if m.state in (IDLE, STOPPED):
            self.check(events, [self.go(sid, WAKING, Why.WAKE)])
            assert start
        elif m.state is STOPPING:
            self.check(events, [self.go(sid, ACTIVE, Why.WAKE)])
            assert not start
        else:
            self.check(events, [])
            assert not start

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def driver_stopping(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        events, proceed = self.core.driver_stopping(sid, self.now)
        m.fenced = False
        self.check(events, [self.go(sid, STOPPING, Why.DRIVER)] if m.state is IDLE else [])
        assert proceed == (m.state in (STOPPING, STOPPED))

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def driver_stopped(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        events, start = self.core.driver_stopped(sid, self.now)
        restart = m.fenced and m.state is ACTIVE
        expected = []
        if m.state is WAKING:
            m.stopped_at, m.open_by, m.wake_from = self.now, {}, STOPPED
        elif m.state is STOPPED:
            m.stopped_at, m.open_by = self.now, {}
        else:
            expected.append(self.go(sid, STOPPED, Why.DRIVER))
            if restart:
                expected.append(self.go(sid, WAKING, Why.WAKE))
        self.check(events, expected)
        assert start == restart

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def driver_ready(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        ok = m.state in (WAKING, STOPPED, STOPPING)
        self.check(self.core.driver_ready(sid, self.now), [self.go(sid, ACTIVE, Why.DRIVER)] if ok else [])

    @precondition(lambda self: self.models)
    @rule(data=st.data())
    def driver_failed(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.models)))
        m = self.models[sid]
        expected = []
        if m.state is WAKING:
            assert m.wake_from in (IDLE, STOPPED)
            expected.append(self.go(sid, m.wake_from, Why.DRIVER))
        self.check(self.core.driver_failed(sid, self.now), expected)

    @rule(data=st.data())
    def forget_source(self, data: st.DataObject) -> None:
        """A source restarted or went silent: its counts go; an active sandbox under ``connections`` left
        with none runs its idle period from now. No state changes. (Mostly a source that holds counts:
        the one that holds none is the dull case; and mostly some time after the last report, as a
        silent source is forgotten.)"""
        held = sorted({s for m in self.models.values() for s in m.open_by})
        pick_held = bool(held) and data.draw(st.booleans())
        source = data.draw(st.sampled_from(held if pick_held else list(SOURCES)))
        self.now += data.draw(st.sampled_from((0.25, 1.0, 0.0)))
        before = {sid: besides_meters(self.core.snapshot(sid)) for sid in self.models}
        self.check(self.core.forget_source(source, self.now), [])
        assert {sid: besides_meters(self.core.snapshot(sid)) for sid in self.models} == before
        for m in self.models.values():
            if m.open_by.pop(source, 0) and m.open == 0 and m.policy is Activity.CONNECTIONS and m.state is ACTIVE:
                m.last = self.now if m.last is None else max(m.last, self.now)

    @precondition(lambda self: any(m.open_by for m in self.models.values()))
    @rule(data=st.data())
    def another_replica_changed_the_counts(self, data: st.DataObject) -> None:
        """A row another replica wrote, restored over this core's sandbox (``sync_core``): one source's
        count dropped there and another's set."""
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.models.items() if m.open_by)))
        m = self.models[sid]
        gone = data.draw(st.sampled_from(sorted(m.open_by)))
        came = data.draw(st.sampled_from(SOURCES))
        snap = self.core.snapshot(sid)
        for by in (snap.open_by, m.open_by):
            del by[gone]
            by[came] = by.get(came, 0) + 1
        snap.open_connections = sum(snap.open_by.values())
        self.core.restore(self.core.config(sid), snap)

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """What a store read does: every sandbox restored from its snapshot, into this core (over the
        sandbox it holds) or into a new one (a restart); the timers, status and index must not change."""
        if data.draw(st.booleans()):
            for sid in sorted(self.models):
                self.core.restore(self.core.config(sid), self.core.snapshot(sid))
        else:
            fresh = TimerCore()
            for sid in sorted(self.models):
                fresh.restore(self.core.config(sid), self.core.snapshot(sid))
            fresh.counters = self.core.counters
            self.core = fresh

    @rule()
    def on_timer(self) -> None:
        named = self.core.due(self.now)
        events = self.core.on_timer(self.now)
        assert named == sorted(e.sandbox for e in events)  # due() names exactly what on_timer takes idle
        due = []
        for sid, m in sorted(self.models.items()):
            d = m.deadline()
            if d is not None and d <= self.now:
                due.append(self.go(sid, IDLE, Why.IDLE_TIMER))
        self.check(sorted(events, key=lambda e: e.sandbox), due)

    @invariant()
    def next_timer_is_the_true_earliest_deadline(self) -> None:
        deadlines = [d for m in self.models.values() if (d := m.deadline()) is not None]
        true = min(deadlines) if deadlines else None
        # next_timer_before first, on the heap as the step left it (next_timer brings every entry up to date).
        for horizon in (self.now, *(() if true is None else (true - 1.0, true, true + 1.0))):
            got = self.core.next_timer_before(horizon)
            if true is None:
                assert got is None or got > horizon
            elif true <= horizon:
                assert got == true
            else:
                assert got is not None and horizon < got <= true
        assert self.core.next_timer() == true

    @invariant()
    def status_matches_the_model(self) -> None:
        rows = {r.sandbox: r for r in self.core.status(self.now)}
        assert rows.keys() == self.models.keys()
        for sid, m in self.models.items():
            r = rows[sid]
            d = m.deadline()
            hold = m.hold if m.hold is not None and m.hold > self.now else None
            assert (r.incarnation, r.state, r.bytes_in, r.bytes_out, r.open_connections) == (
                m.incarnation,
                m.state,
                m.bytes_in,
                m.bytes_out,
                m.open,
            )
            assert (r.last_activity, r.hold_until) == (m.last, hold)
            assert r.idle_in_s == (None if d is None else max(0.0, d - self.now))
            snap = self.core.snapshot(sid)
            assert (snap.open_by, snap.open_connections) == (m.open_by, m.open)

    @invariant()
    def the_counts_by_state_are_the_models(self) -> None:
        expected = {state.value: 0 for state in State}
        for m in self.models.values():
            expected[m.state.value] += 1
        assert self.core.state_counts() == expected

    @invariant()
    def the_source_index_names_exactly_the_sandboxes_holding_a_count(self) -> None:
        for source in SOURCES:
            assert self.core.holding(source) == sorted(s for s, m in self.models.items() if source in m.open_by)


TimerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_timer_machine = TimerMachine.TestCase


def test_due_names_only_what_is_due_and_changes_nothing() -> None:
    core = TimerCore()
    for i in range(50):
        core.register(SandboxConfig(f"s{i:02d}", "i", 10.0 + i), 0.0)
    assert core.due(9.9) == []
    assert core.due(12.0) == ["s00", "s01", "s02"]
    assert core.due(12.0) == ["s00", "s01", "s02"]  # a peek: nothing changed
    assert [e.sandbox for e in core.on_timer(12.0)] == ["s00", "s01", "s02"]
    assert core.due(12.0) == []


def test_snapshot_and_restore_copy_every_field() -> None:
    """Every field of SandboxState set away from its default survives restore then snapshot, and neither
    shares the object: a field added later and left out of the copy fails here."""
    values = {
        "active_since": 1.5, "state": WAKING, "last_activity": 2.5, "bytes_in": 3, "bytes_out": 4,
        "open_connections": 5, "open_by": {"fwd#0": 2, "fwd#1": 3}, "hold_until": 6.5, "stopped_at": 7.5,
        "wake_from": STOPPED, "fenced": True,
    }
    assert set(values) == {f.name for f in dataclasses.fields(SandboxState)}
    state = SandboxState(**values)  # type: ignore[arg-type]
    core = TimerCore()
    config = SandboxConfig("sbx-1", "inc-1", 10.0)
    core.restore(config, state)
    snap = core.snapshot("sbx-1")
    assert snap == state and snap is not state
    assert core.snapshot("sbx-1") is not snap
    state.bytes_in = 99  # the core kept a copy of its own
    state.open_by["fwd#0"] = 99
    snap.open_by["fwd#1"] = 99
    assert core.snapshot("sbx-1") == SandboxState(**{**values, "open_by": {"fwd#0": 2, "fwd#1": 3}})  # type: ignore[arg-type]
    assert core.has_state("sbx-1", core.snapshot("sbx-1")) and not core.has_state("sbx-1", snap)


# -- a batch's reports at once ------------------------------------------------------------------------

_IDS = ["s0", "s1", "s2"]
_history_step = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(_IDS), st.integers(0, 3), st.integers(0, 2),
              st.sampled_from([0.0, 0.5, 30.0]), st.sampled_from(SOURCES)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 5.0, 12.0])),
    st.tuples(st.just("timer")),
    st.tuples(st.sampled_from(["wake", "ready", "stopping", "stopped", "failed"]), st.sampled_from(_IDS)),
    st.tuples(st.just("hold"), st.sampled_from(_IDS), st.sampled_from([1.0, 20.0])),
    st.tuples(st.just("forget"), st.sampled_from(SOURCES)),
    st.tuples(st.just("reregister"), st.sampled_from(_IDS)),
)
_entry = st.tuples(st.sampled_from([*_IDS, "unknown"]), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2),
                   st.sampled_from([0.0, 0.25, 4.0, 8.0, 1e6]))


def _replay(history: list[tuple[Any, ...]], policies: list[Activity]) -> tuple[TimerCore, float]:
    core, now = TimerCore(), 100.0
    for sid, policy in zip(_IDS, policies, strict=True):
        core.register(SandboxConfig(sid, "inc-1", 10.0, policy, registered_at=now), now)
    for step in history:
        kind = step[0]
        if kind == "report":
            _, sid, b, n_open, age, source = step
            core.on_report(str(sid), int(b), int(b), int(n_open), now - float(age), now, str(source))
        elif kind == "advance":
            now += float(step[1])
        elif kind == "timer":
            core.on_timer(now)
        elif kind == "hold":
            core.hold(str(step[1]), float(step[2]), now)
        elif kind == "forget":
            core.forget_source(str(step[1]), now)
        elif kind == "reregister":
            core.register(SandboxConfig(str(step[1]), f"inc-{now}", 10.0, registered_at=now), now)
        else:
            call = {"wake": core.wake, "ready": core.driver_ready, "stopping": core.driver_stopping,
                    "stopped": core.driver_stopped, "failed": core.driver_failed}[str(kind)]
            call(str(step[1]), now)
    return core, now


def _same_as_each(
    history: list[tuple[Any, ...]], policies: list[Activity], batch: list[tuple[str, int, int, int, float]],
    source: str, marked: bool,
) -> None:
    """``on_reports(batch)`` on one core and ``on_report`` of each entry on its twin leave the two alike."""
    one, now = _replay(history, policies)
    each, _ = _replay(history, policies)
    if marked:  # the versions a store marked: the batch must forget those of the sandboxes it changed
        one.mark_stored(_IDS, 7)
        each.mark_stored(_IDS, 7)
    got = one.on_reports(batch, now, source)
    want: list[Event] = []
    for sid, b_in, b_out, n_open, idle_s in batch:
        want += each.on_report(sid, b_in, b_out, n_open, now - idle_s, now, source)
    assert got == want
    assert one.counters == each.counters
    assert one.status(now) == each.status(now)
    for sid in _IDS:
        assert one.snapshot(sid) == each.snapshot(sid)
        assert one.stored_version(sid) == each.stored_version(sid)
        assert one.counts_changed(sid) == each.counts_changed(sid)
    for s in SOURCES:
        assert one.holding(s) == each.holding(s)
    assert one.state_counts() == each.state_counts()
    for later in (0.0, 5.0, 11.0, 40.0):
        assert one.next_timer() == each.next_timer()
        assert one.on_timer(now + later) == each.on_timer(now + later)


@settings(max_examples=500, deadline=None)
@given(
    history=st.lists(_history_step, max_size=30),
    policies=st.lists(st.sampled_from(list(Activity)), min_size=len(_IDS), max_size=len(_IDS)),
    batch=st.lists(_entry, max_size=12, unique_by=lambda e: e[0]),
    source=st.sampled_from(SOURCES),
    marked=st.booleans(),
)
def test_on_reports_is_on_report_of_each_entry(
    history: list[tuple[Any, ...]], policies: list[Activity], batch: list[tuple[str, int, int, int, float]],
    source: str, marked: bool,
) -> None:
    _same_as_each(history, policies, batch, source, marked)


_C, _B = Activity.CONNECTIONS, Activity.BYTES


@pytest.mark.parametrize(("history", "batch"), [
    # connections policy, the same open count again a while later: activity now, not at the report's age
    ([("report", "s0", 0, 2, 0.0, "fwd#0"), ("advance", 5.0)], [("s0", 0, 0, 2, 4.0), ("s1", 1, 0, 0, 0.25)]),
    ([("report", "s0", 1, 1, 0.0, "fwd#0"), ("advance", 5.0)], [("s0", 3, 1, 1, 0.25)]),
    # a report from before the stop, about a sandbox active again: bytes only
    ([("advance", 12.0), ("timer",), ("stopping", "s0"), ("stopped", "s0"), ("advance", 0.5), ("ready", "s0"),
      ("advance", 5.0)], [("s0", 2, 2, 0, 8.0), ("s1", 2, 2, 0, 8.0)]),
    # before the incarnation began, and a count that moved
    ([("advance", 5.0), ("reregister", "s1")], [("s1", 1, 1, 0, 4.0), ("s2", 1, 1, 1, 0.0)]),
    # a sandbox whose heap entry was taken (idle, then active again by a hold)
    ([("advance", 12.0), ("timer",), ("hold", "s0", 1.0)], [("s0", 1, 1, 0, 0.0)]),
])
def test_on_reports_is_on_report_of_each_entry_in_these_cases(
    history: list[tuple[Any, ...]], batch: list[tuple[str, int, int, int, float]]
) -> None:
    for marked in (False, True):
        _same_as_each(history, [_C, _B, _C], batch, "fwd#0", marked)
