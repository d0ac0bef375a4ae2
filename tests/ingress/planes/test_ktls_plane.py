"""The ktls data plane end to end: a real forwarder (kernel TLS + splice pump) between a TLS gateway
client and sandbox apps. Needs CONFIG_TLS: scripts/ktls-tests.sh runs these inside a Debian kernel."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ingress: fwd_support
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, make_pki, payload, preamble_for
from ktls_test_hooks import key_update_for_test

from forwarder.ingress.planes import ktls_keys as ktls
from forwarder.ingress.settings import ForwarderSettings
from sbxnet.protocol.status import Status

pytestmark = pytest.mark.ktls
MiB = 1 << 20
XFER = int(os.environ.get("KTLS_XFER_MIB", "64")) * MiB


@pytest.fixture(scope="module")
def kpki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("kpki"))


@pytest.fixture
def fwd(kpki: Pki) -> Iterator[ForwarderThread]:
    cert, key = kpki.paths["forwarder"]
    settings = ForwarderSettings(
        listen_host="127.0.0.1", listen_port=8443, metrics_port=0, cert_file=cert, key_file=key,
        ca_file=kpki.ca_file, client_san_allow=["spiffe://sbxnet.test/gateway"],
        sandbox_prefixes=[ipaddress.ip_network("127.0.0.0/8")],
        allow_targets=[ipaddress.ip_network("127.0.0.1/32")],
        # Emulated CPUs are slow: a 50 ms fresh-SYN interval could abandon every attempt under load.
        connect_deadline=30.0, connect_syn_interval=1.0, close_timeout=120.0, data_plane="ktls",
    )
    f = ForwarderThread(settings)
    assert f.server.plane.name == "ktls"
    yield f
    f.call(f.server.drain(1.0))
    f.call(plane(f).close())
    f.stop()


def plane(f: ForwarderThread) -> Any:
    return f.server.plane


def wait_for(cond: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def gateway_fd_of(client: GwClient) -> int:
    """The forwarder-side descriptor (owned by the pump) of the client's TCP connection."""
    want = client.sock.getsockname()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername() == want:
                return fd
        except OSError:
            pass
        finally:
            s.close()
    raise AssertionError("gateway socket not found")


class DuplexSandbox:
    """Sends ``down`` while reading everything the gateway sends, then reports the digest."""

    def __init__(self, down: bytes) -> None:
        self.down = down
        self.got: list[tuple[bytes, int]] = []
        self.app = SandboxApp(self.handle)

    def handle(self, conn: socket.socket) -> None:
        def send() -> None:
            view = memoryview(self.down)
            for off in range(0, len(view), MiB):
                conn.sendall(view[off : off + MiB])
            conn.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        h, n = hashlib.sha256(), 0
        while chunk := conn.recv(1 << 18):
            h.update(chunk)
            n += len(chunk)
        t.join()
        self.got.append((h.digest(), n))


def test_64mib_each_way_both_directions_with_proof_of_bypass(fwd: ForwarderThread, kpki: Pki) -> None:
    up, down = payload(XFER, 1), payload(XFER, 2)
    sb = DuplexSandbox(down)
    before = ktls.tls_stat()
    client = GwClient(fwd.port, kpki.client_ctx())
    assert client.open(preamble_for(sb.app.port)) is Status.OK
    wait_for(lambda: plane(fwd).pump is not None and plane(fwd).pump.stats().active == 1)
    # Both directions are in the kernel on the forwarder's gateway socket...
    assert ktls.installed_directions(gateway_fd_of(client)) == (True, True)
    during = ktls.tls_stat()
    assert during["TlsCurrTxSw"] == before.get("TlsCurrTxSw", 0) + 1
    assert during["TlsCurrRxSw"] == before.get("TlsCurrRxSw", 0) + 1
    digest = client.exchange(up)
    assert digest == hashlib.sha256(down).digest() and client.received_len == XFER
    sb.app.join()
    assert sb.got == [(hashlib.sha256(up).digest(), XFER)]
    fwd.wait_idle()
    # ...the pump counted exactly what moved, and the Python side holds no descriptor to copy with.
    st = plane(fwd).pump.stats()
    assert (st.bytes_up, st.bytes_down) == (XFER, XFER)
    assert st.splice_calls > 0
    assert plane(fwd).ends["eof"] == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1
    assert fwd.sample("sbxnet_forwarder_data_plane", {"plane": "ktls"}) == 1
    after = ktls.tls_stat()
    assert after.get("TlsDecryptError", 0) == before.get("TlsDecryptError", 0)
    print(f"\n[emulated kernel: functional only] {XFER >> 20} MiB each way moved by kTLS + splice")


