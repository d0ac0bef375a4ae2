"""A kept link to the sandbox that its app closed while it was idle is never used for the next request.

Apps close idle keep-alive connections on their own clock (Node.js after 5 s by default, nginx after
75 s): the next request on the client's connection must then go over a fresh link, not fail with 502.
For HTTP/1.1 clients the session keeps its link between requests; for HTTP/2 clients, links are kept
between streams.
Real parts: an app that closes each connection 0.3 s after its last response, with keep-alive headers
(as Node.js does), behind a real forwarder and the gateway."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fwd_support import ForwarderThread, Pki
from gw_support import DOMAIN, GatewayThread, forwarder_settings, gateway_log, registration
from test_gateway_h2 import RawH2, status

IDLE_CLOSE = 0.3


class IdleClosingApp:
    """HTTP/1.1 keep-alive that closes a connection ``IDLE_CLOSE`` seconds after its last response;
    every answer names the connection it came on (``conn``, counted from 1). With ``race``, it instead
    closes a connection, unanswered, when a second request comes on it: what a gateway sees when the app's
    idle close and its request cross."""

    def __init__(self, *, race: bool = False) -> None:
        self.race = race
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = int(self.lsock.getsockname()[1])
        self.conns = 0
        self.closed_idle = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self._serve, args=(conn, self.conns), daemon=True).start()

    def _serve(self, conn: socket.socket, n: int) -> None:
        buf = b""
        served = 0
        with conn:
            while True:
                conn.settimeout(IDLE_CLOSE if served else 10)
                try:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                except TimeoutError:
                    self.closed_idle += 1
                    return  # idle past our keep-alive timeout: close, as Node.js does
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                if self.race and served:
                    self.closed_idle += 1
                    return  # closed just as the request came: it is never answered
                served += 1
                body = json.dumps({"conn": n, "served": served}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=0\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def stop(self) -> None:
        self.lsock.close()


@pytest.fixture(scope="module")
def chain(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The gateway before two apps: ``node`` closes idle connections, ``racy`` closes a connection as a
    second request arrives on it."""
    fwd = ForwarderThread(forwarder_settings(pki))
    app, racy = IdleClosingApp(), IdleClosingApp(race=True)
    routes = tmp_path_factory.mktemp("routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "node": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port),
        "racy": registration(pki, fwd.port, {racy.port: ("http", "public")}, default=racy.port)}}))
    gw = GatewayThread(pki, routes, idle_timeout=30.0)
    yield {"gw": gw, "fwd": fwd, "app": app, "racy": racy, "pki": pki}
    gw.stop()
    fwd.stop()
    app.stop()
    racy.stop()


def _h1_requests(chain: dict[str, Any], pauses: list[float], *, sandbox: str = "node",
                 method: str = "GET", body: bytes = b"") -> list[tuple[int, int]]:
    """Requests on one HTTP/1.1 client connection, a pause before each: each answer's status and the
    app connection it came on (-1 for an answer that is not the app's)."""
    ctx = ssl.create_default_context(cafile=str(chain["pki"].ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    gw: GatewayThread = chain["gw"]
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", gw.port), timeout=10),
                        server_hostname=f"{sandbox}.{DOMAIN}")
    out = []
    buf = b""
    try:
        for pause in pauses:
            time.sleep(pause)
            framing = f"Content-Length: {len(body)}\r\n" if body else ""
            s.sendall(f"{method} / HTTP/1.1\r\nHost: {sandbox}.{DOMAIN}\r\n{framing}\r\n".encode() + body)
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, "the gateway closed the client connection"
                buf += chunk
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            length = next(int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k.lower() == "content-length")
            while len(buf) < length:
                buf += s.recv(65536)
            answer, buf = buf[:length], buf[length:]
            code = int(lines[0].split()[1])
            out.append((code, json.loads(answer)["conn"] if code == 200 else -1))
            if code != 200:
                break  # the gateway closes after a 502
    finally:
        s.close()
    return out


def test_http1_a_link_the_app_closed_while_idle_is_replaced(chain: dict[str, Any]) -> None:
    app: IdleClosingApp = chain["app"]
    before = app.conns
    with gateway_log() as lines:
        got = _h1_requests(chain, [0.0, 0.0, 1.0, 0.0])
    statuses = [s for s, _ in got]
    assert statuses == [200, 200, 200, 200], (statuses, [x for x in lines.lines if x.get("event") == "request"])
    conns = [c for _, c in got]
    # The first two on one app connection (kept), the third after the app closed it: a new one, kept again.
    assert conns[0] == conns[1] and conns[2] == conns[3] and conns[2] != conns[1]
    assert app.conns - before == 2
    assert app.closed_idle >= 1


def test_http2_streams_reuse_a_link_and_never_one_the_app_closed(chain: dict[str, Any]) -> None:
    """One HTTP/2 client connection, streams one after another: they share one link (one app connection)
    while the app keeps it; after a pause past the app's idle close, the next stream gets a fresh link."""
    app: IdleClosingApp = chain["app"]
    before = app.conns
    c = RawH2(chain, f"node.{DOMAIN}")
    conns = []
    try:
        for sid, pause in ((1, 0.0), (3, 0.0), (5, 0.0), (7, 1.0), (9, 0.0)):
            time.sleep(pause)
            c.request(sid, f"node.{DOMAIN}")
            out = c.wait(sid)
            assert status(out, sid) == "200", out[sid]
            conns.append(json.loads(out[sid]["body"])["conn"])
    finally:
        c.close()
    assert conns[0] == conns[1] == conns[2]  # reused while the app kept it
    assert conns[3] == conns[4] != conns[2]  # replaced after the app closed it, then reused again
    assert app.conns - before == 2


def test_http1_an_idempotent_request_whose_kept_link_closes_under_it_is_sent_again(chain: dict[str, Any]) -> None:
    gw: GatewayThread = chain["gw"]
    before = gw.sample("sbxnet_gateway_upstream_retries_total", {"reason": "kept_link_closed"})
    got = _h1_requests(chain, [0.0, 0.0, 0.0], sandbox="racy")
    assert [code for code, _ in got] == [200, 200, 200]
    assert len({conn for _, conn in got}) == 3  # each second request on a link was sent again on a fresh one
    assert gw.sample("sbxnet_gateway_upstream_retries_total", {"reason": "kept_link_closed"}) - before == 2


def test_http1_a_request_with_a_body_is_not_sent_twice(chain: dict[str, Any]) -> None:
    """A POST (or anything with a body) that may have reached the app is never replayed: 502."""
    got = _h1_requests(chain, [0.0, 0.0], sandbox="racy", method="POST", body=b"x" * 100)
    assert [code for code, _ in got] == [200, 502]


def test_http2_an_idempotent_stream_whose_kept_link_closes_under_it_is_sent_again(chain: dict[str, Any]) -> None:
    gw: GatewayThread = chain["gw"]
    before = gw.sample("sbxnet_gateway_upstream_retries_total", {"reason": "kept_link_closed"})
    c = RawH2(chain, f"racy.{DOMAIN}")
    conns = []
    try:
        for sid in (1, 3, 5):
            c.request(sid, f"racy.{DOMAIN}")
            out = c.wait(sid)
            assert status(out, sid) == "200", out[sid]
            conns.append(json.loads(out[sid]["body"])["conn"])
    finally:
        c.close()
    assert len(set(conns)) == 3
    assert gw.sample("sbxnet_gateway_upstream_retries_total", {"reason": "kept_link_closed"}) - before == 2
