"""Moving live connections between splice pumps (sp_detach, sp_adopt, sp_resume): the core of a ktls
takeover (docs/forwarder.md, "Moving kTLS tunnels"). On plain TCP, so on this host. The descriptors are
duplicated between the pumps as SCM_RIGHTS would (new numbers, the same sockets and pipes), and the old
copies closed after the adoption, as the old process will."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator

import pytest
from pump_support import Receiver, Sender, open_fds, stream, wait_events, wire

from forwarder.ingress.planes.splice_pump import (
    DS_UP_IN_EOF,
    DS_UP_OUT_SHUT,
    EV_GW_FIN,
    EV_SB_EOF,
    Detached,
    PumpOutcome,
    SplicePump,
)

MiB = 1 << 20


@pytest.fixture
def pumps() -> Iterator[tuple[SplicePump, SplicePump]]:
    before = open_fds()
    a, b = SplicePump(threads=2, max_conns=64), SplicePump(threads=2, max_conns=64)
    yield a, b
    a.close()
    b.close()
    assert open_fds() == before, "descriptors leaked"


def moved(d: Detached) -> Detached:
    """``d`` as another process would receive it: duplicates of its descriptors; the old copies closed."""
    new = d.with_fds([os.dup(fd) for fd in d.fds])
    d.close()
    return new


class PacedSender(Sender):
    """Sends in 16 KiB chunks 5 ms apart (about 3 MB/s), so the move lands in the middle of the stream."""

    def run(self) -> None:
        try:
            view = memoryview(self.data)
            for off in range(0, len(view), 16384):
                self.sock.sendall(view[off : off + 16384])
                time.sleep(0.005)
            self.sock.shutdown(socket.SHUT_WR)
        except BaseException as e:  # reported by the test
            self.error = e


def test_connections_move_while_streaming_both_ways(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    size = 4 * MiB
    wired = [wire(a) for _ in range(8)]
    runs = []
    for i, w in enumerate(wired):
        up, down = stream(2 * i, size), stream(2 * i + 1, size)
        rs = (Receiver(w.sb_peer), Receiver(w.gw_peer))
        ss = (PacedSender(w.gw_peer, up), PacedSender(w.sb_peer, down))
        for t in (*rs, *ss):
            t.start()
        runs.append((w, up, down, rs, ss))
    time.sleep(0.3)
    details = []
    for w in wired:
        d = a.detach(w.conn_id)
        assert d is not None, "finished before the move: slow the senders down"
        details.append(d)
    assert a.stats().active == 0 and a.take_events() == []
    assert any(d.bytes_up or d.bytes_down for d in details), "nothing moved before the move"
    ids = [b.adopt(moved(d), paused=True) for d in details]
    for i in ids:
        assert b.resume(i)
    for _w, up, down, rs, ss in runs:
        for t in (*rs, *ss):
            t.join(120)
            assert not t.is_alive() and t.error is None, t.error
        assert rs[0].n == size and rs[0].h.digest() == hashlib.sha256(up).digest()
        assert rs[1].n == size and rs[1].h.digest() == hashlib.sha256(down).digest()
    events = {e.conn_id: e for e in wait_events(b, len(ids))}
    for i in ids:
        e = events[i]
        assert e.outcome is PumpOutcome.CLOSED, e
        assert (e.bytes_up, e.bytes_down) == (size, size)  # the counters went on from the detached ones
        assert e.flags & EV_GW_FIN and e.flags & EV_SB_EOF
    assert a.stats().bytes_up + b.stats().bytes_up - sum(d.bytes_up for d in details) == 8 * size
    for w in wired:
        w.close()


def test_bytes_waiting_in_a_pipe_move_with_it(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    w = wire(a)
    data = stream(11, 64 * MiB)
    s = Sender(w.gw_peer, data, shutdown=False)
    s.start()
    # The sandbox reads nothing: the pump's pipe fills and its write to the sandbox blocks.
    deadline = time.monotonic() + 20
    while True:
        c = a.counters(w.conn_id)
        time.sleep(0.1)
        if c == a.counters(w.conn_id) and s.is_alive():
            break
        assert time.monotonic() < deadline
    d = a.detach(w.conn_id)
    assert d is not None
    assert d.up_pipe_bytes > 0, "the test needs bytes in the pipe"
    new = b.adopt(moved(d))
    r = Receiver(w.sb_peer)
    r.start()
    s.join(60)
    assert s.error is None
    w.gw_peer.shutdown(socket.SHUT_WR)
    r.join(60)
    assert r.n == len(data) and r.h.digest() == hashlib.sha256(data).digest()  # none lost, none twice
    w.sb_peer.shutdown(socket.SHUT_WR)
    (e,) = wait_events(b, 1)
    assert e.conn_id == new and e.outcome is PumpOutcome.CLOSED and e.bytes_up == len(data)
    w.close()


def test_a_connection_given_back_to_its_own_pump_goes_on(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, _ = pumps
    w = wire(a)
    w.gw_peer.sendall(b"before")
    assert w.sb_peer.recv(10) == b"before"
    d = a.detach(w.conn_id)
    assert d is not None and d.bytes_up == 6
    assert a.counters(w.conn_id) is None and a.detach(w.conn_id) is None
    again = a.adopt(d)  # a takeover that failed: the old process keeps it
    w.gw_peer.sendall(b" after")
    assert w.sb_peer.recv(10) == b" after"
    # The pump counts a splice once the call returns, which can be after the peer has read its bytes.
    deadline = time.monotonic() + 5
    while a.counters(again) != (12, 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert a.counters(again) == (12, 0)
    w.gw_peer.shutdown(socket.SHUT_WR)
    w.sb_peer.shutdown(socket.SHUT_WR)
    assert w.sb_peer.recv(10) == b"" and w.gw_peer.recv(10) == b""
    (e,) = wait_events(a, 1)
    assert e.conn_id == again and e.outcome is PumpOutcome.CLOSED and e.bytes_up == 12
    w.close()


def test_paused_moves_nothing_until_resumed(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    w = wire(a)
    d = a.detach(w.conn_id)
    assert d is not None
    new = b.adopt(moved(d), paused=True)
    w.gw_peer.sendall(b"waits")
    w.sb_peer.settimeout(0.3)
    with pytest.raises(TimeoutError):
        w.sb_peer.recv(10)
    assert b.counters(new) == (0, 0) and b.stats().active == 1
    assert b.resume(new) and not b.resume(new)
    w.sb_peer.settimeout(10)
    assert w.sb_peer.recv(10) == b"waits"
    assert b.abort(new)
    wait_events(b, 1)
    w.close()


def test_half_close_and_its_close_timer_move(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    w = wire(a, close_timeout=1.0)
    w.gw_peer.sendall(b"request")
    w.gw_peer.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := w.sb_peer.recv(100):
        got += chunk
    assert got == b"request"  # its FIN arrived: the up direction ended, the close timer runs
    time.sleep(0.3)
    d = a.detach(w.conn_id)
    assert d is not None
    assert d.dir_state & DS_UP_IN_EOF and d.dir_state & DS_UP_OUT_SHUT and d.evflags & EV_GW_FIN
    assert 0 <= d.close_left_ms <= 800
    t0 = time.monotonic()
    b.adopt(moved(d))
    (e,) = wait_events(b, 1, timeout=10)
    # The rest of the timer, not a fresh one: about 0.7 s (generous bounds for a loaded host).
    assert time.monotonic() - t0 < 0.95 + 2.0
    assert e.outcome is PumpOutcome.CLOSE_TIMEOUT and e.flags & EV_GW_FIN
    assert w.gw_peer.recv(10) == b""
    w.close()


def test_a_finished_connection_is_not_detached(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, _ = pumps
    w = wire(a)
    w.gw_peer.shutdown(socket.SHUT_WR)
    w.sb_peer.shutdown(socket.SHUT_WR)
    (e,) = wait_events(a, 1)
    assert e.outcome is PumpOutcome.CLOSED
    assert a.detach(w.conn_id) is None
    w.close()


def test_adopt_refuses_what_it_cannot_take_and_leaves_the_descriptors(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    w = wire(a)
    d = a.detach(w.conn_id)
    assert d is not None
    with pytest.raises(OSError):
        b.adopt(d.with_fds([d.gw_fd, d.gw_fd, *d.fds[2:]]))  # one descriptor twice
    os.set_blocking(d.sb_fd, True)
    with pytest.raises(OSError):
        b.adopt(d)
    os.set_blocking(d.sb_fd, False)
    with pytest.raises(OSError):
        b.adopt(Detached(**{**d.__dict__, "up_pipe_bytes": 1 << 30}))  # more than the pipe holds
    assert b.stats().added == 0
    b.adopt(d)  # all still usable: nothing was closed
    w.gw_peer.sendall(b"ok")
    assert w.sb_peer.recv(10) == b"ok"
    w.close()


def test_a_paused_connection_detaches_as_it_was_adopted(pumps: tuple[SplicePump, SplicePump]) -> None:
    a, b = pumps
    w = wire(a)
    w.gw_peer.sendall(b"x" * 10)
    assert w.sb_peer.recv(10) == b"x" * 10
    d = a.detach(w.conn_id)
    assert d is not None
    paused = b.adopt(moved(d), paused=True)
    back = b.detach(paused)  # a takeover given up: the new process lets go of what it never ran
    assert back is not None and back.bytes_up == 10 and back.dir_state == d.dir_state
    assert b.stats().active == 0 and b.resume(paused) is False
    a.adopt(moved(back))
    w.gw_peer.sendall(b"y")
    assert w.sb_peer.recv(10) == b"y"
    w.close()
