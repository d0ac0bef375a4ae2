"""Real peers for gateway tests: the gateway in a thread, in front of a real forwarder, with real apps."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import ipaddress
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp
from fwd_support import make_pki as make_pki  # re-exported: conftest.py gets fwd_support through here

from certs.loader import client_context
from certs.mint import mint_leaf, spki_pin, write_issued
from forwarder.ingress.settings import ForwarderSettings
from gateway.names import Names
from gateway.route_source import RouteSource, StaticRoutes
from gateway.server import GatewayConfig, GatewayServer
from gateway.tls_front import CertPair, FrontTls
from gateway.upstream import UpstreamPolicy
from sbxnet.jsonlog import JsonFormatter

DOMAIN = "sbx.test"
TOKEN = "s3cret-token"


def front_cert(pki: Pki) -> CertPair:
    cert, key = write_issued(mint_leaf(pki.ca, "gateway-front", dns=(f"*.{DOMAIN}",)), pki.dir, "front")
    return CertPair(cert, key)


def registration(pki: Pki, fwd_port: int, ports: dict[int, tuple[str, str]], *, default: int,
                 deadline: float = 3.0) -> dict[str, Any]:
    from cryptography import x509

    pin = spki_pin(x509.load_pem_x509_certificate(pki.paths["forwarder"][0].read_bytes()))
    body: dict[str, Any] = {
        "incarnation": "i1",
        "forwarder": {"address": f"127.0.0.1:{fwd_port}", "spki_pin": pin},
        "target_ip": "127.0.0.1",
        "default_port": default,
        "ports": {str(p): {"protocol": proto, "auth": auth} for p, (proto, auth) in ports.items()},
        "idle_period_s": 60,
        "connect_deadline_s": deadline,
    }
    if any(a == "token" for _, a in ports.values()):
        body["token_sha256"] = hashlib.sha256(TOKEN.encode()).hexdigest()
    return body


class GatewayThread:
    """The gateway on its own event loop in a thread. Routes from ``routes_file`` (a ``StaticRoutes``), or
    from ``routes``: a factory called on the gateway's loop (the scheduler's client). ``certs``: the front's
    certificates (default: one, ``*.<DOMAIN>``)."""

    def __init__(self, pki: Pki, routes_file: Path | None, *, routes: Callable[[], RouteSource] | None = None,
                 certs: Sequence[CertPair] | None = None, **config: Any) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(512)
        self.port = int(self.listener.getsockname()[1])
        cert, key = pki.paths["gateway"]

        async def build() -> GatewayServer:
            cfg = GatewayConfig(
                names=Names(DOMAIN, listen_port=self.port),
                front=FrontTls(list(certs) if certs is not None else [front_cert(pki)]),
                routes=routes() if routes is not None else StaticRoutes(routes_file, ttl=1.0),  # type: ignore[arg-type]
                upstream=UpstreamPolicy(client_context(cert_file=cert, key_file=key, ca_file=pki.ca_file)),
                **config,
            )
            server = GatewayServer(cfg)
            await server.start(self.listener)
            return server

        self.server: GatewayServer = asyncio.run_coroutine_threadsafe(build(), self.loop).result(30)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return float(self.server.metrics.registry.get_sample_value(name, labels or {}) or 0.0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.drain(1.0), self.loop).result(30)
        close = getattr(self.server.config.routes, "close", None)  # the scheduler's client: its session
        if close is not None:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class EchoHttp(http.server.ThreadingHTTPServer):
    """A sandbox's HTTP app: answers every request with JSON describing what it received (and ``ident``,
    the sandbox it plays, as ``"sandbox"``)."""

    daemon_threads = True
    request_queue_size = 128  # a real app's backlog, not socketserver's 5 (50 clients at once overflow it)

    def __init__(self, port: int = 0, *, ident: str = "") -> None:
        self.ident = ident
        self.requests: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", port), _Handler)
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a link the gateway reset (its client vanished mid-exchange) is not the app's error to print

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = {"method": self.command, "path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()],
                "body_sha256": hashlib.sha256(body).hexdigest(), "body_len": len(body),
                "sandbox": self.server.ident}  # type: ignore[attr-defined]
        self.server.requests.append(seen)  # type: ignore[attr-defined]
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            left = n
            while left:
                self.wfile.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
            return
        out = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = _answer


def forwarder_settings(pki: Pki, **over: Any) -> ForwarderSettings:
    """A userspace-plane forwarder on loopback that lets the gateway's certificate in and reaches 127.0.0.1."""
    cert, key = pki.paths["forwarder"]
    values: dict[str, Any] = dict(
        listen_host="127.0.0.1", listen_port=8443, metrics_port=0, cert_file=cert, key_file=key, ca_file=pki.ca_file,
        client_san_allow=["spiffe://sbxnet.test/gateway"], sandbox_prefixes=[ipaddress.ip_network("127.0.0.0/8")],
        allow_targets=[ipaddress.ip_network("127.0.0.1/32")], connect_deadline=1.0, data_plane="userspace",
    )
    values.update(over)
    return ForwarderSettings(**values)


