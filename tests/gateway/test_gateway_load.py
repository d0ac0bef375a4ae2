"""The gateway under load and through a cold start, with real TLS clients, in front of a real forwarder.

- 1,000 slow clients (each a TLS connection whose request head arrives one byte a second: slowloris)
  held open at the gateway (its open-connections gauge says so, before and after) while other clients
  are served: 50 requests, one after another, each on a new connection, each answered within 100 ms
  from the connect. The gateway runs as its own process (``sbxnet gateway``) and the slow clients in
  another (asyncio and ssl), so neither shares an interpreter with the clients that are timed. A run of
  50 that misses is printed and made once more (other jobs on these cores can stall every process).
- A cold start through the whole chain: the sandbox's program starts listening 400 ms after a POST
  with a 256 KiB body was sent to the gateway; the forwarder's connect that gets through comes within
  one backoff step (50 ms) of the listen and the response's first byte a few ms after it (bounds with
  a margin for shared cores, below), and the program gets the body exactly once. A try where the
  request reached the forwarder only after the listen (no cold start) is printed and made again.

Every figure is printed (``pytest -s``) as well as checked.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import os
import random
import resource
import select
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
from gw_support import DOMAIN, EchoHttp, GatewayThread, forwarder_settings, front_cert, registration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ingress"))  # fwd_support
from fwd_support import ForwarderThread, Pki, free_port

SBXNET = [sys.executable, "-m", "sbxnet.app.cli"]
SLOW_CLIENTS = 1000
TIMED_REQUESTS = 50
ANSWER_WITHIN_S = 0.100
# Other jobs share this machine's cores and can stall every process on it for a moment: a run of timed
# requests that missed the bound is printed, and one more run is made (it must hold). A stall of the
# gateway's own would show in both.
TIMED_ATTEMPTS = 2


# -- the 1,000 slow clients --------------------------------------------------------------------------

# The slow clients' program (run as ``python -c``): it opens ``n`` TLS connections, sends each one's
# request head a byte a second (phases spread over the second, as unrelated clients' are), prints
# "open <n>" once every connection is up and has sent its first byte, and on a line on stdin stops
# and prints "closed <k>": how many the gateway closed meanwhile.
FLOOD = r"""
import asyncio, ssl, sys, time

port, n, cafile, host = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
HEAD = (f"GET /slow HTTP/1.1\r\nhost: {host}\r\nx-slow: " + "a" * 4000 + "\r\n\r\n").encode()

