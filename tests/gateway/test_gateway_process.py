"""`sbxnet gateway` as a process: settings errors, ops endpoints, a request through it, SIGHUP, SIGTERM."""

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
from typing import Any

import pytest
from gw_support import DOMAIN, EchoHttp, forwarder_settings, front_cert, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, free_port

SBXNET = [sys.executable, "-m", "sbxnet.app.cli"]


@pytest.fixture(scope="module")
def backend(pki: Pki) -> Iterator[tuple[ForwarderThread, EchoHttp]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = EchoHttp()
    yield fwd, app
    fwd.stop()
    app.stop()


def config(tmp: Path, pki: Pki, backend: tuple[ForwarderThread, EchoHttp], **extra: Any) -> Path:
    fwd, app = backend
    front = front_cert(pki)
    routes = tmp / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port)}}))
    gw_cert, gw_key = pki.paths["gateway"]
    values: dict[str, Any] = {
        "listen_host": '"127.0.0.1"', "listen_port": free_port(), "metrics_port": free_port(),
        "domain": f'"{DOMAIN}"', "cert_files": f'["{front.cert_file}"]', "key_files": f'["{front.key_file}"]',
        "routes_file": f'"{routes}"', "upstream_cert_file": f'"{gw_cert}"', "upstream_key_file": f'"{gw_key}"',
        "upstream_ca_file": f'"{pki.ca_file}"',
    }
    values.update(extra)
    path = tmp / "gateway.toml"
    path.write_text("[gateway]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
    return path


def toml_value(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"{key} = "):
            return line.split(" = ", 1)[1].strip('"')
    raise KeyError(key)


def wait_ready(mport: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=0.5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the gateway did not become ready")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"domain": '"bad..example"'}, "gateway.domain"),
        ({"listen_port": 70000}, "gateway.listen_port = 70000"),
        ({"lisen_port": 1}, "gateway.lisen_port: unknown setting"),
        ({"routes_file": '"/nonexistent/routes.json"'}, "gateway.routes_file"),
        ({"key_files": "[]"}, "gateway.key_files"),
        ({"workers": 257}, "gateway.workers = 257"),
        ({"scheduler_url": '"https://127.0.0.1:8700"'}, "exactly one of routes_file and scheduler_url"),
        ({"scheduler_url": '"http://127.0.0.1:8700"'}, "gateway.scheduler_url"),
        ({"scheduler_url": '"https://127.0.0.1:99999"'}, "gateway.scheduler_url"),
    ],
)
def test_each_bad_setting_is_named_and_exits_2(tmp_path: Path, pki: Pki, backend: Any, extra: dict[str, Any],
                                                message: str) -> None:
    r = subprocess.run([*SBXNET, "gateway", "--config", str(config(tmp_path, pki, backend, **extra))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_a_bad_routes_file_is_refused_at_start(tmp_path: Path, pki: Pki, backend: Any) -> None:
    path = config(tmp_path, pki, backend)
    Path(toml_value(path, "routes_file")).write_text('{"sandboxes": {"UPPER": {}}}')
    r = subprocess.run([*SBXNET, "gateway", "--config", str(path), "--check"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "routes.json" in r.stderr


def test_a_taken_port_is_a_clear_refusal(tmp_path: Path, pki: Pki, backend: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        path = config(tmp_path, pki, backend, listen_port=taken.getsockname()[1])
        r = subprocess.run([*SBXNET, "gateway", "--config", str(path)], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1
    assert "already in use" in r.stderr and "SBXNET_GATEWAY_LISTEN_PORT" in r.stderr


def test_serves_reloads_and_drains(tmp_path: Path, pki: Pki, backend: Any) -> None:
    path = config(tmp_path, pki, backend)
    port, mport = int(toml_value(path, "listen_port")), int(toml_value(path, "metrics_port"))
    proc = subprocess.Popen([*SBXNET, "gateway", "--config", str(path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_ready(mport, proc)
        curl = ["curl", "-sS", "--http1.1", "--cacert", str(pki.ca_file), "--resolve",
                f"alpha.{DOMAIN}:{port}:127.0.0.1", f"https://alpha.{DOMAIN}:{port}/hi"]
        r = subprocess.run(curl, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == "/hi", r.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as m:
            assert 'sbxnet_gateway_requests_total{kind="http",status="200"}' in m.read().decode()

        # A broken routes file on SIGHUP keeps the routes that were loaded.
        Path(toml_value(path, "routes_file")).write_text("{")
        os.kill(proc.pid, signal.SIGHUP)
        time.sleep(0.5)
        r = subprocess.run(curl, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == "/hi", r.stderr

        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    events = [json.loads(line).get("event") for line in err.splitlines() if line.startswith("{")]
    assert "listening" in events and "reload_failed" in events and "stopped" in events, err[-2000:]
    if proc.stderr:
        proc.stderr.close()
