"""``sbxnet demo-forwarder``: the forwarder's side of the link on loopback, narrated.

It mints certificates, starts a sample sandbox app and the forwarder (``sbxnet forwarder``, as an
operator would run it), then acts as the gateway: mutual TLS, preamble, status, bytes both ways with
SHA-256 checks, a cold start, and the refusals (a forbidden target, a peer off the allowlist, a
sandbox that never listens). It prints what happened and the forwarder's own metrics, then drains it.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=64, help="MiB to move each way (default 64)")
    p.add_argument("--keep", action="store_true", help="keep the demo's directory (certs, config, logs)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SampleApp:
    """The sandbox's program: answers 'hello' lines, hashes bulk uploads, streams a download."""

    def __init__(self, port: int | None = None, download: bytes = b"") -> None:
        self.port = port or _free_port()
        self.download = download
        self.upload_digest = ""
        self.listened_at = 0.0

    def listen(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(16)
        self.listened_at = time.monotonic()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            first = conn.recv(6)
            if first == b"hello\n":
                conn.sendall(b"hello from the sandbox\n")
                return
            sender = threading.Thread(target=self._send_download, args=(conn,))
            sender.start()
            h = hashlib.sha256(first)
            while data := conn.recv(1 << 18):
                h.update(data)
            self.upload_digest = h.hexdigest()
            sender.join()

    def _send_download(self, conn: socket.socket) -> None:
        conn.sendall(self.download)
        conn.shutdown(socket.SHUT_WR)


def _say(text: str) -> None:
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    from certs.loader import PinMismatch, client_context
    from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued
    from gateway.link_client import LinkClient
    from sbxnet.protocol.preamble import Preamble, push_preamble
    from sbxnet.protocol.status import Status

    work = Path(tempfile.mkdtemp(prefix="sbxnet-demo-"))
    _say(f"== sbxnet demo (working directory {work})")
    ca = mint_ca("sbxnet demo CA")
    write_issued(ca, work, "ca")
    fwd_leaf = mint_leaf(ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",))
    write_issued(fwd_leaf, work, "forwarder")
    write_issued(
        mint_leaf(ca, "gateway", uris=("spiffe://demo.sbxnet/gateway",), server=False, client=True), work, "gateway"
    )
    write_issued(
        mint_leaf(ca, "stranger", uris=("spiffe://demo.sbxnet/stranger",), server=False, client=True), work, "stranger"
    )
    _say(
        f"minted a CA, the forwarder's certificate (SPKI pin {spki_pin(fwd_leaf.cert)}) and two client "
        "certificates: spiffe://demo.sbxnet/gateway (allowed) and spiffe://demo.sbxnet/stranger (not)"
    )

    from forwarder.ingress.planes.ktls_keys import probe

    ktls = probe()
    plane = "ktls" if ktls.ok else "userspace"
    if not ktls.ok:
        _say(f"kernel TLS is not available here ({ktls.cause}): the demo chooses the userspace data plane "
             "explicitly (a forwarder left on the default ktls plane would refuse to start)")
    port, mport = _free_port(), _free_port()
    config = work / "forwarder.toml"
    config.write_text(
        "[forwarder]\n"
        f'listen_host = "127.0.0.1"\nlisten_port = {port}\nmetrics_port = {mport}\n'
        f'cert_file = "{work / "forwarder.crt"}"\nkey_file = "{work / "forwarder.key"}"\n'
        f'ca_file = "{work / "ca.crt"}"\n'
        'client_san_allow = ["spiffe://demo.sbxnet/gateway"]\n'
        'sandbox_prefixes = ["127.0.0.0/8"]\n'
        "# loopback is refused unless explicitly allowed: the demo sandbox lives on 127.0.0.1\n"
        'allow_targets = ["127.0.0.1/32"]\n'
        f'data_plane = "{plane}"\nconnect_deadline = 1.0\n'
    )
    log_path = work / "forwarder.log"
    log = log_path.open("wb")
    fwd = subprocess.Popen(
        [sys.executable, "-m", "sbxnet.app.cli", "forwarder", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=0.5):
                    break
            except OSError:
                if fwd.poll() is not None or time.monotonic() > deadline:
                    _say(log_path.read_text())
                    _say("demo: the forwarder did not start")
                    return 1
                time.sleep(0.05)
        _say(f"forwarder listening on 127.0.0.1:{port} ({plane} data plane), ops on 127.0.0.1:{mport}")
        _say("the gateway-like client presents spiffe://demo.sbxnet/gateway and pins the forwarder's key")
        ctx = client_context(cert_file=work / "gateway.crt", key_file=work / "gateway.key", ca_file=work / "ca.crt")
        pins = {spki_pin(fwd_leaf.cert)}  # the gateway identifies the forwarder by its key

        def preamble(dst: str, dport: int, sandbox: str) -> bytes:
            return push_preamble(
                Preamble(
                    src=ipaddress.ip_address("198.51.100.23"),
                    src_port=51000,
                    dst=ipaddress.ip_address(dst),
                    dst_port=dport,
                    sandbox_id=sandbox,
                    connection_id=os.urandom(8).hex().encode(),
                )
            )

        n = args.mib << 20
        download = random.Random(2).randbytes(n)
        app = SampleApp(download=download)
        app.listen()
        _say(f"\n-- 1. a request to sandbox 'sbx-demo' at 127.0.0.1:{app.port}")
        c = LinkClient(port, ctx, pins=pins)
        status = c.open(preamble("127.0.0.1", app.port, "sbx-demo"))
        c.send(b"hello\n")
        _say(f"status {status.name}; the sandbox answered: {c.recv_all().decode().strip()!r}")
        c.close_write()  # close_notify, then FIN: a FIN alone would be a truncation, answered with a reset
        c.close()

        _say(f"\n-- 2. {args.mib} MiB each way, both directions at once")
        upload = random.Random(1).randbytes(n)
        c = LinkClient(port, ctx, pins=pins)
        assert c.open(preamble("127.0.0.1", app.port, "sbx-demo")) is Status.OK
        t0 = time.monotonic()
        got = c.exchange(upload)
        dt = time.monotonic() - t0
        c.close()
        time.sleep(0.1)
        up_ok = app.upload_digest == hashlib.sha256(upload).hexdigest()
        down_ok = got == hashlib.sha256(download).digest() and c.received_len == n
        _say(f"upload   sha256 at the sandbox {'matches' if up_ok else 'DIFFERS'}")
        _say(f"download sha256 at the gateway {'matches' if down_ok else 'DIFFERS'}")
        _say(
            f"{2 * n / dt / 1e6:.0f} MB/s through the hop in total ({dt:.2f} s; the demo's own client "
            "shares these cores, so this is not a benchmark: see bench/)"
        )

        _say("\n-- 3. cold start: the sandbox's program starts listening 400 ms after the request")
        late = SampleApp()
        timer = threading.Timer(0.4, late.listen)
        c = LinkClient(port, ctx, pins=pins)
        c.handshake()
        timer.start()
        c.send_preamble(preamble("127.0.0.1", late.port, "sbx-cold"))
        status = c.open_status()
        answered = time.monotonic()
        c.send(b"hello\n")
        c.recv_all()
        c.close_write()
        c.close()
        _say(
            f"status {status.name} {1000 * (answered - late.listened_at):.1f} ms after the program listened "
            "(retries: 5 ms doubling to 50 ms; a fresh SYN every 50 ms)"
        )

        _say("\n-- 4. what the forwarder refuses")
        for what, dst, dport in [
            ("cloud metadata 169.254.169.254:80", "169.254.169.254", 80),
            ("the forwarder host's own loopback 127.0.0.2:22", "127.0.0.2", 22),
        ]:
            c = LinkClient(port, ctx, pins=pins)
            _say(f"target {what}: status {c.open(preamble(dst, dport, 'sbx-demo')).name}")
            c.close()
        dead = _free_port()
        c = LinkClient(port, ctx, pins=pins)
        t0 = time.monotonic()
        st = c.open(preamble("127.0.0.1", dead, "sbx-gone"))
        _say(f"a sandbox that never listens: status {st.name} after {time.monotonic() - t0:.2f} s (connect deadline)")
        c.close()
        sctx = client_context(cert_file=work / "stranger.crt", key_file=work / "stranger.key", ca_file=work / "ca.crt")
        c = LinkClient(port, sctx, pins=pins)
        _say(f"a client certificate off the allowlist: status {c.open(preamble('127.0.0.1', app.port, 'x')).name}")
        c.close()
        c = LinkClient(port, ctx, pins={"0" * 43 + "="})
        try:
            c.handshake()
            _say("a forwarder whose key is not pinned: NOT REFUSED (bug)")
        except PinMismatch:
            _say("a forwarder whose key is not the pinned one: the client hangs up before sending a byte")
        c.close()
        c = LinkClient(port, ctx, pins=pins)
        c.handshake()
        c.send_preamble(b"GET / HTTP/1.1\r\nHost: sbx-demo\r\n\r\n")
        _say(f"HTTP instead of a preamble: status {c.open_status().name}")
        c.close()

        time.sleep(1.2)  # one metrics flush
        _say(f"\n-- 5. the forwarder's metrics (http://127.0.0.1:{mport}/metrics, selected)")
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(
                    (
                        "sbxnet_forwarder_connections_total",
                        "sbxnet_forwarder_bytes_total",
                        "sbxnet_forwarder_handshake_rejects_total",
                        "sbxnet_forwarder_target_rejects_total",
                        "sbxnet_forwarder_preamble_rejects_total",
                        "sbxnet_forwarder_data_plane",
                    )
                ):
                    _say("  " + line)
    finally:
        fwd.send_signal(signal.SIGTERM)
        try:
            rc = fwd.wait(30)
        except subprocess.TimeoutExpired:
            fwd.kill()
            rc = fwd.wait()
        log.close()
    _say(f"\n-- 6. SIGTERM: the forwarder drained and exited with {rc}; its JSON log is {log_path}")
    events = [ln for ln in log_path.read_text().splitlines() if '"event": "closed"' in ln][:2]
    for ln in events:
        _say("  " + ln[:240])
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        _say("(the directory is removed; pass --keep to keep it)")
    return 0 if rc == 0 else 1
