"""The forwarder as an operator runs it: the CLI, bad config, the port, ops endpoints, signals, workers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
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
from fwd_support import GwClient, Pki, SandboxApp, free_port, payload, preamble_for, recv_all

from certs.mint import mint_leaf, spki_pin, write_issued
from sbxnet.protocol.status import Status

SBXNET = [sys.executable, "-m", "sbxnet.app.cli"]


def write_config(path: Path, pki: Pki, **extra: object) -> Path:
    cert, key = pki.paths["forwarder"]
    lines = [
        "[forwarder]",
        'listen_host = "127.0.0.1"',
        f"listen_port = {extra.pop('listen_port', free_port())}",
        f"metrics_port = {extra.pop('metrics_port', 0)}",
        f'cert_file = "{cert}"',
        f'key_file = "{key}"',
        f'ca_file = "{pki.ca_file}"',
        'client_san_allow = ["spiffe://sbxnet.test/gateway"]',
        'sandbox_prefixes = ["127.0.0.0/8"]',
        'allow_targets = ["127.0.0.1/32"]',
        "drain_timeout = 10",
        'data_plane = "userspace"',
    ]
    for k, v in extra.items():
        lines.append(f"{k} = {v}")
    path.write_text("\n".join(lines) + "\n")
    return path


def config_port(path: Path, key: str = "listen_port") -> int:
    for line in path.read_text().splitlines():
        if line.startswith(f"{key} ="):
            return int(line.split("=")[1])
    raise KeyError(key)


class Proc:
    """The forwarder command in its own process group; its stderr (the JSON log lines of the process and
    of any workers) is read as it comes, so a test can wait for an event while the process runs."""

    def __init__(self, config: Path, *args: str) -> None:
        self.config = config
        self.port = config_port(config)
        self.p = subprocess.Popen(
            [*SBXNET, "forwarder", "--config", str(config), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self._lines.append(line.decode(errors="replace"))

    @property
    def err(self) -> str:
        return "".join(self._lines)

    def events(self, event: str) -> list[dict[str, Any]]:
        """The JSON log lines so far with this ``event``."""
        out = []
        for line in list(self._lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                out.append(record)
        return out

    def wait_for(self, event: str, count: int = 1, timeout: float = 10) -> list[dict[str, Any]]:
        """At least ``count`` log lines with this ``event``, or AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(found := self.events(event)) < count:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{len(found)} of {count} {event!r} log lines after {timeout}s:\n{self.err}")
            time.sleep(0.02)
        return found

    def wait_exit(self, timeout: float | None) -> None:
        self.p.wait(timeout)
        self._reader.join(10)  # workers may hold the pipe a moment longer

    def wait_listening(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                self._reader.join(10)
                raise AssertionError(f"forwarder exited {self.p.returncode}: {self.err}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("forwarder did not listen")

    def kill(self) -> None:
        # The whole group: workers hold the output pipes too.
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, *, signalled: bool = False) -> tuple[int, str]:
        """SIGTERM (unless the test already sent it) and wait for the exit."""
        if not signalled and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            self.wait_exit(20)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait_exit(None)
        return self.p.returncode, self.err


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
        p.wait_exit(None)


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# -- configuration ---------------------------------------------------------------------------------

BAD: list[tuple[dict[str, object], str]] = [
    ({"listen_port": 70000}, "forwarder.listen_port = 70000"),
    ({"preamble_timeout": -1}, "forwarder.preamble_timeout = -1"),
    ({"data_plane": '"turbo"'}, "forwarder.data_plane = 'turbo'"),
    ({"workers": '"many"'}, "forwarder.workers = 'many'"),
    ({"sandbox_prefixes": '["10.0.0.0/33"]'}, "forwarder.sandbox_prefixes.0 = '10.0.0.0/33'"),
    ({"client_san_allow": '["spiffe://td/gate*"]'}, "forwarder.client_san_allow"),
    ({"cert_file": '"/nonexistent/forwarder.crt"'}, "forwarder.cert_file = '/nonexistent/forwarder.crt'"),
    ({"connect_backoff_initial": 1.0}, "connect_backoff_initial (1.0) must not exceed connect_backoff_cap"),
    ({"listen_hots": '"127.0.0.1"'}, "forwarder.listen_hots: unknown setting"),
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[next(iter(b)) for b, _ in BAD])
def test_bad_config_names_field_value_and_exits_2(
    tmp_path: Path, pki: Pki, bad: dict[str, object], message: str
) -> None:
    cfg = write_config(tmp_path / "f.toml", pki)
    text = cfg.read_text()
    for key, value in bad.items():
        lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
        text = "\n".join([*lines, f"{key} = {value}"]) + "\n"
    cfg.write_text(text)
    r = subprocess.run([*SBXNET, "forwarder", "--config", str(cfg), "--check"], capture_output=True, timeout=30)
    assert r.returncode == 2, r.stderr
    err = r.stderr.decode()
    assert message in err
    assert err.count("\n") <= 2  # one message, not a traceback


def test_bad_environment_value(tmp_path: Path, pki: Pki) -> None:
    cfg = write_config(tmp_path / "f.toml", pki)
    env = {**os.environ, "SBXNET_FORWARDER_LISTEN_PORT": "eighty"}
    r = subprocess.run(
        [*SBXNET, "forwarder", "--config", str(cfg), "--check"], capture_output=True, env=env, timeout=30
    )
    assert r.returncode == 2
    assert "forwarder.listen_port = 'eighty'" in r.stderr.decode()
    assert "SBXNET_FORWARDER_LISTEN_PORT" in r.stderr.decode()


def test_environment_overrides_file(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    cfg = write_config(tmp_path / "f.toml", pki)
    env = {**os.environ, "SBXNET_FORWARDER_SANDBOX_PREFIXES": "10.0.0.0/8,127.0.0.0/8"}
    r = subprocess.run(
        [*SBXNET, "forwarder", "--config", str(cfg), "--check"], capture_output=True, env=env, timeout=30
    )
    assert r.returncode == 0, r.stderr


# -- the port --------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_port_taken_is_a_clear_refusal(tmp_path: Path, pki: Pki, workers: int) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    cfg = write_config(tmp_path / "f.toml", pki, listen_port=port, workers=workers)
    r = subprocess.run([*SBXNET, "forwarder", "--config", str(cfg)], capture_output=True, timeout=30)
    holder.close()
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr.decode()
    assert "already in use" in r.stderr.decode().lower()


# -- ops endpoints, signals ------------------------------------------------------------------------


def test_metrics_health_and_sigterm_drain(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    mport = free_port()
    proc = Proc(write_config(tmp_path / "f.toml", pki, metrics_port=mport))
    procs.append(proc)
    proc.wait_listening()
    assert http_get(mport, "/healthz")[0] == 200
    assert http_get(mport, "/readyz")[0] == 200

    release = threading.Event()
    got: list[tuple[bytes, int]] = []

    def handler(conn: socket.socket) -> None:
        release.wait(10)
        got.append(recv_all(conn))

    app = SandboxApp(handler)
    client = GwClient(proc.port, pki.client_ctx())
    assert client.open(preamble_for(app.port, sandbox_id="sbx-drain")) is Status.OK
    client.send(b"a" * 1000)

    proc.p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # stops accepting at once
        try:
            socket.create_connection(("127.0.0.1", proc.port), timeout=0.2).close()
            time.sleep(0.05)
        except OSError:
            break
    else:
        raise AssertionError("still accepting after SIGTERM")
    assert http_get(mport, "/readyz")[0] == 503
    assert proc.p.poll() is None  # the live connection keeps it running

    client.send(b"b" * 1000)  # and the live connection still works
    client.close_write()
    release.set()
    client.recv_all()
    code, err = proc.stop(signalled=True)
    assert code == 0, err
    assert got == [(hashlib.sha256(b"a" * 1000 + b"b" * 1000).digest(), 2000)]
    assert '"event": "drained"' in err and '"cut": 0' in err


def test_sighup_reloads_certificates_without_dropping_live_connections(
    tmp_path: Path, pki: Pki, procs: list[Proc]
) -> None:
    certdir = tmp_path / "certs"
    certdir.mkdir()
    leaf = mint_leaf(pki.ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",))
    cert, key = write_issued(leaf, certdir, "forwarder")
    cfg = write_config(tmp_path / "f.toml", pki)
    cfg.write_text(
        cfg.read_text()
        .replace(str(pki.paths["forwarder"][0]), str(cert))
        .replace(str(pki.paths["forwarder"][1]), str(key))
    )
    proc = Proc(cfg)
    procs.append(proc)
    proc.wait_listening()

    def echo(conn: socket.socket) -> None:
        while data := conn.recv(65536):
            conn.sendall(data)

    app = SandboxApp(echo)
    live = GwClient(proc.port, pki.client_ctx())
    assert live.open(preamble_for(app.port)) is Status.OK

    def server_pin() -> str:
        from cryptography import x509

        c = GwClient(proc.port, pki.client_ctx())
        c.handshake()
        der = c.tls.getpeercert(binary_form=True)
        c.close()
        assert der is not None
        return spki_pin(x509.load_der_x509_certificate(der))

    assert server_pin() == spki_pin(leaf.cert)
    new = mint_leaf(pki.ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",))
    write_issued(new, certdir, "forwarder")
    proc.p.send_signal(signal.SIGHUP)
    proc.wait_for("reloaded")
    assert server_pin() == spki_pin(new.cert)
    live.send(b"still here")
    assert live.recv_exact(10) == b"still here"

    key.write_text("not a key")  # a broken reload keeps the current certificates
    proc.p.send_signal(signal.SIGHUP)
    # The reload was attempted and failed (a SIGHUP ignored would leave no such line), and only then
    # is the certificate still served worth checking.
    failed = proc.wait_for("reload_failed")
    assert server_pin() == spki_pin(new.cert)
    live.send(b"and still here")
    assert live.recv_exact(14) == b"and still here"
    live.close()
    code, err = proc.stop()
    assert code == 0
    assert "reload failed: certificates from" in err
    assert len(proc.events("reloaded")) == 1 and len(failed) == len(proc.events("reload_failed")) == 1
    assert failed[0]["file"] == str(key)  # the one that failed, named


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


@pytest.mark.parametrize("given", [None, "pymalloc"])
def test_the_forwarder_runs_under_malloc_unless_its_environment_names_an_allocator(
    tmp_path: Path, pki: Pki, procs: list[Proc], monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    """``sbxnet forwarder`` starts itself again (the same PID) with PYTHONMALLOC=malloc, so memory held by
    closed tunnels goes back to the kernel (tests/ingress/test_fwd_memory.py); an allocator the operator
    chose is kept. Workers inherit it."""
    if given is None:
        monkeypatch.delenv("PYTHONMALLOC", raising=False)
    else:
        monkeypatch.setenv("PYTHONMALLOC", given)
    proc = Proc(write_config(tmp_path / "f.toml", pki, workers=2))
    procs.append(proc)
    proc.wait_listening()
    workers = {r["pid"] for r in proc.wait_for("listening", count=2, timeout=20)}
    assert len(workers) == 2 and proc.p.pid not in workers
    for pid in (proc.p.pid, *workers):
        assert environ_of(pid).get("PYTHONMALLOC") == (given or "malloc"), pid


def test_two_workers_share_the_port_and_sum_metrics(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    mport = free_port()
    proc = Proc(write_config(tmp_path / "f.toml", pki, metrics_port=mport, workers=2))
    procs.append(proc)
    proc.wait_listening()
    deadline = time.monotonic() + 20
    while http_get(mport, "/readyz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http_get(mport, "/readyz")[0] == 200
    # Both workers listen before any connection is made, or the first could take them all.
    listening = {r["pid"] for r in proc.wait_for("listening", count=2, timeout=20)}
    assert len(listening) == 2

    data = payload(1 << 18, 5)
    app = SandboxApp(lambda conn: conn.sendall(hashlib.sha256(recv_all(conn)[0]).digest()))
    # SO_REUSEPORT picks a worker by a hash of the source port: with 32 connections, the chance that
    # one worker gets them all is 2 in 2**32.
    n = 32
    for _ in range(n):
        c = GwClient(proc.port, pki.client_ctx())
        assert c.open(preamble_for(app.port)) is Status.OK
        c.send(data)
        c.close_write()
        assert c.recv_all() == hashlib.sha256(hashlib.sha256(data).digest()).digest()
        c.close()

    def samples() -> dict[tuple[str, str], float]:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(http_get(mport, "/metrics")[1]):
            for smp in fam.samples:
                out[(smp.name, ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items())))] = smp.value
        return out

    deadline = time.monotonic() + 5
    while samples().get(("sbxnet_forwarder_bytes_total", "direction=up")) != n * len(data):
        assert time.monotonic() < deadline, samples()
        time.sleep(0.2)  # byte counters are flushed once a second
    assert samples()[("sbxnet_forwarder_connections_total", "outcome=closed")] == n
    code, err = proc.stop()
    assert code == 0, err
    served = [r["pid"] for r in proc.events("connected")]
    assert len(served) == n
    assert set(served) == listening, served  # both workers served connections
