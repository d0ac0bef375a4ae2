"""A userspace tunnel past its handoff holds a connection slot until it ends, not until its connection's
task does (that task ends at the handoff: sbxnet/accept.py's hold); its end is counted and logged when it
comes; SIGTERM's drain waits for such tunnels up to its deadline, then cuts them (reset both ways,
counted ``drained``)."""

from __future__ import annotations

import asyncio
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
