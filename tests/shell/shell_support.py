"""What the daemon-shell tests share: a deployment's certificates minted with ``sbxnet certs dev`` (the
command an operator runs), and a sample config file for each daemon pointing at them."""

from __future__ import annotations

import os
import socket
import subprocess
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
metrics_port = 0
state_dir = "{var}/lib/sbxnet/egress"
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
