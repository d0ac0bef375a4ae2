"""Every daemon's signals (issue 22 point 12), on real processes: SIGHUP reloads what can change safely,
one outcome line per SIGHUP; a failed reload keeps the process and what it had, and its one line names
the file and why; SIGTERM stops it, exit 0. The scheduler, which SIGHUP used to kill with no line, takes
the new certificate at the next handshake and the new admin token at the next call; with an event-stream
client connected it stops at once (timed by its own log timestamps)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from shell_support import Daemon, mint, sample_configs

from certs.mint import spki_pin

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
LISTENING = {"gateway": "listening", "forwarder": "listening", "scheduler": "listening", "egress": "egress_listening"}
OUTCOMES = ("reloaded", "reload_failed")


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    mint(CLI, d)
    return d


@pytest.fixture
def pki(minted: Path, tmp_path: Path) -> Path:
    """A copy of the certificates for one test, which may break its files."""
    return Path(shutil.copytree(minted, tmp_path / "pki"))


def hup(d: Daemon, seen: int) -> dict[str, object]:
    """SIGHUP, then its outcome line (the next one after the ``seen`` already logged)."""
    d.p.send_signal(signal.SIGHUP)
    return d.wait_for(*OUTCOMES, count=seen + 1)[seen]


def start(daemon: str, pki: Path, tmp_path: Path) -> Daemon:
    configs = sample_configs(pki, tmp_path / "etc", var=tmp_path / "var")
    d = Daemon(CLI, daemon, configs[daemon], tmp_path)
    d.wait_for(LISTENING[daemon])
    return d


@pytest.mark.parametrize(("daemon", "broken"), [
    ("gateway", "scheduler.crt"),  # its client-facing certificate in the sample config
    ("forwarder", "forwarder.crt"),
    ("forwarder", "forwarder.key"),
    ("scheduler", "scheduler.crt"),
    ("scheduler", "admin.token"),
])
def test_sighup_one_outcome_per_signal_and_a_failure_names_the_file(
        daemon: str, broken: str, pki: Path, tmp_path: Path) -> None:
    d = start(daemon, pki, tmp_path)
    try:
        good = hup(d, 0)
        assert good["event"] == "reloaded", good
        kept = (pki / broken).read_bytes()
        (pki / broken).write_text("")  # emptied, as a half-finished copy leaves it
        failed = hup(d, 1)
        assert failed["event"] == "reload_failed", failed
        assert failed["file"] == str(pki / broken) and failed["error"], failed
        assert str(pki / broken) in str(failed["msg"])
        (pki / broken).write_bytes(kept)
        again = hup(d, 2)
        assert again["event"] == "reloaded", again
        assert d.p.poll() is None
    finally:
        code = d.stop()
    assert code == 0, d.other
    assert [r["event"] for r in d.events(*OUTCOMES)] == ["reloaded", "reload_failed", "reloaded"]


def test_egress_sighup_is_one_outcome_line_and_announces(pki: Path, tmp_path: Path) -> None:
    d = start("egress", pki, tmp_path)
    try:
        assert hup(d, 0)["event"] == "reloaded"
        assert hup(d, 1)["event"] == "reloaded"
        d.wait_for("claims_announced", count=2)
    finally:
        code = d.stop()
    assert code == 0, d.other
    assert len(d.events(*OUTCOMES)) == 2


def _served_pin(port: int, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, \
            ctx.wrap_socket(s, server_hostname="localhost") as t:
        der = t.getpeercert(binary_form=True)
    assert der is not None
    return spki_pin(x509.load_der_x509_certificate(der))


def _admin(port: int, ca: Path, token: str) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(f"https://localhost:{port}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_scheduler_sighup_takes_a_new_certificate_and_token(pki: Path, tmp_path: Path) -> None:
    from certs.mint import load_issued, mint_leaf, write_issued

    d = start("scheduler", pki, tmp_path)
    port = int(str(d.wait_for("listening")[0]["address"]).rsplit(":", 1)[1])
    try:
        old_pin = _served_pin(port, pki / "ca.crt")
        old_token = (pki / "admin.token").read_text().strip()
        assert _admin(port, pki / "ca.crt", old_token) == 200
        leaf = mint_leaf(load_issued(pki, "ca"), "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True)
        write_issued(leaf, pki, "scheduler")
        (pki / "admin.token").write_text("a-new-admin-token-0123456789\n")
        assert hup(d, 0)["event"] == "reloaded"
        assert _served_pin(port, pki / "ca.crt") == spki_pin(leaf.cert) != old_pin
        assert _admin(port, pki / "ca.crt", "a-new-admin-token-0123456789") == 200
        assert _admin(port, pki / "ca.crt", old_token) == 403
    finally:
        code = d.stop()
    assert code == 0, d.other


def test_scheduler_stops_at_once_with_an_event_stream_open(pki: Path, tmp_path: Path) -> None:
    d = start("scheduler", pki, tmp_path)
    port = int(str(d.wait_for("listening")[0]["address"]).rsplit(":", 1)[1])
    token = (pki / "admin.token").read_text().strip()
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    req = urllib.request.Request(f"https://localhost:{port}/v1/events", headers={"Authorization": f"Bearer {token}"})
    stream = urllib.request.urlopen(req, context=ctx, timeout=30)
    try:
        assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        time.sleep(0.3)  # the handler is in its wait for news
        d.p.send_signal(signal.SIGTERM)
        assert stream.read() == b""  # the stream ended (not cut by the client)
        code = d.stop()
    finally:
        stream.close()
        d.stop()
    assert code == 0, d.other
    (stopping,), (stopped,) = d.events("stopping"), d.events("stopped")
    took = float(str(stopped["ts"])) - float(str(stopping["ts"]))
    # aiohttp's shutdown waited its whole 5 s timeout for the stream before the fix
    assert took < 2.5, (took, json.dumps(d.logs[-5:]))
