"""Idle only on evidence, with ``sbxnet scheduler`` as a real process (issue 22, points 1, 2 and 19).

A forwarder's feed is played by the test (the forwarder certificate of ``mint_pki``, posting to
``/v1/feed`` as the forwarder's reporter does: a batch every interval, empty when nothing moved). Two
sandboxes with a short idle period: one routed to that forwarder, one to a forwarder that never fed.
Only the first is idled; ``sbxnet scheduler status --config <the scheduler's own file>`` (no --url, no
--ca-file, no --token-file) finds the scheduler at its configured address and says why the other is
not idled. Then the scheduler is stopped and restarted on the same database while the fed sandbox has
traffic: nothing is idled before its feed has reported again.

Before the fix: the never-fed sandbox went idle by its byte timer, status had no --config (and went to
127.0.0.1:8700 whatever the scheduler's address), and after a restart the sandbox with traffic went idle
before the feed's retry landed."""

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

import pytest
from sched_support import ADMIN, FORWARDER_SAN, GATEWAY_SAN, PIN, client_ctx, free_port, mint_pki, registration

from sbxnet.protocol.feed import new_epoch, push_columns
from scheduler.sqlite_store import SqliteStore

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
PERIOD = 1.0  # the sandboxes' idle period
UNFED = "10.9.9.9:8443"  # the forwarder that never feeds (its pin is not the feeding certificate's)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


def write_config(path: Path, pki: dict[str, Path], db: Path, port: int) -> Path:
    path.write_text("\n".join([
        "[scheduler]",
        'listen_host = "127.0.0.1"',
        f"listen_port = {port}",
        "metrics_port = 0",
        f'cert_file = "{pki["scheduler"]}"',
        f'key_file = "{pki["scheduler_key"]}"',
        f'ca_file = "{pki["ca"]}"',
        f'gateway_san_allow = ["{GATEWAY_SAN}"]',
        f'forwarder_san_allow = ["{FORWARDER_SAN}"]',
        f'admin_token_file = "{pki["admin_token"]}"',
        f'database = "sqlite://{db}"',
        "feed_interval = 0.2",
        "feed_retry_cap = 0.5",
    ]) + "\n")
    return path


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}