async def main():
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    gate = asyncio.Semaphore(32)  # handshakes at a time: the gateway's backlog is not what is tested
    opened = asyncio.Event()
    stop = asyncio.Event()
    state = {"open": 0, "closed": 0, "failed": 0}

    async def client(i):
        async with gate:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host)
            except OSError as e:
                state["failed"] += 1
                print(f"failed {i} {e!r}", file=sys.stderr, flush=True)
                return
            writer.write(HEAD[:1])
            await writer.drain()
        state["open"] += 1
        if state["open"] + state["failed"] == n:
            opened.set()

        async def watch():  # the gateway answering or closing before the end: either counts
            try:
                await reader.read(65536)
            except OSError:
                pass
            if not stop.is_set():
                state["closed"] += 1

        watcher = asyncio.ensure_future(watch())
        await opened.wait()
        loop = asyncio.get_running_loop()
        next_at = loop.time() + i / n  # spread: unrelated clients do not send in step
        sent = 1
        while not stop.is_set() and not watcher.done():
            delay = next_at - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            if stop.is_set() or watcher.done():
                break
            writer.write(HEAD[sent:sent + 1])
            sent += 1
            next_at += 1.0
        watcher.cancel()
        writer.transport.abort()

    tasks = [asyncio.ensure_future(client(i)) for i in range(n)]
    await opened.wait()
    print(f"open {state['open']}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"closed {state['closed']}", flush=True)

asyncio.run(main())
"""


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"{SLOW_CLIENTS} slow clients need {need} descriptors; RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # inherited by the gateway and the slow clients


@pytest.fixture(scope="module")
def backend(pki: Pki) -> Iterator[tuple[ForwarderThread, EchoHttp]]:
    fwd = ForwarderThread(forwarder_settings(pki))
    app = EchoHttp(ident="alpha")
    yield fwd, app
    fwd.stop()
    app.stop()


def gateway_config(tmp: Path, pki: Pki, fwd: ForwarderThread, app: EchoHttp, **extra: Any) -> tuple[Path, int, int]:
    front = front_cert(pki)
    routes = tmp / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        "alpha": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port)}}))
    gw_cert, gw_key = pki.paths["gateway"]
    port, mport = free_port(), free_port()
    values: dict[str, Any] = {
        "listen_host": '"127.0.0.1"', "listen_port": port, "metrics_port": mport, "domain": f'"{DOMAIN}"',
        "cert_files": f'["{front.cert_file}"]', "key_files": f'["{front.key_file}"]', "routes_file": f'"{routes}"',
        "upstream_cert_file": f'"{gw_cert}"', "upstream_key_file": f'"{gw_key}"',
        "upstream_ca_file": f'"{pki.ca_file}"',
        "log_level": '"warning"',  # a line per request would be the gateway's main work here
    }
    values.update(extra)
    path = tmp / "gateway.toml"
    path.write_text("[gateway]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
    return path, port, mport


def open_connections_gauge(mport: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sbxnet_gateway_open_connections":
                return float(s.value)
    raise AssertionError("no sbxnet_gateway_open_connections")


def timed_request(port: int, ctx: ssl.SSLContext) -> tuple[float, float, float, float]:
    """A GET on a connection of its own: seconds from the connect's start to the TCP connection, the TLS
    handshake done, the response's first byte, and the whole response."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        t_tcp = time.monotonic()
        with ctx.wrap_socket(raw, server_hostname=f"alpha.{DOMAIN}") as tls:
            t_tls = time.monotonic()
            tls.sendall(f"GET /timed HTTP/1.1\r\nhost: alpha.{DOMAIN}\r\nconnection: close\r\n\r\n".encode())
            data = tls.recv(65536)
            t_first = time.monotonic()
            while chunk := tls.recv(65536):
                data += chunk
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), data[:200]
    assert json.loads(body)["path"] == "/timed"
    return t_tcp - t0, t_tls - t0, t_first - t0, took


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def timed_run(port: int, ctx: ssl.SSLContext) -> list[tuple[float, float, float, float]]:
    out = []
    for _ in range(TIMED_REQUESTS):
        out.append(timed_request(port, ctx))
        time.sleep(0.01)  # sequential clients, not a benchmark loop
    return out


def ms(runs: list[tuple[float, float, float, float]]) -> str:
    s = sorted(runs, key=lambda r: r[-1])
    slowest = ", ".join(f"{x * 1000:.1f}" for x in s[-1])
    return (f"median {s[len(s) // 2][-1] * 1000:.1f} ms, p90 {s[int(len(s) * 0.9)][-1] * 1000:.1f} ms, "
            f"max {s[-1][-1] * 1000:.1f} ms (its tcp, tls, first byte, end: {slowest} ms)")


