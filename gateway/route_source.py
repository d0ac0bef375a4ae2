"""Where the gateway gets routes and wakes sandboxes: the scheduler (docs/scheduler-api.md), or a file.

``RouteSource`` is what the rest of the gateway calls. ``StaticRoutes`` serves routes from a JSON file of
registrations (``{"sandboxes": {"<id>": <registration as PUT /v1/sandboxes/<id> takes it>}}``), every
sandbox always active: for a fixed fleet, and for running the gateway before a scheduler exists. The
scheduler's client (``scheduler_routes.SchedulerRoutes``) implements the same two calls over HTTP.

``Waker`` coalesces wakes: one call to the source per sandbox however many requests wait, the waiters
bounded per sandbox (past the bound a request is answered 503 at once rather than queued without limit).
``Lookups`` coalesces route lookups the same way: one lookup per sandbox in flight; every request that
misses the cache meanwhile waits for it and gets its answer, or its error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sbxnet.errors import EnvironmentFault
from sbxnet.protocol.routes import Route, RouteError, check_sandbox_id, pull_registration


@dataclass(frozen=True)
class Lookup:
    route: Route | None  # None: no such sandbox
    ttl: float  # how long the answer may be cached (the scheduler's Cache-Control max-age)


class RouteLookupFailed(EnvironmentFault):
    """The source could not answer (the scheduler down, a time-out, an answer that does not decode): the
    gateway answers 503 with Retry-After and caches nothing."""


class RouteSource(Protocol):
    async def lookup(self, sandbox: str) -> Lookup: ...

    async def wake(self, sandbox: str, wait: float) -> str:
        """Ask for ``sandbox`` to run; returns its state when answered ("active" once it runs)."""
        ...

    # Both may raise RouteLookupFailed.


class StaticRoutes:
    def __init__(self, path: Path, *, ttl: float = 5.0) -> None:
        self.path = path
        self.ttl = ttl
        self._routes = self._load(path)

    @staticmethod
    def _load(path: Path) -> dict[str, Route]:
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise EnvironmentFault("routes_file", f"cannot read {path}: {e}") from None
        if not isinstance(doc, dict) or set(doc) != {"sandboxes"} or not isinstance(doc["sandboxes"], dict):
            raise EnvironmentFault("routes_file", f'{path}: expected {{"sandboxes": {{"<id>": {{...}}}}}}')
        routes: dict[str, Route] = {}
        for sandbox, body in doc["sandboxes"].items():
            try:
                check_sandbox_id(sandbox)
                reg = pull_registration(json.dumps(body).encode())
            except RouteError as e:
                raise EnvironmentFault("routes_file", f"{path}: sandbox {sandbox[:64]!r}: {e}") from None
            routes[sandbox] = reg.route(sandbox, "active")
        return routes

    def reload(self) -> BaseException | None:
        """Read the file again; keep the current routes if it is bad."""
        try:
            self._routes = self._load(self.path)
        except EnvironmentFault as e:
            return e
        return None

    def load(self) -> dict[str, Route]:
        """The file read again, not yet in use (raises EnvironmentFault); ``use`` swaps it in."""
        return self._load(self.path)

    def use(self, routes: dict[str, Route]) -> None:
        self._routes = routes

    async def lookup(self, sandbox: str) -> Lookup:
        return Lookup(self._routes.get(sandbox), self.ttl)

    async def wake(self, sandbox: str, wait: float) -> str:
        return "active" if sandbox in self._routes else "unknown"


class WakeRefused(Exception):
    """Too many requests already wait for this sandbox to wake."""


@dataclass
class _Wake:
    task: asyncio.Task[str]
    stamp: int = -1  # ``Waker.stamp()`` when the wake was answered


class Waker:
    """``stamp``: read when a wake is answered, and handed to every waiter with the state
    (``wake_stamped``): the gateway passes ``Lookups.ticket``, so that the route looked up after a wake
    comes from a lookup that began after the wake was answered, never one begun while it ran."""

    def __init__(self, source: RouteSource, *, max_waiting: int = 256, wait: float = 10.0,
                 stamp: Callable[[], int] | None = None) -> None:
        self.source = source
        self.max_waiting = max_waiting
        self.wait = wait
        self.stamp = stamp
        self._inflight: dict[str, _Wake] = {}
        self._waiting: dict[str, int] = {}
        self.calls = 0  # wakes sent to the source (metrics: wakes)

    def _finished(self, sandbox: str, wake: _Wake) -> Callable[[asyncio.Task[str]], None]:
        def done(_task: asyncio.Task[str]) -> None:
            if self.stamp is not None:
                wake.stamp = self.stamp()  # before any waiter resumes: done callbacks run in order
            if self._inflight.get(sandbox) is wake:
                del self._inflight[sandbox]

        return done

    async def wake(self, sandbox: str) -> str:
        """The sandbox's state after one coalesced wake; ``WakeRefused`` past ``max_waiting``."""
        return (await self.wake_stamped(sandbox))[0]

    async def wake_stamped(self, sandbox: str) -> tuple[str, int]:
        """As ``wake``, with ``stamp()`` as it was when the wake was answered (-1 without a stamp)."""
        if self._waiting.get(sandbox, 0) >= self.max_waiting:
            raise WakeRefused(sandbox)
        wake = self._inflight.get(sandbox)
        if wake is None:
            self.calls += 1
            wake = _Wake(asyncio.create_task(self.source.wake(sandbox, self.wait)))
            self._inflight[sandbox] = wake
            wake.task.add_done_callback(self._finished(sandbox, wake))
        self._waiting[sandbox] = self._waiting.get(sandbox, 0) + 1
        try:
            # shield: one waiter giving up (its client left) must not cancel the wake for the others.
            state = await asyncio.shield(wake.task)
            return state, wake.stamp
        finally:
            left = self._waiting[sandbox] - 1
            if left:
                self._waiting[sandbox] = left
            else:
                del self._waiting[sandbox]


