"""Metering with a fake clock: exact, exactly-once deltas per sandbox, exact totals, bounded memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.ingress.metering import ConnMeter, Meter, SandboxDelta, _Sandbox


def moved(m: ConnMeter, up: int, down: int, now: float) -> None:
    """What a plane does per chunk."""
    m.up += up
    m.down += down
    m.last_activity = now


def test_deltas_across_opens_closes_and_takes() -> None:
    meter = Meter()
    a1 = meter.open("sbx-a", "c1", 1.0)
    a2 = meter.open("sbx-a", "c2", 1.5)
    b1 = meter.open("sbx-b", "c3", 2.0)
    moved(a1, 100, 10, 2.5)
    moved(a2, 5, 7, 3.0)
    moved(b1, 1, 0, 2.25)
    meter.close(a1)
    assert meter.take_deltas(4.0) == {
        "sbx-a": SandboxDelta(bytes_up=105, bytes_down=17, open_connections=1, last_activity=3.0, idle_s=1.0),
        "sbx-b": SandboxDelta(bytes_up=1, bytes_down=0, open_connections=1, last_activity=2.25, idle_s=1.75),
    }
    moved(a2, 1000, 0, 4.5)
    meter.close(a2)
    meter.close(a2)  # twice: nothing more
    meter.close(b1)
    assert meter.take_deltas(5.0) == {
        "sbx-a": SandboxDelta(1000, 0, 0, 4.5, 0.5),
        "sbx-b": SandboxDelta(0, 0, 0, 2.25, 2.75),  # closed with nothing new: reported, then forgotten
    }
    assert meter.take_deltas(6.0) == {}


def test_an_open_with_no_bytes_is_reported_once() -> None:
    meter = Meter()
    meter.open("sbx-a", "c1", 1.0)
    assert meter.take_deltas(1.25) == {"sbx-a": SandboxDelta(0, 0, 1, 1.0, 0.25)}
    assert meter.take_deltas(2.0) == {}  # still open, nothing new


def test_forgotten_after_a_take_with_no_open_connection() -> None:
    meter = Meter()
    m = meter.open("sbx-a", "c1", 1.0)
    moved(m, 3, 4, 1.5)
    meter.close(m)
    assert meter.usage()["sbx-a"].bytes_up == 3
    assert meter.take_deltas(2.0) == {"sbx-a": SandboxDelta(3, 4, 0, 1.5, 0.5)}
    assert meter.usage() == {}
    assert meter.take_deltas(3.0) == {}
    assert meter.totals() == (3, 4)


def test_still_open_sandbox_is_kept() -> None:
    meter = Meter()
    done = meter.open("sbx-a", "c1", 1.0)
    live = meter.open("sbx-a", "c2", 1.0)
    moved(done, 1, 1, 1.1)
    meter.close(done)
    assert meter.take_deltas(2.0)["sbx-a"].open_connections == 1
    assert meter.take_deltas(3.0) == {}
    assert set(meter.usage()) == {"sbx-a"}
    moved(live, 0, 9, 3.5)
    assert meter.take_deltas(4.0) == {"sbx-a": SandboxDelta(0, 9, 1, 3.5, 0.5)}


def test_bytes_after_a_take_appear_in_the_next_take_only() -> None:
    meter = Meter()
    m = meter.open("sbx-a", "c1", 0.0)
    moved(m, 10, 20, 0.5)
    assert meter.take_deltas(1.0)["sbx-a"].bytes_up == 10
    moved(m, 1, 2, 1.5)
    assert meter.take_deltas(2.0) == {"sbx-a": SandboxDelta(1, 2, 1, 1.5, 0.5)}
    moved(m, 4, 0, 2.5)
    meter.close(m)  # bytes not yet taken are folded at close, not lost
    moved(m, 99, 99, 2.6)  # after close: not counted anywhere
    assert meter.take_deltas(3.0) == {"sbx-a": SandboxDelta(4, 0, 0, 2.5, 0.5)}
    assert meter.take_deltas(4.0) == {}
    assert meter.totals() == (15, 22)


def test_absolute_counters_as_the_ktls_plane_sets_them() -> None:
    # The kTLS plane copies the pump's running counters into the meter rather than adding.
    meter = Meter()
    m = meter.open("sbx-k", "c1", 0.0)
    m.up, m.down, m.last_activity = 1000, 50, 0.5
    assert meter.take_deltas(1.0) == {"sbx-k": SandboxDelta(1000, 50, 1, 0.5, 0.5)}
    m.up, m.down, m.last_activity = 1500, 50, 1.5
    assert meter.take_deltas(2.0) == {"sbx-k": SandboxDelta(500, 0, 1, 1.5, 0.5)}
    assert meter.take_deltas(3.0) == {}  # the same counters again: nothing moved
    m.up, m.down = 1600, 80
    meter.close(m)
    assert meter.take_deltas(4.0) == {"sbx-k": SandboxDelta(100, 30, 0, 1.5, 2.5)}
    assert meter.totals() == (1600, 80)


def test_totals_exact_across_forgotten_sandboxes() -> None:
    meter = Meter()
    live = meter.open("sbx-live", "c0", 0.0)
    for i in range(50):
        m = meter.open(f"sbx-{i}", f"c{i}", float(i))
        moved(m, i, 2 * i, float(i))
        meter.close(m)
        if i % 7 == 0:
            meter.take_deltas(float(i))
    moved(live, 5, 6, 60.0)
    meter.take_deltas(61.0)
    assert meter.totals() == (sum(range(50)) + 5, 2 * sum(range(50)) + 6)


def test_memory_is_bounded_by_active_sandboxes() -> None:
    meter = Meter()
    for round_ in range(20):
        opened = [meter.open(f"sbx-{round_}-{i}", "c", 0.0) for i in range(100)]
        for m in opened:
            moved(m, 1, 1, 1.0)
            meter.close(m)
        assert len(meter.take_deltas(2.0)) == 100
    assert meter._sandboxes == {}
    assert meter.totals() == (2000, 2000)


# -- random sequences: every metered byte in exactly one take ------------------------------------------

# (op, which sandbox or connection, bytes up, bytes down)
_ops = st.lists(
    st.tuples(
        st.sampled_from(["open", "move", "move", "close", "take"]),
        st.integers(0, 9),
        st.integers(0, 5000),
        st.integers(0, 5000),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_sum_of_all_takes_is_every_byte_metered(ops: list[tuple[str, int, int, int]]) -> None:
    meter = Meter()
    conns: list[ConnMeter] = []
    closed: set[int] = set()
    metered: dict[str, list[int]] = {}
    taken: dict[str, list[int]] = {}
    now = 0.0

    def take() -> None:
        for sid, d in meter.take_deltas(now).items():
            t = taken.setdefault(sid, [0, 0])
            t[0] += d.bytes_up
            t[1] += d.bytes_down
            assert d.open_connections == sum(1 for i, c in enumerate(conns) if c.sandbox_id == sid and i not in closed)
            assert 0 <= d.idle_s <= now

    for op, which, up, down in ops:
        now += 0.25
        if op == "open":
            conns.append(meter.open(f"sbx-{which % 5}", f"c{len(conns)}", now))
        elif op == "move" and conns and which % len(conns) not in closed:
            c = conns[which % len(conns)]
            moved(c, up, down, now)
            m = metered.setdefault(c.sandbox_id, [0, 0])
            m[0] += up
            m[1] += down
        elif op == "close" and conns:
            meter.close(conns[which % len(conns)])
            closed.add(which % len(conns))
        elif op == "take":
            take()
        assert meter.totals() == (sum(m[0] for m in metered.values()), sum(m[1] for m in metered.values()))
        live_sandboxes = {c.sandbox_id for i, c in enumerate(conns) if i not in closed}
        # Nothing kept for closed-and-taken sandboxes (the others are touched: the next take reports them).
        records = {sid: s for sid, s in meter._sandboxes.items() if isinstance(s, _Sandbox)}
        assert {sid for sid in meter._sandboxes if sid not in records or records[sid].conns} == live_sandboxes
        assert all(s.touched for s in records.values() if not s.conns)
    for i, c in enumerate(conns):
        meter.close(c)
        closed.add(i)
    take()
    assert {s: v for s, v in taken.items() if v != [0, 0]} == {s: v for s, v in metered.items() if v != [0, 0]}
    assert meter._sandboxes == {}
    assert meter.take_deltas(now) == {}


def test_open_silent_connections_are_reported_again_every_refresh() -> None:
    """The scheduler forgets a feed stream's open connections when the stream falls silent, so a sandbox
    whose connections are open but idle is reported again (no bytes, its open count) every ``refresh_s``."""
    meter = Meter()
    m = meter.open("sbx-a", "c1", 1.0)
    m.up += 5
    assert meter.take_deltas(2.0, refresh_s=10.0) == {"sbx-a": SandboxDelta(5, 0, 1, 1.0, 1.0)}
    assert meter.take_deltas(3.0, refresh_s=10.0) == {}  # silent, reported 1 s ago
    assert meter.take_deltas(11.9, refresh_s=10.0) == {}
    assert meter.take_deltas(12.0, refresh_s=10.0) == {"sbx-a": SandboxDelta(0, 0, 1, 1.0, 11.0)}
    assert meter.take_deltas(13.0, refresh_s=10.0) == {}
    assert meter.take_deltas(13.0) == {}  # without refresh_s: as before
    meter.close(m)
    assert meter.take_deltas(14.0, refresh_s=10.0) == {"sbx-a": SandboxDelta(0, 0, 0, 1.0, 13.0)}
    assert meter.take_deltas(30.0, refresh_s=10.0) == {}  # forgotten: nothing open
    assert meter._sandboxes == {}  # bounded by the live sandboxes


# -- against a plain model: the per-sandbox records and the one-connection shortcut change nothing ---------


class _Model:
    """The meter as first written: live connections per sandbox, a pending entry per sandbox touched since
    the previous take, the time each was last reported. Each take is a scan of all of them."""

    def __init__(self) -> None:
        self.live: dict[str, list[list[float]]] = {}  # sid -> [up, down, last, taken_up, taken_down] per conn
        self.pending: dict[str, list[float]] = {}  # sid -> [up, down, last]
        self.reported: dict[str, float] = {}

    def open(self, sid: str, now: float) -> list[float]:
        c = [0, 0, now, 0, 0]
        self.live.setdefault(sid, []).append(c)
        p = self.pending.setdefault(sid, [0, 0, 0.0])
        p[2] = max(p[2], now)
        return c

    def close(self, sid: str, c: list[float]) -> None:
        self.live[sid].remove(c)
        if not self.live[sid]:
            del self.live[sid]
        p = self.pending.setdefault(sid, [0, 0, 0.0])
        p[0] += c[0] - c[3]
        p[1] += c[1] - c[4]
        p[2] = max(p[2], c[2])

    def take(self, now: float, refresh_s: float | None) -> dict[str, SandboxDelta]:
        out = {}
        for sid in list(self.live) + [s for s in self.pending if s not in self.live]:
            p = self.pending.pop(sid, None)
            live = self.live.get(sid, [])
            up = sum(c[0] - c[3] for c in live) + (p[0] if p else 0)
            down = sum(c[1] - c[4] for c in live) + (p[1] if p else 0)
            for c in live:
                c[3], c[4] = c[0], c[1]
            last = max([p[2] if p else 0.0, *(c[2] for c in live)])
            stale = refresh_s is not None and now - self.reported.get(sid, now) >= refresh_s
            if p is None and not up and not down and not stale:
                continue
            out[sid] = SandboxDelta(int(up), int(down), len(live), last, max(0.0, now - last))
            if live:
                self.reported[sid] = now
            else:
                self.reported.pop(sid, None)
        return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "move", "move", "move", "close", "take", "take"]),
                          st.integers(0, 9), st.integers(0, 3), st.integers(0, 40)), max_size=120),
       st.sampled_from([None, 1.0, 2.5]))
def test_the_meter_takes_what_the_plain_model_takes(
    ops: list[tuple[str, int, int, int]], refresh_s: float | None
) -> None:
    meter, model = Meter(), _Model()
    conns: list[tuple[ConnMeter, list[float]]] = []
    now = 0.0
    for op, which, amount, dt in ops:
        now += dt / 16
        if op == "open":
            sid = f"sbx-{which % 4}"
            conns.append((meter.open(sid, f"c{len(conns)}", now), model.open(sid, now)))
        elif op == "move" and conns:
            m, c = conns[which % len(conns)]
            moved(m, amount, amount // 2, now)
            c[0], c[1], c[2] = c[0] + amount, c[1] + amount // 2, now
        elif op == "close" and conns:
            m, c = conns.pop(which % len(conns))
            meter.close(m)
            meter.close(m)  # twice: nothing more
            model.close(m.sandbox_id, c)
        elif op == "take":
            assert meter.take_deltas(now, refresh_s) == model.take(now, refresh_s)
        assert meter.totals()[0] >= sum(int(c[0]) for _m, c in conns)
    assert meter.take_deltas(now + 100, refresh_s) == model.take(now + 100, refresh_s)
