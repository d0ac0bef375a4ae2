"""A forwarder's key rotated under traffic, as docs/forwarder.md "Rotating a forwarder's key" tells an operator
to (issue 22 point 17): the scheduler, the forwarder and the gateway as processes, certificates from
``sbxnet certs``, routes registered through the scheduler's API.

A sandbox whose route holds the current and the next pin answers every request while the forwarder's
certificate and key are swapped for the next (``certs promote``, SIGHUP); a sandbox whose route still holds
only the old pin is answered as docs/gateway.md says a pin mismatch is (502 at once, no further handshake,
its access-log line's reason ``pin_mismatch``)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from gw_support import DOMAIN, EchoHttp

from certs.loader import client_context, spki_pin_of_der
from certs.mint import load_issued, mint_leaf, write_issued

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
TRUST = "sbxnet.local"  # 'sbxnet certs dev' names its certificates in this trust domain
GATEWAY_SAN = f"spiffe://{TRUST}/gateway"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def certs(*args: str) -> str:
    """``sbxnet certs ARGS``: its output, or AssertionError with it."""
    r = subprocess.run([*CLI, "certs", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


class Daemon:
    """One ``sbxnet`` command in its own process group; its JSON log lines (stderr) read as they come."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                  start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.lines.append(line.decode(errors="replace"))

    def events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                out.append(record)
        return out

    def wait_for(self, event: str, count: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(found := self.events(event)) < count:
            assert self.p.poll() is None, "".join(self.lines)[-3000:]
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {event!r} log line after {timeout}s:\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.02)
        return found

    def wait_port(self, port: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.p.poll() is None, "".join(self.lines)[-3000:]
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise AssertionError(f"nothing listens on {port}:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._reader.join(10)


class Deployment:
    """What a platform engineer runs: 'sbxnet certs dev' material, the scheduler (SQLite), one forwarder,
    the gateway on the scheduler, and a sandbox app (an HTTP echo) behind the forwarder. ``scheduler_client``:
    the gateway's client certificate for the scheduler is one of its own, 'sbxnet certs gateway --name' that,
    instead of the link's."""

    def __init__(self, d: Path, *, pool: int = 0, scheduler_client: str | None = None) -> None:
        self.d, self.pool = d, pool
        certs("dev", "--dir", str(d))
        if scheduler_client is not None:
            certs("gateway", "--dir", str(d), "--name", scheduler_client)
        front = mint_leaf(load_issued(d, "ca"), "front", dns=(f"*.{DOMAIN}",))
        self.front_cert, self.front_key = write_issued(front, d, "front")
        self.token = (d / "admin.token").read_text().strip()
        self.app = EchoHttp()
        self.daemons: list[Daemon] = []

        self.sched_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
        env.update({
            "SBXNET_SCHEDULER_LISTEN_HOST": "127.0.0.1", "SBXNET_SCHEDULER_LISTEN_PORT": str(self.sched_port),
            "SBXNET_SCHEDULER_METRICS_PORT": "0", "SBXNET_SCHEDULER_CERT_FILE": str(d / "scheduler.crt"),
            "SBXNET_SCHEDULER_KEY_FILE": str(d / "scheduler.key"), "SBXNET_SCHEDULER_CA_FILE": str(d / "ca.crt"),
            "SBXNET_SCHEDULER_GATEWAY_SAN_ALLOW": GATEWAY_SAN,
            "SBXNET_SCHEDULER_FORWARDER_SAN_ALLOW": f"spiffe://{TRUST}/forwarder/*",
            "SBXNET_SCHEDULER_ADMIN_TOKEN_FILE": str(d / "admin.token"),
            "SBXNET_SCHEDULER_DATABASE": f"sqlite://{d / 'scheduler.db'}", "SBXNET_SCHEDULER_ROUTE_CACHE_S": "1",
        })
        self.scheduler = self._start(["scheduler"], self.sched_port, env=env)

        self.fwd_port = free_port()
        (d / "forwarder.toml").write_text("\n".join([
            "[forwarder]", 'listen_host = "127.0.0.1"', f"listen_port = {self.fwd_port}", "metrics_port = 0",
            f'cert_file = "{d / "forwarder.crt"}"', f'key_file = "{d / "forwarder.key"}"',
            f'ca_file = "{d / "ca.crt"}"', f'client_san_allow = ["{GATEWAY_SAN}"]',
            'sandbox_prefixes = ["127.0.0.0/8"]', 'allow_targets = ["127.0.0.1/32"]', 'data_plane = "userspace"',
        ]) + "\n")
        self.forwarder = self._start(["forwarder", "--config", str(d / "forwarder.toml")], self.fwd_port)

        self.port = free_port()
        (d / "gateway.toml").write_text("\n".join([
            "[gateway]", 'listen_host = "127.0.0.1"', f"listen_port = {self.port}", "metrics_port = 0",
            f'domain = "{DOMAIN}"', f'cert_files = ["{self.front_cert}"]', f'key_files = ["{self.front_key}"]',
            f'scheduler_url = "https://127.0.0.1:{self.sched_port}"',
            f'upstream_cert_file = "{d / "gateway.crt"}"', f'upstream_key_file = "{d / "gateway.key"}"',
            f'upstream_ca_file = "{d / "ca.crt"}"', f"upstream_pool_size = {pool}",
            *([f'scheduler_cert_file = "{d / scheduler_client}.crt"',
               f'scheduler_key_file = "{d / scheduler_client}.key"'] if scheduler_client is not None else []),
        ]) + "\n")
        self.gateway = self._start(["gateway", "--config", str(d / "gateway.toml")], self.port)
        self.client_ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))

    def _start(self, args: list[str], port: int, *, env: dict[str, str] | None = None) -> Daemon:
        daemon = Daemon(args, env=env)
        self.daemons.append(daemon)
        daemon.wait_port(port)
        return daemon

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.stop()
        self.app.stop()

    def register(self, sandbox: str, forwarder: dict[str, Any], *, deadline: float = 10.0) -> None:
        """``PUT /v1/sandboxes/{sandbox}`` as the platform does, with its admin token."""
        body = {"incarnation": "i1", "forwarder": {"address": f"127.0.0.1:{self.fwd_port}", **forwarder},
                "target_ip": "127.0.0.1", "default_port": self.app.port,
                "ports": {str(self.app.port): {"protocol": "http", "auth": "public"}}, "idle_period_s": 300,
                "connect_deadline_s": deadline}
        req = urllib.request.Request(
            f"https://127.0.0.1:{self.sched_port}/v1/sandboxes/{sandbox}", method="PUT",
            data=json.dumps(body).encode(), headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=self.client_ctx, timeout=10) as r:
            assert r.status in (200, 201), r.read()

    def get(self, sandbox: str) -> tuple[int, dict[str, str]]:
        """One request on a connection of its own (so a link, a handshake and a pin check of its own)."""
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        with self.client_ctx.wrap_socket(raw, server_hostname=f"{sandbox}.{DOMAIN}") as tls:
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {sandbox}.{DOMAIN}:{self.port}\r\nConnection: close\r\n\r\n"
                        .encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
        head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
        return int(head[0].split()[1]), headers

    def served_pin(self) -> str:
        """The pin of the key the forwarder presents to a new link now."""
        ctx = client_context(cert_file=self.d / "gateway.crt", key_file=self.d / "gateway.key",
                             ca_file=self.d / "ca.crt")
        raw = socket.create_connection(("127.0.0.1", self.fwd_port), timeout=10)
        with ctx.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return spki_pin_of_der(der)


