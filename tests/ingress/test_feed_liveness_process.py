"""Issue 22, points 1 and 2, with real processes: ``sbxnet forwarder`` carrying a tunnel with traffic (256 B
each way every 100 ms through an echo app) and ``sbxnet scheduler`` on a SQLite file, both on loopback,
the forwarder's feed sent with its own link certificate (whose pin the route carries).

1. The scheduler is stopped for several idle periods and restarted on the same database while traffic
   flows: no sandbox is declared idle after the restart (before the fix it went idle at once, the stored
   last activity being older than its period, and active again only when the forwarder's retry landed).
2. A forwarder with no ``feed_url``: its sandbox with traffic is never idled (before: idled after its
   period), and ``sbxnet scheduler status`` says why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fwd_support import GwClient, Pki, preamble_for
from test_feed_wiring import FWD_SAN, FeedPki, Moved, echo_app, echo_round_trip, fpki, wait_until
from test_fwd_process import Proc, free_port, write_config

from certs.mint import mint_leaf, spki_pin, write_issued
from sbxnet.protocol.status import Status
from scheduler.sqlite_store import SqliteStore

__all__ = ["fpki"]  # a fixture, used by name

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
TOKEN = "liveness-admin-token"
PERIOD = 1.5  # the sandbox's idle period


@pytest.fixture(scope="module")
def fwd_cert(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The forwarder's certificate for both its link (server) and its feed (client, the URI SAN the
    scheduler allows), and its pin."""
    d = tmp_path_factory.mktemp("fwd-cert")
    leaf = mint_leaf(pki.ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",), uris=(FWD_SAN,), server=True,
                     client=True)
    cert, key = write_issued(leaf, d, "forwarder")
    return cert, key, spki_pin(leaf.cert)


class Scheduler:
    def __init__(self, tmp: Path, pki: Pki, fpki: FeedPki) -> None:
        self.port = free_port()
        self.db = tmp / "sched.db"
        token = tmp / "admin.token"
        token.write_text(TOKEN + "\n")
        self.ca = pki.ca_file
        self.config = tmp / "scheduler.toml"
        self.config.write_text("\n".join([
            "[scheduler]",
            'listen_host = "127.0.0.1"',
            f"listen_port = {self.port}",
            "metrics_port = 0",
            f'cert_file = "{fpki["scheduler"]}"',
            f'key_file = "{fpki["scheduler_key"]}"',
            f'ca_file = "{pki.ca_file}"',
            'gateway_san_allow = ["spiffe://sbxnet.test/gateway"]',
            f'forwarder_san_allow = ["{FWD_SAN}"]',
            f'admin_token_file = "{token}"',
            f'database = "sqlite://{self.db}"',
            "feed_interval = 0.2",
        ]) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp / "scheduler.log"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
        with self.log.open("ab") as err:  # its stderr, every run appended (never a full pipe)
            self.proc = subprocess.Popen([*CLI, "scheduler", "--config", str(self.config)], env=env,
                                         stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.admin("GET", "/v1/sandboxes")
                return
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline, "the scheduler did not answer"
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, self.log.read_text()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def admin(self, method: str, path: str, body: object = None) -> object:
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.ca))
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}", method=method,
                                     headers={"Authorization": f"Bearer {TOKEN}"},
                                     data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return json.loads(resp.read())

    def register(self, sandbox: str, fwd_port: int, pin: str, app_port: int) -> None:
        self.admin("PUT", f"/v1/sandboxes/{sandbox}", {
            "incarnation": "inc-1", "forwarder": {"address": f"127.0.0.1:{fwd_port}", "spki_pin": pin},
            "target_ip": "127.0.0.1", "default_port": app_port,
            "ports": {str(app_port): {"protocol": "tcp", "auth": "public"}},
            "idle_period_s": PERIOD, "activity": "bytes",
        })

    def events(self, sandbox: str) -> list[tuple[str, str, float]]:
        """(to, why, at) of the sandbox's committed events, read on a connection of the test's own."""
        store = SqliteStore(self.db)
        try:
            return [(e.event.to_state.value, e.event.why.value, e.event.at) for e in store.events_after(0)
                    if e.event.sandbox == sandbox]
        finally:
            store.close()

    def row(self, sandbox: str) -> dict[str, Any]:
        row = self.admin("GET", f"/v1/sandboxes/{sandbox}")
        assert isinstance(row, dict)
        return row


@pytest.fixture
def sched(tmp_path: Path, pki: Pki, fpki: FeedPki) -> Iterator[Scheduler]:
    s = Scheduler(tmp_path, pki, fpki)
    s.start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
        p.wait_exit(None)


