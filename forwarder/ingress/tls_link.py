"""The gateway link's TLS, driven over memory BIOs so that we, not OpenSSL, decide what is read.

Until the data plane takes over, the socket is read one TLS record at a time (5-byte header, then
exactly its body). Nothing is ever buffered inside the TLS library when the handshake and preamble
phase ends, and we know exactly how many records were consumed and produced under the application
traffic keys: the record sequence numbers a kernel TLS socket must start from.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from sbxnet.errors import RemoteProtocolError

RECORD_HEADER_LEN = 5
# TLS 1.3 ciphertext limit: 2^14 + 256 (RFC 8446 5.2).
MAX_RECORD_BODY = 16384 + 256


class LinkClosed(RemoteProtocolError):
    """The peer closed or reset the TCP connection."""


class NotTls(RemoteProtocolError):
    """The connection's first bytes cannot begin a TLS handshake record; ``first`` holds them (at most 5)."""

    def __init__(self, first: bytes) -> None:
        super().__init__("not_tls", f"first bytes {first.hex()}")
        self.first = first


def can_start_tls(prefix: bytes) -> bool:
    """Whether ``prefix`` (the first bytes of a connection, any length) can begin a TLS handshake record:
    content type 22 (handshake), then a legacy record version 3.x (0x0301 or 0x0303 in practice; RFC 8446
    5.1). Clear text on the TLS port (a bare PROXY v2 header, an HTTP request) fails at its first byte,
    so it is refused at once instead of being taken as a record header and waited on."""
    if len(prefix) > 0 and prefix[0] != 0x16:
        return False
    if len(prefix) > 1 and prefix[1] != 0x03:
        return False
    return not (len(prefix) > 2 and prefix[2] & 0xF0)


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise LinkClosed("eof", f"after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class TlsLink:
    """A server-side TLS session over ``sock`` (non-blocking). Not thread-safe; one task drives it.
    Slotted: a tunnel holds one for its whole life."""

    __slots__ = ("_first", "_loop", "incoming", "outgoing", "rx_app_records", "sock", "ssl", "tx_app_records")

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        self.sock = sock
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.ssl = ctx.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.rx_app_records = 0  # application-key records fed to OpenSSL after the handshake
        self.tx_app_records = 0  # application-key records OpenSSL produced after the handshake
        self._loop = asyncio.get_running_loop()
        self._first = True  # no byte read from the socket yet

    async def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            await self._loop.sock_sendall(self.sock, data)

    async def _first_header(self) -> bytes:
        """The connection's first record header, judged byte by byte as it arrives (``can_start_tls``)."""
        self._first = False
        header = b""
        while len(header) < RECORD_HEADER_LEN:
            chunk = await self._loop.sock_recv(self.sock, RECORD_HEADER_LEN - len(header))
            if not chunk:
                raise LinkClosed("eof", f"after {len(header)} of {RECORD_HEADER_LEN} bytes")
            header += chunk
            if not can_start_tls(header):
                raise NotTls(header)
        return header

    async def read_record(self) -> bytes:
        """Exactly one TLS record (header + body) from the socket; the connection's first must start
        like a TLS handshake record (else :class:`NotTls`)."""
        if self._first:
            header = await self._first_header()
        else:
            header = await recv_exact(self._loop, self.sock, RECORD_HEADER_LEN)
        length = int.from_bytes(header[3:5], "big")
        if length > MAX_RECORD_BODY:
            raise RemoteProtocolError("record_too_long", f"{length} bytes")
        return header + await recv_exact(self._loop, self.sock, length)

    async def handshake(self) -> None:
        """Complete the handshake; on failure send OpenSSL's alert before raising."""
        while True:
            try:
                self.ssl.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                self.incoming.write(await self.read_record())
                continue
            except ssl.SSLError:
                try:
                    await asyncio.wait_for(self._flush(), 0.5)
                except (OSError, TimeoutError):
                    pass
                raise
            await self._flush()
            return

    async def read_app_record(self) -> bytes:
        """Plaintext of the next application record (b"" on close_notify), one socket record at a time.

        Post-handshake handshake messages are not expected from a gateway; OpenSSL consumes them
        inside ``read`` and we count the record, so the count stays the record sequence number.
        """
        while True:
            record = await self.read_record()
            self.incoming.write(record)
            self.rx_app_records += 1
            try:
                data = self.ssl.read(MAX_RECORD_BODY)
            except ssl.SSLWantReadError:
                continue  # a record with no application data (e.g. a post-handshake message)
            except ssl.SSLZeroReturnError:
                return b""
            if data:
                return data

    async def write(self, data: bytes) -> None:
        before = self.outgoing.pending
        self.ssl.write(data)
        # Each write of up to 16 KiB is one record; larger writes are split by OpenSSL.
        self.tx_app_records += max(1, -(-len(data) // 16384)) if self.outgoing.pending > before else 0
        await self._flush()

    def drop_tls(self) -> None:
        """Free the TLS session now that the kernel carries it (kTLS plane, after the key install): the
        SSL object with its session and the peer's certificate, and both memory BIOs, instead of holding
        them until the connection ends. Nothing is sent: only we ever read the outgoing BIO. The link is
        a bare socket from then on; using its TLS raises AttributeError."""
        del self.ssl, self.incoming, self.outgoing

    def peercert(self) -> dict[str, object] | None:
        cert = self.ssl.getpeercert()
        return dict(cert) if cert else None
