"""Our L7 hop for the staged benchmark's arm 1: in the forwarder's place, but parsing and re-framing HTTP.

    python -m sbxnet.app.bench.l7_hop --certs DIR --port P

It speaks the forwarder's link to the gateway (mutual TLS 1.3 with the forwarder's certificate, client
certificates verified against the CA; the preamble read; the 4-byte status answered once the app's
connection is open) and then, unlike the forwarder, parses each HTTP/1.1 request and response with
httptools and writes them on as a proxy does: hop-by-hop headers dropped, ``X-Forwarded-For`` added
from the preamble, chunked bodies re-chunked. One keep-alive connection to the app per link. Bodies
stream through as they arrive, nothing buffered whole: each side's write buffer above 1 MiB pauses
reading on the other (the transports' flow control). asyncio protocols on uvloop, TLS by uvloop.

A benchmark peer, not a product part: only loopback targets are served, no client SAN is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
from pathlib import Path
from typing import Any

import httptools
import uvloop

from sbxnet.app.bench.http_peer import LAST_CHUNK, chunk, reframe
from sbxnet.protocol.codes import Status
from sbxnet.protocol.preamble import PreambleError, pull_preamble
from sbxnet.protocol.status import push_status

HIGH_WATER = 1 << 20


class _Message:
    """The message in progress on one direction: its start line parts and headers."""

    def __init__(self) -> None:
        self.url = b""
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = False

    def on_message_begin(self) -> None:
        self.url, self.reason, self.headers, self.chunked = b"", b"", [], False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))


class Downstream(asyncio.Protocol, _Message):
    """The gateway's link: preamble, then requests parsed and written on to the app."""

    def __init__(self) -> None:
        _Message.__init__(self)
        self.transport: Any = None
        self.up: Upstream | None = None
        self.pending = bytearray()
        self.parser: httptools.HttpRequestParser | None = None
        self.forwarded: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        if self.parser is not None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()
            return
        self.pending += data
        try:
            got = pull_preamble(self.pending)
        except PreambleError:
            self.transport.write(push_status(Status.BAD_PREAMBLE))
            self.transport.close()
            return
        if got is None:
            return
        pre, used = got
        rest, self.pending = bytes(self.pending[used:]), bytearray()
        self.forwarded = [(b"X-Forwarded-For", str(pre.src).encode())]
        self.transport.pause_reading()
        asyncio.get_running_loop().create_task(self._open(str(pre.dst), pre.dst_port, rest, pre.dst.is_loopback))

    async def _open(self, host: str, port: int, rest: bytes, allowed: bool) -> None:
        if not allowed:
            self.transport.write(push_status(Status.FORBIDDEN))
            self.transport.close()
            return
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: Upstream(self), host, port)
        except OSError:
            self.transport.write(push_status(Status.NOT_LISTENING))
            self.transport.close()
            return
        self.up = up
        self.transport.write(push_status(Status.OK))
        self.parser = httptools.HttpRequestParser(self)
        self.transport.resume_reading()
        if rest:
            self.data_received(rest)

    # -- the request, as httptools hands it over ------------------------------------------------------

    def on_headers_complete(self) -> None:
        assert self.parser is not None and self.up is not None
        start = self.parser.get_method() + b" " + self.url + b" HTTP/1.1"
        data, self.chunked = reframe(start, self.headers, self.forwarded)
        self.up.transport.write(data)

    def on_body(self, body: bytes) -> None:
        assert self.up is not None
        self.up.transport.write(chunk(body) if self.chunked else body)

    def on_message_complete(self) -> None:
        if self.chunked and self.up is not None:
            self.up.transport.write(LAST_CHUNK)

    # -- flow control and ends ------------------------------------------------------------------------

    def pause_writing(self) -> None:
        if self.up is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None:
            self.up.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.transport.close()


class Upstream(asyncio.Protocol, _Message):
    """The app's connection: responses parsed and written back on the link."""

    def __init__(self, down: Downstream) -> None:
        _Message.__init__(self)
        self.down = down
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_headers_complete(self) -> None:
        start = b"HTTP/1.1 %d %s" % (self.parser.get_status_code(), self.reason)
        data, self.chunked = reframe(start, self.headers, [])
        self.down.transport.write(data)

    def on_body(self, body: bytes) -> None:
        self.down.transport.write(chunk(body) if self.chunked else body)

    def on_message_complete(self) -> None:
        if self.chunked:
            self.down.transport.write(LAST_CHUNK)

    def pause_writing(self) -> None:
        self.down.transport.pause_reading()

    def resume_writing(self) -> None:
        self.down.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.transport.close()  # after what is buffered has been written


def server_context(certs: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(certs / "forwarder.crt"), str(certs / "forwarder.key"))
    ctx.load_verify_locations(cafile=str(certs / "ca.crt"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def serve(certs: Path, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Downstream, "127.0.0.1", port, ssl=server_context(certs), backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--certs", type=Path, required=True, help="holds forwarder.crt, forwarder.key and ca.crt")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    uvloop.run(serve(args.certs, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
