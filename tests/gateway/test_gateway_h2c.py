"""h2c to the app at the frame level: an h2-library client over TLS -> gateway -> real forwarder -> an app
speaking HTTP/2 in cleartext (the h2 library, server side, scripted by path).

What gRPC relies on and a grpcio test cannot show frame by frame: trailers both ways, a trailers-only answer
kept as one HEADERS frame with END_STREAM, RST_STREAM codes passed both ways, flow control as backpressure
both ways (nothing buffered beyond the windows), one upstream connection for a client connection's streams,
GOAWAY and a closing app.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
from fwd_support import ForwarderThread, Pki, SandboxApp
from gw_support import DOMAIN, GatewayThread, forwarder_settings, registration
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, PingFrame, SettingsFrame, WindowUpdateFrame
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.h2c_upstream import STREAM_WINDOW, FrameSizeGuard

Codes = h2.errors.ErrorCodes


class H2App:
    """A sandbox app speaking h2c on loopback, one thread per connection. Paths:

    ``/`` and anything else: answers after the request ends with JSON (path, headers, body length and
    SHA-256, trailers); ``/trailers``: the same, then trailers; ``/trailers-only``: one HEADERS frame with
    END_STREAM; ``/reset-after-data``: a head, 1000 bytes, RST_STREAM ENHANCE_YOUR_CALM; ``/refuse``:
    RST_STREAM REFUSED_STREAM; ``/flood``: DATA as fast as the window allows, until reset (``sent`` counts);
    ``/sink``: reads the body without acknowledging it until ``consume`` is set; ``/hold``: no answer until
    the connection ends; ``/goaway``: GOAWAY naming the oldest held stream as the last one taken, then
    close; ``/close-after-data``, ``/close-now``: the socket closed after a head and some DATA / at once.
    """

    def __init__(self, *, max_streams: int | None = None) -> None:
        self.max_streams = max_streams  # its SETTINGS_MAX_CONCURRENT_STREAMS, if any
        self.open_streams = 0
        self.most_open = 0  # the most streams it had open at once
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = int(self.lsock.getsockname()[1])
        self.accepted = 0
        self.requests: list[dict[str, Any]] = []
        self.sent: dict[str, int] = {}
        self.consume = threading.Event()
        self.errors: list[BaseException] = []
        self.goaways: list[int] = []  # the gateway's GOAWAY codes
        self.live = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.lsock.accept()
            except OSError:
                return
            self.accepted += 1
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock: socket.socket) -> None:
        self.live += 1
        try:
            self._run(sock)
        except (OSError, h2.exceptions.ProtocolError):
            pass  # the gateway aborted the link: a reset is how a client going away looks here
        except BaseException as e:
            self.errors.append(e)
        finally:
            sock.close()
            self.live -= 1

    def _run(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        if self.max_streams is not None:
            conn.local_settings = h2.settings.Settings(client=False, initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams})
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        recs: dict[int, dict[str, Any]] = {}
        floods: set[int] = set()
        held: list[int] = []
        due: list[tuple[float, int]] = []  # /slow answers: when, stream
        unacked: list[tuple[int, int]] = []
        while not self._stop:
            readable, _, _ = select.select([sock], [], [], 0.01)
            if readable:
                data = sock.recv(1 << 16)
                if not data:
                    return
                for ev in conn.receive_data(data):
                    if self._event(conn, ev, recs, floods, held, unacked, due) == "close":
                        sock.sendall(conn.data_to_send())
                        return
            if self.consume.is_set():
                for sid, n in unacked:
                    with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
                        conn.acknowledge_received_data(n, sid)
                unacked.clear()
            for sid in list(floods):
                try:
                    n = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                    if n > 0:
                        conn.send_data(sid, b"f" * n)
                        self.sent["/flood"] = self.sent.get("/flood", 0) + n
                except h2.exceptions.StreamClosedError:
                    floods.discard(sid)
            now = time.monotonic()
            for when, sid in [d for d in due if d[0] <= now]:
                due.remove((when, sid))
                self._answer(conn, sid, recs[sid])
            out = conn.data_to_send()
            if out:
                sock.sendall(out)

    def _event(self, conn: h2.connection.H2Connection, ev: Any, recs: dict[int, dict[str, Any]], floods: set[int],
               held: list[int], unacked: list[tuple[int, int]], due: list[tuple[float, int]]) -> str | None:
        if isinstance(ev, h2.events.RequestReceived):
            headers = [(n.decode(), v.decode()) for n, v in ev.headers]
            path = dict(headers)[":path"]
            rec: dict[str, Any] = {"path": path, "headers": headers, "sha": hashlib.sha256(), "n": 0, "trailers": None,
                   "reset": None, "stream_id": ev.stream_id}
            recs[ev.stream_id] = rec
            self.requests.append(rec)
            self.open_streams += 1
            self.most_open = max(self.most_open, self.open_streams)
            sid = ev.stream_id
            if path == "/trailers-only":
                conn.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc"),
                                        ("grpc-status", "5"), ("grpc-message", "not found")], end_stream=True)
            elif path == "/reset-after-data":
                conn.send_headers(sid, [(":status", "200")])
                conn.send_data(sid, b"d" * 1000)
                conn.reset_stream(sid, Codes.ENHANCE_YOUR_CALM)
            elif path == "/refuse":
                conn.reset_stream(sid, Codes.REFUSED_STREAM)
            elif path == "/flood":
                conn.send_headers(sid, [(":status", "200")])
                floods.add(sid)
            elif path == "/hold":
                held.append(sid)
            elif path == "/goaway":
                conn.close_connection(last_stream_id=min(held) if held else 0)
                return "close"
            elif path == "/close-after-data":
                conn.send_headers(sid, [(":status", "200")])
                conn.send_data(sid, b"d" * 1000)
                return "close"
            elif path == "/close-now":
                return "close"
        elif isinstance(ev, h2.events.DataReceived):
            rec = recs[ev.stream_id]
            rec["sha"].update(ev.data)
            rec["n"] += len(ev.data)
            if rec["path"] == "/sink" and not self.consume.is_set():
                unacked.append((ev.stream_id, ev.flow_controlled_length))
            else:
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.TrailersReceived):
            recs[ev.stream_id]["trailers"] = [(n.decode(), v.decode()) for n, v in ev.headers]
        elif isinstance(ev, h2.events.StreamEnded):
            rec = recs[ev.stream_id]
            if rec["path"] in ("/trailers-only", "/reset-after-data", "/refuse", "/flood", "/hold"):
                return None
            if rec["path"] == "/slow":
                due.append((time.monotonic() + 0.1, ev.stream_id))
                return None
            self._answer(conn, ev.stream_id, rec)
        elif isinstance(ev, h2.events.StreamReset):
            if ev.stream_id in recs:
                recs[ev.stream_id]["reset"] = int(ev.error_code)
            floods.discard(ev.stream_id)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaways.append(int(ev.error_code or 0))
            return "close"
        return None

    def _answer(self, conn: h2.connection.H2Connection, sid: int, rec: dict[str, Any]) -> None:
        body = json.dumps({"path": rec["path"], "headers": rec["headers"], "n": rec["n"],
                           "sha": rec["sha"].hexdigest(), "trailers": rec["trailers"]}).encode()
        trailers = rec["path"] == "/trailers"
        conn.send_headers(sid, [(":status", "200"), ("content-type", "application/json")])
        conn.send_data(sid, body, end_stream=not trailers)
        if trailers:
            conn.send_headers(sid, [("x-trailer", "t1"), ("grpc-status", "0")], end_stream=True)
        self.open_streams -= 1

    def by_path(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == path]

    def stop(self) -> None:
        self._stop = True
        self.lsock.close()
        for t in self._threads:
            t.join(5)


class Client:
    """A blocking HTTP/2 client over TLS to the gateway (the h2 library), stream by stream. With
    ``auto_ack`` False it never acknowledges DATA (its windows then stay at what it has read)."""

    def __init__(self, s: dict[str, Any], sni: str) -> None:
        ctx = ssl.create_default_context(cafile=str(s["pki"].ca_file))
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", s["gw"].port), timeout=10)
        self.sock = ctx.wrap_socket(raw, server_hostname=sni)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.st: dict[int, dict[str, Any]] = {}
        self.auto_ack = True
        self.unacked: list[tuple[int, int]] = []

    def _rec(self, sid: int) -> dict[str, Any]:
        return self.st.setdefault(sid, {"body": bytearray(), "headers": None, "trailers": None, "ended": False,
                                        "reset": None, "head_ended": False})

    def request(self, sid: int, authority: str, path: str, *, method: str = "GET", end: bool = True,
                extra: tuple[tuple[str, str], ...] = ()) -> None:
        self._rec(sid)
        self.conn.send_headers(sid, [(":method", method), (":scheme", "https"), (":authority", authority),
                                     (":path", path), *extra], end_stream=end)
        self.sock.sendall(self.conn.data_to_send())

    def send(self, sid: int, data: bytes, *, end: bool = False, stall: float = 10.0) -> int:
        """Send ``data`` as the windows allow; stops after ``stall`` seconds without window. How much went."""
        sent = 0
        last = time.monotonic()
        while sent < len(data):
            n = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, len(data) - sent)
            if n <= 0:
                if time.monotonic() - last > stall:
                    return sent
                self.pump(0.05)
                continue
            self.conn.send_data(sid, data[sent:sent + n], end_stream=end and sent + n == len(data))
            self.sock.sendall(self.conn.data_to_send())
            sent += n
            last = time.monotonic()
        if end and not data:
            self.conn.end_stream(sid)
            self.sock.sendall(self.conn.data_to_send())
        return sent

    def trailers(self, sid: int, headers: list[tuple[str, str]]) -> None:
        self.conn.send_headers(sid, headers, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())

    def reset(self, sid: int, code: int) -> None:
        self.conn.reset_stream(sid, code)
        self.sock.sendall(self.conn.data_to_send())

    def ack_all(self) -> None:
        for sid, n in self.unacked:
            with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
                self.conn.acknowledge_received_data(n, sid)
        self.unacked.clear()
        self.sock.sendall(self.conn.data_to_send())

    def pump(self, timeout: float) -> None:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable and not self.sock.pending():
            return
        data = self.sock.recv(1 << 16)
        assert data, "the gateway closed the connection"
        for ev in self.conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                r = self._rec(ev.stream_id)
                r["headers"] = {n.decode(): v.decode() for n, v in ev.headers}
                r["head_ended"] = ev.stream_ended is not None
            elif isinstance(ev, h2.events.DataReceived):
                self._rec(ev.stream_id)["body"] += ev.data
                if self.auto_ack:
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                else:
                    self.unacked.append((ev.stream_id, ev.flow_controlled_length))
            elif isinstance(ev, h2.events.TrailersReceived):
                self._rec(ev.stream_id)["trailers"] = {n.decode(): v.decode() for n, v in ev.headers}
            elif isinstance(ev, h2.events.StreamEnded):
                self._rec(ev.stream_id)["ended"] = True
            elif isinstance(ev, h2.events.StreamReset):
                self._rec(ev.stream_id)["reset"] = int(ev.error_code)
        self.sock.sendall(self.conn.data_to_send())

    def wait(self, pred: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out; streams: {self.summary()}"
            self.pump(0.05)

    def done(self, *sids: int) -> None:
        self.wait(lambda: all(self.st.get(s, {}).get("ended") or self.st.get(s, {}).get("reset") is not None
                              for s in sids))

    def summary(self) -> dict[int, Any]:
        return {k: {**v, "body": len(v["body"])} for k, v in self.st.items()}

    def close(self) -> None:
        self.sock.close()


def open_fds() -> set[int]:
    """This process's descriptors, without the one the listing itself used (gone once it is done)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            os.readlink(f"/proc/self/fd/{name}")
            out.add(int(name))
    return out


