"""The ``userspace`` data plane: TLS in user space over the link's memory BIOs, bytes copied.

It is the benchmark's middle stage and the path for kernels without TLS, chosen explicitly. Each
direction is a task while its bytes move; once its socket has had nothing to read for ``PARK_AFTER_S``
it parks (``_Tunnel``): the task ends, the socket waits in the loop's one epoll set for parked sockets
(``userspace_parking.py``), and a fresh task starts when bytes come, so an idle tunnel holds no task,
coroutine, future or loop reader of its own. Nothing waits for its end either: ``UserspacePlane.start``
returns at once and the tunnel tells its owner how it ended when it does (the server counts and logs it
then), so the connection's own task ends at the handoff.
Sockets are tried before they are waited on (a loop round trip per read costs more than the read),
reads land in a buffer borrowed for the burst and are copied onward before any await, and a send that
the peer cannot take yet is waited on before the next read: that is the back-pressure.
Decrypted bytes go to a buffer borrowed from the thread's pool (``memory.py``) while they move and given
back before the next wait, so an idle tunnel holds no plaintext buffer; OpenSSL releases its own record
buffers between records (CPython sets SSL_MODE_RELEASE_BUFFERS on every context), and the memory BIOs'
buffers, which OpenSSL never shrinks, are given back once the handshake is over and whenever a direction
parks with its BIO grown past ``BIO_KEEP`` (``memory.release_bio_buffers``).
From the gateway, close_notify ends that direction (FIN to the sandbox, the other direction goes on);
a TCP FIN without close_notify before it resets both sides, as a reset does.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import Protocol, cast

from forwarder.ingress.metering import ConnMeter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.planes.interface import Handoff, Outcome, abort
from forwarder.ingress.planes.memory import release_bio_buffers, thread_pool
from forwarder.ingress.planes.userspace_parking import parking_lot
from forwarder.ingress.tls_link import MAX_RECORD_BODY, TlsLink

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
# A direction whose socket runs dry waits for it in its task for up to PARK_AFTER_S, and only then parks.
# During a transfer a socket runs dry over and over for moments; parking each time (the task ended, the
# socket in and out of the parking lot, a new task) and handing the BIO's buffer back each time (freed,
# grown again, its pages faulted in) cost 15-25% more CPU per byte (bench/forwarder_hop.py, 256 MiB on 1
# and 8 tunnels). An idle tunnel is parked half a second after its last byte.
PARK_AFTER_S = 0.5
# A direction that parks gives back its BIO's buffer once it has grown past this (a full record: 22 KiB; a
# 64 KiB slice: 87 KiB); the handshake's size is kept, so small exchanges do not free and grow it again.
BIO_KEEP = 4 * 1024

async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, _set_done, fut)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _readable_soon(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
    """True once ``sock`` is readable, False if it has not been for ``PARK_AFTER_S`` (the direction parks)."""
    fut: asyncio.Future[bool] = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _settle, fut, True)
    timer = loop.call_later(PARK_AFTER_S, _settle, fut, False)
    try:
        return await fut
    finally:
        timer.cancel()
        loop.remove_reader(fd)


def _settle(fut: asyncio.Future[bool], readable: bool) -> None:
    if not fut.done():
        fut.set_result(readable)


async def _send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: memoryview) -> None:
    while data:
        try:
            n = sock.send(data)
        except BlockingIOError:
            await _writable(loop, sock)
            continue
        data = data[n:]


class _Drained:
    """Set while the incoming BIO holds no complete record; ``waiting`` once close_notify waits on it.

    An ``asyncio.Event`` but for one waiter (the direction that sends close_notify) and with no deque
    of waiters, which alone cost more than half a KiB per tunnel."""

    __slots__ = ("_set", "_waiter", "waiting")

    def __init__(self) -> None:
        self._set = True
        self._waiter: asyncio.Future[None] | None = None
        self.waiting = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class _Reset(Exception):
    """One side broke: ``end`` is ``reset`` (an error on its socket) or ``fin`` (the gateway's TCP stream
    ended with no close_notify before it)."""

    def __init__(self, side: str, end: str = "reset") -> None:
        self.side = side
        self.end = end


class _TlsFailure(Exception):
    pass


_RUNNING = object()  # a direction's result while it has not ended


class _Sides(Protocol):
    """What the directions use of a tunnel (a ``Handoff``'s fields, which ``_Tunnel`` holds itself)."""

    link: TlsLink
    upstream: socket.socket
    leftover: bytes
    meter: ConnMeter


class TunnelOwner(Protocol):
    """Whom a tunnel started with :meth:`UserspacePlane.start` tells of its end."""

    def tunnel_ended(self, outcome: Outcome) -> None:
        """The tunnel has ended (both sockets closed, or reset): ``outcome`` says how. Called once."""


class _Tunnel:
    """One tunnel, from the handoff to its end, with no task or coroutine waiting for that end. A direction
    runs as a task while bytes move; when its socket has nothing to read the task returns False and the
    direction parks: its socket waits in the loop's parking lot (``userspace_parking.py``), which calls
    :meth:`readable` once it is, and a new task starts. A direction that ends (True: its orderly end done;
    or an exception) is recorded (``up_result``, ``down_result``) and the tunnel judged (:meth:`_judge`,
    a loop step later, as a task woken by that end would): an exception ends it at once, one orderly end
    gives the other direction ``close_timeout``, two end it ``closed``. Ending stops both directions,
    waits for their tasks, closes (or resets) both sockets, then tells the owner. One object with a slot
    per field, not lists: this is what an idle tunnel holds."""

    __slots__ = ("_closed", "_judging", "_loop", "_outcome", "_owner", "_plane", "_stopped", "_timer",
                 "close_timeout", "down_parked", "down_result", "down_task", "drained", "leftover", "link", "meter",
                 "up_parked", "up_result", "up_task", "upstream")

    def __init__(self, plane: UserspacePlane, h: Handoff, owner: TunnelOwner) -> None:
        self._plane = plane
        # The handoff's fields, not the handoff (a dataclass with its dict: 0.1 KiB more an idle tunnel).
        self.link = h.link
        self.upstream = h.upstream
        self.leftover = h.leftover
        self.meter = h.meter
        self.close_timeout = h.close_timeout
        self._owner = owner
        self._loop = asyncio.get_running_loop()
        self.drained = _Drained()
        self.up_task: asyncio.Task[bool] | None = None
        self.down_task: asyncio.Task[bool] | None = None
        self.up_parked = self.down_parked = False
        self.up_result: object = _RUNNING  # None: ended in order; else the exception
        self.down_result: object = _RUNNING
        self._judging = False  # a judgement is scheduled
        self._timer: asyncio.TimerHandle | None = None  # close_timeout, once one direction ended in order
        self._outcome: Outcome | None = None  # set once the tunnel is ending
        self._stopped = False
        self._closed = False

    def start(self) -> None:
        self._start_up()
        self._start_down()

    def _start_up(self) -> None:
        self.up_task = self._loop.create_task(self._plane._gateway_to_sandbox(self, self.drained), name="up")
        self.up_task.add_done_callback(self._up_done)

    def _start_down(self) -> None:
        self.down_task = self._loop.create_task(self._plane._sandbox_to_gateway(self, self.drained), name="down")
        self.down_task.add_done_callback(self._down_done)

    def _up_done(self, task: asyncio.Task[bool]) -> None:
        if self.up_task is task:
            self.up_task = None
        exc = self._ended(task)
        if exc is False:
            self.up_parked = True
            link = self.link
            parking_lot(self._loop).park(link.sock.fileno(), self)
            release_bio_buffers(link.ssl, (link.incoming,), BIO_KEEP)
        elif exc is not True:
            self.up_result = exc
            self._judge_soon()
        else:
            self._close_once_stopped()

    def _down_done(self, task: asyncio.Task[bool]) -> None:
        if self.down_task is task:
            self.down_task = None
        exc = self._ended(task)
        if exc is False:
            self.down_parked = True
            link = self.link
            parking_lot(self._loop).park(self.upstream.fileno(), self)
            release_bio_buffers(link.ssl, (link.outgoing,), BIO_KEEP)
        elif exc is not True:
            self.down_result = exc
            self._judge_soon()
        else:
            self._close_once_stopped()

    def _ended(self, task: asyncio.Task[bool]) -> BaseException | bool | None:
        """What a direction's task came to: False to park, None (an orderly end) or the exception that
        ended it, True for nothing to do (the tunnel is stopping). The exception is retrieved either way."""
        if task.cancelled():
            return True if self._stopped else asyncio.CancelledError()
        exc = task.exception()
        if self._stopped:
            return True
        if exc is None and not task.result():
            return False
        return exc

    def readable(self, fd: int) -> None:
        """A parked direction's socket is readable (it has left the lot): start its task again."""
        if fd == self.link.sock.fileno() and self.up_parked:
            self.up_parked = False
            self._start_up()
        elif fd == self.upstream.fileno() and self.down_parked:
            self.down_parked = False
            self._start_down()

    def ended(self) -> int:
        return (self.up_result is not _RUNNING) + (self.down_result is not _RUNNING)

    def cut(self) -> None:
        """End it now (a drain's deadline passed): both sides are reset, the outcome is ``drained``."""
        self._end(Outcome.DRAINED)

    def _judge_soon(self) -> None:
        if not self._judging:
            self._judging = True
            self._loop.call_soon(self._judge)

    def _judge(self) -> None:
        self._judging = False
        if self._outcome is not None or not self.ended():
            return
        up, down = self.up_result, self.down_result
        for exc in (up, down):
            if exc is not _RUNNING and exc is not None:
                assert isinstance(exc, BaseException)
                self._plane._count_truncation(exc, up_ended=up is None)
                self._end(self._plane._classify(exc))
                return
        if self.ended() == 2:
            self._end(Outcome.CLOSED)
        elif self._timer is None:  # one direction ended in order; the other may keep going for close_timeout
            self._timer = self._loop.call_later(self.close_timeout, self._end, Outcome.CLOSE_TIMEOUT)

    def _end(self, outcome: Outcome) -> None:
        """Unpark both directions and cancel the running ones; the sockets are closed once their tasks end."""
        if self._outcome is not None:
            return
        self._outcome = outcome
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stopped = True
        if self.up_parked:
            self.up_parked = False
            parking_lot(self._loop).leave(self.link.sock.fileno())
        if self.down_parked:
            self.down_parked = False
            parking_lot(self._loop).leave(self.upstream.fileno())
        for task in (self.up_task, self.down_task):
            if task is not None:
                task.cancel()
        self._close_once_stopped()

    def _close_once_stopped(self) -> None:
        if self.up_task is not None or self.down_task is not None:
            return  # a cancelled task has yet to end: its done callback comes back here
        outcome = self._outcome
        if outcome is None or self._closed:
            return  # not ending (a failed start), or closed already
        self._closed = True
        # A direction's exception holds its traceback, whose frames hold this tunnel (``h``): let go of
        # them, or the ended tunnel (its SSL object and OpenSSL's 20 KiB) would wait for a collection.
        self.up_result = self.down_result = None
        try:
            self._plane._close(self, outcome)
        finally:
            self._owner.tunnel_ended(outcome)


class _Ended:
    """The owner :meth:`UserspacePlane.run` starts a tunnel with: its end as a future."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Outcome]) -> None:
        self.future = future

    def tunnel_ended(self, outcome: Outcome) -> None:
        if not self.future.done():
            self.future.set_result(outcome)


class UserspacePlane:
    name = "userspace"

    def __init__(self, *, metrics: ForwarderMetrics | None = None) -> None:
        self._metrics = metrics

    @staticmethod
    def on_accept(sock: socket.socket) -> None:
        pass  # nothing to prepare: TLS stays in user space

    def start(self, h: Handoff, owner: TunnelOwner) -> _Tunnel:
        """Start moving bytes and return at once: ``owner.tunnel_ended`` hears of the end (nothing waits
        for it meanwhile, so an idle tunnel holds no task or coroutine). ``cut()`` on the result ends it
        as a drain does."""
        tunnel = _Tunnel(self, h, owner)
        try:
            # The handshake's flights are spent: both BIOs are empty (nothing is buffered at the handoff).
            release_bio_buffers(h.link.ssl, (h.link.incoming, h.link.outgoing))
            tunnel.start()
        except BaseException:
            tunnel._stopped = True
            for task in (tunnel.up_task, tunnel.down_task):
                if task is not None:
                    task.cancel()
            self._close(h, Outcome.INTERNAL)
            raise
        return tunnel

    async def run(self, h: Handoff) -> Outcome:
        """The tunnel as one coroutine (the ``DataPlane`` shape): :meth:`start`, then its end awaited;
        cancelled, it is cut and its end waited for before the cancellation goes on."""
        ended = _Ended(asyncio.get_running_loop().create_future())
        tunnel = self.start(h, ended)
        try:
            return await asyncio.shield(ended.future)
        except asyncio.CancelledError:
            tunnel.cut()
            await ended.future
            raise

    def _count_truncation(self, exc: BaseException, *, up_ended: bool) -> None:
        """A gateway side that broke before its close_notify ended the upload (``up_ended``: the upload
        ended in order, which it does only after it): the stream was cut short, and the sandbox is reset."""
        if not isinstance(exc, _Reset) or exc.side != "gateway" or self._metrics is None:
            return
        if up_ended:
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
    def _close(h: _Sides, outcome: Outcome) -> None:
        if outcome is Outcome.CLOSED:
            h.link.sock.close()
            h.upstream.close()
        else:
            # Anything but an orderly end on both sides is passed on as a reset, never as a clean EOF
            # that could make a truncated stream look complete.
            abort(h.link.sock)
            abort(h.upstream)

    async def _gateway_to_sandbox(self, h: _Sides, drained: _Drained) -> bool:
        """Gateway to sandbox until the socket has had nothing to read for PARK_AFTER_S (False: the direction
        parks, holding no buffer) or close_notify came (True, after the sandbox's SHUT_WR)."""
        loop = asyncio.get_running_loop()
        sock, up, meter = h.link.sock, h.upstream, h.meter
        if h.leftover:
            leftover, h.leftover = h.leftover, b""  # delivered once, and not kept for the tunnel's life
            await self._deliver(loop, up, memoryview(leftover), meter)
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
                    got = -1
                except OSError as e:
                    raise _Reset("gateway") from e
                if got < 0:
                    # Idle: hold no buffer meanwhile; park if it lasts (not while an exception is held).
                    raws.give(raw)
                    raw = None
                    if plain is not None:
                        plains.give(plain)
                        plain = None
                    if not await _readable_soon(loop, sock):
                        return False
                    continue
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
        return True

    async def _decrypt_and_deliver(
        self, loop: asyncio.AbstractEventLoop, h: _Sides, drained: _Drained, plain: memoryview, n: int,
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

    async def _sandbox_to_gateway(self, h: _Sides, drained: _Drained) -> bool:
        """Sandbox to gateway until the socket has had nothing to read for PARK_AFTER_S (False: the direction
        parks) or its end of stream, passed on as close_notify and FIN (True)."""
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
                    n = -1
                except OSError as e:
                    raise _Reset("sandbox") from e
                if n < 0:
                    raws.give(raw)
                    raw = None
                    if not await _readable_soon(loop, up):
                        return False
                    continue
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
        return True

    @staticmethod
    async def _deliver(loop: asyncio.AbstractEventLoop, up: socket.socket, data: memoryview, meter: ConnMeter) -> None:
        try:
            await _send_all(loop, up, data)
        except OSError as e:
            raise _Reset("sandbox") from e
        meter.up += len(data)
        meter.last_activity = time.monotonic()
