"""sbxnet/tls_stream.py over real loopback sockets, both ends TlsStream, on the default loop and uvloop."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from certs.mint import mint_ca, mint_leaf, write_issued
from sbxnet.tls_stream import TlsStream

Loop = Callable[[Coroutine[Any, Any, None]], None]


def _default(coro: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner() as runner:
        runner.run(coro)


def _uvloop(coro: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


@pytest.fixture(params=[_default, _uvloop], ids=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Loop:
    # libuv opens its process-wide signal pipe with the first loop: not a leak of ours.
    request.param(asyncio.sleep(0))

    def go(coro: Coroutine[Any, Any, None]) -> None:
        # An earlier test's garbage (a socket only the collector closes) must not close an fd while this
        # one runs, and a leak is an fd that is new afterwards, not one something else closed meanwhile.
        gc.collect()
        before = _fds()
        request.param(coro)
        assert not _fds() - before, "file descriptors leaked"

    return go


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = mint_ca(), mint_ca("other CA")
    write_issued(ca, d, "ca")
    write_issued(other_ca, d, "other_ca")
    write_issued(mint_leaf(ca, "server", dns=("localhost",)), d, "server")
    return {"ca": d / "ca.crt", "other_ca": d / "other_ca.crt", "crt": d / "server.crt", "key": d / "server.key"}


def _server_ctx(pki: dict[str, Path], *, alpn: list[str] | None = None, tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki["crt"], pki["key"])
    if alpn:
        ctx.set_alpn_protocols(alpn)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _client_ctx(pki: dict[str, Path], *, ca: str = "ca", alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki[ca])
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


async def _pair(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[TlsStream, TlsStream]:
    a, b = socket.socketpair()
    return await asyncio.gather(
        TlsStream.accept(a, server, timeout=5),
        TlsStream.connect(b, client, server_hostname="localhost", timeout=5),
    )


async def _read_all(s: TlsStream) -> bytes:
    out = bytearray()
    while chunk := await s.read():
        out += chunk
    return bytes(out)


@pytest.fixture(params=["tls13", "tls12"])
def ctxs(request: pytest.FixtureRequest, pki: dict[str, Path]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    return _server_ctx(pki, tls12=request.param == "tls12"), _client_ctx(pki)


def test_echo(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        try:
            for msg in (b"x", b"hello" * 1000, os.urandom(100_000)):
                await cli.write(msg)
                got = bytearray()
                while len(got) < len(msg):
                    got += await srv.read()
                await srv.write(bytes(got))
                back = bytearray()
                while len(back) < len(msg):
                    back += await cli.read()
                assert bytes(back) == msg
        finally:
            srv.close()
            cli.close()

    run(main())


def test_read_returns_what_is_there(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        await cli.write(b"abc")
        assert await asyncio.wait_for(srv.read(65536), 5) == b"abc"
        await cli.write(b"0123456789")
        assert await srv.read(4) == b"0123"
        assert await srv.read(100) == b"456789"
        srv.close()
        cli.close()

    run(main())


def test_bulk_both_ways_concurrently(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    size = 8 << 20

    async def send(s: TlsStream, seed: bytes) -> str:
        h = hashlib.sha256()
        block = hashlib.sha256(seed).digest() * 2048  # 64 KiB
        sent = 0
        i = 0
        while sent < size:
            chunk = block[: 1 + (i * 7919) % len(block)]
            chunk = chunk[: size - sent]
            await s.write(chunk)
            h.update(chunk)
            sent += len(chunk)
            i += 1
        await s.write_eof()
        return h.hexdigest()

    async def recv(s: TlsStream) -> str:
        h = hashlib.sha256()
        while chunk := await s.read():
            h.update(chunk)
        assert s.eof == "close_notify"
        return h.hexdigest()

    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        sent_c, sent_s, got_s, got_c = await asyncio.wait_for(
            asyncio.gather(send(cli, b"c"), send(srv, b"s"), recv(srv), recv(cli)), 60
        )
        assert sent_c == got_s
        assert sent_s == got_c
        srv.close()
        cli.close()

    run(main())


@pytest.mark.parametrize("first", ["client", "server"])
def test_half_close(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext], first: str) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        a, b = (cli, srv) if first == "client" else (srv, cli)
        await a.write(b"request")
        await a.write_eof()
        await a.write_eof()  # idempotent
        assert await _read_all(b) == b"request"
        assert b.eof == "close_notify"
        assert await b.read() == b""  # stays at end
        with pytest.raises(BrokenPipeError):
            await a.write(b"more")
        await b.write(b"response" * 10000)
        await b.write_eof()
        assert await _read_all(a) == b"response" * 10000
        assert a.eof == "close_notify"
        srv.close()
        cli.close()

    run(main())


def test_write_eof_with_records_waiting(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """Records already in the socket (or BIO) when we send close_notify are still read."""

    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        for i in range(20):
            await srv.write(b"%d;" % i)
        await srv.write_eof()
        await asyncio.sleep(0.05)
        assert await cli.read(2) == b"0;"  # one recv, all records in it decrypted
        await cli.write_eof()
        assert await _read_all(cli) == b"".join(b"%d;" % i for i in range(1, 20))
        assert cli.eof == "close_notify"
        assert await _read_all(srv) == b""
        assert srv.eof == "close_notify"
        srv.close()
        cli.close()

    run(main())


def test_tcp_fin_without_close_notify(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        await srv.write(b"partial")
        srv.sock.shutdown(socket.SHUT_WR)
        assert await _read_all(cli) == b"partial"
        assert cli.eof == "tcp_eof"
        # And the other way still works.
        await cli.write(b"still here")
        assert await srv.read() == b"still here"
        srv.close()
        cli.close()

    run(main())


def test_abort_resets_the_peer(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        await cli.write(b"unread by the server")  # unread data too: the reset must still come
        await asyncio.sleep(0.05)
        srv.abort()
        with pytest.raises(OSError):
            await cli.read()
        cli.close()

    run(main())


def test_abort_on_tcp(run: Loop, pki: dict[str, Path]) -> None:
    """Over TCP (not a socketpair) abort sends a reset: ConnectionResetError, not EOF."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lsock = socket.create_server(("127.0.0.1", 0))
        lsock.setblocking(False)
        c = socket.socket()
        c.setblocking(False)
        await loop.sock_connect(c, lsock.getsockname())
        s, _ = await loop.sock_accept(lsock)
        lsock.close()
        srv, cli = await asyncio.gather(
            TlsStream.accept(s, _server_ctx(pki), timeout=5),
            TlsStream.connect(c, _client_ctx(pki), server_hostname="localhost", timeout=5),
        )
        await cli.write(b"ping")
        assert await srv.read() == b"ping"
        srv.abort()
        with pytest.raises(ConnectionResetError):
            await cli.read()
        with pytest.raises(OSError):
            for _ in range(10):
                await cli.write(b"x" * 65536)
                await asyncio.sleep(0.01)
        cli.close()

    run(main())


