"""Two scheduler replicas on one PostgreSQL (docs/scheduler.md "State and replicas"): each a real service and
API over TLS with its own store connection and timer core, both running their idle timers, both taking
the feed and the platform's calls. Each idle event fires exactly once, totals fed through either replica
are exact, a wake waiting on one is answered when the driver reports to the other, each webhook event
is delivered once, and a feed stream reporting to one replica is live for both."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pg_support
import pytest
from sched_support import Client, Platform, SchedulerApp, mint_pki, registration, wait_for

from sbxnet.protocol.feed import new_epoch
from scheduler.pg_store import PgStore


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def pg_server() -> pg_support.PgServer:
    try:
        return pg_support.shared_server()
    except pg_support.PgUnavailable as e:
        pytest.skip(str(e))


class Pair:
    def __init__(self, a: SchedulerApp, b: SchedulerApp, platform: Platform | None) -> None:
        self.a, self.b, self.platform = a, b, platform
        self.ca, self.cb = Client(a), Client(b)

    def events(self) -> list[tuple[str, str | None, str]]:
        assert self.a.store is not None
        return [(e.event.sandbox, e.event.from_state, e.event.to_state) for e in self.a.store.events_after(0, 10000)]


@pytest.fixture
async def pair(pg_server: pg_support.PgServer, pki: dict[str, Path], request: pytest.FixtureRequest
               ) -> AsyncIterator[Pair]:
    dsn = pg_support.fresh_schema(pg_server)
    # True: with a platform; "no_feed": no SchedulerApp feed; "feed_to_a": only replica a hears the feed.
    param = getattr(request, "param", False)
    platform = await Platform().start() if param is True else None
    url = platform.url if platform else None
    feed = param != "no_feed"
    a = await SchedulerApp(lambda: PgStore(dsn), pki, webhook_url=url, feed=feed).start()
    b = await SchedulerApp(lambda: PgStore(dsn), pki, webhook_url=url, feed=feed and param != "feed_to_a").start()
    p = Pair(a, b, platform)
    try:
        yield p
    finally:
        await p.ca.close()
        await p.cb.close()
        await a.stop()
        await b.stop()
        if platform:
            await platform.stop()


async def test_each_idle_timer_fires_once_across_two_replicas(pair: Pair) -> None:
    sids = [f"sbx-{i:02d}" for i in range(20)]
    for i, sid in enumerate(sids):  # half registered through each replica
        client = pair.ca if i % 2 else pair.cb
        assert (await client.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=2.5)))[0] == 201
    # Both cores hold every sandbox before the first is due (the other replica learns by resync, 1 s here).
    assert pair.a.service is not None and pair.b.service is not None
    await wait_for(lambda: all(s in pair.a.service.core and s in pair.b.service.core for s in sids), 5.0,
                   "both replicas know every sandbox")
    await wait_for(lambda: sum(1 for e in pair.events() if e[2] == "idle") >= 20, 15.0, "twenty idle events")
    await asyncio.sleep(1.5)  # time for a second firing, if there were one
    idle = [e for e in pair.events() if e[2] == "idle"]
    assert sorted(sid for sid, _, _ in idle) == sids  # once each
    # Both replicas' timer loops did fire some: the exactly-once is not one replica doing it all by luck.
    fired = (pair.a.service.counters["timer_fires"], pair.b.service.counters["timer_fires"])
    assert sum(fired) == 20, fired


@pytest.mark.parametrize("pair", ["feed_to_a"], indirect=True)
async def test_only_the_replica_that_hears_a_feed_idles_its_sandboxes(pair: Pair) -> None:
    # Feed liveness is each replica's own memory (docs/scheduler-api.md "Feed liveness"): b hears no feed
    # from the forwarder these routes name, so it idles none of them, whatever its timers say; a does,
    # once each, on the rows it locks and re-reads.
    sids = [f"sbx-{i:02d}" for i in range(6)]
    for i, sid in enumerate(sids):
        client = pair.ca if i % 2 else pair.cb
        assert (await client.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=1.0)))[0] == 201
    await wait_for(lambda: sum(1 for e in pair.events() if e[2] == "idle") >= 6, 15.0, "six idle events")
    await asyncio.sleep(1.0)
    assert sorted(sid for sid, _, to in pair.events() if to == "idle") == sids
    assert pair.a.service is not None and pair.b.service is not None
    assert (pair.a.service.counters["timer_fires"], pair.b.service.counters["timer_fires"]) == (6, 0)
    status, doc = await pair.cb.admin("GET", "/v1/sandboxes/sbx-00")
    assert status == 200 and doc["state"] == "idle" and doc["idle_blocked"] is None  # not active: no note


@pytest.mark.parametrize("pair", ["no_feed"], indirect=True)  # it counts every batch the replicas applied
async def test_feed_through_both_replicas_totals_exact(pair: Pair) -> None:
    for sid in ("sbx-a", "sbx-b"):
        await pair.ca.admin("PUT", f"/v1/sandboxes/{sid}", registration())
    # Reports are about bytes moved after the registration (earlier ones belong to a previous incarnation).
    await asyncio.sleep(0.2)
    epochs = {s: new_epoch(time.time_ns() + s, bytes([s]) * 8) for s in (1, 2)}

    async def post(client: Client, stream: int, seq: int, n: int) -> None:
        entries = [{"sandbox": sid, "bytes_in": n, "bytes_out": 2 * n, "open": 0, "idle_s": 0.0}
                   for sid in ("sbx-a", "sbx-b")]
        body = {"epoch": epochs[stream], "seq": seq, "sandboxes": entries}
        status, _, doc = await client.call("POST", f"/v1/feed?stream={stream}", as_="forwarder", body=body)
        assert status == 200 and doc == {"acked": seq}, doc

    # Two streams of the forwarder, each batch to either replica, all at once.
    for seq in range(1, 21):
        await asyncio.gather(*(post(pair.ca if (seq + stream) % 2 else pair.cb, stream, seq, 1000 * stream + seq)
                               for stream in (1, 2)))
    want_in = sum(1000 * stream + seq for stream in (1, 2) for seq in range(1, 21))
    assert pair.a.store is not None
    stored = {r.sandbox: (r.state.bytes_in, r.state.bytes_out) for r in pair.a.store.sandboxes()}
    assert stored == {"sbx-a": (want_in, 2 * want_in), "sbx-b": (want_in, 2 * want_in)}
    assert pair.a.service is not None and pair.b.service is not None
    assert pair.a.service.feed.answered["apply"] + pair.b.service.feed.answered["apply"] == 40
    # Either replica's status reads the shared store, not its own core (which may lag the other's writes).
    for client in (pair.ca, pair.cb):
        rows = {r["sandbox"]: r for r in (await client.admin("GET", "/v1/sandboxes"))[1]["sandboxes"]}
        assert (rows["sbx-a"]["bytes_in"], rows["sbx-b"]["bytes_out"]) == (want_in, 2 * want_in)
        assert (await client.admin("GET", "/v1/sandboxes/sbx-b"))[1]["bytes_in"] == want_in


@pytest.mark.parametrize("pair", [True], indirect=True)
async def test_a_wake_on_one_replica_answered_by_the_driver_on_the_other(pair: Pair) -> None:
    assert pair.platform is not None

    async def driver(ev: dict[str, object]) -> None:
        if ev["to"] == "waking":
            await asyncio.sleep(0.2)
            # The platform reports to the other replica than the one the gateway waits on.
            await pair.ca.admin("POST", f"/v1/sandboxes/{ev['sandbox']}/driver", {"event": "ready"})

    pair.platform.on_event = driver
    await pair.ca.admin("PUT", "/v1/sandboxes/sbx-1", registration(idle_period_s=0.3))
    await wait_for(lambda: ("sbx-1", "active", "idle") in pair.events(), 10.0, "idle")
    t0 = time.monotonic()
    status, _, doc = await pair.cb.call("POST", "/v1/sandboxes/sbx-1/wake?wait=10", as_="gateway")
    took = time.monotonic() - t0
    assert (status, doc) == (200, {"state": "active"})
    assert took < 5.0
    await asyncio.sleep(1.0)
    # Each webhook event reached the platform once, though both replicas run a sender.
    ids = [e["id"] for e in pair.platform.events]
    assert len(ids) == len(set(ids)), pair.platform.events
    assert [e["to"] for e in pair.platform.events][:2] == ["idle", "waking"]
    assert json.dumps(pair.events()).count('"waking"') == 2  # the event to waking and the one from it


async def test_a_stream_reporting_to_one_replica_is_live_for_both_and_forgotten_once(
    pg_server: pg_support.PgServer, pki: dict[str, Path]
) -> None:
    """The time of a stream's last batch is in the shared ledger: a stream whose batches all go to replica
    A is not stale to B's sweep; once it is silent, one of the two forgets it (once), and its sandbox
    under the connections policy idles a period later."""
    stale_s, period = 1.0, 0.5
    dsn = pg_support.fresh_schema(pg_server)
    a = await SchedulerApp(lambda: PgStore(dsn), pki, source_stale_s=stale_s).start()
    b = await SchedulerApp(lambda: PgStore(dsn), pki, source_stale_s=stale_s).start()
    p = Pair(a, b, None)
    try:
        await asyncio.sleep(stale_s)  # past both replicas' grace after their start
        body = registration(idle_period_s=period, activity="connections")
        assert (await p.cb.admin("PUT", "/v1/sandboxes/sbx-1", body))[0] == 201
        await asyncio.sleep(0.05)
        epoch = new_epoch(time.time_ns(), bytes(8))
        seq = 0
        live_until = time.time() + 3 * stale_s + period
        while time.time() < live_until:  # one worker with a connection open, reporting every interval
            seq += 1
            entry = {"sandbox": "sbx-1", "bytes_in": 0, "bytes_out": 0, "open": 1, "idle_s": 0.0}
            doc = {"epoch": epoch, "seq": seq, "sandboxes": [entry]}
            last = time.time()  # no later than the replica's receive time
            status, _, answer = await p.ca.call("POST", "/v1/feed?stream=3", as_="forwarder", body=doc)
            assert (status, answer) == (200, {"acked": seq})
            await asyncio.sleep(0.2)
        assert ("sbx-1", "active", "idle") not in p.events()
        await wait_for(lambda: ("sbx-1", "active", "idle") in p.events(), stale_s + period + 5.0, "idle")
        assert a.store is not None and a.service is not None and b.service is not None
        (idle,) = [e.event for e in a.store.events_after(0) if e.event.to_state.value == "idle"]
        assert idle.at >= last + stale_s + period
        assert a.service.counters["sources_forgotten"] + b.service.counters["sources_forgotten"] == 1
        (row,) = a.store.sandboxes()
        assert row.state.open_by == {}
    finally:
        await p.ca.close()
        await p.cb.close()
        await a.stop()
        await b.stop()