def test_8_connections_at_once(fwd: ForwarderThread, kpki: Pki) -> None:
    size = max(MiB, XFER // 8)
    results: list[tuple[bool, bool]] = []
    sandboxes = []

    def one(i: int) -> None:
        up, down = payload(size, 10 + i), payload(size, 20 + i)
        sb = DuplexSandbox(down)
        sandboxes.append((sb, up))
        client = GwClient(fwd.port, kpki.client_ctx())
        assert client.open(preamble_for(sb.app.port)) is Status.OK
        digest = client.exchange(up)
        sb.app.join()
        results.append((digest == hashlib.sha256(down).digest(), sb.got == [(hashlib.sha256(up).digest(), size)]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == [(True, True)] * 8
    fwd.wait_idle()
    st = plane(fwd).pump.stats()
    assert (st.bytes_up, st.bytes_down, st.finished) == (8 * size, 8 * size, 8)


def test_preamble_and_first_tenant_bytes_in_one_record(fwd: ForwarderThread, kpki: Pki) -> None:
    got: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        buf = b""
        while chunk := conn.recv(65536):
            buf += chunk
        got.append(buf)

    app = SandboxApp(handler)
    client = GwClient(fwd.port, kpki.client_ctx())
    client.handshake()
    client.send(preamble_for(app.port) + b"first tenant bytes|")  # one record
    assert client.recv_exact(4)
    client.send(b"then more through the kernel")
    client.close_write()
    assert client.recv_all() == b""
    app.join()
    assert got == [b"first tenant bytes|then more through the kernel"]


def test_preamble_split_over_two_records(fwd: ForwarderThread, kpki: Pki) -> None:
    got: list[bytes] = []
    app = SandboxApp(lambda c: got.append(c.recv(100)))
    client = GwClient(fwd.port, kpki.client_ctx())
    client.handshake()
    pre = preamble_for(app.port)
    client.send(pre[:9])
    client.send(pre[9:])
    assert client.recv_exact(4)
    client.send(b"after two records")
    app.join()
    assert got == [b"after two records"]


def test_gateway_half_close_with_close_notify(fwd: ForwarderThread, kpki: Pki) -> None:
    def handler(conn: socket.socket) -> None:
        buf = b""
        while chunk := conn.recv(4096):
            buf += chunk
        conn.sendall(b"got " + str(len(buf)).encode())

    app = SandboxApp(handler)
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"x" * 100_000)
    # close_notify alone, no FIN: the kernel hands it to the pump as an alert record = end of stream.
    try:
        client.tls.unwrap()
    except Exception:
        pass
    client._flush()
    assert client.recv_all() == b"got 100000"
    assert client.eof
    app.join()
    fwd.wait_idle()
    assert plane(fwd).ends["eof"] == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "closed"}) == 1


def test_sandbox_half_close_sends_close_notify(fwd: ForwarderThread, kpki: Pki) -> None:
    received: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        conn.sendall(b"banner")
        conn.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := conn.recv(4096):
            buf += chunk
        received.append(buf)

    app = SandboxApp(handler)
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    assert client.recv_all() == b"banner"
    assert client.eof  # close_notify from the pump (a TCP FIN alone would be a truncation)
    client.send(b"y" * 50_000)
    client.close_write()
    app.join()
    assert received == [b"y" * 50_000]


