"""The ``userspace`` data plane: TLS in user space over the link's memory BIOs, bytes copied.

It is the benchmark's middle stage and the path for kernels without TLS, chosen explicitly. Each
direction is one task; ``sock_sendall`` finishing before the next read is the back-pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from typing import cast

from forwarder.metering import ConnMeter
from forwarder.planes import Handoff, Outcome, abort
from forwarder.tls_link import MAX_RECORD_BODY

CHUNK = 256 * 1024


_per_thread = threading.local()


def _receive_buffer() -> bytearray:
    """One receive buffer per event-loop thread, shared by its connections (never held across an await)."""
    buf: bytearray | None = getattr(_per_thread, "buf", None)
    if buf is None:
        buf = _per_thread.buf = bytearray(CHUNK)
    return buf


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


class _Reset(Exception):
    def __init__(self, side: str) -> None:
        self.side = side


class _TlsFailure(Exception):
    pass


class UserspacePlane:
    name = "userspace"

    async def run(self, h: Handoff) -> Outcome:
        up = asyncio.create_task(self._gateway_to_sandbox(h), name="up")
        down = asyncio.create_task(self._sandbox_to_gateway(h), name="down")
        outcome = Outcome.CLOSED
        try:
            done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            first = done.pop()
            if first.exception() is None and pending:
                # One direction ended in order; the other may keep going for close_timeout.
                done2, pending = await asyncio.wait(pending, timeout=h.close_timeout)
                if pending:
                    outcome = Outcome.CLOSE_TIMEOUT
                first = done2.pop() if done2 else first
            for task in (up, down):
                if task.done() and task.exception() is not None:
                    outcome = self._classify(task.exception())
                    break
        except asyncio.CancelledError:
            outcome = Outcome.DRAINED
            raise
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            self._close(h, outcome)
        return outcome

    @staticmethod
    def _classify(exc: BaseException | None) -> Outcome:
        if isinstance(exc, _Reset):
            return Outcome.RESET_GATEWAY if exc.side == "gateway" else Outcome.RESET_SANDBOX
        if isinstance(exc, _TlsFailure):
            return Outcome.TLS_ERROR
        return Outcome.INTERNAL

    @staticmethod
    def _close(h: Handoff, outcome: Outcome) -> None:
        if outcome is Outcome.CLOSED:
            h.link.sock.close()
            h.upstream.close()
        else:
            # Anything but an orderly end on both sides is passed on as a reset, never as a clean EOF
            # that could make a truncated stream look complete.
            abort(h.link.sock)
            abort(h.upstream)

    async def _gateway_to_sandbox(self, h: Handoff) -> None:
        loop = asyncio.get_running_loop()
        sock, up, tls, meter = h.link.sock, h.upstream, h.link.ssl, h.meter
        if h.leftover:
            await self._send(up, memoryview(h.leftover), meter)
        # Room for the plaintext of one whole receive plus a record that was split across receives, so
        # every complete record is decrypted before the next await (the invariant unwrap() relies on).
        buf = bytearray(CHUNK + 2 * MAX_RECORD_BODY)
        view = memoryview(buf)
        rbuf = _receive_buffer()
        eof = False
        while not eof:
            try:
                # Try the socket first and wait only when it is empty: a loop round trip (and an epoll
                # add/remove) per read costs more than the read itself at these sizes.
                got = sock.recv_into(rbuf)
            except BlockingIOError:
                await _readable(loop, sock)
                continue
            except OSError as e:
                raise _Reset("gateway") from e
            if not got:
                break  # TCP FIN without close_notify: end of stream all the same
            # Copied into the BIO before any await: the receive buffer is shared by this thread's tasks.
            h.link.incoming.write(memoryview(rbuf)[:got])
            n = 0
            while True:
                try:
                    k = cast(int, tls.read(len(buf) - n, view[n:]))  # with a buffer, read() returns a count
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:
                    eof = True
                    break
                except ssl.SSLError as e:
                    raise _TlsFailure(e.reason or "tls") from e
                if k == 0:
                    eof = True
                    break
                n += k
            if n:
                await self._send(up, view[:n], meter)
        with contextlib.suppress(OSError):
            up.shutdown(socket.SHUT_WR)

    async def _sandbox_to_gateway(self, h: Handoff) -> None:
        loop = asyncio.get_running_loop()
        sock, up, tls, meter = h.link.sock, h.upstream, h.link.ssl, h.meter
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            try:
                n = up.recv_into(buf)
            except BlockingIOError:
                await _readable(loop, up)
                continue
            except OSError as e:
                raise _Reset("sandbox") from e
            if n == 0:
                break
            tls.write(view[:n])
            try:
                await loop.sock_sendall(sock, h.link.outgoing.read())
            except OSError as e:
                raise _Reset("gateway") from e
            meter.down += n
            meter.last_activity = time.monotonic()
        # End of stream from the sandbox: close_notify, then FIN. The second SSL_shutdown inside
        # unwrap() finds at most a partial record in the incoming BIO (the other task drains every
        # complete record before it awaits), so no tenant data is discarded.
        with contextlib.suppress(ssl.SSLError):
            tls.unwrap()
        try:
            await loop.sock_sendall(sock, h.link.outgoing.read())
            sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise _Reset("gateway") from e

    @staticmethod
    async def _send(up: socket.socket, data: memoryview, meter: ConnMeter) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(up, data)
        except OSError as e:
            raise _Reset("sandbox") from e
        meter.up += len(data)
        meter.last_activity = time.monotonic()
