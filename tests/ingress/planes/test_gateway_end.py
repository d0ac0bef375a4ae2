"""How the gateway's direction ends, on both data planes: close_notify is its orderly end (the sandbox
sees a FIN and may still answer); a TCP FIN without close_notify before it is a cut or a truncation,
so both sides are reset and it is counted as ``reset_gateway``, as a reset is, and in
``truncated_total{end="fin"}`` (a reset before close_notify: ``end="reset"``). Records with no data
(TLS 1.3 allows them; kernel TLS reads them as 0 bytes, like the end of the stream) end nothing.

The ``ktls`` cases need CONFIG_TLS: scripts/ktls-tests.sh runs them inside a Debian kernel."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ingress: fwd_support
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, make_pki, preamble_for
from ktls_test_hooks import export_keys_for_test, use_test_build
from tls_support import CryptoInfo

from forwarder.ingress.planes import ktls_keys
from forwarder.ingress.settings import ForwarderSettings
from sbxnet.protocol.status import Status

PLANES = [pytest.param("userspace", id="userspace"), pytest.param("ktls", id="ktls", marks=pytest.mark.ktls)]


@pytest.fixture(scope="module")
def epki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("end-pki"))


def forwarder(plane: str, pki: Pki) -> Iterator[ForwarderThread]:
    cert, key = pki.paths["forwarder"]
    settings = ForwarderSettings(
        listen_host="127.0.0.1", listen_port=8443, metrics_port=0, cert_file=cert, key_file=key,
        ca_file=pki.ca_file, client_san_allow=["spiffe://sbxnet.test/gateway"],
        sandbox_prefixes=[ipaddress.ip_network("127.0.0.0/8")],
        allow_targets=[ipaddress.ip_network("127.0.0.1/32")],
        # Emulated CPUs (the ktls cases run under QEMU) are slow: generous connect timing.
        connect_deadline=30.0, connect_syn_interval=1.0, close_timeout=60.0, data_plane=plane,
    )
    f = ForwarderThread(settings)
    assert f.server.plane.name == plane
    yield f
    f.call(f.server.drain(1.0))
    if plane == "ktls":
        f.call(f.server.plane.close())
    f.stop()


@pytest.fixture
def fwd(request: pytest.FixtureRequest, epki: Pki) -> Iterator[ForwarderThread]:
    yield from forwarder(request.param, epki)


@pytest.fixture
def fwd_test_build(
    request: pytest.FixtureRequest, epki: Pki, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ForwarderThread]:
    """A forwarder whose key installer is the test build from the start, so that a gateway client's
    context prepared by the same build can export the keys it sends under."""
    use_test_build(monkeypatch)
    yield from forwarder(request.param, epki)


def outcomes(f: ForwarderThread) -> dict[str, float]:
    names = ("closed", "reset_gateway", "reset_sandbox", "close_timeout", "tls_error", "internal")
    got = {n: f.sample("sbxnet_forwarder_connections_total", {"outcome": n}) for n in names}
    return {n: v for n, v in got.items() if v}


def truncations(f: ForwarderThread) -> dict[str, float]:
    plane = f.server.plane.name
    got = {e: f.sample("sbxnet_forwarder_truncated_total", {"plane": plane, "end": e}) for e in ("fin", "reset")}
    return {e: v for e, v in got.items() if v}


def ended_with_reset_counted(f: ForwarderThread, end: str = "fin") -> None:
    """The forwarder counted one connection, ended ``reset_gateway`` (and, on kTLS, the pump's reason),
    and one truncation that ended with ``end``."""
    f.wait_idle()
    assert outcomes(f) == {"reset_gateway": 1}
    assert truncations(f) == {end: 1}
    if f.server.plane.name == "ktls":
        assert f.server.plane.ends == {"reset": 1}
        assert f.sample("sbxnet_forwarder_plane_ends_total", {"plane": "ktls", "reason": "reset"}) == 1


class ReadingSandbox:
    """Reads ``first`` bytes, says so, then reads on until the end: ``ended`` is ``eof`` or ``reset``, and
    ``rest`` holds what came after ``first``. ``answer`` is sent after a clean end of stream."""

    def __init__(self, first: int, answer: bytes = b"") -> None:
        self.first, self.answer = first, answer
        self.got_first = threading.Event()
        self.head = b""
        self.rest = b""
        self.ended: list[str] = []
        self.app = SandboxApp(self.handle)

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        while len(self.head) < self.first and (chunk := conn.recv(self.first - len(self.head))):
            self.head += chunk
        self.got_first.set()
        try:
            while chunk := conn.recv(65536):
                self.rest += chunk
        except ConnectionResetError:
            self.ended.append("reset")
            return
        self.ended.append("eof")
        conn.sendall(self.answer)


def open_link(f: ForwarderThread, pki: Pki, sb: ReadingSandbox) -> GwClient:
    client = GwClient(f.port, pki.client_ctx(), timeout=60)
    assert client.open(preamble_for(sb.app.port)) is Status.OK
    return client


def close_notify_received(client: GwClient) -> bool:
    """True once the forwarder's close_notify has been read (a bare FIN leaves OpenSSL wanting more)."""
    try:
        return client.tls.read(1) == b""
    except ssl.SSLZeroReturnError:
        return True
    except ssl.SSLWantReadError:
        return False


@pytest.mark.parametrize("fwd", PLANES, indirect=True)
def test_bare_fin_from_gateway_resets_both_sides(fwd: ForwarderThread, epki: Pki) -> None:
    sb = ReadingSandbox(first=7)
    client = open_link(fwd, epki, sb)
    client.send(b"partial")
    assert sb.got_first.wait(60)  # every byte before the FIN was delivered...
    client.sock.shutdown(socket.SHUT_WR)  # ...then the TCP stream ends under TLS, no close_notify
    with pytest.raises(ConnectionResetError):
        client.sock.recv(100)  # the gateway side is reset, not answered with close_notify and FIN
    sb.app.join(60)
    assert not sb.app.errors
    assert (sb.head, sb.rest, sb.ended) == (b"partial", b"", ["reset"])  # never a clean end of stream
    ended_with_reset_counted(fwd)


@pytest.mark.parametrize("fwd", PLANES, indirect=True)
def test_fin_inside_a_record_resets_and_delivers_none_of_it(fwd: ForwarderThread, epki: Pki) -> None:
    sb = ReadingSandbox(first=6)
    client = open_link(fwd, epki, sb)
    client.send(b"whole|")
    assert sb.got_first.wait(60)
    client.tls.write(b"a record cut in half by the end of the TCP stream")
    record = client.out.read()
    client.sock.sendall(record[: len(record) // 2])
    client.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError):
        client.sock.recv(100)
    sb.app.join(60)
    assert not sb.app.errors
    assert (sb.head, sb.rest, sb.ended) == (b"whole|", b"", ["reset"])
    ended_with_reset_counted(fwd)


@pytest.mark.parametrize("fwd", PLANES, indirect=True)
def test_reset_from_gateway_before_close_notify_is_a_truncation(fwd: ForwarderThread, epki: Pki) -> None:
    sb = ReadingSandbox(first=7)
    client = open_link(fwd, epki, sb)
    client.send(b"partial")
    assert sb.got_first.wait(60)
    client.abort()  # a TCP reset, no close_notify: the upload was cut
    sb.app.join(60)
    assert not sb.app.errors
    assert (sb.head, sb.rest, sb.ended) == (b"partial", b"", ["reset"])
    ended_with_reset_counted(fwd, end="reset")


@pytest.mark.parametrize("fwd", PLANES, indirect=True)
def test_reset_from_gateway_after_close_notify_is_no_truncation(fwd: ForwarderThread, epki: Pki) -> None:
    # The gateway's direction ended in order (the sandbox saw its FIN); a reset after that cuts only the
    # answer: reset_gateway, but the upload was whole.
    got_eof, aborted = threading.Event(), threading.Event()
    ended: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        conn.settimeout(60)
        buf = b""
        while chunk := conn.recv(65536):
            buf += chunk
        ended.append(buf)
        got_eof.set()
        assert aborted.wait(60)
        try:
            conn.sendall(b"an answer nobody reads")  # the forwarder finds the gateway side reset
            conn.recv(1)
        except (ConnectionResetError, BrokenPipeError):
            pass  # the forwarder's reset came before our answer went (BrokenPipe) or after it (reset)

    app = SandboxApp(handler)
    client = GwClient(fwd.port, epki.client_ctx(), timeout=60)
    assert client.open(preamble_for(app.port)) is Status.OK
    client.send(b"the whole upload")
    client.close_write()  # close_notify, then FIN
    assert got_eof.wait(60)
    client.abort()
    aborted.set()
    app.join(60)
    assert not app.errors
    assert ended == [b"the whole upload"]
    fwd.wait_idle()
    assert outcomes(fwd) == {"reset_gateway": 1}
    assert truncations(fwd) == {}


@pytest.mark.parametrize("fin", [True, False], ids=["close_notify_then_fin", "close_notify_alone"])
@pytest.mark.parametrize("fwd", PLANES, indirect=True)
def test_close_notify_from_gateway_then_sandbox_answers(fwd: ForwarderThread, epki: Pki, fin: bool) -> None:
    sb = ReadingSandbox(first=5, answer=b"the answer, sent after the gateway's end of stream")
    client = open_link(fwd, epki, sb)
    client.send(b"hello")
    client.send(b" and the rest of the request")
    if fin:
        client.close_write()  # close_notify, then FIN: the FIN after it is no truncation
    else:
        try:
            client.tls.unwrap()
        except ssl.SSLWantReadError:
            pass  # close_notify sent; the forwarder's comes later
        client._flush()
    assert client.recv_all() == b"the answer, sent after the gateway's end of stream"
    assert close_notify_received(client)  # the sandbox's end arrived as close_notify, not a bare FIN
    sb.app.join(60)
    assert not sb.app.errors
    assert (sb.head, sb.rest, sb.ended) == (b"hello", b" and the rest of the request", ["eof"])
    fwd.wait_idle()
    assert outcomes(fwd) == {"closed": 1}
    if fwd.server.plane.name == "ktls":
        assert fwd.server.plane.ends == {"eof": 1}


@pytest.mark.parametrize("end", ["close_notify", "bare_fin"])
@pytest.mark.parametrize("fwd_test_build", PLANES, indirect=True)
def test_records_with_no_data_are_no_end_of_stream(fwd_test_build: ForwarderThread, epki: Pki, end: str) -> None:
    # TLS 1.3 allows empty and padding-only application data records (RFC 8446 5.4); kernel TLS hands
    # them to splice(2) as a read of 0 bytes, the same as the end of the stream. They must end nothing:
    # the data after them arrives, and only what comes last (close_notify, or a bare FIN) decides.
    fwd = fwd_test_build
    sb = ReadingSandbox(first=5, answer=b"answer")
    ctx = epki.client_ctx()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ktls_keys.prepare_context(ctx)  # the client's own secrets become exportable (test build)
    client = GwClient(fwd.port, ctx, timeout=60)
    assert client.open(preamble_for(sb.app.port)) is Status.OK
    client.send(b"hello")
    assert sb.got_first.wait(60)
    tx = CryptoInfo.parse(export_keys_for_test(client.tls)[0])
    assert tx.rec_seq == 2  # the preamble and "hello"; from here on the test seals what the client sends
    records = [
        (b"", 23, 0),
        (b"", 23, 0),
        (b"", 23, 40),
        (b" after records with no data", 23, 0),
        (b"", 23, 0),
    ]
    if end == "close_notify":
        records.append((b"\x01\x00", 21, 0))
    wire = b"".join(tx.seal(tx.rec_seq + i, body, kind, padding=pad) for i, (body, kind, pad) in enumerate(records))
    client.sock.sendall(wire)
    client.sock.shutdown(socket.SHUT_WR)
    if end == "close_notify":
        assert client.recv_all() == b"answer"
        assert close_notify_received(client)
        sb.app.join(60)
        assert (sb.head, sb.rest, sb.ended) == (b"hello", b" after records with no data", ["eof"])
        fwd.wait_idle()
        assert outcomes(fwd) == {"closed": 1}
    else:
        with pytest.raises(ConnectionResetError):
            client.sock.recv(100)
        sb.app.join(60)
        assert (sb.head, sb.rest, sb.ended) == (b"hello", b" after records with no data", ["reset"])
        ended_with_reset_counted(fwd)
    assert not sb.app.errors