class Scheduler:
    def __init__(self, config: Path, port: int, db: Path, pki: dict[str, Path]) -> None:
        self.config, self.port, self.db, self.pki = config, port, db, pki
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = config.parent / "scheduler.log"  # its stderr, every run appended (never a full pipe)

    def start(self) -> None:
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen([*CLI, "scheduler", "--config", str(self.config)], env=clean_env(),
                                         stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                call(self.port, "GET", "/v1/sandboxes", None, self.pki)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise AssertionError("the scheduler did not answer")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, self.log.read_text()


def call(port: int, method: str, path: str, body: object, pki: dict[str, Path]) -> tuple[int, object]:
    req = urllib.request.Request(f"https://127.0.0.1:{port}{path}", method=method, headers=ADMIN,
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, context=client_ctx(pki, None), timeout=10) as resp:
        return resp.status, json.loads(resp.read())


class ForwarderFeed(threading.Thread):
    """A forwarder's reporter: a batch every ``interval`` (the bytes moved since the last one, if any, for
    ``traffic_for``), resent after a failure with the forwarder's backoff capped at ``cap``."""

    def __init__(self, port: int, pki: dict[str, Path], interval: float = 0.2, cap: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url = f"https://127.0.0.1:{port}/v1/feed?stream=0"
        self.ctx = client_ctx(pki, "forwarder")
        self.interval, self.cap = interval, cap
        self.traffic_for: str | None = None
        self.stopped = threading.Event()
        self.acked = 0

    def run(self) -> None:
        epoch, seq, body = new_epoch(time.time_ns(), os.urandom(8)), 1, None
        failures = 0
        while not self.stopped.is_set():
            if body is None:
                sids = [self.traffic_for] if self.traffic_for else []
                body = push_columns(epoch, seq, sids, [256] * len(sids), [256] * len(sids), [0] * len(sids),
                                    [50] * len(sids))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, context=self.ctx, timeout=2) as resp:
                    assert resp.status == 200
                seq, body, failures = seq + 1, None, 0
                self.acked += 1
                self.stopped.wait(self.interval)
            except (urllib.error.URLError, OSError):
                failures += 1
                self.stopped.wait(min(0.25 * 2 ** (failures - 1), self.cap))


@pytest.fixture
def sched(pki: dict[str, Path], tmp_path: Path) -> Iterator[Scheduler]:
    port = free_port()
    db = tmp_path / "db" / "s.db"
    s = Scheduler(write_config(tmp_path / "scheduler.toml", pki, db, port), port, db, pki)
    (tmp_path / "db").mkdir()
    s.start()
    try:
        yield s
    finally:
        if s.proc is not None:
            s.proc.kill()
            s.proc.wait()


def events(db: Path, sandbox: str) -> list[tuple[str, str, float]]:
    """(to, why, at) of each of the sandbox's events, as the scheduler committed them (its database read
    on a connection of the test's own)."""
    store = SqliteStore(db)
    try:
        return [(e.event.to_state.value, e.event.why.value, e.event.at) for e in store.events_after(0)
                if e.event.sandbox == sandbox]
    finally:
        store.close()


def state(port: int, pki: dict[str, Path], sandbox: str) -> dict[str, object]:
    _, row = call(port, "GET", f"/v1/sandboxes/{sandbox}", None, pki)
    assert isinstance(row, dict)
    return row


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out: {what}")


def test_only_a_live_feed_idles_and_status_from_the_config_says_why(sched: Scheduler, pki: dict[str, Path]) -> None:
    port = sched.port
    assert call(port, "PUT", "/v1/sandboxes/sbx-fed", registration(idle_period_s=PERIOD), pki)[0] == 201
    assert call(port, "PUT", "/v1/sandboxes/sbx-unfed",
                registration(idle_period_s=PERIOD, forwarder=UNFED, pin=PIN), pki)[0] == 201
    feed = ForwarderFeed(port, pki)
    feed.start()
    try:
        wait_for(lambda: state(port, pki, "sbx-fed")["state"] == "idle", 10 * PERIOD, "the fed sandbox idles")
        time.sleep(3 * PERIOD)
        unfed = state(port, pki, "sbx-unfed")
        assert unfed["state"] == "active" and unfed["idle_in_s"] is None
        assert str(unfed["idle_blocked"]).startswith(f"no feed from {UNFED} since "), unfed
        assert state(port, pki, "sbx-fed")["idle_blocked"] is None
        assert feed.acked >= 3 * PERIOD / 0.2  # an empty batch every interval
        # Status finds the scheduler from its own settings alone (the port is not 8700).
        out = subprocess.run([*CLI, "scheduler", "status", "--config", str(sched.config)], env=clean_env(),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        rows = {ln.split()[0]: ln for ln in out.stdout.splitlines()[1:]}
        assert f"no feed from {UNFED} since " in rows["sbx-unfed"] and " idle " in rows["sbx-fed"]
        # A flag still overrides what the file says.
        bad = subprocess.run([*CLI, "scheduler", "status", "--config", str(sched.config), "--url",
                              f"https://127.0.0.1:{free_port()}"], env=clean_env(),
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "cannot reach" in bad.stderr
    finally:
        feed.stopped.set()
        feed.join()
    assert [to for to, _, _ in events(sched.db, "sbx-unfed")] == ["active"]


def test_a_restarted_scheduler_idles_nothing_before_the_feed_reports_again(
    sched: Scheduler, pki: dict[str, Path]
) -> None:
    port = sched.port
    assert call(port, "PUT", "/v1/sandboxes/sbx-busy", registration(idle_period_s=PERIOD), pki)[0] == 201
    feed = ForwarderFeed(port, pki)
    feed.traffic_for = "sbx-busy"  # 256 B each way in every batch
    feed.start()
    try:
        wait_for(lambda: feed.acked >= 5, 10, "the feed reports")
        sched.stop()
        time.sleep(3 * PERIOD)  # longer than the idle period: the stored last activity is old at restart
        sched.start()
        acked = feed.acked
        wait_for(lambda: feed.acked >= acked + 10, 20, "the feed reports again")
        time.sleep(2 * PERIOD)
        evs = events(sched.db, "sbx-busy")
        assert [to for to, _, _ in evs] == ["active"], evs
        # Once the traffic stops (the feed goes on, empty) it idles, on the feed's evidence.
        feed.traffic_for = None
        wait_for(lambda: state(port, pki, "sbx-busy")["state"] == "idle", 10 * PERIOD, "idle once traffic stops")
    finally:
        feed.stopped.set()
        feed.join()