@contextmanager
def gateway_stack(pki: Pki, routes_dir: Path) -> Iterator[dict[str, Any]]:
    """The gateway in front of a real forwarder and apps: sandboxes alpha (HTTP and a raw TCP port), beta
    (an HTTP app of its own), secure (token), ws (WebSockets), gone (a forwarder that is not there; alpha's
    app as its port). Each HTTP app answers with the sandbox it plays (``"sandbox"``)."""
    fwd = ForwarderThread(forwarder_settings(pki))
    app = EchoHttp(ident="alpha")
    beta = EchoHttp(ident="beta")
    secure = EchoHttp(ident="secure")

    def echo(conn: socket.socket) -> None:
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)

    tcp = SandboxApp(echo)
    ws_server, ws_port = websocket_echo()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = int(dead.getsockname()[1])
    dead.close()
    routes = routes_dir / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {app.port: ("http", "public"), tcp.port: ("tcp", "public")},
                              default=app.port),
        "beta": registration(pki, fwd.port, {beta.port: ("http", "public")}, default=beta.port),
        "secure": registration(pki, fwd.port, {secure.port: ("http", "token")}, default=secure.port),
        "ws": registration(pki, fwd.port, {ws_port: ("http", "public")}, default=ws_port),
        "gone": registration(pki, dead_port, {app.port: ("http", "public")}, default=app.port, deadline=0.5),
    }}))
    gw = GatewayThread(pki, routes, header_timeout=1.0, idle_timeout=5.0)
    yield {"gw": gw, "fwd": fwd, "app": app, "beta": beta, "secure": secure, "tcp": tcp, "pki": pki,
           "routes": routes}
    gw.stop()
    fwd.stop()
    app.stop()
    beta.stop()
    secure.stop()
    ws_server.shutdown()


def websocket_echo() -> tuple[Any, int]:
    """A sandbox's WebSocket app (the websockets library's server), echoing every message."""
    from websockets.sync.server import serve

    def handler(conn: Any) -> None:
        for message in conn:
            conn.send(message)

    server = serve(handler, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.socket.getsockname()[1])


class JsonLines(logging.Handler):
    """The gateway's log as its JSON lines (sbxnet.jsonlog's format), kept in memory."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []
        self.text: list[str] = []  # each line as written

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        self.text.append(line)
        self.lines.append(json.loads(line))

    def events(self, event: str, since: int = 0) -> list[dict[str, Any]]:
        return [line for line in self.lines[since:] if line.get("event") == event]


@contextmanager
def gateway_log(*quiet: GatewayThread, timeout: float = 15.0) -> Iterator[JsonLines]:
    """The ``sbxnet.gateway`` logger's INFO lines and up, while in the block. The logger is every gateway's
    in this process, and a request's line is written as it ends, which may be just after its client read
    the answer: so capturing starts once each of ``quiet`` serves no connection (an earlier test's last
    line is written by then)."""
    deadline = time.monotonic() + timeout
    for gw in quiet:
        while gw.server.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not gw.server.open_connections, "the gateway still serves an earlier test's connection"
    handler = JsonLines()
    logger = logging.getLogger("sbxnet.gateway")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def client_hello(server_name: str | None, *, tls12: bool = False) -> bytes:
    """The ClientHello Python's ssl sends for ``server_name`` (what a client's first bytes are)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=server_name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        return out.read()
    raise AssertionError("a client handshake finished with no server")


def non_ascii_hello(*, tls12: bool = False) -> bytes:
    """A well-formed ClientHello whose server name is ``é.<DOMAIN>`` in UTF-8, which no ssl client sends
    (they send the IDNA A-label): Python's ``xx.<DOMAIN>`` hello with the two name bytes swapped for
    ``é``'s two, so every length still holds."""
    hello = client_hello(f"xx.{DOMAIN}", tls12=tls12)
    assert hello.count(f"xx.{DOMAIN}".encode()) == 1
    return hello.replace(f"xx.{DOMAIN}".encode(), "é".encode() + f".{DOMAIN}".encode())
