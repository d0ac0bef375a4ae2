"""The ``userspace`` data plane: TLS in user space over the link's memory BIOs, bytes copied.

It is the benchmark's middle stage and the path for kernels without TLS, chosen explicitly. Each
direction is one task. Sockets are tried before they are waited on (a loop round trip per read costs
more than the read), reads land in one buffer per loop thread and are copied onward before any await,
and a send that the peer cannot take yet is waited on before the next read: that is the back-pressure.
Decrypted bytes go to a buffer borrowed from the thread's pool (``memory.py``) while they move and given
back before the next wait, so an idle tunnel holds no plaintext buffer; OpenSSL releases its own record
buffers between records (CPython sets SSL_MODE_RELEASE_BUFFERS on every context).
From the gateway, close_notify ends that direction (FIN to the sandbox, the other direction goes on);
a TCP FIN without close_notify before it resets both sides, as a reset does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import cast

from forwarder.ingress.metering import ConnMeter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.planes.interface import Handoff, Outcome, abort
from forwarder.ingress.planes.memory import thread_pool
from forwarder.ingress.tls_link import MAX_RECORD_BODY

RECV_SIZE = 1024 * 1024  # one socket read, into a buffer lent while its bytes move
# The most that enters a memory BIO at once, either way. A BIO's buffer grows to its largest write and is
# kept for the session (OpenSSL never shrinks it), so a tunnel that once moved a burst would otherwise keep
# a whole read's worth in each direction's BIO for the rest of its life (1 MiB reads: 1.5 MiB a tunnel).
FEED_SIZE = 64 * 1024
# Decrypted per delivery to the sandbox, gathered across a read's slices: one send per 256 KiB, not per
# slice (a send per 64 KiB cost a third more CPU per byte: docs/benchmarks.md, "Forwarder hop").
PLAINTEXT_SIZE = 256 * 1024
RAW_KEEP = 4  # given-back buffers each pool of the loop thread keeps for the next burst
PLAIN_KEEP = 8

async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: memoryview) -> None:
    while data:
        try:
            n = sock.send(data)
        except BlockingIOError:
            await _ready(loop, sock, write=True)
            continue
        data = data[n:]


async def _finish(*tasks: asyncio.Task[None]) -> None:
    """Cancel ``tasks`` and wait for their ends, each exception retrieved (the outcome is judged before).

    ``asyncio.wait``, not ``gather``: a task woken by a gathering future (a ``Future`` subclass) looks up
    its ``result`` under a name made afresh each time, and CPython's method cache keeps such names (the
    last in each of its 4,096 slots). After 2,000 tunnels ended that way, hundreds of these 64-byte
    strings were left all over the heap the tunnels had filled, each keeping a 1 MiB arena of Python's
    allocator from going back to the kernel (measured: 9 MiB freed once the cache was cleared)."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()


