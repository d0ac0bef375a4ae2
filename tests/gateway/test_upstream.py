"""The gateway's upstream against a real forwarder on loopback: pinned mTLS, preamble, status, and the
retries that ride out a cold start (forwarder or sandbox not up yet) without ever repeating a request."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp, free_port
from gw_support import forwarder_settings

from certs.loader import client_context
from certs.mint import spki_pin
from forwarder.ingress.settings import ForwarderSettings
from gateway.upstream import UpstreamFailed, UpstreamPolicy, open_upstream
from sbxnet.protocol.preamble import Preamble
from sbxnet.protocol.routes import Forwarder, PortSpec, Route


def fwd_settings(pki: Pki, **over: Any) -> ForwarderSettings:
    return forwarder_settings(pki, **{"connect_deadline": 2.0, **over})


@pytest.fixture
def forwarders(pki: Pki) -> Iterator[list[ForwarderThread]]:
    started: list[ForwarderThread] = []
    yield started
    for f in started:
        f.stop()


def pin(pki: Pki, stem: str = "forwarder") -> str:
    return spki_pin(x509.load_pem_x509_certificate(pki.paths[stem][0].read_bytes()))


def route(fwd_port: int, app_port: int, pki: Pki, *, deadline: float = 3.0, pin_of: str = "forwarder") -> Route:
    return Route(
        sandbox="sbx-1", incarnation="i1", state="active",
        forwarder=Forwarder("127.0.0.1", fwd_port, (pin(pki, pin_of),)),
        target_ip=ipaddress.ip_address("127.0.0.1"), default_port=app_port,
        ports={app_port: PortSpec("http", "public")}, token_sha256=None, connect_deadline_s=deadline,
    )


def preamble(app_port: int, dst: str = "127.0.0.1") -> Preamble:
    return Preamble(ipaddress.ip_address("203.0.113.9"), 41000, ipaddress.ip_address(dst), app_port, "sbx-1", b"gw-1")


def policy(pki: Pki) -> UpstreamPolicy:
    cert, key = pki.paths["gateway"]
    return UpstreamPolicy(client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file))


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


async def roundtrip(r: Route, port: int, p: Preamble, pol: UpstreamPolicy) -> tuple[bytes, int, list[str]]:
    up = await open_upstream(r, port, p, pol, rng=random.Random(1))
    await up.stream.write(b"hello")
    got = up.leftover
    while len(got) < 5:
        chunk = await up.stream.read()
        assert chunk
        got += chunk
    await up.stream.write_eof()
    assert await up.stream.read() == b""  # the echo app ends its side after ours: half-close both ways
    up.stream.close()
    return got, up.attempts, up.failures


def test_ok_through_a_real_forwarder(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    app = SandboxApp(echo)
    got, attempts, failures = asyncio.run(roundtrip(route(fwd.port, app.port, pki), app.port, preamble(app.port),
                                                    policy(pki)))
    assert got == b"hello" and attempts == 1 and failures == []
    app.join()


def test_a_forwarder_that_starts_late_is_reached_once_it_listens(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    app = SandboxApp(echo)
    port = free_port()
    started: list[float] = []
    t = threading.Thread(target=_start_on(pki, port, forwarders, started))
    t.start()
    t0 = time.monotonic()
    got, attempts, _ = asyncio.run(roundtrip(route(port, app.port, pki), app.port, preamble(app.port),
                                                    policy(pki)))
    t.join()
    assert got == b"hello"
    assert attempts > 1  # refused SYNs first
    assert started and time.monotonic() - t0 < 3.0
    app.join()


def _start_on(pki: Pki, port: int, forwarders: list[ForwarderThread], started: list[float]) -> Any:
    def run() -> None:
        time.sleep(0.3)
        f = _ForwarderOnPort(fwd_settings(pki), port)
        forwarders.append(f)
        started.append(time.monotonic())

    return run


class _ForwarderOnPort(ForwarderThread):
    """A ForwarderThread on a port chosen beforehand (the test needs to aim at it before it listens)."""

    def __init__(self, settings: ForwarderSettings, port: int) -> None:
        from forwarder.ingress import server as server_mod

        real = server_mod.bind_listener

        fixed = port

        def bind(
            host: str, port: int, *, reuse_port: bool, backlog: int = 1024, setting: str = "the listen port setting"
        ) -> socket.socket:
            return real(host, fixed, reuse_port=reuse_port, backlog=backlog, setting=setting)

        server_mod.bind_listener = bind
        try:
            super().__init__(settings)
        finally:
            server_mod.bind_listener = real


def test_not_listening_is_retried_until_the_sandbox_listens(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    # The forwarder gives up on the sandbox after 0.2 s (NOT_LISTENING); the gateway keeps asking.
    fwd = ForwarderThread(fwd_settings(pki, connect_deadline=0.2))
    forwarders.append(fwd)
    app = SandboxApp(echo, listen=False)
    timer = threading.Timer(0.7, app.listen)
    timer.start()
    got, attempts, failures = asyncio.run(roundtrip(route(fwd.port, app.port, pki), app.port, preamble(app.port),
                                                    policy(pki)))
    timer.join()
    assert got == b"hello"
    assert "not_listening" in failures and attempts >= 2
    app.join()


def test_forwarder_down_is_503_within_the_deadline(pki: Pki) -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(open_upstream(route(port, 9, pki, deadline=0.5), 9, preamble(9), policy(pki)))
    took = time.monotonic() - t0
    assert e.value.http_status == 503 and e.value.retry_after == 1
    assert e.value.attempts > 3
    assert 0.45 < took < 2.0


def test_a_forbidden_target_is_not_retried(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(open_upstream(route(fwd.port, 80, pki), 80, preamble(80, dst="169.254.169.254"), policy(pki)))
    assert e.value.http_status == 502 and e.value.reason == "forwarder_forbidden"
    assert e.value.attempts == 1


def _outcomes(fwd: ForwarderThread) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in fwd.server.metrics.registry.collect()
            if m.name == "sbxnet_forwarder_connections" for s in m.samples if s.name.endswith("_total")}


def test_a_forwarder_with_another_key_is_never_sent_the_preamble(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    """A pin mismatch is not transient: one handshake, no preamble, 502 (not retried until the deadline)."""
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    app = SandboxApp(echo)
    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(open_upstream(route(fwd.port, app.port, pki, deadline=3.0, pin_of="gateway"), app.port,
                                  preamble(app.port), policy(pki)))
    assert (e.value.http_status, e.value.reason, e.value.retry_after) == (502, "pin_mismatch", None)
    fwd.wait_idle()
    assert app.accepted == 0
    # One handshake, and the link ended before a preamble byte: the forwarder's own outcome for that.
    assert _outcomes(fwd) == {"no_preamble": 1}


def test_a_pin_mismatch_looks_the_route_up_once_more_then_502(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    """The route looked up afresh says the same (the pin is wrong at the source): 502 after that one
    recheck, with no second handshake."""
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    app = SandboxApp(echo)
    wrong = route(fwd.port, app.port, pki, deadline=3.0, pin_of="gateway")
    calls: list[float] = []

    async def recheck() -> Route | None:
        calls.append(time.monotonic())
        return wrong

    with pytest.raises(UpstreamFailed) as e:
        asyncio.run(open_upstream(wrong, app.port, preamble(app.port), policy(pki), recheck=recheck))
    assert (e.value.http_status, e.value.reason) == (502, "pin_mismatch")
    assert len(calls) == 1
    fwd.wait_idle()
    assert _outcomes(fwd) == {"no_preamble": 1}


def test_recheck_after_the_first_failure_can_move_the_route(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    """A cached route that no longer holds (here: the sandbox's host was replaced, so the cached pin is
    not its forwarder's): after the first failed attempt the caller's recheck hands over the fresh route,
    and the connect goes there, with the fresh route's own deadline; recheck is asked once."""
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    app = SandboxApp(echo)
    calls: list[float] = []
    fresh = route(fwd.port, app.port, pki, deadline=2.0)

    async def recheck() -> Route | None:
        calls.append(time.monotonic())
        return fresh

    async def go() -> tuple[bytes, list[str]]:
        stale = route(fwd.port, app.port, pki, deadline=0.3, pin_of="gateway")
        up = await open_upstream(stale, app.port, preamble(app.port), policy(pki), rng=random.Random(1),
                                 recheck=recheck)
        await up.stream.write(b"hello")
        got = up.leftover
        while len(got) < 5:
            got += await up.stream.read()
        up.stream.abort()
        return got, up.failures

    got, failures = asyncio.run(go())
    assert got == b"hello" and failures == ["pin_mismatch"] and len(calls) == 1
    app.join()


def test_recheck_saying_gone_is_503_at_once(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    fwd = ForwarderThread(fwd_settings(pki, connect_deadline=0.2))
    forwarders.append(fwd)
    gone = SandboxApp(echo, listen=False)

    async def recheck() -> Route | None:
        return None

    t0 = time.monotonic()
    with pytest.raises(UpstreamFailed) as failed:
        asyncio.run(open_upstream(route(fwd.port, gone.port, pki, deadline=5.0), gone.port, preamble(gone.port),
                                  policy(pki), recheck=recheck))
    assert (failed.value.reason, failed.value.http_status) == ("sandbox_gone", 503)
    assert time.monotonic() - t0 < 4.0  # not the 5 s deadline


def test_the_route_is_looked_up_once_more_before_answering(pki: Pki, forwarders: list[ForwarderThread]) -> None:
    """The route's host refuses every connect until the deadline (no attempt got far enough to be
    rechecked); before answering 503 the route is looked up once more, and it names the sandbox's new
    host: the link goes there, with the new route's own deadline."""
    fwd = ForwarderThread(fwd_settings(pki))
    forwarders.append(fwd)
    app = SandboxApp(echo)
    dead = route(free_port(), app.port, pki, deadline=0.5)
    fresh = route(fwd.port, app.port, pki, deadline=2.0)
    calls: list[float] = []

    async def recheck() -> Route | None:
        calls.append(time.monotonic())
        return fresh

    async def go() -> tuple[bytes, list[str]]:
        up = await open_upstream(dead, app.port, preamble(app.port), policy(pki), rng=random.Random(1),
                                 recheck=recheck)
        await up.stream.write(b"hello")
        got = up.leftover
        while len(got) < 5:
            got += await up.stream.read()
        up.stream.abort()
        return got, up.failures

    t0 = time.monotonic()
    got, failures = asyncio.run(go())
    assert got == b"hello" and len(calls) == 1
    assert calls[0] - t0 >= 0.5  # the lookup came at the dead route's deadline
    assert failures and all(f.startswith("connect_") for f in failures)
    app.join()


def test_a_forwarder_that_never_answers_is_504_after_the_deadline_and_its_grace(pki: Pki) -> None:
    """A peer with the forwarder's key that takes the preamble and never sends a status (a hung
    forwarder): the wait ends at the deadline plus ``status_grace``, the route is looked up once more,
    and the answer is 504. The peer is plain TLS (ssl module) with the forwarder's certificate."""
    cert, key = pki.paths["forwarder"]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[ssl.SSLSocket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                tls = ctx.wrap_socket(conn, server_side=True)
                tls.recv(4096)  # the preamble; no status, ever
                held.append(tls)

    threading.Thread(target=serve, daemon=True).start()
    calls: list[float] = []
    r = route(port, 9, pki, deadline=0.5)

    async def recheck() -> Route | None:
        calls.append(time.monotonic())
        return r

    t0 = time.monotonic()
    try:
        with pytest.raises(UpstreamFailed) as e:
            asyncio.run(open_upstream(r, 9, preamble(9), replace(policy(pki), status_grace=0.5), recheck=recheck))
        took = time.monotonic() - t0
    finally:
        listener.close()
        for tls in held:
            tls.close()
    assert (e.value.http_status, e.value.reason, e.value.retry_after) == (504, "status_timeout", None)
    assert 0.95 <= took < 5.0, took  # the 0.5 s deadline and the 0.5 s grace
    assert len(calls) == 2  # after the first failure, and once more before answering
    assert len(held) == 1  # no second attempt: the deadline had passed