def forwarder(tmp: Path, pki: Pki, cert: tuple[Path, Path, str], procs: list[Proc], **extra: object) -> Proc:
    """``sbxnet forwarder`` with ``cert`` for its link and (by default) its feed."""
    path = write_config(tmp / "fwd.toml", pki, **extra)
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(("cert_file", "key_file"))]
    lines.insert(1, f'cert_file = "{cert[0]}"')
    lines.insert(2, f'key_file = "{cert[1]}"')
    path.write_text("\n".join(lines) + "\n")
    proc = Proc(path)
    procs.append(proc)
    proc.wait_listening()
    return proc


class Traffic(threading.Thread):
    """256 B each way every 100 ms through one tunnel to the echo app, until stopped."""

    def __init__(self, fwd_port: int, pki: Pki, app_port: int, sandbox: str) -> None:
        super().__init__(daemon=True)
        self.client = GwClient(fwd_port, pki.client_ctx())
        assert self.client.open(preamble_for(app_port, sandbox_id=sandbox)) is Status.OK
        self.sandbox, self.moved = sandbox, Moved()
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.1):
                echo_round_trip(self.client, self.sandbox, os.urandom(256), self.moved)
        except BaseException as e:
            self.error = e

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.client.close()
        assert self.error is None, self.error


def test_a_scheduler_restart_while_traffic_flows_idles_nothing(
    tmp_path: Path, pki: Pki, fwd_cert: tuple[Path, Path, str], sched: Scheduler, procs: list[Proc]
) -> None:
    app = echo_app()
    fwd = forwarder(tmp_path, pki, fwd_cert, procs, feed_url=f'"https://127.0.0.1:{sched.port}/v1/feed"',
                    feed_ca_file=f'"{pki.ca_file}"', feed_interval=0.2)
    sched.register("sbx-busy", fwd.port, fwd_cert[2], app.port)
    assert fwd.events("feed_key_differs") == [] and fwd.events("feed_disabled") == []
    traffic = Traffic(fwd.port, pki, app.port, "sbx-busy")
    traffic.start()
    try:
        wait_until(lambda: (sched.row("sbx-busy")["bytes_in"] or 0) > 0, 10, lambda: sched.row("sbx-busy"))
        sched.stop()
        stopped_at = time.time()
        time.sleep(3 * PERIOD)  # the stored last activity is two periods old at the restart
        sched.start()
        restarted_at = time.time()
        wait_until(lambda: (sched.row("sbx-busy")["last_activity"] or 0) > restarted_at, 10,
                   lambda: sched.row("sbx-busy"))
        time.sleep(2 * PERIOD)  # traffic goes on
        evs = sched.events("sbx-busy")
        assert [to for to, _, _ in evs] == ["active"], (evs, stopped_at, restarted_at)
        # Once the traffic stops, the feed (reporting empty batches) is the evidence: idle after a period.
        traffic.stop()
        quiet_from = time.time()
        wait_until(lambda: sched.row("sbx-busy")["state"] == "idle", 6 * PERIOD, lambda: sched.row("sbx-busy"))
        ((_, why, at),) = [e for e in sched.events("sbx-busy") if e[0] == "idle"]
        assert why == "idle_timer" and at >= quiet_from + PERIOD - 0.5
    finally:
        if traffic.is_alive():
            traffic.stop()
        app.close()


def test_a_forwarder_with_no_feed_never_has_its_sandbox_idled_and_status_says_why(
    tmp_path: Path, pki: Pki, fwd_cert: tuple[Path, Path, str], sched: Scheduler, procs: list[Proc]
) -> None:
    app = echo_app()
    fwd = forwarder(tmp_path, pki, fwd_cert, procs)  # no feed_url
    assert len(fwd.wait_for("feed_disabled")) == 1
    sched.register("sbx-nofeed", fwd.port, fwd_cert[2], app.port)
    traffic = Traffic(fwd.port, pki, app.port, "sbx-nofeed")
    traffic.start()
    try:
        time.sleep(4 * PERIOD)
        row = sched.row("sbx-nofeed")
        assert row["state"] == "active" and row["idle_in_s"] is None, row
        assert str(row["idle_blocked"]).startswith(f"no feed from 127.0.0.1:{fwd.port} since "), row
        assert [to for to, _, _ in sched.events("sbx-nofeed")] == ["active"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
        out = subprocess.run([*CLI, "scheduler", "status", "--url", f"https://127.0.0.1:{sched.port}", "--ca-file",
                              str(pki.ca_file), "--token-file", str(sched.config.parent / "admin.token")], env=env,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"no feed from 127.0.0.1:{fwd.port} since " in out.stdout, out.stdout
    finally:
        traffic.stop()
        app.close()
