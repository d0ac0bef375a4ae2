"""Half-close is forwarded as half-close in each direction; a reset at either end reaches the other."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

MakeForwarder = Callable[..., ForwarderThread]  # the make_forwarder fixture (tests/ingress/conftest.py)


def test_gateway_half_close_then_sandbox_answers(forwarder: ForwarderThread, pki: Pki) -> None:
    # The sandbox reads to end of stream, only then answers: works only if the gateway's end of
    # stream reaches it as a half-close while the other direction stays open.
    def handler(conn: socket.socket) -> None:
        buf = b""
        while chunk := conn.recv(4096):
            buf += chunk
        conn.sendall(b"got " + str(len(buf)).encode())

    app = SandboxApp(handler)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"x" * 100_000)
    client.close_write()
    assert client.recv_all() == b"got 100000"
    assert client.eof
    app.join()
    assert not app.errors
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1


def test_sandbox_half_close_then_gateway_keeps_sending(forwarder: ForwarderThread, pki: Pki) -> None:
    received: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        conn.sendall(b"banner")
        conn.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := conn.recv(4096):
            buf += chunk
        received.append(buf)

    app = SandboxApp(handler)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.open(preamble_for(app.port))
    assert client.recv_all() == b"banner"  # close_notify arrived: end of stream from the sandbox
    assert client.eof
    client.send(b"y" * 50_000)  # the other direction still flows
    client.close_write()
    app.join()
    assert received == [b"y" * 50_000]


def test_sandbox_reset_reaches_gateway_as_reset(forwarder: ForwarderThread, pki: Pki) -> None:
    def handler(conn: socket.socket) -> None:
        conn.recv(10)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    app = SandboxApp(handler)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"hello")
    with pytest.raises(ConnectionResetError):
        client.recv_all()
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_connections_total", {"outcome": "reset_sandbox"}) == 1


def test_gateway_reset_reaches_sandbox_as_reset(forwarder: ForwarderThread, pki: Pki) -> None:
    outcome: list[str] = []
    started = threading.Event()

    def handler(conn: socket.socket) -> None:
        conn.recv(10)
        started.set()
        try:
            while conn.recv(4096):
                pass
            outcome.append("eof")
        except ConnectionResetError:
            outcome.append("reset")

    app = SandboxApp(handler)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"hello")
    assert started.wait(5)
    client.abort()
    app.join()
    assert outcome == ["reset"]
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_connections_total", {"outcome": "reset_gateway"}) == 1
    # No close_notify came before the reset: the upload was cut short.
    assert forwarder.sample("sbxnet_forwarder_truncated_total", {"plane": "userspace", "end": "reset"}) == 1


def test_close_timeout_cuts_a_direction_that_never_ends(make_forwarder: MakeForwarder, pki: Pki) -> None:
    fwd = make_forwarder(close_timeout=0.3)
    hold = threading.Event()

    def handler(conn: socket.socket) -> None:
        conn.shutdown(socket.SHUT_WR)  # sandbox done sending at once...
        hold.wait(5)  # ...but never reads to the end nor closes

    app = SandboxApp(handler)
    client = GwClient(fwd.port, pki.client_ctx())
    client.open(preamble_for(app.port))
    t0 = time.monotonic()
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        while True:
            client.fill()
            if client.eof:
                client.send(b"z")  # keep the gateway side open; it ends only by the timeout
                time.sleep(0.05)
    assert time.monotonic() - t0 < 3
    hold.set()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "close_timeout"}) == 1


def test_sandbox_end_of_stream_mid_upload_loses_no_upload_bytes(forwarder: ForwarderThread, pki: Pki) -> None:
    # The forwarder sends close_notify (SSL_shutdown) while upload records are arriving: none of
    # them may be swallowed by the shutdown.
    import hashlib

    from fwd_support import payload

    def recv_all_bytes(conn: socket.socket) -> bytes:
        out = bytearray()
        while chunk := conn.recv(1 << 18):
            out += chunk
        return bytes(out)

    got: list[tuple[bytes, int]] = []

    def handler(conn: socket.socket) -> None:
        first = conn.recv(1)  # the upload has started
        time.sleep(0.3)  # let the forwarder block on a full socket with upload records still undecrypted
        conn.sendall(b"done")
        conn.shutdown(socket.SHUT_WR)
        rest = recv_all_bytes(conn)
        got.append((hashlib.sha256(first + rest).digest(), len(first) + len(rest)))

    data = payload(32 << 20, 9)
    for _ in range(3):
        app = SandboxApp(handler)
        client = GwClient(forwarder.port, pki.client_ctx())
        client.open(preamble_for(app.port))
        client.exchange(data)
        app.join()
        app.close()
        client.close()
    assert got == [(hashlib.sha256(data).digest(), len(data))] * 3
