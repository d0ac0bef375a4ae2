"""`sbxnet gateway` with workers: processes sharing the port (SO_REUSEPORT) under the supervisor
(sbxnet/supervisor.py), in front of a real forwarder and real apps: both workers serve, /metrics sums
them, SIGHUP reaches each, a killed worker is restarted, SIGTERM drains them all, a taken port is refused."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gw_support import DOMAIN, EchoHttp, forwarder_settings, front_cert, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, free_port

SBXNET = [sys.executable, "-m", "sbxnet.app.cli"]


class HeldApp(http.server.ThreadingHTTPServer):
    """A sandbox's HTTP app that answers only once ``release`` is set (requests in flight during a drain)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self) -> None:
        self.release = threading.Event()
        self.arrived = 0
        super().__init__(("127.0.0.1", 0), _HeldHandler)
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A link the gateway resets (its client vanished mid-exchange, or the drain cut it) reaches the app
        # as a reset: the keep-alive read fails. Not this program's error to print.
        pass

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class _HeldHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        server: HeldApp = self.server  # type: ignore[assignment]
        server.arrived += 1
        server.release.wait(30)
        body = b"released"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def backend(pki: Pki) -> Iterator[tuple[ForwarderThread, EchoHttp, HeldApp]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = EchoHttp(ident="alpha")
    held = HeldApp()
    yield fwd, app, held
    fwd.stop()
    app.stop()
    held.stop()


def write_config(tmp: Path, pki: Pki, backend: tuple[ForwarderThread, EchoHttp, HeldApp], **extra: Any) -> Path:
    fwd, app, held = backend
    front = front_cert(pki)
    routes = tmp / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {"alpha": registration(
        pki, fwd.port, {app.port: ("http", "public"), held.port: ("http", "public")}, default=app.port)}}))
    gw_cert, gw_key = pki.paths["gateway"]
    values: dict[str, Any] = {
        "listen_host": '"127.0.0.1"', "listen_port": free_port(), "metrics_port": free_port(),
        "domain": f'"{DOMAIN}"', "cert_files": f'["{front.cert_file}"]', "key_files": f'["{front.key_file}"]',
        "routes_file": f'"{routes}"', "upstream_cert_file": f'"{gw_cert}"', "upstream_key_file": f'"{gw_key}"',
        "upstream_ca_file": f'"{pki.ca_file}"', "workers": 2, "drain_timeout": 20,
    }
    values.update(extra)
    path = tmp / "gateway.toml"
    path.write_text("[gateway]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
    return path


def toml_int(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(f"{key} = "):
            return int(line.split(" = ", 1)[1])
    raise KeyError(key)


class Gateway:
    """``sbxnet gateway`` in its own process group; its stderr (the JSON lines of the supervisor and of its
    workers, which inherit it) read as it comes."""

    def __init__(self, config: Path) -> None:
        self.port = toml_int(config, "listen_port")
        self.mport = toml_int(config, "metrics_port")
        self.p = subprocess.Popen([*SBXNET, "gateway", "--config", str(config)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, start_new_session=True)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self._lines.append(line.decode(errors="replace"))

    @property
    def err(self) -> str:
        return "".join(self._lines)

    def events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self._lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                out.append(record)
        return out

    def wait_for(self, event: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(found := self.events(event)) < count:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{len(found)} of {count} {event!r} lines after {timeout}s:\n{self.err[-4000:]}")
            time.sleep(0.02)
        return found

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        for fam in text_string_to_metric_families(self.get("/metrics")[1]):
            for s in fam.samples:
                if s.name == name and s.labels == (labels or {}):
                    return float(s.value)
        return None

    def stop(self) -> tuple[int, str]:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(40)
        except subprocess.TimeoutExpired:
            self.kill()
            self.p.wait()
        self._reader.join(10)
        return self.p.returncode, self.err

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # the workers too
        except ProcessLookupError:
            pass


@pytest.fixture
def gateways() -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for g in started:
        g.kill()
        g.p.wait()
        g._reader.join(10)
        if g.p.stderr:
            g.p.stderr.close()


def start(gateways: list[Gateway], config: Path, workers: int = 2) -> tuple[Gateway, set[int]]:
    """The gateway up, every worker listening (before the first connection, or one could take them all),
    /readyz 200; the workers' pids."""
    g = Gateway(config)
    gateways.append(g)
    pids = {int(r["pid"]) for r in g.wait_for("listening", count=workers)}
    assert len(pids) == workers and (g.p.pid in pids) == (workers == 1)  # one worker: no supervisor
    deadline = time.monotonic() + 10
    while True:
        try:
            if g.get("/readyz")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, g.err[-4000:]
        time.sleep(0.05)
    return g, pids


def client_ctx(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def open_conn(port: int, ctx: ssl.SSLContext, host: str = f"alpha.{DOMAIN}") -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=20)
    return ctx.wrap_socket(raw, server_hostname=host)


def read_response(tls: ssl.SSLSocket) -> tuple[int, bytes]:
    """One response with a Content-Length (what these apps send)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length")
    while len(body) < length:
        chunk = tls.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), body


def request(tls: ssl.SSLSocket, path: str = "/", host: str = f"alpha.{DOMAIN}", close: bool = False) -> None:
    extra = "connection: close\r\n" if close else ""
    tls.sendall(f"GET {path} HTTP/1.1\r\nhost: {host}\r\n{extra}\r\n".encode())


def one_request(port: int, ctx: ssl.SSLContext) -> int:
    """A request on a connection of its own (a new source port: SO_REUSEPORT may pick either worker)."""
    with open_conn(port, ctx) as tls:
        request(tls, close=True)
        status, body = read_response(tls)
        assert json.loads(body)["sandbox"] == "alpha"
        return status


def served_by(g: Gateway) -> Counter[int]:
    """Links opened per worker pid (each request here opens one: the log's link_open lines)."""
    return Counter(int(r["pid"]) for r in g.events("link_open"))


def test_two_workers_share_the_port_sum_metrics_and_take_sighup(
    tmp_path: Path, pki: Pki, backend: Any, gateways: list[Gateway]
) -> None:
    g, pids = start(gateways, write_config(tmp_path, pki, backend))
    ctx = client_ctx(pki)
    # SO_REUSEPORT picks a worker by a hash of the source port: with 32 connections, the chance that one
    # worker gets them all is 2 in 2**32.
    n = 32
    assert [one_request(g.port, ctx) for _ in range(n)] == [200] * n
    per_worker = served_by(g)
    assert set(per_worker) == pids and sum(per_worker.values()) == n, per_worker

    # Counters summed over the workers; the open-connections gauge summed over the live ones.
    assert g.sample("sbxnet_gateway_requests_total", {"kind": "http", "status": "200"}) == n
    held = []
    for _ in range(8):
        c = open_conn(g.port, ctx)
        request(c)
        assert read_response(c)[0] == 200
        held.append(c)
    deadline = time.monotonic() + 5
    while g.sample("sbxnet_gateway_open_connections") != len(held):
        assert time.monotonic() < deadline, g.get("/metrics")[1]
        time.sleep(0.05)
    for c in held:
        c.close()
    while g.sample("sbxnet_gateway_open_connections") != 0:
        assert time.monotonic() < deadline + 5, g.get("/metrics")[1]
        time.sleep(0.05)

    # SIGHUP to the supervisor reloads in every worker.
    os.kill(g.p.pid, signal.SIGHUP)
    reloaded = g.wait_for("reloaded", count=2)  # one line for certificates and routes, in each worker
    assert Counter(int(r["pid"]) for r in reloaded) == {pid: 1 for pid in pids}
    assert one_request(g.port, ctx) == 200
    code, err = g.stop()
    assert code == 0, err[-4000:]


def test_a_killed_worker_is_restarted_and_its_counts_kept(
    tmp_path: Path, pki: Pki, backend: Any, gateways: list[Gateway]
) -> None:
    g, pids = start(gateways, write_config(tmp_path, pki, backend))
    ctx = client_ctx(pki)
    n = 16
    assert [one_request(g.port, ctx) for _ in range(n)] == [200] * n
    # A request is counted as it ends, just after its client has the answer: wait for the counts, so the kill
    # tests what becomes of counts a dead worker made, not that race.
    deadline = time.monotonic() + 10
    while (g.sample("sbxnet_gateway_requests_total", {"kind": "http", "status": "200"}) or 0) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    exited = g.wait_for("worker_exited")
    assert exited[0]["worker_pid"] == victim and exited[0]["code"] == -signal.SIGKILL
    started = g.wait_for("worker_started", count=3)
    new_pid = int(started[-1]["worker_pid"])
    assert new_pid not in pids
    listening = g.wait_for("listening", count=3)
    assert int(listening[-1]["pid"]) == new_pid
    deadline = time.monotonic() + 10
    while g.get("/readyz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    assert [one_request(g.port, ctx) for _ in range(n)] == [200] * n
    assert set(served_by(g)) == pids | {new_pid}  # the new worker serves (2 in 2**16 that it would not)
    # The dead worker's requests still count; its open connections no longer do.
    assert g.sample("sbxnet_gateway_requests_total", {"kind": "http", "status": "200"}) == 2 * n
    assert g.sample("sbxnet_gateway_open_connections") == 0
    code, err = g.stop()
    assert code == 0, err[-4000:]


def test_sigterm_drains_every_worker(tmp_path: Path, pki: Pki, backend: Any, gateways: list[Gateway]) -> None:
    _, _, held = backend
    held.release.clear()
    g, pids = start(gateways, write_config(tmp_path, pki, backend))
    ctx = client_ctx(pki)
    host = f"{held.port}-alpha.{DOMAIN}"
    # Requests in flight (the app holds them) until each worker has at least one.
    inflight: list[ssl.SSLSocket] = []
    while set(served_by(g)) != pids:
        assert len(inflight) < 40, served_by(g)
        c = open_conn(g.port, ctx, host)
        request(c, host=host, close=True)
        inflight.append(c)
        links = len(inflight)
        deadline = time.monotonic() + 10
        while len(g.events("link_open")) < links:
            assert time.monotonic() < deadline, g.err[-4000:]
            time.sleep(0.01)

    g.p.send_signal(signal.SIGTERM)
    assert len(g.wait_for("draining", count=2)) == 2
    deadline = time.monotonic() + 10
    while True:  # neither worker accepts any more
        try:
            socket.create_connection(("127.0.0.1", g.port), timeout=0.5).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "still accepting after SIGTERM"
        time.sleep(0.05)
    assert g.get("/readyz")[0] == 503
    assert g.p.poll() is None  # the requests in flight keep it running

    held.release.set()
    for c in inflight:
        assert read_response(c) == (200, b"released")
        c.close()
    code, err = g.stop()
    assert code == 0, err[-4000:]
    stopped = g.events("stopped")
    assert {int(r["pid"]) for r in stopped} == pids and all(r["cut"] == 0 for r in stopped), stopped


def test_a_supervisor_killed_outright_takes_its_workers_with_it(
    tmp_path: Path, pki: Pki, backend: Any, gateways: list[Gateway]
) -> None:
    g, pids = start(gateways, write_config(tmp_path, pki, backend))
    ctx = client_ctx(pki)
    assert one_request(g.port, ctx) == 200
    os.kill(g.p.pid, signal.SIGKILL)  # no SIGTERM passed on: the kernel's parent-death signal stands in
    g.p.wait(10)
    stopped = g.wait_for("stopped", count=2, timeout=30)  # each drained (nothing open) and exited
    assert {int(r["pid"]) for r in stopped} == pids
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", g.port), timeout=1).close()


def test_a_taken_port_is_refused_before_any_worker_starts(tmp_path: Path, pki: Pki, backend: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        config = write_config(tmp_path, pki, backend, listen_port=port)
        r = subprocess.run([*SBXNET, "gateway", "--config", str(config)], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    assert f"gateway: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "already in use" in r.stderr.lower() and "SBXNET_GATEWAY_LISTEN_PORT" in r.stderr
    assert "worker_started" not in r.stderr


@pytest.mark.parametrize("workers", [257, -1])
def test_workers_out_of_range_is_named_and_exits_2(tmp_path: Path, pki: Pki, backend: Any, workers: int) -> None:
    config = write_config(tmp_path, pki, backend, workers=workers)
    r = subprocess.run([*SBXNET, "gateway", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"gateway.workers = {workers}" in r.stderr


def test_workers_0_is_one_per_core(tmp_path: Path, pki: Pki, backend: Any, gateways: list[Gateway]) -> None:
    cores = os.cpu_count() or 1
    if cores > 8:
        pytest.skip(f"{cores} cores: too many gateway processes for a test")
    g, _ = start(gateways, write_config(tmp_path, pki, backend, workers=0), workers=cores)
    time.sleep(0.5)
    assert len(g.events("listening")) == cores
    code, err = g.stop()
    assert code == 0, err[-4000:]
