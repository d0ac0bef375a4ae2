"""A TLS stream over memory BIOs on a non-blocking socket, for asyncio (default loop and uvloop).

asyncio's own SSL transports cannot half-close (``can_write_eof()`` is False), and the gateway must
forward a half-close as a half-close: ``write_eof`` sends close_notify, then a TCP FIN, and reading
goes on. So OpenSSL only ever sees memory BIOs, and we move the ciphertext with ``recv_into`` /
``sock_sendall``.

One task may read while another writes. Ciphertext leaves the outgoing BIO in order: whoever holds
the send lock takes everything OpenSSL has produced so far and sends it before letting go, so bytes
taken later were produced later. ``read`` decrypts every complete record it is given into a buffer of
its own, so the incoming BIO never holds a whole record between calls: ``write_eof`` (OpenSSL's
``SSL_shutdown``, which tries to read the peer's close_notify) then finds nothing it could swallow.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
from collections import deque
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

_T = TypeVar("_T")

RECV_SIZE = 256 * 1024
MAX_PLAIN_RECORD = 16384  # a TLS record's plaintext at most (RFC 8446 5.1): one SSL_read's worth
# Plaintext handed to OpenSSL per write: bounds the ciphertext held in the outgoing BIO.
WRITE_CHUNK = 256 * 1024
# How long a failed handshake waits to deliver OpenSSL's alert before closing.
ALERT_GRACE = 0.5

Eof = Literal["close_notify", "tcp_eof"]


_local = threading.local()


def _scratch() -> memoryview:
    """This thread's receive buffer (each event loop runs in one thread; ``recv_into`` lets go of the GIL)."""
    try:
        return _local.scratch
    except AttributeError:
        _local.scratch = memoryview(bytearray(RECV_SIZE))
        return _local.scratch


