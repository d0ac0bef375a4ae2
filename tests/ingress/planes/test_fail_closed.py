"""Fail closed: in ktls mode on a kernel without TLS the forwarder exits before listening."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.ingress.planes import ktls_keys as ktls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def forwarder_env(pki_dir: Path, port: int, plane: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    env.update(
        SBXNET_FORWARDER_LISTEN_HOST="127.0.0.1",
        SBXNET_FORWARDER_LISTEN_PORT=str(port),
        SBXNET_FORWARDER_METRICS_PORT="0",
        SBXNET_FORWARDER_CERT_FILE=str(pki_dir / "forwarder.crt"),
        SBXNET_FORWARDER_KEY_FILE=str(pki_dir / "forwarder.key"),
        SBXNET_FORWARDER_CA_FILE=str(pki_dir / "ca.crt"),
        SBXNET_FORWARDER_CLIENT_SAN_ALLOW="spiffe://sbxnet.test/gateway",
        SBXNET_FORWARDER_SANDBOX_PREFIXES="10.0.0.0/8",
        SBXNET_FORWARDER_DATA_PLANE=plane,
        SBXNET_FORWARDER_WORKERS="1",
    )
    return env


def test_probe_names_the_cause() -> None:
    r = ktls.probe()
    if r.ok:
        assert r.cause == "ok"
        return
    assert r.cause in {"module_not_loaded", "not_built", "attach_failed"}
    msg = r.message()
    assert "modprobe tls" in msg and 'data_plane = "userspace"' in msg and "never falls back" in msg
    assert "\n" not in msg


@pytest.mark.skipif(ktls.probe().ok, reason="this kernel has TLS: the forwarder would start")
def test_ktls_mode_refuses_to_start_without_kernel_tls(pki_dir: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "sbxnet.app.cli", "forwarder"],
        env=forwarder_env(pki_dir, port, "ktls"), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "ktls" in ln]
    assert len(lines) == 1, proc.stderr
    cause = ktls.probe().cause
    expected = {"not_built": "without CONFIG_TLS", "module_not_loaded": "`tls` module is not loaded"}
    assert expected.get(cause, "could not be attached") in lines[0]
    assert "modprobe tls" in lines[0] and 'data_plane = "userspace"' in lines[0]
    # Nothing listened on the port at any point: binding it now works, and nothing answers there.
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
    assert "listening" not in proc.stdout + proc.stderr


@pytest.mark.skipif(ktls.probe().ok, reason="this kernel has TLS: the forwarder would start")
def test_default_plane_is_ktls_and_fails_closed_too(pki_dir: Path) -> None:
    env = forwarder_env(pki_dir, free_port(), "ktls")
    del env["SBXNET_FORWARDER_DATA_PLANE"]
    proc = subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "forwarder"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "modprobe tls" in proc.stderr and 'data_plane = "userspace"' in proc.stderr


@pytest.mark.skipif(ktls.probe().ok, reason="this kernel has TLS: the plane would start")
def test_ktls_plane_cannot_be_built_without_kernel_tls() -> None:
    from forwarder.ingress.planes.ktls import KtlsPlane, KtlsUnavailable

    with pytest.raises(KtlsUnavailable) as e:
        KtlsPlane()
    assert "modprobe tls" in str(e.value)
