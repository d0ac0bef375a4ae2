"""The shared accept loop (sbxnet/accept.py) on a real loopback listener: pause keeps the socket, so a
connect made meanwhile waits in the backlog and is served at resume; stop_accepting closes it, so the
kernel refuses the next one."""

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