def test_close_ends_pending_read(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        reader = asyncio.create_task(cli.read())
        await asyncio.sleep(0.02)
        cli.close()
        with pytest.raises(ConnectionAbortedError):
            await asyncio.wait_for(reader, 5)
        srv.close()

    run(main())


def test_cancelled_read_is_cancelled(run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(cli.read(), 0.05)
        await srv.write(b"after")
        assert await cli.read() == b"after"
        srv.close()
        cli.close()

    run(main())


def test_handshake_timeout(run: Loop, pki: dict[str, Path]) -> None:
    async def main() -> None:
        for side in ("accept", "connect"):
            a, b = socket.socketpair()
            with pytest.raises(TimeoutError):
                if side == "accept":
                    await TlsStream.accept(a, _server_ctx(pki), timeout=0.2)
                else:
                    await TlsStream.connect(a, _client_ctx(pki), server_hostname="localhost", timeout=0.2)
            assert a.fileno() == -1
            b.close()

    run(main())


def test_handshake_eof(run: Loop, pki: dict[str, Path]) -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        b.close()
        with pytest.raises(OSError):
            await TlsStream.connect(a, _client_ctx(pki), server_hostname="localhost", timeout=5)
        assert a.fileno() == -1

    run(main())


def test_wrong_ca(run: Loop, pki: dict[str, Path]) -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        results = await asyncio.gather(
            TlsStream.accept(a, _server_ctx(pki), timeout=5),
            TlsStream.connect(b, _client_ctx(pki, ca="other_ca"), server_hostname="localhost", timeout=5),
            return_exceptions=True,
        )
        assert isinstance(results[1], ssl.SSLCertVerificationError)
        assert isinstance(results[0], ssl.SSLError)  # the client's alert
        assert a.fileno() == -1
        assert b.fileno() == -1

    run(main())


def test_wrong_hostname(run: Loop, pki: dict[str, Path]) -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        results = await asyncio.gather(
            TlsStream.accept(a, _server_ctx(pki), timeout=5),
            TlsStream.connect(b, _client_ctx(pki), server_hostname="elsewhere", timeout=5),
            return_exceptions=True,
        )
        assert isinstance(results[1], ssl.SSLCertVerificationError)
        assert isinstance(results[0], OSError)

    run(main())


def test_alpn_and_version(run: Loop, pki: dict[str, Path]) -> None:
    async def main() -> None:
        srv, cli = await _pair(_server_ctx(pki, alpn=["h2", "http/1.1"]), _client_ctx(pki, alpn=["http/1.1", "h2"]))
        assert srv.ssl_object.selected_alpn_protocol() == "h2"
        assert cli.ssl_object.selected_alpn_protocol() == "h2"
        assert cli.ssl_object.version() == "TLSv1.3"
        cert = cli.ssl_object.getpeercert()
        assert cert and ("DNS", "localhost") in cert["subjectAltName"]
        srv.close()
        cli.close()

    run(main())


def test_session_tickets_do_not_surface(run: Loop, pki: dict[str, Path]) -> None:
    """A TLS 1.3 server sends tickets after the handshake; the client's first read skips them."""

    async def main() -> None:
        server = _server_ctx(pki)
        server.num_tickets = 4
        srv, cli = await _pair(server, _client_ctx(pki))
        await asyncio.sleep(0.05)  # the tickets are in the client's socket, nothing else
        reader = asyncio.create_task(cli.read())
        await asyncio.sleep(0.05)
        assert not reader.done()  # tickets alone are no data and no EOF
        await srv.write(b"data")
        assert await asyncio.wait_for(reader, 5) == b"data"
        assert cli.ssl_object.session is not None
        srv.close()
        cli.close()

    run(main())


def test_data_right_behind_the_clients_finished_is_read_without_more_bytes(run: Loop, pki: dict[str, Path]) -> None:
    # curl sends its first request in the same segment as its Finished; the server must not wait on the
    # socket for bytes that are already in its incoming BIO (the gateway's keep-alive test found this).
    async def main() -> None:
        a, b = socket.socketpair()
        b.setblocking(True)
        cctx = _client_ctx(pki)
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = cctx.wrap_bio(inc, out, server_hostname="localhost")
        loop = asyncio.get_running_loop()

        async def client() -> None:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if out.pending:
                        await loop.sock_sendall(b, out.read())
                    inc.write(await loop.sock_recv(b, 65536))
            tls.write(b"GET / HTTP/1.1\r\n\r\n")
            await loop.sock_sendall(b, out.read())  # Finished and the request in one send

        b.setblocking(False)
        srv, _ = await asyncio.gather(TlsStream.accept(a, _server_ctx(pki), timeout=5), client())
        try:
            async with asyncio.timeout(2):
                assert await srv.read() == b"GET / HTTP/1.1\r\n\r\n"
        finally:
            srv.close()
            b.close()

    run(main())


def test_usable_idle_takes_session_tickets_and_sees_every_way_a_stream_goes_bad(
    run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """What the gateway's warm pool asks of a link it kept: still fit to send a first byte on?"""

    async def main() -> None:
        srv, cli = await _pair(*ctxs)
        await asyncio.sleep(0.05)  # a TLS 1.3 server's session tickets are waiting on the client's socket
        assert cli.usable_idle()
        assert cli.usable_idle()  # asking again changes nothing
        # The stream still works both ways after the tickets were taken without a read.
        await cli.write(b"first byte")
        assert await srv.read() == b"first byte"
        await srv.write(b"answer")
        assert await cli.read() == b"answer"
        # The peer speaks before being asked: not fit (and what it said is not lost to a later read).
        await srv.write(b"unasked")
        await asyncio.sleep(0.05)
        assert not cli.usable_idle()
        assert await cli.read() == b"unasked"
        srv.close()
        cli.close()

        for end in ("close_notify", "fin", "reset"):
            srv, cli = await _pair(*ctxs)
            if end == "close_notify":
                await srv.write_eof()
            elif end == "fin":
                srv.sock.shutdown(socket.SHUT_WR)
            else:
                srv.abort()
            await asyncio.sleep(0.05)
            assert not cli.usable_idle(), end
            srv.close()
            cli.close()
            assert not cli.usable_idle()  # a closed stream is never fit

    run(main())


def test_a_socket_stays_watched_between_reads_and_is_let_go_while_nobody_reads(
    run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """One registration serves read after read; bytes that come while nobody reads do not keep the loop
    busy (the socket is let go, not polled over and over) and are read whole later."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv, cli = await _pair(*ctxs)
        adds = 0
        add_reader = loop.add_reader

        def counting(*args: Any) -> None:
            nonlocal adds
            adds += 1
            add_reader(*args)

        loop.add_reader = counting  # type: ignore[method-assign,assignment]
        try:
            for i in range(5):
                reading = asyncio.ensure_future(srv.read())
                await asyncio.sleep(0.01)  # the read waits on the socket
                await cli.write(b"%d" % i)
                assert await reading == b"%d" % i
            assert adds <= 1  # watched once (from the handshake on, or the first wait) for the five waits
            await cli.write(b"while nobody reads")
            cpu = time.process_time()
            await asyncio.sleep(0.3)
            assert time.process_time() - cpu < 0.1  # polled over and over, it would be most of the 0.3 s
            assert await srv.read() == b"while nobody reads"
        finally:
            loop.add_reader = add_reader  # type: ignore[method-assign]
            srv.close()
            cli.close()

    run(main())


def test_interrupt_read_wakes_a_waiting_read_which_takes_nothing(
    run: Loop, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    async def main() -> None:
        from sbxnet.tls_stream import ReadInterrupted

        srv, cli = await _pair(*ctxs)
        try:
            assert not srv.interrupt_read()  # no read under way
            reading = asyncio.ensure_future(srv.read())
            await asyncio.sleep(0.01)
            assert srv.interrupt_read()
            with pytest.raises(ReadInterrupted):
                await reading
            await cli.write(b"after")
            assert await asyncio.wait_for(srv.read(), 5) == b"after"  # nothing lost, nothing left armed
            # An interrupt whose read is cancelled before it runs is not left for the next read.
            reading = asyncio.ensure_future(srv.read())
            await asyncio.sleep(0.01)
            assert srv.interrupt_read()
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            later = asyncio.ensure_future(srv.read())
            await asyncio.sleep(0.01)
            await cli.write(b"next")
            assert await asyncio.wait_for(later, 5) == b"next"
        finally:
            srv.close()
            cli.close()

    run(main())
