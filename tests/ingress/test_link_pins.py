"""The link client pins the forwarder's key: the right pin connects, a wrong one sends nothing."""

from __future__ import annotations

import socket
import ssl

import pytest
from cryptography import x509
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from certs.loader import PinMismatch, client_context
from certs.mint import spki_pin
from sbxnet.protocol.status import Status


def _pin(pki: Pki) -> str:
    cert, _ = pki.paths["forwarder"]
    return spki_pin(x509.load_pem_x509_certificate(cert.read_bytes()))


def _ctx(pki: Pki) -> ssl.SSLContext:
    cert, key = pki.paths["gateway"]
    return client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


def test_the_pinned_key_connects(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_echo)
    c = GwClient(forwarder.port, _ctx(pki), pins={_pin(pki)})
    assert c.open(preamble_for(app.port)) is Status.OK
    c.send(b"ping")
    assert c.recv_exact(4) == b"ping"
    c.close()
    app.join()


def test_another_key_is_refused_before_any_preamble_byte(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_echo)
    c = GwClient(forwarder.port, _ctx(pki), pins={"A" * 43 + "="})
    with pytest.raises(PinMismatch):
        c.open(preamble_for(app.port))
    c.close()
    forwarder.wait_idle()
    assert app.accepted == 0
    # The forwarder saw a finished handshake and then nothing: the link ended before a preamble.
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "unused"}) == 1
