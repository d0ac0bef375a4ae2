"""The gateway on the reference scheduler: routes looked up over mutual TLS (``SchedulerRoutes``), unknown
sandboxes 404, the scheduler down 503 with nothing cached, and scale to zero and back: a sandbox the
platform's driver stopped is woken by the requests that arrive for it — 50 at once cause one start, and
every one is answered. Real parts throughout: the scheduler's API on SQLite, a webhook receiver acting as
the platform's driver (it stops and starts the sandbox's program), a forwarder, the gateway."""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gw_support import DOMAIN, EchoHttp, GatewayThread, forwarder_settings, gateway_log, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scheduler"))  # sched_support
from fwd_support import ForwarderThread, Pki
from sched_support import Client, Platform, SchedulerApp, wait_for

from certs.loader import client_context
from certs.mint import mint_leaf, write_issued
from gateway.route_source import RouteLookupFailed
from gateway.scheduler_routes import SchedulerRoutes
from scheduler.sqlite_store import SqliteStore

GATEWAY_SAN = "spiffe://sbxnet.test/gateway"


def sched_pki(pki: Pki) -> dict[str, Path]:
    """The scheduler's certificate from the same CA, in the shape sched_support takes."""
    cert, key = write_issued(mint_leaf(pki.ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True),
                             pki.dir, "scheduler")
    fwd_cert, fwd_key = pki.paths["forwarder"]
    # The forwarder's own certificate for SchedulerApp's feed: the key the routes pin, so the scheduler
    # takes that feed as the evidence it idles these sandboxes on.
    return {"ca": pki.ca_file, "scheduler": cert, "scheduler_key": key, "forwarder": fwd_cert,
            "forwarder_key": fwd_key}


def gateway_client_ctx(pki: Pki) -> ssl.SSLContext:
    cert, key = pki.paths["gateway"]
    ctx = client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)
    ctx.check_hostname = True  # the scheduler is reached by name or address, not pinned
    return ctx


class Chain:
    def __init__(self, pki: Pki, sched: SchedulerApp, fwd: ForwarderThread, gw: GatewayThread) -> None:
        self.pki, self.sched, self.fwd, self.gw = pki, sched, fwd, gw
        self.client = Client(sched)
        self._session: aiohttp.ClientSession | None = None

    async def get(self, host: str, path: str = "/") -> tuple[int, bytes]:
        """One request through the gateway, as a browser for ``host`` would send it (SNI and Host)."""
        if self._session is None:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca_file))
            ctx.set_alpn_protocols(["http/1.1"])  # as a browser does: an HTTP route, whatever the lookup says
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=30))
        async with self._session.get(f"https://127.0.0.1:{self.gw.port}{path}", headers={"Host": host},
                                     server_hostname=host) as resp:
            return resp.status, await resp.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self.client.close()


