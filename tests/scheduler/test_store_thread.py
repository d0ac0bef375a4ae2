"""The store off the event loop (``scheduler/store_thread.py``, docs/scheduler.md "The store thread"): the
scheduler's API over real mTLS on loopback, on a real SQLite file and on a real PostgreSQL server.

While a feed batch waits on the store (another connection holds SQLite's write lock; on PostgreSQL a row
lock on one of the batch's sandboxes), the gateway's route lookups are answered, each well within a
bound, and the batch is answered 200 once the lock goes, its bytes committed. With the store thread's
queue full, a further batch and a registration are refused 503 with ``Retry-After`` and change nothing;
the batch that waited still commits. Batches that arrive while a transaction runs commit as one group
after it, each answered, a resend among them applied once. A request whose client goes away while its
operation runs still commits and publishes its events."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pg_support
import psycopg
import pytest
from sched_support import Client, SchedulerApp, mint_pki, registration

from sbxnet.protocol.feed import new_epoch
from sbxnet.protocol.routes import pull_registration
from scheduler.pg_store import PgStore
from scheduler.sqlite_store import SqliteStore
from scheduler.store import Store

LOCK_S = 2.0  # how long the other connection holds its lock
ROUTE_BOUND_S = 1.0  # each route lookup meanwhile is answered within this (the store waits LOCK_S)
SIDS = [f"sbx-{i}" for i in range(20)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


class Holder:
    """Another connection to the database holding a lock the scheduler's next write needs."""

    def __init__(self, hold: Callable[[], Any], release: Callable[[], None]) -> None:
        self.hold, self.release = hold, release


def _sqlite_holder(db: Path) -> Holder:
    conn = sqlite3.connect(db, isolation_level=None)

    def release() -> None:
        conn.rollback()
        conn.close()

    return Holder(lambda: conn.execute("BEGIN IMMEDIATE"), release)


def _pg_holder(dsn: str) -> Holder:
    conn = psycopg.connect(dsn, autocommit=False)

    def hold() -> None:
        conn.execute("SELECT 1 FROM sandboxes WHERE sandbox = %s FOR UPDATE", (SIDS[0],))

    def release() -> None:
        conn.rollback()
        conn.close()

    return Holder(hold, release)