def test_1000_slow_clients_while_others_are_answered_within_100ms(
    tmp_path: Path, pki: Pki, backend: tuple[ForwarderThread, EchoHttp]
) -> None:
    raise_fd_limit(4 * SLOW_CLIENTS)
    fwd, app = backend
    config, port, mport = gateway_config(tmp_path, pki, fwd, app, max_connections=SLOW_CLIENTS + 500,
                                         header_timeout=120, handshake_timeout=30)
    gw_log, flood_log = tmp_path / "gateway.log", tmp_path / "flood.log"
    gw = subprocess.Popen([*SBXNET, "gateway", "--config", str(config)], stdout=subprocess.DEVNULL,
                          stderr=gw_log.open("wb"))
    flood: subprocess.Popen[str] | None = None

    def line_from(proc: subprocess.Popen[str], timeout: float) -> str:
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout)[0]:
            raise AssertionError(f"nothing from the slow clients in {timeout} s:\n{flood_log.read_text()[-3000:]}"
                                 f"\ngateway:\n{gw_log.read_text()[-3000:]}")
        return proc.stdout.readline()

    try:
        deadline = time.monotonic() + 30
        while True:
            assert gw.poll() is None, gw_log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become ready"
            time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=str(pki.ca_file))
        ctx.set_alpn_protocols(["http/1.1"])
        timed_request(port, ctx)  # warm: imports, the route cache
        quiet = timed_run(port, ctx)

        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(port), str(SLOW_CLIENTS), str(pki.ca_file), f"alpha.{DOMAIN}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=flood_log.open("wb"), text=True)
        assert flood.stdin is not None
        t_flood = time.monotonic()
        line = line_from(flood, 120)
        opened_s = time.monotonic() - t_flood
        assert line == f"open {SLOW_CLIENTS}\n", (line, flood_log.read_text()[-3000:])
        idle0, idle_t0 = cpu_seconds(gw.pid), time.monotonic()
        time.sleep(1.5)  # every slow client has dripped since: the flood at its steady rate
        flood_cpu = (cpu_seconds(gw.pid) - idle0) / (time.monotonic() - idle_t0)
        before = open_connections_gauge(mport)
        attempts = []
        for _ in range(TIMED_ATTEMPTS):
            cpu0, flood0, busy0, t0 = cpu_seconds(gw.pid), cpu_seconds(flood.pid), machine_busy(), time.monotonic()
            loaded = timed_run(port, ctx)
            cpu1, flood1, busy1, t1 = cpu_seconds(gw.pid), cpu_seconds(flood.pid), machine_busy(), time.monotonic()
            attempts.append((loaded, (cpu1 - cpu0) / (t1 - t0), (flood1 - flood0) / (t1 - t0),
                             (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])))
            if max(r[-1] for r in loaded) < ANSWER_WITHIN_S:
                break
        after = open_connections_gauge(mport)
        flood.stdin.write("stop\n")
        flood.stdin.flush()
        closed = line_from(flood, 60)
        assert flood.wait(30) == 0, flood_log.read_text()[-3000:]
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait()
        gw.terminate()
        try:
            gw.wait(30)
        except subprocess.TimeoutExpired:
            gw.kill()
            gw.wait()
    print(f"\n{SLOW_CLIENTS} slow clients opened in {opened_s:.1f} s; gateway open connections "
          f"{before:.0f} before and {after:.0f} after the timed requests")
    print(f"{TIMED_REQUESTS} requests, each on a new connection, connect to whole response, without the slow "
          f"clients: {ms(quiet)}")
    print(f"the slow clients alone cost the gateway {flood_cpu:.0%} of a core")
    for loaded, gw_cpu, clients_cpu, busy in attempts:
        print(f"with them: {ms(loaded)}; meanwhile the gateway used {gw_cpu:.0%} of a core, the slow clients "
              f"{clients_cpu:.0%}, and the machine's {os.cpu_count()} cores were {busy:.0%} busy")
    # The slow clients were all open at the gateway, all through the timed requests.
    assert before >= SLOW_CLIENTS and after >= SLOW_CLIENTS, (before, after)
    assert closed == "closed 0\n", closed
    loaded = attempts[-1][0]
    assert max(r[-1] for r in loaded) < ANSWER_WITHIN_S, ms(loaded)


# -- cold start through the whole chain ------------------------------------------------------------


class LateHttp(http.server.ThreadingHTTPServer):
    """A sandbox's HTTP program that is not listening yet: its port is bound (so connects to it are refused,
    as to a program that has not started) until ``listen()``. It records each request and the body's
    SHA-256, and answers with them."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _LateHandler, bind_and_activate=False)
        self.server_bind()
        self.port = int(self.server_address[1])
        self.listened_at = 0.0
        self.requests: list[dict[str, Any]] = []

    def listen(self) -> None:
        self.server_activate()
        self.listened_at = time.monotonic()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The gateway aborts a link when its client's connection ends, and the forwarder passes that on as
        # a reset: the keep-alive read after the answer fails. Not this program's error to print.
        pass

    def stop(self) -> None:
        if self.listened_at:
            self.shutdown()
        self.server_close()


class _LateHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        server: LateHttp = self.server  # type: ignore[assignment]
        arrived = time.monotonic()
        body = self.rfile.read(int(self.headers["content-length"]))
        seen = {"path": self.path, "arrived": arrived, "len": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        server.requests.append(seen)
        out = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def cold_post(gw: GatewayThread, sandbox: str, app: LateHttp, ctx: ssl.SSLContext,
              body: bytes) -> tuple[float, float, bytes]:
    """POST ``body``; the program listens 400 ms after it was sent. (sent, first response byte, response),
    on time.monotonic(), the clock the program's listen was read on."""
    host = f"{sandbox}.{DOMAIN}"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        head = f"POST /cold HTTP/1.1\r\nhost: {host}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        sent = time.monotonic()
        timer = threading.Timer(0.4, app.listen)
        timer.start()
        tls.sendall(head.encode() + body)
        first = tls.recv(1)
        first_at = time.monotonic()
        data = first
        while chunk := tls.recv(65536):
            data += chunk
        timer.join()
    return sent, first_at, data


