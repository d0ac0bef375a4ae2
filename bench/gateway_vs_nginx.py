"""The gateway chain against nginx as the same TLS front end, and against a direct TLS connection (issue 9).

    .venv/bin/python bench/gateway_vs_nginx.py --rounds 3 --out results.json

Everything runs on loopback, each party its own process. One sandbox app for all arms: nginx
(bench/nginx/app.conf, one worker) serving a small static body and a large file over plaintext
HTTP/1.1, and the same files over TLS 1.3 for arm D.

Arms:
  A  ``sbxnet gateway`` (routes file, client TLS 1.3) -> ``sbxnet forwarder`` (mutual TLS 1.3, the
     preamble; kTLS data plane if this kernel has it, else userspace) -> the app's plaintext port
  P  the same as A with the gateway's warm pool on (``upstream_pool_size`` 2): a chain of its own
  B  nginx as the same front end (bench/nginx/front.conf: TLS 1.3 with the same certificate, HTTP parsed,
     X-Forwarded-*, ``proxy_pass https://`` with the gateway's client certificate, upstream keep-alive)
     -> nginx's stream module as the TCP-level mutual-TLS hop (bench/nginx/hop.conf, the forwarder's
     certificate) -> the app's plaintext port
  D  direct: TLS 1.3 to the app's own TLS listener, no hop: the baseline for added latency
  O  the same as A with the gateway's code taken from another source tree (``--old-tree DIR``, e.g. a
     ``git worktree`` of an earlier commit; the forwarder stays this tree's): old against new, interleaved,
     for a change to the gateway (O and A differ only in the gateway's code)

Each front and hop runs one worker. Measurements (``--metrics``), with h2load (nghttp2-client) and curl:
  ka1        keep-alive, one connection, small body: p50, p99, requests/s
  kaN        keep-alive, ``--conns`` connections: the same, and requests per front CPU-second (requests/s
             divided by the front process's CPU-seconds per second; that is requests/s per front core)
  newconn    ``--newconn-n`` requests with ``Connection: close``, ``--newconn-conns`` at a time, so each
             request has a connection of its own (h2load reconnects): requests/s, requests per front
             CPU-second, p50 and p99 from the request's write to the response's end (the client handshake
             not included)
  firstbyte  ``--firstbyte-n`` connections one after another (curl, full handshakes, no session reuse):
             p50 and p99 from the TCP connect's start to the response's first byte, and the handshake alone
  bulk       the large file over one connection (curl): GB/s, and CPU-seconds per GB of the front, the
             hop and the two together

CPU is utime + stime from /proc/<pid>/stat over a process, its threads and its live descendants
(nginx's master and worker), sampled just before and just after each load run. Each trial also records
the CPU the rest of the machine used meanwhile ("others", from /proc/stat less ours and the client's).

Interleaving: every (round, measurement) step runs the arms in the order given, the next step in the
reverse order (A B D, D B A, A B D, ...), so drift on a shared machine falls on every arm. Figures are the
median and range over the rounds. Results (every trial, the summary, the machine) go to ``--out`` as JSON;
a Markdown table is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
NGINX_CONF = Path(__file__).resolve().parent / "nginx"
VENV_PY = ROOT / ".venv" / "bin" / "python"
PY = str(VENV_PY) if VENV_PY.exists() else sys.executable
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
H2LOAD = shutil.which("h2load") or "/usr/bin/h2load"
CURL = shutil.which("curl") or "/usr/bin/curl"
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")
DOMAIN = "bench.test"
SANDBOX = "app"
HOST = f"{SANDBOX}.{DOMAIN}"
TRUST = "bench.sbxnet"
GB = 1e9
CLK_TCK = os.sysconf("SC_CLK_TCK")
METRICS = ("ka1", "kaN", "newconn", "firstbyte", "bulk")
ARM_NAMES = {
    "A": "sbxnet gateway -> sbxnet forwarder -> app",
    "P": "the same as A, with the gateway's warm pool (2 ready links)",
    "B": "nginx front -> nginx stream TLS hop -> app",
    "D": "direct TLS to the app (no hop)",
    "O": "the same as A, with the gateway from --old-tree",
}


# -- CPU accounting -----------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime ticks) of one process (all its threads), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def tree_cpu(roots: list[int]) -> float:
    """CPU seconds used so far by each root, its threads and all its live descendants, summed."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st:
                parent[int(entry)], ticks[int(entry)] = st
    want = set(roots)
    total = 0
    for pid in ticks:
        p = pid
        while p and p not in want:
            p = parent.get(p, 0)
        if p:
            total += ticks[pid]
    return total / CLK_TCK


