"""Real peers for forwarder tests: a gateway-like TLS client, sandbox apps, a forwarder in a thread."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from certs.mint import Issued, mint_ca, mint_leaf, write_issued
from gateway.link_client import LinkClient as GwClient
from sbxnet.protocol.preamble import Preamble, push_preamble

__all__ = ["GwClient"]  # re-exported for the tests

TRUST_DOMAIN = "sbxnet.test"
GATEWAY_URI = f"spiffe://{TRUST_DOMAIN}/gateway"


# -- certificates -----------------------------------------------------------------------------------


@dataclass
class Pki:
    dir: Path
    ca: Issued
    paths: dict[str, tuple[Path, Path]] = field(default_factory=dict)

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.crt"

    def client_ctx(self, stem: str | None = "gateway", *, tls12_only: bool = False) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cafile=str(self.ca_file))
        if stem:
            cert, key = self.paths[stem]
            ctx.load_cert_chain(str(cert), str(key))
        if tls12_only:
            ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def make_pki(directory: Path) -> Pki:
    import datetime as dt

    ca = mint_ca("sbxnet test CA")
    write_issued(ca, directory, "ca")
    pki = Pki(directory, ca)

    def leaf(stem: str, issuer: Issued, **kw: Any) -> None:
        pki.paths[stem] = write_issued(mint_leaf(issuer, stem, **kw), directory, stem)

    # Server and client, with a URI SAN, as `sbxnet certs forwarder` mints it: the link's certificate is
    # also the idle feed's (sched_support's forwarder identity), so the feed's key is the one routes pin.
    leaf("forwarder", ca, dns=("localhost",), ips=("127.0.0.1", "::1"), uris=("spiffe://t/forwarder/1",),
         server=True, client=True)
    leaf("gateway", ca, uris=(GATEWAY_URI,), server=False, client=True)
    leaf("intruder", ca, uris=(f"spiffe://{TRUST_DOMAIN}/intruder",), server=False, client=True)
    old = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    leaf("expired", ca, uris=(GATEWAY_URI,), server=False, client=True, days=1, not_before=old)
    other = mint_ca("some other CA")
    leaf("foreign", other, uris=(GATEWAY_URI,), server=False, client=True)
    return pki


# -- the gateway side -------------------------------------------------------------------------------


def preamble_for(port: int, sandbox_id: str = "sbx-1", dst: str = "127.0.0.1", **kw: Any) -> bytes:
    return push_preamble(
        Preamble(
            src=ipaddress.ip_address("203.0.113.7"),
            src_port=40000,
            dst=ipaddress.ip_address(dst),
            dst_port=port,
            sandbox_id=sandbox_id,
            **kw,
        )
    )


# -- sandbox apps -----------------------------------------------------------------------------------


def payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


class SandboxApp:
    """A TCP server on loopback running ``handler(conn)`` per connection in a thread."""

    def __init__(self, handler: Callable[[socket.socket], None], *, port: int = 0, listen: bool = True) -> None:
        self.handler = handler
        self.accepted = 0
        self.gone_before_accept = 0  # connections reset in the backlog, skipped
        self.errors: list[BaseException] = []
        self.peers: list[tuple[str, int]] = []
        self.results: list[Any] = []
        self._lsock: socket.socket | None = None
        self.port = port
        self._threads: list[threading.Thread] = []
        if listen:
            self.listen()
        elif port == 0:
            self.port = free_port()

    def listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.port = s.getsockname()[1]
        self._lsock = s
        self.listened_at = time.monotonic()
        t = threading.Thread(target=self._accept_loop, daemon=True)
        t.start()

    def _accept_loop(self) -> None:
        assert self._lsock is not None
        while True:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            try:
                peer = conn.getpeername()
            except OSError:  # ENOTCONN: reset while it waited in the backlog; nothing to serve
                conn.close()
                self.gone_before_accept += 1
                continue
            self.accepted += 1
            self.peers.append(peer)
            t = threading.Thread(target=self._run, args=(conn,), daemon=True)
            t.start()  # started before it is listed: join() may run in another thread at any moment
            self._threads.append(t)

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except BaseException as e:  # recorded for the test to assert on
            self.errors.append(e)
        finally:
            conn.close()

    def join(self, timeout: float = 30, *, connections: int = 1) -> None:
        """Wait for ``connections`` handlers to have started (the accept may still be on its way), then
        for every handler to finish."""
        deadline = time.monotonic() + timeout
        while len(self._threads) < connections and time.monotonic() < deadline:
            time.sleep(0.005)
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._lsock:
            self._lsock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recv_all(conn: socket.socket) -> tuple[bytes, int]:
    h = hashlib.sha256()
    total = 0
    while True:
        data = conn.recv(1 << 18)
        if not data:
            return h.digest(), total
        h.update(data)
        total += len(data)


# -- the forwarder under test, in a thread with its own event loop -----------------------------------


class ForwarderThread:
    def __init__(self, settings: Any) -> None:
        import uvloop

        from forwarder.ingress.server import ForwarderServer, bind_listener

        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.listener = bind_listener("127.0.0.1", 0, reuse_port=False)

        async def build() -> ForwarderServer:
            server = ForwarderServer(settings)
            await server.start(self.listener)
            return server

        self.server = self.call(build())
        self.port = self.server.port

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.server.metrics.registry.get_sample_value(name, labels or {})
        return float(value or 0.0)

    def wait_idle(self, timeout: float = 10) -> None:
        """Wait until the forwarder serves no connection; AssertionError if it still does after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.server.open_connections:
            if time.monotonic() >= deadline:
                n = self.server.open_connections
                raise AssertionError(f"forwarder still serving {n} connection(s) after {timeout}s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.call(self.server.drain(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def open_fds() -> set[int]:
    """The descriptors open in this process. The listing's own descriptor is closed once listed, so
    each listed one is checked with fstat and those gone by then are dropped (that one among them)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue
        fds.add(fd)
    return fds
