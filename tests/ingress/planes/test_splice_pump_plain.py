"""The splice pump on plain TCP (no TLS): runs on any Linux kernel, including this host's."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator

import pytest
from pump_support import Receiver, Sender, open_fds, reset_close, stream, wait_events, wire

from forwarder.ingress.planes.splice_pump import EV_GW_FIN, EV_SB_EOF, PumpOutcome, SplicePump

MiB = 1 << 20


@pytest.fixture
def pump() -> Iterator[SplicePump]:
    before = open_fds()
    p = SplicePump(threads=2, max_conns=64)
    yield p
    p.close()
    assert open_fds() == before, "descriptors leaked"


def transfer(pump: SplicePump, conns: int, size: int) -> None:
    wired = [wire(pump) for _ in range(conns)]
    threads = []
    for i, w in enumerate(wired):
        up, down = stream(2 * i, size), stream(2 * i + 1, size)
        rs = (Receiver(w.sb_peer), Receiver(w.gw_peer))
        ss = (Sender(w.gw_peer, up), Sender(w.sb_peer, down))
        threads.append((w, up, down, rs, ss))
        for t in [*rs, *ss]:
            t.start()
    for _w, up, down, rs, ss in threads:
        for t in (*rs, *ss):
            t.join(120)
            assert not t.is_alive()
            assert t.error is None, t.error
        assert rs[0].n == size and rs[0].h.digest() == hashlib.sha256(up).digest()
        assert rs[1].n == size and rs[1].h.digest() == hashlib.sha256(down).digest()
    events = {e.conn_id: e for e in wait_events(pump, conns)}
    for w, *_ in threads:
        e = events[w.conn_id]
        assert e.outcome is PumpOutcome.CLOSED, e
        assert (e.bytes_up, e.bytes_down) == (size, size)
        assert e.flags & EV_GW_FIN and e.flags & EV_SB_EOF
        w.close()
    st = pump.stats()
    assert st.active == 0 and st.finished == st.added == conns


def test_64mib_each_way_both_at_once(pump: SplicePump) -> None:
    transfer(pump, 1, 64 * MiB)


def test_8_connections_at_once(pump: SplicePump) -> None:
    transfer(pump, 8, 8 * MiB)


def test_many_short_connections_reuse_slots() -> None:
    before = open_fds()
    with SplicePump(threads=2, max_conns=4) as pump:
        for round_ in range(25):
            wired = [wire(pump) for _ in range(4)]
            for i, w in enumerate(wired):
                msg = f"hello {round_} {i}".encode()
                w.gw_peer.sendall(msg)
                assert w.sb_peer.recv(100) == msg
                w.sb_peer.sendall(msg[::-1])
                assert w.gw_peer.recv(100) == msg[::-1]
                w.gw_peer.shutdown(socket.SHUT_WR)
                w.sb_peer.shutdown(socket.SHUT_WR)
                assert w.sb_peer.recv(10) == b"" and w.gw_peer.recv(10) == b""
            events = wait_events(pump, 4)
            assert sorted(e.conn_id for e in events) == sorted(w.conn_id for w in wired)
            assert all(e.outcome is PumpOutcome.CLOSED for e in events)
            for w in wired:
                w.close()
    assert open_fds() == before


def test_full_pump_refuses_and_caller_keeps_fds() -> None:
    with SplicePump(threads=1, max_conns=1) as pump:
        w = wire(pump)
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        with pytest.raises(OSError):
            pump.add(a.fileno(), b.fileno())
        a.close()  # still ours: closing must not raise EBADF
        b.close()
        w.close()


def test_blocking_fd_refused() -> None:
    with SplicePump() as pump:
        a, b = socket.socketpair()
        with pytest.raises(OSError):
            pump.add(a.fileno(), b.fileno())
        a.close()
        b.close()


@pytest.mark.parametrize("first", ["gateway", "sandbox"])
def test_half_close_each_way(pump: SplicePump, first: str) -> None:
    w = wire(pump)
    a, b = (w.gw_peer, w.sb_peer) if first == "gateway" else (w.sb_peer, w.gw_peer)
    a.sendall(b"request")
    a.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := b.recv(100):
        got += chunk
    assert got == b"request"  # then end of stream, while the other direction stays open
    assert pump.counters(w.conn_id) is not None
    reply = stream(9, 3 * MiB)
    Sender(b, reply).start()
    r = Receiver(a)
    r.run()
    assert r.error is None and r.h.digest() == hashlib.sha256(reply).digest()
    (e,) = wait_events(pump, 1)
    assert e.outcome is PumpOutcome.CLOSED
    up, down = (7, len(reply)) if first == "gateway" else (len(reply), 7)
    assert (e.bytes_up, e.bytes_down) == (up, down)
    w.close()


@pytest.mark.parametrize("who", ["gateway", "sandbox"])
def test_reset_each_way(pump: SplicePump, who: str) -> None:
    w = wire(pump)
    w.gw_peer.sendall(b"x" * 1000)
    assert w.sb_peer.recv(1000)
    resetter, other = (w.gw_peer, w.sb_peer) if who == "gateway" else (w.sb_peer, w.gw_peer)
    reset_close(resetter)
    with pytest.raises(ConnectionResetError):
        while other.recv(65536):
            pass
    (e,) = wait_events(pump, 1)
    expected = PumpOutcome.RESET_GATEWAY if who == "gateway" else PumpOutcome.RESET_SANDBOX
    assert e.outcome is expected and e.reason == "reset"
    other.close()


def test_reset_after_half_close(pump: SplicePump) -> None:
    w = wire(pump)
    w.sb_peer.shutdown(socket.SHUT_WR)
    assert w.gw_peer.recv(10) == b""
    reset_close(w.sb_peer)
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        for _ in range(100):
            w.gw_peer.sendall(b"y" * 65536)
            time.sleep(0.01)
        w.gw_peer.recv(10)
    (e,) = wait_events(pump, 1)
    assert e.outcome is PumpOutcome.RESET_SANDBOX
    w.gw_peer.close()


def test_close_timeout_on_remaining_direction(pump: SplicePump) -> None:
    w = wire(pump, close_timeout=0.3)
    w.gw_peer.shutdown(socket.SHUT_WR)
    assert w.sb_peer.recv(10) == b""
    t0 = time.monotonic()
    (e,) = wait_events(pump, 1, timeout=5)
    assert 0.25 <= time.monotonic() - t0 < 2
    assert e.outcome is PumpOutcome.CLOSE_TIMEOUT
    assert w.gw_peer.recv(10) == b""  # the gateway saw its remaining direction end
    w.close()


def test_back_pressure_holds_then_delivers(pump: SplicePump) -> None:
    w = wire(pump)
    w.gw_peer.setblocking(False)
    sent = bytearray()
    data = stream(5, 64 * MiB)
    # The sandbox reads nothing: the pump must stop reading, and the gateway's sends must block.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            n = w.gw_peer.send(data[len(sent) : len(sent) + MiB])
        except BlockingIOError:
            time.sleep(0.05)
            try:
                n = w.gw_peer.send(data[len(sent) : len(sent) + MiB])
            except BlockingIOError:
                break
        sent += data[len(sent) : len(sent) + n]
    assert len(sent) < len(data), "sender never blocked"
    calls = pump.stats().splice_calls
    time.sleep(0.3)
    assert pump.stats().splice_calls - calls < 10, "pump spins while blocked"
    w.gw_peer.setblocking(True)
    w.gw_peer.shutdown(socket.SHUT_WR)
    r = Receiver(w.sb_peer)
    r.run()
    assert r.n == len(sent) and r.h.digest() == hashlib.sha256(sent).digest()
    counters = pump.counters(w.conn_id)
    assert counters == (len(sent), 0)
    w.sb_peer.shutdown(socket.SHUT_WR)
    (e,) = wait_events(pump, 1)
    assert e.outcome is PumpOutcome.CLOSED and e.bytes_up == len(sent)
    w.close()


def test_take_moved_reports_each_change_once() -> None:
    """take_moved names a connection once per change of its counters, with the same totals as counters(),
    across more connections than one C batch (256) holds; idle ones are never named, finished ones never."""
    before = open_fds()
    pump = SplicePump(threads=2, max_conns=600)
    try:
        wired = [wire(pump) for _ in range(300)]
        assert pump.take_moved() == []
        moving = wired[::2]  # 150 move bytes, 150 stay idle
        for i, w in enumerate(moving):
            w.gw_peer.sendall(b"x" * (i + 1))
        for i, w in enumerate(moving):
            got = b""
            while len(got) < i + 1:
                got += w.sb_peer.recv(1000)
        moved = {c: (up, down) for c, up, down in pump.take_moved()}
        assert moved == {w.conn_id: (i + 1, 0) for i, w in enumerate(moving)}
        assert all(pump.counters(c) == v for c, v in moved.items())
        assert pump.take_moved() == []  # nothing changed since
        w = wired[1]
        w.sb_peer.sendall(b"back")
        got = b""
        while len(got) < 4:
            got += w.gw_peer.recv(10)
        assert pump.take_moved() == [(w.conn_id, 0, 4)]
        assert pump.abort(w.conn_id)
        wait_events(pump, 1)
        assert pump.take_moved() == []
        for x in wired:
            x.close()
    finally:
        pump.close()
    assert open_fds() == before, "descriptors leaked"


@pytest.mark.parametrize("reset", [False, True])
def test_abort(pump: SplicePump, reset: bool) -> None:
    w = wire(pump)
    assert pump.abort(w.conn_id, reset=reset)
    (e,) = wait_events(pump, 1)
    assert e.outcome is PumpOutcome.ABORTED and e.reason == ("abort_reset" if reset else "abort")
    if reset:
        with pytest.raises(ConnectionResetError):
            w.gw_peer.recv(10)
    else:
        assert w.gw_peer.recv(10) == b""
    assert not pump.abort(w.conn_id)
    assert pump.counters(w.conn_id) is None
    w.close()


def test_close_with_live_connections_releases_everything() -> None:
    before = open_fds()
    pump = SplicePump(threads=2)
    wired = [wire(pump) for _ in range(5)]
    pump.close()
    for w in wired:
        with pytest.raises(ConnectionResetError):
            w.gw_peer.recv(10)
        w.close()
    assert open_fds() == before
