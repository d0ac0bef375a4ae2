"""``gateway.http1._OnFirstWait``: ``await coro`` in the awaiting task, telling of the first time it waits.

The HTTP/1.1 front watches a client whose request waits for admission or a link only once that wait is
real: a request served from the route cache over a kept link must cost no task and no timer, and one that
waits must be awaited exactly as ``await coro`` would (results, errors, cancellation).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.http1 import _OnFirstWait


def test_a_coroutine_that_never_waits_is_not_told_of() -> None:
    calls: list[str] = []

    async def quick() -> int:
        return 7

    async def main() -> int:
        return await _OnFirstWait(quick(), lambda: calls.append("waited"))

    assert asyncio.run(main()) == 7
    assert calls == []


def test_a_coroutine_that_waits_is_told_of_once_and_gets_what_it_awaited() -> None:
    calls: list[str] = []

    async def slow() -> str:
        await asyncio.sleep(0.01)
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, "b")
        got = await fut
        await asyncio.sleep(0)  # a bare yield too
        return "a" + got

    async def main() -> str:
        return await _OnFirstWait(slow(), lambda: calls.append("waited"))

    assert asyncio.run(main()) == "ab"
    assert calls == ["waited"]


def test_errors_and_cancellation_pass_as_through_await() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("no")

    async def blocked(seen: list[str]) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            await asyncio.sleep(0)  # cleanup that waits still runs
            seen.append("cleaned up")
            raise

    async def main() -> list[str]:
        with pytest.raises(ValueError, match="no"):
            await _OnFirstWait(fails(), lambda: None)
        seen: list[str] = []
        task = asyncio.create_task(_run(_OnFirstWait(blocked(seen), lambda: None)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    async def _run(aw: _OnFirstWait[None]) -> None:
        await aw

    assert asyncio.run(main()) == ["cancelled inside", "cleaned up"]


def test_a_timeout_inside_works_as_without_it() -> None:
    async def inner() -> str:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        except TimeoutError:
            return "timed out"
        return "not"

    async def main() -> str:
        return await _OnFirstWait(inner(), lambda: None)

    assert asyncio.run(main()) == "timed out"
