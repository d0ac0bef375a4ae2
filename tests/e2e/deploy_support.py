"""Three hosts in network namespaces, deployed from docs/deploy.md (the support of test_deploy_three_hosts.py).

- ``Guide``: the blocks of docs/deploy.md the test follows: the certificate commands, what each host keeps,
  each daemon's TOML file and each host's start commands (a block the test reads begins with
  ``# on <host>: <file>``).
- ``three_hosts``: the namespaces (an edge with a bridge 10.10.0.1/24, two sandbox hosts on it, and behind
  each host a namespace holding its sandboxes' addresses, as VMs behind a tap), torn down with every process
  on leaving; ``pytest.skip`` where namespaces cannot be made.
- ``Ns``: run code with this process's thread inside a namespace (``setns(2)`` is per thread), so sockets
  are made there; a socket once made works from any thread.
- ``Program``: a sandbox's HTTP program bound to its private address in a sandbox namespace.
- ``Platform``: the guide's webhook driver (checks the signature, stops on idle unless fenced, starts on
  waking) and the platform's admin calls.
- ``Traffic``: steady requests through the gateway, one thread per sandbox, every answer recorded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
GUIDE = ROOT / "docs" / "deploy.md"
T = TypeVar("T")

# The guide's network (docs/deploy.md, "The layout").
EDGE_IP = "10.10.0.1"
HOST_IPS = {"host-1": "10.10.0.11", "host-2": "10.10.0.12"}
SANDBOX_NETS = {"host-1": "10.200.1", "host-2": "10.200.2"}  # /24 each; .1 is the host's side
DOMAIN = "sbx.example"
GATEWAY_PORT = 443
SCHEDULER_URL = f"https://{EDGE_IP}:8700"
WEBHOOK_PORT = 9000

# -- the guide ----------------------------------------------------------------------------------------

_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)  # a block in a list item is indented
_JSON = re.compile(r"^<!-- on (\S+): (\S+) .*?-->\n```json\n(.*?)^```$", re.S | re.M)
_ON = re.compile(r"# on (\S+): (.+)")
_KEEPS = "# what each host keeps in /etc/sbxnet/"
_START = re.compile(r"^sbxnet (scheduler|gateway|forwarder) --config (\S+) &$")
_SCP = re.compile(r"^scp -p (\S+) root@(\S+):(\S+)$")


@dataclass
class Guide:
    """The blocks of docs/deploy.md the deployment is made from."""

    blocks: dict[tuple[str, str], str]  # (host, file or step) -> the block without its first line
    keeps: dict[str, list[str]]  # host -> the files it keeps in /etc/sbxnet/

    @classmethod
    def read(cls, path: Path = GUIDE) -> Guide:
        blocks: dict[tuple[str, str], str] = {}
        keeps: dict[str, list[str]] = {}
        for m in _FENCE.finditer(path.read_text()):
            indent = len(m.group(1))
            lines = m.group(3).splitlines(keepends=True)
            assert all(not line.strip() or line.startswith(m.group(1)) for line in lines), m.group(0)
            first, _, rest = "".join(line[indent:] for line in lines).partition("\n")
            on = _ON.fullmatch(first)
            if on is not None:
                key = (on.group(1), on.group(2).strip())
                assert key not in blocks, f"docs/deploy.md has two blocks for {key}"
                blocks[key] = rest
            elif first == _KEEPS:
                for line in rest.splitlines():
                    host, _, files = line.partition(":")
                    keeps[host.strip()] = files.split()
        for m in _JSON.finditer(path.read_text()):
            blocks[(m.group(1), m.group(2))] = m.group(3)
        return cls(blocks, keeps)

    def configs(self, host: str) -> dict[str, str]:
        """The TOML files the guide gives ``host``: path -> text."""
        return {name: text for (h, name), text in self.blocks.items() if h == host and name.endswith(".toml")}

    def starts(self, host: str) -> list[tuple[str, str]]:
        """The daemons the guide starts on ``host``, in order: (daemon, config path)."""
        out = []
        for line in self.blocks[(host, "start")].splitlines():
            m = _START.fullmatch(line.strip())
            if m is not None:
                out.append((m.group(1), m.group(2)))
        return out

    def copies(self, step: str) -> list[tuple[str, str, str]]:
        """The files the admin machine's ``step`` block copies: (its local path, host address, remote path),
        from lines ``scp -p <local> root@<address>:<remote>``; every line of the block must be one."""
        out = []
        for line in self.blocks[("admin", step)].splitlines():
            m = _SCP.fullmatch(line.strip())
            assert m is not None, f"docs/deploy.md's {step} block: not an 'scp -p FILE root@HOST:PATH' line: {line}"
            out.append((m.group(1), m.group(2), m.group(3)))
        return out

    def mkdirs(self, host: str) -> list[str]:
        return [line.split()[-1] for line in self.blocks[(host, "start")].splitlines()
                if line.startswith("mkdir -p ")]


# -- namespaces ---------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
_here = threading.local()  # .netns: the namespace this thread entered, if any


def enter_netns(name: str) -> None:
    """Move the calling thread (only it: setns(2) is per thread) into network namespace ``name``."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
    _here.netns = name


