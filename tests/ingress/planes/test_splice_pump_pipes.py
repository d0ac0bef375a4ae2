"""The splice pump's pipes: what the kernel really gave is what counts, and a kernel-TLS connection whose
pipe cannot hold a whole record is refused (``PipeTooSmall``), never spliced into a pipe that would cut
its records. On plain TCP (the ``ktls`` flag on a plain pair: the check is in ``sp_add``, before any
byte moves), so these run on this host's kernel."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pump_support import Receiver, Sender, open_fds, stream, tcp_pair, wait_events, wire

from forwarder.ingress.planes.splice_pump import KTLS_MIN_PIPE, PipeTooSmall, PumpOutcome, SplicePump

F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
ROOT = Path(__file__).resolve().parents[3]


def pipe_fds() -> dict[int, str]:
    """This process's pipe descriptors, fd -> its pipe inode's name."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            out[int(name)] = target
    return out


def nonblocking_pair() -> tuple[socket.socket, socket.socket, socket.socket, socket.socket]:
    """(gateway peer, gateway side, sandbox side, sandbox peer); the two middle ones non-blocking."""
    gw_peer, gw = tcp_pair()
    sb, sb_peer = tcp_pair()
    gw.setblocking(False)
    sb.setblocking(False)
    return gw_peer, gw, sb, sb_peer


def test_a_forced_small_pipe_is_what_the_pump_uses_on_plain_tcp() -> None:
    before_fds = open_fds()
    with SplicePump(threads=1, max_conns=4, pipe_size=8192) as pump:
        before = pipe_fds()
        w = wire(pump)
        new = sorted(set(pipe_fds()) - set(before))
        assert len(new) == 4  # two pipes, two ends each
        # Each pipe really is the size asked for, smaller than the kernel's 64 KiB default.
        assert {fcntl.fcntl(fd, F_GETPIPE_SZ) for fd in new} == {8192}
        data = stream(3, 4 << 20)
        r = Receiver(w.sb_peer)
        r.start()
        s = Sender(w.gw_peer, data)
        s.start()
        s.join(60)
        r.join(60)
        assert s.error is None and r.error is None
        assert r.n == len(data) and r.h.digest() == hashlib.sha256(data).digest()
        w.sb_peer.shutdown(socket.SHUT_WR)
        (e,) = wait_events(pump, 1)
        assert e.outcome is PumpOutcome.CLOSED and e.bytes_up == len(data)
        w.close()
    assert open_fds() == before_fds


@pytest.mark.parametrize("pipe_size", [4096, 8192, 16384])
def test_ktls_connection_with_a_pipe_under_a_record_is_refused(pipe_size: int) -> None:
    before_fds = open_fds()
    with SplicePump(threads=1, max_conns=4, pipe_size=pipe_size) as pump:
        gw_peer, gw, sb, sb_peer = nonblocking_pair()
        before = pipe_fds()
        with pytest.raises(PipeTooSmall) as info:
            pump.add(gw.fileno(), sb.fileno(), ktls=True)
        assert "a TLS record would not fit" in str(info.value)
        assert pipe_fds() == before  # the pipes it made were closed again
        assert pump.stats().added == 0
        # The descriptors are still the caller's: usable, and closing them must not raise EBADF.
        gw_peer.sendall(b"x")
        assert gw.recv(1) == b"x"
        for s in (gw_peer, gw, sb, sb_peer):
            s.close()
        # The same pump takes a plain pair with the same pipes: the limit is kTLS's alone.
        w = wire(pump)
        w.gw_peer.sendall(b"plain")
        assert w.sb_peer.recv(10) == b"plain"
        assert pump.abort(w.conn_id)
        wait_events(pump, 1)
        w.close()
    assert open_fds() == before_fds


def test_ktls_connection_at_the_minimum_is_taken() -> None:
    with SplicePump(threads=1, max_conns=4, pipe_size=KTLS_MIN_PIPE) as pump:
        gw_peer, gw, sb, sb_peer = nonblocking_pair()
        conn_id = pump.add(gw.detach(), sb.detach(), ktls=True)
        assert pump.abort(conn_id, reset=True)
        (e,) = wait_events(pump, 1)
        assert e.outcome is PumpOutcome.ABORTED
        for s in (gw_peer, sb_peer):
            s.close()


# What a non-root forwarder meets: 1 MiB pipes (256 pages each) until the user's pipe pages reach
# fs/pipe-user-pages-soft, then two-page pipes the kernel will not let it grow.
CHILD = r"""
import fcntl, json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from forwarder.ingress.planes.splice_pump import PipeTooSmall, SplicePump

def pair():
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0)); lst.listen(1)
        c = socket.create_connection(lst.getsockname()); s, _ = lst.accept()
    return c, s

def pipes():
    out = set()
    for n in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("pipe:"):
                out.add(int(n))
        except OSError:
            pass
    return out

pump = SplicePump(threads=1, max_conns=256)
keep, sizes, refused = [], [], None
for i in range(200):
    gp, g = pair(); s, sp = pair()
    g.setblocking(False); s.setblocking(False)
    before = pipes()
    try:
        pump.add(g.fileno(), s.fileno(), ktls=True)
    except PipeTooSmall as e:
        refused = {"at": i, "errno": e.errno, "pipes_left": len(pipes() - before)}
        break
    sizes += [fcntl.fcntl(fd, 1032) for fd in pipes() - before]
    g.detach(); s.detach()
    keep += [gp, sp]
print(json.dumps({"refused": refused, "sizes": sorted(set(sizes))}))
pump.close()
"""


def test_past_the_pipe_page_limit_a_ktls_connection_is_refused_not_truncated() -> None:
    soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv(1), to run the pump without CAP_SYS_RESOURCE and CAP_SYS_ADMIN")
    if soft == 0:
        pytest.skip("fs/pipe-user-pages-soft is 0: no per-user pipe limit here")
    # Root without the two capabilities is limited as any user is (the accounting is root's, shared with
    # every root process here: the limit may come earlier, never later).
    r = subprocess.run(
        [setpriv, "--bounding-set=-sys_resource,-sys_admin", "--", sys.executable, "-c", CHILD, str(ROOT)],
        capture_output=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    refused = got["refused"]
    # 1 MiB pipes, two per tunnel: the soft limit is met after soft / 512 tunnels (32 by default), give or
    # take what other root processes' pipes hold and free meanwhile; far fewer than the 200 tried.
    assert refused is not None, got
    assert refused["at"] <= 2 * (soft // 512)
    assert refused["errno"] == errno.ENOBUFS
    assert refused["pipes_left"] == 0
    assert all(size >= KTLS_MIN_PIPE for size in got["sizes"]), got  # every tunnel taken had whole-record pipes
