"""The demo's sandbox programs and its platform: small real servers on loopback.

- ``HttpProgram``: an HTTP/1.1 app (``/`` says who it is, ``/bytes/<n>`` streams n bytes, a POST is
  hashed and the digest returned) that can start listening late and stop and start again on its port.
- ``websocket_echo`` and ``grpc_program``: a WebSocket echo (the ``websockets`` library) and a gRPC
  service over h2c (``grpcio``, generic handlers: no generated code), each when its library is installed.
- ``Platform``: the scheduler's webhook receiver acting as the platform's driver: on ``idle`` it asks the
  scheduler whether to stop (the stop fence), stops the program and says ``stopped``; on ``waking`` it
  starts the program again and says ``ready``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent import futures
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.program.requests += 1
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(n))
            self.end_headers()
            block = self.server.program.block
            left = n
            while left:
                chunk = block[: min(left, len(block))]
                self.wfile.write(chunk)
                left -= len(chunk)
            return
        who = self.server.program.name
        xff = self.headers.get("x-forwarded-for", "-")
        self._send(200, f"hello from {who} (you are {xff}; {self.headers.get('host')})\n".encode())

    def do_POST(self) -> None:
        self.server.program.requests += 1
        left = int(self.headers.get("content-length") or 0)
        h = hashlib.sha256()
        while left:
            chunk = self.rfile.read(min(left, 1 << 18))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        self._send(200, (h.hexdigest() + "\n").encode())


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    program: HttpProgram

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a link closed under a keep-alive connection is the client's business, not a crash to print


class HttpProgram:
    """One sandbox's HTTP program on 127.0.0.1:``port``."""

    def __init__(self, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.block = hashlib.sha256(name.encode()).digest() * 2048  # 64 KiB of deterministic bytes
        self.requests = 0
        self.listened_at: float | None = None
        self._server: _Server | None = None

    def start(self) -> None:
        srv = _Server(("127.0.0.1", self.port), _Handler)
        srv.program = self
        self._server = srv
        self.listened_at = time.monotonic()
        threading.Thread(target=srv.serve_forever, daemon=True).start()

    def start_after(self, delay: float) -> threading.Timer:
        t = threading.Timer(delay, self.start)
        t.start()
        return t

    def stop(self) -> None:
        srv, self._server = self._server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()

    @property
    def running(self) -> bool:
        return self._server is not None

    def expected_download(self, n: int) -> str:
        h = hashlib.sha256()
        left = n
        while left:
            chunk = self.block[: min(left, len(self.block))]
            h.update(chunk)
            left -= len(chunk)
        return h.hexdigest()


def websocket_echo(port: int) -> Callable[[], None] | None:
    """A WebSocket echo program on ``port``; returns its stop function, None without ``websockets``."""
    try:
        from websockets.sync.server import serve
    except ImportError:
        return None

    def echo(ws: Any) -> None:
        for message in ws:
            ws.send(message)

    server = serve(echo, "127.0.0.1", port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.shutdown


GRPC_SERVICE = "demo.Echo"


def grpc_program(port: int) -> Callable[[], None] | None:
    """A gRPC service over h2c on ``port`` (Unary echoes; Count streams n numbers); None without grpcio."""
    try:
        import grpc
    except ImportError:
        return None

    def unary(request: bytes, context: Any) -> bytes:
        return b"echo: " + request

    def count(request: bytes, context: Any) -> Any:
        for i in range(int(request)):
            yield str(i).encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Count": grpc.unary_stream_rpc_method_handler(count),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return lambda: server.stop(0.5).wait()


class Platform:
    """The platform's webhook receiver and driver for the programs it is given (sandbox -> program)."""

    def __init__(self, scheduler_url: str, admin_token: str, ca_file: str, programs: dict[str, HttpProgram],
                 *, start_delay_s: float = 0.2) -> None:
        self.scheduler_url = scheduler_url.rstrip("/")
        self.token = admin_token
        self.ctx = ssl.create_default_context(cafile=ca_file)
        self.programs = programs
        self.start_delay_s = start_delay_s
        self.events: list[tuple[float, dict[str, Any]]] = []  # (monotonic time received, event)
        self.actions: list[tuple[float, str]] = []
        self.port = free_port()
        platform = self

        class Hook(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                ev = json.loads(body)
                platform.events.append((time.monotonic(), ev))
                threading.Thread(target=platform._act, args=(ev,), daemon=True).start()

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Hook)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def admin(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.scheduler_url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=15) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def _act(self, ev: dict[str, Any]) -> None:
        try:
            self._drive(ev)
        except OSError as e:  # the scheduler went away (the demo is ending): nothing to drive
            self.actions.append((time.monotonic(), f"{ev['sandbox']}: could not reach the scheduler ({e})"))

    def _drive(self, ev: dict[str, Any]) -> None:
        sid = ev["sandbox"]
        program = self.programs.get(sid)
        if program is None:
            return
        if ev["to"] == "idle":
            _, answer = self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopping"})
            if not answer.get("proceed"):
                self.actions.append((time.monotonic(), f"{sid}: the stop was fenced (traffic came first)"))
                return
            program.stop()
            self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopped"})
            self.actions.append((time.monotonic(), f"{sid}: program stopped"))
        elif ev["to"] == "waking":
            time.sleep(self.start_delay_s)  # what a VM restore costs
            program.start()
            self.actions.append((time.monotonic(), f"{sid}: program started"))
            self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "ready"})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
