"""Static routes from a file, and the waker that coalesces wakes per sandbox."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from pathlib import Path

import pytest

from gateway.route_source import Lookup, Lookups, RouteLookupFailed, StaticRoutes, Waker, WakeRefused
from sbxnet.errors import EnvironmentFault

PIN = base64.b64encode(hashlib.sha256(b"k").digest()).decode()
REG = {
    "incarnation": "i1",
    "forwarder": {"address": "127.0.0.1:8443", "spki_pin": PIN},
    "target_ip": "127.0.0.1",
    "default_port": 8080,
    "ports": {"8080": {"protocol": "http", "auth": "public"}},
    "idle_period_s": 60,
}


def write(tmp_path: Path, doc: object) -> Path:
    p = tmp_path / "routes.json"
    p.write_text(json.dumps(doc))
    return p


def test_static_routes_serve_the_file_and_reload_keeps_them_when_bad(tmp_path: Path) -> None:
    p = write(tmp_path, {"sandboxes": {"sbx-1": REG}})
    src = StaticRoutes(p, ttl=3)
    found = asyncio.run(src.lookup("sbx-1"))
    assert found.route is not None and found.route.state == "active" and found.ttl == 3
    assert found.route.forwarder.port == 8443
    assert asyncio.run(src.lookup("nope")) == Lookup(None, 3)
    p.write_text("{")
    assert src.reload() is not None
    assert asyncio.run(src.lookup("sbx-1")).route is not None
    write(tmp_path, {"sandboxes": {"sbx-2": REG}})
    assert src.reload() is None
    assert asyncio.run(src.lookup("sbx-1")).route is None


@pytest.mark.parametrize(
    "doc",
    [[], {"routes": {}}, {"sandboxes": {"a.b": REG}}, {"sandboxes": {"sbx": {**REG, "default_port": 1}}}],
)
def test_a_bad_file_is_an_environment_fault_naming_it(tmp_path: Path, doc: object) -> None:
    with pytest.raises(EnvironmentFault) as e:
        StaticRoutes(write(tmp_path, doc))
    assert "routes.json" in str(e.value)


class CountingSource:
    """A route source whose wake takes ``delay`` and counts its calls (the waker's own logic under test)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.wakes: list[str] = []

    async def lookup(self, sandbox: str) -> Lookup:
        return Lookup(None, 1)

    async def wake(self, sandbox: str, wait: float) -> str:
        self.wakes.append(sandbox)
        await asyncio.sleep(self.delay)
        return "active"


def test_fifty_waiters_cause_one_wake_per_sandbox() -> None:
    async def main() -> tuple[list[str], list[str]]:
        src = CountingSource(0.05)
        waker = Waker(src)
        states = await asyncio.gather(*(waker.wake("a") for _ in range(50)), *(waker.wake("b") for _ in range(3)))
        return list(states), src.wakes

    states, wakes = asyncio.run(main())
    assert states == ["active"] * 53
    assert sorted(wakes) == ["a", "b"]


def test_a_waiter_leaving_does_not_cancel_the_wake_for_the_others() -> None:
    async def main() -> str:
        waker = Waker(CountingSource(0.05))
        first = asyncio.create_task(waker.wake("a"))
        second = asyncio.create_task(waker.wake("a"))
        await asyncio.sleep(0.01)
        first.cancel()
        return await second

    assert asyncio.run(main()) == "active"


def test_waiters_are_bounded_per_sandbox() -> None:
    async def main() -> int:
        waker = Waker(CountingSource(0.05), max_waiting=3)
        results = await asyncio.gather(*(waker.wake("a") for _ in range(5)), return_exceptions=True)
        assert waker.calls == 1
        after = await waker.wake("a")  # once they are answered, new waiters are taken again
        assert after == "active" and waker.calls == 2
        return sum(isinstance(r, WakeRefused) for r in results)

    assert asyncio.run(main()) == 2


class SlowLookups:
    """A route source whose lookup takes ``delay`` and counts its calls; it fails while ``down``."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.down = False
        self.lookups: list[str] = []

    async def lookup(self, sandbox: str) -> Lookup:
        self.lookups.append(sandbox)
        await asyncio.sleep(self.delay)
        if self.down:
            raise RouteLookupFailed("unreachable", "down")
        return Lookup(None, 1)

    async def wake(self, sandbox: str, wait: float) -> str:
        return "active"


def test_fifty_waiters_cause_one_lookup_per_sandbox_and_all_get_its_answer() -> None:
    async def main() -> None:
        src = SlowLookups(0.05)
        told: list[int] = []
        lookups = Lookups(src, on_call=lambda: told.append(1))
        answers = await asyncio.gather(*(lookups.lookup("a") for _ in range(50)),
                                       *(lookups.lookup("b") for _ in range(3)))
        assert answers == [Lookup(None, 1)] * 53
        assert sorted(src.lookups) == ["a", "b"] and lookups.calls == 2 and len(told) == 2
        await lookups.lookup("a")  # the one in flight is done: the next miss looks again
        assert src.lookups.count("a") == 2

    asyncio.run(main())


def test_every_waiter_gets_the_lookups_error() -> None:
    async def main() -> list[object]:
        src = SlowLookups(0.05)
        src.down = True
        lookups = Lookups(src)
        return await asyncio.gather(*(lookups.lookup("a") for _ in range(10)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RouteLookupFailed) and r.reason == "unreachable" for r in results), results


def test_a_waiter_leaving_does_not_cancel_the_lookup_for_the_others() -> None:
    async def main() -> Lookup:
        src = SlowLookups(0.05)
        lookups = Lookups(src)
        first = asyncio.create_task(lookups.lookup("a"))
        second = asyncio.create_task(lookups.lookup("a"))
        await asyncio.sleep(0.01)
        first.cancel()
        answer = await second
        assert src.lookups == ["a"]
        return answer

    assert asyncio.run(main()) == Lookup(None, 1)


def test_a_lookup_begun_before_a_ticket_is_not_joined_one_begun_after_it_is() -> None:
    """After a wake, the route must come from a lookup begun after the wake's answer: one begun while
    the wake ran may say "waking". Callers with the same ticket share the new lookup."""
    async def main() -> None:
        src = SlowLookups(0.05)
        lookups = Lookups(src)
        early = asyncio.create_task(lookups.lookup("a"))
        await asyncio.sleep(0.01)  # the early lookup is in flight ...
        ticket = lookups.ticket()  # ... when the event happens
        joined = asyncio.create_task(lookups.lookup("a"))  # no ticket: joins the early one
        late = [asyncio.create_task(lookups.lookup("a", started_after=ticket)) for _ in range(5)]
        await asyncio.gather(early, joined, *late)
        assert src.lookups == ["a", "a"] and lookups.calls == 2

    asyncio.run(main())


def test_every_waiter_of_a_wake_gets_the_stamp_taken_when_it_was_answered() -> None:
    async def main() -> None:
        count = [0]

        def stamp() -> int:
            count[0] += 1
            return count[0]

        waker = Waker(CountingSource(0.05), stamp=stamp)
        answers = await asyncio.gather(*(waker.wake_stamped("a") for _ in range(10)))
        assert answers == [("active", 1)] * 10  # read once, when the one wake was answered
        assert await waker.wake_stamped("a") == ("active", 2)
        assert await Waker(CountingSource(0.0)).wake_stamped("a") == ("active", -1)

    asyncio.run(main())