def no_alpn_read(c: Chain, host: str) -> bytes:
    """A client that offers no ALPN (as a raw-route client does): what it reads after sending a line."""
    ctx = ssl.create_default_context(cafile=str(c.pki.ca_file))
    import socket

    with socket.create_connection(("127.0.0.1", c.gw.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        try:
            tls.sendall(b"hello\n")
            return tls.recv(100)
        except (ssl.SSLError, ConnectionError):
            return b""


@pytest.fixture
async def chain(pki: Pki, tmp_path: Path) -> AsyncIterator[Chain]:
    platform = await Platform().start()
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki(pki), webhook_url=platform.url,
                               gateway_allow=(GATEWAY_SAN,)).start()
    fwd = ForwarderThread(forwarder_settings(pki))
    url, ctx = sched.url, gateway_client_ctx(pki)
    gw = GatewayThread(pki, None, routes=lambda: SchedulerRoutes(url, ctx), header_timeout=2.0, wake_wait=10.0)
    c = Chain(pki, sched, fwd, gw)
    c.platform = platform  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        await c.close()
        await asyncio.to_thread(gw.stop)
        await asyncio.to_thread(fwd.stop)
        await sched.stop()
        await platform.stop()


async def register(c: Chain, sid: str, app_port: int, **over: Any) -> None:
    body = registration(c.pki, c.fwd.port, {app_port: ("http", "public")}, default=app_port)
    body.update(over)
    status, doc = await c.client.admin("PUT", f"/v1/sandboxes/{sid}", body)
    assert status in (200, 201), doc


async def test_routes_come_from_the_scheduler(chain: Chain) -> None:
    app = EchoHttp()
    try:
        await register(chain, "alpha", app.port)
        status, body = await chain.get(f"alpha.{DOMAIN}", "/hi")
        assert status == 200 and json.loads(body)["path"] == "/hi"
        status, body = await chain.get(f"nobody.{DOMAIN}")
        assert status == 404
        # Removed from the registry: unknown once the cached route expires (max-age=2).
        assert (await chain.client.admin("DELETE", "/v1/sandboxes/alpha"))[0] == 200
        await asyncio.sleep(2.2)
        assert (await chain.get(f"alpha.{DOMAIN}"))[0] == 404
    finally:
        app.stop()


async def test_the_scheduler_down_is_503_and_nothing_is_cached(chain: Chain) -> None:
    app = EchoHttp()
    try:
        await register(chain, "alpha", app.port)
        await chain.sched.stop()
        await asyncio.sleep(2.2)  # the route cached by an earlier lookup (none here) would have expired
        status, body = await chain.get(f"alpha.{DOMAIN}")
        assert status == 503 and b"route service is unavailable" in body
        assert await asyncio.to_thread(no_alpn_read, chain, f"alpha.{DOMAIN}") == b""  # could be raw: closed
        await chain.sched.start()
        status, _ = await chain.get(f"alpha.{DOMAIN}")
        assert status == 200
    finally:
        app.stop()


async def test_scale_to_zero_and_back_with_one_wake_for_fifty_requests(chain: Chain) -> None:
    platform: Platform = chain.platform  # type: ignore[attr-defined]
    app: list[EchoHttp] = [EchoHttp()]
    port = app[0].port
    starts: list[float] = []

    async def driver(ev: dict[str, Any]) -> None:
        """The platform: stop the program when the sandbox goes idle, start it again on a wake."""
        sid = ev["sandbox"]
        if ev["to"] == "idle":
            _, doc = await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopping"})
            if doc.get("proceed"):
                await asyncio.to_thread(app[0].stop)
                await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopped"})
        elif ev["to"] == "waking":
            starts.append(time.monotonic())
            await asyncio.sleep(0.3)  # the program takes a while to start
            app[0] = EchoHttp(port)
            await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "ready"})

    platform.on_event = driver
    try:
        await register(chain, "sleepy", port, idle_period_s=0.5)
        assert (await chain.get(f"sleepy.{DOMAIN}"))[0] == 200
        sched = chain.sched
        await wait_for(lambda: sched.state("sleepy") == "stopped",
                       10.0, "stopped by the driver")
        # No forwarder feed here to say the wake's traffic is activity: a longer period keeps the woken
        # sandbox from idling again mid-test (the same incarnation keeps its state: stopped).
        await register(chain, "sleepy", port, idle_period_s=60)
        t0 = time.monotonic()
        async def timed(i: int) -> tuple[int, bytes]:
            t = time.monotonic()
            status, body = await chain.get(f"sleepy.{DOMAIN}", f"/r{i}")
            return status, body + f" after {time.monotonic() - t:.2f}s start {t - t0:.2f}".encode()

        answers = await asyncio.gather(*(timed(i) for i in range(50)))
        answers = [(s, b.rsplit(b" after ", 1)[0] if s == 200 else b) for s, b in answers]
        elapsed = time.monotonic() - t0
        assert [s for s, _ in answers] == [200] * 50, {b for s, b in answers if s != 200}
        assert sorted(json.loads(b)["path"] for _, b in answers) == sorted(f"/r{i}" for i in range(50))
        assert len(starts) == 1, "one start for fifty requests"
        assert [e["to"] for e in platform.events] == ["idle", "waking"]
        assert chain.gw.sample("sbxnet_gateway_wakes_total") == 1
        assert elapsed < 10.0
        _, doc = await chain.client.admin("GET", "/v1/sandboxes/sleepy")
        assert doc["state"] == "active"
    finally:
        app[0].stop()


