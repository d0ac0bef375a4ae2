"""The single node's address allocator: the pure choice (``addresses.AddressPool``, a fake clock) and its
release log on a real file (``release_log.ReleaseLog``), across a simulated restart."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.egress.router.addresses import AddressPool, AllocationError, Released
from forwarder.egress.router.release_log import ReleaseLog, format_line, parse_line

NET = ipaddress.IPv4Network("100.64.0.0/29")  # hosts .1-.6; .1 is the exits' gateway: .2-.6 are claims'
BASE = int(NET.network_address)
WINDOW = 600.0


def test_hands_out_host_addresses_but_the_gateways_in_turn() -> None:
    pool = AddressPool(NET, WINDOW)
    got = [pool.allocate(f"c{i}", now=0) - BASE for i in range(5)]
    assert got == [2, 3, 4, 5, 6]
    with pytest.raises(AllocationError) as e:
        pool.allocate("c9", now=0)
    assert e.value.reason == "pool_exhausted"


def test_a_released_address_is_not_reused_inside_the_window() -> None:
    pool = AddressPool(NET, WINDOW)
    a = [pool.allocate(f"c{i}", now=0) for i in range(5)]
    pool.release("c0", a[0], now=10)
    with pytest.raises(AllocationError, match="pool_exhausted"):
        pool.allocate("x", now=10 + WINDOW - 0.001)
    assert pool.allocate("x", now=10 + WINDOW) == a[0]


def test_round_robin_puts_a_released_address_last() -> None:
    pool = AddressPool(NET, 0.0)  # no window at all: still the next address first, not the freed one
    a = pool.allocate("c0", now=0)
    pool.release("c0", a, now=1)
    assert pool.allocate("c1", now=2) == a + 1


def test_reserve_refuses_held_cooling_and_outside_but_the_releasing_claim_gets_its_own_back() -> None:
    pool = AddressPool(NET, WINDOW, exclude=[BASE + 6])
    pool.reserve("c1", BASE + 3, now=0)
    for addr, reason in ((BASE + 3, "address_in_use"), (BASE + 1, "outside_pool"), (BASE, "outside_pool"),
                         (BASE + 7, "outside_pool"), (BASE + 6, "outside_pool"), (BASE + 8, "outside_pool")):
        with pytest.raises(AllocationError) as e:
            pool.reserve("c2", addr, now=0)
        assert e.value.reason == reason, addr
    pool.reserve("c1", BASE + 3, now=0)  # again by its holder: no change
    assert pool.release("c2", BASE + 3, now=1) is None  # not c2's to give back
    assert pool.release("c1", BASE + 3, now=1) == Released(BASE + 3, 1, "c1")
    with pytest.raises(AllocationError, match="address_cooling"):
        pool.reserve("c2", BASE + 3, now=2)
    pool.reserve("c1", BASE + 3, now=2)  # a claim that comes back (moved away and back) keeps it
    assert pool.held == {BASE + 3: "c1"} and not pool.cooling


def test_excluded_addresses_are_never_allocated() -> None:
    pool = AddressPool(NET, WINDOW, exclude=[BASE + 2, BASE + 4])
    assert sorted(pool.allocate(f"c{i}", now=0) - BASE for i in range(3)) == [3, 5, 6]
    with pytest.raises(AllocationError, match="pool_exhausted"):
        pool.allocate("c9", now=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.floats(0, 300)), max_size=60))
def test_no_address_is_held_twice_or_reused_inside_its_window(ops: list[tuple[bool, int, float]]) -> None:
    # A random run of allocations and releases against a model: held addresses are distinct, and an
    # address allocated to another claim was released at least a window before.
    window = 500.0
    pool = AddressPool(NET, window)
    now = 0.0
    held: dict[str, int] = {}
    last_release: dict[int, tuple[float, str]] = {}
    n = 0
    for alloc, pick, dt in ops:
        now += dt
        if alloc or not held:
            n += 1
            claim = f"c{n}"
            try:
                a = pool.allocate(claim, now)
            except AllocationError:
                continue
            assert a not in held.values()
            if a in last_release:
                at, _who = last_release[a]
                assert now - at >= window, (a, now, at)
            held[claim] = a
        else:
            claim = sorted(held)[pick % len(held)]
            a = held.pop(claim)
            assert pool.release(claim, a, now) is not None
            last_release[a] = (now, claim)


# ---------------------------------------------------------------- the log on a real file


def test_the_log_carries_the_window_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "releases.log"
    log = ReleaseLog.open(path, WINDOW, now=1000)
    pool = AddressPool(NET, WINDOW, released=log.released, now=1000)
    a = [pool.allocate(f"c{i}", now=1000) for i in range(5)]
    for i in (0, 1):
        r = pool.release(f"c{i}", a[i], now=1000 + i)
        assert r is not None
        log.append(r)
    log.close()
    # "restart": the state file would restore the three held claims
    log = ReleaseLog.open(path, WINDOW, now=1100)
    assert [(r.address, r.claim) for r in log.released] == [(a[0], "c0"), (a[1], "c1")]
    pool = AddressPool(NET, WINDOW, released=log.released, now=1100)
    for i in (2, 3, 4):
        pool.reserve(f"c{i}", a[i], now=1100)
    with pytest.raises(AllocationError, match="pool_exhausted"):
        pool.allocate("new", now=1100)
    log.close()
    # after the window the log is compacted to nothing and the addresses come back
    log = ReleaseLog.open(path, WINDOW, now=1001 + WINDOW)
    assert log.released == [] and path.read_text() == ""
    log.close()


def test_the_log_skips_lines_it_cannot_read_and_compacts_them_away(tmp_path: Path) -> None:
    path = tmp_path / "releases.log"
    good = Released(BASE + 2, 50.0, "c1")
    path.write_text("garbage\n" + format_line(good) + "100.64.0.3 nan c2\n100.64.0.4 1e999 c3\n"
                    "300.0.0.1 5 c4\n100.64.0.5 60 c5\n100.64.0.6 7")  # the last line torn by a crash
    log = ReleaseLog.open(path, WINDOW, now=100)
    assert [(r.address, r.claim) for r in log.released] == [(BASE + 2, "c1"), (BASE + 5, "c5")]
    assert log.skipped == 5
    assert path.read_text() == format_line(good) + format_line(Released(BASE + 5, 60.0, "c5"))
    log.close()


@given(st.integers(0, 2**32 - 1), st.floats(0, 4e9, allow_nan=False), st.from_regex(r"[A-Za-z0-9._:-]{1,20}",
                                                                                   fullmatch=True))
def test_a_line_round_trips(addr: int, at: float, claim: str) -> None:
    r = parse_line(format_line(Released(addr, at, claim)))
    assert r is not None and (r.address, r.claim) == (addr, claim) and abs(r.at - at) <= 0.0005
