"""Raw TCP-over-TLS routes end to end: client -> gateway -> real forwarder -> sandbox program, and back.

Half-close and reset each way under the one rule (close_notify is an orderly end of one direction; a TCP
FIN without it, a reset or idleness resets both sides), the idle timeout, and ``client_cert`` routes: a
certificate asked for only on their server names, required to chain to the client CA, a missing or wrong
one failing the handshake with nothing sent upstream. ``hello_server_name`` (the ClientHello read before
the handshake) gets property tests. Every test ends with no descriptor or task left behind.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gw_support import DOMAIN, EchoHttp, GatewayThread, forwarder_settings, front_cert, registration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, SandboxApp, open_fds

from certs.loader import client_context, server_context
from certs.mint import mint_ca, mint_leaf, write_issued
from gateway.server import relay
from gateway.tls_front import NEED_MORE, UNREADABLE, FrontTls, HelloName, hello_server_name
from sbxnet.tls_stream import TlsStream

OPENSSL = shutil.which("openssl")


# -- leak checks (the gateway's other real-client tests use these too) ---------------------------------


def loop_tasks(loop: asyncio.AbstractEventLoop) -> int:
    """How many tasks run on ``loop`` (another thread's), not counting the one that counts."""

    async def count() -> int:
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


def live_fds() -> set[int]:
    """This process's open descriptors, without the one listing them (``fwd_support.open_fds`` counts it,
    and a leak can hide behind its number)."""
    listed = open_fds()
    out = set()
    for fd in listed:
        try:
            os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        out.add(fd)
    return out


def _describe(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} (closed since)")
    return out


@contextmanager
def no_leaks(gateways: list[GatewayThread], forwarders: list[ForwarderThread], timeout: float = 15) -> Iterator[None]:
    """Around a test: afterwards, once every gateway and forwarder serves no connection, this process
    holds the descriptors it held before and their loops run the tasks they ran before."""
    fds = live_fds()
    tasks = [loop_tasks(g.loop) for g in gateways] + [loop_tasks(f.loop) for f in forwarders]
    yield
    deadline = time.monotonic() + timeout
    for g in gateways:
        while g.server.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert g.server.open_connections == 0, "the gateway still serves a connection"
    for f in forwarders:
        f.wait_idle(max(0.1, deadline - time.monotonic()))
    while True:  # sandbox threads and subprocesses close theirs a moment later
        leaked = live_fds() - fds
        now = [loop_tasks(g.loop) for g in gateways] + [loop_tasks(f.loop) for f in forwarders]
        if (not leaked and now == tasks) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"descriptors leaked: {_describe(leaked)}"
    assert now == tasks, f"tasks left running: {now} (before: {tasks})"


# -- the stack -------------------------------------------------------------------------------------------


@dataclass
class Sandbox:
    """A sandbox program on loopback: ``handler(conn, seen)``; ``seen`` gets one entry per connection."""

    app: SandboxApp
    seen: list[Any] = field(default_factory=list)
    started: list[int] = field(default_factory=list)  # one entry per handler that began

    @classmethod
    def start(cls, handler: Callable[[socket.socket, list[Any]], None]) -> Sandbox:
        seen: list[Any] = []
        started: list[int] = []

        def run(conn: socket.socket) -> None:
            started.append(1)
            handler(conn, seen)

        return cls(SandboxApp(run), seen, started)

    @property
    def port(self) -> int:
        return self.app.port

    def wait_started(self, before: int, timeout: float = 15) -> None:
        """Until the handler of the connection after ``before`` earlier ones runs: a reset that reaches the
        program before its accept() returns would stop SandboxApp's accept loop (getpeername fails)."""
        wait_for(lambda: len(self.started) > before, timeout)

    def wait(self, before: int, timeout: float = 15) -> Any:
        """The entry of the connection after ``before`` earlier ones, once its handler finished."""
        self.app.join(timeout, connections=before + 1)
        assert len(self.seen) > before, "the sandbox's handler did not finish"
        return self.seen[before]


def read_until_end(conn: socket.socket) -> tuple[bytes, str]:
    """Everything the peer sent, and how its direction ended: ``eof`` (FIN) or ``reset``."""
    buf = bytearray()
    try:
        while chunk := conn.recv(65536):
            buf += chunk
    except ConnectionResetError:
        return bytes(buf), "reset"
    return bytes(buf), "eof"


def echo(conn: socket.socket, seen: list[Any]) -> None:
    end = "eof"
    try:
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
    except (ConnectionResetError, BrokenPipeError):
        end = "reset"
    seen.append(end)


def answer_at_end(conn: socket.socket, seen: list[Any]) -> None:
    # Reads to the client's end of stream, only then answers: works only over a half-close.
    data, end = read_until_end(conn)
    if end == "eof":
        conn.sendall(b"got %d" % len(data))
    seen.append((len(data), end))


def banner_then_read(conn: socket.socket, seen: list[Any]) -> None:
    conn.sendall(b"banner")
    conn.shutdown(socket.SHUT_WR)  # this side is done; the client's direction stays open
    seen.append(read_until_end(conn))


def record(conn: socket.socket, seen: list[Any]) -> None:
    seen.append(read_until_end(conn))


def reset_after_hello(conn: socket.socket, seen: list[Any]) -> None:
    got = conn.recv(5)
    seen.append(got)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


@dataclass
class ClientPki:
    ca_file: Path
    user: tuple[Path, Path]  # issued by the client CA, clientAuth
    expired: tuple[Path, Path]  # the client CA's, expired
    server_only: tuple[Path, Path]  # the client CA's, serverAuth only


def make_client_pki(d: Path) -> ClientPki:
    ca = mint_ca("sbxnet test client CA")
    write_issued(ca, d, "client-ca")
    old = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    return ClientPki(
        d / "client-ca.crt",
        write_issued(mint_leaf(ca, "user", uris=("spiffe://sbxnet.test/user",), server=False, client=True), d, "u"),
        write_issued(mint_leaf(ca, "old", uris=("spiffe://sbxnet.test/old",), server=False, client=True, days=1,
                               not_before=old), d, "old"),
        write_issued(mint_leaf(ca, "srv", dns=("srv.test",), server=True, client=False), d, "srv"),
    )


@dataclass
class Raw:
    pki: Pki
    clients: ClientPki
    fwd: ForwarderThread
    gw: GatewayThread  # with the client CA
    bare: GatewayThread  # without a client CA, tcp_idle_timeout 0.5 s
    apps: dict[str, Sandbox]
    web: EchoHttp

    def sni(self, app: str) -> str:
        return f"{self.apps[app].port}-{'locked' if app == 'locked' else 'raw'}.{DOMAIN}"


@pytest.fixture(scope="module")
def raw(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Raw]:
    clients = make_client_pki(tmp_path_factory.mktemp("client-pki"))
    fwd = ForwarderThread(forwarder_settings(pki))
    apps = {name: Sandbox.start(h) for name, h in [("echo", echo), ("answer", answer_at_end),
                                                     ("banner", banner_then_read), ("record", record),
                                                     ("reset", reset_after_hello), ("locked", echo)]}
    web = EchoHttp()
    ports: dict[int, tuple[str, str]] = {a.port: ("tcp", "public") for n, a in apps.items() if n != "locked"}
    ports[web.port] = ("http", "public")
    routes = tmp_path_factory.mktemp("raw-routes") / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "raw": registration(pki, fwd.port, ports, default=web.port),
        "locked": registration(pki, fwd.port, {apps["locked"].port: ("tcp", "client_cert")},
                               default=apps["locked"].port),
    }}))
    gw = GatewayThread(pki, routes, handshake_timeout=5.0)
    # GatewayThread builds a front without a client CA; this one is the same certificate with one.
    gw.server.config.front = FrontTls([front_cert(pki)], client_ca_file=clients.ca_file)
    bare = GatewayThread(pki, routes, handshake_timeout=5.0, tcp_idle_timeout=0.5)
    yield Raw(pki, clients, fwd, gw, bare, apps, web)
    gw.stop()
    bare.stop()
    fwd.stop()
    for a in apps.values():
        a.app.close()
    web.stop()


