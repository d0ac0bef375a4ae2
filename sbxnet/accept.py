"""The accept loop every listener here uses (ghostunnel's shape): take a connection slot before accepting,
so at the limit new peers wait in the kernel's backlog; back off on accept errors (EMFILE, ENFILE,
ENOBUFS) instead of spinning; one task per connection; drain stops accepting, waits, then cuts the rest.

A connection may outlive its task (:meth:`Acceptor.hold`): a forwarder's userspace tunnel, once its bytes
move, needs no coroutine waiting for its end, and an idle one would otherwise keep a task and its frames
for its whole life. Such a connection keeps its slot until :meth:`Acceptor.let_go`; drain waits for it as
for a task, and cuts it with ``cut()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

Serve = Callable[[socket.socket, tuple[str, int]], Coroutine[Any, Any, None]]


class Held(Protocol):
    """A connection that outlived its task (:meth:`Acceptor.hold`)."""

    def cut(self) -> None:
        """End it now (a drain's deadline passed); it calls :meth:`Acceptor.let_go` once it has ended."""


class Acceptor:
    def __init__(self, serve: Serve, *, max_connections: int, log: logging.Logger, name: str = "accept") -> None:
        self._serve = serve
        self._log = log
        self._name = name
        self._slots = asyncio.Semaphore(max_connections)
        self._conns: set[asyncio.Task[None]] = set()
        self._held: set[Held] = set()  # connections whose task has handed them on (hold), until let_go
        self._holders: set[asyncio.Task[None]] = set()  # tasks that did, until they end: their slot is held
        self._quiet: asyncio.Future[None] | None = None  # drain's wait for no task and nothing held
        self._task: asyncio.Task[None] | None = None
        self.listener: socket.socket | None = None

    @property
    def port(self) -> int:
        assert self.listener is not None, "not started"
        return int(self.listener.getsockname()[1])

    @property
    def open_connections(self) -> int:
        return len(self._conns) - len(self._holders) + len(self._held)

    def hold(self, conn: Held) -> None:
        """Called from a connection's task: ``conn`` lives on after the task ends and keeps the task's
        slot until :meth:`let_go` (which ``conn`` calls when it ends). Drain waits for it and cuts it."""
        task = asyncio.current_task()
        assert task is not None and task in self._conns, "hold() outside a connection's task"
        self._holders.add(task)
        self._held.add(conn)

    def let_go(self, conn: Held) -> None:
        """``conn`` (held) has ended: its slot is free."""
        self._held.remove(conn)
        self._slots.release()
        self._settle()

    def start(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.listener = listener
        self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop_accepting(self) -> None:
        """Stop the loop and close the listening socket (new peers are refused by the kernel)."""
        await self.pause()
        if self.listener:
            self.listener.close()

    async def pause(self) -> None:
        """Stop the loop and keep the listening socket: new peers wait in its backlog (or another
        process sharing it accepts them) until :meth:`resume`."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def resume(self) -> None:
        """Accept again on the socket :meth:`pause` kept."""
        assert self.listener is not None and self.listener.fileno() >= 0, "no listening socket kept"
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self._name)

    async def drain(self, timeout: float | None) -> int:
        """Let live connections finish up to ``timeout`` (None: however long they take), then cancel the
        rest; how many were cut."""
        if not self._conns and not self._held:
            return 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._all_ended()
        pending = [t for t in self._conns if not t.done()]
        held = list(self._held)
        for t in pending:
            t.cancel()
        for conn in held:
            conn.cut()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self._all_ended()  # the cut ones' ends (each stops its own work first)
        return len(pending) + len(held)

    async def _all_ended(self) -> None:
        while self._conns or self._held:
            if self._quiet is None or self._quiet.done():
                self._quiet = asyncio.get_running_loop().create_future()
            await self._quiet

    def _settle(self) -> None:
        if not self._conns and not self._held and self._quiet is not None and not self._quiet.done():
            self._quiet.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.listener is not None
        backoff = 0.005
        while True:
            await self._slots.acquire()
            try:
                sock, addr = await _accept(loop, self.listener)
            except OSError as e:
                self._slots.release()
                # EMFILE/ENFILE/ENOBUFS: back off instead of spinning; the backlog holds the peers.
                reason = errno.errorcode.get(e.errno or 0, "oserror")
                self._log.warning("accept failed", extra={"event": "accept_error", "reason": reason})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            except BaseException:
                self._slots.release()
                raise
            backoff = 0.005
            task = asyncio.create_task(self._serve(sock, (str(addr[0]), int(addr[1]))))
            self._conns.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._conns.discard(task)
        if task in self._holders:
            self._holders.discard(task)  # its connection keeps the slot until let_go
        else:
            self._slots.release()
        self._settle()


async def _accept(loop: asyncio.AbstractEventLoop, listener: socket.socket) -> tuple[socket.socket, Any]:
    """One connection, non-blocking. Cancelled only while waiting for the listener to be readable, never
    between the kernel's accept and the caller (as ``loop.sock_accept`` can be: its future done, its task
    cancelled before it runs, the socket dropped): ``stop_accepting`` loses no connection, and where
    another process shares the listener (a forwarder's takeover), what is left in the backlog is its.
    Readiness shared with that process may find nothing to accept: that is a wait, not an error."""
    fd = listener.fileno()
    while True:
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            pass
        else:
            sock.setblocking(False)
            return sock, addr
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
