"""takeover._alive: a running process lives; one that exited but is not yet reaped (a zombie) does not,
nor does a pid nobody has."""

from __future__ import annotations

import subprocess
import sys
import time

from forwarder.ingress.takeover import _alive


def test_running_zombie_and_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert _alive(p.pid)
        assert p.stdin is not None
        p.stdin.close()  # it exits; not reaped until wait()
        deadline = time.monotonic() + 30
        while _alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(p.pid)
        assert p.poll() is not None  # it was a zombie until now
    finally:
        p.kill()
        p.wait()
    assert not _alive(p.pid)
