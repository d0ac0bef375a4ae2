"""Upgrades that drop no tunnel: a new forwarder takes the listening socket over from the running one.

The running forwarder (``takeover_socket`` set) serves a Unix SOCK_SEQPACKET control socket, mode 0600;
a peer whose credentials (SO_PEERCRED) are neither root's nor this process's user is refused. A new
process started with ``sbxnet forwarder --takeover <socket>`` connects and says HELLO; the running one
answers OFFER with its TLS listener and the control socket's own listener attached (SCM_RIGHTS). The
new one starts accepting on that very listener and says READY; only then does the running one stop
accepting (and close its ops endpoints) and answer RELEASED; the ktls plane then moves its live tunnels
(TUNNEL, ADOPTED, COMMIT). The new one says DONE, and only then does the running one close its copies
of the two listeners, keeping its live tunnels until they end before it exits. The listening socket is
never closed, so no connect is refused: until READY both processes accept from one backlog, and
whatever waits in it after the release is the new one's. A new process that dies (or fails) at any
step before DONE leaves the running one serving everything: before READY it never stopped; after, it
still holds both listeners, gives back any tunnel not yet committed, and accepts again (and serves its
ops endpoints again) from the same backlog. The messages are ``takeover_codec.py``; docs/forwarder.md
gives the sequence.

One process per side: ``takeover_socket`` needs ``workers = 1`` (settings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from forwarder.ingress.planes.ktls import MovingTunnel

from forwarder.ingress.takeover_codec import (
    MAX_MESSAGE,
    PUMP_STATE,
    ROLES,
    Adopted,
    Commit,
    Done,
    Hello,
    Offer,
    Ready,
    Refused,
    Released,
    TakeoverError,
    Tunnel,
    pull_message,
    push_message,
)
from sbxnet.errors import EnvironmentFault

log = logging.getLogger("sbxnet.forwarder")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class TakeoverFailed(EnvironmentFault):
    """This process cannot take over (nothing answers, the running one refused, a bad offer); the
    running forwarder keeps serving. ``detail`` is the operator's line."""


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    pid, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


def peer_allowed(uid: int) -> bool:
    """Root, or the user this forwarder runs as: whoever could start or signal it anyway."""
    return uid == 0 or uid == os.getuid()