@pytest.fixture(autouse=True)
def leak_check(raw: Raw) -> Iterator[None]:
    with no_leaks([raw.gw, raw.bare], [raw.fwd]):
        yield


def client_ctx(raw: Raw, cert: tuple[Path, Path] | None = None, *, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(raw.pki.ca_file))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


async def connect(raw: Raw, app: str, *, gw: GatewayThread | None = None,
                  ctx: ssl.SSLContext | None = None) -> TlsStream:
    sock = socket.create_connection(("127.0.0.1", (gw or raw.gw).port), timeout=10)
    sock.setblocking(False)
    return await TlsStream.connect(sock, ctx or client_ctx(raw), server_hostname=raw.sni(app), timeout=10)


async def read_all(s: TlsStream) -> bytes:
    buf = bytearray()
    while chunk := await s.read():
        buf += chunk
    return bytes(buf)


def tcp_ended(gw: GatewayThread, how: str) -> float:
    return gw.sample("sbxnet_gateway_requests_total", {"kind": "tcp", "status": how})


def fwd_outcome(raw: Raw, outcome: str) -> float:
    return raw.fwd.sample("sbxnet_forwarder_connections_total", {"outcome": outcome})


def wait_for(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- half-close and reset, each way ----------------------------------------------------------------------


async def test_client_half_close_reaches_the_sandbox_as_fin_and_the_answer_comes_back(raw: Raw) -> None:
    app, closed, fwd_closed = raw.apps["answer"], tcp_ended(raw.gw, "closed"), fwd_outcome(raw, "closed")
    before = len(app.seen)
    c = await connect(raw, "answer")
    await c.write(b"u" * 100_000)
    await c.write_eof()  # close_notify, then FIN: this direction is done, the other stays open
    assert await read_all(c) == b"got 100000"
    assert c.eof == "close_notify"  # the sandbox's FIN arrived as an orderly end, not a bare FIN
    c.close()
    assert app.wait(before) == (100_000, "eof")
    wait_for(lambda: tcp_ended(raw.gw, "closed") == closed + 1)
    wait_for(lambda: fwd_outcome(raw, "closed") == fwd_closed + 1)


async def test_sandbox_half_close_reaches_the_client_as_close_notify_and_the_client_goes_on(raw: Raw) -> None:
    app, closed = raw.apps["banner"], tcp_ended(raw.gw, "closed")
    before = len(app.seen)
    c = await connect(raw, "banner")
    assert await read_all(c) == b"banner"
    assert c.eof == "close_notify"
    await c.write(b"v" * 50_000)  # the client's direction still flows to the sandbox
    await c.write_eof()
    assert app.wait(before) == (b"v" * 50_000, "eof")
    wait_for(lambda: tcp_ended(raw.gw, "closed") == closed + 1)
    c.close()


async def test_client_fin_without_close_notify_resets_the_sandbox(raw: Raw) -> None:
    # A bare FIN is what a cut (or a crash) looks like: the sandbox must not take it for a complete stream.
    app, truncated, fwd_reset = raw.apps["record"], tcp_ended(raw.gw, "truncated"), fwd_outcome(raw, "reset_gateway")
    before = len(app.seen)
    c = await connect(raw, "record")
    await c.write(b"hello")
    app.wait_started(before)
    c.sock.shutdown(socket.SHUT_WR)  # FIN, no close_notify
    with pytest.raises(ConnectionResetError):
        await read_all(c)
    c.close()
    data, end = app.wait(before)
    assert end == "reset" and b"hello".startswith(data)
    wait_for(lambda: tcp_ended(raw.gw, "truncated") == truncated + 1)
    wait_for(lambda: fwd_outcome(raw, "reset_gateway") == fwd_reset + 1)


async def test_client_reset_resets_the_sandbox(raw: Raw) -> None:
    app, resets = raw.apps["record"], tcp_ended(raw.gw, "reset")
    before = len(app.seen)
    c = await connect(raw, "record")
    await c.write(b"hello")
    app.wait_started(before)
    c.abort()
    data, end = app.wait(before)
    assert end == "reset" and b"hello".startswith(data)
    wait_for(lambda: tcp_ended(raw.gw, "reset") == resets + 1)


async def test_sandbox_reset_reaches_the_client_as_reset(raw: Raw) -> None:
    app, resets, fwd_reset = raw.apps["reset"], tcp_ended(raw.gw, "reset"), fwd_outcome(raw, "reset_sandbox")
    before = len(app.seen)
    c = await connect(raw, "reset")
    await c.write(b"hello")
    with pytest.raises(ConnectionResetError):
        await read_all(c)
    c.close()
    assert app.wait(before) == b"hello"
    wait_for(lambda: tcp_ended(raw.gw, "reset") == resets + 1)
    wait_for(lambda: fwd_outcome(raw, "reset_sandbox") == fwd_reset + 1)


async def test_link_side_rule_close_notify_is_half_close_a_bare_fin_is_a_reset(tmp_path: Path) -> None:
    """``relay`` on its own, with a stand-in forwarder that can do what the real one never does (end with
    a bare FIN): the same rule holds on the link side as on the client's."""
    d = tmp_path
    ca = mint_ca("relay CA")
    write_issued(ca, d, "ca")
    s_cert = write_issued(mint_leaf(ca, "s", dns=("localhost",), server=True, client=True), d, "s")
    srv_ctx = server_context(cert_file=s_cert[0], key_file=s_cert[1], ca_file=d / "ca.crt")
    cli_ctx = client_context(cert_file=s_cert[0], key_file=s_cert[1], ca_file=d / "ca.crt")

    async def tls_pair() -> tuple[TlsStream, TlsStream]:
        lsock = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
        lsock.close()
        for s in (a, b):
            s.setblocking(False)
        return await asyncio.gather(TlsStream.connect(a, cli_ctx, server_hostname=None, timeout=5),
                                    TlsStream.accept(b, srv_ctx, timeout=5))

    loop_fds = live_fds()
    for ending in ("close_notify", "bare_fin"):
        user, gw_client = await tls_pair()  # the client and the gateway's side of it
        gw_link, forwarder = await tls_pair()  # the gateway's link and a stand-in forwarder
        relaying = asyncio.create_task(relay(gw_client, gw_link, idle=10))
        await forwarder.write(b"from the sandbox")
        if ending == "close_notify":
            await forwarder.write_eof()
        else:
            forwarder.sock.shutdown(socket.SHUT_WR)
        if ending == "close_notify":
            assert await read_all(user) == b"from the sandbox" and user.eof == "close_notify"
            await user.write(b"still sending")  # the other direction goes on
            await user.write_eof()
            assert await read_all(forwarder) == b"still sending"
            assert await relaying == ("closed", 13, 16)
        else:
            got = bytearray()
            with pytest.raises(ConnectionResetError):
                while chunk := await user.read():
                    got += chunk
            assert b"from the sandbox".startswith(bytes(got))
            assert (await relaying)[0] == "truncated"
            with pytest.raises(ConnectionResetError):
                await forwarder.read()  # the link was reset too
        for s in (user, forwarder):
            s.close()
    assert live_fds() == loop_fds


async def test_an_idle_raw_connection_is_reset_at_tcp_idle_timeout(raw: Raw) -> None:
    app, idle = raw.apps["echo"], tcp_ended(raw.bare, "idle")
    before = len(app.seen)
    c = await connect(raw, "echo", gw=raw.bare)
    await c.write(b"ping")
    assert await c.read() == b"ping"
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError):
        await c.read()
    took = time.monotonic() - t0
    c.close()
    assert 0.4 < took < 5, took  # tcp_idle_timeout is 0.5 s on this gateway
    assert app.wait(before) == "reset"
    wait_for(lambda: tcp_ended(raw.bare, "idle") == idle + 1)


