"""How the HTTP/1.1 front cuts a response into TLS records: what one read of the link gave goes to the
client in one write (a small response is one record, not a head and a body), and nothing waits for more
than has come (a response whose body comes later reaches the client part by part)."""

from __future__ import annotations

import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_support import DOMAIN, GatewayThread, forwarder_settings, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp

BODY = b"x" * 1000
LATER = threading.Event()  # the app sends the rest of /later only once the client has the first part


def _app(conn: socket.socket) -> None:
    """Each request answered with one send (/later: the head and a first part, then the rest when told)."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        if head.startswith(b"GET /later "):
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (2 * len(BODY)) + BODY)
            if not LATER.wait(10):
                return
            conn.sendall(BODY)
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)


@pytest.fixture(scope="module")
def routes(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = SandboxApp(_app)
    path = Path(tmp_path_factory.mktemp("routes")) / "routes.json"
    path.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port)}}))
    yield path
    fwd.stop()


@pytest.fixture(scope="module")
def gw(pki: Pki, routes: Path) -> Iterator[GatewayThread]:
    g = GatewayThread(pki, routes)
    yield g
    g.stop()


class _RecordClient:
    """A TLS client over memory BIOs that sees the server's records: counted as they come off the wire."""

    def __init__(self, port: int, ca_file: Path) -> None:
        ctx = ssl.create_default_context(cafile=str(ca_file))
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_hostname=f"alpha.{DOMAIN}")
        self.raw = b""  # ciphertext not yet split into records
        self.records = 0
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._recv()
        self._flush()

    def _flush(self) -> None:
        if data := self.out.read():
            self.sock.sendall(data)

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the gateway closed")
        self.raw += data
        while len(self.raw) >= 5 and len(self.raw) >= 5 + int.from_bytes(self.raw[3:5], "big"):
            end = 5 + int.from_bytes(self.raw[3:5], "big")
            self.inc.write(self.raw[:end])
            self.raw = self.raw[end:]
            self.records += 1

    def request(self, path: str) -> None:
        self.obj.write(f"GET {path} HTTP/1.1\r\nHost: alpha.{DOMAIN}\r\n\r\n".encode())
        self._flush()

    def read_until(self, size: int) -> bytes:
        """At least ``size`` plaintext bytes (the response's head and body as far as asked)."""
        got = b""
        while len(got) < size:
            try:
                data = self.obj.read(65536)
            except ssl.SSLWantReadError:
                self._recv()
                continue
            if not data:
                raise EOFError("close_notify")
            got += data
        return got

    def response(self) -> bytes:
        got = self.read_until(1)
        while b"\r\n\r\n" not in got:
            got += self.read_until(1)
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        if len(body) < length:
            body += self.read_until(length - len(body))
        return body

    def close(self) -> None:
        self.sock.close()


def test_a_small_response_reaches_the_client_in_one_record(gw: GatewayThread, pki: Pki) -> None:
    c = _RecordClient(gw.port, pki.ca_file)
    try:
        c.request("/first")
        assert c.response() == BODY  # the session tickets came before it: counted from here on
        for _ in range(3):
            before = c.records
            c.request("/again")
            assert c.response() == BODY
            assert c.records - before == 1  # head and body in one record (they were two)
    finally:
        c.close()


def test_a_body_that_comes_later_is_not_waited_for(gw: GatewayThread, pki: Pki) -> None:
    """Coalescing never holds what has come: the head and the first part reach the client while the app
    still holds the rest (it sends it only once the client has them)."""
    LATER.clear()
    c = _RecordClient(gw.port, pki.ca_file)
    try:
        c.request("/later")
        got = c.read_until(1)
        while not got.endswith(BODY):
            got += c.read_until(1)
        head, _, first = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and first == BODY
        LATER.set()
        assert c.read_until(len(BODY)) == BODY
    finally:
        LATER.set()
        c.close()


def test_the_idle_timeout_runs_from_the_last_exchange_whatever_came_before(pki: Pki, routes: Path) -> None:
    """One idle timer serves the connection's whole life: requests that keep coming inside the timeout keep
    it open past several timeouts' worth, and once they stop it ends in order one timeout after the last."""
    idle = 1.0
    g = GatewayThread(pki, routes, idle_timeout=idle)
    c = _RecordClient(g.port, pki.ca_file)
    try:
        started = last = time.monotonic()
        while last - started < 3 * idle:
            time.sleep(idle / 5)
            c.request("/again")
            assert c.response() == BODY
            last = time.monotonic()
        with pytest.raises(EOFError):  # close_notify: ended in order
            c.read_until(1)
        waited = time.monotonic() - last
        assert idle - 0.1 <= waited < idle + 4
    finally:
        c.close()
        g.stop()