async def test_scheduler_routes_client_answers(pki: Pki, tmp_path: Path) -> None:
    """The client alone: found with the TTL the scheduler gave, unknown, woken, and every failure one
    RouteLookupFailed (unreachable, another CA, a certificate the scheduler does not take as a gateway's)."""
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki(pki),
                               gateway_allow=(GATEWAY_SAN,), route_cache_s=7, negative_cache_s=3).start()
    client = Client(sched)
    routes = SchedulerRoutes(sched.url, gateway_client_ctx(pki), timeout_s=2.0)
    try:
        body = registration(pki, 8443, {8080: ("http", "token")}, default=8080)
        assert (await client.admin("PUT", "/v1/sandboxes/alpha", body))[0] == 201
        found = await routes.lookup("alpha")
        assert found.ttl == 7 and found.route is not None and found.route.sandbox == "alpha"
        assert found.route.token_sha256 == hashlib.sha256(b"s3cret-token").hexdigest()
        missing = await routes.lookup("nobody")
        assert (missing.route, missing.ttl) == (None, 3)
        assert await routes.wake("alpha", 1.0) == "active"
        assert await routes.wake("nobody", 1.0) == "unknown"
        other_cert, other_key = write_issued(mint_leaf(pki.ca, "not-a-gateway", uris=("spiffe://sbxnet.test/x",),
                                                       server=False, client=True), pki.dir, "not-a-gateway")
        forwarder_ctx = client_context(cert_file=other_cert, key_file=other_key, ca_file=pki.ca_file)
        not_gateway = SchedulerRoutes(sched.url, forwarder_ctx)
        with pytest.raises(RouteLookupFailed) as refused:
            await not_gateway.lookup("alpha")
        assert refused.value.reason == "status_403"
        await not_gateway.close()
        other = ssl.create_default_context()  # the system's CAs: the scheduler's certificate is not theirs
        stranger = SchedulerRoutes(sched.url, other)
        with pytest.raises(RouteLookupFailed) as untrusted:
            await stranger.lookup("alpha")
        assert untrusted.value.reason == "unreachable"
        await stranger.close()
        await sched.stop()
        with pytest.raises(RouteLookupFailed) as down:
            await routes.lookup("alpha")
        assert down.value.reason == "unreachable"
        assert routes.failures == {"unreachable": 1}
    finally:
        await routes.close()
        await client.close()
        await sched.stop()


