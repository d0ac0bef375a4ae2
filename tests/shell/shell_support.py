"""What the daemon-shell tests share: a deployment's certificates minted with ``sbxnet certs dev`` (the
command an operator runs), and a sample config file for each daemon pointing at them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

DAEMONS = ("gateway", "forwarder", "scheduler", "egress")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any SBXNET_* setting (the tests' settings come from their config files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    env.update(extra)
    return env


def mint(sbxnet: list[str], pki: Path) -> None:
    """``sbxnet certs dev --dir pki``: CA, forwarder, gateway and scheduler certificates and an admin token."""
    pki.mkdir(parents=True, exist_ok=True)
    subprocess.run([*sbxnet, "certs", "dev", "--dir", str(pki)], check=True, capture_output=True, timeout=120,
                   env=clean_env())


def sample_configs(pki: Path, out: Path, *, var: Path, ports: dict[str, int] | None = None) -> dict[str, Path]:
    """One TOML file per daemon, as docs/ describe them, its files under ``pki`` and its state under ``var``
    (the scheduler's SQLite database is ``var``/lib/sbxnet/scheduler.db, not created by this). ``ports``:
    listen ports by daemon (metrics are off); any missing is a fresh one."""
    ports = dict(ports or {})
    for name in ("gateway", "forwarder", "scheduler"):
        ports.setdefault(name, free_port())
    sched = ports["scheduler"]
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "scheduler": f"""
listen_port = {sched}
metrics_port = 0
cert_file = "{pki}/scheduler.crt"
key_file = "{pki}/scheduler.key"
ca_file = "{pki}/ca.crt"
gateway_san_allow = ["spiffe://sbxnet.local/gateway"]
forwarder_san_allow = ["spiffe://sbxnet.local/forwarder/forwarder"]
admin_token_file = "{pki}/admin.token"
database = "sqlite://{var}/lib/sbxnet/scheduler.db"
""",
        "gateway": f"""
listen_host = "127.0.0.1"
listen_port = {ports["gateway"]}
metrics_port = 0
domain = "sbx.test"
cert_files = ["{pki}/scheduler.crt"]
key_files = ["{pki}/scheduler.key"]
scheduler_url = "https://localhost:{sched}"
upstream_cert_file = "{pki}/gateway.crt"
upstream_key_file = "{pki}/gateway.key"
upstream_ca_file = "{pki}/ca.crt"
workers = 1
drain_timeout = 5
""",
        "forwarder": f"""
listen_host = "127.0.0.1"
listen_port = {ports["forwarder"]}
metrics_port = 0
cert_file = "{pki}/forwarder.crt"
key_file = "{pki}/forwarder.key"
ca_file = "{pki}/ca.crt"
client_san_allow = ["spiffe://sbxnet.local/gateway"]
sandbox_prefixes = ["127.0.0.0/8"]
data_plane = "userspace"
workers = 1
drain_timeout = 5
feed_url = "https://localhost:{sched}/v1/feed"
""",
        "egress": f"""
exits = ["exit-a=192.0.2.10@02:00:00:00:00:0a"]
listen = "127.0.0.1"
port = {ports.get("egress") or free_port()}
metrics_port = 0
""",
    }
    paths = {}
    for name, body in tables.items():
        paths[name] = out / f"{name}.toml"
        paths[name].write_text(f"[{name}]{body}")
    return paths


def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root``: (mode, size, mtime in ns), to compare before and after."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


class Daemon:
    """``sbxnet <daemon> --config F`` as a real process; its JSON log lines collected as they come."""

    def __init__(self, sbxnet: list[str], daemon: str, config: Path, cwd: Path) -> None:
        self.name = daemon
        self.p = subprocess.Popen([*sbxnet, daemon, "--config", str(config)], cwd=cwd, env=clean_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.logs: list[dict[str, object]] = []
        self.other: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            with self._cond:
                try:
                    record = json.loads(line)
                except ValueError:
                    self.other.append(line)
                else:
                    self.logs.append(record)
                self._cond.notify_all()

    def events(self, *names: str) -> list[dict[str, object]]:
        with self._cond:
            return [r for r in self.logs if r.get("event") in names]

    def wait_for(self, *names: str, count: int = 1, timeout: float = 30.0) -> list[dict[str, object]]:
        """Once ``count`` lines with one of these events were logged: all of them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(found := [r for r in self.logs if r.get("event") in names]) < count:
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: no {names} x{count} in {self.logs} {self.other}")
                self._cond.wait(min(left, 0.2))
            return found

    def stop(self, timeout: float = 30.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            code = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            self._reader.join(10)
            if self.p.stdout is not None:
                self.p.stdout.close()
            if self.p.stderr is not None:
                self.p.stderr.close()
        return code