class ReadInterrupted(Exception):
    """A ``read`` waiting for the socket was woken by ``interrupt_read``; it took nothing."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class TlsStream:
    """One TLS connection. ``read`` and ``write`` may run concurrently from two tasks; each of them
    (and ``write_eof``) from one task at a time."""

    ssl_object: ssl.SSLObject
    sock: socket.socket
    eof: Eof | None

    def __init__(
        self, sock: socket.socket, ssl_object: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO
    ) -> None:
        self.sock = sock
        self.ssl_object = ssl_object
        self.eof = None
        self._incoming = incoming
        self._outgoing = outgoing
        self._loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        # Decrypted records not yet read, in order; a partly read one is cut, never copied into a
        # growing buffer (a large body would be copied over and over).
        self._plain: deque[bytes] = deque()
        self._buffered = 0
        self._rx_error: BaseException | None = None
        self._write_closed = False
        self._closed = False
        self._inflight: set[asyncio.Task[Any]] = set()
        self._read_waiter: asyncio.Future[None] | None = None  # what ``_readable`` awaits, for ``close``
        self._watching = False  # the loop watches the socket for reading (``_readable``)
        self._idle_wakes = 0  # wakes in a row with no reader waiting
        self._interrupted = False  # ``interrupt_read`` woke the waiting read

    # -- handshake ------------------------------------------------------------------------------

    @classmethod
    async def accept(cls, sock: socket.socket, ctx: ssl.SSLContext, *, timeout: float) -> TlsStream:
        """Server-side handshake on ``sock``. Raises ssl.SSLError, OSError or TimeoutError (after
        ``timeout`` seconds), and closes ``sock`` on any failure."""
        return await cls._handshake(sock, ctx, server_side=True, server_hostname=None, timeout=timeout)

    @classmethod
    async def connect(
        cls, sock: socket.socket, ctx: ssl.SSLContext, *, server_hostname: str | None, timeout: float
    ) -> TlsStream:
        """Client-side handshake on ``sock`` (already TCP-connected). Errors as for ``accept``."""
        return await cls._handshake(sock, ctx, server_side=False, server_hostname=server_hostname, timeout=timeout)

    @classmethod
    async def _handshake(
        cls,
        sock: socket.socket,
        ctx: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None,
        timeout: float,
    ) -> TlsStream:
        try:
            sock.setblocking(False)
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            obj = ctx.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=server_hostname)
            stream = cls(sock, obj, incoming, outgoing)
        except BaseException:
            sock.close()
            raise
        try:
            async with asyncio.timeout(timeout):
                await stream._do_handshake()
        except BaseException:
            stream.close()
            raise
        return stream

    async def _do_handshake(self) -> None:
        while True:
            try:
                self.ssl_object.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionAbortedError("eof during the TLS handshake") from None
            except ssl.SSLError:
                # Best effort: let the peer see OpenSSL's alert.
                try:
                    async with asyncio.timeout(ALERT_GRACE):
                        await self._flush()
                except (OSError, TimeoutError):
                    pass
                raise
        # The client's Finished; on a TLS 1.3 server, the session tickets.
        await self._flush()
        # Application data that came in the same read as the peer's last handshake message (a client's
        # first request right behind its Finished) is in the incoming BIO already: decrypt it now, or
        # read() would wait on the socket for bytes the peer has already sent.
        self._drain()

    # -- reading --------------------------------------------------------------------------------

    async def read(self, n: int = 65536) -> bytes:
        """Up to ``n`` bytes of plaintext, as soon as any is available; b"" at end of stream (then
        ``eof`` says whether the peer sent close_notify or only a TCP FIN). Post-handshake messages
        (session tickets, key updates) are consumed here, and whatever OpenSSL answers is sent.
        A reset or a TLS error (the peer's alert, a bad record) raises OSError / ssl.SSLError."""
        while True:
            if self._buffered:
                return self._take(n)
            if self._rx_error is not None:
                raise self._rx_error
            if self.eof is not None:
                return b""
            if self._incoming.pending:
                self._drain()
                if self._buffered or self.eof is not None or self._rx_error is not None:
                    continue
            if not await self._fill():
                self.eof = "tcp_eof"
                self._incoming.write_eof()
                continue
            self._drain()
            if self._outgoing.pending:
                await self._flush()

    def _take(self, n: int) -> bytes:
        """Up to ``n`` buffered bytes: a whole record as it is when it fits, else one join."""
        plain = self._plain
        first = plain[0]
        if len(first) >= n or len(plain) == 1:
            if len(first) > n:
                plain[0] = first[n:]
                first = first[:n]
            else:
                plain.popleft()
            self._buffered -= len(first)
            return first
        parts = []
        size = 0
        while plain and size + len(plain[0]) <= n:
            chunk = plain.popleft()
            parts.append(chunk)
            size += len(chunk)
        if plain and size < n:
            chunk = plain[0]
            parts.append(chunk[: n - size])
            plain[0] = chunk[n - size :]
            size = n
        self._buffered -= size
        return b"".join(parts)

    def usable_idle(self) -> bool:
        """For a stream kept open with nothing sent on it yet (the gateway's warm pool): take, without
        waiting, whatever the peer sent meanwhile (session tickets are consumed; anything OpenSSL answers
        goes out with the next write) and say whether the stream is still fit to use: open, no end of
        stream, no error, and no plaintext (a peer that speaks before being asked is not one to use).
        Not while a ``read`` is waiting: the two would race for the socket's bytes."""
        if self._closed or self.eof is not None or self._rx_error is not None:
            return False
        scratch = _scratch()
        while True:
            try:
                got = self.sock.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self._rx_error = e
                return False
            if not got:
                self.eof = "tcp_eof"
                self._incoming.write_eof()
                break
            self._incoming.write(scratch[:got])
        self._drain()
        return self.eof is None and self._rx_error is None and not self._buffered

    def _drain(self) -> None:
        """Decrypt every complete record in the incoming BIO onto ``_plain``."""
        if self.eof is not None or self._rx_error is not None:
            return
        incoming, obj = self._incoming, self.ssl_object
        while True:
            if not incoming.pending and not obj.pending():
                # Nothing left to decrypt: SSL_read could only say so by raising SSLWantReadError, which
                # cost an exception per call (twice per small request on each side of the gateway).
                return
            try:
                chunk = obj.read(MAX_PLAIN_RECORD)
            except ssl.SSLWantReadError:
                return
            except ssl.SSLZeroReturnError:
                self.eof = "close_notify"
                return
            except ssl.SSLError as e:
                self._rx_error = e
                return
            if not chunk:
                self.eof = "close_notify"
                return
            self._plain.append(chunk)
            self._buffered += len(chunk)

    # -- writing --------------------------------------------------------------------------------

    async def write(self, data: bytes | memoryview) -> None:
        """Encrypt and send all of ``data``; returns when the socket has taken it. BrokenPipeError
        after ``write_eof``; OSError if the peer reset."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_CHUNK):
            if self._write_closed:
                raise BrokenPipeError("write after write_eof")
            self.ssl_object.write(view[start : start + WRITE_CHUNK])
            await self._flush()

    async def write_eof(self) -> None:
        """Send close_notify, then shut the socket down for writing. Reading still works after it.
        A second call does nothing."""
        if self._write_closed:
            return
        self._write_closed = True
        # Records already in the incoming BIO go to _plain first: SSL_shutdown would discard them.
        self._drain()
        try:
            self.ssl_object.unwrap()
        except ssl.SSLWantReadError:
            pass  # close_notify sent; the peer's has not come yet
        async with self._send_lock:
            await self._send_pending()
            self.sock.shutdown(socket.SHUT_WR)

    async def _flush(self) -> None:
        async with self._send_lock:
            await self._send_pending()

    async def _send_pending(self) -> None:
        data = self._outgoing.read()
        if not data:
            return
        try:
            n = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        if n < len(data):
            await self._wait(self._loop.sock_sendall(self.sock, memoryview(data)[n:]))

    async def _fill(self) -> int:
        """Move what the socket has (waiting until it has something) into the incoming BIO; 0 at end of
        stream. Read into a scratch buffer and copied into the BIO at once, with no await between, so one
        buffer per thread serves every stream."""
        scratch = _scratch()
        while True:
            try:
                got = self.sock.recv_into(scratch)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if got:
                self._incoming.write(scratch[:got])
            return got

    async def _readable(self) -> None:
        """Wait until the socket is readable. The future is awaited here, not through ``_wait``'s task (a
        task per wait cost an event-loop turn and the task's set-up on every read that waited); ``close``
        ends the wait through ``_read_waiter``. One reader at a time (``read`` and the handshake).

        The socket stays watched after a wait (``_on_readable``): a keep-alive exchange waits on each
        socket once per request, and watching it afresh each time cost a poll handle made and closed and
        an epoll_ctl or two per wait. It is let go when it turns readable with no reader waiting (so an
        unread socket never wakes the loop over and over) and at ``close``."""
        if self._closed:
            raise ConnectionAbortedError("the TLS stream is closed")
        fut: asyncio.Future[None] = self._loop.create_future()
        if not self._watching:
            self._loop.add_reader(self.sock.fileno(), self._on_readable)
            self._watching = True
        self._read_waiter = fut
        self._idle_wakes = 0
        try:
            await fut
        except BaseException:  # cancelled: an interrupt that came first is not left for the next read
            self._interrupted = False
            raise
        finally:
            self._read_waiter = None
        if self._closed:  # woken by ``close``, or closed after the socket turned readable
            raise ConnectionAbortedError("the TLS stream is closed")
        if self._interrupted:
            self._interrupted = False
            raise ReadInterrupted()

    def interrupt_read(self) -> bool:
        """Wake the ``read`` that is waiting for the socket: it raises ``ReadInterrupted``, having taken
        nothing (what comes later is there for the next read). False, doing nothing, when no read is
        waiting for the socket (none is under way, or it is about to take bytes that came): an owner that
        waits for the first of its peer's bytes or its own deadline (the gateway's idle keep-alive) ends
        the wait so, without a task and a timer per wait."""
        waiter = self._read_waiter
        if waiter is None or waiter.done():
            return False
        self._interrupted = True
        waiter.set_result(None)
        return True

    def _on_readable(self) -> None:
        waiter = self._read_waiter
        if waiter is not None:
            _wake(waiter)
            return  # woken already, its reader not yet run: it will read
        # A wake queued in the same loop turn as its reader's, run after the reader took the bytes, comes
        # once; a second in a row means bytes wait with nobody reading.
        self._idle_wakes += 1
        if self._idle_wakes > 1:
            self._watching = False
            self._loop.remove_reader(self.sock.fileno())

    async def _wait(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await a socket operation as a task that ``close`` can end: a pending sock_recv or
        sock_sendall would otherwise never finish once the socket is closed."""
        if self._closed:
            coro.close()
            raise ConnectionAbortedError("the TLS stream is closed")
        task = self._loop.create_task(coro)
        self._inflight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and task.cancelled() and (current is None or not current.cancelling()):
                raise ConnectionAbortedError("the TLS stream is closed") from None
            raise
        finally:
            self._inflight.discard(task)

    # -- closing --------------------------------------------------------------------------------

    def abort(self) -> None:
        """Close at once with a TCP reset (SO_LINGER 0)."""
        if not self._closed and self.sock.fileno() != -1:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        """Close the socket without close_notify. Pending ``read``/``write`` calls raise
        ConnectionAbortedError."""
        if self._closed:
            return
        self._closed = True
        if self.sock.fileno() != -1:
            # Unregister first: the cancelled operations must not unregister a reused fd later.
            self._loop.remove_reader(self.sock)
            self._watching = False
            self._loop.remove_writer(self.sock)
        for task in self._inflight:
            task.cancel()
        if self._read_waiter is not None:
            _wake(self._read_waiter)  # the reader finds the stream closed (no exception left unread if cancelled)
        self.sock.close()