async def _open_clients(c: Chain, host: str, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    ctx = ssl.create_default_context(cafile=str(c.pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    return list(await asyncio.gather(*(asyncio.open_connection("127.0.0.1", c.gw.port, ssl=ctx, server_hostname=host)
                                       for _ in range(n))))


async def _status_of(reader: asyncio.StreamReader) -> int:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    return int(head.split(b" ", 2)[1])


async def test_fifty_requests_for_an_uncached_sandbox_make_one_lookup(pki: Pki, tmp_path: Path) -> None:
    """50 requests for a sandbox not in the route cache, sent at once on connections already open: the
    scheduler answers one lookup (its own count), and every request is answered from it. The route's
    max-age is long, so a request that came after the lookup would hit the cache, never look again."""
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki(pki), route_cache_s=60,
                               gateway_allow=(GATEWAY_SAN,)).start()
    fwd = ForwarderThread(forwarder_settings(pki))
    url, ctx = sched.url, gateway_client_ctx(pki)
    gw = GatewayThread(pki, None, routes=lambda: SchedulerRoutes(url, ctx), header_timeout=5.0)
    c = Chain(pki, sched, fwd, gw)
    app = EchoHttp()
    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        await register(c, "many", app.port)
        host = f"many.{DOMAIN}"
        clients = await _open_clients(c, host, 50)
        assert sched.service is not None
        before = sched.service.counters["route_lookups"]
        for i, (_, w) in enumerate(clients):
            w.write(f"GET /r{i} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        await asyncio.gather(*(w.drain() for _, w in clients))
        statuses = await asyncio.gather(*(_status_of(r) for r, _ in clients))
        assert statuses == [200] * 50
        assert sched.service.counters["route_lookups"] - before == 1
        # Each request missed the cache, or (on a loaded machine, read after the lookup was answered) hit it.
        assert sum(gw.sample("sbxnet_gateway_route_cache_total", {"result": r}) for r in ("miss", "hit")) == 50
        assert gw.sample("sbxnet_gateway_route_lookups_total") == 1
    finally:
        for _, w in clients:
            w.close()
        app.stop()
        await c.close()
        await asyncio.to_thread(gw.stop)
        await asyncio.to_thread(fwd.stop)
        await sched.stop()


async def test_the_scheduler_down_serves_the_last_route_it_gave_for_a_bounded_time(pki: Pki, tmp_path: Path) -> None:
    """The scheduler stopped: a sandbox whose route it gave less than ``route_stale_s`` ago is still
    served (counted, logged once); a name it answered "unknown" is not, nor one it never gave; past the
    bound, 503. Times: the gateway's bound runs from the last answer, which came before the test's request
    that caused it returned, so sleeping from there past the bound is past it."""
    stale_s = 6.0
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki(pki), route_cache_s=1,
                               negative_cache_s=1, gateway_allow=(GATEWAY_SAN,)).start()
    fwd = ForwarderThread(forwarder_settings(pki))
    url, ctx = sched.url, gateway_client_ctx(pki)
    gw = GatewayThread(pki, None, routes=lambda: SchedulerRoutes(url, ctx), route_stale_s=stale_s)
    c = Chain(pki, sched, fwd, gw)
    app = EchoHttp()
    try:
        await register(c, "alpha", app.port)
        await register(c, "beta", app.port)
        assert (await c.get(f"beta.{DOMAIN}"))[0] == 200
        assert (await c.client.admin("DELETE", "/v1/sandboxes/beta"))[0] == 200
        await asyncio.sleep(1.2)  # beta's cached route expires ...
        assert (await c.get(f"beta.{DOMAIN}"))[0] == 404  # ... and the scheduler says it does not know it
        with gateway_log() as log:  # (the client's keep-alive connection stays open: no quiet wait)
            assert (await c.get(f"alpha.{DOMAIN}", "/a1"))[0] == 200
            given = time.monotonic()  # the scheduler gave alpha's route before this
            await sched.stop()
            await asyncio.sleep(1.2)  # alpha's cached route has expired: each request looks it up, and fails
            for i in range(3):
                status, body = await c.get(f"alpha.{DOMAIN}", f"/stale{i}")
                assert status == 200 and json.loads(body)["path"] == f"/stale{i}", (status, body)
            served_at = time.monotonic()
            assert (await c.get(f"beta.{DOMAIN}"))[0] == 503  # answered "unknown": never a stale route
            assert (await c.get(f"nobody.{DOMAIN}"))[0] == 503  # never known
            stale_lines = log.events("route_stale")
        assert served_at - given < stale_s  # the stale answers above came inside the bound
        assert gw.sample("sbxnet_gateway_route_cache_total", {"result": "stale"}) == 3
        assert len(stale_lines) == 1 and stale_lines[0]["sandbox_id"] == "alpha", stale_lines  # said once
        await asyncio.sleep(max(0.0, given + stale_s + 0.2 - time.monotonic()))
        status, body = await c.get(f"alpha.{DOMAIN}")
        assert status == 503 and b"route service is unavailable" in body  # past the bound
        await sched.start()
        assert (await c.get(f"alpha.{DOMAIN}"))[0] == 200
    finally:
        app.stop()
        await c.close()
        await asyncio.to_thread(gw.stop)
        await asyncio.to_thread(fwd.stop)
        await sched.stop()


async def test_a_new_client_context_serves_the_next_calls_and_lets_those_in_flight_finish(pki: Pki) -> None:
    """``SchedulerRoutes.use_ssl_context`` (SIGHUP reloaded the scheduler client's certificate): the next
    lookup presents the new certificate on a new connection, though one with the old was kept alive; a wake
    in flight at the swap finishes on its connection, which is closed once it has. A stand-in scheduler that
    holds each wake until told, and notes the client certificate each request came with."""
    from aiohttp import web

    seen: list[tuple[str, list[str]]] = []
    release = asyncio.Event()

    def sans(request: web.Request) -> list[str]:
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        return [v for k, v in (cert or {}).get("subjectAltName", ()) if k == "URI"]

    async def lookup(request: web.Request) -> web.Response:
        seen.append((request.path, sans(request)))
        return web.Response(status=404, headers={"Cache-Control": "max-age=0"})

    async def wake(request: web.Request) -> web.Response:
        seen.append((request.path, sans(request)))
        await release.wait()
        return web.Response(status=200)

    paths = sched_pki(pki)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(paths["ca"]))
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    server_ctx.load_cert_chain(paths["scheduler"], paths["scheduler_key"])
    app = web.Application()
    app.router.add_get("/v1/routes/{sandbox}", lookup)
    app.router.add_post("/v1/sandboxes/{sandbox}/wake", wake)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = runner.addresses[0][1]
    renewed = "spiffe://sbxnet.test/gateway-renewed"
    cert, key = write_issued(mint_leaf(pki.ca, "gateway-renewed", uris=(renewed,), server=False, client=True),
                             pki.dir, "gateway-renewed")
    new_ctx = client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)
    new_ctx.check_hostname = True
    routes = SchedulerRoutes(f"https://127.0.0.1:{port}", gateway_client_ctx(pki), timeout_s=5.0)
    try:
        assert (await routes.lookup("a")).route is None  # a connection kept alive, with the first certificate
        waking = asyncio.create_task(routes.wake("b", 5.0))
        await wait_for(lambda: len(seen) == 2)
        old_session = routes._session
        assert old_session is not None
        routes.use_ssl_context(new_ctx)
        assert (await routes.lookup("c")).route is None
        assert not waking.done() and not old_session.closed  # the wake in flight keeps its connection
        release.set()
        assert await waking == "active"
        await wait_for(lambda: old_session.closed)  # closed once its last call ended
        assert routes.failures == {}
        assert seen == [("/v1/routes/a", [GATEWAY_SAN]), ("/v1/sandboxes/b/wake", [GATEWAY_SAN]),
                        ("/v1/routes/c", [renewed])]
    finally:
        release.set()
        await routes.close()
        await runner.cleanup()


