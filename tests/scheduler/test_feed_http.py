"""The feed's two HTTP adapters end to end over real mTLS on loopback: the forwarder's ``FeedReporter``
(a real ``Meter`` fed bytes by the test, a real ``Outbox``) against the scheduler's ``POST /v1/feed``
(``scheduler/feed_http.py``) on a real ``SqliteStore``. Totals are exact across a scheduler restart;
wrong CAs, unlisted SANs and malformed bodies are refused."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from certs import loader
from certs.mint import mint_ca, mint_leaf, write_issued
from forwarder.ingress.feed_outbox import Outbox
from forwarder.ingress.feed_reporter import FeedReporter
from forwarder.ingress.metering import Meter
from sbxnet.protocol.feed import new_epoch
from sbxnet.protocol.routes import pull_registration
from scheduler.feed_http import FeedService, serve
from scheduler.sqlite_store import SqliteStore
from scheduler.timers import SandboxConfig, TimerCore

FWD_SAN = "spiffe://t/forwarder/1"
PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
SANDBOXES = ("sbx-a", "sbx-b")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = mint_ca(), mint_ca("other CA")
    write_issued(ca, d, "ca")
    leaves = {
        "scheduler": (ca, mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True)),
        "forwarder": (ca, mint_leaf(ca, "fwd", uris=(FWD_SAN,), server=False, client=True)),
        "unlisted": (ca, mint_leaf(ca, "fwd2", uris=("spiffe://t/forwarder/2",), server=False, client=True)),
        "foreign": (other_ca, mint_leaf(other_ca, "fwd", uris=(FWD_SAN,), server=False, client=True)),
    }
    out = {"ca": d / "ca.crt"}
    for stem, (_, leaf) in leaves.items():
        write_issued(leaf, d, stem)
        out[stem], out[stem + "_key"] = d / f"{stem}.crt", d / f"{stem}.key"
    return out


def client_ctx(pki: dict[str, Path], stem: str = "forwarder") -> ssl.SSLContext:
    return loader.client_context(cert_file=pki[stem], key_file=pki[stem + "_key"], ca_file=pki["ca"])


def server_ctx(pki: dict[str, Path]) -> ssl.SSLContext:
    return loader.server_context(cert_file=pki["scheduler"], key_file=pki["scheduler_key"], ca_file=pki["ca"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def register_all(db: Path) -> None:
    """The sandboxes registered (as the registry's PUT will do), well before any traffic."""
    store, core = SqliteStore(db), TimerCore()
    try:
        at = time.time() - 60
        for sid in SANDBOXES:
            body = {
                "incarnation": "inc-1", "forwarder": {"address": "10.0.3.7:8443", "spki_pin": PIN},
                "target_ip": "10.200.1.5", "default_port": 8080,
                "ports": {"8080": {"protocol": "http", "auth": "public"}}, "idle_period_s": 300,
                "activity": "bytes",
            }
            r = pull_registration(json.dumps(body).encode())
            events = core.register(SandboxConfig(sid, r.incarnation, r.idle_period_s, r.activity, at), at)  # type: ignore[arg-type]
            store.put_registration(sid, r, at, core.snapshot(sid), events)
    finally:
        store.close()


def totals(db: Path) -> dict[str, tuple[int, int]]:
    store = SqliteStore(db)
    try:
        return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in store.sandboxes()}
    finally:
        store.close()


async def wait_for(cond: Callable[[], bool], timeout: float = 4.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.02)


class Scheduler:
    """The feed server on a fixed port over one SQLite file; stop and start again at will."""

    def __init__(self, db: Path, pki: dict[str, Path], port: int) -> None:
        self.db, self.pki, self.port = db, pki, port
        self.store: SqliteStore | None = None
        self.service: FeedService | None = None
        self._runner: object = None

    async def start(self) -> FeedService:
        self.store = SqliteStore(self.db)
        self.service = FeedService(self.store, allow=[FWD_SAN])
        self._runner = await serve(self.service, "127.0.0.1", self.port, server_ctx(self.pki))
        return self.service

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # type: ignore[attr-defined]
            self._runner = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def totals(self) -> dict[str, tuple[int, int]]:
        assert self.store is not None
        return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in self.store.sandboxes()}


