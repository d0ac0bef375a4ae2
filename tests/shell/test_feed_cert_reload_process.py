"""The forwarder's feed client certificate (``feed_cert_file``, ``feed_key_file``) on SIGHUP, as
docs/architecture.md "Every daemon's shell" says (issue 22 point 12): the scheduler and a forwarder as
processes, the feed's certificate set apart from the link's and replaced in turn by one the scheduler's
``forwarder_san_allow`` refuses, by a renewed good one, and by a broken file. A link through the forwarder
to an echo app gives each step bytes to report; the next reports present the certificate the reload
took: refused (the forwarder backs off, ``http_403``), then taken again (``feed_reporting``); a failed
reload keeps the one in use, and its one line names the file."""

from __future__ import annotations

import ipaddress
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from shell_support import Daemon, clean_env, free_port, mint, sample_configs

from certs.loader import client_context
from gateway.link_client import LinkClient
from sbxnet.protocol.preamble import Preamble, push_preamble
from sbxnet.protocol.status import Status

CLI = [sys.executable, "-m", "sbxnet.app.cli"]
OUTCOMES = ("reloaded", "reload_failed")
FORWARDER_SAN = "spiffe://sbxnet.local/forwarder/forwarder"  # on the sample scheduler's forwarder_san_allow


def certs_forwarder(pki: Path, uri: str) -> None:
    """``sbxnet certs forwarder --name feed``: a new key and certificate for the feed, as an operator renews it."""
    subprocess.run([*CLI, "certs", "forwarder", "--dir", str(pki), "--name", "feed", "--ip", "127.0.0.1",
                    "--uri", uri], check=True, capture_output=True, timeout=60, env=clean_env())


class Echo:
    """A sandbox app on loopback: echoes each connection's bytes until its end."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        self.listener.close()


def move_bytes(pki: Path, forwarder_port: int, app: Echo) -> None:
    """One link through the forwarder, as the gateway opens it, with bytes both ways for the feed to report."""
    ctx = client_context(cert_file=pki / "gateway.crt", key_file=pki / "gateway.key", ca_file=pki / "ca.crt")
    link = LinkClient(forwarder_port, ctx, timeout=10)
    try:
        preamble = Preamble(src=ipaddress.ip_address("203.0.113.7"), src_port=40000,
                            dst=ipaddress.ip_address("127.0.0.1"), dst_port=app.port, sandbox_id="feedbox")
        assert link.open(push_preamble(preamble)) is Status.OK
        link.exchange(b"x" * 4096)
    finally:
        link.close()


def hup(d: Daemon, seen: int) -> dict[str, Any]:
    """SIGHUP, then its outcome line (the next one after the ``seen`` already logged)."""
    d.p.send_signal(signal.SIGHUP)
    return d.wait_for(*OUTCOMES, count=seen + 1)[seen]


def test_forwarder_sighup_reloads_the_feed_certificate(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    mint(CLI, pki)
    certs_forwarder(pki, FORWARDER_SAN)
    fport = free_port()
    configs = sample_configs(pki, tmp_path / "etc", var=tmp_path / "var", ports={"forwarder": fport})
    with configs["forwarder"].open("a") as f:
        f.write(f'feed_cert_file = "{pki}/feed.crt"\nfeed_key_file = "{pki}/feed.key"\n'
                'allow_targets = ["127.0.0.1/32"]\n')
    app = Echo()
    scheduler = Daemon(CLI, "scheduler", configs["scheduler"], tmp_path)
    forwarder = None
    try:
        scheduler.wait_for("listening")
        forwarder = Daemon(CLI, "forwarder", configs["forwarder"], tmp_path)
        forwarder.wait_for("listening")
        forwarder.wait_for("feed_started")
        move_bytes(pki, fport, app)
        time.sleep(2.5)  # reported at the next 1 s interval
        assert forwarder.events("feed_backing_off") == [], forwarder.logs

        # A feed certificate whose SAN the scheduler does not take: the next report is refused.
        certs_forwarder(pki, "spiffe://sbxnet.local/forwarder/intruder")
        line = hup(forwarder, 0)
        assert line["event"] == "reloaded" and "feed certificates" in line["what"], line
        assert {str(pki / "feed.crt"), str(pki / "feed.key")} <= set(line["files"]), line
        move_bytes(pki, fport, app)
        (backing_off,) = forwarder.wait_for("feed_backing_off")
        assert backing_off["reason"] == "http_403", backing_off

        # Renewed with the forwarder's SAN: reported again.
        certs_forwarder(pki, FORWARDER_SAN)
        line = hup(forwarder, 1)
        assert line["event"] == "reloaded", line
        forwarder.wait_for("feed_reporting")  # the refused report, sent again at its backoff

        # A broken key: one reload_failed line naming it; the renewed certificate goes on being used.
        (pki / "feed.key").write_text("")
        line = hup(forwarder, 2)
        assert line["event"] == "reload_failed", line
        assert line["what"] == "feed certificates" and line["file"] == str(pki / "feed.key"), line
        move_bytes(pki, fport, app)
        time.sleep(2.5)
        assert len(forwarder.events("feed_backing_off")) == 1, forwarder.logs
        assert [r["event"] for r in forwarder.events(*OUTCOMES)] == ["reloaded", "reloaded", "reload_failed"]
    finally:
        if forwarder is not None:
            assert forwarder.stop() == 0, forwarder.other
        assert scheduler.stop() == 0, scheduler.other
        app.close()
