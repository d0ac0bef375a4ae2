"""gateway/route_cache.py: positive and negative entries, the scheduler's TTLs, LRU bound, counters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.route_cache import Hit, RouteCache, Stale, ttl_from_cache_control
from sbxnet.errors import ConfigError


@pytest.mark.parametrize(
    ("header", "ttl"),
    [
        ("max-age=2", 2.0),
        ("max-age=0", 0.0),
        ("Max-Age=1", 1.0),
        ('max-age="5"', 5.0),
        ("public, max-age=30", 30.0),
        ("max-age = 3", 3.0),
        (b"max-age=2", 2.0),
        ("max-age=2, no-store", 0.0),
        ("no-cache", 0.0),
        ("NO-STORE", 0.0),
        ("public", 0.0),  # a header without max-age: nothing to go by
        ("", 0.0),
        ("max-age=", 0.0),
        ("max-age=-1", 0.0),
        ("max-age=1.5", 0.0),
        ("max-age=abc", 0.0),
        ("max-age=2, max-age=3", 0.0),  # conflicting: RFC 9111 4.2.1 says treat as stale
        ("max-age=99999999999", 0.0),
        (b"max-age=\xff", 0.0),
        (None, 7.0),  # no header: the caller's default
    ],
)
def test_ttl_from_cache_control(header: str | bytes | None, ttl: float) -> None:
    assert ttl_from_cache_control(header, default=7.0) == ttl


@given(st.text(max_size=80) | st.binary(max_size=80))
def test_ttl_parse_never_raises_and_is_never_negative(header: str | bytes) -> None:
    t = ttl_from_cache_control(header, default=1.0)
    assert t >= 0 and math.isfinite(t)


def test_found_then_expired() -> None:
    c: RouteCache[str] = RouteCache()
    assert c.get("a", 0.0) is None
    c.put_found("a", "route-a", 2.0, now=10.0)
    assert c.get("a", 10.0) == Hit("route-a", 12.0)
    assert c.get("a", 11.999) == Hit("route-a", 12.0)
    assert c.get("a", 12.0) is None  # expiry is at now + ttl exactly
    assert len(c) == 0
    assert c.stats() == {"entries": 0, "hits": 2, "negative_hits": 0, "misses": 2, "expired": 1, "evictions": 0,
                         "invalidations": 0, "known": 0, "stale": 0}


def test_unknown_is_cached_as_a_negative_hit() -> None:
    c: RouteCache[str] = RouteCache()
    c.put_unknown("nope", 1.0, now=0.0)
    hit = c.get("nope", 0.5)
    assert hit is not None and hit.route is None
    assert c.get("nope", 1.0) is None
    assert (c.negative_hits, c.hits, c.misses) == (1, 0, 1)


def test_a_found_route_replaces_a_negative_entry_and_back() -> None:
    c: RouteCache[str] = RouteCache()
    c.put_unknown("a", 5.0, now=0.0)
    c.put_found("a", "r", 5.0, now=1.0)
    assert c.get("a", 2.0) == Hit("r", 6.0)
    c.put_unknown("a", 1.0, now=3.0)
    assert c.get("a", 3.5) == Hit(None, 4.0)


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan])
def test_a_ttl_of_nothing_caches_nothing_and_drops_what_was_there(ttl: float) -> None:
    c: RouteCache[str] = RouteCache()
    c.put_found("a", "old", 10.0, now=0.0)
    c.put_found("a", "new", ttl, now=1.0)
    assert c.get("a", 1.0) is None
    c.put_unknown("b", ttl, now=1.0)
    assert c.get("b", 1.0) is None and len(c) == 0


def test_ttl_is_capped() -> None:
    c: RouteCache[str] = RouteCache(max_ttl=5.0)
    c.put_found("a", "r", 1e9, now=0.0)
    c.put_unknown("b", math.inf, now=0.0)
    assert c.get("a", 4.9) is not None and c.get("a", 5.0) is None
    assert c.get("b", 4.9) is not None and c.get("b", 5.0) is None


def test_invalidate_after_a_failed_connect() -> None:
    c: RouteCache[str] = RouteCache()
    c.put_found("a", "r", 2.0, now=0.0)
    assert c.invalidate("a") is True
    assert c.get("a", 0.1) is None
    assert c.invalidate("a") is False
    assert c.invalidations == 1


def test_lru_eviction_keeps_the_recently_used() -> None:
    c: RouteCache[str] = RouteCache(max_entries=3)
    for i, k in enumerate("abc"):
        c.put_found(k, k.upper(), 100.0, now=float(i))
    assert c.get("a", 5.0) is not None  # a is now the most recent; b the least
    c.put_unknown("d", 100.0, now=6.0)
    assert len(c) == 3 and c.evictions == 1
    assert c.get("b", 7.0) is None
    assert {k for k in "acd" if c.get(k, 7.0) is not None} == set("acd")
    c.put_found("c", "C2", 100.0, now=8.0)  # a rewrite is a use: a goes next
    c.put_found("e", "E", 100.0, now=9.0)
    assert c.get("a", 10.0) is None and c.get("c", 10.0) == Hit("C2", 68.0)  # 100 s capped at max_ttl (60 s)


def test_purge_drops_only_expired_entries() -> None:
    c: RouteCache[str] = RouteCache()
    c.put_found("a", "r", 1.0, now=0.0)
    c.put_unknown("b", 3.0, now=0.0)
    assert c.purge(2.0) == 1
    assert len(c) == 1 and c.expired == 1
    assert c.get("b", 2.0) == Hit(None, 3.0)


@pytest.mark.parametrize(("kw", "field"), [({"max_entries": 0}, "entries"), ({"max_entries": True}, "entries"),
                                           ({"max_ttl": 0.0}, "max_ttl"), ({"max_ttl": math.nan}, "max_ttl"),
                                           ({"max_stale": -1.0}, "route_stale_s"),
                                           ({"max_stale": math.inf}, "route_stale_s")])
def test_bad_bounds_are_refused(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RouteCache(**kw)  # type: ignore[arg-type]


# A model: a dict of (value, expires) and an access order; the cache must agree with it at every step.
OPS = st.lists(
    st.tuples(st.sampled_from(["get", "found", "unknown", "invalidate", "purge"]), st.sampled_from("abcdef"),
              st.floats(-1, 10, allow_nan=False), st.floats(0, 3, allow_nan=False)),
    max_size=60,
)


@given(OPS, st.integers(1, 4))
def test_agrees_with_a_model(ops: list[tuple[str, str, float, float]], cap: int) -> None:
    c: RouteCache[str] = RouteCache(max_entries=cap, max_ttl=5.0)
    model: dict[str, tuple[str | None, float]] = {}
    order: list[str] = []
    now = 0.0
    gets = 0

    def touch(k: str) -> None:
        if k in order:
            order.remove(k)
        order.append(k)

    for op, k, ttl, dt in ops:
        now += dt
        if op == "get":
            gets += 1
            want = model.get(k)
            if want is not None and now >= want[1]:
                del model[k]
                order.remove(k)
                want = None
            got = c.get(k, now)
            assert (got is None) == (want is None)
            if want is not None:
                assert got == Hit(want[0], want[1])
                touch(k)
        elif op in ("found", "unknown"):
            if op == "found":
                c.put_found(k, k + str(now), ttl, now)
            else:
                c.put_unknown(k, ttl, now)
            if ttl > 0:
                model[k] = (k + str(now) if op == "found" else None, now + min(ttl, 5.0))
                touch(k)
                while len(model) > cap:
                    del model[order.pop(0)]
            elif k in model:
                del model[k]
                order.remove(k)
        elif op == "invalidate":
            assert c.invalidate(k) == (k in model)
            if k in model:
                del model[k]
                order.remove(k)
        else:
            dead = [key for key, (_, exp) in model.items() if now >= exp]
            assert c.purge(now) == len(dead)
            for key in dead:
                del model[key]
                order.remove(key)
        assert len(c) == len(model) <= cap
    assert c.hits + c.negative_hits + c.misses == gets


# -- the last route known, served while the source cannot be asked -----------------------------------


def test_the_last_route_is_served_stale_for_max_stale_from_when_it_was_given() -> None:
    c: RouteCache[str] = RouteCache(max_stale=10.0)
    assert c.stale("a", 0.0) is None  # never given
    c.put_found("a", "r1", 2.0, 100.0)
    assert c.get("a", 103.0) is None  # the entry expired: the caller looks it up, and that fails
    assert c.stale("a", 103.0) == Stale("r1", 3.0, True)
    assert c.stale("a", 109.5) == Stale("r1", 9.5, False)  # said once
    assert c.stale("a", 110.0) is None  # the bound runs from when it was given, not from the first stale use
    assert c.stale("a", 105.0) is None  # and once past it, it is forgotten
    assert c.stats()["stale"] == 2 and c.stats()["known"] == 0


def test_a_new_answer_restarts_the_bound_and_the_first_flag() -> None:
    c: RouteCache[str] = RouteCache(max_stale=10.0)
    c.put_found("a", "r1", 2.0, 0.0)
    assert c.stale("a", 5.0) == Stale("r1", 5.0, True)
    c.put_found("a", "r2", 2.0, 8.0)  # the source is back, and says where the sandbox is now
    assert c.stale("a", 15.0) == Stale("r2", 7.0, True)


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan])
def test_unknown_or_uncacheable_answers_forget_the_last_route(ttl: float) -> None:
    c: RouteCache[str] = RouteCache(max_stale=10.0)
    c.put_found("a", "r1", 2.0, 0.0)
    c.put_unknown("a", 1.0, 1.0)  # the source said it does not know the sandbox
    assert c.stale("a", 2.0) is None
    c.put_found("b", "r1", 2.0, 0.0)
    c.put_found("b", "r2", ttl, 1.0)  # an answer not to be cached is not to be served stale either
    assert c.stale("b", 2.0) is None


def test_invalidate_keeps_the_last_route_and_max_stale_0_keeps_none() -> None:
    c: RouteCache[str] = RouteCache(max_stale=10.0)
    c.put_found("a", "r1", 2.0, 0.0)
    c.invalidate("a")  # a failed connect: look again; if the source cannot answer, this is what it last said
    assert c.stale("a", 1.0) == Stale("r1", 1.0, True)
    off: RouteCache[str] = RouteCache()
    off.put_found("a", "r1", 2.0, 0.0)
    assert off.stale("a", 0.5) is None


def test_the_last_routes_are_bounded_and_purged() -> None:
    c: RouteCache[str] = RouteCache(max_entries=2, max_stale=10.0)
    for i, k in enumerate("abc"):
        c.put_found(k, f"r{k}", 2.0, float(i))
    assert c.stats()["known"] == 2 and c.stale("a", 3.0) is None  # the least recently given went first
    c.purge(11.5)  # b (given at 1) is past the bound, c (given at 2) is not
    assert c.stats()["known"] == 1 and c.stale("c", 11.5) == Stale("rc", 9.5, True)


STALE_OPS = st.lists(
    st.tuples(st.sampled_from(["found", "unknown", "stale", "purge"]), st.sampled_from("abc"),
              st.floats(-1, 3, allow_nan=False), st.floats(0, 4, allow_nan=False)),
    max_size=50,
)


@given(STALE_OPS)
def test_stale_agrees_with_a_model(ops: list[tuple[str, str, float, float]]) -> None:
    """Served stale exactly when the source's last answer for the name was a route it let be cached,
    given less than max_stale ago; the first time since that answer says so."""
    c: RouteCache[str] = RouteCache(max_entries=10, max_stale=5.0)
    model: dict[str, tuple[str, float, bool]] = {}  # name -> (route, given at, served already)
    now = 0.0
    for op, k, ttl, dt in ops:
        now += dt
        if op == "found":
            c.put_found(k, k + str(now), ttl, now)
            if ttl > 0:
                model[k] = (k + str(now), now, False)
            else:
                model.pop(k, None)
        elif op == "unknown":
            c.put_unknown(k, ttl, now)
            model.pop(k, None)
        elif op == "stale":
            want = model.get(k)
            if want is not None and not now - want[1] < 5.0:
                del model[k]
                want = None
            got = c.stale(k, now)
            if want is None:
                assert got is None
            else:
                assert got == Stale(want[0], now - want[1], not want[2])
                model[k] = (want[0], want[1], True)
        else:
            c.purge(now)
            for key in [key for key, (_, given, _) in model.items() if not now - given < 5.0]:
                del model[key]
        assert c.stats()["known"] == len(model)
