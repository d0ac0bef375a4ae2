"""``sbxnet scheduler`` as an operator runs it: a real process on loopback, its settings checked at start
(each bad one named, exit 2), a clear refusal when the port is taken, SIGTERM, and ``sbxnet scheduler
status`` printing the table."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sched_support import ADMIN, ADMIN_SHA, FORWARDER_SAN, GATEWAY_SAN, client_ctx, free_port, mint_pki, registration
from test_liveness_process import ForwarderFeed

CLI = [sys.executable, "-m", "sbxnet.app.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return mint_pki(tmp_path_factory.mktemp("pki"))


def env_for(pki: dict[str, Path], db: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    env.update({
        "SBXNET_SCHEDULER_LISTEN_PORT": str(port),
        "SBXNET_SCHEDULER_METRICS_PORT": "0",
        "SBXNET_SCHEDULER_CERT_FILE": str(pki["scheduler"]),
        "SBXNET_SCHEDULER_KEY_FILE": str(pki["scheduler_key"]),
        "SBXNET_SCHEDULER_CA_FILE": str(pki["ca"]),
        "SBXNET_SCHEDULER_GATEWAY_SAN_ALLOW": GATEWAY_SAN,
        "SBXNET_SCHEDULER_FORWARDER_SAN_ALLOW": FORWARDER_SAN,
        "SBXNET_SCHEDULER_ADMIN_TOKEN_FILE": str(pki["admin_token"]),
        "SBXNET_SCHEDULER_DATABASE": f"sqlite://{db}",
        **extra,
    })
    return env


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError("the scheduler did not listen")


@pytest.fixture
def running(pki: dict[str, Path], tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "scheduler"], env=env_for(pki, tmp_path / "sub" / "s.db", port),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_listening(port, proc)
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def call(port: int, method: str, path: str, body: object, pki: dict[str, Path]) -> tuple[int, object]:
    req = urllib.request.Request(f"https://127.0.0.1:{port}{path}", method=method, headers=ADMIN,
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, context=client_ctx(pki, None), timeout=10) as resp:
        return resp.status, json.loads(resp.read())


def test_serves_registers_prints_status_and_stops_on_sigterm(
    running: tuple[int, subprocess.Popen[bytes]], pki: dict[str, Path], tmp_path: Path
) -> None:
    port, proc = running
    assert call(port, "PUT", "/v1/sandboxes/sbx-web", registration(), pki)[0] == 201
    assert call(port, "PUT", "/v1/sandboxes/sbx-db", registration(idle_period_s=0.3), pki)[0] == 201
    assert call(port, "POST", "/v1/sandboxes/sbx-web/hold", {"ttl_s": 3600}, pki)[0] == 200
    # sbx-db goes idle, on the evidence of its forwarder's live feed (the scheduler idles only on one).
    feed = ForwarderFeed(port, pki)
    feed.start()
    try:
        deadline = time.monotonic() + 10
        while call(port, "GET", "/v1/sandboxes/sbx-db", None, pki)[1]["state"] != "idle":  # type: ignore[index]
            assert time.monotonic() < deadline, "sbx-db never went idle"
            time.sleep(0.05)
    finally:
        feed.stopped.set()
        feed.join()
    out = subprocess.run([*CLI, "scheduler", "status", "--url", f"https://127.0.0.1:{port}",
                          "--ca-file", str(pki["ca"]), "--token-file", str(pki["admin_token"])],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["SANDBOX", "STATE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert rows["sbx-db"][1] == "idle" and rows["sbx-web"][1] == "active"
    assert "60m" in rows["sbx-web"]  # the hold, an hour from now
    (tmp_path / "wrong.token").write_text("not-the-token\n")
    bad = subprocess.run([*CLI, "scheduler", "status", "--url", f"https://127.0.0.1:{port}",
                          "--ca-file", str(pki["ca"]), "--token-file", str(tmp_path / "wrong.token")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "answered 403" in bad.stderr
    garbled = subprocess.run([*CLI, "scheduler", "status", "--url", f"https://127.0.0.1:{port}",
                              "--ca-file", str(pki["ca"]), "--token-file", str(pki["ca"])],
                             capture_output=True, text=True, timeout=30)
    assert garbled.returncode == 2 and "on one line" in garbled.stderr and "BEGIN" not in garbled.stderr
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    logs = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    assert [r.get("event") for r in logs if r.get("event") in ("listening", "stopped")] == ["listening", "stopped"]


def test_the_port_taken_is_a_clear_refusal(pki: dict[str, Path], tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = subprocess.run([*CLI, "scheduler"], env=env_for(pki, tmp_path / "s.db", port),
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"SBXNET_SCHEDULER_LISTEN_PORT": "70000"}, "scheduler.listen_port"),
        ({"SBXNET_SCHEDULER_DATABASE": "mysql://x"}, "scheduler.database"),
        ({"SBXNET_SCHEDULER_DATABASE": "sqlite://relative.db"}, "scheduler.database"),
        ({"SBXNET_SCHEDULER_WEBHOOK_URL": "ftp://x"}, "scheduler.webhook_url"),
        ({"SBXNET_SCHEDULER_ADMIN_TOKEN_SHA256": ADMIN_SHA}, "exactly one of admin_token_sha256"),
        ({"SBXNET_SCHEDULER_GATEWAY_SAN_ALLOW": ""}, "scheduler.gateway_san_allow"),
        ({"SBXNET_SCHEDULER_CERT_FILE": "/nonexistent.crt"}, "scheduler.cert_file"),
    ],
)
def test_each_bad_setting_is_named_with_exit_2(
    pki: dict[str, Path], tmp_path: Path, extra: dict[str, str], named: str
) -> None:
    env = env_for(pki, tmp_path / "s.db", free_port(), **extra)
    out = subprocess.run([*CLI, "scheduler", "--check"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and named in out.stderr, out.stderr


def test_an_unknown_setting_in_the_config_file_is_named(pki: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text("[scheduler]\nroute_cache = 5\n")
    out = subprocess.run([*CLI, "scheduler", "--check", "--config", str(tmp_path / "s.toml")],
                         env=env_for(pki, tmp_path / "s.db", free_port()), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "scheduler.route_cache: unknown setting" in out.stderr, out.stderr


def test_check_accepts_good_settings(pki: dict[str, Path], tmp_path: Path) -> None:
    out = subprocess.run([*CLI, "scheduler", "--check"], env=env_for(pki, tmp_path / "s.db", free_port()),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "valid" in out.stdout, out.stderr
