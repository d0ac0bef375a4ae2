"""A real scheduler for tests: its HTTP API (``scheduler.api_http``) over real TLS on loopback, on a real
store, with test-minted certificates; and a platform webhook receiver that can act as the driver."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from certs import loader
from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued
from sbxnet.protocol.feed import new_epoch, push_columns
from scheduler.api_http import Api
from scheduler.service import SchedulerService
from scheduler.store import Store, load_core
from scheduler.store_thread import StoreThread
from scheduler.webhook import WebhookSender

GATEWAY_SAN = "spiffe://t/gateway"
FORWARDER_SAN = "spiffe://t/forwarder/1"
ADMIN_TOKEN = "admin-token-for-tests"
ADMIN_SHA = hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PIN = base64.b64encode(hashlib.sha256(b"spki").digest()).decode()
# The SPKI pin of the forwarder certificate ``mint_pki`` minted last: ``registration``'s default, so the
# routes tests register name the forwarder whose feed the tests post (the scheduler idles a sandbox only
# while the feed of the forwarder its route names is live).
_forwarder_pin = PIN
HEARTBEAT_STREAM = 1023  # the stream SchedulerApp's forwarder feed reports on


def mint_pki(d: Path) -> dict[str, Path]:
    ca, other_ca = mint_ca(), mint_ca("other CA")
    write_issued(ca, d, "ca")
    leaves = {
        "scheduler": mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True),
        "gateway": mint_leaf(ca, "gw", uris=(GATEWAY_SAN,), server=False, client=True),
        "forwarder": mint_leaf(ca, "fwd", uris=(FORWARDER_SAN,), server=False, client=True),
        "foreign": mint_leaf(other_ca, "gw", uris=(GATEWAY_SAN,), server=False, client=True),
    }
    global _forwarder_pin
    _forwarder_pin = spki_pin(leaves["forwarder"].cert)
    out = {"ca": d / "ca.crt"}
    for stem, leaf in leaves.items():
        write_issued(leaf, d, stem)
        out[stem], out[stem + "_key"] = d / f"{stem}.crt", d / f"{stem}.key"
    (d / "admin.token").write_text(ADMIN_TOKEN + "\n")
    out["admin_token"] = d / "admin.token"
    return out


def client_ctx(pki: dict[str, Path], stem: str | None) -> ssl.SSLContext:
    """A client context verifying the scheduler; presenting ``stem``'s certificate unless None."""
    if stem is None:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        return ctx
    ctx = loader.client_context(cert_file=pki[stem], key_file=pki[stem + "_key"], ca_file=pki["ca"])
    return ctx


def server_ctx(pki: dict[str, Path]) -> ssl.SSLContext:
    ctx = loader.server_context(cert_file=pki["scheduler"], key_file=pki["scheduler_key"], ca_file=pki["ca"])
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def registration(*, incarnation: str = "inc-1", idle_period_s: float = 300.0, activity: str = "bytes",
                 auth: str = "public", target_ip: str = "10.200.1.5", forwarder: str = "10.0.3.7:8443",
                 pin: str | None = None, port: int = 8080, protocol: str = "http", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "incarnation": incarnation,
        "forwarder": {"address": forwarder, "spki_pin": _forwarder_pin if pin is None else pin},
        "target_ip": target_ip, "default_port": port,
        "ports": {str(port): {"protocol": protocol, "auth": auth}}, "idle_period_s": idle_period_s,
        "activity": activity, **extra,
    }
    if auth == "token":
        body.setdefault("token_sha256", hashlib.sha256(b"sandbox-token").hexdigest())
    return body


