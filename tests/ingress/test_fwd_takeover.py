"""Upgrades that drop no tunnel (issue 11 point 4), userspace plane, one process: real ``sbxnet forwarder``
children. A new one started with ``--takeover`` gets the listening socket from the running one; the old
one keeps its tunnels until they end and exits; nothing is refused or cut meanwhile, and what each moved
is accounted exactly. A new process that dies before its READY, or after it but before its DONE, leaves
the old one serving everything."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fwd_support import GwClient, Pki, SandboxApp, payload, preamble_for
from test_fwd_process import SBXNET, Proc, config_port, http_get, procs, write_config

from forwarder.ingress.takeover_codec import MAX_MESSAGE, Hello, Offer, Ready, pull_message, push_message
from sbxnet.protocol.status import Status

__all__ = ["procs"]  # the fixture, shared with test_fwd_process

TUNNELS = 50
CHUNK = 4096
TICK_S = 0.010  # a new connection every 10 ms


def echo(conn: socket.socket) -> None:
    """Echo everything; end when the gateway ends. The sandbox's own digest is kept for the test."""
    h = hashlib.sha256()
    n = 0
    while data := conn.recv(1 << 16):
        h.update(data)
        n += len(data)
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
    echo_digests.append((h.digest(), n))


echo_digests: list[tuple[bytes, int]] = []


class Tunnel(threading.Thread):
    """One long tunnel: sends CHUNK bytes, reads their echo, again (``pause`` s apart), until told to
    finish; then close_notify + FIN and the rest of the echo. Both ends' digests are checked by the test."""

    def __init__(self, port: int, pki: Pki, app_port: int, seed: int, pause: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pause = pause
        self.client = GwClient(port, pki.client_ctx(), timeout=60)
        assert self.client.open(preamble_for(app_port, sandbox_id=f"sbx-long-{seed}")) is Status.OK
        self.seed = seed
        self.finish = threading.Event()
        self.sent = hashlib.sha256()
        self.back = hashlib.sha256()
        self.n = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            i = 0
            while not self.finish.is_set():
                data = payload(CHUNK, self.seed * 100_000 + i)
                i += 1
                self.client.send(data)
                self.sent.update(data)
                self.back.update(self.client.recv_exact(len(data)))
                self.n += len(data)
                time.sleep(self.pause)
            self.client.close_write()
            rest = self.client.recv_all()
            assert rest == b"", rest[:20]
            self.client.close()
        except BaseException as e:
            self.error = e


class Arrivals(threading.Thread):
    """A new short connection every TICK_S, each in its own thread: open, a payload, its echo back whole."""

    def __init__(self, port: int, pki: Pki, app_port: int, tick: float = TICK_S) -> None:
        super().__init__(daemon=True)
        self.port, self.pki, self.app_port, self.tick = port, pki, app_port, tick
        self.stop = threading.Event()
        self.started = 0
        self.ok = 0
        self.bytes = 0
        self.failures: list[str] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def one(self, k: int) -> None:
        data = payload(1000 + k % 3000, 7_000_000 + k)
        try:
            c = GwClient(self.port, self.pki.client_ctx(), timeout=60)
            status = c.open(preamble_for(self.app_port, sandbox_id=f"sbx-short-{k % 5}"))
            if status is not Status.OK:
                raise AssertionError(f"status {status}")
            c.send(data)
            c.close_write()
            back = c.recv_all()
            c.close()
            if back != data:
                raise AssertionError(f"echo of {len(back)} bytes, not the {len(data)} sent")
            with self._lock:
                self.ok += 1
                self.bytes += len(data)
        except BaseException as e:
            with self._lock:
                self.failures.append(f"connection {k}: {type(e).__name__}: {e}")

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            t = threading.Thread(target=self.one, args=(self.started,), daemon=True)
            t.start()
            self._threads.append(t)
            self.started += 1
            next_at += self.tick
            time.sleep(max(0.0, next_at - time.monotonic()))

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads)


def closed_events(p: Proc) -> list[dict[str, object]]:
    return p.events("closed")


def byte_fields(record: dict[str, object]) -> dict[str, int]:
    fields = record.get("fields", record)
    assert isinstance(fields, dict)
    return {k: int(fields[k]) for k in ("bytes_up", "bytes_down")}


def field(record: dict[str, object], key: str) -> object:
    fields = record.get("fields")
    return fields[key] if isinstance(fields, dict) and key in fields else record.get(key)