class Lookups:
    """One ``source.lookup`` per sandbox in flight: a request that misses the cache while a lookup for
    its sandbox is under way waits for that one and gets its ``Lookup`` or its ``RouteLookupFailed``.
    A waiter that gives up (its client left) does not cancel the lookup for the others.

    ``started_after``: a ``ticket()`` taken at some event; only a lookup begun after it is joined (one
    begun before may answer from before the event: a wake's end), otherwise a new one begins, which
    later callers with the same ticket join."""

    def __init__(self, source: RouteSource, *, on_call: Callable[[], None] | None = None) -> None:
        self.source = source
        self.on_call = on_call  # told of each lookup sent to the source (metrics: route_lookups)
        self._inflight: dict[str, tuple[int, asyncio.Task[Lookup]]] = {}  # (its number, the lookup)
        self.calls = 0  # lookups sent to the source; the last one's number

    def ticket(self) -> int:
        """The number of the last lookup begun: one begun after now has a greater number."""
        return self.calls

    def _finished(self, sandbox: str, task: asyncio.Task[Lookup]) -> Callable[[asyncio.Task[Lookup]], None]:
        def done(_task: asyncio.Task[Lookup]) -> None:
            entry = self._inflight.get(sandbox)
            if entry is not None and entry[1] is task:
                del self._inflight[sandbox]
            if not _task.cancelled():
                _task.exception()  # retrieved: every waiter may have given up before it ended

        return done

    async def lookup(self, sandbox: str, *, started_after: int = -1) -> Lookup:
        entry = self._inflight.get(sandbox)
        if entry is None or entry[0] <= started_after:
            self.calls += 1
            if self.on_call is not None:
                self.on_call()
            task = asyncio.create_task(self.source.lookup(sandbox), name=f"route-lookup-{sandbox}")
            entry = (self.calls, task)
            self._inflight[sandbox] = entry  # an earlier one still answers its own waiters
            task.add_done_callback(self._finished(sandbox, task))
        return await asyncio.shield(entry[1])