@pytest.mark.parametrize("who", ["gateway", "sandbox"])
def test_reset_each_way(fwd: ForwarderThread, kpki: Pki, who: str) -> None:
    seen: list[str] = []
    ready = threading.Event()

    def handler(conn: socket.socket) -> None:
        conn.recv(10)
        ready.set()
        if who == "sandbox":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return
        try:
            conn.recv(10)
            seen.append("eof")
        except ConnectionResetError:
            seen.append("reset")

    app = SandboxApp(handler)
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"hello")
    ready.wait(10)
    if who == "gateway":
        client.abort()
        app.join()
        assert seen == ["reset"]
    else:
        with pytest.raises(ConnectionResetError):
            client.recv_all()
    fwd.wait_idle()
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": f"reset_{who}"}) == 1


def test_key_update_from_gateway_closes_cleanly(fwd: ForwarderThread, kpki: Pki) -> None:
    got: list[bytes] = []
    app = SandboxApp(lambda c: got.append(c.recv(100) + c.recv(100)))
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"before")
    time.sleep(0.2)
    key_update_for_test(client.tls)
    client.tls.do_handshake()  # sends the KeyUpdate record
    client._flush()
    assert client.recv_all() == b""  # close_notify, then FIN: an orderly close
    app.join()
    assert got == [b"before"]  # and then an end of stream, not a reset
    fwd.wait_idle()
    assert plane(fwd).ends["tls_key_update"] == 1
    assert fwd.sample("sbxnet_forwarder_plane_ends_total", {"plane": "ktls", "reason": "tls_key_update"}) == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "tls_error"}) == 1


def test_record_that_fails_to_decrypt(fwd: ForwarderThread, kpki: Pki) -> None:
    got: list[bytes] = []
    errors: list[str] = []

    def handler(conn: socket.socket) -> None:
        try:
            while chunk := conn.recv(65536):
                got.append(chunk)
        except ConnectionResetError:
            errors.append("reset")

    app = SandboxApp(handler)
    before = ktls.tls_stat()
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    client.tls.write(b"secret tenant data that must not arrive")
    record = bytearray(client.out.read())
    record[10] ^= 0x01  # one ciphertext byte
    client.sock.sendall(bytes(record))
    with pytest.raises((ConnectionResetError, EOFError)):
        client.recv_all()
        raise EOFError
    app.join()
    assert got == [] and errors == ["reset"]
    fwd.wait_idle()
    assert plane(fwd).ends["tls_decrypt_error"] == 1
    assert fwd.sample("sbxnet_forwarder_plane_ends_total", {"plane": "ktls", "reason": "tls_decrypt_error"}) == 1
    assert fwd.sample("sbxnet_forwarder_connections_total", {"outcome": "tls_error"}) == 1
    assert ktls.tls_stat()["TlsDecryptError"] == before.get("TlsDecryptError", 0) + 1


def test_no_descriptor_leaks(fwd: ForwarderThread, kpki: Pki) -> None:
    app = SandboxApp(lambda c: c.sendall(c.recv(100)))
    client = GwClient(fwd.port, kpki.client_ctx())
    client.open(preamble_for(app.port))
    client.send(b"warm-up")
    assert client.recv_exact(7) == b"warm-up"
    client.close_write()
    client.recv_all()
    client.close()
    app.join()
    fwd.wait_idle()
    base = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        client = GwClient(fwd.port, kpki.client_ctx())
        client.open(preamble_for(app.port))
        client.send(b"ping")
        assert client.recv_exact(4) == b"ping"
        client.close_write()
        client.recv_all()
        client.close()
    app.join()
    fwd.wait_idle()
    wait_for(lambda: plane(fwd).pump.stats().active == 0)
    assert len(os.listdir("/proc/self/fd")) <= base
