"""A takeover that moves live kTLS tunnels (issue 11 point 4): real ``sbxnet forwarder`` children on the
ktls plane. The new process gets the listener and every tunnel in the old one's pump (descriptors,
pipes with their bytes, counters), the old one exits, and the tunnels go on streaming in the new one:
nothing refused, cut, lost or sent twice, and each tunnel's bytes counted once across the two processes.
A new process that dies before the commit leaves the tunnels and the listener with the old one, which
goes on serving both. Needs CONFIG_TLS: scripts/ktls-tests.sh runs these inside a Debian kernel.

Status: passes in the emulated kernel (KTLS_TAKEOVER=1 scripts/ktls-tests.sh -k takeover, 10 tunnels, a
connection a second): twice in a row, 562 s and 773 s, and then in the whole kTLS run (22 passed in 614 s,
with tunnels sending every 200 ms there). Earlier runs never finished: the emulator could not
keep up with a connection every 100 ms, and pyproject's 300 s per-test timeout cut the first test just
before its takeover_done (see the figures below)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ingress: fwd_support, the process tests
import test_fwd_takeover as tk
from fwd_support import Pki, SandboxApp, make_pki
from test_fwd_process import Proc, procs, write_config

pytestmark = [
    pytest.mark.ktls,
    # Under the emulator this module takes 9-13 minutes (two forwarder starts under load), more than the
    # whole kTLS run's default budget (480 s): there it runs when asked for (KTLS_TAKEOVER=1
    # KTLS_VM_TIMEOUT=1800 scripts/ktls-tests.sh), and always where the kernel has TLS natively.
    pytest.mark.skipif(os.environ.get("SBXNET_IN_VM") == "1" and os.environ.get("KTLS_TAKEOVER") != "1",
                       reason="moving kTLS tunnels takes 9-13 minutes under the emulator, past this run's budget; "
                              "run it with KTLS_TAKEOVER=1 KTLS_VM_TIMEOUT=1800 scripts/ktls-tests.sh"),
    # pyproject's 300 s per test is less than two forwarders' starts under the emulator (each past a
    # minute, the second, under the first one's load, up to four): a run cut there is no result.
    pytest.mark.timeout(1800 if os.environ.get("SBXNET_IN_VM") == "1" else 300),
]
# The figures on a kernel with TLS. Under QEMU's software emulation (scripts/ktls-tests.sh) a TLS
# handshake takes the better part of a second of emulated CPU on each side, and a new forwarder's start
# (imports) takes over a minute of both emulated CPUs: a connection every 100 ms there piled up faster
# than they were served (handshakes past the 5 s timeout by the hundred, threads by the thousand, the
# run past the VM's limit). So there the same checks run at a load the emulator keeps up with, and a
# handshake may take up to a minute: functional, not the load the issue names.
IN_VM = os.environ.get("SBXNET_IN_VM") == "1"
TUNNELS = int(os.environ.get("KTLS_TAKEOVER_TUNNELS", "10" if IN_VM else "50"))
TICK_S = float(os.environ.get("KTLS_TAKEOVER_TICK_S", "1.0" if IN_VM else "0.01"))
HANDSHAKE_S = 60 if IN_VM else 5
# Between a tunnel's chunks. The tunnels' TLS in this process took most of the emulated CPUs: at 20 ms
# the new forwarder took 320-683 s to its takeover_done (past START_S once, at host load 6); at 200 ms, 111 s.
PAUSE_S = 0.2 if IN_VM else 0.02
# Where the processes' logs and the test's steps are written as they come (scripts/ktls-tests.sh sets it
# inside the VM and keeps them): a run the VM's time limit cuts short still shows where it was.
TRACE_DIR = os.environ.get("KTLS_TRACE_DIR")
__all__ = ["procs"]  # the fixture, shared with test_fwd_process


@pytest.fixture(scope="module")
def kpki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("kpki-takeover"))


def ktls_config(path: Path, pki: Pki, control: Path) -> Path:
    cfg = write_config(path, pki, takeover_socket=f'"{control}"', connect_deadline=30, connect_syn_interval=1,
                       takeover_timeout=600 if IN_VM else 120, takeover_move_ktls="true", handshake_timeout=HANDSHAKE_S,
                       preamble_timeout=30 if IN_VM else 2)
    cfg.write_text(cfg.read_text().replace('data_plane = "userspace"', 'data_plane = "ktls"'))
    return cfg


# Emulated CPUs: a new interpreter takes a minute or more to import everything and listen, and the new
# process, under the old one's load, took 320, 392 and 683 s to its takeover_done (host load 4 to 7).
START_S = 900 if IN_VM else 60


def listening(p: Proc) -> None:
    try:
        p.wait_listening(timeout=START_S)
        p.wait_for("takeover_listening", timeout=60)
    except AssertionError as e:
        raise AssertionError(f"{e}; its log so far:\n{p.err[-4000:]}") from None


class Trace(threading.Thread):
    """With KTLS_TRACE_DIR set: every 5 s, each process's log so far and the test's steps, to files there."""

    def __init__(self, name: str, procs: list[Proc]) -> None:
        super().__init__(daemon=True)
        self.name, self.procs = name, procs
        self.steps: list[str] = []
        self.t0 = time.monotonic()
        self.done = threading.Event()
        if TRACE_DIR:
            self.start()

    def step(self, what: str) -> None:
        self.steps.append(f"{time.monotonic() - self.t0:8.1f}s {what}\n")
        self.flush()

    def flush(self) -> None:
        if not TRACE_DIR:
            return
        d = Path(TRACE_DIR)
        (d / f"{self.name}.steps").write_text("".join(self.steps))
        for i, p in enumerate(list(self.procs)):
            (d / f"{self.name}.proc{i}.log").write_text(p.err)

    def run(self) -> None:
        while not self.done.wait(5.0):
            self.flush()


def by_conn(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(r["conn_id"]): r for r in records}


def test_tunnels_move_to_the_new_process_and_the_old_one_exits(tmp_path: Path, kpki: Pki, procs: list[Proc]) -> None:
    tk.echo_digests.clear()
    control = tmp_path / "control.sock"
    cfg = ktls_config(tmp_path / "f.toml", kpki, control)
    trace = Trace("move", procs)
    old = Proc(cfg)
    procs.append(old)
    listening(old)
    trace.step("old process listening")
    app = SandboxApp(tk.echo)
    tunnels = [tk.Tunnel(old.port, kpki, app.port, seed, PAUSE_S) for seed in range(TUNNELS)]
    for t in tunnels:
        t.start()
    trace.step(f"{TUNNELS} tunnels open")
    arrivals = tk.Arrivals(old.port, kpki, app.port, tick=TICK_S)
    arrivals.start()
    time.sleep(2.0)

    new = Proc(cfg, "--takeover", str(control))
    procs.append(new)
    trace.step("new process started")
    (done,) = new.wait_for("takeover_done", timeout=START_S)
    trace.step(f"takeover_done {done}")
    moved = done["tunnels_moved"]
    assert isinstance(moved, int) and moved >= TUNNELS
    new.wait_for("tunnels_adopted", timeout=60)
    (went,) = old.wait_for("tunnels_moved", timeout=60)
    assert went["moved"] == moved
    old.wait_exit(120)  # its tunnels are gone: nothing keeps it
    trace.step(f"old process exited {old.p.returncode}")
    assert old.p.returncode == 0, old.err
    time.sleep(2.0)  # the tunnels stream on in the new process alone
    arrivals.finish()
    trace.step(f"arrivals finished: {arrivals.started} started, {arrivals.ok} ok, {len(arrivals.failures)} failed")
    for t in tunnels:
        t.finish.set()
    for t in tunnels:
        t.join(300)
        assert not t.is_alive() and t.error is None, t.error
        assert t.sent.digest() == t.back.digest()
    trace.step("tunnels finished")
    app.join(120, connections=TUNNELS + arrivals.started)
    assert arrivals.failures == [], arrivals.failures[:5]
    assert arrivals.ok == arrivals.started
    long_digests = sorted((t.sent.digest(), t.n) for t in tunnels)
    assert sorted(d for d in tk.echo_digests if d in set(long_digests)) == long_digests

    # Each long tunnel: "moved" in the old process with the bytes up to the move, "closed" in the new one
    # (adopted) with the rest; together its bytes exactly, each counted once.
    old_moved = by_conn([e for e in old.events("closed") if e["outcome"] == "moved"])
    new_adopted = by_conn([e for e in new.events("closed") if e.get("adopted")])
    assert set(old_moved) == set(new_adopted) and len(old_moved) == moved
    long_ids = {f"sbx-long-{i}" for i in range(TUNNELS)}
    per_sandbox = {str(e["sandbox_id"]): int(e["bytes_up"]) + int(new_adopted[c]["bytes_up"])
                   for c, e in old_moved.items()}
    for t in tunnels:
        assert per_sandbox[f"sbx-long-{t.seed}"] == t.n
    assert all(new_adopted[c]["outcome"] == "closed" for c in old_moved if old_moved[c]["sandbox_id"] in long_ids)
    (old_stop,) = old.events("stopped")
    new.stop()
    trace.step("new process stopped")
    trace.done.set()
    (new_stop,) = new.events("stopped")
    total = sum(t.n for t in tunnels) + arrivals.bytes
    assert int(old_stop["bytes_up"]) + int(new_stop["bytes_up"]) == total


# A new process that takes the offer, says READY (able to adopt), receives the first tunnel and is killed
# before it adopts it: the old one must take every tunnel back.
HALF_WAY = r"""
import os, socket, sys, time
sys.path.insert(0, sys.argv[2])
from forwarder.ingress.takeover_codec import MAX_MESSAGE, Hello, Ready, push_message
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
c.send(push_message(Hello(os.getpid())))
socket.recv_fds(c, MAX_MESSAGE + 1, 4)
c.send(push_message(Ready(os.getpid(), True)))
released = c.recv(MAX_MESSAGE + 1)
socket.recv_fds(c, MAX_MESSAGE + 1, 6)
print("got a tunnel", flush=True)
time.sleep(60)
"""


def test_a_new_process_killed_before_the_commit_leaves_the_tunnels_with_the_old_one(
    tmp_path: Path, kpki: Pki, procs: list[Proc]
) -> None:
    tk.echo_digests.clear()
    control = tmp_path / "control.sock"
    trace = Trace("halfway", procs)
    old = Proc(ktls_config(tmp_path / "f.toml", kpki, control))
    procs.append(old)
    listening(old)
    trace.step("old process listening")
    app = SandboxApp(tk.echo)
    tunnels = [tk.Tunnel(old.port, kpki, app.port, seed, PAUSE_S) for seed in range(min(TUNNELS, 10))]
    for t in tunnels:
        t.start()
    trace.step(f"{len(tunnels)} tunnels open")
    time.sleep(1.0)
    root = Path(__file__).resolve().parents[3]
    half = subprocess.Popen([sys.executable, "-c", HALF_WAY, str(control), str(root)], stdout=subprocess.PIPE)
    assert half.stdout is not None
    assert half.stdout.readline().strip() == b"got a tunnel"
    half.send_signal(signal.SIGKILL)
    half.wait(30)
    trace.step("half-way process killed")
    (failed,) = old.wait_for("takeover_failed", timeout=120)
    trace.step(f"takeover_failed {failed}")
    assert failed["reason"] == "tunnels_given_back" and failed["given_back"] >= len(tunnels)
    time.sleep(1.0)  # they stream on in the old process
    for t in tunnels:
        t.finish.set()
    for t in tunnels:
        t.join(300)
        assert not t.is_alive() and t.error is None, t.error
        assert t.sent.digest() == t.back.digest()
    trace.step("tunnels finished")
    # It holds the listener still (no DONE came) and accepts again: a new tunnel is served here.
    old.wait_for("resumed")
    late = tk.Tunnel(old.port, kpki, app.port, 99, PAUSE_S)
    late.start()
    time.sleep(0.5)
    late.finish.set()
    late.join(300)
    assert not late.is_alive() and late.error is None, late.error
    assert late.sent.digest() == late.back.digest()
    tunnels.append(late)
    trace.step("a new tunnel served after the failed takeover")
    rc, err = old.stop()
    trace.step(f"old process exited {rc}")
    trace.done.set()
    assert rc == 0, err
    closed = [e for e in old.events("closed") if str(e["sandbox_id"]).startswith("sbx-long-")]
    assert sorted(int(e["bytes_up"]) for e in closed) == sorted(t.n for t in tunnels)
    assert all(e["outcome"] == "closed" for e in closed)
