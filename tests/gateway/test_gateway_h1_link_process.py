"""The HTTP/1.1 front's link to the sandbox, with `sbxnet gateway` as a process, a real forwarder and real
sandbox apps (issue 22, in the spirit of point 4: every exchange ends at once, in one access-log line).

- A link the sandbox breaks as the request's head goes up (an app that resets each connection as it
  accepts it) is answered 502 ``upstream_broken``, as docs/gateway.md promises for a link broken before
  any response byte: never a traceback, a status-0 line without a reason and a client left with no answer.
- A client that leaves while its request waits for the link (a sandbox whose program starts late: a cold
  start) ends its exchange at once: one line, ``client_gone``, the link attempt aborted, and nothing of the
  request reaches the app when it comes up. What the client sends during that wait (the rest of its body)
  is kept for the request; a framing error in it is a 400 with nothing upstream, as one that came with the
  head.
- A client that leaves while its request waits for the link (a sandbox whose program starts late: a cold
  start) ends its exchange at once: one line, ``client_gone``, and nothing of the request reaches the app
  when it comes up.

Timing comes from the gateway's own records (each request line's ``duration``), with bounds far from what
the old behaviour took (the link's whole deadline) so they hold on a loaded machine.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_support import DOMAIN, forwarder_settings, front_cert, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp, free_port
from test_gateway_h2 import RawH2

SBXNET = [sys.executable, "-m", "sbxnet.app.cli"]


class GatewayProcess:
    """`sbxnet gateway` with a routes file; its JSON log lines (stderr) collected as they come."""

    def __init__(self, tmp: Path, pki: Pki, sandboxes: dict[str, Any]) -> None:
        front = front_cert(pki)
        routes = tmp / "routes.json"
        routes.write_text(json.dumps({"sandboxes": sandboxes}))
        gw_cert, gw_key = pki.paths["gateway"]
        self.port, self.mport = free_port(), free_port()
        values = {
            "listen_host": '"127.0.0.1"', "listen_port": self.port, "metrics_port": self.mport,
            "domain": f'"{DOMAIN}"', "cert_files": f'["{front.cert_file}"]', "key_files": f'["{front.key_file}"]',
            "routes_file": f'"{routes}"', "upstream_cert_file": f'"{gw_cert}"', "upstream_key_file": f'"{gw_key}"',
            "upstream_ca_file": f'"{pki.ca_file}"', "log_level": '"info"',
        }
        path = tmp / "gateway.toml"
        path.write_text("[gateway]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
        self.proc = subprocess.Popen([*SBXNET, "gateway", "--config", str(path)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.text: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/readyz", timeout=0.5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._lock:
                self.text.append(raw.decode(errors="replace"))

    def stderr(self) -> str:
        with self._lock:
            return "".join(self.text)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for text in self.stderr().splitlines():
            if text.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(text))
        return out

    def requests(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The access-log lines, once there are ``n`` of them (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.lines() if line.get("event") == "request"]
            if len(found) >= n or time.monotonic() >= deadline:
                return found
            time.sleep(0.02)

    def no_traceback(self) -> None:
        err = self.stderr()
        assert "Traceback" not in err and not any(line.get("event") == "internal" for line in self.lines()), \
            err[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def tls(pki: Pki, port: int, sandbox: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(s, server_hostname=f"{sandbox}.{DOMAIN}")


def read_all(s: ssl.SSLSocket, timeout: float = 10.0) -> tuple[bytes, str]:
    """What the gateway sent until it ended the connection, and how it ended (``eof``, ``reset``,
    ``timeout``)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        return out, "timeout"
    except (ConnectionResetError, ssl.SSLError):
        return out, "reset"
    return out, "eof"


class LateApp:
    """A sandbox app whose program listens only on ``listen()`` (a cold start). Its port is bound from the
    start, so nothing else takes it meanwhile (a connect retried to a free loopback port in the ephemeral
    range can end up connected to itself); until ``listen()`` a connect to it is refused, as to a program
    not up yet."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    def listen(self) -> None:
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self.handler(conn)

    def close(self) -> None:
        self.sock.close()


class Recorder:
    """A sandbox app, up only on ``app.listen()``, that keeps what each connection brought and never answers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[bytearray] = []
        self.app = LateApp(self._handle)

    def _handle(self, conn: socket.socket) -> None:
        got = bytearray()
        with self.lock:
            self.conns.append(got)
        conn.settimeout(30)
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                with self.lock:
                    got += data

    def received(self) -> bytes:
        with self.lock:
            return b"".join(bytes(c) for c in self.conns)


