"""Everything the forwarder refuses: who may connect, what they may send, where they may go."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable

import pytest
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, open_fds, preamble_for

from sbxnet.protocol.status import Status

MakeForwarder = Callable[..., ForwarderThread]  # the make_forwarder fixture (tests/ingress/conftest.py)


def _never(conn: object) -> None:
    raise AssertionError("the sandbox must not be reached")


# -- mutual TLS ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stem", "tls12", "reason"),
    [
        ("foreign", False, "unknown_ca"),
        ("expired", False, "cert_expired"),
        (None, False, "no_client_cert"),
        ("gateway", True, "protocol_version"),
    ],
)
def test_handshake_refusals(forwarder: ForwarderThread, pki: Pki, stem: str | None, tls12: bool, reason: str) -> None:
    app = SandboxApp(_never)
    client = GwClient(forwarder.port, pki.client_ctx(stem, tls12_only=tls12))
    with pytest.raises((ssl.SSLError, ConnectionError, EOFError)):
        # TLS 1.3 clients finish before the server judges their certificate: the refusal shows on
        # the first read.
        client.open(preamble_for(app.port))
    client.close()
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_handshake_rejects_total", {"reason": reason}) == 1
    assert app.accepted == 0


def test_san_not_on_allowlist(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_never)
    client = GwClient(forwarder.port, pki.client_ctx("intruder"))
    assert client.open(preamble_for(app.port)) is Status.FORBIDDEN
    client.close()
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_handshake_rejects_total", {"reason": "san_not_allowed"}) == 1
    assert app.accepted == 0


def test_star_segment_allowlist(make_forwarder: MakeForwarder, pki: Pki) -> None:
    fwd = make_forwarder(client_san_allow=["spiffe://sbxnet.test/*"])
    app = SandboxApp(lambda conn: None)
    client = GwClient(fwd.port, pki.client_ctx("intruder"))
    assert client.open(preamble_for(app.port)) is Status.OK
    client.close()


# -- preamble --------------------------------------------------------------------------------------


def test_bad_preambles_refused_without_connect(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_never)
    good = preamble_for(app.port)
    bad = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        good[:12] + b"\x20" + good[13:],  # LOCAL command
        good[:13] + b"\x12" + good[14:],  # UDP
        good[:14] + (600).to_bytes(2, "big") + good[16:],  # longer than the 512-byte bound
        good[:-3] + b"a/b",  # sandbox ID with a character outside the set
    ]
    for data in bad:
        client = GwClient(forwarder.port, pki.client_ctx())
        assert client.open(data) is Status.BAD_PREAMBLE
        client.close()
    forwarder.wait_idle()
    assert app.accepted == 0
    total = sum(
        s.value
        for m in forwarder.server.metrics.registry.collect()
        if m.name == "sbxnet_forwarder_preamble_rejects"
        for s in m.samples
        if s.name.endswith("_total")
    )
    assert total == len(bad)


def test_preamble_dripped_one_byte_per_second_is_cut_at_the_timeout(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_never)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.handshake()
    data = preamble_for(app.port)
    t0 = time.monotonic()
    status = None
    for i in range(len(data)):
        try:
            client.send(data[i : i + 1])
        except OSError:
            break
        client.sock.settimeout(1.0)
        try:
            client.fill()
        except TimeoutError:
            continue  # nothing back within a second: drip the next byte
        if len(client.plain) >= 4:
            status = bytes(client.plain[:4])
            break
        if client.eof:
            break
    elapsed = time.monotonic() - t0
    assert status == b"SX\x01\x03"  # BAD_PREAMBLE
    assert 1.8 < elapsed < 3.5
    forwarder.wait_idle()
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "timeout"}) == 1
    assert app.accepted == 0


def _echo_once(conn: socket.socket) -> None:
    conn.sendall(conn.recv(100))


def test_a_pooled_link_waits_past_the_preamble_timeout_for_its_first_byte(
    make_forwarder: MakeForwarder, pki: Pki
) -> None:
    """The warm pool's case: handshaken now, used later. The preamble timeout runs from the first byte."""
    fwd = make_forwarder(preamble_timeout=0.3, preamble_idle_timeout=20.0)
    app = SandboxApp(_echo_once)
    client = GwClient(fwd.port, pki.client_ctx())
    client.handshake()
    time.sleep(1.0)  # more than three preamble timeouts, well inside the idle one
    client.send_preamble(preamble_for(app.port))
    assert client.open_status() is Status.OK
    client.send(b"ping")
    assert client.recv_exact(4) == b"ping"
    client.close()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "timeout"}) == 0


def test_a_link_with_no_first_byte_is_closed_at_the_idle_timeout(make_forwarder: MakeForwarder, pki: Pki) -> None:
    fwd = make_forwarder(preamble_timeout=5.0, preamble_idle_timeout=0.5)
    app = SandboxApp(_never)
    client = GwClient(fwd.port, pki.client_ctx())
    client.handshake()
    t0 = time.monotonic()
    client.sock.settimeout(10)
    while client.fill():  # the session tickets, then the answer and the end of the link
        pass
    elapsed = time.monotonic() - t0
    assert bytes(client.plain[:4]) == b"SX\x01\x03"  # BAD_PREAMBLE: the gateway hears why
    assert 0.4 < elapsed < 4.0  # cut at the idle timeout, not the 5 s preamble timeout
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "idle"}) == 1
    assert app.accepted == 0


