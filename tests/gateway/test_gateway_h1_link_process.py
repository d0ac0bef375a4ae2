"""The HTTP/1.1 front's link to the sandbox, with `sbxnet gateway` as a process, a real forwarder and real
sandbox apps (issue 22, in the spirit of point 4: every exchange ends at once, in one access-log line).

- A link the sandbox breaks as the request's head goes up (an app that resets each connection as it
  accepts it) is answered 502 ``upstream_broken``, as docs/gateway.md promises for a link broken before
  any response byte: never a traceback, a status-0 line without a reason and a client left with no answer.

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
from collections.abc import Iterator
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


class Recorder:
    """A sandbox app that keeps what each connection brought and never answers."""

    def __init__(self, *, listen: bool = True) -> None:
        self.lock = threading.Lock()
        self.conns: list[bytearray] = []
        self.app = SandboxApp(self._handle, listen=listen)

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