def _reset_at_once(conn: socket.socket) -> None:
    """The app's end of each link: reset as soon as it is accepted (a program that stops just then)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


@pytest.fixture
def forwarder(pki: Pki) -> Iterator[ForwarderThread]:
    # connect_deadline: the forwarder waits this long for a sandbox's program to listen (the preamble's
    # deadline, the route's connect_deadline_s, is shorter and wins).
    fwd = ForwarderThread(forwarder_settings(pki, connect_deadline=20.0))
    yield fwd
    fwd.stop()


@pytest.mark.parametrize("proto", ["http/1.1", "h2"])
def test_a_link_reset_as_the_head_goes_up_is_502_upstream_broken_in_one_line(
        tmp_path: Path, pki: Pki, forwarder: ForwarderThread, proto: str) -> None:
    app = SandboxApp(_reset_at_once)
    gw = GatewayProcess(tmp_path, pki, {"gone": registration(pki, forwarder.port, {app.port: ("http", "public")},
                                                             default=app.port)})
    tries = 20  # the reset races the head's write: each try is one chance for the write itself to fail
    answers: list[tuple[bytes, str]] = []
    try:
        if proto == "h2":  # the HTTP/2 front's HTTP/1.1 link: one stream after another on one connection
            h2c = RawH2({"pki": pki, "gw": gw}, f"gone.{DOMAIN}")
            for i in range(tries):
                sid = 1 + 2 * i
                h2c.request(sid, f"gone.{DOMAIN}", "/x")
                got = h2c.wait(sid)[sid]
                answers.append((got.get("headers", {}).get(":status", "").encode(), "reset" if "reset" in got else ""))
            h2c.close()
        else:
            for _ in range(tries):
                s = tls(pki, gw.port, "gone")
                s.sendall(b"GET /x HTTP/1.1\r\nHost: gone.sbx.test\r\n\r\n")
                out, end = read_all(s)
                s.close()
                answers.append((out[:13], end))
        lines = gw.requests(tries)
    finally:
        gw.stop()
        app.close()
    want = (b"502", "") if proto == "h2" else (b"HTTP/1.1 502 ", "eof")
    assert answers == [want] * tries, answers
    assert [(line["status"], line["reason"], line["sandbox_id"]) for line in lines] == \
        [(502, "upstream_broken", "gone")] * tries, lines
    gw.no_traceback()


@pytest.mark.parametrize("how", ["close_notify", "fin", "reset"])
def test_a_client_gone_while_the_link_is_set_up_ends_the_exchange_and_nothing_reaches_the_app(
        tmp_path: Path, pki: Pki, forwarder: ForwarderThread, how: str) -> None:
    rec = Recorder()  # the sandbox's program is not up yet: the link waits for it (cold start)
    gw = GatewayProcess(tmp_path, pki, {"cold": registration(
        pki, forwarder.port, {rec.app.port: ("http", "public")}, default=rec.app.port, deadline=15.0)})
    waited = 0.5
    try:
        s = tls(pki, gw.port, "cold")
        s.sendall(b"POST /once HTTP/1.1\r\nHost: cold.sbx.test\r\nContent-Length: 5\r\n\r\nhello")
        time.sleep(waited)  # the gateway waits for the forwarder's OK meanwhile
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if how == "close_notify":
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.unwrap()  # close_notify; then waits for the gateway's, which ends the connection instead
        s.close()
        lines = gw.requests(1, timeout=3.0)
        rec.app.listen()  # the program comes up: a link still being set up would carry the request now
        time.sleep(1.5)
        lines = gw.requests(1)
        gw.no_traceback()
        forwarder.wait_idle(5)  # the link attempt was aborted, not left open on the forwarder
    finally:
        gw.stop()
        rec.app.close()
    assert len(lines) == 1, lines
    line = lines[0]
    assert (line["status"], line["reason"], line["sandbox_id"], line["bytes_up"]) == (0, "client_gone", "cold", 0), \
        line
    assert line["duration"] < waited + 2.0, line  # not the link's deadline (15 s), nor the program's start
    assert rec.received() == b"", rec.received()  # not a byte of the request reached the app


def _answer_with_body_length(conn: socket.socket) -> None:
    """A sandbox app: one request with a Content-Length body, answered 200 with what it received."""
    conn.settimeout(10)
    got = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in got and (data := conn.recv(65536)):
            got += data
        head, _, body = got.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length and (data := conn.recv(65536)):
            body += data
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        conn.close()


def test_what_the_client_sends_while_the_link_is_set_up_goes_up_whole(
        tmp_path: Path, pki: Pki, forwarder: ForwarderThread) -> None:
    # The client is read while the link waits for the program: its body, sent meanwhile, is kept for the
    # request and goes up with the head once the link is up.
    app = LateApp(_answer_with_body_length)
    gw = GatewayProcess(tmp_path, pki, {"cold": registration(
        pki, forwarder.port, {app.port: ("http", "public")}, default=app.port, deadline=15.0)})
    try:
        s = tls(pki, gw.port, "cold")
        s.sendall(b"POST /p HTTP/1.1\r\nHost: cold.sbx.test\r\nConnection: close\r\nContent-Length: 10\r\n\r\nhello")
        time.sleep(0.4)
        s.sendall(b"world")
        time.sleep(0.4)
        app.listen()
        out, end = read_all(s)
        s.close()
        lines = gw.requests(1)
    finally:
        gw.stop()
        app.close()
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(b"\r\n\r\nhelloworld") and end == "eof", (out, end)
    assert [(line["status"], line.get("reason"), line["bytes_up"]) for line in lines] == [(200, None, 10)], lines
    gw.no_traceback()


def test_a_framing_error_sent_while_the_link_is_set_up_is_400_with_nothing_upstream(
        tmp_path: Path, pki: Pki, forwarder: ForwarderThread) -> None:
    rec = Recorder()
    gw = GatewayProcess(tmp_path, pki, {"cold": registration(
        pki, forwarder.port, {rec.app.port: ("http", "public")}, default=rec.app.port, deadline=15.0)})
    try:
        s = tls(pki, gw.port, "cold")
        s.sendall(b"POST /up HTTP/1.1\r\nHost: cold.sbx.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        time.sleep(0.4)
        s.sendall(b" 5\r\nhello\r\n0\r\n\r\n")  # a chunk size with a space, while the link waits
        time.sleep(0.4)
        rec.app.listen()
        out, end = read_all(s)
        s.close()
        lines = gw.requests(1)
        time.sleep(0.5)
    finally:
        gw.stop()
        rec.app.close()
    assert out.startswith(b"HTTP/1.1 400 ") and b"connection: close" in out.lower(), (out[:200], end)
    assert [(line["status"], line["reason"], line["bytes_up"]) for line in lines] == [(400, "bad_request", 0)], lines
    assert rec.received() == b""
    gw.no_traceback()
