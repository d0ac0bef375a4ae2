"""The gateway's drain (SIGTERM) and how it ends connections, with real clients through a real forwarder.

Drain: an idle HTTP/1.1 keep-alive connection and an idle HTTP/2 connection are closed in order at once
(close_notify, not a bare FIN); a request in flight is answered with ``Connection: close`` (curl); an
HTTP/2 client gets GOAWAY (NO_ERROR, its last stream) at once, its stream in flight finishes (the h2
library and curl), a stream opened after the GOAWAY is refused; the drain returns as soon as the last
connection is gone. A WebSocket (the websockets library) and a raw TCP connection are not told: they run
on until the drain's timeout and are then cut, reset at both ends and counted.

Links: each sandbox app here records how its connection ended at its socket, FIN (``eof``) or ``reset``.
After a complete exchange (a keep-alive session over HTTP/1.1, an HTTP/2 stream, an h2c connection) it
sees a FIN; when the client vanished mid-response, a reset.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h11
import pytest
from fwd_support import ForwarderThread, Pki, SandboxApp
from gw_support import DOMAIN, GatewayThread, forwarder_settings, gateway_log, registration
from test_raw_routes import live_fds, loop_tasks

from gateway.http2 import goaway_frame

CURL = shutil.which("curl")
Codes = h2.errors.ErrorCodes
HOLD_LIMIT = 30.0  # how long the app holds a /hold request at most (a test that fails must not hang)


# -- sandbox apps that say how their connection ended --------------------------------------------------


class Recorded:
    """A sandbox program (``handler(conn, record)`` per connection, in a thread) and one record per
    connection: a dict the handler fills in, ``end`` (``eof``: a FIN, ``reset``) last."""

    def __init__(self, handler: Callable[[socket.socket, dict[str, Any]], None]) -> None:
        self.records: list[dict[str, Any]] = []

        def run(conn: socket.socket) -> None:
            rec: dict[str, Any] = {"paths": []}
            self.records.append(rec)
            handler(conn, rec)

        self.app = SandboxApp(run)
        self.port = self.app.port

    def ended(self, path: str, timeout: float = 10.0) -> str:
        """How the connection that served ``path`` ended, once it has."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in list(self.records):
                if path in rec["paths"] and "end" in rec:
                    return str(rec["end"])
            time.sleep(0.01)
        raise AssertionError(f"no ended connection served {path}: {self.records}")

    def served(self) -> list[str]:
        return [p for rec in list(self.records) for p in rec["paths"]]