def lasting_new_fds(before: set[int]) -> set[int]:
    """Descriptors open now and not in ``before`` that stay open across a few listings: the gateway's
    route source rereads its file every second, which a single listing may catch."""
    new = open_fds() - before
    for _ in range(4):
        time.sleep(0.05)
        new &= open_fds() - before
    return new


def _gateway_tasks(gw: GatewayThread) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return asyncio.run_coroutine_threadsafe(count(), gw.loop).result(10)


@pytest.fixture(scope="module")
def h2c_stack(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = H2App()
    narrow = H2App(max_streams=2)

    def banner(conn: socket.socket) -> None:  # not HTTP/2 at all: speaks first, then reads until closed
        conn.sendall(b"SSH-2.0-OpenSSH_9.2 not-http\r\n")
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass

    talker = SandboxApp(banner)
    routes = tmp_path_factory.mktemp("h2c-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "h2app": registration(pki, fwd.port, {app.port: ("h2c", "public")}, default=app.port),
        "other": registration(pki, fwd.port, {app.port: ("h2c", "public")}, default=app.port),
        "narrow": registration(pki, fwd.port, {narrow.port: ("h2c", "public")}, default=narrow.port),
        "talker": registration(pki, fwd.port, {talker.port: ("h2c", "public")}, default=talker.port),
    }}))
    gw = GatewayThread(pki, routes, header_timeout=2.0, idle_timeout=10.0)
    yield {"gw": gw, "fwd": fwd, "app": app, "narrow": narrow, "pki": pki, "tasks": _gateway_tasks(gw)}
    gw.stop()
    fwd.stop()
    app.stop()
    narrow.stop()
    talker.close()


