"""Clear text on the TLS port is refused at its first wrong byte, counted ``not_tls`` and logged with the
peer, instead of being taken as a record header and waited on until the handshake timeout."""

from __future__ import annotations

import logging
import random
import socket
import ssl
import time

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from forwarder.ingress.tls_link import can_start_tls
from sbxnet.protocol.status import Status

# -- the judgement, without sockets ----------------------------------------------------------------


def client_hello(ctx: ssl.SSLContext) -> bytes:
    """The first flight a real TLS client sends with ``ctx``: the oracle for what must pass."""
    tls = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def test_real_client_hellos_start_like_tls(pki: Pki) -> None:
    for ctx in (pki.client_ctx(), pki.client_ctx(tls12_only=True), ssl.create_default_context()):
        hello = client_hello(ctx)
        for n in range(len(hello) + 1):  # whole, and every prefix (bytes arrive in any split)
            assert can_start_tls(hello[:n]), (n, hello[:8].hex())


def test_only_a_handshake_record_of_version_3_x_starts_like_tls() -> None:
    for b in range(256):
        assert can_start_tls(bytes([b])) is (b == 0x16)
        assert can_start_tls(bytes([0x16, b])) is (b == 0x03)
        assert can_start_tls(bytes([0x16, 0x03, b])) is (b <= 0x0F)
    rng = random.Random(11)
    for _ in range(2000):
        data = rng.randbytes(rng.randrange(0, 9))
        ok = can_start_tls(data)
        # Prefix-closed: a prefix of an accepted start is accepted, so judging byte by byte as bytes
        # arrive gives the same answer as judging the whole.
        assert all(can_start_tls(data[:n]) for n in range(len(data))) or not ok
        expect = (len(data) < 1 or data[0] == 0x16) and (len(data) < 2 or data[1] == 3) and (
            len(data) < 3 or data[2] < 16
        )
        assert ok is expect, data.hex()


# -- through the forwarder ---------------------------------------------------------------------------


def _never(conn: object) -> None:
    raise AssertionError("the sandbox must not be reached")


def _random_clear_text(seed: int) -> bytes:
    data = random.Random(seed).randbytes(64)
    assert data[0] != 0x16  # this seed's bytes are not a TLS start by chance
    return data


CLEAR_TEXT = {
    "proxy_v2": preamble_for(9, sandbox_id="sbx-clear"),  # a gateway that forgot TLS
    "http": b"GET / HTTP/1.1\r\nHost: sbx.example\r\n\r\n",
    "random": _random_clear_text(3),
}


def test_clear_text_is_refused_at_once_and_counted_not_tls(
    forwarder: ForwarderThread, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    app = SandboxApp(_never)
    caplog.set_level(logging.WARNING, logger="sbxnet.forwarder")
    assert forwarder.server.settings.handshake_timeout >= 5  # what a wait for a record body would cost
    peers: dict[str, str] = {}
    for name, data in CLEAR_TEXT.items():
        s = socket.create_connection(("127.0.0.1", forwarder.port), timeout=10)
        host, port = s.getsockname()
        peers[name] = f"{host}:{port}"
        t0 = time.monotonic()
        s.sendall(data)
        try:
            assert s.recv(100) == b""  # no TLS alert, no answer: the socket is closed
        except ConnectionResetError:
            pass  # closed with our bytes unread, so the kernel reset it: as good
        wall = time.monotonic() - t0
        s.close()
        # A generous bound under load for the wall clock; the forwarder's own clock says 100 ms.
        assert wall < 2.0, (name, wall)
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_handshake_rejects_total", {"reason": "not_tls"}) == len(CLEAR_TEXT)
    assert forwarder.sample("sbxnet_forwarder_handshake_rejects_total", {"reason": "timeout"}) == 0
    assert forwarder.sample("sbxnet_forwarder_connections_total", {"outcome": "handshake_refused"}) == len(CLEAR_TEXT)
    refused = [r for r in caplog.records if getattr(r, "event", None) == "handshake_refused"]
    assert sorted(r.__dict__["peer"] for r in refused) == sorted(peers.values())
    for name, data in CLEAR_TEXT.items():
        (record,) = [r for r in refused if r.__dict__["peer"] == peers[name]]
        assert record.__dict__["reason"] == "not_tls"
        fields = record.__dict__["fields"]
        assert fields["handshake_ms"] < 100, (name, fields)
        first = bytes.fromhex(fields["first_bytes"])
        assert 1 <= len(first) <= 5 and data.startswith(first)
    assert app.accepted == 0


def test_client_hello_split_byte_by_byte_is_served(forwarder: ForwarderThread, pki: Pki) -> None:
    # The first header is judged as it arrives: a legitimate client whose first bytes come one at a time
    # is neither refused nor mistaken.
    app = SandboxApp(lambda conn: conn.sendall(b"hi"))
    client = GwClient(forwarder.port, pki.client_ctx())
    try:
        client.tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = client.out.read()
    client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(6):
        client.sock.sendall(hello[i : i + 1])
        time.sleep(0.02)
    client.sock.sendall(hello[6:])
    assert client.open(preamble_for(app.port)) is Status.OK
    assert client.recv_exact(2) == b"hi"
    client.close()
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_handshake_rejects_total", {"reason": "not_tls"}) == 0
