"""Real loopback peers for the splice pump tests: a gateway peer and a sandbox peer around the pump."""

from __future__ import annotations

import hashlib
import os
import random
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

from forwarder.ingress.planes.splice_pump import PumpEvent, SplicePump


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(client, accepted server side), connected over 127.0.0.1."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        c = socket.create_connection(lst.getsockname())
        s, _ = lst.accept()
    return c, s


@dataclass
class Wired:
    """``gw_peer`` talks to the pump's gateway side, ``sb_peer`` to its sandbox side."""

    gw_peer: socket.socket
    sb_peer: socket.socket
    conn_id: int

    def close(self) -> None:
        self.gw_peer.close()
        self.sb_peer.close()


def wire(pump: SplicePump, *, close_timeout: float = 10.0, timeout: float = 60.0) -> Wired:
    gw_peer, gw = tcp_pair()
    sb, sb_peer = tcp_pair()
    for s in (gw, sb):
        s.setblocking(False)
    conn_id = pump.add(gw.detach(), sb.detach(), close_timeout=close_timeout)
    gw_peer.settimeout(timeout)
    sb_peer.settimeout(timeout)
    return Wired(gw_peer, sb_peer, conn_id)


def stream(seed: int, size: int) -> bytes:
    """Deterministic test data."""
    return random.Random(seed).randbytes(size)


class Sender(threading.Thread):
    def __init__(self, sock: socket.socket, data: bytes, *, shutdown: bool = True) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.shutdown = sock, data, shutdown
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            view = memoryview(self.data)
            for off in range(0, len(view), 1 << 20):
                self.sock.sendall(view[off : off + (1 << 20)])
            if self.shutdown:
                self.sock.shutdown(socket.SHUT_WR)
        except BaseException as e:  # reported by the test
            self.error = e


class Receiver(threading.Thread):
    """Reads to EOF, hashing as it goes."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.h = hashlib.sha256()
        self.n = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                k = self.sock.recv_into(buf)
                if not k:
                    return
                self.h.update(view[:k])
                self.n += k
        except BaseException as e:
            self.error = e


def wait_events(pump: SplicePump, count: int, timeout: float = 30.0) -> list[PumpEvent]:
    events: list[PumpEvent] = []
    deadline = time.monotonic() + timeout
    while len(events) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(events)} of {count} pump events")
        r, _, _ = select.select([pump.event_fd], [], [], left)
        if r:
            events += pump.take_events()
    return events


def reset_close(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