def test_takeover_under_load_refuses_nothing_cuts_nothing_and_accounts_every_byte(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    from fwd_support import free_port

    echo_digests.clear()
    control = tmp_path / "control.sock"
    mport = free_port()
    cfg = write_config(tmp_path / "f.toml", pki, metrics_port=mport, takeover_socket=f'"{control}"')
    old = Proc(cfg)
    procs.append(old)
    old.wait_listening()
    old.wait_for("takeover_listening")
    assert stat.S_IMODE(os.stat(control).st_mode) == 0o600
    app = SandboxApp(echo)

    tunnels = [Tunnel(old.port, pki, app.port, seed) for seed in range(TUNNELS)]
    for t in tunnels:
        t.start()
    arrivals = Arrivals(old.port, pki, app.port)
    arrivals.start()
    time.sleep(1.0)

    new = Proc(cfg, "--takeover", str(control))
    procs.append(new)
    (done,) = new.wait_for("takeover_done", timeout=60)
    assert field(done, "released") is True
    assert field(done, "stream") == 1  # the old one goes on reporting on stream 0 meanwhile
    assert field(done, "old_kept_connections") is not None
    old.wait_for("taken_over")
    time.sleep(1.0)  # connections keep arriving: the new process alone accepts them now
    arrivals.finish()

    # The old one serves its tunnels still, and only those; it exits once they end.
    assert old.p.poll() is None
    for t in tunnels:
        t.finish.set()
    for t in tunnels:
        t.join(120)
        assert not t.is_alive()
        assert t.error is None, t.error
        assert t.sent.digest() == t.back.digest()
    old.wait_exit(60)
    assert old.p.returncode == 0, old.err
    app.join(60, connections=TUNNELS + arrivals.started)

    # Zero refused, zero cut.
    assert arrivals.failures == [], arrivals.failures[:5]
    assert arrivals.ok == arrivals.started >= 100
    # Both far ends saw the same bytes: each sandbox digest is one of the gateways' digests.
    long_digests = sorted((t.sent.digest(), t.n) for t in tunnels)
    assert sorted(d for d in echo_digests if d in set(long_digests)) == long_digests

    # Who served what: every long tunnel stayed with the old process; new connections went to both
    # before the release and only to the new one after it.
    old_closed, new_closed = closed_events(old), closed_events(new)
    assert all(field(e, "outcome") == "closed" for e in old_closed + new_closed)
    assert len(old_closed) + len(new_closed) == TUNNELS + arrivals.started
    long_ids = {f"sbx-long-{i}" for i in range(TUNNELS)}
    assert {e["sandbox_id"] for e in old_closed} >= long_ids
    assert not any(e["sandbox_id"] in long_ids for e in new_closed)
    assert new_closed, "the new process served nothing"

    # Exact bytes across the move: the old one's totals (its meter, at its exit) cover its tunnels and
    # nothing else; with the new one's they are every byte the gateways sent and got back.
    (old_stop,) = old.events("stopped")
    assert field(old_stop, "taken_over") is True and field(old_stop, "cut") == 0
    old_sum = sum(byte_fields(e)["bytes_up"] for e in old_closed)
    assert field(old_stop, "bytes_up") == field(old_stop, "bytes_down") == old_sum
    total = sum(t.n for t in tunnels) + arrivals.bytes
    new_sum = sum(byte_fields(e)["bytes_up"] for e in new_closed)
    assert old_sum + new_sum == total

    # The new one serves the ops port now, and its metrics count what it served.
    deadline = time.monotonic() + 5
    while True:
        code, text = http_get(mport, "/metrics")
        line = f'sbxnet_forwarder_bytes_total{{direction="up"}} {float(new_sum)}'
        if code == 200 and line in text:
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.2)  # flushed once a second
    assert http_get(mport, "/readyz")[0] == 200

    # The next upgrade: the new one serves the control socket it was handed; with no tunnels left it
    # exits as soon as it released the listener.
    newer = Proc(cfg, "--takeover", str(control))
    procs.append(newer)
    (done,) = newer.wait_for("takeover_done", timeout=60)
    assert field(done, "stream") == 2 and field(done, "old_kept_connections") == 0
    new.wait_exit(30)
    assert new.p.returncode == 0, new.err
    (new_stop,) = new.events("stopped")
    assert field(new_stop, "bytes_up") == field(new_stop, "bytes_down") == new_sum
    c = GwClient(newer.port, pki.client_ctx())
    assert c.open(preamble_for(app.port)) is Status.OK
    c.close()
    code, err = newer.stop()
    assert code == 0, err
    assert not control.exists()  # removed by the last process, at its stop