class Ns:
    """A network namespace, and threads of this process inside it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool = ThreadPoolExecutor(8, thread_name_prefix=name, initializer=enter_netns, initargs=(name,))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a thread inside the namespace: this one if it is there already (a pool worker
        waiting on its own pool could deadlock it), else one of the pool's."""
        if getattr(_here, "netns", None) == self.name:
            return fn(*args)
        return self.pool.submit(fn, *args).result()

    def thread(self, fn: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            enter_netns(self.name)
            fn()

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    r = _run(*args)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


@dataclass
class Hosts:
    """The namespaces: ``ns["edge"]``, ``ns["host-1"]``, ``ns["host-2"]``, and the sandboxes behind each
    host, ``ns["sandboxes-1"]``, ``ns["sandboxes-2"]``."""

    ns: dict[str, Ns]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@contextmanager
def three_hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip)")
    tag = secrets.token_hex(3)
    roles = ("edge", "host-1", "host-2", "sandboxes-1", "sandboxes-2")
    names = {role: f"sbxdp{tag}-{role}" for role in roles}
    made: list[str] = []
    hosts = Hosts({})
    try:
        for role in roles:
            r = _run("ip", "netns", "add", names[role])
            if r.returncode:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(names[role])
            _must("ip", "-n", names[role], "link", "set", "lo", "up")
        edge = names["edge"]
        r = _run("ip", "-n", edge, "link", "add", "br0", "type", "bridge")
        if r.returncode:
            pytest.skip(f"no bridge devices here: {r.stderr.strip()}")
        _must("ip", "-n", edge, "addr", "add", f"{EDGE_IP}/24", "dev", "br0")
        _must("ip", "-n", edge, "link", "set", "br0", "up")
        for n, host in enumerate(("host-1", "host-2"), 1):
            h, sb = names[host], names[f"sandboxes-{n}"]
            # The private network: host-N's eth0 on the edge's bridge.
            _must("ip", "-n", edge, "link", "add", f"to{n}", "type", "veth", "peer", "name", "eth0", "netns", h)
            _must("ip", "-n", edge, "link", "set", f"to{n}", "master", "br0")
            _must("ip", "-n", edge, "link", "set", f"to{n}", "up")
            _must("ip", "-n", h, "addr", "add", f"{HOST_IPS[host]}/24", "dev", "eth0")
            _must("ip", "-n", h, "link", "set", "eth0", "up")
            # The sandboxes behind the host (their taps, in production): the host's side is .1.
            net = SANDBOX_NETS[host]
            _must("ip", "-n", h, "link", "add", "sb0", "type", "veth", "peer", "name", "eth0", "netns", sb)
            _must("ip", "-n", h, "addr", "add", f"{net}.1/24", "dev", "sb0")
            _must("ip", "-n", h, "link", "set", "sb0", "up")
            _must("ip", "-n", sb, "link", "set", "eth0", "up")
        hosts.ns = {role: Ns(names[role]) for role in roles}
        yield hosts
    finally:
        for p in hosts.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for ns in hosts.ns.values():
            ns.pool.shutdown(wait=False, cancel_futures=True)
        for name in made:
            _run("ip", "netns", "del", name)