@pytest.fixture
def s(h2c_stack: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The stack, checked after each test: no client connection, link, app connection, task, sandbox slot
    or descriptor left, and the app saw no error of its own."""
    s = h2c_stack
    s["app"].consume.clear()
    before = open_fds()
    yield s
    gw: GatewayThread = s["gw"]
    deadline = time.monotonic() + 10
    while (gw.server.open_connections or s["app"].live or _gateway_tasks(gw) > s["tasks"]
           or lasting_new_fds(before)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.server.open_connections == 0
    s["fwd"].wait_idle(5)
    assert s["app"].live == 0
    assert _gateway_tasks(gw) == s["tasks"]
    assert gw.server._per_sandbox == {}
    assert lasting_new_fds(before) == set()
    assert s["app"].errors == []


NAME = f"h2app.{DOMAIN}"


@contextlib.contextmanager
def client(s: dict[str, Any], sni: str = NAME) -> Iterator[Client]:
    c = Client(s, sni)
    try:
        yield c
    finally:
        c.close()


def test_a_connections_streams_share_one_upstream_connection(s: dict[str, Any]) -> None:
    app: H2App = s["app"]
    accepted = app.accepted
    with client(s) as c:
        sids = list(range(1, 40, 2))
        for sid in sids:
            c.request(sid, NAME, f"/n{sid}")
        c.done(*sids)
        for sid in sids:
            assert c.st[sid]["headers"][":status"] == "200"
            assert json.loads(c.st[sid]["body"])["path"] == f"/n{sid}"
    assert app.accepted - accepted == 1
    with client(s) as c2:
        c2.request(1, NAME, "/again")
        c2.done(1)
    assert app.accepted - accepted == 2  # a connection of its own for another client connection


def test_the_head_reaches_the_app_as_http2_with_the_gateways_forwarded_headers(s: dict[str, Any]) -> None:
    with client(s) as c:
        c.request(1, NAME, "/head?q=1", extra=(("te", "trailers"), ("x-forwarded-for", "6.6.6.6"),
                                             ("x-custom", "v"), ("cookie", "a=1"), ("cookie", "b=2")))
        c.done(1)
        seen = json.loads(c.st[1]["body"])
    pseudo = [(n, v) for n, v in seen["headers"] if n.startswith(":")]
    assert pseudo == [(":method", "GET"), (":scheme", "https"), (":authority", NAME), (":path", "/head?q=1")]
    headers = dict((n, v) for n, v in seen["headers"] if not n.startswith(":"))
    assert headers["te"] == "trailers"
    assert headers["x-forwarded-for"] == "127.0.0.1"
    assert headers["x-forwarded-proto"] == "https"
    assert headers["x-forwarded-host"] == NAME
    assert headers["x-custom"] == "v"
    assert "host" not in headers


def test_trailers_pass_both_ways(s: dict[str, Any]) -> None:
    body = b"payload" * 1000
    with client(s) as c:
        c.request(1, NAME, "/trailers", method="POST", end=False, extra=(("te", "trailers"),))
        c.send(1, body)
        c.trailers(1, [("x-request-trailer", "r1"), ("grpc-timeout", "5S")])
        c.done(1)
        r = c.st[1]
    seen = json.loads(r["body"])
    assert seen["n"] == len(body) and seen["sha"] == hashlib.sha256(body).hexdigest()
    assert seen["trailers"] == [["x-request-trailer", "r1"], ["grpc-timeout", "5S"]]
    assert r["trailers"] == {"x-trailer": "t1", "grpc-status": "0"}
    assert r["ended"]


def test_a_trailers_only_answer_stays_one_headers_frame_with_end_stream(s: dict[str, Any]) -> None:
    with client(s) as c:
        c.request(1, NAME, "/trailers-only")
        c.done(1)
        r = c.st[1]
    assert r["head_ended"], "END_STREAM must ride on the head (a gRPC trailers-only answer)"
    assert r["headers"][":status"] == "200"
    assert r["headers"]["grpc-status"] == "5"
    assert r["headers"]["grpc-message"] == "not found"
    assert r["trailers"] is None


def test_the_apps_reset_reaches_the_client_with_its_code_and_the_link_goes_on(s: dict[str, Any]) -> None:
    app: H2App = s["app"]
    accepted = app.accepted
    with client(s) as c:
        c.request(1, NAME, "/reset-after-data")
        c.done(1)
        assert c.st[1]["headers"][":status"] == "200"
        assert c.st[1]["reset"] == Codes.ENHANCE_YOUR_CALM
        c.request(3, NAME, "/refuse")
        c.done(3)
        assert c.st[3]["reset"] == Codes.REFUSED_STREAM
        c.request(5, NAME, "/after")
        c.done(5)
        assert json.loads(c.st[5]["body"])["path"] == "/after"
    assert app.accepted - accepted == 1


def test_a_download_is_held_to_the_clients_window_and_its_reset_reaches_the_app(s: dict[str, Any]) -> None:
    """The client reads nothing: the app gets no further than the gateway's window for it plus what the
    client's window let through. Then the client reads 4 MiB and resets with its own code, which the app
    sees."""
    app: H2App = s["app"]
    app.sent.clear()
    with client(s) as c:
        c.auto_ack = False
        c.request(1, NAME, "/flood")
        c.wait(lambda: len(c.st[1]["body"]) >= 65535)  # the client's whole initial window
        time.sleep(1.0)
        for _ in range(10):
            c.pump(0.02)
        stalled = app.sent.get("/flood", 0)
        assert STREAM_WINDOW // 2 < stalled <= STREAM_WINDOW + 3 * 65535, stalled
        assert len(c.st[1]["body"]) <= 65535
        c.auto_ack = True
        c.ack_all()
        c.wait(lambda: len(c.st[1]["body"]) >= 4 << 20, timeout=30)
        assert app.sent["/flood"] > stalled
        c.reset(1, Codes.ENHANCE_YOUR_CALM)
        deadline = time.monotonic() + 5
        while app.by_path("/flood")[-1]["reset"] is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert app.by_path("/flood")[-1]["reset"] == Codes.ENHANCE_YOUR_CALM
    assert set(c.st[1]["body"]) == {ord("f")}


def test_an_upload_is_held_to_the_apps_window(s: dict[str, Any]) -> None:
    """The app acknowledges nothing: the client gets no further than the app's window plus the gateway's
    window for the client. Once the app reads, the whole body arrives, exactly."""
    app: H2App = s["app"]
    body = hashlib.sha256(b"up").digest() * ((4 << 20) // 32)
    with client(s) as c:
        c.request(1, NAME, "/sink", method="POST", end=False)
        went = c.send(1, body, stall=1.0)
        assert 65535 <= went <= STREAM_WINDOW + 3 * 65535, went
        assert app.by_path("/sink")[-1]["n"] <= 2 * 65535
        app.consume.set()
        rest = c.send(1, body[went:], end=True)
        assert went + rest == len(body)
        c.done(1)
        seen = json.loads(c.st[1]["body"])
    assert seen["n"] == len(body)
    assert seen["sha"] == hashlib.sha256(body).hexdigest()


def test_the_app_closing_mid_response_resets_the_stream_and_the_next_gets_a_new_link(s: dict[str, Any]) -> None:
    app: H2App = s["app"]
    accepted = app.accepted
    with client(s) as c:
        c.request(1, NAME, "/close-after-data")
        c.done(1)
        assert c.st[1]["headers"][":status"] == "200"
        assert c.st[1]["reset"] == Codes.INTERNAL_ERROR
        c.request(3, NAME, "/close-now")
        c.done(3)
        assert c.st[3]["headers"][":status"] == "502"  # nothing of the response had come: the gateway answers
        c.request(5, NAME, "/fine")
        c.done(5)
        assert json.loads(c.st[5]["body"])["path"] == "/fine"
    assert app.accepted - accepted == 3


def test_a_goaway_refuses_the_streams_it_did_not_take(s: dict[str, Any]) -> None:
    """The app's GOAWAY names the held stream as the last it took: the stream after it is reset
    REFUSED_STREAM (a client may retry it); the held one cannot finish on a connection h2 has closed
    (python-hyper/h2 issue 1181), so it is answered 502; the next stream gets a new link."""
    app: H2App = s["app"]
    with client(s) as c:
        c.request(1, NAME, "/hold")
        deadline = time.monotonic() + 5
        while not app.by_path("/hold") and time.monotonic() < deadline:
            time.sleep(0.01)
        c.request(3, NAME, "/goaway")
        c.done(1, 3)
        assert c.st[3]["reset"] == Codes.REFUSED_STREAM
        assert c.st[1]["headers"][":status"] == "502"
        c.request(5, NAME, "/fine")
        c.done(5)
        assert json.loads(c.st[5]["body"])["path"] == "/fine"


def test_a_stream_for_another_sandbox_goes_to_that_sandbox_on_a_link_of_its_own(s: dict[str, Any]) -> None:
    """A coalesced stream (its :authority another sandbox's name, which the wildcard certificate covers) is
    routed by its own route: the app sees it with that authority, on another link than the first stream's."""
    app: H2App = s["app"]
    before = len(app.requests)
    with client(s) as c:
        c.request(1, NAME, "/mine")
        c.request(3, f"other.{DOMAIN}", "/coalesced")
        c.done(1, 3)
        assert c.st[1]["headers"][":status"] == "200"
        assert c.st[3]["headers"][":status"] == "200"
    seen = {r["path"]: dict(r["headers"])[":authority"] for r in app.requests[before:]}
    assert seen == {"/mine": NAME, "/coalesced": f"other.{DOMAIN}"}


def test_a_client_leaving_mid_stream_resets_its_streams_and_closes_its_link(s: dict[str, Any]) -> None:
    """The client vanishes with streams open: the app sees each stream reset CANCEL and a GOAWAY before
    the link closes (the fixture's checks see no link, app connection, task or descriptor left)."""
    app: H2App = s["app"]
    goaways = len(app.goaways)
    with client(s) as c:
        c.request(1, NAME, "/hold")
        c.request(3, NAME, "/flood")
        c.wait(lambda: c.st[3]["headers"] is not None and len(app.by_path("/hold")) > 0)
        hold, flood = app.by_path("/hold")[-1], app.by_path("/flood")[-1]
    deadline = time.monotonic() + 5
    while (hold["reset"] is None or flood["reset"] is None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hold["reset"] == Codes.CANCEL
    assert flood["reset"] == Codes.CANCEL
    while len(app.goaways) == goaways and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.goaways[goaways:] == [Codes.NO_ERROR]


def test_streams_wait_for_room_under_the_apps_concurrency_limit(s: dict[str, Any]) -> None:
    """The app allows 2 streams at once; 10 arrive together on one client connection: they go on one link
    two at a time, and every one is answered."""
    narrow: H2App = s["narrow"]
    name = f"narrow.{DOMAIN}"
    with client(s, name) as c:
        c.request(1, name, "/first")  # the app's SETTINGS are known after this
        c.done(1)
        narrow.most_open = 0
        sids = list(range(3, 23, 2))
        for sid in sids:
            c.request(sid, name, "/slow")
        c.done(*sids)
        for sid in sids:
            assert c.st[sid]["headers"][":status"] == "200", c.summary()
    assert narrow.most_open == 2
    assert narrow.accepted == 1
    assert narrow.errors == []


def test_an_app_that_is_not_http2_is_502_and_the_connection_goes_on(s: dict[str, Any]) -> None:
    """A port registered as h2c whose app speaks something else first (here an SSH banner, which may come
    with the forwarder's OK or after it): 502 on that stream, and the client connection serves the next."""
    name = f"talker.{DOMAIN}"
    with client(s, name) as c:
        c.request(1, name, "/")
        c.done(1)
        assert c.st[1]["headers"][":status"] == "502"
        c.request(3, name, "/")
        c.done(3)
        assert c.st[3]["headers"][":status"] == "502"


# -- the frame size guard, on its own -----------------------------------------------------------------

_FRAME_TYPES = st.sampled_from(["data", "headers", "ping", "window", "settings", "goaway"])


def _frame(kind: str, size: int, stream_id: int) -> bytes:
    """One valid frame, serialised by hyperframe (the oracle: an encoder that is not the guard's)."""
    if kind == "data":
        return DataFrame(stream_id, data=b"d" * size).serialize()
    if kind == "ping":
        return PingFrame(0, opaque_data=b"p" * 8).serialize()
    if kind == "window":
        return WindowUpdateFrame(stream_id, window_increment=1 + size).serialize()
    if kind == "settings":
        return SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: size}).serialize()
    if kind == "headers":
        return HeadersFrame(stream_id, data=b"h" * size).serialize()
    return GoAwayFrame(0, last_stream_id=stream_id, additional_data=b"g" * max(0, size - 8)).serialize()


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=300, deadline=None)
@example(frames=[], cuts=[], skip=0, over=16385)
@example(frames=[("data", 16384, 1)], cuts=[1, 9, 10, 16393, 16394], skip=24, over=1 << 20)
@example(frames=[("headers", 0, 1), ("goaway", 8, 1), ("settings", 0, 1)], cuts=list(range(60)), skip=24,
         over=(1 << 24) - 1)