# A new process killed half-way: it has the listener and the control socket (HELLO, OFFER, descriptors
# received) and never says READY.
HALF_WAY = r"""
import os, socket, sys, time
sys.path.insert(0, sys.argv[2])
from forwarder.ingress.takeover_codec import MAX_MESSAGE, Hello, Ready, pull_message, push_message
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
c.send(push_message(Hello(os.getpid())))
data, fds, _, _ = socket.recv_fds(c, MAX_MESSAGE + 1, 4)
print(len(fds), flush=True)
if sys.argv[3] == "ready":  # says READY without ever accepting, and waits for RELEASED
    c.send(push_message(Ready(os.getpid(), False)))
    print(type(pull_message(c.recv(MAX_MESSAGE + 1))).__name__, flush=True)
time.sleep(60)
"""


class Serving:
    """A running forwarder with a control socket, 10 long tunnels through it and a new connection every
    TICK_S: what a half-way takeover must leave untouched."""

    def __init__(self, tmp_path: Path, pki: Pki, procs: list[Proc], **extra: object) -> None:
        self.control = tmp_path / "control.sock"
        self.pki = pki
        self.cfg = write_config(tmp_path / "f.toml", pki, takeover_socket=f'"{self.control}"', **extra)
        self.old = Proc(self.cfg)
        procs.append(self.old)
        self.old.wait_listening()
        self.old.wait_for("takeover_listening")
        self.app = SandboxApp(echo)
        self.tunnels = [Tunnel(self.old.port, pki, self.app.port, seed) for seed in range(10)]
        for t in self.tunnels:
            t.start()
        self.arrivals = Arrivals(self.old.port, pki, self.app.port)
        self.arrivals.start()
        time.sleep(0.3)

    def half_way(self, stage: str) -> subprocess.Popen[bytes]:
        """A stand-in new process that takes the offer (and, at ``ready``, says READY and reads RELEASED)."""
        root = Path(__file__).resolve().parents[2]
        half = subprocess.Popen([sys.executable, "-c", HALF_WAY, str(self.control), str(root), stage],
                                stdout=subprocess.PIPE)
        assert half.stdout is not None
        assert half.stdout.readline().strip() == b"2"  # it holds the listener and the control socket
        if stage == "ready":
            assert half.stdout.readline().strip() == b"Released"  # the old one stopped accepting
        return half

    def all_served(self) -> None:
        """Every tunnel and arrival served whole by the old process, which was never taken over."""
        self.arrivals.finish()
        for t in self.tunnels:
            t.finish.set()
        for t in self.tunnels:
            t.join(60)
            assert t.error is None, t.error
            assert t.sent.digest() == t.back.digest()
        assert self.arrivals.failures == [], self.arrivals.failures[:5]
        assert self.arrivals.ok == self.arrivals.started >= 50
        assert not self.old.events("taken_over") and self.old.p.poll() is None

    def still_taken_over(self, procs: list[Proc]) -> None:
        """The control socket is still served: a real takeover afterwards works."""
        new = Proc(self.cfg, "--takeover", str(self.control))
        procs.append(new)
        new.wait_for("takeover_done", timeout=60)
        self.old.wait_exit(30)
        assert self.old.p.returncode == 0
        c = GwClient(new.port, self.pki.client_ctx())
        assert c.open(preamble_for(self.app.port)) is Status.OK
        c.close()
        assert new.stop()[0] == 0