class SchedulerApp:
    """The scheduler's service and API on a loopback port (fixed once chosen, so it can restart there)."""

    def __init__(self, store_factory: Callable[[], Store], pki: dict[str, Path], *, port: int | None = None,
                 webhook_url: str | None = None, webhook_secret: bytes | None = None,
                 route_cache_s: int = 2, negative_cache_s: int = 1,
                 gateway_allow: tuple[str, ...] = (GATEWAY_SAN,), source_stale_s: float = 30.0,
                 max_pending: int | None = None, feed: bool = True) -> None:
        # ``feed``: the forwarder (``mint_pki``'s) reports every 0.3 s with nothing moved, as a live
        # forwarder does; without it, no sandbox registered with ``registration``'s pin is ever idled.
        self.feed = feed
        self._feed_task: asyncio.Task[None] | None = None
        self.source_stale_s = source_stale_s
        self.max_pending = max_pending
        self.gateway_allow = gateway_allow
        self.store_factory = store_factory
        self.pki = pki
        self.port = port or free_port()
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self.route_cache_s = route_cache_s
        self.negative_cache_s = negative_cache_s
        # The test's own connection, for its reads on its own thread (what is committed); the service's
        # stores are used on their threads only (service.store, service.reader).
        self.store: Store | None = None
        self.service: SchedulerService | None = None
        self.api: Api | None = None
        self.webhook: WebhookSender | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def state(self, sandbox: str) -> str | None:
        """The committed state, read on the test's own connection. The service's core is a cache the store
        thread changes just before its commit, so a state read there can run ahead of its stored event."""
        assert self.store is not None
        row = self.store.sandbox(sandbox)
        return None if row is None else row.state.state.value

    async def start(self) -> SchedulerApp:
        # As run.py does: each store opened on the thread it is used on, the core loaded there.
        worker = StoreThread() if self.max_pending is None else StoreThread(max_pending=self.max_pending)
        reader_thread = StoreThread("sbxnet-store-read")
        store = await worker.run(self.store_factory)
        reader = await reader_thread.run(self.store_factory)
        core = await worker.run(load_core, store)
        self.store = self.store_factory()
        self.service = SchedulerService(store, forwarder_allow=[FORWARDER_SAN],
                                        auto_ready=self.webhook_url is None, resync_s=1.0,
                                        source_stale_s=self.source_stale_s, worker=worker, reader=reader,
                                        reader_thread=reader_thread, core=core)
        self.api = Api(self.service, admin_token_sha256=ADMIN_SHA, gateway_allow=self.gateway_allow,
                       route_cache_s=self.route_cache_s, negative_cache_s=self.negative_cache_s)
        self._runner = web.AppRunner(self.api.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=server_ctx(self.pki),
                          reuse_address=True).start()
        self.service.start()
        if self.feed:
            fed = asyncio.Event()
            self._feed_task = asyncio.create_task(self._heartbeat(fed))
            await asyncio.wait_for(fed.wait(), 10)  # the feed is live before the test begins
        if self.webhook_url is not None:
            self.webhook = WebhookSender(store, self.webhook_url, news=self.service.new_events,
                                         worker=worker, secret=self.webhook_secret)
            self.webhook.start()
        return self

    async def _heartbeat(self, fed: asyncio.Event) -> None:
        """A live forwarder's feed with no traffic: an empty batch every 0.3 s on a stream of its own."""
        epoch = new_epoch(time.time_ns(), os.urandom(8))
        seq = 0
        connector = aiohttp.TCPConnector(ssl=client_ctx(self.pki, "forwarder"))
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                body = push_columns(epoch, seq + 1, [], [], [], [], [])
                try:
                    async with session.post(f"{self.url}/v1/feed?stream={HEARTBEAT_STREAM}", data=body) as resp:
                        if resp.status == 200:
                            seq += 1
                            fed.set()
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                await asyncio.sleep(0.3)

    async def stop(self) -> None:
        task, self._feed_task = self._feed_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.service is not None:
            await self.service.stop()
        if self.webhook is not None:
            await self.webhook.stop()
            self.webhook = None
        if self.service is not None and self.store is not None:
            service = self.service
            await service.worker.run(service.store.close)
            if service.reader_thread is not None and service.reader is not None:
                await service.reader_thread.run(service.reader.close)
            service.close()
            self.store.close()
        self.store = None


class Client:
    """aiohttp sessions as each caller: the platform (token), the gateway and a forwarder (certificates)."""

    def __init__(self, app: SchedulerApp) -> None:
        self.app = app
        self._sessions: dict[str | None, aiohttp.ClientSession] = {}

    def session(self, stem: str | None = None) -> aiohttp.ClientSession:
        s = self._sessions.get(stem)
        if s is None:
            s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx(self.app.pki, stem)),
                                      timeout=aiohttp.ClientTimeout(total=40))
            self._sessions[stem] = s
        return s

    async def call(self, method: str, path: str, *, as_: str | None = None, headers: dict[str, str] | None = None,
                   body: object = None, raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        h = dict(headers or {})
        async with self.session(as_).request(method, self.app.url + path, data=data, headers=h) as resp:
            text = await resp.read()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text.decode(errors="replace")
            return resp.status, dict(resp.headers), parsed

    async def admin(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        status, _, doc = await self.call(method, path, headers=ADMIN, body=body)
        return status, doc

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()


class Platform:
    """The platform's webhook receiver on loopback (plain HTTP): records every event; ``on_event`` may act
    on one (the driver: call the scheduler back)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.events: list[dict[str, Any]] = []
        self.signatures: list[str | None] = []
        self.on_event: Callable[[dict[str, Any]], Coroutine[Any, Any, None]] | None = None
        self.fail_next = 0  # answer this many deliveries 500
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=500, text="try later")
        ev = json.loads(body)
        self.events.append(ev)
        self.signatures.append(request.headers.get("X-Sbxnet-Signature"))
        if self.on_event is not None:
            t: asyncio.Task[None] = asyncio.create_task(self.on_event(ev))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        return web.Response(text="ok")

    async def start(self) -> Platform:
        app = web.Application()
        app.router.add_post("/hook", self._hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met within {timeout} s"
        await asyncio.sleep(0.02)