class HttpApp(Recorded):
    """HTTP/1.1 with keep-alive (h11): ``/hold`` is answered once ``release`` is set, ``/bytes/<n>`` with n
    bytes, anything else with a line naming the path."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()  # a /hold request has come
        super().__init__(self._serve)

    def _serve(self, conn: socket.socket, rec: dict[str, Any]) -> None:
        h = h11.Connection(h11.SERVER)
        path = ""
        try:
            while True:
                ev = h.next_event()
                if ev is h11.NEED_DATA:
                    h.receive_data(conn.recv(65536))
                elif isinstance(ev, h11.ConnectionClosed):
                    rec["end"] = "eof"
                    return
                elif isinstance(ev, h11.Request):
                    path = ev.target.decode()
                    rec["paths"].append(path)
                elif isinstance(ev, h11.EndOfMessage):
                    self._answer(conn, h, path)
                    if h.our_state is h11.MUST_CLOSE:
                        rec["end"] = "closed_by_app"
                        return
                    h.start_next_cycle()
        except (ConnectionResetError, BrokenPipeError):
            rec["end"] = "reset"
        except h11.RemoteProtocolError:
            rec["end"] = "eof_mid_request"

    def _answer(self, conn: socket.socket, h: h11.Connection, path: str) -> None:
        if path == "/hold":
            self.holding.set()
            self.release.wait(HOLD_LIMIT)
        if path.startswith("/bytes/"):
            n = int(path.split("/")[2])
            conn.sendall(h.send(h11.Response(status_code=200, headers=[("content-length", str(n))])))
            chunk = b"x" * 65536
            while n:
                conn.sendall(h.send(h11.Data(data=chunk[: min(n, len(chunk))])))
                n -= min(n, len(chunk))
        else:
            body = b"released" if path == "/hold" else f"served {path}".encode()
            conn.sendall(h.send(h11.Response(status_code=200, headers=[("content-length", str(len(body)))])))
            conn.sendall(h.send(h11.Data(data=body)))
        conn.sendall(h.send(h11.EndOfMessage()))


def h2c_app(conn: socket.socket, rec: dict[str, Any]) -> None:
    """HTTP/2 with prior knowledge (the h2 library): every stream answered ``200`` when its request ends;
    the GOAWAY codes the gateway sends are recorded (``goaways``)."""
    h = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    h.initiate_connection()
    rec["goaways"] = []
    try:
        conn.sendall(h.data_to_send())
        while True:
            data = conn.recv(65536)
            if not data:
                rec["end"] = "eof"
                return
            for ev in h.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    rec["paths"].append(dict(ev.headers)[b":path"].decode())
                elif isinstance(ev, h2.events.StreamEnded):
                    h.send_headers(ev.stream_id, [(b":status", b"200")])
                    h.send_data(ev.stream_id, b"h2c ok", end_stream=True)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    rec["goaways"].append(int(ev.error_code or 0))
            if out := h.data_to_send():
                conn.sendall(out)
    except (ConnectionResetError, BrokenPipeError):
        rec["end"] = "reset"
    except h2.exceptions.ProtocolError:
        rec["end"] = "protocol_error"


def ws_app(conn: socket.socket, rec: dict[str, Any]) -> None:
    """A WebSocket program (websockets' server protocol over the socket): echoes text."""
    from websockets.frames import Frame, Opcode
    from websockets.http11 import Request
    from websockets.server import ServerProtocol

    proto = ServerProtocol()
    rec["paths"].append("/ws")
    while True:
        try:
            data = conn.recv(65536)
        except ConnectionResetError:
            rec["end"] = "reset"
            return
        if not data:
            rec["end"] = "eof"
            return
        proto.receive_data(data)
        for ev in proto.events_received():
            if isinstance(ev, Request):
                proto.send_response(proto.accept(ev))
            elif isinstance(ev, Frame) and ev.opcode is Opcode.TEXT:
                proto.send_text(ev.data)
        try:
            for out in proto.data_to_send():
                if out:
                    conn.sendall(out)
        except (ConnectionResetError, BrokenPipeError):
            rec["end"] = "reset"
            return


def tcp_echo(conn: socket.socket, rec: dict[str, Any]) -> None:
    rec["paths"].append("tcp")
    try:
        while data := conn.recv(65536):
            conn.sendall(data)
        rec["end"] = "eof"
    except (ConnectionResetError, BrokenPipeError):
        rec["end"] = "reset"


# -- the stack ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    http, h2c, ws, tcp = HttpApp(), Recorded(h2c_app), Recorded(ws_app), Recorded(tcp_echo)
    routes = tmp_path_factory.mktemp("drain-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "rec": registration(pki, fwd.port, {http.port: ("http", "public"), h2c.port: ("h2c", "public"),
                                            tcp.port: ("tcp", "public")}, default=http.port),
        "ws": registration(pki, fwd.port, {ws.port: ("http", "public")}, default=ws.port),
    }}))
    yield {"pki": pki, "fwd": fwd, "http": http, "h2c": h2c, "ws": ws, "tcp": tcp, "routes": routes}
    fwd.stop()
    for app in (http, h2c, ws, tcp):
        app.app.close()


@pytest.fixture
def gateway(backend: dict[str, Any]) -> Iterator[GatewayThread]:
    """A gateway of its own (a drain ends it), with an idle timeout far longer than any wait here. After
    the test: no task left on its loop once drained, no descriptor left in this process."""
    backend["http"].release.clear()
    backend["http"].holding.clear()
    fds = live_fds()
    gw = GatewayThread(backend["pki"], backend["routes"], header_timeout=5.0, idle_timeout=60.0)
    try:
        yield gw
        drain(gw, 1.0).result(30)
        assert loop_tasks(gw.loop) == 0
    finally:
        backend["http"].release.set()
        gw.stop()
    backend["fwd"].wait_idle(10)
    deadline = time.monotonic() + 10
    while (leaked := live_fds() - fds) and time.monotonic() < deadline:  # app threads close theirs a moment later
        time.sleep(0.02)
    assert not leaked, f"descriptors leaked: {sorted(leaked)}"