COLD_RUNS = 3
COLD_TRIES = 6


def test_cold_start_through_the_chain_answers_within_a_backoff_step_and_delivers_the_post_once(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sbxnet.forwarder")
    fwd = ForwarderThread(forwarder_settings(pki))  # connect_deadline 1 s: the forwarder rides out the 400 ms
    apps = [LateHttp() for _ in range(COLD_TRIES)]
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"sandboxes": {
        f"cold{i}": registration(pki, fwd.port, {app.port: ("http", "public")}, default=app.port)
        for i, app in enumerate(apps)}}))
    gw = GatewayThread(pki, routes)
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    runs: list[dict[str, float]] = []
    late: list[dict[str, float]] = []
    try:
        for i, app in enumerate(apps):
            if len(runs) == COLD_RUNS:
                break
            body = random.Random(i).randbytes(256 * 1024)
            sent, first_at, data = cold_post(gw, f"cold{i}", app, ctx, body)
            head, _, answer = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 "), data[:300]
            # The body reached the program exactly once, whole.
            assert len(app.requests) == 1, app.requests
            (seen,) = app.requests
            assert json.loads(answer) == seen
            assert seen["len"] == len(body) and seen["sha256"] == hashlib.sha256(body).hexdigest()
            (connected,) = [r for r in caplog.records if getattr(r, "event", None) == "connected"
                            and getattr(r, "target", None) == f"127.0.0.1:{app.port}"]
            fields = connected.__dict__["fields"]
            run = {
                "listened": app.listened_at - sent,  # after the POST was sent
                # The forwarder's first connect to the program (connect_ms runs from it), after the POST.
                "first_attempt": fields["attempt_started"] - fields["connect_ms"] / 1000 - sent,
                "attempts": fields["attempts"],  # the forwarder's connects, the refused ones included
                "attempt_lag": fields["attempt_started"] - app.listened_at,  # the connect that got through
                "arrived_lag": seen["arrived"] - app.listened_at,  # the request at the program
                "first_byte_lag": first_at - app.listened_at,  # the response's first byte at the client
            }
            # A cold start only if the request was at the forwarder's connect before the program listened:
            # a machine that stalls the chain for 400 ms makes this try test nothing, so it is told and
            # tried again (the body was still delivered once, above).
            (runs if run["first_attempt"] < run["listened"] else late).append(run)
    finally:
        gw.stop()
        for app in apps:
            app.stop()
        fwd.stop()

    def show(rs: list[dict[str, float]], key: str) -> list[float]:
        return [round(r[key] * 1000, 1) for r in rs]

    print(f"\ncold start, ms after the program's listen ({len(runs)} runs):")
    for key in ("attempt_lag", "arrived_lag", "first_byte_lag"):
        print(f"  {key}: {show(runs, key)}")
    print(f"  listened after the POST: {show(runs, 'listened')} ms; the forwarder's first connect after the "
          f"POST: {show(runs, 'first_attempt')} ms; its connect attempts {[r['attempts'] for r in runs]}")
    if late:
        print(f"  not cold (the forwarder's first connect came after the listen): first connect "
              f"{show(late, 'first_attempt')} ms, listen {show(late, 'listened')} ms after the POST")
    assert len(runs) == COLD_RUNS, f"only {len(runs)} of {COLD_TRIES} tries were cold starts: {late}"
    for r in runs:
        assert 0.39 < r["listened"] < 0.7, r  # the setup: the program really started late
        assert r["attempts"] >= 5, r  # refused until then, the backoff at its cap
        # One capped step (50 ms) between the listen and the connect that got through, plus the event
        # loop's lateness waking from it on shared cores (an attempt begun just before the listen may
        # connect too).
        assert -0.02 < r["attempt_lag"] < 0.05 + 0.025, r
        # Then the 5 ms of the chain: OK to the gateway, the head and the 256 KiB body to the program, its
        # answer back through both. Bounded at 8x here: other jobs run on the same two cores (29 ms was
        # seen at a load average of 7 on both this and the tree before it; a retry timer gone wrong is
        # hundreds of ms).
        assert r["first_byte_lag"] - r["attempt_lag"] < 0.040, r
        assert r["first_byte_lag"] < 0.05 + 0.025 + 0.040, r