def test_a_new_process_killed_before_ready_leaves_the_old_one_serving_everything(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    run = Serving(tmp_path, pki, procs)
    old = run.old
    half = run.half_way("offer")
    old.wait_for("takeover_offered")
    time.sleep(0.3)
    half.send_signal(signal.SIGKILL)
    half.wait(10)
    (failed,) = old.wait_for("takeover_failed")
    assert failed["reason"] == "ended_before_ready"
    time.sleep(0.5)

    # A real new process that fails half-way: these settings serve another port than the running one.
    other = write_config(tmp_path / "other.toml", pki, takeover_socket=f'"{run.control}"')
    r = subprocess.run([*SBXNET, "forwarder", "--config", str(other), "--takeover", str(run.control)],
                       capture_output=True, timeout=60)
    assert r.returncode == 1
    assert f"listens on 127.0.0.1:{old.port}, these settings on 127.0.0.1:{config_port(other)}" in r.stderr.decode()
    assert len(old.wait_for("takeover_failed", count=2)) == 2
    time.sleep(0.5)
    run.all_served()
    run.still_taken_over(procs)


def test_a_new_process_killed_after_ready_before_it_finished_leaves_the_old_one_serving_everything(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    """Past READY the running one has stopped accepting, but it keeps its copy of the listener until the
    new one says DONE: a new process killed in between (here one that never accepts) leaves connects
    waiting in the backlog, not refused, and the old one takes them and every later one."""
    from fwd_support import free_port

    mport = free_port()
    run = Serving(tmp_path, pki, procs, metrics_port=mport)
    old = run.old
    half = run.half_way("ready")
    old.wait_for("released")
    time.sleep(0.3)  # connects arrive meanwhile and wait in the backlog: nobody accepts them
    half.send_signal(signal.SIGKILL)
    half.wait(10)
    (failed,) = old.wait_for("takeover_failed")
    assert failed["reason"] == "ended_before_done"
    old.wait_for("resumed")
    time.sleep(0.5)
    run.all_served()
    assert http_get(mport, "/readyz")[0] == 200  # ready again
    run.still_taken_over(procs)


def test_a_running_forwarder_stopped_during_a_takeover_leaves_the_control_path_to_the_new_one(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    """SIGTERM after READY, before DONE: the old one drains and exits, and does not remove the control
    socket's path, which the new process serves (here a stand-in that holds it after READY)."""
    control = tmp_path / "control.sock"
    cfg = write_config(tmp_path / "f.toml", pki, takeover_socket=f'"{control}"')
    old = Proc(cfg)
    procs.append(old)
    old.wait_listening()
    old.wait_for("takeover_listening")
    root = Path(__file__).resolve().parents[2]
    half = subprocess.Popen([sys.executable, "-c", HALF_WAY, str(control), str(root), "ready"], stdout=subprocess.PIPE)
    try:
        assert half.stdout is not None
        assert half.stdout.readline().strip() == b"2"
        assert half.stdout.readline().strip() == b"Released"
        assert old.stop()[0] == 0
        assert control.exists()
        # The path still reaches the listener the stand-in holds.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.connect(str(control))
        probe.close()
    finally:
        half.kill()
        half.wait(10)


def test_a_new_process_whose_takeover_does_not_finish_steps_back_while_the_running_one_lives(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    """The running side here is this test (alive throughout): it offers a real listener, takes READY and
    then closes the control link without RELEASED. The new process, which accepted one connection
    meanwhile, must step back: accept nothing more, serve that connection to its end, exit 1; the
    listener stays the test's, with what waited in its backlog."""
    control = tmp_path / "control.sock"
    cfg = write_config(tmp_path / "f.toml", pki, takeover_socket=f'"{control}"')
    port = config_port(cfg)
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", port))
    lst.listen(64)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(control))
    srv.listen(1)
    app = SandboxApp(echo)
    new = Proc(cfg, "--takeover", str(control))
    procs.append(new)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    assert isinstance(pull_message(conn.recv(MAX_MESSAGE + 1)), Hello)
    socket.send_fds(conn, [push_message(Offer(os.getpid(), f"127.0.0.1:{port}", 1, ("tls", "control")))],
                    [lst.fileno(), srv.fileno()])
    assert isinstance(pull_message(conn.recv(MAX_MESSAGE + 1)), Ready)
    early = Tunnel(port, pki, app.port, 1)  # the new one accepts it, READY said
    early.start()
    new.wait_for("connected")
    conn.close()
    (abandoned,) = new.wait_for("takeover_abandoned", timeout=30)
    assert abandoned["released"] is False and abandoned["open"] == 1
    # It accepts no more: a connect now waits in the listener's backlog for us.
    lst.settimeout(10)
    waiting = socket.create_connection(("127.0.0.1", port), timeout=10)
    got, _ = lst.accept()
    got.close()
    waiting.close()
    assert new.p.poll() is None  # still serving the connection it took
    time.sleep(0.3)
    early.finish.set()
    early.join(60)
    assert early.error is None, early.error
    assert early.sent.digest() == early.back.digest()
    new.wait_exit(30)
    assert new.p.returncode == 1
    assert not new.events("takeover_done")
    (stopped,) = new.events("stopped")
    assert stopped["stepped_back"] is True and stopped["cut"] == 0
    assert control.exists()  # the running side's path, left alone
    lst.close()
    srv.close()


def test_a_second_forwarder_on_the_same_control_socket_is_refused(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    control = tmp_path / "control.sock"
    old = Proc(write_config(tmp_path / "f.toml", pki, takeover_socket=f'"{control}"'))
    procs.append(old)
    old.wait_for("takeover_listening", timeout=20)
    r = subprocess.run([*SBXNET, "forwarder", "--config", str(write_config(tmp_path / "g.toml", pki,
                        takeover_socket=f'"{control}"'))], capture_output=True, timeout=60)
    assert r.returncode == 1
    assert f"a forwarder already serves the control socket {control}: start this one with --takeover" in \
        r.stderr.decode()
    # A peer that speaks the protocol wrong is refused and the forwarder goes on.
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(str(control))
    c.send(b"GET / HTTP/1.0\r\n\r\n")
    assert c.recv(MAX_MESSAGE) == b""
    c.close()
    (failed,) = old.wait_for("takeover_failed")
    assert failed["reason"] == "bad_magic"
    # A killed forwarder's stale socket file does not stop the next one.
    old.kill()
    old.wait_exit(10)
    assert control.exists()
    again = Proc(write_config(tmp_path / "h.toml", pki, takeover_socket=f'"{control}"'))
    procs.append(again)
    again.wait_for("takeover_listening", timeout=20)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(str(control))
    c.send(push_message(Hello(os.getpid())))
    data, fds, _, _ = socket.recv_fds(c, MAX_MESSAGE + 1, 4)
    offer = pull_message(data)
    assert isinstance(offer, Offer) and offer.fds == ("tls", "control") and len(fds) == 2
    for fd in fds:
        os.close(fd)
    c.close()  # no READY: it keeps serving
    again.wait_for("takeover_failed")
    again.wait_listening()


def test_takeover_needs_one_worker(tmp_path: Path, pki: Pki) -> None:
    cfg = write_config(tmp_path / "f.toml", pki, workers=2, takeover_socket=f'"{tmp_path / "c.sock"}"')
    r = subprocess.run([*SBXNET, "forwarder", "--config", str(cfg), "--check"], capture_output=True, timeout=30)
    assert r.returncode == 2
    assert "takeover_socket needs workers = 1" in r.stderr.decode()


# Another user's process, speaking the protocol right: a HELLO given as hex.
STRANGER = r"""
import socket, sys
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    c.connect(sys.argv[1])
except PermissionError:
    print("eacces"); sys.exit(0)
try:
    c.send(bytes.fromhex(sys.argv[2]))
    data = c.recv(4096)
except (BrokenPipeError, ConnectionResetError):  # closed before our HELLO, or with it unread
    data = b""
print("answered" if data else "closed")
"""


def test_only_root_or_the_forwarders_user_may_take_over(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.getuid() != 0 or setpriv is None or not os.access(python, os.X_OK):
        pytest.skip("needs root, setpriv(1) and a system python3 to connect as another user (nobody)")
    public = Path(tempfile.mkdtemp(dir="/tmp", prefix="sbxnet-takeover-"))
    try:
        public.chmod(0o755)
        control = public / "control.sock"
        old = Proc(write_config(tmp_path / "f.toml", pki, takeover_socket=f'"{control}"'))
        procs.append(old)
        old.wait_for("takeover_listening", timeout=20)
        hello = push_message(Hello(4242)).hex()

        def as_nobody() -> str:
            r = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", python, "-c",
                                STRANGER, str(control), hello], capture_output=True, timeout=30)
            assert r.returncode == 0, r.stderr.decode()
            return r.stdout.decode().strip()

        assert as_nobody() == "eacces"  # mode 0600
        control.chmod(0o666)  # a mode set wrong by hand: the credentials still keep it out
        assert as_nobody() == "closed"
        (refused,) = old.wait_for("takeover_refused")
        assert refused["reason"] == "peer_not_allowed" and refused["peer_uid"] == 65534
        assert not old.events("takeover_offered")
        assert old.stop()[0] == 0
    finally:
        shutil.rmtree(public, ignore_errors=True)
