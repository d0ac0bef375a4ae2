"""Idle timers through the whole chain (issue 10's tests): clients -> gateway -> forwarder -> sandbox, the
forwarder metering bytes and reporting them on the idle feed to the scheduler, whose timers decide. Real
parts: the scheduler's API on SQLite over mutual TLS, a forwarder with its feed reporter, the gateway on
the scheduler's routes, sandbox programs on loopback.

Bounds come from the issue: once traffic stops, the sandbox is idle within its period plus one report
interval plus 1 s, measured from the scheduler's own event time to the client's last byte (one host, one
clock)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent.parent
for sub in ("ingress", "gateway", "scheduler"):
    sys.path.insert(0, str(HERE / sub))
from fwd_support import ForwarderThread, Pki, SandboxApp, free_port, make_pki  # noqa: E402
from gw_support import DOMAIN, EchoHttp, GatewayThread, forwarder_settings, registration  # noqa: E402
from sched_support import Client, Platform, SchedulerApp, wait_for  # noqa: E402

from certs.loader import client_context  # noqa: E402
from certs.mint import mint_leaf, write_issued  # noqa: E402
from forwarder.ingress.feed_reporter import FeedReporter, reporter_for  # noqa: E402
from gateway.scheduler_routes import SchedulerRoutes  # noqa: E402
from scheduler.sqlite_store import SqliteStore  # noqa: E402

GATEWAY_SAN = "spiffe://sbxnet.test/gateway"
FEED_SAN = "spiffe://t/forwarder/1"  # sched_support's forwarder identity
INTERVAL = 0.25  # the feed's report interval here
STALE = 1.5  # the scheduler's source_stale_s here
OPEN_REFRESH = 0.5  # the forwarder's feed_open_refresh here


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


class Chain:
    def __init__(self, pki: Pki, sched: SchedulerApp, fwd: ForwarderThread, reporter: FeedReporter,
                 gw: GatewayThread, platform: Platform) -> None:
        self.pki, self.sched, self.fwd, self.reporter, self.gw, self.platform = pki, sched, fwd, reporter, gw, platform
        self.client = Client(sched)

    def state(self, sid: str) -> str | None:
        return self.sched.state(sid)  # committed, so its event is stored too

    def idle_events(self, sid: str) -> list[float]:
        assert self.sched.store is not None
        return [e.event.at for e in self.sched.store.events_after(0, 10000)
                if e.event.sandbox == sid and e.event.to_state == "idle"]

    async def register(self, sid: str, port: int, protocol: str = "http", **over: Any) -> None:
        body = registration(self.pki, self.fwd.port, {port: (protocol, "public")}, default=port)
        body.update(over)
        status, doc = await self.client.admin("PUT", f"/v1/sandboxes/{sid}", body)
        assert status in (200, 201), doc
        await asyncio.sleep(0.05)  # bytes are counted once the registration is older than them

    def tls(self, host: str) -> ssl.SSLSocket:
        """A client connection to the gateway for ``host`` offering no ALPN (what a raw route takes)."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        raw = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        return ctx.wrap_socket(raw, server_hostname=host)

    def get(self, host: str, path: str = "/") -> int:
        """One HTTP/1.1 request on its own connection; the status."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
        ctx.set_alpn_protocols(["http/1.1"])
        with socket.create_connection(("127.0.0.1", self.gw.port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return int(data.split(b" ", 2)[1])


@pytest.fixture
async def chain(pki: Pki, tmp_path: Path) -> AsyncIterator[Chain]:
    cert, key = write_issued(mint_leaf(pki.ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True),
                             pki.dir, "scheduler")
    sched_pki = {"ca": pki.ca_file, "scheduler": cert, "scheduler_key": key}
    platform = await Platform().start()
    # A feed stream silent for STALE seconds has its open connections forgotten; the forwarder reports
    # open-but-silent sandboxes again every OPEN_REFRESH, so a live stream never looks silent.
    # The forwarder's own reporter is the feed (no SchedulerApp feed), sent with its link certificate
    # (its SAN is FEED_SAN): the key the routes pin, so the scheduler idles these sandboxes on its evidence.
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki, webhook_url=platform.url,
                               gateway_allow=(GATEWAY_SAN,), source_stale_s=STALE, feed=False).start()
    settings = forwarder_settings(pki, feed_url=f"{sched.url}/v1/feed", feed_interval=INTERVAL,
                                  feed_open_refresh=OPEN_REFRESH)
    fwd = ForwarderThread(settings)

    async def start_reporter() -> FeedReporter:
        r = reporter_for(settings, fwd.server.meter, stream=0, metrics=fwd.server.metrics)
        assert r is not None
        r.start()
        return r

    reporter = fwd.call(start_reporter())
    gw_cert, gw_key = pki.paths["gateway"]
    ctx = client_context(cert_file=gw_cert, key_file=gw_key, ca_file=pki.ca_file)
    ctx.check_hostname = True
    gw = GatewayThread(pki, None, routes=lambda: SchedulerRoutes(sched.url, ctx), header_timeout=2.0,
                       tcp_idle_timeout=60.0)
    c = Chain(pki, sched, fwd, reporter, gw, platform)
    try:
        yield c
    finally:
        await c.client.close()
        await asyncio.to_thread(gw.stop)
        fwd.call(reporter.stop(final_timeout=1.0))
        await asyncio.to_thread(fwd.stop)
        await sched.stop()
        await platform.stop()


async def test_traffic_keeps_it_active_and_silence_idles_it_within_the_bound(chain: Chain) -> None:
    app = EchoHttp()
    try:
        period = 1.5
        await chain.register("busy", app.port, idle_period_s=period)
        started = time.time()
        last_byte = started
        while time.time() - started < 2 * period + 1:  # past its period twice over, a request every 0.3 s
            assert await asyncio.to_thread(chain.get, f"busy.{DOMAIN}") == 200
            last_byte = time.time()
            assert chain.state("busy") == "active"
            await asyncio.sleep(0.3)
        assert chain.idle_events("busy") == []
        await wait_for(lambda: chain.state("busy") == "idle", period + INTERVAL + 5, "idle after the traffic")
        (at,) = chain.idle_events("busy")
        assert at - last_byte <= period + INTERVAL + 1.0, at - last_byte
        assert at - last_byte >= period - 0.05  # and not before its period ran out
    finally:
        app.stop()


async def test_a_byte_every_second_keeps_it_alive_an_open_silent_connection_does_not(chain: Chain) -> None:
    tcp = SandboxApp(echo)
    try:
        period = 1.5
        await chain.register("term", tcp.port, protocol="tcp", idle_period_s=period)
        host = f"{tcp.port}-term.{DOMAIN}"
        s = await asyncio.to_thread(chain.tls, host)
        try:
            for _ in range(4):  # a byte a second for four seconds: more than twice the period
                await asyncio.to_thread(s.sendall, b".")
                assert await asyncio.to_thread(s.recv, 1) == b"."
                await asyncio.sleep(1.0)
            assert chain.state("term") == "active" and chain.idle_events("term") == []
            last_byte = time.time()
            # Open and silent: under the default (bytes) policy it goes idle all the same.
            await wait_for(lambda: chain.state("term") == "idle", period + INTERVAL + 5, "idle while open")
            (at,) = chain.idle_events("term")
            assert at - last_byte <= period + INTERVAL + 1.0
        finally:
            s.close()
    finally:
        tcp.join()


async def test_under_the_connections_policy_an_open_connection_keeps_it_active(chain: Chain) -> None:
    tcp = SandboxApp(echo)
    try:
        period = 1.0
        await chain.register("shell", tcp.port, protocol="tcp", idle_period_s=period, activity="connections")
        s = await asyncio.to_thread(chain.tls, f"{tcp.port}-shell.{DOMAIN}")
        await asyncio.to_thread(s.sendall, b"x")
        assert await asyncio.to_thread(s.recv, 1) == b"x"
        await asyncio.sleep(max(3 * period, 2 * STALE) + 1)  # silent but open, past the staleness too
        assert chain.state("shell") == "active" and chain.idle_events("shell") == []
        s.close()
        closed = time.time()
        await wait_for(lambda: chain.state("shell") == "idle", period + INTERVAL + 5, "idle after the close")
        (at,) = chain.idle_events("shell")
        assert at - closed <= period + INTERVAL + 1.0
    finally:
        tcp.join()


async def test_a_hold_keeps_it_active_without_traffic_then_expires(chain: Chain) -> None:
    app = EchoHttp()
    try:
        await chain.register("batch", app.port, idle_period_s=0.5)
        status, doc = await chain.client.admin("POST", "/v1/sandboxes/batch/hold", {"ttl_s": 2.0})
        assert status == 200
        await asyncio.sleep(1.5)
        assert chain.state("batch") == "active"
        await wait_for(lambda: chain.state("batch") == "idle", 5.0, "idle once the hold ends")
        (at,) = chain.idle_events("batch")
        assert at >= doc["hold_until"] + 0.5 - 0.01
    finally:
        app.stop()


async def test_scale_to_zero_and_back_with_the_feed_no_request_fails(chain: Chain) -> None:
    """Idle -> the platform stops the program -> a request wakes it and is answered; then the woken
    sandbox's own traffic, reported on the feed, keeps it active past its period."""
    port = free_port()  # the program's port, where it restarts
    app: list[EchoHttp | None] = [None]
    lock = threading.Lock()

    async def driver(ev: dict[str, Any]) -> None:
        if ev["to"] == "idle":
            _, answer = await chain.client.admin("POST", "/v1/sandboxes/zero/driver", {"event": "stopping"})
            if answer.get("proceed"):
                with lock:
                    running, app[0] = app[0], None
                if running is not None:
                    await asyncio.to_thread(running.stop)
                await chain.client.admin("POST", "/v1/sandboxes/zero/driver", {"event": "stopped"})
        elif ev["to"] == "waking":
            await asyncio.sleep(0.2)
            with lock:
                app[0] = EchoHttp(port)
            await chain.client.admin("POST", "/v1/sandboxes/zero/driver", {"event": "ready"})

    chain.platform.on_event = driver
    app[0] = EchoHttp(port)
    try:
        period = 1.0
        await chain.register("zero", port, idle_period_s=period)
        assert await asyncio.to_thread(chain.get, f"zero.{DOMAIN}") == 200
        await wait_for(lambda: chain.state("zero") == "stopped", 10.0, "stopped by the platform")
        statuses = await asyncio.gather(*(asyncio.to_thread(chain.get, f"zero.{DOMAIN}", f"/w{i}") for i in range(10)))
        assert statuses == [200] * 10
        assert chain.state("zero") == "active"
        woke = time.time()
        while time.time() - woke < 2 * period + 0.5:  # its own traffic keeps it up now
            assert await asyncio.to_thread(chain.get, f"zero.{DOMAIN}") == 200
            await asyncio.sleep(0.25)
        assert chain.state("zero") == "active"
        wakes = [e["to"] for e in chain.platform.events if e["sandbox"] == "zero"]
        assert wakes == ["idle", "waking"], wakes
    finally:
        with lock:
            running, app[0] = app[0], None
        if running is not None:
            running.stop()
