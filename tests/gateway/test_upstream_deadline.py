"""One deadline for the link, agreed between the gateway and the forwarder, and the route fetched once more
before the gateway gives up: real gateway, forwarders, apps and (for the move) the reference scheduler.

A sandbox whose program is down: the forwarder (its own connect_deadline 10 s) is told in the preamble
how long the gateway still waits (the route's connect_deadline_s), gives up by then, and the client gets
503 with Retry-After once the route's deadline has passed, never a 504 from a gateway that stopped
listening first. A sandbox moved to another host while its old route is cached: the request that finds
its old host down is answered from the new one."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import json
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
from gw_support import DOMAIN, EchoHttp, GatewayThread, _Handler, forwarder_settings, gateway_log, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scheduler"))  # sched_support
from fwd_support import ForwarderThread, Pki, SandboxApp
from sched_support import Client, SchedulerApp
from test_gateway_scheduler import GATEWAY_SAN, gateway_client_ctx, sched_pki

from gateway.scheduler_routes import SchedulerRoutes
from scheduler.sqlite_store import SqliteStore

ROUTE_DEADLINE = 2.0
FORWARDER_DEADLINE = 10.0  # longer than the route's and than the 5 s the gateway used to wait


async def get(pki: Pki, gw: GatewayThread, host: str, path: str = "/") -> tuple[int, dict[str, str], bytes]:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx),
                                     timeout=aiohttp.ClientTimeout(total=40)) as session, \
            session.get(f"https://127.0.0.1:{gw.port}{path}", headers={"Host": host}, server_hostname=host) as resp:
        return resp.status, dict(resp.headers), await resp.read()


class EchoAt(EchoHttp):
    """``EchoHttp`` on another loopback address: the same sandbox port on another host."""

    def __init__(self, host: str, port: int, *, ident: str) -> None:
        self.ident = ident
        self.requests: list[dict[str, Any]] = []
        http.server.ThreadingHTTPServer.__init__(self, (host, port), _Handler)
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()


def request_lines(log: Any, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(log.events("request")) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    lines: list[dict[str, Any]] = log.events("request")
    assert len(lines) == n, lines
    return lines


def test_a_sandbox_whose_program_is_down_is_503_with_retry_after_past_the_routes_deadline(
        pki: Pki, tmp_path: Path) -> None:
    fwd = ForwarderThread(forwarder_settings(pki, connect_deadline=FORWARDER_DEADLINE))
    down = SandboxApp(lambda conn: None, listen=False)  # the sandbox's program is not running
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "down": registration(pki, fwd.port, {down.port: ("http", "public")}, default=down.port,
                             deadline=ROUTE_DEADLINE)}}))
    gw = GatewayThread(pki, routes)
    try:
        with gateway_log(gw) as log:
            status, headers, body = asyncio.run(get(pki, gw, f"down.{DOMAIN}"))
            assert status == 503, (status, body)
            assert headers.get("Retry-After") == "1"
            (line,) = request_lines(log, 1)
        assert line["status"] == 503 and line["reason"] == "not_listening", line
        # The gateway's own record: answered once the route's deadline had passed, not before, and not
        # at the forwarder's 10 s (bound loose for a loaded machine). The deadline runs on the event loop's
        # clock (uvloop: milliseconds, read once per loop turn), the record on time.monotonic(): 50 ms
        # of slack below, far less than anything the gateway could answer early by.
        assert ROUTE_DEADLINE - 0.05 <= line["duration"] < FORWARDER_DEADLINE - 2, line
        fwd.wait_idle()
        assert down.accepted == 0
        # The forwarder was told the deadline: it gave up its connect by then, not at its own 10 s.
        assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "not_listening"}) >= 1
        took = fwd.sample("sbxnet_forwarder_connect_seconds_sum", {"result": "failed"})
        assert took <= ROUTE_DEADLINE + 1.0, took
    finally:
        gw.stop()
        fwd.stop()


async def test_a_sandbox_moved_to_another_host_is_answered_from_its_new_one(pki: Pki, tmp_path: Path) -> None:
    """The route is cached (max-age 60 s) when the sandbox is stopped on host A and, 50 ms later,
    registered on host B: the request that finds A's program down ends that attempt at the route's
    deadline (A's forwarder told so), looks the route up once more, and is answered by B."""
    sched = await SchedulerApp(lambda: SqliteStore(tmp_path / "s.db"), sched_pki(pki), route_cache_s=60,
                               gateway_allow=(GATEWAY_SAN,)).start()
    host_a = ForwarderThread(forwarder_settings(pki, connect_deadline=FORWARDER_DEADLINE))
    host_b = ForwarderThread(forwarder_settings(pki, connect_deadline=FORWARDER_DEADLINE,
                                                allow_targets=[ipaddress.ip_network("127.0.0.2/32")]))
    url, ctx = sched.url, gateway_client_ctx(pki)
    gw = GatewayThread(pki, None, routes=lambda: SchedulerRoutes(url, ctx))
    client = Client(sched)
    on_a = EchoHttp(ident="on-a")
    on_b = EchoAt("127.0.0.2", on_a.port, ident="on-b")  # the sandbox's port, on host B's address
    try:
        body = registration(pki, host_a.port, {on_a.port: ("http", "public")}, default=on_a.port,
                            deadline=ROUTE_DEADLINE)
        assert (await client.admin("PUT", "/v1/sandboxes/mover", body))[0] == 201
        status, _, answer = await get(pki, gw, f"mover.{DOMAIN}")
        assert status == 200 and json.loads(answer)["sandbox"] == "on-a"  # the route is cached now
        await asyncio.to_thread(on_a.stop)  # stopped on A ...
        await asyncio.sleep(0.05)
        moved = registration(pki, host_b.port, {on_b.port: ("http", "public")}, default=on_b.port,
                             deadline=ROUTE_DEADLINE)
        moved["incarnation"], moved["target_ip"] = "i2", "127.0.0.2"
        assert (await client.admin("PUT", "/v1/sandboxes/mover", moved))[0] == 200  # ... and on B
        t0 = time.monotonic()
        status, _, answer = await get(pki, gw, f"mover.{DOMAIN}", "/after-the-move")
        took = time.monotonic() - t0
        assert status == 200, (status, answer)
        assert json.loads(answer)["sandbox"] == "on-b" and json.loads(answer)["path"] == "/after-the-move"
        assert took < ROUTE_DEADLINE + 5.0, took  # the old host's attempt ended at the route's deadline
        assert gw.sample("sbxnet_gateway_route_rechecks_total") >= 1
    finally:
        await client.close()
        await asyncio.to_thread(gw.stop)
        await asyncio.to_thread(host_a.stop)
        await asyncio.to_thread(host_b.stop)
        on_b.stop()
        await sched.stop()


def test_a_pooled_link_to_a_sandbox_whose_program_is_down_is_answered_the_same(pki: Pki, tmp_path: Path) -> None:
    """With the warm pool, the first attempt rides a ready link: its NOT_LISTENING at the deadline is
    answered as a fresh link's is (503, Retry-After, reason not_listening)."""
    fwd = ForwarderThread(forwarder_settings(pki, connect_deadline=FORWARDER_DEADLINE))
    down = SandboxApp(lambda conn: None, listen=False)
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "down": registration(pki, fwd.port, {down.port: ("http", "public")}, default=down.port, deadline=1.0)}}))
    gw = GatewayThread(pki, routes, pool_size=1)
    try:
        assert asyncio.run(get(pki, gw, f"down.{DOMAIN}"))[0] == 503  # a miss: the pool fills meanwhile
        deadline = time.monotonic() + 10
        while gw.server.pool is not None and gw.server.pool.total < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with gateway_log(gw) as log:
            status, headers, _ = asyncio.run(get(pki, gw, f"down.{DOMAIN}"))
            (line,) = request_lines(log, 1)
        assert status == 503 and headers.get("Retry-After") == "1"
        assert line["reason"] == "not_listening", line
        assert gw.sample("sbxnet_gateway_pool_takes_total", {"result": "hit"}) == 1
    finally:
        gw.stop()
        fwd.stop()
