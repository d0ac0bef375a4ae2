"""``sbxnet demo``: the whole ingress chain on loopback, as an operator would run it, narrated.

It mints certificates, starts the three components as their own processes (``sbxnet scheduler`` on
SQLite, ``sbxnet forwarder`` reporting bytes to it, ``sbxnet gateway`` taking its routes from it), starts
the sandboxes' programs (an HTTP app, a token-protected one, a WebSocket echo, a gRPC service, a raw TCP
echo, one that starts late, one that goes idle and is woken), registers them with the scheduler as a
platform would, and drives them with real clients: curl (HTTP/1.1 and HTTP/2), ``websockets``, ``grpcio``
and ``openssl s_client``. It prints the routing and status codes, first-byte latencies, the bytes moved
and checked, the idle -> wake cycle as the scheduler's event stream told it, the scheduler's status table
and the components' metrics; then stops all three with SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

DOMAIN = "demo.test"
TRUST = "demo.sbxnet"
TOKEN = "demo-token-" + "x" * 8


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=32, help="MiB to move each way through the chain (default 32)")
    p.add_argument("--keep", action="store_true", help="keep the demo's directory (certificates, logs, database)")


def _say(text: str = "") -> None:
    print(text, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Demo:
    def __init__(self, work: Path, mib: int) -> None:
        self.work = work
        self.mib = mib
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.ports = {k: _free_port() for k in ("scheduler", "scheduler_ops", "forwarder", "forwarder_ops",
                                                "gateway", "gateway_ops")}
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.events_error = ""
        self.failures: list[str] = []

    # -- set-up ---------------------------------------------------------------------------------

    def mint(self) -> None:
        from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued

        w = self.work
        ca = mint_ca("sbxnet demo CA")
        write_issued(ca, w, "ca")
        fwd = mint_leaf(ca, "forwarder", ips=("127.0.0.1",), uris=(f"spiffe://{TRUST}/forwarder/host-1",),
                        server=True, client=True)
        write_issued(fwd, w, "forwarder")
        write_issued(mint_leaf(ca, "gateway", uris=(f"spiffe://{TRUST}/gateway",), server=False, client=True), w,
                     "gateway")
        write_issued(mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",)), w, "scheduler")
        write_issued(mint_leaf(ca, "front", dns=(f"*.{DOMAIN}", DOMAIN)), w, "front")
        self.pin = spki_pin(fwd.cert)
        self.admin_token = os.urandom(16).hex()
        (w / "admin.token").write_text(self.admin_token + "\n")
        os.chmod(w / "admin.token", 0o600)
        _say(f"minted a CA and certificates: the forwarder (key pin {self.pin[:12]}..., feed identity "
             f"spiffe://{TRUST}/forwarder/host-1), the gateway (spiffe://{TRUST}/gateway), the scheduler, and "
             f"the public wildcard *.{DOMAIN}")

    def start(self, name: str, args: list[str], env: dict[str, str], ready_port: int) -> None:
        log = self.work / f"{name}.log"
        self.logs[name] = log
        full = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
        full.update(env)
        with log.open("wb") as out:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "sbxnet.app.cli", *args], env=full,
                                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", ready_port)) == 0:
                    return
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                _say(log.read_text())
                raise RuntimeError(f"the {name} did not start (its log is above)")
            time.sleep(0.05)

    def start_components(self) -> str:
        from forwarder.ingress.planes.ktls_keys import probe

        w, p = self.work, self.ports
        sched_url = f"https://127.0.0.1:{p['scheduler']}"
        self.platform = self._platform(sched_url)
        self.start("scheduler", ["scheduler"], {
            "SBXNET_SCHEDULER_LISTEN_PORT": str(p["scheduler"]),
            "SBXNET_SCHEDULER_METRICS_PORT": str(p["scheduler_ops"]),
            "SBXNET_SCHEDULER_CERT_FILE": str(w / "scheduler.crt"),
            "SBXNET_SCHEDULER_KEY_FILE": str(w / "scheduler.key"),
            "SBXNET_SCHEDULER_CA_FILE": str(w / "ca.crt"),
            "SBXNET_SCHEDULER_GATEWAY_SAN_ALLOW": f"spiffe://{TRUST}/gateway",
            "SBXNET_SCHEDULER_FORWARDER_SAN_ALLOW": f"spiffe://{TRUST}/forwarder/host-1",
            "SBXNET_SCHEDULER_ADMIN_TOKEN_FILE": str(w / "admin.token"),
            "SBXNET_SCHEDULER_DATABASE": f"sqlite://{w / 'scheduler.db'}",
            "SBXNET_SCHEDULER_WEBHOOK_URL": self.platform.url,
            "SBXNET_SCHEDULER_ROUTE_CACHE_S": "1",
        }, p["scheduler"])
        ktls = probe()
        self.plane = "ktls" if ktls.ok else "userspace"
        self.start("forwarder", ["forwarder"], {
            "SBXNET_FORWARDER_LISTEN_HOST": "127.0.0.1",
            "SBXNET_FORWARDER_LISTEN_PORT": str(p["forwarder"]),
            "SBXNET_FORWARDER_METRICS_PORT": str(p["forwarder_ops"]),
            "SBXNET_FORWARDER_CERT_FILE": str(w / "forwarder.crt"),
            "SBXNET_FORWARDER_KEY_FILE": str(w / "forwarder.key"),
            "SBXNET_FORWARDER_CA_FILE": str(w / "ca.crt"),
            "SBXNET_FORWARDER_CLIENT_SAN_ALLOW": f"spiffe://{TRUST}/gateway",
            "SBXNET_FORWARDER_SANDBOX_PREFIXES": "127.0.0.0/8",
            "SBXNET_FORWARDER_ALLOW_TARGETS": "127.0.0.1/32",  # the demo's sandboxes live on loopback
            "SBXNET_FORWARDER_DATA_PLANE": self.plane,
            "SBXNET_FORWARDER_CONNECT_DEADLINE": "0.5",
            "SBXNET_FORWARDER_FEED_URL": f"{sched_url}/v1/feed",
            "SBXNET_FORWARDER_FEED_INTERVAL": "0.5",
        }, p["forwarder"])
        self.start("gateway", ["gateway"], {
            "SBXNET_GATEWAY_LISTEN_HOST": "127.0.0.1",
            "SBXNET_GATEWAY_LISTEN_PORT": str(p["gateway"]),
            "SBXNET_GATEWAY_METRICS_PORT": str(p["gateway_ops"]),
            "SBXNET_GATEWAY_DOMAIN": DOMAIN,
            "SBXNET_GATEWAY_CERT_FILES": str(w / "front.crt"),
            "SBXNET_GATEWAY_KEY_FILES": str(w / "front.key"),
            "SBXNET_GATEWAY_SCHEDULER_URL": sched_url,
            "SBXNET_GATEWAY_UPSTREAM_CERT_FILE": str(w / "gateway.crt"),
            "SBXNET_GATEWAY_UPSTREAM_KEY_FILE": str(w / "gateway.key"),
            "SBXNET_GATEWAY_UPSTREAM_CA_FILE": str(w / "ca.crt"),
        }, p["gateway"])
        why = "" if ktls.ok else f" (kernel TLS is not available here: {ktls.cause}; chosen explicitly)"
        _say(f"scheduler  https://127.0.0.1:{p['scheduler']}  SQLite {w / 'scheduler.db'}, the demo's webhook "
             "as the platform's driver")
        _say(f"forwarder  127.0.0.1:{p['forwarder']}  {self.plane} data plane{why}, reporting bytes every 0.5 s")
        _say(f"gateway    https://*.{DOMAIN}:{p['gateway']}  routes from the scheduler")
        return sched_url

    def _platform(self, sched_url: str) -> Any:
        from sbxnet.app.demo_programs import HttpProgram, Platform

        self.sleepy = HttpProgram("sleepy")
        platform = Platform(sched_url, "", str(self.work / "ca.crt"), {"sleepy": self.sleepy})
        return platform

    def register(self, sid: str, port: int, protocol: str = "http", auth: str = "public", **extra: Any) -> None:
        body: dict[str, Any] = {
            "incarnation": "i1", "forwarder": {"address": f"127.0.0.1:{self.ports['forwarder']}",
                                               "spki_pin": self.pin},
            "target_ip": "127.0.0.1", "default_port": port, "ports": {str(port): {"protocol": protocol, "auth": auth}},
            "idle_period_s": 300, "connect_deadline_s": 5, **extra,
        }
        if auth == "token":
            body["token_sha256"] = hashlib.sha256(TOKEN.encode()).hexdigest()
        status, answer = self.platform.admin("PUT", f"/v1/sandboxes/{sid}", body)
        if status not in (200, 201):
            raise RuntimeError(f"registering {sid}: {status} {answer}")

    def watch_events(self, sched_url: str) -> None:
        """The scheduler's event stream, read in the background (what an operator's dashboard would do)."""
        ctx = ssl.create_default_context(cafile=str(self.work / "ca.crt"))
        req = urllib.request.Request(f"{sched_url}/v1/events", headers={"Authorization": f"Bearer {self.admin_token}"})

        def read() -> None:
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=120) as resp:
                    while raw := resp.readline():
                        if raw.startswith(b"data: "):
                            self.events.append((time.monotonic(), json.loads(raw[6:])))
            except OSError as e:
                self.events_error = f"{type(e).__name__}: {e}"

        threading.Thread(target=read, daemon=True).start()

    # -- clients --------------------------------------------------------------------------------

    def curl(self, host: str, path: str = "/", *args: str, http: str = "--http2") -> dict[str, str]:
        port = self.ports["gateway"]
        fmt = ('{"code":"%{http_code}","version":"%{http_version}","connect":"%{time_appconnect}",'
               '"first":"%{time_starttransfer}","size":"%{size_download}","up":"%{size_upload}"}')
        cmd = ["curl", "-sS", http, "--cacert", str(self.work / "ca.crt"), "--resolve", f"{host}:{port}:127.0.0.1",
               "-o", str(self.work / "body"), "-w", fmt, *args, f"https://{host}:{port}{path}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            return {"code": "000", "error": r.stderr.strip()}
        out: dict[str, str] = json.loads(r.stdout)
        out["body"] = (self.work / "body").read_bytes()[:200].decode(errors="replace").strip()
        return out

    def show(self, label: str, r: dict[str, str], expect: str) -> None:
        if "error" in r:
            line = f"  {label:<44} curl failed: {r['error']}"
        else:
            wait = (float(r["first"]) - float(r["connect"])) * 1000
            body = r["body"] if len(r["body"]) < 70 else r["body"][:67] + "..."
            line = (f"  {label:<44} {r['code']} HTTP/{r['version']:<3} first byte {wait:6.1f} ms after TLS  "
                    f"{body!r}")
        if r.get("code") != expect:
            self.failures.append(f"{label}: expected {expect}, got {r.get('code')}")
            line += f"   <-- expected {expect}"
        _say(line)

    # -- the story ------------------------------------------------------------------------------

    def run(self) -> None:
        from sbxnet.app.demo_programs import HttpProgram, grpc_program, websocket_echo

        _say(f"== sbxnet demo: the whole ingress chain on loopback (working directory {self.work})")
        self.mint()
        sched_url = self.start_components()
        self.platform.token = self.admin_token
        self.watch_events(sched_url)

        web, vault, late = HttpProgram("web"), HttpProgram("vault"), HttpProgram("late")
        web.start()
        vault.start()
        ws_port, rpc_port, term_port = _free_port(), _free_port(), _free_port()
        ws_stop = websocket_echo(ws_port)
        rpc_stop = grpc_program(rpc_port)
        term = _TcpEcho(term_port)
        self.register("web", web.port)
        self.register("vault", vault.port, auth="token")
        self.register("chat", ws_port)
        self.register("rpc", rpc_port, protocol="h2c")
        self.register("term", term_port, protocol="tcp")
        self.register("late", late.port, connect_deadline_s=10)
        _say("registered 6 sandboxes with the scheduler as the platform would (PUT /v1/sandboxes/<id>): web, "
             "vault (token), chat (WebSocket), rpc (gRPC over h2c), term (raw TCP), late")

        _say("\n-- 1. routing, every request on its own (curl)")
        self.show(f"GET https://web.{DOMAIN}/ (HTTP/2)", self.curl(f"web.{DOMAIN}"), "200")
        self.show(f"GET https://web.{DOMAIN}/ (HTTP/1.1)", self.curl(f"web.{DOMAIN}", http="--http1.1"), "200")
        self.show(f"GET https://nobody.{DOMAIN}/ (unknown sandbox)", self.curl(f"nobody.{DOMAIN}"), "404")
        self.show(f"GET https://9-web.{DOMAIN}/ (port not exposed)", self.curl(f"9-web.{DOMAIN}"), "404")
        self.show(f"SNI web, Host: vault.{DOMAIN}", self.curl(f"web.{DOMAIN}", "/", "-H", f"Host: vault.{DOMAIN}",
                                                            http="--http1.1"), "421")
        self.show(f"GET https://vault.{DOMAIN}/ without a token", self.curl(f"vault.{DOMAIN}"), "401")
        self.show(f"GET https://vault.{DOMAIN}/ with a wrong token",
                  self.curl(f"vault.{DOMAIN}", "/", "-H", "Authorization: Bearer nope"), "403")
        self.show(f"GET https://vault.{DOMAIN}/?token=... (a browser)",
                  self.curl(f"vault.{DOMAIN}", f"/?token={TOKEN}"), "303")
        self.show(f"GET https://vault.{DOMAIN}/ with the token",
                  self.curl(f"vault.{DOMAIN}", "/", "-H", f"Authorization: Bearer {TOKEN}"), "200")

        n = self.mib << 20
        _say(f"\n-- 2. bytes: {self.mib} MiB down and up through gateway -> forwarder -> sandbox (HTTP/2)")
        r = self.curl(f"web.{DOMAIN}", f"/bytes/{n}")
        got = hashlib.sha256((self.work / "body").read_bytes()).hexdigest()
        ok = r.get("code") == "200" and got == web.expected_download(n)
        _say(f"  download: {r.get('code')}, {int(r.get('size', 0)) >> 20} MiB, sha256 {'matches' if ok else 'DIFFERS'}")
        if not ok:
            self.failures.append("download hash")
        upload = self.work / "upload"
        upload.write_bytes(os.urandom(n))
        r = self.curl(f"web.{DOMAIN}", "/", "--data-binary", f"@{upload}", "-H",
                      "content-type: application/octet-stream")
        ok = r.get("code") == "200" and r.get("body") == hashlib.sha256(upload.read_bytes()).hexdigest()
        _say(f"  upload:   {r.get('code')}, {int(r.get('up', 0)) >> 20} MiB, sha256 at the sandbox "
             f"{'matches' if ok else 'DIFFERS'}")
        if not ok:
            self.failures.append("upload hash")

        _say("\n-- 3. WebSocket, gRPC and raw TCP")
        self.websocket(ws_port if ws_stop else None)
        self.grpc(rpc_stop is not None)
        self.raw(term_port)

        _say("\n-- 4. cold start: the 'late' program starts listening 400 ms after the request arrives")
        timer = late.start_after(0.4)
        t0 = time.monotonic()
        r = self.curl(f"late.{DOMAIN}")
        timer.join()
        assert late.listened_at is not None
        took = (time.monotonic() - t0) * 1000
        _say(f"  {r.get('code')} in {took:.0f} ms in all; the program listened at {1000 * (late.listened_at - t0):.0f}"
             " ms (the gateway and the forwarder retry: a fresh SYN every 50 ms, 5 ms backoff doubling to 50 ms)")
        if r.get("code") != "200":
            self.failures.append("cold start")

        self.idle_cycle()
        self.status()
        self.metrics()
        for stop in (ws_stop, rpc_stop, term.stop, web.stop, vault.stop, late.stop, self.sleepy.stop):
            if stop:
                stop()

    def websocket(self, port: int | None) -> None:
        if port is None:
            _say("  WebSocket: skipped (the websockets library is not installed)")
            return
        from websockets.sync.client import connect

        ctx = ssl.create_default_context(cafile=str(self.work / "ca.crt"))
        sock = socket.create_connection(("127.0.0.1", self.ports["gateway"]))
        url = f"wss://chat.{DOMAIN}:{self.ports['gateway']}/"
        with connect(url, sock=sock, ssl=ctx, server_hostname=f"chat.{DOMAIN}") as ws:
            t0 = time.monotonic()
            for i in range(100):
                ws.send(f"message {i}")
                if ws.recv() != f"message {i}":
                    self.failures.append("websocket echo")
            took = (time.monotonic() - t0) * 1000
        _say(f"  WebSocket wss://chat.{DOMAIN}/: 100 messages echoed, {took / 100:.2f} ms per round trip")

    def grpc(self, available: bool) -> None:
        if not available:
            _say("  gRPC: skipped (grpcio is not installed)")
            return
        import grpc

        from sbxnet.app.demo_programs import GRPC_SERVICE

        name = f"rpc.{DOMAIN}"
        creds = grpc.ssl_channel_credentials(root_certificates=(self.work / "ca.crt").read_bytes())
        opts = [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
        with grpc.secure_channel(f"127.0.0.1:{self.ports['gateway']}", creds, options=opts) as ch:
            unary = ch.unary_unary(f"/{GRPC_SERVICE}/Unary")
            answer = unary(b"hi", timeout=10)
            stream = ch.unary_stream(f"/{GRPC_SERVICE}/Count")
            count = sum(1 for _ in stream(b"1000", timeout=10))
        if answer != b"echo: hi" or count != 1000:
            self.failures.append("grpc")
        _say(f"  gRPC {name}: unary answered {answer!r}; server streaming delivered {count} messages")

    def raw(self, port: int) -> None:
        name = f"term.{DOMAIN}"
        if shutil.which("openssl") is None:
            _say("  raw TCP: skipped (openssl is not installed)")
            return
        # -quiet keeps the connection open at the end of its input: read the echo, then end it.
        proc = subprocess.Popen(["openssl", "s_client", "-quiet", "-verify_return_error", "-CAfile",
                                 str(self.work / "ca.crt"), "-servername", name, "-connect",
                                 f"127.0.0.1:{self.ports['gateway']}"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdin is not None and proc.stdout is not None
        got = b""
        try:
            proc.stdin.write(b"ping over raw TLS\n")
            proc.stdin.flush()
            reader = threading.Thread(target=lambda: got_line.append(proc.stdout.readline()),  # type: ignore[union-attr]
                                      daemon=True)
            got_line: list[bytes] = []
            reader.start()
            reader.join(15)
            got = got_line[0] if got_line else b""
        finally:
            proc.kill()
            proc.wait()
        ok = got == b"ping over raw TLS\n"
        if not ok:
            self.failures.append("raw tcp")
        _say(f"  raw TCP (openssl s_client -servername {name}): echoed {'back' if ok else 'NOTHING'} "
             "(routed by SNI alone, no ALPN)")

    def idle_cycle(self) -> None:
        _say("\n-- 5. idle and wake: 'sleepy' idles 2 s after its last byte; the platform stops it; a request "
             "wakes it")
        # Registered only now: a 2 s period running from the start would lapse during the sections above
        # on a slow machine, and the platform would be stopping it as this request arrives.
        self.sleepy.start()
        self.register("sleepy", self.sleepy.port, idle_period_s=2)
        t0 = time.monotonic()
        self.show(f"GET https://sleepy.{DOMAIN}/ (traffic)", self.curl(f"sleepy.{DOMAIN}"), "200")
        deadline = time.monotonic() + 20
        while self.sleepy.running and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = time.monotonic()
        _say(f"  no traffic: the program was stopped {stopped - t0:.1f} s later")
        time.sleep(0.5)
        t1 = time.monotonic()
        r = self.curl(f"sleepy.{DOMAIN}", "/again")
        self.show(f"GET https://sleepy.{DOMAIN}/again (wakes it)", r, "200")
        _say(f"  answered {1000 * (time.monotonic() - t1):.0f} ms after the request (the wake, the program's "
             "200 ms start, the connect)")
        time.sleep(0.3)
        _say("  the scheduler's event stream (GET /v1/events) for sleepy, and what the platform did:")
        lines = [(at, f"{ev['from'] or '-':>8} -> {ev['to']:<8} ({ev['why']})") for at, ev in self.events
                 if ev["sandbox"] == "sleepy" and at >= t0]
        lines += [(at, f"platform: {what}") for at, what in self.platform.actions]
        for at, text in sorted(lines):
            _say(f"    +{at - t0:5.2f} s  {text}")
        if self.events_error:
            _say(f"    (the stream failed: {self.events_error})")
        moves = [(ev["from"], ev["to"]) for _, ev in self.events if ev["sandbox"] == "sleepy"]
        if moves[-5:] != [("active", "idle"), ("idle", "stopping"), ("stopping", "stopped"), ("stopped", "waking"),
                          ("waking", "active")]:
            self.failures.append(f"the idle -> wake cycle: {moves}")

    def status(self) -> None:
        _say("\n-- 6. sbxnet scheduler status")
        r = subprocess.run([sys.executable, "-m", "sbxnet.app.cli", "scheduler", "status", "--url",
                            f"https://127.0.0.1:{self.ports['scheduler']}", "--ca-file", str(self.work / "ca.crt"),
                            "--token-file", str(self.work / "admin.token")], capture_output=True, text=True,
                           timeout=30)
        for line in (r.stdout or r.stderr).splitlines():
            _say("  " + line)

    def metrics(self) -> None:
        _say("\n-- 7. metrics (selected)")
        wanted = {
            "gateway_ops": ("sbxnet_gateway_requests_total", "sbxnet_gateway_wakes_total",
                            "sbxnet_gateway_route_cache_total"),
            "forwarder_ops": ("sbxnet_forwarder_bytes_total", "sbxnet_forwarder_feed"),
            "scheduler_ops": ("sbxnet_scheduler_feed_batches_total", "sbxnet_scheduler_sandboxes",
                              "sbxnet_scheduler_webhook_total"),
        }
        for ops, prefixes in wanted.items():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[ops]}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except OSError as e:
                _say(f"  {ops}: {e}")
                continue
            for line in text.splitlines():
                if line.startswith(prefixes) and "_created" not in line and not line.endswith(" 0.0"):
                    _say("  " + line)

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for name in ("gateway", "forwarder", "scheduler"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        if hasattr(self, "platform"):
            self.platform.close()
        return codes


class _TcpEcho:
    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    def stop(self) -> None:
        self.sock.close()


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="sbxnet-demo-"))
    demo = Demo(work, args.mib)
    try:
        demo.run()
    except Exception as e:
        demo.failures.append(f"{type(e).__name__}: {e}")
        _say(f"\ndemo: stopped by {type(e).__name__}: {e}")
    finally:
        codes = demo.stop()
    _say("\n-- 8. SIGTERM to each: " + ", ".join(f"{n} exited {c}" for n, c in codes.items())
         + f"; their JSON logs are in {work}")
    if any(c != 0 for c in codes.values()):
        demo.failures.append("a component did not exit cleanly")
    if demo.failures:
        _say("demo: FAILED: " + "; ".join(demo.failures))
        _say(f"(the directory {work} is kept for a look)")
        return 1
    _say("demo: every step did what it should")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        _say("(the directory is removed; pass --keep to keep it)")
    return 0
