"""Idle directions of the userspace plane wait in the loop's parking lot, with no task of their own
(forwarder/ingress/planes/userspace_parking.py): real sockets on a uvloop loop, and a real tunnel
through a forwarder in a thread."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
import uvloop
from fwd_support import ForwarderThread, GwClient, Pki, SandboxApp, preamble_for

from forwarder.ingress.planes import userspace_parking
from forwarder.ingress.planes.userspace_parking import ParkingLot, _LoopReaders, parking_lot

Lot = Callable[[asyncio.AbstractEventLoop], "ParkingLot | _LoopReaders"]


class Owner:
    def __init__(self) -> None:
        self.woken: list[int] = []

    def readable(self, fd: int) -> None:
        self.woken.append(fd)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = uvloop.new_event_loop()
    yield lp
    lp.close()


def spin(loop: asyncio.AbstractEventLoop, seconds: float = 0.05) -> None:
    loop.run_until_complete(asyncio.sleep(seconds))


def epoll_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{n}") == "anon_inode:[eventpoll]"
               for n in os.listdir("/proc/self/fd") if _exists(n))


def _exists(n: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{n}")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("make", [ParkingLot, _LoopReaders], ids=["epoll", "loop-readers"])
def test_a_parked_socket_is_reported_once_when_readable_and_not_before(
    loop: asyncio.AbstractEventLoop, make: Lot
) -> None:
    lot = make(loop)
    pairs = [socket.socketpair() for _ in range(50)]
    owner = Owner()
    try:
        for a, _ in pairs:
            a.setblocking(False)
            lot.park(a.fileno(), owner)
        spin(loop)
        assert owner.woken == [] and len(lot) == 50  # nothing to read yet
        pairs[7][1].send(b"x")
        pairs[30][1].close()  # end of stream wakes too
        spin(loop)
        assert sorted(owner.woken) == sorted([pairs[7][0].fileno(), pairs[30][0].fileno()])
        assert len(lot) == 48
        pairs[7][1].send(b"more")  # left the lot: no second report, however much comes
        spin(loop)
        assert len(owner.woken) == 2
        lot.leave(pairs[3][0].fileno())  # taken back before it was readable
        pairs[3][1].send(b"x")
        spin(loop)
        assert len(owner.woken) == 2 and len(lot) == 47
        a, b = pairs[12]
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        b.close()  # a reset
        spin(loop)
        assert owner.woken[-1] == a.fileno()
    finally:
        for a, b in pairs:
            if a.fileno() != -1 and a.fileno() not in owner.woken:
                lot.leave(a.fileno())
            a.close()
            b.close()


def test_the_epoll_set_is_closed_once_its_last_socket_leaves(loop: asyncio.AbstractEventLoop) -> None:
    before = epoll_fds()  # uvloop's own
    lot = parking_lot(loop)
    assert parking_lot(loop) is lot
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    owner = Owner()
    try:
        lot.park(a.fileno(), owner)
        lot.park(c.fileno(), owner)
        assert epoll_fds() == before + 1
        b.send(b"x")
        spin(loop)
        assert owner.woken == [a.fileno()] and epoll_fds() == before + 1  # one still parked
        lot.leave(c.fileno())
        assert epoll_fds() == before  # empty: closed, and the loop no longer reads it
        assert parking_lot(loop) is not lot  # a fresh one next time
        userspace_parking.parking_lot(loop).park(a.fileno(), owner)
        b.send(b"y")
        spin(loop)
        assert owner.woken == [a.fileno(), a.fileno()] and epoll_fds() == before
    finally:
        for s in (a, b, c, d):
            s.close()


def test_an_idle_tunnel_has_no_task_and_wakes_when_bytes_come(make_forwarder: Callable[..., ForwarderThread],
                                                              pki: Pki) -> None:
    def echo(conn: socket.socket) -> None:
        while chunk := conn.recv(65536):
            conn.sendall(chunk)

    fwd = make_forwarder()
    app = SandboxApp(echo)
    client = GwClient(fwd.port, pki.client_ctx())

    async def directions() -> tuple[list[str], int]:
        names = [t.get_name() for t in asyncio.all_tasks() if t.get_name() in ("up", "down")]
        return names, len(parking_lot(asyncio.get_running_loop()))

    def idle_state(want_parked: int) -> tuple[list[str], int]:
        deadline = time.monotonic() + 10
        while True:
            state = fwd.call(directions())
            if state[1] == want_parked or time.monotonic() > deadline:
                return state
            time.sleep(0.02)

    try:
        client.open(preamble_for(app.port))
        assert idle_state(2) == ([], 2)  # both directions parked: no task
        for size in (5, 100_000):
            data = os.urandom(size)
            client.send(data)
            assert client.recv_exact(size) == data
            assert idle_state(2) == ([], 2)
        client.close_write()
        assert client.recv_all() == b""
        fwd.wait_idle()
        assert fwd.call(directions()) == ([], 0)
    finally:
        client.close()
        app.close()
