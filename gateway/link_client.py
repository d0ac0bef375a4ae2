"""A blocking client of the forwarder link (mutual TLS 1.3, preamble, status record, bytes).

Used by the demo and the tests; the gateway's asyncio upstream drives the same sans-I/O sequence
(``sbxnet.protocol.link.GatewaySequence``). It runs TLS over memory BIOs so that it can half-close
(close_notify, then FIN) and keep reading. Given ``pins``, it refuses a forwarder whose key is not
pinned (``certs.loader.check_pin``) before sending anything; without, it trusts the CA alone.
"""

from __future__ import annotations

import hashlib
import selectors
import socket
import ssl
import struct
import time
from collections.abc import Collection

from certs.loader import check_pin
from sbxnet.protocol.link import GatewaySequence
from sbxnet.protocol.status import Status


class LinkClient:
    """One connection to a forwarder. Not thread-safe."""

    def __init__(
        self,
        port: int,
        ctx: ssl.SSLContext,
        *,
        host: str = "127.0.0.1",
        timeout: float = 30,
        pins: Collection[str] | None = None,
    ) -> None:
        self.timeout = timeout
        self.pins = pins
        self.seq: GatewaySequence | None = None
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.inc, self.out, server_hostname="localhost")
        self.plain = bytearray()
        self.eof = False

    def _flush(self) -> None:
        data = self.out.read()
        if data:
            self.sock.sendall(data)

    def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionAbortedError("eof during handshake") from None
                self.inc.write(data)
        self._flush()
        if self.pins is not None:
            check_pin(self.tls, self.pins)

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def _decrypt_all(self) -> None:
        while True:
            try:
                chunk = self.tls.read(1 << 16)
            except ssl.SSLWantReadError:
                return
            except ssl.SSLZeroReturnError:
                self.eof = True
                return
            if not chunk:
                self.eof = True
                return
            self.plain += chunk

    def fill(self) -> bool:
        """One socket read, every complete record decrypted. False at end of stream."""
        data = self.sock.recv(1 << 18)
        if not data:
            self.eof = True
            return False
        self.inc.write(data)
        self._decrypt_all()
        self._flush()
        return not self.eof

    def recv_exact(self, n: int) -> bytes:
        while len(self.plain) < n:
            if self.eof:
                raise EOFError(f"eof after {len(self.plain)} of {n} bytes")
            self.fill()
        out = bytes(self.plain[:n])
        del self.plain[:n]
        return out

    def recv_all(self) -> bytes:
        while not self.eof and self.fill():
            pass
        out = bytes(self.plain)
        self.plain.clear()
        return out

    def open(self, preamble: bytes) -> Status:
        """Handshake, send the preamble, return the forwarder's status."""
        self.handshake()
        self.send_preamble(preamble)
        return self.open_status()

    def send_preamble(self, preamble: bytes) -> None:
        """Send ``preamble`` as the first application data (as given: tests send broken ones)."""
        self.seq = GatewaySequence(preamble, now=time.monotonic(), timeout=self.timeout)
        self.send(self.seq.start())

    def open_status(self) -> Status:
        """Read the forwarder's status; bytes that followed it stay for ``recv_*``. EOFError if the
        link ends first."""
        assert self.seq is not None, "send_preamble first"
        while True:
            if self.plain:
                data = bytes(self.plain)
                self.plain.clear()
                answer = self.seq.receive_data(data, time.monotonic())
                if answer is not None:
                    self.plain += answer.leftover
                    return answer.status
            if self.eof:
                raise EOFError("eof before the status record")
            self.fill()

    def close_write(self) -> None:
        try:
            self.tls.unwrap()
        except ssl.SSLWantReadError:
            pass
        self._flush()
        self.sock.shutdown(socket.SHUT_WR)

    def abort(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()

    def exchange(self, payload: bytes, *, chunk: int = 1 << 16) -> bytes:
        """Send ``payload`` then close_notify+FIN while receiving until the far end's end of stream."""
        self.sock.setblocking(False)
        sel = selectors.DefaultSelector()
        pending = b""
        offset = 0
        wrote_eof = False
        received = hashlib.sha256()
        received_len = 0
        try:
            while True:
                if not pending and offset < len(payload):
                    self.tls.write(payload[offset : offset + chunk])
                    offset += chunk
                    pending = self.out.read()
                if not pending and offset >= len(payload) and not wrote_eof:
                    try:
                        self.tls.unwrap()
                    except ssl.SSLWantReadError:
                        pass
                    pending = self.out.read()
                    wrote_eof = True
                if wrote_eof and not pending and self.sock.fileno() >= 0:
                    try:
                        self.sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
                sel.register(self.sock, events)
                ready = sel.select(timeout=30)
                sel.unregister(self.sock)
                if not ready:
                    raise TimeoutError("exchange stalled for 30 s")
                for _, mask in ready:
                    if mask & selectors.EVENT_WRITE and pending:
                        try:
                            n = self.sock.send(pending)
                        except BlockingIOError:
                            n = 0
                        pending = pending[n:]
                    if mask & selectors.EVENT_READ:
                        try:
                            data = self.sock.recv(1 << 18)
                        except BlockingIOError:
                            continue
                        if not data:
                            self.eof = True
                        else:
                            self.inc.write(data)
                            self._decrypt_all()
                        received.update(self.plain)
                        received_len += len(self.plain)
                        self.plain.clear()
                if self.eof and wrote_eof and not pending:
                    break
        finally:
            sel.close()
            self.sock.setblocking(True)
        self.received_len = received_len
        return received.digest()