@pytest.fixture(params=["sqlite", "pg"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Callable[[], Store], Callable[[], Holder]]:
    if request.param == "sqlite":
        db = tmp_path / "s.db"
        # Long lock waits: under load the test's steps while the lock is held may take more than the defaults.
        return (lambda: SqliteStore(db, busy_timeout_s=60.0)), (lambda: _sqlite_holder(db))
    try:
        server = pg_support.shared_server()
    except pg_support.PgUnavailable as e:
        pytest.skip(str(e))
    dsn = pg_support.fresh_schema(server)
    return (lambda: PgStore(dsn, lock_timeout_s=60.0)), (lambda: _pg_holder(dsn))


class Stack:
    def __init__(self, app: SchedulerApp, holder: Callable[[], Holder]) -> None:
        self.app, self.holder = app, holder
        self.client = Client(app)
        self.epoch = new_epoch(time.time_ns(), bytes(8))

    async def register(self) -> None:
        for sid in SIDS:
            assert (await self.client.admin("PUT", f"/v1/sandboxes/{sid}", registration()))[0] == 201

    def batch(self) -> dict[str, Any]:
        """Each stream's first batch of the epoch (the tests post one per stream)."""
        return {"epoch": self.epoch, "seq": 1, "sandboxes": [
            {"sandbox": sid, "bytes_in": 10, "bytes_out": 20, "open": 0, "idle_s": 0.0} for sid in SIDS]}

    async def post(self, body: dict[str, Any], stream: int = 0) -> tuple[int, dict[str, str], Any]:
        return await self.client.call("POST", f"/v1/feed?stream={stream}", as_="forwarder", body=body)

    async def route(self, sid: str) -> float:
        """One route lookup as the gateway; returns how long it took."""
        t = time.monotonic()
        status, _, doc = await self.client.call("GET", f"/v1/routes/{sid}", as_="gateway")
        assert status == 200 and doc["state"] == "active", (status, doc)
        return time.monotonic() - t

    def totals(self) -> set[tuple[int, int]]:
        assert self.app.store is not None
        return {(r.state.bytes_in, r.state.bytes_out) for r in self.app.store.sandboxes()}


@pytest.fixture
async def stack(backend: tuple[Callable[[], Store], Callable[[], Holder]], pki: dict[str, Path]
                ) -> AsyncIterator[Stack]:
    make, holder = backend
    # No feed of SchedulerApp's: these tests fill the store thread's queue themselves, and idle nothing.
    app = await SchedulerApp(make, pki, max_pending=2, feed=False).start()
    s = Stack(app, holder)
    await s.register()
    try:
        yield s
    finally:
        await s.client.close()
        await app.stop()


async def _until_waiting(app: SchedulerApp, n: int) -> None:
    """Until ``n`` operations are on the store thread (submitted, not finished)."""
    assert app.service is not None
    deadline = time.monotonic() + 10
    while app.service.worker.pending < n:
        assert time.monotonic() < deadline, f"{n} store operations never waited"
        await asyncio.sleep(0.01)


async def test_route_lookups_are_answered_while_a_batch_waits_on_a_lock(stack: Stack) -> None:
    await stack.route(SIDS[1])  # the connections are up (a handshake is no part of the bound)
    holder = stack.holder()
    holder.hold()
    try:
        feed = asyncio.create_task(stack.post(stack.batch()))
        await _until_waiting(stack.app, 1)
        await asyncio.sleep(0.2)  # the batch is inside its transaction, waiting on the lock
        took: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < LOCK_S * 0.75:
            took.append(await stack.route(SIDS[len(took) % len(SIDS)]))
            await asyncio.sleep(0.05)
        assert not feed.done(), "the batch did not wait on the lock: the test proves nothing"
    finally:
        holder.release()
    status, _, doc = await feed
    assert (status, doc) == (200, {"acked": 1})
    assert len(took) >= 5 and max(took) < ROUTE_BOUND_S, took
    assert stack.totals() == {(10, 20)}


async def test_a_full_queue_answers_503_with_retry_after_and_changes_nothing(stack: Stack) -> None:
    assert stack.app.service is not None
    # The timer loop's rounds go on the store thread too: one counted in ``pending`` would let the first
    # batch's group stay unstarted behind it, and the refused batch below would join that group (as it
    # should: joining adds no operation) and wait on the held lock instead of being refused.
    await stack.app.service.stop()
    holder = stack.holder()
    holder.hold()
    try:
        first = asyncio.create_task(stack.post(stack.batch()))
        await _until_waiting(stack.app, 1)
        second = asyncio.create_task(stack.client.admin("PUT", "/v1/sandboxes/sbx-queued", registration()))
        await _until_waiting(stack.app, 2)  # max_pending: the queue is full
        status, headers, doc = await stack.post(stack.batch(), stream=2)
        assert (status, headers.get("Retry-After"), doc) == (503, "1", "busy")
        status, headers, doc = await stack.client.call(
            "PUT", "/v1/sandboxes/sbx-new", headers={"Authorization": "Bearer admin-token-for-tests"},
            body=registration())
        assert status == 503 and headers.get("Retry-After") == "1", (status, doc)
    finally:
        holder.release()
    assert (await first)[0] == 200 and (await second)[0] == 201
    assert stack.totals() == {(10, 20), (0, 0)}  # the batch that waited (sbx-queued: none), not the refused one
    assert stack.app.store is not None and stack.app.store.ledger("spiffe://t/forwarder/1#2") is None
    assert (await stack.client.admin("GET", "/v1/sandboxes/sbx-new"))[0] == 404
    assert stack.app.service is not None and stack.app.service.feed.refused.get("busy") == 1


async def test_batches_that_queue_behind_a_transaction_commit_as_one_group(stack: Stack) -> None:
    """While a batch waits on the lock, five streams' batches and a resend of one of them arrive: they
    join one group (one transaction after the first), every one is answered, the resend counted once."""
    app = stack.app
    assert app.service is not None
    feed = app.service.feed
    await app.service.stop()  # the timer loop's rounds would start groups of their own between the batches
    holder = stack.holder()
    holder.hold()
    try:
        first = asyncio.create_task(stack.post(stack.batch()))
        await _until_waiting(app, 1)
        await asyncio.sleep(0.2)  # the first is inside its transaction: the next ones queue
        body = stack.batch()
        rest = [asyncio.create_task(stack.post(body if s == 0 else stack.batch(), stream=1 + s % 5))
                for s in range(6)]
        await _until_waiting(app, 2)
        await asyncio.sleep(0.5)  # all six arrived and joined (the store thread is still on the first)
        assert app.service.worker.pending == 2 and not first.done()
    finally:
        holder.release()
    assert (await first)[:1] == (200,)
    answers = [(status, doc) for status, _, doc in await asyncio.gather(*rest)]
    assert answers == [(200, {"acked": 1})] * 6
    assert feed.groups == 2 and feed.answered["apply"] == 6 and sum(feed.answered.values()) == 7
    assert stack.totals() == {(60, 120)}  # six streams' batches each once: the resend applied once


async def test_a_cancelled_request_still_commits_and_publishes_its_events(stack: Stack) -> None:
    """A registration (a new incarnation: one event) whose waiter is cancelled while its transaction
    waits on the lock: committed and published all the same (the event stream's news is set)."""
    app = stack.app
    assert app.service is not None and app.store is not None
    service = app.service
    news = service.new_events()
    new = pull_registration(json.dumps(registration(incarnation="inc-2")).encode())
    holder = stack.holder()
    holder.hold()
    try:
        task = asyncio.create_task(service.call(service.register, SIDS[0], new))
        await _until_waiting(app, 1)
        await asyncio.sleep(0.2)  # inside its transaction, waiting on the lock
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not news.is_set()
    finally:
        holder.release()
    await asyncio.wait_for(news.wait(), 10)
    (row,) = [r for r in app.store.sandboxes() if r.sandbox == SIDS[0]]
    assert row.registration.incarnation == "inc-2"
    assert [e.event.incarnation for e in app.store.events_after(0) if e.event.sandbox == SIDS[0]] == [
        "inc-1", "inc-2"]
