"""Open connections per feed stream (docs/scheduler-api.md, "Decisions ... Taken by the service"): the
scheduler's API over real mTLS on loopback on a real SQLite file, a forwarder certificate posting to
``POST /v1/feed?stream=<n>`` as two workers would, the timer loop running. Two streams each with a
connection open on one sandbox under the ``connections`` policy keep it active until both have closed; a
stream that restarts (a new epoch) without its old connections leaves no count behind; a stream that goes
silent with connections open is forgotten ``source_stale_s`` after its last batch, while a stream that
keeps reporting keeps its own. Then ``SchedulerService.forget_stale`` with a fake clock: nothing is
forgotten in the first ``source_stale_s`` after a start, the counts a migrated row kept without a source
go then, a forgotten stream is live again at its next batch, and 0 turns it off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sched_support import Client, SchedulerApp, mint_pki, registration, wait_for
from test_store_contract import PIN, reg

from sbxnet.errors import LocalProtocolError
from sbxnet.protocol.feed import Batch, SandboxReport, new_epoch
from scheduler.service import SchedulerService
from scheduler.settings import SchedulerSettings
from scheduler.sqlite_store import SqliteStore
from scheduler.store import UNATTRIBUTED, ingest_batch
from scheduler.timers import State

PERIOD = 0.5
SLACK = 1.5  # on top of the bounds the rules give: the machine is shared


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


class Feed:
    """One forwarder's streams, posting batches of open counts as its workers would."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.epochs: dict[int, str] = {}
        self.seqs: dict[int, int] = {}

    def restart(self, stream: int) -> None:
        self.epochs[stream] = new_epoch(time.time_ns(), bytes([stream]) * 8)
        self.seqs[stream] = 0

    async def post(self, stream: int, open_: dict[str, int] | None = None) -> None:
        """One batch on ``stream``: each sandbox's connections open at that worker, no bytes."""
        if stream not in self.epochs:
            self.restart(stream)
        self.seqs[stream] += 1
        entries = [{"sandbox": sid, "bytes_in": 0, "bytes_out": 0, "open": n, "idle_s": 0.0}
                   for sid, n in (open_ or {}).items()]
        body = {"epoch": self.epochs[stream], "seq": self.seqs[stream], "sandboxes": entries}
        status, _, doc = await self.client.call("POST", f"/v1/feed?stream={stream}", as_="forwarder", body=body)
        assert (status, doc) == (200, {"acked": self.seqs[stream]})


class Stack:
    def __init__(self, app: SchedulerApp) -> None:
        self.app = app
        self.client = Client(app)
        self.feed = Feed(self.client)

    async def register(self, *sids: str) -> None:
        for sid in sids:
            body = registration(idle_period_s=PERIOD, activity="connections")
            assert (await self.client.admin("PUT", f"/v1/sandboxes/{sid}", body))[0] == 201
        await asyncio.sleep(0.05)  # reports are about activity after the registration

    async def row(self, sid: str) -> dict[str, Any]:
        status, doc = await self.client.admin("GET", f"/v1/sandboxes/{sid}")
        assert status == 200
        row: dict[str, Any] = doc
        return row

    def idle_at(self, sid: str) -> list[float]:
        assert self.app.store is not None
        return [e.event.at for e in self.app.store.events_after(0) if e.event.sandbox == sid
                and e.event.to_state is State.IDLE]


