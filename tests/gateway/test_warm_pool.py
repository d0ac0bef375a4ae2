"""The warm pool (gateway/upstream_pool.py) against a real forwarder on loopback: a pooled link carries the
next connection with no connect or handshake, links the forwarder dropped are never used, a pooled link that
fails at the preamble is followed at once by a fresh connection, and retired links end quietly."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import ssl
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from fwd_support import ForwarderThread, Pki, SandboxApp
from gw_support import DOMAIN, EchoHttp, GatewayThread, forwarder_settings, gateway_log, registration
from prometheus_client import CollectorRegistry, Counter, Gauge
from test_upstream import echo, fwd_settings, policy, preamble, route

from gateway.upstream import Upstream, open_upstream
from gateway.upstream_pool import PoolKey, WarmPool, _Ready
from sbxnet.tls_stream import TlsStream


@pytest.fixture
def forwarder(pki: Pki) -> Iterator[ForwarderThread]:
    fwd = ForwarderThread(fwd_settings(pki))
    yield fwd
    fwd.stop()


def _metrics() -> tuple[CollectorRegistry, Counter, Gauge]:
    r = CollectorRegistry()
    return r, Counter("takes", "", ["result"], registry=r), Gauge("links", "", registry=r)


async def _until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _echo_once(up: Upstream) -> bytes:
    await up.stream.write(b"hello")
    got = up.leftover
    while len(got) < 5:
        chunk = await up.stream.read()
        assert chunk
        got += chunk
    up.stream.close()
    return got


def test_a_pooled_link_carries_the_next_connection(pki: Pki, forwarder: ForwarderThread) -> None:
    app = SandboxApp(echo)
    r = route(forwarder.port, app.port, pki)
    reg, takes, links = _metrics()

    async def main() -> None:
        pool = WarmPool(policy(pki).context, size=2, max_idle=10.0, takes=takes, links=links)
        pool.start()
        first = await open_upstream(r, app.port, preamble(app.port), policy(pki), rng=random.Random(1), pool=pool)
        assert not first.pooled and first.attempts == 1  # nothing was pooled yet: a miss, then a fresh connect
        assert await _echo_once(first) == b"hello"
        await _until(lambda: pool.total == 2)  # the miss marked the forwarder wanted: two links made ready
        second = await open_upstream(r, app.port, preamble(app.port), policy(pki), rng=random.Random(1), pool=pool)
        assert second.pooled and second.attempts == 0 and second.failures == []
        assert await _echo_once(second) == b"hello"
        await _until(lambda: pool.total == 2)  # topped up again
        await pool.close()
        assert pool.total == 0

    asyncio.run(main())
    assert reg.get_sample_value("takes_total", {"result": "miss"}) == 1
    assert reg.get_sample_value("takes_total", {"result": "hit"}) == 1
    assert reg.get_sample_value("links") == 0
    forwarder.wait_idle()
    # The three links never used ended in order: counted as unused, not as broken preambles.
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "unused"}) == 2
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "eof"}) == 0
    app.join()


def test_links_the_forwarder_dropped_are_never_used(pki: Pki) -> None:
    """A pool kept longer than the forwarder waits (misconfigured on purpose): the forwarder cuts the links
    at its idle timeout, and the pool sees that before it hands one out."""
    fwd = ForwarderThread(fwd_settings(pki, preamble_idle_timeout=0.3))
    app = SandboxApp(echo)
    r = route(fwd.port, app.port, pki)
    reg, takes, links = _metrics()

    async def main() -> None:
        pool = WarmPool(policy(pki).context, size=2, max_idle=30.0, takes=takes, links=links)
        assert pool.take(r.forwarder) is None  # marks it wanted, starts the fill (no ticker: no pruning)
        await _until(lambda: pool.total == 2)
        await asyncio.sleep(1.0)  # the forwarder cut both at 0.3 s
        up = await open_upstream(r, app.port, preamble(app.port), policy(pki), rng=random.Random(1), pool=pool)
        assert not up.pooled and up.failures == []  # no failed attempt: the dead links were not tried
        assert await _echo_once(up) == b"hello"
        await pool.close()

    try:
        asyncio.run(main())
        assert reg.get_sample_value("takes_total", {"result": "stale"}) == 1
        assert (reg.get_sample_value("takes_total", {"result": "hit"}) or 0) == 0
        fwd.wait_idle()
        assert fwd.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "idle"}) >= 2
    finally:
        fwd.stop()
    app.join()


def test_a_pooled_link_that_fails_at_the_preamble_is_followed_at_once_by_a_fresh_one(
    pki: Pki, forwarder: ForwarderThread
) -> None:
    """A link that looked fit but whose far end closed on the preamble: nothing of the client's was sent,
    so the next attempt follows on a fresh connection with no backoff, and the request goes through."""
    app = SandboxApp(echo)
    r = route(forwarder.port, app.port, pki)
    cert, key = pki.paths["forwarder"]
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)  # the forwarder's key: the pin holds
    got_preamble: list[bytes] = []

    async def main() -> None:
        async def closes_on_the_preamble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got_preamble.append(await reader.read(1024))
            writer.transport.abort()

        dying = await asyncio.start_server(closes_on_the_preamble, "127.0.0.1", 0, ssl=server_ctx)
        port = dying.sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        stream = await TlsStream.connect(sock, policy(pki).context, server_hostname=None, timeout=5)
        await asyncio.sleep(0.05)
        assert stream.usable_idle()
        pool = WarmPool(policy(pki).context, size=1, max_idle=30.0)
        loop = asyncio.get_running_loop()
        pool._ready[PoolKey.of(r.forwarder)] = deque([_Ready(stream, loop.time())])
        t0 = loop.time()
        up = await open_upstream(r, app.port, preamble(app.port), policy(pki), rng=random.Random(1), pool=pool)
        assert not up.pooled
        assert up.failures in (["pooled_closed_before_status"], ["pooled_reset_before_status"])
        assert up.attempts == 1
        assert await _echo_once(up) == b"hello"
        assert loop.time() - t0 < 2.0  # no deadline waited out
        await pool.close()
        dying.close()
        await dying.wait_closed()

    asyncio.run(main())
    assert got_preamble and got_preamble[0].startswith(b"\r\n\r\n\x00\r\nQUIT\n")  # it did get the preamble
    app.join()


def test_the_gateway_serves_new_client_connections_on_pooled_links(pki: Pki, tmp_path: Path) -> None:
    """Through the whole chain with curl: one new client connection after another; after the first, each
    is carried by a link from the pool (the gateway's counters and its link log say so), and each answer
    comes from the sandbox."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    fwd = ForwarderThread(forwarder_settings(pki))
    app = EchoHttp(ident="alpha")
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port)}}))
    gw = GatewayThread(pki, routes, pool_size=2, pool_idle=10.0)
    try:
        with gateway_log() as lines:
            bodies = []
            for i in range(4):
                r = subprocess.run(
                    ["curl", "-sS", "--http1.1", "--cacert", str(pki.ca_file), "--resolve",
                     f"alpha.{DOMAIN}:{gw.port}:127.0.0.1", f"https://alpha.{DOMAIN}:{gw.port}/n{i}"],
                    capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr
                bodies.append(json.loads(r.stdout))
                deadline = time.monotonic() + 10
                while gw.server.pool is not None and gw.server.pool.total < 2:  # topped up before the next
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            opened = lines.events("link_open")  # written before the request went upstream
        assert [b["sandbox"] for b in bodies] == ["alpha"] * 4
        assert [b["path"] for b in bodies] == [f"/n{i}" for i in range(4)]
        pooled = [x["pooled"] for x in opened]
        assert pooled == [False, True, True, True]
        assert gw.sample("sbxnet_gateway_pool_takes_total", {"result": "hit"}) == 3
        assert gw.sample("sbxnet_gateway_pool_takes_total", {"result": "miss"}) == 1
    finally:
        gw.stop()
        fwd.stop()
        app.stop()
    assert gw.server.pool is not None and gw.server.pool.total == 0  # the drain closed the pool


def test_a_new_client_context_drains_the_pool_and_a_refill_in_flight(pki: Pki, forwarder: ForwarderThread) -> None:
    """``use_context`` (SIGHUP reloaded the link's client certificate): the ready links, handshaken with the
    old context, are retired, a link a refill was opening with it is dropped when it comes, and the pool
    fills again with the new one; nothing made with the old one is handed out after."""
    r = route(forwarder.port, 9, pki)  # no preamble is sent: the sandbox's port is never reached
    old, new = policy(pki).context, policy(pki).context

    def made_with(pool: WarmPool) -> list[ssl.SSLContext]:
        return [ready.stream.ssl_object.context for q in pool._ready.values() for ready in q]

    async def main() -> None:
        pool = WarmPool(old, size=2, max_idle=30.0)
        assert pool.take(r.forwarder) is None  # marks it wanted, starts the fill
        await _until(lambda: pool.total == 2)
        assert made_with(pool) == [old, old]
        pool.use_context(new)  # the ready links retired; the forwarder still wanted, so refilled
        assert pool.total == 0
        await _until(lambda: pool.total == 2)
        assert made_with(pool) == [new, new]

        # A refill under way when the context changes: its link is not kept.
        taken = pool.take(r.forwarder)
        assert taken is not None and taken.ssl_object.context is new
        taken.abort()
        for _ in range(100):  # the top-up task runs up to its connect, and is in flight
            if pool._opening:
                break
            await asyncio.sleep(0)
        assert pool._opening == 1 and pool.total == 1
        pool.use_context(old)
        await _until(lambda: pool.total == 2)
        assert made_with(pool) == [old, old]
        await pool.close()

    asyncio.run(main())
    forwarder.wait_idle()
    # The links retired at each swap ended in order (unused), not cut.
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "unused"}) >= 3
