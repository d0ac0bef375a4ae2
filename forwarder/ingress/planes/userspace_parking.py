"""Where the userspace plane's idle directions wait: one epoll set per event loop for all of them.

A parked direction (``userspace._Tunnel``) waits for its socket to become readable. Registered with the
loop (``add_reader``), each such wait cost about 700 bytes of the loop's objects (uvloop's poll handle,
its callback handle with a copy of the context, entries in two of its dicts): 1.4 KiB per idle tunnel,
a twentieth of all it held. Here every parked socket of a loop is in one epoll set, whose descriptor is
the loop's only reader for them; its entries are kernel memory, and ours is one dict entry per socket.
A socket is watched until it is readable (data, end of stream or error) or taken back with
:meth:`ParkingLot.leave`, and the set is closed once it holds none, so an idle process keeps no
descriptor for it. Where there is no epoll (not Linux), each wait is the loop's reader, as before.
"""

from __future__ import annotations

import asyncio
import select
from typing import Protocol


class Parked(Protocol):
    def readable(self, fd: int) -> None:
        """``fd``, parked by this object, is readable; it has left the lot."""


class ParkingLot:
    """The parked sockets of one event loop. Not thread-safe: the loop's own thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[int, Parked] = {}
        self._epoll: select.epoll | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def park(self, fd: int, owner: Parked) -> None:
        """Call ``owner.readable(fd)`` once ``fd`` is readable (then it is no longer watched)."""
        if self._epoll is None:
            self._epoll = select.epoll()
            self._loop.add_reader(self._epoll.fileno(), self._ready)
        self._epoll.register(fd, select.EPOLLIN)
        self._waiting[fd] = owner

    def leave(self, fd: int) -> None:
        """Stop watching ``fd`` (parked, not yet reported readable); before it is closed."""
        if self._waiting.pop(fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(fd)
            self._close_if_empty()

    def _ready(self) -> None:
        assert self._epoll is not None
        for fd, _ in self._epoll.poll(0):
            owner = self._waiting.pop(fd, None)
            if owner is None:
                continue
            self._epoll.unregister(fd)
            owner.readable(fd)
        self._close_if_empty()

    def _close_if_empty(self) -> None:
        if self._waiting or self._epoll is None:
            return
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._epoll = None
        if _lots.get(self._loop) is self:
            del _lots[self._loop]


class _LoopReaders:
    """The same, as one loop reader per socket (no epoll here)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[int, Parked] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def park(self, fd: int, owner: Parked) -> None:
        self._waiting[fd] = owner
        self._loop.add_reader(fd, self._ready, fd)

    def leave(self, fd: int) -> None:
        if self._waiting.pop(fd, None) is not None:
            self._loop.remove_reader(fd)

    def _ready(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        owner = self._waiting.pop(fd, None)
        if owner is not None:
            owner.readable(fd)


_lots: dict[asyncio.AbstractEventLoop, ParkingLot | _LoopReaders] = {}


def parking_lot(loop: asyncio.AbstractEventLoop) -> ParkingLot | _LoopReaders:
    """``loop``'s lot (made on first use; an epoll one is dropped again once empty)."""
    lot = _lots.get(loop)
    if lot is None:
        lot = _lots[loop] = ParkingLot(loop) if hasattr(select, "epoll") else _LoopReaders(loop)
    return lot