@pytest.fixture
async def stack(tmp_path: Path, pki: dict[str, Path], request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    stale_s = getattr(request, "param", 30.0)
    app = await SchedulerApp(lambda: SqliteStore(tmp_path / "sched.db"), pki, source_stale_s=stale_s).start()
    s = Stack(app)
    try:
        yield s
    finally:
        await s.client.close()
        await app.stop()


async def test_two_streams_each_with_a_connection_keep_it_active_until_both_close(stack: Stack) -> None:
    await stack.register("sbx-a")
    await stack.feed.post(0, {"sbx-a": 1})
    await stack.feed.post(1, {"sbx-a": 1})
    assert (await stack.row("sbx-a"))["open_connections"] == 2
    await stack.feed.post(0, {"sbx-a": 0})  # worker 0's connection closes; worker 1's stays open, silent
    await asyncio.sleep(3 * PERIOD + 0.5)
    row = await stack.row("sbx-a")
    assert (row["state"], row["open_connections"], row["idle_in_s"]) == ("active", 1, None)
    assert stack.idle_at("sbx-a") == []
    t0 = time.time()
    await stack.feed.post(1, {"sbx-a": 0})
    t1 = time.time()
    await wait_for(lambda: bool(stack.idle_at("sbx-a")), PERIOD + 5.0, "idle after both closed")
    (at,) = stack.idle_at("sbx-a")
    assert t0 + PERIOD <= at <= t1 + PERIOD + SLACK


async def test_a_stream_restarted_without_its_connections_leaves_no_count(stack: Stack) -> None:
    await stack.register("sbx-a", "sbx-b")
    await stack.feed.post(0, {"sbx-a": 2, "sbx-b": 1})
    await stack.feed.post(1, {"sbx-b": 1})
    await asyncio.sleep(2 * PERIOD)
    assert stack.idle_at("sbx-a") == [] and stack.idle_at("sbx-b") == []
    stack.feed.restart(0)  # the worker was killed and started again: a new epoch, nothing open yet
    t0 = time.time()
    await stack.feed.post(0)
    t1 = time.time()
    rows = {sid: await stack.row(sid) for sid in ("sbx-a", "sbx-b")}
    assert (rows["sbx-a"]["open_connections"], rows["sbx-b"]["open_connections"]) == (0, 1)
    await wait_for(lambda: bool(stack.idle_at("sbx-a")), PERIOD + 5.0, "sbx-a idle after the restart")
    (at,) = stack.idle_at("sbx-a")
    assert t0 + PERIOD <= at <= t1 + PERIOD + SLACK
    assert stack.idle_at("sbx-b") == [] and (await stack.row("sbx-b"))["state"] == "active"  # worker 1's


STALE_S = 1.0


@pytest.mark.parametrize("stack", [STALE_S], indirect=True)
async def test_a_stream_gone_silent_is_forgotten_and_a_reporting_one_is_not(stack: Stack) -> None:
    await asyncio.sleep(STALE_S)  # past the start's grace
    await stack.register("sbx-a", "sbx-b")
    t0 = time.time()
    await stack.feed.post(0, {"sbx-a": 1})  # then worker 0 dies with it open: never a report again
    t1 = time.time()
    live_until = t1 + STALE_S + PERIOD + SLACK + 1.0
    while time.time() < live_until:  # worker 1 reports its open connection every interval
        await stack.feed.post(1, {"sbx-b": 1})
        await asyncio.sleep(0.2)
    await wait_for(lambda: bool(stack.idle_at("sbx-a")), 5.0, "sbx-a idle after its stream went silent")
    (at,) = stack.idle_at("sbx-a")
    sweep = min(1.0, STALE_S / 4)
    assert t0 + STALE_S + PERIOD <= at <= t1 + STALE_S + sweep + PERIOD + SLACK
    row = await stack.row("sbx-b")
    assert (row["state"], row["open_connections"]) == ("active", 1) and stack.idle_at("sbx-b") == []
    assert stack.app.service is not None and stack.app.service.counters["sources_forgotten"] == 1


# --- forget_stale with a fake clock ----------------------------------------------------------------------

S0, S1 = "spiffe://t/forwarder/1#0", "spiffe://t/forwarder/1#1"


def opens(epoch: str, seq: int, *entries: tuple[str, int]) -> Batch:
    return Batch(epoch, seq, tuple(SandboxReport(s, 0, 0, n, 0.0) for s, n in entries))


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_forget_stale_waits_its_period_after_a_start_then_forgets_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    clock = Clock(100.0)
    first = SchedulerService(store, forwarder_allow=[], now=clock, source_stale_s=30.0)
    for sid in ("sbx-a", "sbx-b", "sbx-c"):
        first.register(sid, reg(period=10, activity="connections"))
    e1 = new_epoch(1_000, bytes(8))
    ingest_batch(first.core, store, S0, opens(e1, 1, ("sbx-a", 1), ("sbx-b", 2)), 101.0)
    ingest_batch(first.core, store, S1, opens(e1, 1, ("sbx-b", 1)), 101.0)
    with store.transaction() as tx:  # a migrated row's count, from before counts had a source
        first.core.on_report("sbx-c", 0, 0, 3, 101.0, 101.0, UNATTRIBUTED)
        tx.save({"sbx-c": first.core.snapshot("sbx-c")}, [])
    # The scheduler restarts at 500: every stream's last batch is old, live or not.
    clock.t = 500.0
    service = SchedulerService(store, forwarder_allow=[], now=clock, source_stale_s=30.0)
    clock.t = 529.9
    assert service.forget_stale() == [] and service.counters["sources_forgotten"] == 0
    assert {r.sandbox: r.state.open_by for r in store.sandboxes()}["sbx-b"] == {S0: 2, S1: 1}
    # S1 reports again within the grace (it is alive); S0 does not.
    # Through the service's feed adapter, as the forwarder the routes name (the routes' pin): its feed is
    # live from here, so the byte timers of its sandboxes run (the scheduler idles only on a live feed).
    clock.t = 520.0
    assert service.feed.ingest(S1, opens(e1, 2, ("sbx-b", 1)), PIN) is not None
    clock.t = 530.0
    assert service.forget_stale() == []  # no state changes: the events are none
    rows = {r.sandbox: r.state for r in store.sandboxes()}
    assert {s: st.open_by for s, st in rows.items()} == {"sbx-a": {}, "sbx-b": {S1: 1}, "sbx-c": {}}
    assert (rows["sbx-a"].last_activity, rows["sbx-c"].last_activity) == (530.0, 530.0)  # idle from now
    assert service.counters["sources_forgotten"] == 1  # S0 (the unattributed counts are no stream)
    assert service.core.next_timer() == 540.0
    clock.t = 600.0
    service.forget_stale()  # S1 is stale now; S0 was forgotten already
    assert service.counters["sources_forgotten"] == 2
    assert [r.state.open_by for r in store.sandboxes()] == [{}, {}, {}]
    # S0 comes back (a new epoch) and is live again until it is silent for source_stale_s.
    e2 = new_epoch(2_000, bytes(8))
    ingest_batch(service.core, store, S0, opens(e2, 1, ("sbx-a", 1)), 610.0)
    clock.t = 639.0
    service.forget_stale()
    assert service.counters["sources_forgotten"] == 2 and service.core.snapshot("sbx-a").open_by == {S0: 1}
    clock.t = 641.0
    service.forget_stale()
    assert service.counters["sources_forgotten"] == 3 and service.core.snapshot("sbx-a").open_by == {}
    store.close()


def test_source_stale_s_0_never_forgets_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    clock = Clock(100.0)
    service = SchedulerService(store, forwarder_allow=[], now=clock, source_stale_s=0.0)
    service.register("sbx-a", reg(period=10, activity="connections"))
    ingest_batch(service.core, store, S0, opens(new_epoch(1_000, bytes(8)), 1, ("sbx-a", 1)), 101.0)
    clock.t = 1e9
    assert service.forget_stale() == [] and service.core.snapshot("sbx-a").open_by == {S0: 1}
    for bad in (-1.0, float("nan")):
        with pytest.raises(LocalProtocolError):
            SchedulerService(store, forwarder_allow=[], now=clock, source_stale_s=bad)
    store.close()


def test_the_setting_defaults_to_30_s_and_refuses_a_negative_one(
    pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    base: dict[str, Any] = {
        "cert_file": pki["scheduler"], "key_file": pki["scheduler_key"], "ca_file": pki["ca"],
        "gateway_san_allow": ["spiffe://t/gateway"], "forwarder_san_allow": ["spiffe://t/forwarder/1"],
        "admin_token_sha256": "0" * 64,
    }
    assert SchedulerSettings(**base).source_stale_s == 30.0
    assert SchedulerSettings(**base, source_stale_s=0).source_stale_s == 0.0
    with pytest.raises(ValidationError, match="source_stale_s"):
        SchedulerSettings(**base, source_stale_s=-1)
    monkeypatch.setenv("SBXNET_SCHEDULER_SOURCE_STALE_S", "5")
    assert SchedulerSettings(**base).source_stale_s == 5.0