def drain(gw: GatewayThread, timeout: float) -> concurrent.futures.Future[tuple[int, float, float]]:
    """Start ``server.drain(timeout)`` on the gateway's loop: how many it cut, and when (time.monotonic(),
    read on the gateway's loop) it started and returned."""

    async def timed() -> tuple[int, float, float]:
        started = time.monotonic()
        cut = await gw.server.drain(timeout)
        return cut, started, time.monotonic()

    return asyncio.run_coroutine_threadsafe(timed(), gw.loop)


def tls_to(gw: GatewayThread, pki: Pki, name: str, alpn: str | None) -> ssl.SSLSocket:
    """A TLS connection to the gateway that tells close_notify (recv gives b"") from a TCP FIN without
    it (``ssl.SSLEOFError``). ``alpn`` None: none offered (a raw route's client)."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    if alpn is not None:
        ctx.set_alpn_protocols([alpn])
    raw = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
    return ctx.wrap_socket(raw, server_hostname=name, suppress_ragged_eofs=False)


TCP_CLOSE = 7  # Linux's TCP states (include/net/tcp_states.h): after a reset; after a FIN is CLOSE_WAIT (8)


def how_it_ends(tls: ssl.SSLSocket) -> tuple[str, float]:
    """Read to the end: ``close_notify``, ``tcp_fin`` (a FIN without close_notify) or ``reset``, and when."""
    try:
        while tls.recv(65536):
            pass
        how = "close_notify"
    except ssl.SSLEOFError:
        # Python's ssl reports a reset as this EOF too (OpenSSL's read loses the errno): the socket's TCP
        # state tells them apart.
        state = tls.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        how = "reset" if state == TCP_CLOSE else "tcp_fin"
    except ConnectionResetError:
        how = "reset"
    return how, time.monotonic()


class H1Client:
    """HTTP/1.1 keep-alive over one TLS connection (h11 client side)."""

    def __init__(self, gw: GatewayThread, pki: Pki, name: str) -> None:
        self.name = name
        self.tls = tls_to(gw, pki, name, "http/1.1")
        self.h = h11.Connection(h11.CLIENT)

    def send_get(self, path: str) -> None:
        self.tls.sendall(self.h.send(h11.Request(method="GET", target=path, headers=[("host", self.name)])))
        self.tls.sendall(self.h.send(h11.EndOfMessage()))

    def response(self, *, body_limit: int | None = None) -> tuple[int, dict[bytes, bytes], bytes]:
        status, headers, body = 0, {}, b""
        while True:
            ev = self.h.next_event()
            if ev is h11.NEED_DATA:
                self.h.receive_data(self.tls.recv(65536))
            elif isinstance(ev, h11.Response):
                status, headers = ev.status_code, dict(ev.headers)
            elif isinstance(ev, h11.Data):
                body += ev.data
                if body_limit is not None and len(body) >= body_limit:
                    return status, headers, body
            elif isinstance(ev, h11.EndOfMessage):
                break
        if self.h.our_state is h11.DONE and self.h.their_state is h11.DONE:
            self.h.start_next_cycle()
        return status, headers, body

    def get(self, path: str) -> tuple[int, dict[bytes, bytes], bytes]:
        self.send_get(path)
        return self.response()

    def vanish(self) -> None:
        """Gone mid-exchange: a TCP reset (SO_LINGER 0)."""
        self.tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.tls.close()


class H2Client:
    """HTTP/2 (the h2 library, client side) over one TLS connection. GOAWAY frames are taken out of the
    bytes before h2 sees them (``goaways``: (last stream id, error code)): h2 closes at the first GOAWAY
    and refuses every later frame (python-hyper/h2 issue 1181), while a real client goes on reading the
    streams the GOAWAY let finish; and so a stream can be opened after one, as a client that had not read
    it yet would."""

    def __init__(self, gw: GatewayThread, pki: Pki, name: str) -> None:
        self.name = name
        self.tls = tls_to(gw, pki, name, "h2")
        assert self.tls.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.tls.sendall(self.conn.data_to_send())
        self._frames = bytearray()
        self.goaways: list[tuple[int, int]] = []
        self.st: dict[int, dict[str, Any]] = {}

    def request(self, sid: int, path: str, authority: str | None = None) -> None:
        self.conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", authority or self.name),
                                     (":path", path)], end_stream=True)
        self.tls.sendall(self.conn.data_to_send())

    def read(self) -> None:
        data = self.tls.recv(65536)
        assert data, "the gateway closed the connection"
        self._frames += data
        rest = bytearray()
        while len(self._frames) >= 9:
            n = int.from_bytes(self._frames[:3], "big")
            if len(self._frames) < 9 + n:
                break
            frame = bytes(self._frames[: 9 + n])
            del self._frames[: 9 + n]
            if frame[3] == 0x7:
                last, code = struct.unpack(">II", frame[9:17])
                self.goaways.append((last & 0x7FFFFFFF, code))
            else:
                rest += frame
        for ev in self.conn.receive_data(bytes(rest)):
            sid = getattr(ev, "stream_id", 0)
            rec = self.st.setdefault(sid, {"body": b""}) if sid else {}
            if isinstance(ev, h2.events.ResponseReceived):
                rec["headers"] = dict(ev.headers)
            elif isinstance(ev, h2.events.DataReceived):
                rec["body"] += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded):
                rec["ended"] = True
            elif isinstance(ev, h2.events.StreamReset):
                rec["reset"] = int(ev.error_code)
        if out := self.conn.data_to_send():
            self.tls.sendall(out)

    def until(self, what: Callable[[], object]) -> None:
        while not what():
            self.read()

    def status(self, sid: int) -> str:
        return str(self.st[sid]["headers"][":status"])


def http_app(backend: dict[str, Any]) -> HttpApp:
    app = backend["http"]
    assert isinstance(app, HttpApp)
    return app


# -- the drain: HTTP/1.1 and HTTP/2 ---------------------------------------------------------------------


def test_idle_keep_alive_connections_are_closed_in_order_at_once(backend: dict[str, Any],
                                                                 gateway: GatewayThread) -> None:
    app = http_app(backend)
    one = H1Client(gateway, backend["pki"], f"rec.{DOMAIN}")
    status, headers, _ = one.get("/idle-h1")
    assert status == 200 and b"connection" not in headers  # kept alive
    two = H2Client(gateway, backend["pki"], f"rec.{DOMAIN}")
    two.request(1, "/idle-h2")
    two.until(lambda: two.st.get(1, {}).get("ended"))
    assert two.status(1) == "200"

    pending = drain(gateway, 20.0)
    how_one, one_ended = how_it_ends(one.tls)
    two.until(lambda: two.goaways)
    assert two.goaways == [(1, Codes.NO_ERROR)]
    how_two, two_ended = how_it_ends(two.tls)
    one.tls.close()
    two.tls.close()
    cut, started, returned = pending.result(30)
    print(f"idle h1 closed {one_ended - started:.3f} s, idle h2 {two_ended - started:.3f} s, "
          f"drain returned {returned - started:.3f} s after it began")
    assert (how_one, how_two) == ("close_notify", "close_notify")
    assert cut == 0
    assert one_ended - started < 2.0 and two_ended - started < 2.0  # not the 60 s idle timeout, nor the 20 s drain
    assert returned - started < 3.0
    # Their links were idle: closed in order, the app read a FIN on each.
    assert app.ended("/idle-h1") == "eof"
    assert app.ended("/idle-h2") == "eof"


@pytest.mark.skipif(CURL is None, reason="curl is not installed (scripts/setup.sh installs it)")
def test_an_http1_request_in_flight_is_answered_with_connection_close(backend: dict[str, Any],
                                                                       gateway: GatewayThread,
                                                                       tmp_path: Path) -> None:
    app = http_app(backend)
    assert CURL is not None
    name = f"rec.{DOMAIN}"
    head, body = tmp_path / "head", tmp_path / "body"
    curl = subprocess.Popen([CURL, "-sS", "--http1.1", "--cacert", str(backend["pki"].ca_file), "--resolve",
                             f"{name}:{gateway.port}:127.0.0.1", "-D", str(head), "-o", str(body),
                             f"https://{name}:{gateway.port}/hold"], stderr=subprocess.PIPE, text=True)
    try:
        assert app.holding.wait(20), "the request did not reach the app"
        pending = drain(gateway, 20.0)
        time.sleep(0.5)
        assert not pending.done()  # the request in flight holds the drain
        released = time.monotonic()
        app.release.set()
        _, err = curl.communicate(timeout=30)
    finally:
        if curl.poll() is None:
            curl.kill()
            curl.wait()
    assert curl.returncode == 0, err
    lines = head.read_text().lower().splitlines()
    assert lines[0].startswith("http/1.1 200")
    assert "connection: close" in lines
    assert body.read_bytes() == b"released"
    cut, _, returned = pending.result(30)
    print(f"drain returned {returned - released:.3f} s after the app answered")
    assert cut == 0
    assert returned - released < 2.0  # as soon as that connection was gone
    assert app.ended("/hold") == "eof"  # the link's exchange was complete: closed in order


def test_http2_goaway_lets_the_stream_in_flight_finish_and_refuses_a_later_one(backend: dict[str, Any],
                                                                               gateway: GatewayThread) -> None:
    app = http_app(backend)
    c = H2Client(gateway, backend["pki"], f"rec.{DOMAIN}")
    c.request(1, "/hold")
    assert app.holding.wait(20), "the request did not reach the app"
    pending = drain(gateway, 20.0)
    c.until(lambda: c.goaways)  # at once, while stream 1 is still held
    assert c.goaways == [(1, Codes.NO_ERROR)]
    assert not c.st.get(1, {}).get("ended")
    c.request(3, "/after-goaway")  # a client that had not read the GOAWAY yet
    c.until(lambda: "reset" in c.st.get(3, {}))
    assert c.st[3]["reset"] == Codes.REFUSED_STREAM
    assert gateway.sample("sbxnet_gateway_refusals_total", {"reason": "after_goaway"}) == 1
    released = time.monotonic()
    app.release.set()
    c.until(lambda: c.st.get(1, {}).get("ended"))
    assert c.status(1) == "200" and c.st[1]["body"] == b"released"
    how, _ = how_it_ends(c.tls)
    c.tls.close()
    cut, _, returned = pending.result(30)
    print(f"drain returned {returned - released:.3f} s after the app answered")
    assert how == "close_notify"
    assert cut == 0
    assert returned - released < 2.0
    assert "/after-goaway" not in app.served()
    assert app.ended("/hold") == "eof"


@pytest.mark.skipif(CURL is None, reason="curl is not installed (scripts/setup.sh installs it)")
def test_curl_over_http2_finishes_its_stream_through_a_drain(backend: dict[str, Any], gateway: GatewayThread,
                                                             tmp_path: Path) -> None:
    app = http_app(backend)
    assert CURL is not None
    name = f"rec.{DOMAIN}"
    curl = subprocess.Popen([CURL, "-sS", "--http2", "--cacert", str(backend["pki"].ca_file), "--resolve",
                             f"{name}:{gateway.port}:127.0.0.1", "-w", "\n%{http_code} %{http_version}",
                             f"https://{name}:{gateway.port}/hold"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert app.holding.wait(20), "the request did not reach the app"
        pending = drain(gateway, 20.0)
        time.sleep(0.3)
        app.release.set()
        out, err = curl.communicate(timeout=30)
    finally:
        if curl.poll() is None:
            curl.kill()
            curl.wait()
    assert curl.returncode == 0, err
    assert out == "released\n200 2"
    cut, _, _ = pending.result(30)
    assert cut == 0


# -- the drain: upgrades and raw TCP ------------------------------------------------------------------------


def test_a_websocket_and_a_raw_connection_run_until_the_drain_timeout_then_are_cut(
    backend: dict[str, Any], gateway: GatewayThread
) -> None:
    """Not told in band (no close frame is injected into the WebSocket: the gateway does not read its
    frames, docs/gateway.md), they go on working through the drain, and at its timeout both ends of each
    are reset: the WebSocket client sees an abnormal closure (1006, no close frame), the apps a reset."""
    from websockets.exceptions import ConnectionClosedError
    from websockets.sync.client import connect

    pki, tcp = backend["pki"], backend["tcp"]
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    timeout = 2.0
    with gateway_log(gateway) as log:
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        raw = tls_to(gateway, pki, f"{tcp.port}-rec.{DOMAIN}", None)
        with raw, connect(f"wss://ws.{DOMAIN}:{gateway.port}/", sock=sock, ssl=ctx, server_hostname=f"ws.{DOMAIN}",
                          proxy=None, open_timeout=10) as ws:
            ws.send("before")
            assert ws.recv(timeout=10) == "before"
            raw.sendall(b"before")
            assert raw.recv(64) == b"before"
            pending = drain(gateway, timeout)
            time.sleep(0.5)
            ws.send("during")  # still served: nothing was said to either end
            assert ws.recv(timeout=10) == "during"
            raw.sendall(b"during")
            assert raw.recv(64) == b"during"
            with pytest.raises(ConnectionClosedError):
                ws.recv(timeout=30)
            ws_ended = time.monotonic()
            how, _ = how_it_ends(raw)
            cut, started, returned = pending.result(30)
        cuts = sorted(line["kind"] for line in log.events("drain_cut"))
        requests = log.events("request")
    print(f"websocket ended {ws_ended - started:.3f} s into a {timeout} s drain; drain returned after "
          f"{returned - started:.3f} s")
    assert ws.protocol.close_rcvd is None and ws.close_code == 1006  # cut, no close frame
    assert how == "reset"
    assert cut == 2 and cuts == ["tcp", "upgrade"]
    assert timeout - 0.1 < ws_ended - started < timeout + 5
    assert timeout - 0.1 < returned - started < timeout + 5
    assert gateway.sample("sbxnet_gateway_drain_cut_total", {"kind": "upgrade"}) == 1
    assert gateway.sample("sbxnet_gateway_drain_cut_total", {"kind": "tcp"}) == 1
    assert [(r["status"], r["reason"]) for r in requests] == [(101, "drain_cut")]
    assert backend["ws"].ended("/ws") == "reset"
    assert tcp.ended("tcp") == "reset"


# -- links: closed in order after a complete exchange, reset when cut ------------------------------------


@pytest.mark.skipif(CURL is None, reason="curl is not installed (scripts/setup.sh installs it)")
def test_an_http1_link_ends_with_a_fin_after_a_keep_alive_session_and_a_reset_when_cut(
    backend: dict[str, Any], gateway: GatewayThread
) -> None:
    app = http_app(backend)
    assert CURL is not None
    name = f"rec.{DOMAIN}"
    r = subprocess.run([CURL, "-sS", "--http1.1", "--cacert", str(backend["pki"].ca_file), "--resolve",
                        f"{name}:{gateway.port}:127.0.0.1", "-w", " %{num_connects}\n",
                        f"https://{name}:{gateway.port}/ka-1", f"https://{name}:{gateway.port}/ka-2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "served /ka-1 1\nserved /ka-2 0\n"  # one connection for both
    assert app.ended("/ka-1") == "eof"
    assert next(rec["paths"] for rec in app.records if "/ka-1" in rec["paths"]) == ["/ka-1", "/ka-2"]

    c = H1Client(gateway, backend["pki"], name)
    c.send_get(f"/bytes/{256 << 20}")
    status, _, body = c.response(body_limit=1)
    assert status == 200 and body
    c.vanish()
    assert app.ended(f"/bytes/{256 << 20}") == "reset"


def test_an_http2_streams_link_ends_with_a_fin_when_whole_and_a_reset_when_cut(
    backend: dict[str, Any], gateway: GatewayThread
) -> None:
    app = http_app(backend)
    c = H2Client(gateway, backend["pki"], f"rec.{DOMAIN}")
    try:
        c.request(1, "/h2-whole")
        c.until(lambda: c.st.get(1, {}).get("ended"))
        assert c.status(1) == "200"
        # The exchange was whole and the app keeps the connection alive: the link is kept for the next
        # stream, and the cut of that stream resets it.
        big = f"/bytes/{(256 << 20) + 1}"  # a path no other test here asks for
        c.request(3, big)
        c.until(lambda: c.st.get(3, {}).get("body"))
        c.conn.reset_stream(3, Codes.CANCEL)
        c.tls.sendall(c.conn.data_to_send())
        assert app.ended(big) == "reset"
        rec = next(r for r in app.records if big in r["paths"])
        assert rec["paths"] == ["/h2-whole", big]  # one link for both streams
    finally:
        c.tls.close()
    # A kept link ends in order when its client connection does.
    c = H2Client(gateway, backend["pki"], f"rec.{DOMAIN}")
    try:
        c.request(1, "/h2-whole-2")
        c.until(lambda: c.st.get(1, {}).get("ended"))
        assert c.status(1) == "200"
    finally:
        c.tls.close()
    assert app.ended("/h2-whole-2") == "eof"


def test_an_h2c_link_ends_with_goaway_and_a_fin_when_the_client_leaves(backend: dict[str, Any],
                                                                      gateway: GatewayThread) -> None:
    h2c = backend["h2c"]
    name = f"{h2c.port}-rec.{DOMAIN}"
    c = H2Client(gateway, backend["pki"], name)
    c.request(1, "/h2c-one")
    c.request(3, "/h2c-two")
    c.until(lambda: c.st.get(1, {}).get("ended") and c.st.get(3, {}).get("ended"))
    assert c.st[1]["body"] == c.st[3]["body"] == b"h2c ok"
    c.tls.close()  # nothing in flight
    assert h2c.ended("/h2c-one") == "eof"
    rec = next(r for r in h2c.records if "/h2c-one" in r["paths"])
    assert rec["paths"] == ["/h2c-one", "/h2c-two"]  # one link for both streams
    assert rec["goaways"] == [Codes.NO_ERROR]


def test_idle_timeout_closes_in_order_too(backend: dict[str, Any]) -> None:
    gw = GatewayThread(backend["pki"], backend["routes"], idle_timeout=0.5)
    try:
        one = H1Client(gw, backend["pki"], f"rec.{DOMAIN}")
        assert one.get("/idle-timeout-h1")[0] == 200
        two = H2Client(gw, backend["pki"], f"rec.{DOMAIN}")
        two.request(1, "/idle-timeout-h2")
        two.until(lambda: two.st.get(1, {}).get("ended"))
        t0 = time.monotonic()
        how_one, one_ended = how_it_ends(one.tls)
        two.until(lambda: two.goaways)
        how_two, two_ended = how_it_ends(two.tls)
        one.tls.close()
        two.tls.close()
    finally:
        gw.stop()
    assert (how_one, how_two) == ("close_notify", "close_notify")
    assert two.goaways == [(1, Codes.NO_ERROR)]
    assert one_ended - t0 < 5 and two_ended - t0 < 5


# -- the GOAWAY frame the drain writes ---------------------------------------------------------------------


@pytest.mark.parametrize(("last", "code", "debug"), [(0, 0, b""), (1, 0, b""), (2**31 - 1, 0, b""),
                                                     (12345, 2, b"draining"), (7, 0xFFFFFFFF, b"\x00")])
def test_goaway_frame_parses_back_with_hyperframe(last: int, code: int, debug: bytes) -> None:
    from hyperframe.frame import Frame, GoAwayFrame

    data = goaway_frame(last, code, debug)
    frame, length = Frame.parse_frame_header(memoryview(data[:9]))
    assert isinstance(frame, GoAwayFrame) and length == len(data) - 9
    frame.parse_body(memoryview(data[9:]))
    assert (frame.stream_id, frame.flags, frame.last_stream_id, frame.error_code, frame.additional_data) == (
        0, set(), last, code, debug)


@pytest.mark.parametrize("last", [-1, 2**31])
def test_goaway_frame_refuses_a_stream_id_out_of_range(last: int) -> None:
    with pytest.raises(ValueError):
        goaway_frame(last)
