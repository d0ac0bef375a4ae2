"""A userspace tunnel past its handoff holds a connection slot until it ends, not until its connection's
task does (that task ends at the handoff: sbxnet/accept.py's hold); its end is counted and logged when it
comes; SIGTERM's drain waits for such tunnels up to its deadline, then cuts them (reset both ways,
counted ``drained``); and an ended tunnel is freed at once, however it ended (no reference cycle left for
the collector: a tunnel holds OpenSSL's 20 KiB of session)."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from sbxnet.protocol.status import Status

MakeForwarder = Callable[..., ForwarderThread]
IDLE_S = 0.8  # past the plane's PARK_AFTER_S: both directions parked, no task of the tunnel's left


def echo(ends: list[str]) -> Callable[[socket.socket], None]:
    def handler(conn: socket.socket) -> None:
        try:
            while chunk := conn.recv(4096):
                conn.sendall(chunk)
            ends.append("eof")
        except ConnectionResetError:
            ends.append("reset")
        conn.close()

    return handler


def live_tunnel(port: int, pki: Pki, app: SandboxApp) -> GwClient:
    c = GwClient(port, pki.client_ctx(), timeout=20)
    assert c.open(preamble_for(app.port)) is Status.OK
    c.send(b"ping")
    assert c.recv_exact(4) == b"ping"
    return c


def test_an_idle_tunnel_keeps_its_slot_until_it_ends(make_forwarder: MakeForwarder, pki: Pki) -> None:
    fwd = make_forwarder(max_connections=1)
    ends: list[str] = []
    app = SandboxApp(echo(ends))
    first = live_tunnel(fwd.port, pki, app)
    time.sleep(IDLE_S)
    assert fwd.server.open_connections == 1
    second: list[GwClient] = []

    def open_second() -> None:
        second.append(live_tunnel(fwd.port, pki, app))

    t = threading.Thread(target=open_second, daemon=True)
    t.start()
    t.join(1.0)
    assert not second, "a second tunnel was served while the only slot was held by an idle one"
    first.close_write()
    assert first.recv_all() == b""
    first.close()
    t.join(20)
    assert second, "the slot did not come back when the first tunnel ended"
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1
    assert fwd.server.open_connections == 1
    second[0].close_write()
    second[0].recv_all()
    second[0].close()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 2
    assert fwd.sample("sbxnet_forwarder_open_connections") == 0


def test_drain_waits_for_idle_tunnels_then_cuts_them(
    make_forwarder: MakeForwarder, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sbxnet.forwarder")
    fwd = make_forwarder()
    ends: list[str] = []
    app = SandboxApp(echo(ends))
    ending, cut = live_tunnel(fwd.port, pki, app), live_tunnel(fwd.port, pki, app)
    time.sleep(IDLE_S)
    drain = asyncio.run_coroutine_threadsafe(fwd.server.drain(1.5), fwd.loop)
    time.sleep(0.3)
    ending.close_write()  # ends in order while the drain waits: logged and counted closed
    assert ending.recv_all() == b""
    ending.close()
    assert drain.result(20) == 1  # the idle one was cut at the deadline
    with pytest.raises(ConnectionResetError):
        cut.recv_all()
    cut.close()
    deadline = time.monotonic() + 10
    while sorted(ends) != ["eof", "reset"]:
        assert time.monotonic() < deadline, ends
        time.sleep(0.02)
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "drained"}) == 1
    assert fwd.sample("sbxnet_forwarder_open_connections") == 0
    closed = [r for r in caplog.records if getattr(r, "event", None) == "closed"]
    assert len(closed) == 1, closed
    fields = closed[0].fields  # type: ignore[attr-defined]
    assert fields["outcome"] == "closed" and fields["bytes_up"] == 4 and fields["bytes_down"] == 4
    assert fields["seconds"] >= IDLE_S


def test_an_ended_tunnel_is_freed_at_once_however_it_ended(make_forwarder: MakeForwarder, pki: Pki) -> None:
    from forwarder.ingress.planes.userspace import _Tunnel
    from forwarder.ingress.sequence import LiveTunnel

    def left() -> list[object]:
        return [o for o in gc.get_objects() if isinstance(o, _Tunnel | LiveTunnel)]

    fwd = make_forwarder()
    ends: list[str] = []
    app = SandboxApp(echo(ends))
    gc.collect()
    gc.disable()  # what a cycle would keep stays until the end of the test
    try:
        assert not left()
        ended = [live_tunnel(fwd.port, pki, app) for _ in range(3)]
        time.sleep(IDLE_S)  # parked first: each end wakes a parked direction
        ended[0].close_write()  # in order: closed
        assert ended[0].recv_all() == b""
        ended[1].sock.shutdown(socket.SHUT_WR)  # a TCP FIN with no close_notify: reset_gateway
        ended[2].abort()  # a reset: reset_gateway
        fwd.wait_idle()
        for c in ended:
            c.close()
        for outcome, n in (("closed", 1), ("reset_gateway", 2)):
            assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": outcome}) == n, outcome
        assert not left(), "an ended tunnel is still in memory, waiting for the collector"
    finally:
        gc.enable()