@pytest.fixture(params=[0, 2], ids=["no-pool", "warm-pool"])
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """Without and with the gateway's warm pool (links handshaken and pin-checked ahead, per route pins)."""
    dep = Deployment(tmp_path, pool=request.param)
    try:
        yield dep
    finally:
        dep.stop()


class Traffic:
    """Requests to one sandbox, one after another on each of ``clients`` threads, each on a new connection."""

    def __init__(self, dep: Deployment, sandbox: str, clients: int = 2) -> None:
        self.dep, self.sandbox = dep, sandbox
        self.answers: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append(self.dep.get(self.sandbox)[0])
            except OSError as e:  # a connection refused, reset or cut: a failed request too
                self.errors.append(repr(e))

    def wait_answers(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < n:
            assert time.monotonic() < deadline, f"{len(self.answers)} of {n} answers in {timeout}s"
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_a_forwarder_key_rotated_under_traffic_fails_no_request(deployment: Deployment) -> None:
    dep = deployment
    d = dep.d
    current = certs("pin", str(d / "forwarder.crt")).strip()
    assert dep.served_pin() == current
    # Two sandboxes on that forwarder: "rot" follows the rotation; "old" keeps only the old pin, in the
    # field as it was before the set (still taken).
    dep.register("rot", {"spki_pins": [current]})
    dep.register("old", {"spki_pin": current}, deadline=1.0)
    traffic = Traffic(dep, "rot")
    try:
        traffic.wait_answers(10)

        # 1. The next key, minted ahead; the forwarder's files untouched, so it still serves the current.
        out = certs("next-key", "--dir", str(d), "--name", "forwarder")
        match = re.search(r"next SPKI pin (\S+)", out)
        assert match, out
        nxt = match.group(1)
        assert nxt != current and certs("pin", str(d / "forwarder.next.crt")).strip() == nxt
        assert dep.served_pin() == current

        # 2. The route holds both pins; the gateway takes it up within the route's max-age (1 s here).
        dep.register("rot", {"spki_pins": [current, nxt]})
        time.sleep(1.5)  # the documented wait for route caches (route_cache_s), not a measurement
        before_swap = len(traffic.answers)

        # 3. The swap: the next pair installed, the forwarder told to reload.
        certs("promote", "--dir", str(d), "--name", "forwarder")
        dep.forwarder.p.send_signal(signal.SIGHUP)
        dep.forwarder.wait_for("reloaded")
        assert dep.served_pin() == nxt
        after_reload = len(traffic.answers)
        traffic.wait_answers(after_reload + 20)  # requests that all began on the new key
    finally:
        traffic.stop()

    assert traffic.errors == [], traffic.errors[:5]
    assert before_swap >= 10 and len(traffic.answers) >= after_reload + 20
    assert set(traffic.answers) == {200}, {s: traffic.answers.count(s) for s in set(traffic.answers)}

    # The route that still holds only the old pin: the forwarder's new key is refused, and the request
    # is answered as a pin mismatch is (docs/gateway.md, "Upstream": 502, not retried). Links the gateway's warm
    # pool opened before the swap still carry the old key (the forwarder keeps a live link's context), so
    # up to the pool's size of requests may still be served on them first; none is pooled after the swap.
    served_old: list[int] = []
    while not served_old or served_old[-1] == 200:
        status, _ = dep.get("old")
        served_old.append(status)
        assert len(served_old) <= dep.pool + 1, served_old
    assert status == 502, served_old

    # 4. The last step: the routes drop the old pin.
    dep.register("rot", {"spki_pins": [nxt]})
    dep.register("old", {"spki_pins": [nxt]})
    time.sleep(1.5)
    assert dep.get("rot")[0] == 200 and dep.get("old")[0] == 200

    # The gateway's own account: one access-log line per request, every one for "rot" a 200, and the one
    # refused for "old" refused for the pin.
    dep.gateway.stop()
    lines = dep.gateway.events("request")
    rot = [r for r in lines if r.get("sandbox_id") == "rot"]
    assert len(rot) == len(traffic.answers) + 1 and {r["status"] for r in rot} == {200}
    old = [(r["status"], r.get("reason")) for r in lines if r.get("sandbox_id") == "old"]
    assert old == [(200, None)] * (len(served_old) - 1) + [(502, "pin_mismatch"), (200, None)], old
    x509.load_pem_x509_certificate((d / "forwarder.prev.crt").read_bytes())  # the old pair kept for a rollback