@pytest.mark.parametrize(
    ("dst", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("169.254.169.254", "link_local"),
        ("10.99.0.1", "outside_prefixes"),
    ],
)
def test_forbidden_targets(make_forwarder: MakeForwarder, pki: Pki, dst: str, reason: str) -> None:
    import ipaddress

    fwd = make_forwarder(
        sandbox_prefixes=[ipaddress.ip_network("0.0.0.0/1"), ipaddress.ip_network("128.0.0.0/1")],
        allow_targets=[],
    )
    if dst == "10.99.0.1":
        fwd = make_forwarder(sandbox_prefixes=[ipaddress.ip_network("192.0.2.0/24")], allow_targets=[])
    client = GwClient(fwd.port, pki.client_ctx())
    assert client.open(preamble_for(8080, dst=dst)) is Status.FORBIDDEN
    client.close()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_target_rejects_total", {"reason": reason}) == 1


def test_host_address_refused(make_forwarder: MakeForwarder, pki: Pki) -> None:
    import ipaddress

    from forwarder.ingress.host_addrs import host_addresses

    candidates = [a for a in host_addresses() if a.version == 4 and not a.is_loopback]
    if not candidates:
        pytest.skip("this host has no non-loopback IPv4 address to refuse")
    addr = sorted(candidates)[0]
    fwd = make_forwarder(sandbox_prefixes=[ipaddress.ip_network("0.0.0.0/0")], allow_targets=[])
    client = GwClient(fwd.port, pki.client_ctx())
    assert client.open(preamble_for(8080, dst=str(addr))) is Status.FORBIDDEN
    client.close()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_target_rejects_total", {"reason": "host_address"}) == 1


# -- sandbox not there -----------------------------------------------------------------------------


def test_not_listening_gets_status_and_leaks_nothing(make_forwarder: MakeForwarder, pki: Pki) -> None:
    fwd = make_forwarder(connect_deadline=0.3)
    app = SandboxApp(_never, listen=False)  # a port nobody listens on
    before = open_fds()
    for _ in range(3):
        client = GwClient(fwd.port, pki.client_ctx())
        t0 = time.monotonic()
        assert client.open(preamble_for(app.port)) is Status.NOT_LISTENING
        assert 0.25 < time.monotonic() - t0 < 1.0
        client.close()
    fwd.wait_idle()
    time.sleep(0.05)
    assert open_fds() - before == set()
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "not_listening"}) == 3
    assert fwd.sample("sbxnet_forwarder_connect_attempts_total") >= 3 * 4


def test_the_preambles_deadline_shortens_the_connect_never_lengthens_it(make_forwarder: MakeForwarder,
                                                                        pki: Pki) -> None:
    """The gateway says how long it still waits (the deadline TLV): the connect gives up by then, so the
    gateway hears NOT_LISTENING while it listens. A deadline past the forwarder's own is cut to its own.
    Times are the forwarder's (its connect_seconds histogram)."""
    fwd = make_forwarder(connect_deadline=3.0)
    app = SandboxApp(_never, listen=False)
    client = GwClient(fwd.port, pki.client_ctx())
    assert client.open(preamble_for(app.port, deadline_ms=400)) is Status.NOT_LISTENING
    client.close()
    fwd.wait_idle()
    took = fwd.sample("sbxnet_forwarder_connect_seconds_sum", {"result": "failed"})
    assert 0.35 < took < 2.0, took  # 0.4 s, not the forwarder's 3 s
    client = GwClient(fwd.port, pki.client_ctx())
    assert client.open(preamble_for(app.port, deadline_ms=300_000)) is Status.NOT_LISTENING
    client.close()
    fwd.wait_idle()
    longer = fwd.sample("sbxnet_forwarder_connect_seconds_sum", {"result": "failed"}) - took
    assert 2.9 < longer < 10.0, longer  # its own 3 s, not the 300 s asked for


def _outcomes(fwd: ForwarderThread) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in fwd.server.metrics.registry.collect()
            if m.name == "sbxnet_forwarder_connections" for s in m.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("leave", ["close", "abort", "idle"])
def test_a_peer_that_leaves_before_the_preamble_is_no_preamble(make_forwarder: MakeForwarder, pki: Pki,
                                                               leave: str) -> None:
    """A handshake and then not one preamble byte (a pooled link retired with close_notify, a gateway that
    refused our key and reset, a link left idle) is its own outcome, ``no_preamble``: no preamble was
    sent, so none was bad. The reason is still counted in ``preamble_rejects`` (unused, reset, idle)."""
    fwd = make_forwarder(preamble_idle_timeout=0.3)
    app = SandboxApp(_never)
    client = GwClient(fwd.port, pki.client_ctx())
    client.handshake()
    if leave == "close":
        client.close_write()
        client.close()
    elif leave == "abort":
        client.abort()
    else:
        client.sock.settimeout(10)
        while client.fill():  # the forwarder ends it at the idle timeout
            pass
        client.close()
    fwd.wait_idle()
    assert _outcomes(fwd) == {"no_preamble": 1}
    assert app.accepted == 0


def test_a_peer_that_leaves_mid_preamble_is_still_bad_preamble(forwarder: ForwarderThread, pki: Pki) -> None:
    app = SandboxApp(_never)
    client = GwClient(forwarder.port, pki.client_ctx())
    client.handshake()
    client.send(preamble_for(app.port)[:10])
    client.close_write()  # an orderly end, so the bytes before it are read (a reset could discard them)
    forwarder.wait_idle()
    client.close()
    assert _outcomes(forwarder) == {"bad_preamble": 1}
    assert forwarder.sample("sbxnet_forwarder_preamble_rejects_total", {"reason": "eof"}) == 1