def bind_control(path: Path) -> socket.socket:
    """The control socket's listener at ``path``, mode 0600. A forwarder already answering there is not
    displaced (TakeoverFailed naming ``--takeover``); a stale socket file left by a killed one is."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise TakeoverFailed("control_socket", f"{path} exists and is not a socket; remove it or set another "
                                                   "takeover_socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.settimeout(2)
        try:
            probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise TakeoverFailed("control_socket", f"cannot check the control socket {path}: {e.strerror}") \
                    from None
            os.unlink(path)  # nobody listens: a killed forwarder's
        else:
            raise TakeoverFailed(
                "control_socket",
                f"a forwarder already serves the control socket {path}: start this one with --takeover {path} "
                "to take over from it, or stop it first",
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)  # and peers are checked by credentials, whatever the mode was meanwhile
        sock.listen(4)
    except OSError as e:
        sock.close()
        raise TakeoverFailed("control_socket", f"cannot listen on the control socket {path}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


# -- the running process's side -------------------------------------------------------------------------

OfferFn = Callable[[], "tuple[Offer, list[int]] | str"]


class TunnelMover(Protocol):
    """What moves live kTLS tunnels out of the running process (the ktls plane)."""

    def detach_all(self) -> list[MovingTunnel]: ...

    def commit_moved(self) -> int: ...

    def give_back(self) -> int: ...


class TunnelReceiver(Protocol):
    """What takes them in the new process (the server, over its ktls plane)."""

    def adopt_tunnel(self, tunnel: Tunnel, fds: list[int]) -> None: ...

    def resume_adopted(self) -> int: ...

    def drop_adopted(self) -> int: ...


class ControlServer:
    """Serves the control socket: one takeover at a time, each step within ``timeout``.

    ``offer()`` gives the OFFER and its descriptors (or a refusal token: ``draining``); ``release()``
    stops accepting, keeping the listening socket, and returns how many tunnels stay; ``resume()``
    accepts on it again (the takeover failed after READY); ``let_go()`` closes this process's copy (the
    new process said DONE). :attr:`taken_over` is set at DONE; from then on this server accepts nothing
    more.
    """

    def __init__(self, listener: socket.socket, *, offer: OfferFn, release: Callable[[], Awaitable[int]],
                 resume: Callable[[], Awaitable[None]], let_go: Callable[[], None], timeout: float,
                 mover: TunnelMover | None = None) -> None:
        self.listener = listener
        self._mover = mover
        self._offer = offer
        self._release = release
        self._resume = resume
        self._let_go = let_go
        self._timeout = timeout
        self._busy = False
        self._task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.taken_over = asyncio.Event()
        self.handing_over = False  # past a READY, before its DONE or the failure that ends it
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="takeover-control")

    async def _pause(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def close(self) -> None:
        """Stop serving and close this process's copy of the listener (the file stays: after a takeover
        it is the new process's)."""
        tasks = [t for t in (self._task, *self._serving) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.listener.close()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.taken_over.is_set():
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as e:
                reason = errno.errorcode.get(e.errno or 0, "oserror")
                log.warning("control socket accept failed", extra={"event": "takeover_accept_error", "reason": reason})
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            pid, uid, _ = peer_credentials(conn)
            if not peer_allowed(uid):
                log.warning("takeover refused: peer not allowed", extra={
                    "event": "takeover_refused", "reason": "peer_not_allowed",
                    "fields": {"peer_pid": pid, "peer_uid": uid}})
                return
            if self._busy or self.taken_over.is_set():
                conn.send(push_message(Refused("busy")))
                return
            self._busy = True
            try:
                await self._take(loop, conn, pid)
            finally:
                self._busy = False
        except (OSError, TimeoutError, TakeoverError) as e:
            self.failures += 1
            reason = e.reason if isinstance(e, TakeoverError) else "timeout" if isinstance(e, TimeoutError) else "io"
            log.warning("takeover failed; serving on", extra={"event": "takeover_failed", "reason": reason,
                                                              "fields": {"error": str(e)}})
        finally:
            conn.close()

    async def _take(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, pid: int) -> None:
        async with asyncio.timeout(self._timeout):
            first = await loop.sock_recv(conn, MAX_MESSAGE + 1)
        if not first:
            return  # connected and left: another forwarder's check that this socket is served
        hello = pull_message(first)
        if not isinstance(hello, Hello):
            raise TakeoverError("bad_field", f"expected HELLO, got {type(hello).__name__}")
        offered = self._offer()
        if isinstance(offered, str):
            conn.send(push_message(Refused(offered)))
            log.info("takeover refused", extra={"event": "takeover_refused", "reason": offered})
            return
        offer, fds = offered
        socket.send_fds(conn, [push_message(offer)], fds)
        log.info("listener offered", extra={"event": "takeover_offered", "fields": {
            "peer_pid": pid, "fds": list(offer.fds), "stream": offer.stream}})
        async with asyncio.timeout(self._timeout):
            data = await loop.sock_recv(conn, MAX_MESSAGE + 1)
        if not data:
            # It ended before READY: it accepted nothing, and this process never stopped accepting.
            self.failures += 1
            log.warning("the new forwarder ended before it was ready; serving on",
                        extra={"event": "takeover_failed", "reason": "ended_before_ready", "fields": {"peer_pid": pid}})
            return
        ready = pull_message(data)
        if not isinstance(ready, Ready):
            raise TakeoverError("bad_field", f"expected READY, got {type(ready).__name__}")
        # Control connections are the new process's now (it serves the same listener); both listeners
        # stay open here until its DONE, so that a failure from here on leaves this process serving.
        self.handing_over = True
        await self._pause()
        kept = await self._release()
        mover = self._mover if ready.tunnels else None
        moving = mover.detach_all() if mover is not None else []
        try:
            conn.send(push_message(Released(os.getpid(), kept - len(moving), len(moving))))
            if moving:
                await self._move(loop, conn, moving)
        except (OSError, TimeoutError, TakeoverError) as e:
            conn.close()  # the new process sees the end before these run here again, and lets go of them
            back = mover.give_back() if mover is not None and moving else 0
            await self._serve_again("tunnels_given_back" if moving else "io", e, pid, given_back=back)
            return
        if moving:
            assert mover is not None
            moved = mover.commit_moved()  # the new process's from COMMIT on, whatever happens next
            log.info("tunnels moved", extra={"event": "tunnels_moved", "fields": {"moved": moved, "to_pid": pid}})
        try:
            async with asyncio.timeout(self._timeout):
                data = await loop.sock_recv(conn, MAX_MESSAGE + 1)
            done = pull_message(data) if data else None
            if done is not None and not isinstance(done, Done):
                raise TakeoverError("bad_field", f"expected DONE, got {type(done).__name__}")
        except (OSError, TimeoutError, TakeoverError) as e:
            await self._serve_again("no_done", e, pid)
            return
        if done is None:
            await self._serve_again("ended_before_done", None, pid)
            return
        self.taken_over.set()
        self.handing_over = False
        self._let_go()
        self.listener.close()
        log.info("taken over", extra={"event": "taken_over", "fields": {
            "by_pid": pid, "kept_connections": kept - len(moving), "moving": len(moving)}})

    async def _serve_again(self, reason: str, error: BaseException | None, pid: int, *, given_back: int = 0) -> None:
        """The takeover failed after READY: accept on both listeners again, kept open for this."""
        self.failures += 1
        self.handing_over = False
        await self._resume()
        self._task = asyncio.create_task(self._loop(), name="takeover-control")
        fields: dict[str, object] = {"peer_pid": pid, "given_back": given_back}
        if error is not None:
            fields["error"] = str(error) or type(error).__name__
        log.warning("the takeover did not finish; serving on", extra={
            "event": "takeover_failed", "reason": reason, "fields": fields})

    async def _move(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, moving: list[MovingTunnel]) -> None:
        """One TUNNEL (its six descriptors attached) and its ADOPTED at a time, then COMMIT: the point
        after which the tunnels are the new process's."""
        for t in moving:
            state = tuple((key, int(getattr(t.detached, key))) for key in PUMP_STATE)
            data = push_message(Tunnel(t.conn_id, t.sandbox_id, t.head, state))
            async with asyncio.timeout(self._timeout):
                await _send_fds(loop, conn, data, t.detached.fds)
                answer = pull_message(await loop.sock_recv(conn, MAX_MESSAGE + 1))
            if not isinstance(answer, Adopted) or answer.conn_id != t.conn_id:
                raise TakeoverError("bad_field", f"expected ADOPTED {t.conn_id}, got {answer!r}")
        conn.send(push_message(Commit(len(moving))))


# -- the new process's side ---------------------------------------------------------------------------


@dataclass
class Taken:
    """What a new process took: its link to the running one (kept until RELEASED), the offer, and the
    sockets it carried."""

    conn: socket.socket
    offer: Offer
    listener: socket.socket  # the TLS listener, shared with the running process until it releases it
    control: socket.socket | None  # the control socket's listener, served from here on


def take_over(path: Path, *, host: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
              timeout: float) -> Taken:
    """Connect to the running forwarder's control socket and take its listener: HELLO, then the OFFER
    and its descriptors. The listener must be the one these settings serve (``host``, ``port``). Nothing
    is accepted yet: the caller starts accepting, then :func:`announce_ready`. TakeoverFailed otherwise
    (the running one keeps serving)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
    except OSError as e:
        conn.close()
        raise TakeoverFailed("connect", f"cannot reach a running forwarder at {path}: {e.strerror}") from None
    fds: list[int] = []
    try:
        _, uid, _ = peer_credentials(conn)
        if not peer_allowed(uid):
            raise TakeoverFailed("peer", f"the control socket {path} is served by uid {uid}, neither root nor ours")
        conn.send(push_message(Hello(os.getpid())))
        data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE + 1, len(ROLES))
        try:
            offer = pull_message(data)
        except TakeoverError as e:
            raise TakeoverFailed("bad_offer", f"the running forwarder's answer is not an offer ({e})") from None
        if isinstance(offer, Refused):
            raise TakeoverFailed("refused", f"the running forwarder refused the takeover: {offer.reason}")
        if not isinstance(offer, Offer) or flags & socket.MSG_CTRUNC or len(fds) != len(offer.fds):
            raise TakeoverFailed("bad_offer", "the running forwarder's offer does not carry its descriptors")
        socks = dict(zip(offer.fds, (socket.socket(fileno=fd) for fd in fds), strict=True))
        fds = []  # owned by the sockets now
        listener = socks["tls"]
        _check_listener(listener, host, port)
        for s in socks.values():
            s.setblocking(False)
        return Taken(conn, offer, listener, socks.get("control"))
    except TakeoverFailed:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise
    except OSError as e:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise TakeoverFailed("io", f"takeover over {path} failed: {e.strerror or e}") from None


def _check_listener(sock: socket.socket, host: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> None:
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise TakeoverFailed("bad_offer", "the offered TLS descriptor is not a listening TCP socket")
    name = sock.getsockname()
    if ipaddress.ip_address(name[0]) != host or name[1] != port:
        raise TakeoverFailed(
            "listen_mismatch",
            f"the running forwarder listens on {name[0]}:{name[1]}, these settings on {host}:{port}; "
            "the takeover would serve another address than configured",
        )


def announce_ready(taken: Taken, *, tunnels: bool) -> None:
    """READY: this process accepts on the listener (and, with ``tunnels``, can adopt live kTLS tunnels).
    Sent right after the accept loop starts and before it first runs, so a process killed before this
    accepted nothing."""
    taken.conn.send(push_message(Ready(os.getpid(), tunnels)))


@dataclass(frozen=True)
class Finished:
    """How a takeover ended for the new process. ``serving``: it serves the listener from now on (it said
    DONE, or the running one is gone); otherwise the running one lives and serves everything again, and
    this process steps back: it accepts no more and keeps only what it accepted meanwhile."""

    released: Released | None  # None if the running one never said RELEASED
    serving: bool


async def finish_takeover(taken: Taken, timeout: float, receiver: TunnelReceiver | None) -> Finished:
    """After READY (this process accepts meanwhile): the running one's RELEASED, then the kTLS tunnels it
    moves, each adopted paused and acknowledged, started at its COMMIT; then DONE, after which the running
    one lets go of its copies of the listeners. If it ends, goes silent or errs first, the tunnels
    adopted so far are dropped while it lives (it gives them back to itself and serves on) and started
    if it is gone (nobody else can serve them)."""
    loop = asyncio.get_running_loop()
    conn = taken.conn
    conn.setblocking(False)
    released: Released | None = None
    try:
        async with asyncio.timeout(timeout):
            msg = pull_message((await _recv_fds(loop, conn, 0))[0])
        if not isinstance(msg, Released):
            raise TakeoverError("bad_field", f"expected RELEASED, got {type(msg).__name__}")
        released = msg
        if released.moving:
            if receiver is None:
                raise TakeoverError("bad_field", "tunnels sent to a process that said it cannot adopt them")
            await _adopt(loop, conn, timeout, receiver, released.moving)
        try:
            conn.send(push_message(Done(os.getpid())))
        except OSError:
            # Past COMMIT the tunnels are ours; whether or not the running one saw this, it has let go
            # of them. It serves the listener again only if it lives and missed our DONE.
            return Finished(released, serving=not _alive(taken.offer.pid))
        return Finished(released, serving=True)
    except (OSError, TimeoutError, TakeoverError) as e:
        alive = _alive(taken.offer.pid)
        if receiver is not None:
            n, what = (receiver.drop_adopted(), "dropped") if alive else (receiver.resume_adopted(), "started")
            log.warning(f"takeover ended before its commit; adopted tunnels {what}", extra={
                "event": "takeover_incomplete", "reason": type(e).__name__, "fields": {what: n}})
        return Finished(released, serving=not alive)
    finally:
        conn.close()


async def _adopt(loop: asyncio.AbstractEventLoop, conn: socket.socket, timeout: float, receiver: TunnelReceiver,
                 moving: int) -> None:
    for _ in range(moving):
        async with asyncio.timeout(timeout):
            data, fds, flags = await _recv_fds(loop, conn, 6)
        try:
            tunnel = pull_message(data)
            if not isinstance(tunnel, Tunnel) or flags & socket.MSG_CTRUNC or len(fds) != 6:
                raise TakeoverError("bad_field", "a TUNNEL without its six descriptors")
            receiver.adopt_tunnel(tunnel, fds)
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        conn.send(push_message(Adopted(tunnel.conn_id)))
    async with asyncio.timeout(timeout):
        commit = pull_message((await _recv_fds(loop, conn, 0))[0])
    if not isinstance(commit, Commit) or commit.count != moving:
        raise TakeoverError("bad_field", f"expected COMMIT {moving}, got {commit!r}")
    started = receiver.resume_adopted()
    log.info("tunnels adopted", extra={"event": "tunnels_adopted", "fields": {"started": started}})


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc to ask: the signal check stands
    return stat_line[stat_line.rindex(")") + 2:][:1] not in ("Z", "X")


async def _recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, maxfds: int) -> tuple[bytes, list[int], int]:
    """One datagram and the descriptors on it, from a non-blocking socket."""
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE + 1, maxfds)
            return data, fds, flags
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, write=False)


async def _send_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes, fds: list[int]) -> None:
    while True:
        try:
            socket.send_fds(sock, [data], fds)
            return
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, write=True)


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, _wake, fut)
    try:
        await fut
    finally:
        remove(fd)