def _leave_after(c: Chain, host: str, wait: float) -> None:
    """A client that sends a request, then resets its connection ``wait`` seconds later without an answer."""
    import socket
    import struct

    ctx = ssl.create_default_context(cafile=str(c.pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", c.gw.port), timeout=10)
    tls = ctx.wrap_socket(raw, server_hostname=host)
    tls.sendall(f"GET /gone HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    time.sleep(wait)
    tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    tls.close()


async def test_a_client_gone_during_a_wake_ends_its_exchange_and_the_wake_goes_on(chain: Chain) -> None:
    """Issue 22 (point 4's rule): a client that leaves while its request waits for the sandbox's wake is
    logged ``client_gone`` at once; the wake it asked for goes on, and nothing reaches the app it woke."""
    platform: Platform = chain.platform  # type: ignore[attr-defined]
    app: list[EchoHttp] = [EchoHttp()]
    port = app[0].port

    async def driver(ev: dict[str, Any]) -> None:
        sid = ev["sandbox"]
        if ev["to"] == "idle":
            _, doc = await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopping"})
            if doc.get("proceed"):
                await asyncio.to_thread(app[0].stop)
                await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopped"})
        elif ev["to"] == "waking":
            await asyncio.sleep(4.0)  # the program takes a while to start
            app[0] = EchoHttp(port)
            await chain.client.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "ready"})

    platform.on_event = driver
    try:
        await register(chain, "sleepy", port, idle_period_s=0.5)
        assert (await chain.get(f"sleepy.{DOMAIN}"))[0] == 200
        sched = chain.sched
        await wait_for(lambda: sched.state("sleepy") == "stopped", 10.0, "stopped by the driver")
        await register(chain, "sleepy", port, idle_period_s=60)
        with gateway_log() as log:  # the earlier request's line is written already
            # The cached route says active: the link is tried first, the forwarder answers NOT_LISTENING
            # (its connect_deadline: 1 s), the route is looked up again and the wake asked for; then the
            # client leaves.
            await asyncio.to_thread(_leave_after, chain, f"sleepy.{DOMAIN}", 2.0)
            await wait_for(lambda: sched.state("sleepy") == "active", 15.0, "woken all the same")
            await asyncio.sleep(0.5)  # a request still waiting for the wake would reach the app now
            lines = log.events("request")
        assert [(line["status"], line["reason"], line["sandbox_id"]) for line in lines] == \
            [(0, "client_gone", "sleepy")], lines
        assert lines[0]["duration"] < 3.5, lines  # the program took 4 s to start
        assert app[0].requests == []
        assert [e["to"] for e in platform.events] == ["idle", "waking"]
        assert chain.gw.sample("sbxnet_gateway_wakes_total") == 1  # asked for before the client left
    finally:
        app[0].stop()
