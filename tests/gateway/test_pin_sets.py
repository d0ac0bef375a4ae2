"""The gateway's pin check against a route's set of pins (issue 22 point 17): a forwarder goes on if its key
is any pin of the set, and only then; against a real forwarder on loopback, through ``open_upstream``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import random
import socket
import sys
from pathlib import Path

import pytest
from cryptography import x509
from gw_support import forwarder_settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp

from certs.loader import client_context
from certs.mint import spki_pin
from gateway.upstream import UpstreamFailed, UpstreamPolicy, open_upstream
from sbxnet.protocol.preamble import Preamble
from sbxnet.protocol.routes import Forwarder, PortSpec, Route

OTHER = base64.b64encode(hashlib.sha256(b"some other key").digest()).decode()
ANOTHER = base64.b64encode(hashlib.sha256(b"yet another key").digest()).decode()


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


async def reach(pki: Pki, fwd: ForwarderThread, app: SandboxApp, pins: tuple[str, ...]) -> bytes:
    route = Route(sandbox="sbx-1", incarnation="i1", state="active",
                  forwarder=Forwarder("127.0.0.1", fwd.port, pins), target_ip=ipaddress.ip_address("127.0.0.1"),
                  default_port=app.port, ports={app.port: PortSpec("http", "public")}, token_sha256=None,
                  connect_deadline_s=0.4)
    cert, key = pki.paths["gateway"]
    policy = UpstreamPolicy(client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file))
    preamble = Preamble(ipaddress.ip_address("203.0.113.9"), 41000, ipaddress.ip_address("127.0.0.1"), app.port,
                        "sbx-1", b"gw-1")
    up = await open_upstream(route, app.port, preamble, policy, rng=random.Random(1))
    await up.stream.write(b"ping")
    got = up.leftover
    while len(got) < 4:
        got += await up.stream.read()
    up.stream.abort()
    return got


def test_a_forwarder_whose_key_is_any_pin_of_the_set_is_reached_and_no_other(pki: Pki) -> None:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = SandboxApp(echo)
    try:
        mine = spki_pin(x509.load_pem_x509_certificate(pki.paths["forwarder"][0].read_bytes()))
        # Its key first or last in the set (sorted, as the codec keeps it), with one or two others.
        for pins in [(mine, OTHER), (OTHER, mine), tuple(sorted((OTHER, mine, ANOTHER)))]:
            assert asyncio.run(reach(pki, fwd, app, pins)) == b"ping", pins
        with pytest.raises(UpstreamFailed) as e:
            asyncio.run(reach(pki, fwd, app, (ANOTHER, OTHER)))
        assert e.value.reason == "pin_mismatch" and e.value.http_status == 502
        assert app.accepted == 3  # the refused set reached nothing
    finally:
        fwd.stop()
        app.close()