# -- client certificates -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
def test_client_cert_route_with_a_certificate_from_the_client_ca(raw: Raw, tls12: bool) -> None:
    s = socket.create_connection(("127.0.0.1", raw.gw.port), timeout=10)
    t = client_ctx(raw, raw.clients.user, tls12=tls12).wrap_socket(s, server_hostname=raw.sni("locked"))
    assert t.selected_alpn_protocol() is None
    t.sendall(b"let me in")
    assert t.recv(100) == b"let me in"
    t.unwrap().close()  # close_notify both ways: an orderly end


def test_client_cert_route_with_openssl_s_client(raw: Raw) -> None:
    if OPENSSL is None:
        pytest.skip("openssl is not installed")
    cert, key = raw.clients.user
    proc = subprocess.Popen(
        [OPENSSL, "s_client", "-quiet", "-verify_return_error", "-servername", raw.sni("locked"),
         "-CAfile", str(raw.pki.ca_file), "-cert", str(cert), "-key", str(key),
         "-connect", f"127.0.0.1:{raw.gw.port}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"line through s_client\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"line through s_client\n"
    finally:
        proc.kill()
        proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def refused_at_handshake(raw: Raw, cert: tuple[Path, Path] | None, tls12: bool) -> str:
    """Connect to the client_cert route presenting ``cert``; the TLS error the client got. Asserts that
    nothing went upstream: the gateway never dialled the forwarder and the sandbox saw no connection."""
    app = raw.apps["locked"]
    accepted = app.app.accepted
    attempts = raw.gw.sample("sbxnet_gateway_upstream_attempts_total")
    failures = raw.gw.sample("sbxnet_gateway_handshake_failures_total")
    s = socket.create_connection(("127.0.0.1", raw.gw.port), timeout=10)
    with pytest.raises(ssl.SSLError) as err:
        # TLS 1.2: the handshake itself fails. TLS 1.3: the client's side of it completes (its Finished
        # goes with its certificate) and the gateway's alert is what it reads first.
        t = client_ctx(raw, cert, tls12=tls12).wrap_socket(s, server_hostname=raw.sni("locked"))
        try:
            t.recv(1)
        finally:
            t.close()
    s.close()
    wait_for(lambda: raw.gw.sample("sbxnet_gateway_handshake_failures_total") == failures + 1)
    assert raw.gw.sample("sbxnet_gateway_upstream_attempts_total") == attempts
    assert app.app.accepted == accepted
    return str(err.value)


@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
def test_no_client_certificate_fails_the_handshake(raw: Raw, tls12: bool) -> None:
    reason = refused_at_handshake(raw, None, tls12)
    assert ("HANDSHAKE_FAILURE" if tls12 else "CERTIFICATE_REQUIRED") in reason, reason


@pytest.mark.parametrize(
    ("which", "alert"),
    [("foreign", "UNKNOWN_CA"), ("server_ca", "UNKNOWN_CA"), ("expired", "CERTIFICATE_EXPIRED"),
     ("server_only", "UNSUPPORTED_CERTIFICATE")],
)
def test_a_wrong_client_certificate_fails_the_handshake(raw: Raw, which: str, alert: str) -> None:
    cert = {
        "foreign": raw.pki.paths["foreign"],  # another CA altogether
        "server_ca": raw.pki.paths["gateway"],  # the CA the front and the link use, not the client CA
        "expired": raw.clients.expired,
        "server_only": raw.clients.server_only,  # the client CA's, but not for TLS clients
    }[which]
    reason = refused_at_handshake(raw, cert, tls12=False)
    assert alert in reason, reason


def test_a_split_client_hello_is_read_whole_before_the_handshake(raw: Raw) -> None:
    # The ClientHello in two TCP segments 100 ms apart: the server name is read once it is all there.
    ctx = client_ctx(raw, raw.clients.user)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=raw.sni("locked"))
    s = socket.create_connection(("127.0.0.1", raw.gw.port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    first = True
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            out = outgoing.read()
            if first:
                s.sendall(out[:60])
                time.sleep(0.1)
                out, first = out[60:], False
            s.sendall(out)
            incoming.write(s.recv(65536))
    s.sendall(outgoing.read())
    obj.write(b"split hello")
    s.sendall(outgoing.read())
    got = b""
    while not got:
        try:
            got = obj.read(100)
        except ssl.SSLWantReadError:
            incoming.write(s.recv(65536))
    assert got == b"split hello"
    s.close()


def certificate_requested(raw: Raw, sni: str) -> bool:
    """Whether the gateway's handshake for ``sni`` carried a CertificateRequest (openssl s_client -msg)."""
    assert OPENSSL is not None
    r = subprocess.run([OPENSSL, "s_client", "-msg", "-servername", sni, "-CAfile", str(raw.pki.ca_file),
                        "-connect", f"127.0.0.1:{raw.gw.port}"], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=30)
    assert "Handshake" in r.stdout, r.stdout + r.stderr
    return "CertificateRequest" in r.stdout


def test_a_certificate_is_asked_for_only_on_client_cert_routes(raw: Raw) -> None:
    if OPENSSL is None:
        pytest.skip("openssl is not installed")
    assert certificate_requested(raw, raw.sni("locked"))
    assert not certificate_requested(raw, raw.sni("echo"))  # a public raw route
    assert not certificate_requested(raw, f"raw.{DOMAIN}")  # the HTTP route: a browser is never prompted
    assert not certificate_requested(raw, f"nobody.{DOMAIN}")


async def test_without_a_client_ca_a_client_cert_route_is_closed_before_anything_goes_upstream(raw: Raw) -> None:
    app = raw.apps["locked"]
    accepted = app.app.accepted
    refused = raw.bare.sample("sbxnet_gateway_refusals_total", {"reason": "client_cert_unconfigured"})
    attempts = raw.bare.sample("sbxnet_gateway_upstream_attempts_total")
    c = await connect(raw, "locked", gw=raw.bare, ctx=client_ctx(raw, raw.clients.user))
    with pytest.raises(ConnectionResetError):
        await c.read()  # the handshake asked for no certificate, so the gateway cuts right after it
    c.close()
    wait_for(lambda: raw.bare.sample("sbxnet_gateway_refusals_total",
                                     {"reason": "client_cert_unconfigured"}) == refused + 1)
    assert raw.bare.sample("sbxnet_gateway_upstream_attempts_total") == attempts
    assert app.app.accepted == accepted


# -- the ClientHello, read before the handshake -------------------------------------------------------------


def client_hello(server_name: str | None, *, tls12: bool = False, alpn: list[str] | None = None) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if alpn:
        ctx.set_alpn_protocols(alpn)
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=server_name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        return out.read()
    raise AssertionError("a client handshake finished with no server")


def front_sees(front: FrontTls, hello: bytes) -> str | None:
    """The server name the front's real handshake records for ``hello``."""
    incoming = ssl.MemoryBIO()
    obj = front.context.wrap_bio(incoming, ssl.MemoryBIO(), server_side=True)
    incoming.write(hello)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return front.server_name(obj)


# Starting with a letter: a name of digits and dots may be an IP literal, for which clients send no SNI.
_label = st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(labels=st.lists(_label, min_size=1, max_size=4), tls12=st.booleans(),
       alpn=st.sampled_from([None, ["h2", "http/1.1"], ["ssh"]]))
def test_hello_server_name_reads_what_the_handshake_reads(raw: Raw, labels: list[str], tls12: bool,
                                                          alpn: list[str] | None) -> None:
    name = ".".join(labels)
    hello = client_hello(name, tls12=tls12, alpn=alpn)
    assert hello_server_name(hello) == HelloName(name) == HelloName(front_sees(raw.gw.server.config.front, hello))
    assert hello_server_name(hello + b"\x17\x03\x03\x00\x05trail") == HelloName(name)  # bytes after it
    for cut in sorted({0, 1, 4, 5, 6, len(hello) // 2, len(hello) - 1}):
        assert hello_server_name(hello[:cut]) == NEED_MORE


def test_hello_server_name_without_sni_and_for_what_is_not_tls() -> None:
    assert hello_server_name(client_hello(None)) == HelloName(None)
    assert hello_server_name(b"GET / HTTP/1.1\r\nHost: raw.sbx.test\r\n\r\n") == UNREADABLE
    assert hello_server_name(b"SSH-2.0-OpenSSH_9.2\r\n") == UNREADABLE


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=600))
def test_hello_server_name_on_any_bytes_never_raises(data: bytes) -> None:
    assert hello_server_name(data) in (NEED_MORE, UNREADABLE) or isinstance(hello_server_name(data), HelloName)


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=8))
def test_hello_server_name_on_a_damaged_hello_never_raises(flips: list[tuple[int, int]]) -> None:
    hello = bytearray(_HELLO)
    for at, x in flips:
        hello[at % len(hello)] ^= x
    result = hello_server_name(bytes(hello))
    assert result in (NEED_MORE, UNREADABLE) or isinstance(result, HelloName)


_HELLO = client_hello(f"22-sandbox.{DOMAIN}", alpn=["h2", "http/1.1"])


def test_the_client_ca_file_setting(raw: Raw, tmp_path: Path) -> None:
    import pydantic

    from certs.loader import LOAD_ERRORS
    from gateway.run import build_config
    from gateway.settings import GatewaySettings

    front = front_cert(raw.pki)
    cert, key = raw.pki.paths["gateway"]
    routes = tmp_path / "routes.json"
    routes.write_text('{"sandboxes": {}}')
    base: dict[str, Any] = dict(domain=DOMAIN, cert_files=[front.cert_file], key_files=[front.key_file],
                                routes_file=routes, upstream_cert_file=cert, upstream_key_file=key,
                                upstream_ca_file=raw.pki.ca_file)
    assert GatewaySettings(**base).client_ca_file is None
    assert build_config(GatewaySettings(**base)).front.verifies_client_certs is False
    config = build_config(GatewaySettings(**base, client_ca_file=raw.clients.ca_file))
    assert config.front.verifies_client_certs is True
    with pytest.raises(pydantic.ValidationError, match="client_ca_file"):
        GatewaySettings(**base, client_ca_file=tmp_path / "missing.crt")
    (tmp_path / "junk.crt").write_text("not a certificate")
    with pytest.raises(LOAD_ERRORS):
        build_config(GatewaySettings(**base, client_ca_file=tmp_path / "junk.crt"))