def add_sandbox_address(hosts: Hosts, host: str, ip: str) -> None:
    sb = hosts.ns[f"sandboxes-{host[-1]}"].name
    _must("ip", "-n", sb, "addr", "add", f"{ip}/24", "dev", "eth0")


# -- sandbox programs ---------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        program = self.server.program
        if self.path.startswith("/slow/"):  # /slow/<ms>: a request that takes a while
            with program.lock:
                program.slow_started += 1
            time.sleep(int(self.path.split("/")[2]) / 1000)
        body = f"{program.name} on {program.host}\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    program: Program

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.program.lock:
            self.program.conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.program.lock:
            self.program.conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a connection cut by stop() or by the link's end is not a failure of the program


class Program:
    """A sandbox's HTTP program on ``ip``:8080 in ``host``'s sandbox namespace. ``stop`` is a VM stop:
    the listener and every connection go."""

    def __init__(self, hosts: Hosts, name: str, host: str, ip: str, port: int = 8080) -> None:
        self.ns = hosts.ns[f"sandboxes-{host[-1]}"]
        self.name, self.host, self.ip, self.port = name, host, ip, port
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.slow_started = 0
        self._server: _Server | None = None

    def start(self) -> Program:
        srv = self.ns.call(lambda: _Server((self.ip, self.port), _Handler))
        srv.program = self
        self._server = srv
        threading.Thread(target=srv.serve_forever, name=f"program-{self.name}", daemon=True).start()
        return self

    def answers(self) -> bool:
        """Does the program accept a connection (asked from inside its namespace)?"""
        def probe() -> bool:
            with socket.socket() as s:
                s.settimeout(2)
                return s.connect_ex((self.ip, self.port)) == 0
        return self.ns.call(probe)

    def stop(self) -> None:
        srv, self._server = self._server, None
        if srv is None:
            return
        srv.shutdown()
        srv.server_close()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def running(self) -> bool:
        return self._server is not None


# -- the platform -------------------------------------------------------------------------------------


class Platform:
    """The platform as the guide describes it: admin calls to the scheduler, and the webhook driver on
    the edge at 127.0.0.1:9000."""

    def __init__(self, edge: Ns, ca_file: Path, token: str, secret: bytes) -> None:
        self.edge = edge
        self.ctx = ssl.create_default_context(cafile=str(ca_file))
        self.token = token
        self.secret = secret
        self.programs: dict[str, Program] = {}
        self.events: list[dict[str, Any]] = []
        self.bad_signatures = 0
        self.actions: list[tuple[float, str]] = []
        platform = self

        class Hook(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                want = "sha256=" + hmac.new(platform.secret, body, hashlib.sha256).hexdigest()
                ok = hmac.compare_digest(want, self.headers.get("x-sbxnet-signature", ""))
                self.send_response(200 if ok else 403)
                self.send_header("content-length", "0")
                self.end_headers()
                if not ok:
                    platform.bad_signatures += 1
                    return
                ev = json.loads(body)
                platform.events.append(ev)
                platform.edge.pool.submit(platform._act, ev)  # admin calls are made from the edge

        self._server = edge.call(lambda: http.server.ThreadingHTTPServer(("127.0.0.1", WEBHOOK_PORT), Hook))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="platform-webhook", daemon=True).start()

    def admin(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        def call() -> tuple[int, Any]:
            req = urllib.request.Request(SCHEDULER_URL + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(req, context=self.ctx, timeout=15) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read() or b"null")
        return self.edge.call(call)

    def _act(self, ev: dict[str, Any]) -> None:
        sid = ev["sandbox"]
        program = self.programs.get(sid)
        if program is None:
            return
        try:
            if ev["to"] == "idle":
                _, answer = self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopping"})
                if not answer.get("proceed"):
                    self.actions.append((time.time(), f"{sid}: stop fenced"))
                    return
                program.stop()
                self.actions.append((time.time(), f"{sid}: stopped"))
                self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "stopped"})
            elif ev["to"] == "waking":
                if not program.running:
                    program.start()
                self.actions.append((time.time(), f"{sid}: started"))
                self.admin("POST", f"/v1/sandboxes/{sid}/driver", {"event": "ready"})
        except OSError as e:
            self.actions.append((time.time(), f"{sid}: the scheduler could not be reached ({e})"))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- clients ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    sandbox: str
    started: float  # time.time() at the connect
    ended: float
    status: int  # 0: no answer (see error)
    error: str = ""
    retry_after: str | None = None
    body: str = ""