class Traffic:
    """Bytes metered as a plane would: each chunk added to a live connection's ConnMeter."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.conns = {sid: meter.open(sid, f"{sid}-c1", time.monotonic()) for sid in SANDBOXES}
        self.sent = {sid: (0, 0) for sid in SANDBOXES}
        self.rng = random.Random(7)

    def move(self) -> None:
        for sid, m in self.conns.items():
            up, down = self.rng.randrange(1, 5000), self.rng.randrange(1, 90000)
            m.up += up
            m.down += down
            m.last_activity = time.monotonic()
            i, o = self.sent[sid]
            self.sent[sid] = (i + up, o + down)


def outbox() -> Outbox:
    rand = random.Random(3)
    return Outbox(lambda: new_epoch(time.time_ns(), os.urandom(8)), rand, backoff_initial_s=0.05, backoff_cap_s=0.3)


async def with_stack(
    tmp_path: Path, pki: dict[str, Path], body: Callable[[Scheduler, Traffic, FeedReporter], Awaitable[None]]
) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    fds = len(os.listdir("/proc/self/fd"))
    sched = Scheduler(db, pki, free_port())
    await sched.start()
    meter = Meter()
    reporter = FeedReporter(
        meter, outbox(), f"https://127.0.0.1:{sched.port}/v1/feed", client_ctx(pki), interval=0.05,
        request_timeout_s=1.0,
    )
    reporter.start()
    try:
        await body(sched, Traffic(meter), reporter)
    finally:
        await reporter.stop()
        await sched.stop()
    await asyncio.sleep(0)  # let closed transports finish closing
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert len(os.listdir("/proc/self/fd")) == fds


async def test_batches_arrive_and_totals_equal_the_bytes_metered(tmp_path: Path, pki: dict[str, Path]) -> None:
    async def body(sched: Scheduler, traffic: Traffic, reporter: FeedReporter) -> None:
        for _ in range(10):
            traffic.move()
            await asyncio.sleep(0.02)
        await wait_for(lambda: sched.totals() == traffic.sent)
        assert sched.service is not None and sched.service.answered.get("apply", 0) >= 1
        assert reporter.outbox.failures == {}

    await with_stack(tmp_path, pki, body)


async def test_scheduler_restart_on_the_same_file_loses_and_doubles_nothing(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    async def body(sched: Scheduler, traffic: Traffic, reporter: FeedReporter) -> None:
        traffic.move()
        await wait_for(lambda: sched.totals() == traffic.sent)
        await sched.stop()
        stopped_until = time.monotonic() + 2.0
        while time.monotonic() < stopped_until:  # metering goes on while the scheduler is away
            traffic.move()
            await asyncio.sleep(0.05)
        await wait_for(lambda: reporter.outbox.failures_total > 0)
        await sched.start()
        traffic.move()
        await wait_for(lambda: sched.totals() == traffic.sent)
        # Settled: nothing more arrives, nothing was applied twice.
        await wait_for(lambda: reporter.outbox.in_flight is None and reporter.outbox.pending_count == 0)
        await asyncio.sleep(0.2)
        assert sched.totals() == traffic.sent
        assert totals(sched.db) == traffic.sent

    await with_stack(tmp_path, pki, body)


async def post(pki: dict[str, Path], port: int, stem: str, data: bytes, query: str = "") -> tuple[int, str]:
    url, connector = f"https://127.0.0.1:{port}/v1/feed{query}", aiohttp.TCPConnector(ssl=client_ctx(pki, stem))
    async with aiohttp.ClientSession(connector=connector) as s, s.post(url, data=data) as r:
        return r.status, await r.text()


BATCH = b'{"epoch":"%s","seq":1,"sandboxes":[{"sandbox":"sbx-a","bytes_in":5,"bytes_out":7,"open":0,"idle_s":0.5}]}' % (
    new_epoch(time.time_ns(), bytes(8)).encode()
)


async def test_wrong_ca_fails_the_handshake_and_unlisted_san_gets_403(tmp_path: Path, pki: dict[str, Path]) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        with pytest.raises(aiohttp.ClientError):
            await post(pki, sched.port, "foreign", BATCH)
        assert service.forbidden == {} and service.answered == {}
        assert await post(pki, sched.port, "unlisted", BATCH) == (403, "forbidden")
        assert service.forbidden == {"san_not_allowed": 1} and service.answered == {}
        assert sched.totals() == {"sbx-a": (0, 0), "sbx-b": (0, 0)}
        assert await post(pki, sched.port, "forwarder", BATCH) == (200, '{"acked":1}')
        assert await post(pki, sched.port, "forwarder", BATCH) == (200, '{"acked":1}')  # a retry: not again
        assert sched.totals()["sbx-a"] == (5, 7)
        assert service.answered == {"apply": 1, "duplicate": 1}
        assert service.store.ledger(f"{FWD_SAN}#0") is not None and service.store.ledger(FWD_SAN) is None
    finally:
        await sched.stop()


def batch(epoch: str, seq: int, bytes_in: int = 5) -> bytes:
    entry = b'{"sandbox":"sbx-a","bytes_in":%d,"bytes_out":7,"open":0,"idle_s":0.5}' % bytes_in
    return b'{"epoch":"%s","seq":%d,"sandboxes":[%s]}' % (epoch.encode(), seq, entry)


async def test_each_stream_of_one_certificate_has_its_own_ledger(tmp_path: Path, pki: dict[str, Path]) -> None:
    """SO_REUSEPORT workers share the certificate: the same epoch and seq on two streams are two batches."""
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        epoch = new_epoch(time.time_ns(), bytes(8))
        assert await post(pki, sched.port, "forwarder", batch(epoch, 1), "?stream=0") == (200, '{"acked":1}')
        assert await post(pki, sched.port, "forwarder", batch(epoch, 1), "?stream=1023") == (200, '{"acked":1}')
        assert await post(pki, sched.port, "forwarder", batch(epoch, 1)) == (200, '{"acked":1}')  # 0 by default
        assert sched.totals()["sbx-a"] == (10, 14)
        assert service.answered == {"apply": 2, "duplicate": 1}
        stored = {s: service.store.ledger(f"{FWD_SAN}#{s}") for s in (0, 1023, 1)}
        assert stored[0] is not None and stored[1023] is not None and stored[1] is None
        assert (stored[0].epoch, stored[0].last_seq) == (epoch, 1)
        # A restarted worker: a newer epoch at seq 1 on its stream, the other stream untouched.
        newer = new_epoch(time.time_ns() + 1, bytes(8))
        assert await post(pki, sched.port, "forwarder", batch(newer, 1, 3), "?stream=1023") == (200, '{"acked":1}')
        assert sched.totals()["sbx-a"] == (13, 21)
        ledger = service.store.ledger(f"{FWD_SAN}#1023")
        assert ledger is not None and ledger.epoch == newer
        ledger = service.store.ledger(f"{FWD_SAN}#0")
        assert ledger is not None and ledger.epoch == epoch
    finally:
        await sched.stop()


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("?stream=1024", "bad_stream"),
        ("?stream=-1", "bad_stream"),
        ("?stream=01", "bad_stream"),
        ("?stream=", "bad_stream"),
        ("?stream=1e3", "bad_stream"),
        ("?stream=%EF%BC%91", "bad_stream"),  # a fullwidth digit: int() would take it
        ("?stream=1&stream=2", "bad_stream"),
        ("?worker=1", "unknown_parameter"),
        ("?stream=1&x=", "unknown_parameter"),
    ],
)
async def test_a_bad_stream_gets_400_with_the_reason(
    tmp_path: Path, pki: dict[str, Path], query: str, reason: str
) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        assert await post(pki, sched.port, "forwarder", BATCH, query) == (400, reason)
        assert service.refused == {reason: 1} and service.answered == {}
        assert sched.totals()["sbx-a"] == (0, 0)
    finally:
        await sched.stop()


async def test_replayed_out_of_order_and_stale_batches_are_refused_and_counted(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        start = time.time_ns()
        epoch, older = new_epoch(start, bytes(8)), new_epoch(start - 1, bytes(8))
        for seq in (1, 2, 3):
            assert await post(pki, sched.port, "forwarder", batch(epoch, seq)) == (200, f'{{"acked":{seq}}}')
        assert await post(pki, sched.port, "forwarder", batch(epoch, 1)) == (409, '{"error":"replay","acked":3}')
        assert await post(pki, sched.port, "forwarder", batch(epoch, 5)) == (409, '{"error":"gap","acked":3}')
        assert await post(pki, sched.port, "forwarder", batch(older, 1)) == (409, '{"error":"stale_epoch"}')
        newer = new_epoch(start + 1, bytes(8))
        assert await post(pki, sched.port, "forwarder", batch(newer, 2)) == (409, '{"error":"gap","acked":0}')
        assert sched.totals()["sbx-a"] == (15, 21)  # the three applied, nothing refused
        assert service.answered == {"apply": 3, "replay": 1, "gap": 2, "stale_epoch": 1}
        assert totals(db)["sbx-a"] == (15, 21)
    finally:
        await sched.stop()


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"{not json", 400, "bad_json"),
        (b'{"epoch":"x","seq":1,"sandboxes":[]}', 400, "bad_epoch"),
        (BATCH + b"[]", 400, "trailing_data"),
        (BATCH.replace(b'"seq":1', b'"seq":1,"extra":0'), 400, "unknown_field"),
    ],
)
async def test_malformed_body_gets_400_with_the_reason(
    tmp_path: Path, pki: dict[str, Path], data: bytes, status: int, reason: str
) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        assert await post(pki, sched.port, "forwarder", data) == (status, reason)
        assert service.refused == {reason: 1} and service.answered == {}
        assert sched.totals() == {"sbx-a": (0, 0), "sbx-b": (0, 0)}
    finally:
        await sched.stop()


async def test_a_store_that_fails_before_the_core_changed_is_500_without_a_rebuild(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    db = tmp_path / "sched.db"
    register_all(db)
    sched = Scheduler(db, pki, free_port())
    service = await sched.start()
    try:
        assert sched.store is not None
        sched.store.close()  # every read now fails: the ledger lookup, before anything is applied
        status, text = await post(pki, sched.port, "forwarder", BATCH)
        assert (status, text) == (500, "store_error")
        assert (service.store_errors, service.core_rebuilds) == (1, 0)
    finally:
        await sched.stop()
