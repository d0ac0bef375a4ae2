"""Bytes through the forwarder: both directions at once, SHA-256 checked at the far ends, exact meters."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, payload, preamble_for, recv_all

from sbxnet.protocol.status import Status

MIB = 1 << 20


def sink_and_source(n_down: int, seed: int) -> tuple[SandboxApp, dict[str, object]]:
    """A sandbox app that hashes everything it receives while sending ``n_down`` bytes, then FIN."""
    seen: dict[str, object] = {}

    def handler(conn: socket.socket) -> None:
        data = payload(n_down, seed)

        def send() -> None:
            try:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except OSError as e:
                seen["send_error"] = e

        t = threading.Thread(target=send)
        t.start()
        seen["up"] = recv_all(conn)
        t.join()

    return SandboxApp(handler), seen


def test_64mib_each_way_both_directions_at_once(forwarder: ForwarderThread, pki: Pki) -> None:
    n = 64 * MIB
    app, seen = sink_and_source(n, seed=2)
    up_data = payload(n, seed=1)
    client = GwClient(forwarder.port, pki.client_ctx())
    assert client.open(preamble_for(app.port, sandbox_id="sbx-big")) is Status.OK
    down_digest = client.exchange(up_data)
    app.join()
    assert not app.errors
    assert app.accepted == 1, app.peers
    assert "send_error" not in seen
    assert seen["up"] == (hashlib.sha256(up_data).digest(), n)
    assert down_digest == hashlib.sha256(payload(n, seed=2)).digest()
    assert client.received_len == n
    client.close()
    forwarder.wait_idle()
    usage = forwarder.server.meter.usage()["sbx-big"]
    assert (usage.bytes_up, usage.bytes_down, usage.open_connections) == (n, n, 0)
    assert forwarder.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1


def test_preamble_and_tenant_bytes_in_one_record(forwarder: ForwarderThread, pki: Pki) -> None:
    got: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        buf = b""
        while len(buf) < 11:
            chunk = conn.recv(100)
            if not chunk:
                break
            buf += chunk
        got.append(buf)
        conn.sendall(b"pong")

    app = SandboxApp(handler)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.handshake()
    client.send(preamble_for(app.port) + b"hello world")  # one TLS record
    assert client.recv_exact(4) == b"SX\x01\x00"
    assert client.recv_exact(4) == b"pong"
    app.join()
    assert got == [b"hello world"]
    client.close()


def test_logs_carry_sandbox_and_connection_ids(
    forwarder: ForwarderThread, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import logging

    from sbxnet.jsonlog import JsonFormatter

    caplog.set_level(logging.INFO, logger="sbxnet.forwarder")
    app = SandboxApp(lambda conn: conn.sendall(b"ok"))
    for cid in (b"trace-123", b"\x00\xff"):
        client = GwClient(forwarder.port, pki.client_ctx())
        assert client.open(preamble_for(app.port, sandbox_id="sbx-log", connection_id=cid)) is Status.OK
        client.recv_all()
        client.close()
    forwarder.wait_idle()
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if getattr(r, "event", "") == "closed"]
    ids = [(ln["sandbox_id"], ln["gateway_conn_id"]) for ln in lines]
    assert ids == [("sbx-log", "trace-123"), ("sbx-log", "00ff")]
    assert all(len(ln["conn_id"]) == 16 for ln in lines)