def request(ctx: ssl.SSLContext, sandbox: str, path: str = "/", *, host: str | None = None,
            headers: tuple[str, ...] = (), timeout: float = 20) -> Answer:
    """One HTTP/1.1 request on a connection of its own to the gateway (from the calling thread's
    namespace): SNI ``<sandbox>.<domain>``, Host ``host`` or the same."""
    name = f"{sandbox}.{DOMAIN}"
    started = time.time()
    try:
        with socket.create_connection(("127.0.0.1", GATEWAY_PORT), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=name) as s:
            head = f"GET {path} HTTP/1.1\r\nHost: {host or name}\r\nConnection: close\r\n"
            s.sendall((head + "".join(h + "\r\n" for h in headers) + "\r\n").encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except (OSError, ValueError) as e:
        return Answer(sandbox, started, time.time(), 0, f"{type(e).__name__}: {e}")
    ended = time.time()
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode(errors="replace").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return Answer(sandbox, started, ended, 0, f"no status line: {data[:80]!r}")
    fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    retry = next((v.strip() for k, v in fields.items() if k.strip().lower() == "retry-after"), None)
    return Answer(sandbox, started, ended, status, retry_after=retry, body=body.decode(errors="replace").strip())


def client_context(ca_file: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Traffic:
    """Steady traffic: for each sandbox a thread in the edge namespace sending a request every
    ``every`` seconds, each on a connection of its own; every answer is kept."""

    def __init__(self, edge: Ns, ctx: ssl.SSLContext, sandboxes: list[str], every: float = 0.1) -> None:
        self.edge, self.ctx, self.every = edge, ctx, every
        self.answers: list[Answer] = []
        self._sending: dict[str, float | None] = dict.fromkeys(sandboxes)  # sandbox -> when its request began
        self._stop = threading.Event()
        self._threads = [edge.thread(functools.partial(self._loop, sid), f"traffic-{sid}") for sid in sandboxes]

    def _loop(self, sid: str) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._sending[sid] = time.time()
            self.answers.append(request(self.ctx, sid))
            self._sending[sid] = None
            self._stop.wait(max(0.0, self.every - (time.monotonic() - t0)))

    def between(self, start: float, end: float, sandboxes: tuple[str, ...] = ()) -> list[Answer]:
        """The answers to the requests begun from ``start`` to ``end``, once every one of them has ended."""
        def ended() -> bool:
            return all(began is None or began > end for began in list(self._sending.values()))
        wait_for(ended, 60, "the requests begun in the window to end")
        return [a for a in list(self.answers)
                if start <= a.started <= end and (not sandboxes or a.sandbox in sandboxes)]

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def failures(answers: list[Answer]) -> list[Answer]:
    return [a for a in answers if a.status != 200]


def slow(answers: list[Answer], bound: float) -> list[Answer]:
    return [a for a in answers if a.ended - a.started > bound]


def summary(answers: list[Answer]) -> str:
    counts: dict[str, int] = {}
    for a in answers:
        key = f"{a.sandbox}:{a.status or a.error.split(':')[0]}"
        counts[key] = counts.get(key, 0) + 1
    bad = failures(answers)[:5]
    return f"{counts}; first failures: {bad}"


# -- daemons ------------------------------------------------------------------------------------------


def json_lines(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def ready(ns: Ns, port: int) -> bool:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False
    return ns.call(probe)


def start_daemon(hosts: Hosts, host: str, daemon: str, config: Path, log: Path,
                 env: dict[str, str]) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    full.update(env)
    with log.open("ab") as out:
        p = subprocess.Popen(["ip", "netns", "exec", hosts.ns[host].name, sys.executable, "-m", "sbxnet.app.cli",
                              daemon, "--config", str(config)], cwd=ROOT, env=full, stdout=out,
                             stderr=subprocess.STDOUT)
    hosts.procs.append(p)
    return p
