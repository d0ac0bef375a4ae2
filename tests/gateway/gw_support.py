"""Real peers for gateway tests: the gateway in a thread, in front of a real forwarder, with real apps."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import Pki

from certs.loader import client_context
from certs.mint import mint_leaf, spki_pin, write_issued
from gateway.names import Names
from gateway.route_source import StaticRoutes
from gateway.server import GatewayConfig, GatewayServer
from gateway.tls_front import CertPair, FrontTls
from gateway.upstream import UpstreamPolicy

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
    def __init__(self, pki: Pki, routes_file: Path, **config: Any) -> None:
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
                front=FrontTls([front_cert(pki)], alpn=("http/1.1",)),
                routes=StaticRoutes(routes_file, ttl=1.0),
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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class EchoHttp(http.server.ThreadingHTTPServer):
    """A sandbox's HTTP app: answers every request with JSON describing what it received."""

    daemon_threads = True

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a link the gateway aborted (its client left) is not the app's error to print

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
                "body_sha256": hashlib.sha256(body).hexdigest(), "body_len": len(body)}
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
