"""The shared accept loop (sbxnet/accept.py) on a real loopback listener: pause keeps the socket, so a
connect made meanwhile waits in the backlog and is served at resume; stop_accepting closes it, so the
kernel refuses the next one. A connection its task hands on (hold) keeps its slot until it ends (let_go),
and drain waits for it, then cuts it."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from sbxnet.accept import Acceptor


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def serving(served: list[int]) -> Acceptor:
    async def serve(sock: socket.socket, peer: tuple[str, int]) -> None:
        served.append(peer[1])
        sock.sendall(b"hi")
        sock.close()

    return Acceptor(serve, max_connections=8, log=logging.getLogger("test"))


def test_pause_keeps_the_listener_and_resume_serves_what_waited() -> None:
    async def main() -> None:
        served: list[int] = []
        acc = serving(served)
        acc.start(listener())
        port = acc.port
        r, w = await connect(port)
        assert await r.read() == b"hi"
        w.close()
        await acc.pause()
        r, w = await connect(port)  # accepted by the kernel, waiting in the backlog
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await r.read(1)
        assert len(served) == 1 and acc.listener is not None and acc.listener.fileno() >= 0
        acc.resume()
        async with asyncio.timeout(10):
            assert await r.read() == b"hi"
        w.close()
        assert len(served) == 2
        acc.resume()  # running already: no second loop
        await acc.stop_accepting()
        with pytest.raises(ConnectionRefusedError):
            await connect(port)

    asyncio.run(main())


def test_resume_needs_the_socket_pause_kept() -> None:
    async def main() -> None:
        acc = serving([])
        acc.start(listener())
        await acc.stop_accepting()
        with pytest.raises(AssertionError):
            acc.resume()

    asyncio.run(main())


class Lingering:
    """A connection that outlives its task, as a forwarder's userspace tunnel does: it ends when its peer
    ends (the socket read in a loop reader, not a task) or when cut; either way it lets go of its slot."""

    def __init__(self, acc: Acceptor, sock: socket.socket, ends: list[str]) -> None:
        self.acc, self.sock, self.ends = acc, sock, ends
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data = self.sock.recv(64)
        except BlockingIOError:
            return
        if not data:
            self._end("peer")

    def cut(self) -> None:
        self._end("cut")

    def _end(self, how: str) -> None:
        if self.sock.fileno() < 0:
            return
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.ends.append(how)
        self.acc.let_go(self)


def holding(ends: list[str], *, max_connections: int) -> Acceptor:
    async def serve(sock: socket.socket, peer: tuple[str, int]) -> None:
        sock.sendall(b"hi")
        acc.hold(Lingering(acc, sock, ends))  # the task ends now; the connection does not

    acc = Acceptor(serve, max_connections=max_connections, log=logging.getLogger("test"))
    return acc


def test_a_held_connection_keeps_its_slot_until_it_ends() -> None:
    async def main() -> None:
        ends: list[str] = []
        acc = holding(ends, max_connections=1)
        acc.start(listener())
        r1, w1 = await connect(acc.port)
        assert await r1.readexactly(2) == b"hi"
        await asyncio.sleep(0.05)  # the task is done by now
        assert acc.open_connections == 1 and not ends
        r2, w2 = await connect(acc.port)  # in the backlog: the only slot is the first connection's
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await r2.readexactly(2)
        w1.close()  # the first ends: its slot goes to the second at once
        async with asyncio.timeout(10):
            assert await r2.readexactly(2) == b"hi"
        assert ends == ["peer"] and acc.open_connections == 1
        w2.close()
        await acc.stop_accepting()
        assert await acc.drain(10) == 0  # the second ended by itself: nothing to cut
        assert ends == ["peer", "peer"] and acc.open_connections == 0

    asyncio.run(main())


def test_drain_waits_for_held_connections_then_cuts_them() -> None:
    async def main() -> None:
        ends: list[str] = []
        acc = holding(ends, max_connections=8)
        acc.start(listener())
        peers = [await connect(acc.port) for _ in range(3)]
        for r, _ in peers:
            assert await r.readexactly(2) == b"hi"
        await asyncio.sleep(0.05)
        assert acc.open_connections == 3
        await acc.stop_accepting()
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, peers[0][1].close)  # ends by itself within the deadline
        t0 = loop.time()
        cut = await acc.drain(0.5)
        waited = loop.time() - t0
        assert cut == 2 and sorted(ends) == ["cut", "cut", "peer"], (cut, ends)
        assert waited >= 0.5 and acc.open_connections == 0
        for _, w in peers[1:]:
            w.close()

    asyncio.run(main())


def test_drain_without_a_deadline_waits_for_every_held_connection() -> None:
    async def main() -> None:
        ends: list[str] = []
        acc = holding(ends, max_connections=8)
        acc.start(listener())
        peers = [await connect(acc.port) for _ in range(2)]
        for r, _ in peers:
            assert await r.readexactly(2) == b"hi"
        await acc.pause()
        loop = asyncio.get_running_loop()
        for i, (_, w) in enumerate(peers):
            loop.call_later(0.1 * (i + 1), w.close)
        assert await acc.drain(None) == 0
        assert ends == ["peer", "peer"] and acc.open_connections == 0

    asyncio.run(main())