class _Drained(asyncio.Event):
    """Set while the incoming BIO holds no complete record; ``waiting`` once close_notify waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = False
        self.set()


class _Reset(Exception):
    """One side broke: ``end`` is ``reset`` (an error on its socket) or ``fin`` (the gateway's TCP stream
    ended with no close_notify before it)."""

    def __init__(self, side: str, end: str = "reset") -> None:
        self.side = side
        self.end = end


class _TlsFailure(Exception):
    pass


class UserspacePlane:
    name = "userspace"

    def __init__(self, *, metrics: ForwarderMetrics | None = None) -> None:
        self._metrics = metrics

    @staticmethod
    def on_accept(sock: socket.socket) -> None:
        pass  # nothing to prepare: TLS stays in user space

    async def run(self, h: Handoff) -> Outcome:
        drained = _Drained()
        up = asyncio.create_task(self._gateway_to_sandbox(h, drained), name="up")
        down = asyncio.create_task(self._sandbox_to_gateway(h, drained), name="down")
        outcome = Outcome.CLOSED
        try:
            done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if pending and all(task.exception() is None for task in done):
                # One direction ended in order; the other may keep going for close_timeout.
                _, pending = await asyncio.wait(pending, timeout=h.close_timeout)
                if pending:
                    outcome = Outcome.CLOSE_TIMEOUT
            for task in (up, down):
                if task.done() and (exc := task.exception()) is not None:
                    outcome = self._classify(exc)
                    self._count_truncation(exc, up)
                    break
        except asyncio.CancelledError:
            outcome = Outcome.DRAINED
            raise
        finally:
            await _finish(up, down)
            self._close(h, outcome)
        return outcome

    def _count_truncation(self, exc: BaseException, up: asyncio.Task[None]) -> None:
        """A gateway side that broke before its close_notify ended the upload (``up`` returns only after
        it): the stream was cut short, and the sandbox is reset."""
        if not isinstance(exc, _Reset) or exc.side != "gateway" or self._metrics is None:
            return
        if up.done() and not up.cancelled() and up.exception() is None:
            return  # close_notify came first: only the other direction was cut
        self._metrics.truncated.labels(self.name, exc.end).inc()

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

    async def _gateway_to_sandbox(self, h: Handoff, drained: _Drained) -> None:
        loop = asyncio.get_running_loop()
        sock, up, meter = h.link.sock, h.upstream, h.meter
        if h.leftover:
            await self._deliver(loop, up, memoryview(h.leftover), meter)
        raws = thread_pool(RECV_SIZE, RAW_KEEP)
        plains = thread_pool(PLAINTEXT_SIZE + MAX_RECORD_BODY, PLAIN_KEEP)
        raw: memoryview | None = None
        plain: memoryview | None = None
        try:
            while True:
                if raw is None:
                    raw = raws.take()
                try:
                    got = sock.recv_into(raw)
                except BlockingIOError:
                    # Idle until the socket is readable again: hold no buffer meanwhile.
                    raws.give(raw)
                    raw = None
                    if plain is not None:
                        plains.give(plain)
                        plain = None
                    await _ready(loop, sock, write=False)
                    continue
                except OSError as e:
                    raise _Reset("gateway") from e
                if not got:
                    # TCP FIN with no close_notify before it (that ends the loop below): a cut, or an
                    # attacker's truncation, not an orderly end. Both sides are reset, as for a reset.
                    raise _Reset("gateway", "fin")
                if plain is None:
                    plain = plains.take()
                eof = False
                n = 0  # decrypted into ``plain``, not delivered yet
                for off in range(0, got, FEED_SIZE):
                    # A slice at a time: the BIO's buffer grows to the largest write and never shrinks.
                    h.link.incoming.write(raw[off : min(got, off + FEED_SIZE)])
                    drained.clear()
                    n, eof = await self._decrypt_and_deliver(loop, h, drained, plain, n,
                                                             flush=off + FEED_SIZE >= got)
                    if eof:
                        break
                if eof:
                    break
        finally:
            if raw is not None:
                raws.give(raw)
            if plain is not None:
                plains.give(plain)
        drained.set()
        with contextlib.suppress(OSError):
            up.shutdown(socket.SHUT_WR)

    async def _decrypt_and_deliver(
        self, loop: asyncio.AbstractEventLoop, h: Handoff, drained: _Drained, plain: memoryview, n: int,
        *, flush: bool,
    ) -> tuple[int, bool]:
        """Decrypt every complete record in the incoming BIO after the ``n`` bytes already in ``plain``,
        delivering whenever ``PLAINTEXT_SIZE`` is reached, and the rest when ``flush`` (the read's last
        slice) or at close_notify. Returns what is left undelivered and whether close_notify came."""
        tls = h.link.ssl
        eof = False
        while True:
            while n < PLAINTEXT_SIZE:
                try:
                    k = cast(int, tls.read(len(plain) - n, plain[n:]))  # with a buffer: a count
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
            full = n >= PLAINTEXT_SIZE
            if not full:
                drained.set()  # no complete record left in the BIO
                if drained.waiting:
                    await asyncio.sleep(0)  # let the waiting close_notify go out now
            if n and (full or flush or eof):
                await self._deliver(loop, h.upstream, plain[:n], h.meter)
                n = 0
            if drained.is_set() or eof:
                return n, eof

    async def _sandbox_to_gateway(self, h: Handoff, drained: _Drained) -> None:
        loop = asyncio.get_running_loop()
        sock, up, tls, meter = h.link.sock, h.upstream, h.link.ssl, h.meter
        raws = thread_pool(RECV_SIZE, RAW_KEEP)
        raw: memoryview | None = None
        try:
            while True:
                if raw is None:
                    raw = raws.take()
                try:
                    n = up.recv_into(raw)
                except BlockingIOError:
                    raws.give(raw)
                    raw = None
                    await _ready(loop, up, write=False)
                    continue
                except OSError as e:
                    raise _Reset("sandbox") from e
                if n == 0:
                    break
                for off in range(0, n, FEED_SIZE):
                    # Encrypted a slice at a time, as the BIO's buffer keeps the size of its largest write.
                    tls.write(raw[off : min(n, off + FEED_SIZE)])
                    try:
                        await _send_all(loop, sock, memoryview(h.link.outgoing.read()))
                    except OSError as e:
                        raise _Reset("gateway") from e
                meter.down += n
                meter.last_activity = time.monotonic()
        finally:
            if raw is not None:
                raws.give(raw)
        # End of stream from the sandbox: close_notify, then FIN. unwrap() calls SSL_shutdown twice,
        # and the second call reads the BIO and discards any complete application record it finds
        # there (OpenSSL 3 then fails the session with APPLICATION_DATA_AFTER_CLOSE_NOTIFY); so wait until
        # the other direction has decrypted every complete record.
        drained.waiting = True
        while not drained.is_set():
            await drained.wait()  # re-checked: the other task may have fed the BIO again before we resumed
        with contextlib.suppress(ssl.SSLError):
            tls.unwrap()
        try:
            await _send_all(loop, sock, memoryview(h.link.outgoing.read()))
            sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            raise _Reset("gateway") from e

    @staticmethod
    async def _deliver(loop: asyncio.AbstractEventLoop, up: socket.socket, data: memoryview, meter: ConnMeter) -> None:
        try:
            await _send_all(loop, up, data)
        except OSError as e:
            raise _Reset("sandbox") from e
        meter.up += len(data)
        meter.last_activity = time.monotonic()