@given(frames=st.lists(st.tuples(_FRAME_TYPES, st.integers(0, 16384), st.integers(1, 99)), max_size=12),
       cuts=st.lists(st.integers(0, 1 << 20), max_size=30), skip=st.sampled_from([0, 24]),
       over=st.integers(16385, (1 << 24) - 1))
def test_the_guard_passes_every_frame_within_the_limit_and_stops_at_the_first_over_it(
        frames: list[tuple[str, int, int]], cuts: list[int], skip: int, over: int) -> None:
    good = b"P" * skip + b"".join(_frame(k, n, sid) for k, n, sid in frames)
    bad_head = over.to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01"  # a DATA header naming ``over`` bytes
    stream = good + bad_head + b"x" * 100
    guard = FrameSizeGuard(skip=skip)
    fed = 0
    verdicts = []
    for piece in _pieces(stream, cuts):
        ok = guard.feed(piece, 16384)
        fed += len(piece)
        verdicts.append(ok)
        if not ok:
            break
    assert verdicts[-1] is False, "the oversized header was not refused"
    assert all(verdicts[:-1])
    # Refused in the piece that completed the bad header, never before it was whole.
    assert len(good) + 9 <= fed < len(good) + 9 + len(_pieces(stream, cuts)[len(verdicts) - 1])