def machine_busy() -> float:
    """CPU seconds (all cores) spent not idle since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + vals[4]
    return (sum(vals[:8]) - idle) / CLK_TCK


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# -- the machine --------------------------------------------------------------------------------------


def _first_line(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except OSError as e:
        return f"unavailable ({e})"
    return ((r.stdout or "") + (r.stderr or "")).strip().splitlines()[0] if (r.stdout or r.stderr) else "?"


def describe_machine() -> dict[str, Any]:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    try:
        import uvloop

        uv = uvloop.__version__
    except ImportError:
        uv = "not installed"
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "openssl": ssl.OPENSSL_VERSION,
        "uvloop": uv,
        "nginx": _first_line([NGINX, "-v"]),
        "h2load": _first_line([H2LOAD, "--version"]),
        "curl": _first_line([CURL, "--version"]),
    }


def wait_for_quiet(threshold: float, max_wait: float) -> dict[str, Any]:
    """Poll the 1-minute load average every 30 s until it is under ``threshold`` or ``max_wait`` passes."""
    t0 = time.monotonic()
    samples = []
    while True:
        load = os.getloadavg()[0]
        samples.append(round(load, 2))
        print(f"load average {load:.2f} (waiting for < {threshold})", flush=True)
        if load < threshold or time.monotonic() - t0 >= max_wait:
            break
        time.sleep(min(30.0, max(1.0, max_wait - (time.monotonic() - t0))))
    return {"threshold": threshold, "waited_s": round(time.monotonic() - t0, 1), "samples": samples,
            "reached": samples[-1] < threshold}


# -- processes ------------------------------------------------------------------------------------------


def _tree_commit(tree: Path) -> str:
    """The commit a source tree is at, for the report ("?" where it is not a git checkout)."""
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before listening on {port}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout} s:\n{log.read_text()[-3000:]}")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Arm:
    key: str
    port: int
    front: list[Server]
    hop: list[Server]
    app: list[Server]
    note: str = ""
    cipher: str = ""


@dataclass
class Snapshot:
    wall: float
    front: float
    hop: float
    app: float
    busy: float
    client: float


@dataclass
class Bench:
    work: Path
    small_bytes: int
    large_bytes: int
    servers: list[Server] = field(default_factory=list)
    arms: dict[str, Arm] = field(default_factory=dict)
    plane: str = ""
    plane_note: str = ""
    old_tree: Path | None = None

    # -- set-up -----------------------------------------------------------------------------------------

    def mint(self) -> None:
        from certs.mint import mint_ca, mint_leaf, spki_pin, write_issued

        w = self.work
        ca = mint_ca("bench CA")
        write_issued(ca, w, "ca")
        fwd = mint_leaf(ca, "forwarder", dns=("localhost",), ips=("127.0.0.1",), server=True)
        write_issued(fwd, w, "forwarder")
        write_issued(mint_leaf(ca, "gateway", uris=(f"spiffe://{TRUST}/gateway",), server=False, client=True), w,
                     "gateway")
        write_issued(mint_leaf(ca, "front", dns=(f"*.{DOMAIN}", DOMAIN)), w, "front")
        self.pin = spki_pin(fwd.cert)

    def content(self) -> None:
        www = self.work / "www"
        www.mkdir()
        (self.work / "tmp").mkdir()
        (www / "small").write_bytes(os.urandom(self.small_bytes))
        block = os.urandom(1 << 20)
        with open(www / "large", "wb") as f:
            left = self.large_bytes
            while left:
                f.write(block[: min(left, len(block))])
                left -= min(left, len(block))
        self.small_sha = hashlib.sha256((www / "small").read_bytes()).hexdigest()
        h = hashlib.sha256()
        with open(www / "large", "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        self.large_sha = h.hexdigest()

    def nginx(self, name: str, values: dict[str, str | int], ready_port: int, *, conf_dir: Path = NGINX_CONF) -> Server:
        """Fill in ``conf_dir/<name>.conf`` (``@KEY@`` placeholders) and start nginx on it."""
        text = (conf_dir / f"{name}.conf").read_text()
        for k, v in {"DIR": str(self.work), "HOST": HOST, **values}.items():
            text = text.replace(f"@{k}@", str(v))
        if "@" in re.sub(r"#.*", "", text):
            raise RuntimeError(f"{name}.conf: a placeholder was not filled in")
        conf = self.work / f"{name}.conf"
        conf.write_text(text)
        log = self.work / f"{name}.out"
        with log.open("wb") as out:
            proc = subprocess.Popen([NGINX, "-p", str(self.work), "-c", str(conf)], stdout=out,
                                    stderr=subprocess.STDOUT)
        server = Server(f"nginx-{name}", proc, log)
        self.servers.append(server)
        wait_port(ready_port, proc, log)
        return server

    def sbxnet(self, name: str, env: dict[str, str], ready_port: int, *, tag: str = "",
               tree: Path | None = None) -> Server:
        """Start ``sbxnet <name>`` from this checkout, or from ``tree`` (its code first on the path)."""
        log = self.work / f"{name}{tag}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_") and k != "PYTHONPATH"}
        full.update(env)
        if tree is not None:
            full["PYTHONPATH"] = str(tree)
        with log.open("wb") as out:
            proc = subprocess.Popen([PY, "-m", "sbxnet.app.cli", name], env=full, cwd=tree or ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
        server = Server(name, proc, log)
        self.servers.append(server)
        wait_port(ready_port, proc, log)
        return server

    def start(self, arms: list[str]) -> None:
        app_port, app_tls = free_port(), free_port()
        app = self.nginx("app", {"APP_PORT": app_port, "APP_TLS_PORT": app_tls}, app_port)
        self.app_port, self.app = app_port, app
        wait_port(app_tls, app.proc, app.log)
        if "D" in arms:
            self.arms["D"] = Arm("D", app_tls, [app], [], [], "the app nginx's own TLS listener")
        if "B" in arms:
            if not STREAM_MODULE.exists():
                raise RuntimeError(f"arm B needs nginx's stream module ({STREAM_MODULE}; Debian: libnginx-mod-stream)")
            hop_port, front_port = free_port(), free_port()
            hop = self.nginx("hop", {"HOP_PORT": hop_port, "APP_PORT": app_port}, hop_port)
            front = self.nginx("front", {"FRONT_PORT": front_port, "HOP_PORT": hop_port}, front_port)
            self.arms["B"] = Arm("B", front_port, [front], [hop], [app],
                                 "nginx http (1 worker) -> nginx stream (1 worker)")
        if "A" in arms:
            self.arms["A"] = self.chain("A", pool_size=0)
        if "P" in arms:
            self.arms["P"] = self.chain("P", pool_size=2)
        if "O" in arms:
            if self.old_tree is None:
                raise RuntimeError("arm O needs --old-tree DIR (a source tree of the gateway to compare against)")
            self.arms["O"] = self.chain("O", pool_size=0, gateway_tree=self.old_tree)
        for arm in self.arms.values():
            arm.cipher = self.cipher(arm.port)
            self.check(arm)

    def chain(self, name: str, *, pool_size: int, gateway_tree: Path | None = None) -> Arm:
        """``sbxnet gateway`` -> ``sbxnet forwarder`` -> the app, a pair of processes of its own."""
        from forwarder.ingress.planes.ktls_keys import probe

        w = self.work
        app_port = self.app_port
        ktls = probe()
        self.plane = "ktls" if ktls.ok else "userspace"
        self.plane_note = "" if ktls.ok else f"kernel TLS not available: {ktls.cause}"
        fwd_port, gw_port = free_port(), free_port()
        fwd = self.sbxnet("forwarder", {
            "SBXNET_FORWARDER_LISTEN_HOST": "127.0.0.1",
            "SBXNET_FORWARDER_LISTEN_PORT": str(fwd_port),
            "SBXNET_FORWARDER_METRICS_PORT": "0",
            "SBXNET_FORWARDER_CERT_FILE": str(w / "forwarder.crt"),
            "SBXNET_FORWARDER_KEY_FILE": str(w / "forwarder.key"),
            "SBXNET_FORWARDER_CA_FILE": str(w / "ca.crt"),
            "SBXNET_FORWARDER_CLIENT_SAN_ALLOW": f"spiffe://{TRUST}/gateway",
            "SBXNET_FORWARDER_SANDBOX_PREFIXES": "127.0.0.0/8",
            "SBXNET_FORWARDER_ALLOW_TARGETS": "127.0.0.1/32",
            "SBXNET_FORWARDER_DATA_PLANE": self.plane,
            "SBXNET_FORWARDER_WORKERS": "1",
            "SBXNET_FORWARDER_LOG_LEVEL": "warning",
        }, fwd_port, tag=f"-{name}")
        routes = w / f"routes-{name}.json"
        routes.write_text(json.dumps({"sandboxes": {SANDBOX: {
            "incarnation": "i1",
            "forwarder": {"address": f"127.0.0.1:{fwd_port}", "spki_pin": self.pin},
            "target_ip": "127.0.0.1",
            "default_port": app_port,
            "ports": {str(app_port): {"protocol": "http", "auth": "public"}},
            "idle_period_s": 3600,
            "connect_deadline_s": 5,
        }}}))
        gw = self.sbxnet("gateway", {
            "SBXNET_GATEWAY_LISTEN_HOST": "127.0.0.1",
            "SBXNET_GATEWAY_LISTEN_PORT": str(gw_port),
            "SBXNET_GATEWAY_METRICS_PORT": "0",
            "SBXNET_GATEWAY_DOMAIN": DOMAIN,
            "SBXNET_GATEWAY_CERT_FILES": str(w / "front.crt"),
            "SBXNET_GATEWAY_KEY_FILES": str(w / "front.key"),
            "SBXNET_GATEWAY_ROUTES_FILE": str(routes),
            "SBXNET_GATEWAY_UPSTREAM_CERT_FILE": str(w / "gateway.crt"),
            "SBXNET_GATEWAY_UPSTREAM_KEY_FILE": str(w / "gateway.key"),
            "SBXNET_GATEWAY_UPSTREAM_CA_FILE": str(w / "ca.crt"),
            "SBXNET_GATEWAY_LOG_LEVEL": "warning",
            "SBXNET_GATEWAY_UPSTREAM_POOL_SIZE": str(pool_size),
        }, gw_port, tag=f"-{name}", tree=gateway_tree)
        pool = f"warm pool of {pool_size} per forwarder" if pool_size else "no warm pool"
        code = f", gateway from {gateway_tree} ({_tree_commit(gateway_tree)})" if gateway_tree else ""
        return Arm(name, gw_port, [gw], [fwd], [self.app], f"forwarder data plane {self.plane}, {pool}{code}")

    def cipher(self, port: int) -> str:
        ctx = ssl.create_default_context(cafile=str(self.work / "ca.crt"))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=HOST) as tls:
            c = tls.cipher()
            return f"{tls.version()} {c[0] if c else '?'}"

    def curl_base(self, arm: Arm) -> list[str]:
        return [CURL, "-sS", "--http1.1", "--cacert", str(self.work / "ca.crt"),
                "--connect-to", f"{HOST}:{arm.port}:127.0.0.1:{arm.port}"]

    def url(self, arm: Arm, path: str) -> str:
        return f"https://{HOST}:{arm.port}{path}"

    def check(self, arm: Arm) -> None:
        """Both bodies arrive whole through the arm before anything is timed."""
        for path, want in (("/small", self.small_sha), ("/large", self.large_sha)):
            proc = subprocess.Popen([*self.curl_base(arm), "-f", self.url(arm, path)], stdout=subprocess.PIPE)
            assert proc.stdout is not None
            h = hashlib.sha256()
            while chunk := proc.stdout.read(1 << 20):
                h.update(chunk)
            if proc.wait() != 0 or h.hexdigest() != want:
                raise RuntimeError(f"arm {arm.key}: GET {path} failed or came back different "
                                   f"(curl rc {proc.returncode})")

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    # -- measuring --------------------------------------------------------------------------------------

    def snap(self, arm: Arm) -> Snapshot:
        return Snapshot(time.monotonic(), tree_cpu([s.proc.pid for s in arm.front]),
                        tree_cpu([s.proc.pid for s in arm.hop]), tree_cpu([s.proc.pid for s in arm.app]),
                        machine_busy(), children_cpu())

    @staticmethod
    def cpu(s0: Snapshot, s1: Snapshot) -> dict[str, float]:
        wall = s1.wall - s0.wall
        front, hop, app, client = s1.front - s0.front, s1.hop - s0.hop, s1.app - s0.app, s1.client - s0.client
        others = (s1.busy - s0.busy) - front - hop - app - client
        return {"wall_s": wall, "front_cpu_s": front, "hop_cpu_s": hop, "app_cpu_s": app, "client_cpu_s": client,
                "others_cores": max(0.0, others) / wall if wall > 0 else 0.0}

    def h2load(self, arm: Arm, conns: int, duration: float, *, close: bool, proto: str,
               count: int = 0) -> dict[str, Any]:
        """``duration`` seconds of load, or ``count`` requests: h2load 1.52 does not reconnect after a
        ``Connection: close`` in its timed mode (it waits forever), only when given a count."""
        log = self.work / "h2load.tsv"
        log.unlink(missing_ok=True)
        # h2load takes no fractions of a unit
        amount = ["-n", str(count)] if count else ["-D", f"{round(duration * 1000)}ms"]
        cmd = [H2LOAD, "-c", str(conns), "-t", "1", *amount,
               "--connect-to", f"127.0.0.1:{arm.port}", "--log-file", str(log)]
        if proto == "h1":
            cmd.append("--h1")
        if close:
            cmd += ["-H", "connection: close"]
        cmd.append(self.url(arm, "/small"))
        s0 = self.snap(arm)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=(duration or 300) + 120)
        s1 = self.snap(arm)
        out = r.stdout
        m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                      r"(\d+) errored, (\d+) timeout", out)
        fin = re.search(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s", out)
        if r.returncode != 0 or not m or not fin:
            raise RuntimeError(f"h2load failed (rc {r.returncode}): {out[-2000:]} {r.stderr[-2000:]}")
        done, ok, failed, errored, timeout = (int(m.group(i)) for i in (3, 4, 5, 6, 7))
        durations = []
        for line in log.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 3 and parts[1] == "200":
                durations.append(int(parts[2]) / 1000)
        durations.sort()
        cpu = self.cpu(s0, s1)
        return {
            "requests": ok, "failed": failed + errored + timeout + (done - ok),
            "rps": float(fin.group(3)),
            "p50_ms": pct(durations, 50), "p99_ms": pct(durations, 99),
            "rps_per_front_core": ok / cpu["front_cpu_s"] if cpu["front_cpu_s"] > 0 else None,
            "rps_per_chain_core": ok / (cpu["front_cpu_s"] + cpu["hop_cpu_s"])
            if cpu["front_cpu_s"] + cpu["hop_cpu_s"] > 0 else None,
            "front_cores": cpu["front_cpu_s"] / cpu["wall_s"],
            **cpu,
        }

    def firstbyte(self, arm: Arm, n: int) -> dict[str, Any]:
        fmt = "%{http_code} %{time_connect} %{time_appconnect} %{time_starttransfer} %{time_total}\\n"
        cmd = [*self.curl_base(arm), "--no-sessionid", "-H", "Connection: close", "-o", "/dev/null", "-w", fmt,
               self.url(arm, f"/small?n=[1-{n}]")]
        s0 = self.snap(arm)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        s1 = self.snap(arm)
        rows = [line.split() for line in r.stdout.splitlines() if line.strip()]
        good = [[float(x) * 1000 for x in row[1:]] for row in rows if row[0] == "200"]
        if r.returncode != 0 or len(good) != n:
            raise RuntimeError(f"curl: {len(good)} of {n} answered 200 (rc {r.returncode}): {r.stderr[-2000:]}")
        first = sorted(g[2] for g in good)
        handshake = sorted(g[1] for g in good)
        after = sorted(g[2] - g[1] for g in good)
        cpu = self.cpu(s0, s1)
        return {"connections": n, "p50_ms": pct(first, 50), "p99_ms": pct(first, 99),
                "handshake_p50_ms": pct(handshake, 50), "after_handshake_p50_ms": pct(after, 50),
                "conn_per_s": n / cpu["wall_s"],
                "front_cpu_ms_per_conn": 1000 * cpu["front_cpu_s"] / n, **cpu}

    def bulk(self, arm: Arm) -> dict[str, Any]:
        cmd = [*self.curl_base(arm), "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{time_total}",
               self.url(arm, "/large")]
        s0 = self.snap(arm)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        s1 = self.snap(arm)
        code, size, total = r.stdout.split()
        if r.returncode != 0 or code != "200" or int(size) != self.large_bytes:
            raise RuntimeError(f"bulk: {r.stdout!r} rc {r.returncode} {r.stderr[-2000:]}")
        gb = int(size) / GB
        cpu = self.cpu(s0, s1)
        return {"bytes": int(size), "gbps": gb / float(total),
                "front_cpu_s_per_gb": cpu["front_cpu_s"] / gb, "hop_cpu_s_per_gb": cpu["hop_cpu_s"] / gb,
                "chain_cpu_s_per_gb": (cpu["front_cpu_s"] + cpu["hop_cpu_s"]) / gb,
                "app_cpu_s_per_gb": cpu["app_cpu_s"] / gb, "client_cpu_s_per_gb": cpu["client_cpu_s"] / gb, **cpu}


def pct(sorted_values: list[float], p: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


# -- the summary -----------------------------------------------------------------------------------------

FIGURES: dict[str, list[tuple[str, str]]] = {
    "ka1": [("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("rps", "requests/s")],
    "kaN": [("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("rps", "requests/s"),
            ("rps_per_front_core", "requests/s per front core"), ("rps_per_chain_core", "requests/s per chain core"),
            ("front_cores", "front cores used")],
    "newconn": [("rps", "requests/s"), ("rps_per_front_core", "requests/s per front core"),
                ("p50_ms", "p50 ms (request -> response)"), ("p99_ms", "p99 ms (request -> response)")],
    "firstbyte": [("p50_ms", "first byte p50 ms"), ("p99_ms", "first byte p99 ms"),
                  ("handshake_p50_ms", "TLS handshake done p50 ms"),
                  ("after_handshake_p50_ms", "handshake -> first byte p50 ms"),
                  ("front_cpu_ms_per_conn", "front CPU ms per connection")],
    "bulk": [("gbps", "GB/s"), ("front_cpu_s_per_gb", "front CPU-s/GB"), ("hop_cpu_s_per_gb", "hop CPU-s/GB"),
             ("chain_cpu_s_per_gb", "front+hop CPU-s/GB")],
}


def stat(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(trials: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for metric, figures in FIGURES.items():
        for key, _label in figures:
            for arm in arms:
                vals = [t["result"][key] for t in trials if t["metric"] == metric and t["arm"] == arm
                        and "result" in t and key in t["result"]]
                s = stat(vals)
                if s:
                    summary.setdefault(metric, {}).setdefault(key, {})[arm] = s
            for arm in arms:
                if arm == "D" or "D" not in arms or not key.startswith("p"):
                    continue
                diffs = []
                for rnd in {t["round"] for t in trials}:
                    pair = {t["arm"]: t["result"].get(key) for t in trials
                            if t["metric"] == metric and t["round"] == rnd and "result" in t}
                    if pair.get(arm) is not None and pair.get("D") is not None:
                        diffs.append(pair[arm] - pair["D"])
                s = stat(diffs)
                if s:
                    summary.setdefault(metric, {}).setdefault(f"added_{key}", {})[arm] = s
    return summary


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def med(metric: str, key: str, arm: str) -> float | None:
        v = summary.get(metric, {}).get(key, {}).get(arm)
        return v["median"] if v else None

    added = med("ka1", "added_p50_ms", "A")
    if added is not None:
        out.append({"goal": "keep-alive added p50 over direct TLS < 1 ms (1 connection)", "value": added,
                    "nginx": med("ka1", "added_p50_ms", "B"), "met": added < 1.0})
    added_n = med("kaN", "added_p50_ms", "A")
    if added_n is not None:
        out.append({"goal": "keep-alive added p50 over direct TLS < 1 ms (--conns connections)", "value": added_n,
                    "nginx": med("kaN", "added_p50_ms", "B"), "met": added_n < 1.0})
    a, b = med("kaN", "rps_per_front_core", "A"), med("kaN", "rps_per_front_core", "B")
    if a is not None and b is not None:
        out.append({"goal": "requests/s per front core >= nginx's (keep-alive)", "value": a, "nginx": b,
                    "ratio": a / b, "met": a >= b})
    a, b = med("newconn", "rps_per_front_core", "A"), med("newconn", "rps_per_front_core", "B")
    if a is not None and b is not None:
        out.append({"goal": "(no goal set) requests/s per front core, new connection per request", "value": a,
                    "nginx": b, "ratio": a / b, "met": None})
    a, b = med("bulk", "front_cpu_s_per_gb", "A"), med("bulk", "front_cpu_s_per_gb", "B")
    if a is not None and b is not None:
        out.append({"goal": "bulk front CPU-s/GB <= 1.2x nginx's", "value": a, "nginx": b, "ratio": a / b,
                    "met": a <= 1.2 * b})
    return out


def fmt(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def table(summary: dict[str, Any], arms: list[str], args: argparse.Namespace) -> str:
    what = {"ka1": "keep-alive, 1 conn", "kaN": f"keep-alive, {args.conns} conns",
            "newconn": f"new conn per request, {args.newconn_conns} at a time, {args.newconn_n} requests",
            "firstbyte": f"new conn, {args.firstbyte_n} one by one", "bulk": f"bulk {args.bulk_mib} MiB, 1 conn"}
    head = "| measurement | figure | " + " | ".join(f"{a}" for a in arms) + " |"
    lines = [head, "|" + "---|" * (2 + len(arms))]
    for metric, figures in FIGURES.items():
        if metric not in summary:
            continue
        keys = [(k, lbl) for k, lbl in figures]
        keys += [(f"added_{k}", f"added {lbl} vs D") for k, lbl in figures if f"added_{k}" in summary[metric]]
        for key, label in keys:
            row = summary[metric].get(key)
            if not row:
                continue
            cells = []
            for arm in arms:
                s = row.get(arm)
                cells.append(f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})" if s else "")
            lines.append(f"| {what[metric]} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once per measurement")
    ap.add_argument("--out", type=Path, help="write every trial, the summary and the machine here as JSON")
    ap.add_argument("--arms", default="A,B,D", help="arms in their order (default A,B,D)")
    ap.add_argument("--metrics", default=",".join(METRICS), help=f"measurements (default {','.join(METRICS)})")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per h2load run (default 10)")
    ap.add_argument("--conns", type=int, default=16, help="connections for kaN (default 16)")
    ap.add_argument("--newconn-conns", type=int, default=4, help="connections at a time for newconn (default 4)")
    ap.add_argument("--newconn-n", type=int, default=1000, help="requests (= connections) per newconn run")
    ap.add_argument("--firstbyte-n", type=int, default=200, help="connections per firstbyte run (default 200)")
    ap.add_argument("--small-bytes", type=int, default=128, help="the small body's size (default 128)")
    ap.add_argument("--bulk-mib", type=int, default=512, help="the large body's size in MiB (default 512)")
    ap.add_argument("--proto", choices=("h1", "h2"), default="h1", help="h2load's protocol (default HTTP/1.1)")
    ap.add_argument("--wait-load", type=float, help="first wait until the 1-minute load average is under this")
    ap.add_argument("--wait-max", type=float, default=1200, help="but no longer than this many seconds")
    ap.add_argument("--old-tree", type=Path, help="arm O's gateway code: another source tree of this project")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (configs, logs)")
    args = ap.parse_args()
    arms = [a.strip().upper() for a in args.arms.split(",") if a.strip()]
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    for a in arms:
        if a not in ARM_NAMES:
            ap.error(f"unknown arm {a!r} ({', '.join(ARM_NAMES)})")
    if ("O" in arms) != (args.old_tree is not None):
        ap.error("arm O and --old-tree go together")
    if args.old_tree is not None and not (args.old_tree / "gateway" / "server.py").is_file():
        ap.error(f"--old-tree {args.old_tree}: no gateway/server.py there (give a source tree of this project)")
    for m in metrics:
        if m not in METRICS:
            ap.error(f"unknown measurement {m!r} ({', '.join(METRICS)})")
    for tool in (NGINX, H2LOAD, CURL):
        if not Path(tool).exists():
            print(f"needs {tool} (Debian: nginx, nghttp2-client, curl)", file=sys.stderr)
            return 2

    waited = wait_for_quiet(args.wait_load, args.wait_max) if args.wait_load is not None else None
    machine = describe_machine()
    machine["loadavg_before"] = list(os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="gw-vs-nginx-"))
    bench = Bench(work, args.small_bytes, args.bulk_mib << 20)
    bench.old_tree = args.old_tree.resolve() if args.old_tree is not None else None
    trials: list[dict[str, Any]] = []
    started = time.time()
    try:
        bench.mint()
        bench.content()
        bench.start(arms)
        for a in arms:
            print(f"arm {a}: {ARM_NAMES[a]} ({bench.arms[a].note}); {bench.arms[a].cipher}", flush=True)
            bench.h2load(bench.arms[a], 4, 2.0, close=False, proto=args.proto)  # warm-up, not recorded
        step = 0
        for rnd in range(args.rounds):
            for metric in metrics:
                order = arms if step % 2 == 0 else arms[::-1]
                step += 1
                for a in order:
                    arm = bench.arms[a]
                    trial: dict[str, Any] = {"round": rnd, "metric": metric, "arm": a,
                                             "loadavg": os.getloadavg()[0]}
                    try:
                        if metric == "ka1":
                            trial["result"] = bench.h2load(arm, 1, args.duration, close=False, proto=args.proto)
                        elif metric == "kaN":
                            trial["result"] = bench.h2load(arm, args.conns, args.duration, close=False,
                                                           proto=args.proto)
                        elif metric == "newconn":
                            trial["result"] = bench.h2load(arm, args.newconn_conns, 0, close=True, proto="h1",
                                                           count=args.newconn_n)
                        elif metric == "firstbyte":
                            trial["result"] = bench.firstbyte(arm, args.firstbyte_n)
                        else:
                            trial["result"] = bench.bulk(arm)
                    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                        trial["error"] = str(e)[-1500:]
                    trials.append(trial)
                    res = trial.get("result", {})
                    brief = ", ".join(f"{k}={fmt(res[k])}" for k, _ in FIGURES[metric]
                                      if isinstance(res.get(k), float | int))
                    print(f"round {rnd} {metric:<9} {a}: {brief or trial.get('error')} "
                          f"(others {res.get('others_cores', 0):.2f} cores)", flush=True)
    finally:
        bench.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_after"] = list(os.getloadavg())
    summary = summarize(trials, arms)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "machine": machine,
        "load_wait": waited,
        "arms": {a: {"name": ARM_NAMES[a], "note": bench.arms[a].note, "cipher": bench.arms[a].cipher}
                 for a in arms if a in bench.arms},
        "forwarder_plane": bench.plane, "forwarder_plane_note": bench.plane_note,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "trials": trials,
        "summary": summary,
        "goals": goals(summary),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    print()
    print(f"machine: {machine['cpu_model']}, {machine['nproc']} CPUs, Linux {machine['kernel']}; load average "
          f"{machine['loadavg_before'][0]:.2f} before, {machine['loadavg_after'][0]:.2f} after")
    print(table(summary, arms, args))
    for g in goals(summary):
        state = {True: "met", False: "NOT met", None: "-"}[g["met"]]
        extra = f" (ratio {g['ratio']:.2f})" if "ratio" in g else ""
        nginx = f"; nginx {fmt(g['nginx'])}" if g.get("nginx") is not None else ""
        print(f"goal: {g['goal']}: {fmt(g['value'])}{nginx}{extra}: {state}")
    errors = [t for t in trials if "error" in t]
    for t in errors:
        print(f"error: round {t['round']} {t['metric']} {t['arm']}: {t['error'][:300]}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
