"""Issue 22, point 10, through the real gateway, a real forwarder and real sandbox apps: a ``Connection``
option cannot remove the gateway's own headers (X-Forwarded-*), and one that names a framing header is a
400, with nothing forwarded and no traceback.
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_support import (
    DOMAIN,
    EchoHttp,
    GatewayThread,
    JsonLines,
    forwarder_settings,
    gateway_log,
    registration,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp

CHUNKED_HEAD = b"POST /up HTTP/1.1\r\nHost: rec.sbx.test\r\nTransfer-Encoding: chunked\r\n\r\n"


class Recorder:
    """A sandbox app that never answers: it keeps what each connection brought and how the connection
    ended (``eof``, ``reset``), so a test can see what reached the sandbox and when its link was cut."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[dict[str, Any]] = []
        self.app = SandboxApp(self._handle)

    def _handle(self, conn: socket.socket) -> None:
        rec: dict[str, Any] = {"data": b"", "end": None}
        with self.lock:
            self.conns.append(rec)
        conn.settimeout(60)
        try:
            while data := conn.recv(65536):
                with self.lock:
                    rec["data"] += data
            rec["end"] = "eof"
        except ConnectionResetError:
            rec["end"] = "reset"
        except TimeoutError:
            rec["end"] = "timeout"

    def wait(self, pred: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred(self.conns):
                    return True
            time.sleep(0.01)
        return False

    def received(self) -> bytes:
        with self.lock:
            return b"".join(c["data"] for c in self.conns)


@pytest.fixture(scope="module")
def stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    echo = EchoHttp(ident="alpha")
    rec = Recorder()
    routes = Path(tmp_path_factory.mktemp("routes")) / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {echo.port: ("http", "public")}, default=echo.port),
        "rec": registration(pki, fwd.port, {rec.app.port: ("http", "public")}, default=rec.app.port),
    }}))
    gw = GatewayThread(pki, routes, header_timeout=2.0, idle_timeout=75.0)  # idle_timeout: the default
    yield {"gw": gw, "echo": echo, "rec": rec, "pki": pki}
    gw.stop()
    fwd.stop()
    echo.stop()
    rec.app.close()


def tls(pki: Pki, port: int, sandbox: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(s, server_hostname=f"{sandbox}.{DOMAIN}")


def read_all(s: ssl.SSLSocket, timeout: float = 10.0) -> tuple[bytes, str]:
    """What the gateway sent until it ended the connection, and how it ended (``eof``, ``reset``,
    ``timeout``: nothing ended it within ``timeout``)."""
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


def request_lines(log: JsonLines, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(log.events("request")) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return log.events("request")


def no_traceback(log: JsonLines) -> None:
    assert not log.events("internal"), log.events("internal")
    assert not any("exc_info" in line or "Traceback" in text for line, text in zip(log.lines, log.text, strict=True))


# -- point 10 -------------------------------------------------------------------------------------------

def test_connection_cannot_name_the_gateways_own_headers_away(stack: dict[str, Any]) -> None:
    gw: GatewayThread = stack["gw"]
    s = tls(stack["pki"], gw.port, "alpha")
    s.sendall(b"GET /who HTTP/1.1\r\nHost: alpha.sbx.test\r\n"
              b"Connection: close, X-Forwarded-For, X-Forwarded-Proto, X-Forwarded-Host, X-Drop\r\n"
              b"X-Forwarded-For: 6.6.6.6\r\nX-Drop: 1\r\nX-Keep: 2\r\n\r\n")
    out, _ = read_all(s)
    s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), out[:200]
    seen = json.loads(body)
    headers = seen["headers"]
    forwarded = [(k, v) for k, v in headers if k.startswith("x-forwarded-")]
    assert sorted(forwarded) == [("x-forwarded-for", "127.0.0.1"), ("x-forwarded-host", f"alpha.{DOMAIN}"),
                                 ("x-forwarded-proto", "https")], headers
    names = [k for k, _ in headers]
    assert "x-drop" not in names and "x-keep" in names  # what Connection names is still hop-by-hop


@pytest.mark.parametrize("framing", [
    b"Connection: Content-Length\r\nContent-Length: 5\r\n\r\nhello",
    b"Connection: Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"Connection: keep-alive, host\r\nContent-Length: 5\r\n\r\nhello",
], ids=["content-length", "transfer-encoding", "host"])
def test_a_connection_option_naming_a_framing_header_is_400_with_nothing_forwarded_and_no_traceback(
        stack: dict[str, Any], framing: bytes) -> None:
    gw: GatewayThread = stack["gw"]
    echo: EchoHttp = stack["echo"]
    before = len(echo.requests)
    with gateway_log(gw) as log:
        s = tls(stack["pki"], gw.port, "alpha")
        s.sendall(b"POST /p HTTP/1.1\r\nHost: alpha.sbx.test\r\n" + framing)
        out, end = read_all(s)
        s.close()
        lines = request_lines(log, 1)
        no_traceback(log)
    assert out.startswith(b"HTTP/1.1 400 "), (out[:100], end)
    assert [(line["status"], line["reason"]) for line in lines] == [(400, "connection_names_framing")], lines
    assert len(echo.requests) == before