def test_the_guard_refuses_a_banner_at_once_and_passes_a_frame_at_the_limit() -> None:
    assert FrameSizeGuard().feed(b"SSH-2.0-OpenSSH_9.2\r\n", 16384) is False
    g = FrameSizeGuard()
    assert g.feed(_frame("data", 16384, 1), 16384)
    assert g.feed(_frame("data", 0, 1), 16384)
    assert g.feed(b"\x00\x40\x01", 16384) is True  # half a header over the limit: not judged yet
    assert g.feed(b"\x00\x00\x00\x00\x00\x01", 16384) is False


def test_a_client_frame_over_the_size_limit_is_refused_at_its_header(s: dict[str, Any]) -> None:
    """A client names a 1 MiB frame (over the 16 KiB it may send): GOAWAY FRAME_SIZE_ERROR at once, not
    after the gateway has buffered the megabyte h2 would wait for."""
    gw: GatewayThread = s["gw"]
    refused = gw.sample("sbxnet_gateway_refusals_total", {"reason": "frame_too_large"})
    c = Client(s, NAME)
    try:
        c.sock.sendall((1 << 20).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01" + b"x" * 100)
        ended: list[Any] = []
        deadline = time.monotonic() + 5
        while not ended and time.monotonic() < deadline:
            data = c.sock.recv(65536)
            if not data:
                break
            ended = [ev for ev in c.conn.receive_data(data) if isinstance(ev, h2.events.ConnectionTerminated)]
        assert ended and ended[0].error_code == Codes.FRAME_SIZE_ERROR
    finally:
        c.close()
    assert gw.sample("sbxnet_gateway_refusals_total", {"reason": "frame_too_large"}) == refused + 1
