"""The forwarder hop alone: GB/s and CPU-seconds per GB, interleaved against HAProxy (issue 2).

    .venv/bin/python bench/forwarder_hop.py --bytes 512MiB --conns 1,8 --repeats 3 --arms A,B

Every party is its own process: the load client(s), the hop under test, and a sink standing in for
the sandbox app on loopback. The client does the TLS 1.3 mTLS handshake (and, for our forwarder, the
PROXY v2 preamble and the 4-byte status) first; only then does the runner say "go", so the figures
are the data phase alone, one direction (client -> sandbox). The hop's CPU is utime+stime from
/proc/<pid>/stat summed over the process, its threads and every descendant process, sampled just
before "go" and after the last client has seen the hop's end of stream (which the hop passes on only
after the sink has read everything and closed).

Arms:
  A  our forwarder, userspace data plane, workers = 1 (``sbxnet forwarder --config ...``)
  B  HAProxy (Debian's /usr/sbin/haproxy), mode tcp, TLS 1.3 terminated with the same server
     certificate, client certificate verified against the same CA, nbthread 1
  C  our forwarder, workers = 2 (SO_REUSEPORT processes)
  D  HAProxy, nbthread 2
  G  arm B with tune.bufsize = --haproxy-big-bufsize (default 256KiB, the forwarder's plaintext buffer)
  H  HAProxy, mode tcp, no TLS, nbthread 1, no splice, tune.bufsize as G: the cost of only moving bytes through a
     user-space hop on this machine (recv + send over loopback), the floor under A and B
  P  no hop: plaintext client straight to the sink (the ceiling of client + sink on this machine)

(Arms E and F patched the userspace plane's read size and read loop to measure a proposal; the plane
adopted it and the knobs they patched are gone, so they were removed. docs/benchmarks.md keeps their
results.)

Asymmetry: HAProxy does not parse our preamble, so its client sends none and reads no status. Both
are per-connection costs that fall before "go" and are not in the figures either way.

Arms are run in the order given, reversed on every other repeat (A B, B A, A B, ...), so slow drift
of a shared, noisy machine falls on both. Each trial also reports the CPU that *other* processes
used meanwhile (from /proc/stat), which says how noisy that trial was.

``sbxnet bench`` (sbxnet/app/bench, issue 13) runs its byte-stream references with this module's client,
sink, hops and ``run_trial``; this script stays for the arms and figures of docs/benchmarks.md's
"Forwarder hop" section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import resource
import selectors
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Inside the emulated kernel (bench/in_vm.sh) a Python start alone takes seconds: waits stretch, figures
# of speed mean nothing there.
SLOW = 10 if os.environ.get("SBXNET_IN_VM") else 1
PY = str(ROOT / ".venv" / "bin" / "python")
SBXNET = str(ROOT / ".venv" / "bin" / "sbxnet")
HAPROXY = "/usr/sbin/haproxy"
GB = 1e9  # figures are per 10^9 bytes
CLK_TCK = os.sysconf("SC_CLK_TCK")
ARM_NAMES = {
    "A": "forwarder userspace, 1 worker",
    "B": "HAProxy tcp+TLS, nbthread 1",
    "C": "forwarder userspace, 2 workers",
    "D": "HAProxy tcp+TLS, nbthread 2",
    "G": "HAProxy tcp+TLS, nbthread 1, big buffers",
    "H": "HAProxy tcp, no TLS, nbthread 1, big buffers",
    "P": "no hop (plain TCP client -> sink)",
}


# -- sizes ------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 1GiB, 1000000)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    mult = {"B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30}[unit]
    return int(float(m.group(1)) * mult)


# -- CPU accounting ---------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime ticks) of one process (all its threads), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def tree_cpu(root: int) -> float:
    """CPU seconds used so far by ``root``, its threads and all live descendant processes."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st:
                parent[int(entry)], ticks[int(entry)] = st
    total = 0
    for pid in ticks:
        p = pid
        while p and p != root:
            p = parent.get(p, 0)
        if p == root:
            total += ticks[pid]
    return total / CLK_TCK


def machine_busy() -> float:
    """CPU seconds (all cores) spent not idle since boot, from /proc/stat."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + vals[4]
    return (sum(vals[:8]) - idle) / CLK_TCK


# -- the sink (stands in for the sandbox app) ---------------------------------------------------------


def sink_main(args: argparse.Namespace) -> int:
    """Accept on loopback, read and discard into one buffer, print each connection's byte count."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", args.port))
    ls.listen(256)
    ls.setblocking(False)
    print(f"port {ls.getsockname()[1]}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(ls, selectors.EVENT_READ, None)
    buf = bytearray(args.buf)
    counts: dict[int, int] = {}
    while True:
        for key, _ in sel.select():
            if key.data is None:
                try:
                    conn, _addr = ls.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                counts[conn.fileno()] = 0
                sel.register(conn, selectors.EVENT_READ, conn)
                continue
            conn = key.data
            fd = conn.fileno()
            while True:
                try:
                    n = conn.recv_into(buf)
                except BlockingIOError:
                    break
                except OSError:
                    n = 0
                if n == 0:
                    sel.unregister(conn)
                    conn.close()
                    n = counts.pop(fd)
                    if n:  # a port probe (ours, or a hop's health check) is not a trial connection
                        print(json.dumps({"conn_bytes": n}), flush=True)
                    break
                counts[fd] += n


# -- the load client ----------------------------------------------------------------------------------


def _rusage_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def client_main(args: argparse.Namespace) -> int:
    """One connection: set up (mTLS, preamble), say ready, wait for go, push bytes, wait for EOF.

    TLS runs over memory BIOs so that each chunk is encrypted into one buffer and leaves in one
    ``sendall`` (an SSLSocket writes one 16 KiB record per syscall, which costs the client more).
    """
    sock = socket.create_connection(("127.0.0.1", args.port), timeout=60)
    chunk = memoryview(os.urandom(args.chunk))
    tls = out = inc = None
    cipher = "plain"
    if args.mode != "plain":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cafile=str(Path(args.certs) / "ca.crt"))
        ctx.load_cert_chain(str(Path(args.certs) / "gateway.crt"), str(Path(args.certs) / "gateway.key"))
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(inc, out, server_hostname="localhost")
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                if out.pending:
                    sock.sendall(out.read())
                data = sock.recv(65536)
                if not data:
                    raise SystemExit("client: eof during handshake") from None
                inc.write(data)
        if out.pending:
            sock.sendall(out.read())
        c = tls.cipher()
        cipher = f"{tls.version()} {c[0] if c else '?'}"
        if args.mode == "fwd":
            import ipaddress

            from sbxnet.protocol.preamble import Preamble, push_preamble

            tls.write(push_preamble(Preamble(
                src=ipaddress.ip_address("203.0.113.7"), src_port=40000,
                dst=ipaddress.ip_address("127.0.0.1"), dst_port=args.target_port, sandbox_id="bench",
            )))
            sock.sendall(out.read())
            status = b""
            while len(status) < 4:
                try:
                    status += tls.read(4 - len(status))
                except ssl.SSLWantReadError:
                    data = sock.recv(65536)
                    if not data:
                        raise SystemExit("client: eof before status") from None
                    inc.write(data)
            if status != b"SX\x01\x00":
                raise SystemExit(f"client: forwarder status {status!r}")
    print(f"ready {cipher}", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    cpu0, t0 = _rusage_s(), time.monotonic()
    deadline = t0 + args.seconds if args.seconds else None
    sent = 0
    n = len(chunk)
    while (sent < args.bytes) if deadline is None else (time.monotonic() < deadline):
        piece = chunk if deadline is not None or args.bytes - sent >= n else chunk[: args.bytes - sent]
        if tls is not None:
            assert out is not None
            tls.write(piece)
            sock.sendall(out.read())
        else:
            sock.sendall(piece)
        sent += len(piece)
    if tls is not None:
        assert out is not None
        try:
            tls.unwrap()  # close_notify; the peer's answer is not awaited here
        except ssl.SSLWantReadError:
            pass
        if out.pending:
            sock.sendall(out.read())
    sock.shutdown(socket.SHUT_WR)
    # The hop ends our stream only after the sink has read everything and closed.
    sink = bytearray(65536)
    while True:
        try:
            if sock.recv_into(sink) == 0:
                break
        except ConnectionResetError:
            break
    t1, cpu1 = time.monotonic(), _rusage_s()
    sock.close()
    print(json.dumps({"sent": sent, "t0": t0, "t1": t1, "cpu": cpu1 - cpu0}), flush=True)
    return 0


# -- the hops -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    timeout *= SLOW
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout} s")


@dataclass
class Hop:
    arm: str
    port: int
    proc: subprocess.Popen[bytes] | None
    mode: str  # client mode: fwd | haproxy | plain
    note: str = ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def toml_table(table: str, values: dict[str, Any]) -> str:
    """One TOML table of strings, numbers, booleans and lists of strings (what our settings files hold)."""

    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return str(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        return json.dumps(str(v))

    return f"[{table}]\n" + "".join(f"{k} = {lit(v)}\n" for k, v in values.items())


def start_sbxnet(component: str, name: str, work: Path, values: dict[str, Any], port: int) -> subprocess.Popen[bytes]:
    """``sbxnet <component> --config`` with ``values`` as its table; returns once ``port`` accepts."""
    cfg = work / f"{component}-{name}.toml"
    cfg.write_text(toml_table(component, values))
    log = (work / f"{component}-{name}.log").open("wb")
    proc = subprocess.Popen([SBXNET, component, "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_port(port, proc)
    return proc


def forwarder_values(port: int, certs: Path, *, workers: int = 1, data_plane: str = "userspace",
                     client_san: str = "spiffe://sbxnet.local/gateway") -> dict[str, Any]:
    """The forwarder's settings for a hop on loopback in front of a sandbox on 127.0.0.1."""
    return {
        "listen_host": "127.0.0.1", "listen_port": port, "metrics_port": 0,
        "cert_file": certs / "forwarder.crt", "key_file": certs / "forwarder.key", "ca_file": certs / "ca.crt",
        "client_san_allow": [client_san], "sandbox_prefixes": ["127.0.0.0/8"], "allow_targets": ["127.0.0.1/32"],
        "data_plane": data_plane, "workers": workers, "log_level": "warning",
    }


def start_forwarder(arm: str, work: Path, certs: Path, workers: int, **settings: Any) -> Hop:
    """Our forwarder as a hop; ``settings`` override ``forwarder_values``' (data_plane, pump_threads, ...)."""
    port = free_port()
    values = forwarder_values(port, certs, workers=workers)
    values.update(settings)
    proc = start_sbxnet("forwarder", arm, work, values, port)
    if workers > 1:
        time.sleep(1.0)  # let every worker bind before load arrives
    note = ", ".join(f"{k}={values[k]}" for k in ("data_plane", "workers", "pump_threads") if k in values)
    return Hop(arm, port, proc, "fwd", note)


def start_haproxy(arm: str, work: Path, certs: Path, sink_port: int, threads: int, bufsize: int,
                  tls: bool = True, splice: bool = False) -> Hop:
    """HAProxy in tcp mode in front of the sink; ``tls``: it terminates TLS 1.3 with the forwarder's
    certificate and verifies clients against the CA; ``splice``: plain TCP moved with splice(2) both ways
    (``option splice-request`` + ``splice-response``; ``splice-auto`` splices only when it guesses a stream)."""
    port = free_port()
    pem = work / "forwarder.pem"
    if not pem.exists():
        pem.write_bytes((certs / "forwarder.crt").read_bytes() + (certs / "forwarder.key").read_bytes())
        pem.chmod(0o600)
    tune = f"    tune.bufsize {bufsize}\n" if bufsize else ""
    cfg = work / f"haproxy-{arm}.cfg"
    ssl_opts = f" ssl crt {pem} ca-file {certs / 'ca.crt'} verify required ssl-min-ver TLSv1.3" if tls else ""
    cfg.write_text(
        f"global\n    nbthread {threads}\n    maxconn 1000\n{tune}"
        "defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 120s\n    timeout server 120s\n"
        + ("    option splice-request\n    option splice-response\n" if splice else "")
        + f"frontend fe\n    bind 127.0.0.1:{port}{ssl_opts}\n    default_backend be\n"
        f"backend be\n    server sink 127.0.0.1:{sink_port}\n"
    )
    check = subprocess.run([HAPROXY, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy -c failed: {check.stdout}{check.stderr}")
    log = (work / f"haproxy-{arm}.log").open("wb")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc)
    note = f"nbthread={threads}" + (f" bufsize={bufsize}" if bufsize else "") + (" splice" if splice else "")
    return Hop(arm, port, proc, "haproxy" if tls else "plain", note)


# -- a trial ------------------------------------------------------------------------------------------


@dataclass
class Sink:
    proc: subprocess.Popen[str]
    port: int
    lines: queue.Queue[int] = field(default_factory=queue.Queue)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(int(json.loads(line)["conn_bytes"]))


def start_sink(buf: int) -> Sink:
    proc = subprocess.Popen([PY, __file__, "_sink", "--buf", str(buf)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().split()
    sink = Sink(proc, int(first[1]))
    threading.Thread(target=sink.pump, daemon=True).start()
    return sink


def run_trial(hop: Hop, sink: Sink, certs: Path, conns: int, total: int, seconds: float, chunk: int) -> dict[str, Any]:
    per = total // conns
    port = hop.port
    clients = []
    for _ in range(conns):
        cmd = [PY, __file__, "_client", "--mode", hop.mode, "--port", str(port), "--target-port", str(sink.port),
               "--certs", str(certs), "--bytes", str(per), "--seconds", str(seconds), "--chunk", str(chunk)]
        clients.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    ciphers = set()
    for c in clients:
        assert c.stdout is not None
        line = c.stdout.readline()
        if not line.startswith("ready"):
            for x in clients:
                x.kill()
            raise RuntimeError(f"client for arm {hop.arm} failed to set up (got {line!r})")
        ciphers.add(line[6:].strip())
    time.sleep(0.2)  # let the set-up settle before sampling
    while not sink.lines.empty():
        stale = sink.lines.get()
        print(f"warning: the sink saw a stray connection of {stale} bytes", file=sys.stderr)
    pid = hop.proc.pid if hop.proc else None
    hop0 = tree_cpu(pid) if pid else 0.0
    sink0 = tree_cpu(sink.proc.pid)
    busy0, tb0 = machine_busy(), time.monotonic()
    t0 = time.monotonic()
    for c in clients:
        assert c.stdin is not None
        c.stdin.write("go\n")
        c.stdin.flush()
    results = []
    for c in clients:
        assert c.stdout is not None
        out = c.stdout.readline()
        if c.wait(300) != 0 or not out:
            raise RuntimeError(f"client for arm {hop.arm} exited {c.returncode}")
        results.append(json.loads(out))
    received = 0
    for _ in range(conns):
        received += sink.lines.get(timeout=60)
    t1 = max(r["t1"] for r in results)
    hop1 = tree_cpu(pid) if pid else 0.0
    sink1 = tree_cpu(sink.proc.pid)
    busy1, tb1 = machine_busy(), time.monotonic()
    sent = sum(r["sent"] for r in results)
    if received != sent:
        raise RuntimeError(f"arm {hop.arm}: sink received {received} of {sent} bytes")
    wall = t1 - t0
    client_cpu = sum(r["cpu"] for r in results)
    hop_cpu, sink_cpu = hop1 - hop0, sink1 - sink0
    gb = sent / GB
    return {
        "arm": hop.arm, "conns": conns, "bytes": sent, "wall_s": wall, "gbps": gb / wall,
        "hop_cpu_s": hop_cpu, "hop_cpu_per_gb": hop_cpu / gb, "hop_cores": hop_cpu / wall,
        "client_cpu_per_gb": client_cpu / gb, "sink_cpu_per_gb": sink_cpu / gb,
        # Busy time of everything else on the machine during the trial (the noise), over the sampling
        # window; client start-up and exit fall outside the clients' own figure, so this is an upper bound.
        "others_cores": max(0.0, (busy1 - busy0) - hop_cpu - sink_cpu - client_cpu) / (tb1 - tb0),
        "cipher": ",".join(sorted(ciphers)),
    }


# -- report -------------------------------------------------------------------------------------------


def machine_info() -> dict[str, str]:
    model = "?"
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    hv = subprocess.run([HAPROXY, "-v"], capture_output=True, text=True).stdout.splitlines()
    return {
        "cpu": model, "cores": str(os.cpu_count()), "kernel": platform.release(),
        "python": platform.python_version(), "openssl": ssl.OPENSSL_VERSION,
        "haproxy": hv[0] if hv else "?", "loadavg": Path("/proc/loadavg").read_text().strip(),
    }


def _med_range(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def markdown(rows: list[dict[str, Any]], hops: dict[str, Hop]) -> str:
    out = [
        "| arm | conns | n | GB/s median (range) | hop CPU-s/GB median (range) | hop cores | GB per hop CPU-s"
        " | client CPU-s/GB | sink CPU-s/GB | others' cores (noise) | cipher |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["conns"], r["arm"]) for r in rows})
    for conns, arm in keys:
        rs = [r for r in rows if r["arm"] == arm and r["conns"] == conns]
        per_gb = [r["hop_cpu_per_gb"] for r in rs]
        name = f"{arm}: {ARM_NAMES[arm]}" + (f" ({hops[arm].note})" if hops[arm].note else "")
        gb_per_cpu = "-" if arm == "P" else f"{1 / statistics.median(per_gb):.2f}"
        out.append(
            f"| {name} | {conns} | {len(rs)} | {_med_range([r['gbps'] for r in rs], '.3f')} | "
            f"{'-' if arm == 'P' else _med_range(per_gb, '.3f')} | "
            f"{statistics.median([r['hop_cores'] for r in rs]):.2f} | {gb_per_cpu} | "
            f"{statistics.median([r['client_cpu_per_gb'] for r in rs]):.3f} | "
            f"{statistics.median([r['sink_cpu_per_gb'] for r in rs]):.3f} | "
            f"{statistics.median([r['others_cores'] for r in rs]):.2f} | {rs[0]['cipher']} |"
        )
    return "\n".join(out)


def ratios(rows: list[dict[str, Any]]) -> str:
    lines = []
    for conns in sorted({r["conns"] for r in rows}):
        by = {a: [r for r in rows if r["arm"] == a and r["conns"] == conns] for a in ARM_NAMES}
        for ours, theirs in (("A", "B"), ("A", "G"), ("C", "D")):
            if by[ours] and by[theirs]:
                g = statistics.median(r["gbps"] for r in by[ours]) / statistics.median(r["gbps"] for r in by[theirs])
                c = statistics.median(r["hop_cpu_per_gb"] for r in by[theirs]) / statistics.median(
                    r["hop_cpu_per_gb"] for r in by[ours])
                lines.append(f"- {conns} conn(s): {ours}/{theirs} throughput {g:.2f}x, "
                             f"throughput per core (GB per CPU-s) {c:.2f}x")
    return "\n".join(lines)


def runner_main(args: argparse.Namespace) -> int:
    arms = [a.strip().upper() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARM_NAMES:
            raise SystemExit(f"unknown arm {a!r}; choose from {', '.join(ARM_NAMES)}")
    conns_list = [int(x) for x in args.conns.split(",")]
    work = Path(tempfile.mkdtemp(prefix="sbxnet-hop-"))
    certs = work / "certs"
    subprocess.run([SBXNET, "certs", "dev", "--dir", str(certs)], check=True, capture_output=True)
    info = machine_info()
    sink = start_sink(args.sink_buf)
    hops: dict[str, Hop] = {}
    rows: list[dict[str, Any]] = []
    try:
        for a in dict.fromkeys(arms):
            if a == "A":
                hops[a] = start_forwarder(a, work, certs, 1)
            elif a == "C":
                hops[a] = start_forwarder(a, work, certs, 2)
            elif a == "B":
                hops[a] = start_haproxy(a, work, certs, sink.port, 1, args.haproxy_bufsize)
            elif a == "D":
                hops[a] = start_haproxy(a, work, certs, sink.port, 2, args.haproxy_bufsize)
            elif a == "G":
                hops[a] = start_haproxy(a, work, certs, sink.port, 1, args.haproxy_big_bufsize)
            elif a == "H":
                hops[a] = start_haproxy(a, work, certs, sink.port, 1, args.haproxy_big_bufsize, tls=False)
            else:
                hops[a] = Hop(a, sink.port, None, "plain")
        what = f"{args.seconds:g} s" if args.seconds else f"{args.bytes / (1 << 20):.0f} MiB"
        print(f"# {what} per trial, conns {conns_list}, {args.repeats} repeats, arms {arms}", file=sys.stderr)
        for rep in range(args.repeats):
            order = arms if rep % 2 == 0 else arms[::-1]
            for conns in conns_list:
                for a in order:
                    r = run_trial(hops[a], sink, certs, conns, args.bytes, args.seconds, args.chunk)
                    r["repeat"] = rep
                    rows.append(r)
                    print(f"rep {rep} arm {a} conns {conns}: {r['gbps']:.3f} GB/s, hop {r['hop_cpu_per_gb']:.3f} "
                          f"CPU-s/GB ({r['hop_cores']:.2f} cores), client {r['client_cpu_per_gb']:.3f}, sink "
                          f"{r['sink_cpu_per_gb']:.3f}, others {r['others_cores']:.2f} cores", file=sys.stderr)
    finally:
        for h in hops.values():
            h.stop()
        sink.proc.kill()
        sink.proc.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    print("Machine: " + "; ".join(f"{k} {v}" for k, v in info.items()))
    print("Command: " + " ".join(["bench/forwarder_hop.py", *sys.argv[1:]]))
    print()
    print(markdown(rows, hops))
    print()
    print(ratios(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("_sink", "_client"):
        sys.path.insert(0, str(ROOT))
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--buf", type=int, default=1 << 20)
        p.add_argument("--mode", choices=["fwd", "haproxy", "plain"])
        p.add_argument("--target-port", type=int, default=0)
        p.add_argument("--certs")
        p.add_argument("--bytes", type=int, default=0)
        p.add_argument("--seconds", type=float, default=0)
        p.add_argument("--chunk", type=int, default=1 << 20)
        a = p.parse_args()
        return sink_main(a) if a.role == "_sink" else client_main(a)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=parse_size, default=parse_size("512MiB"),
                   help="bytes per trial, split over the connections (default 512MiB)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="instead of --bytes: each client sends for this long (the figures count what arrived)")
    p.add_argument("--conns", default="1,8", help="comma-separated concurrent connection counts (default 1,8)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the arms, order reversed every other round")
    p.add_argument("--arms", default="A,B", help="comma-separated arms from A-D,G,H,P (default A,B)")
    p.add_argument("--chunk", type=parse_size, default=1 << 20, help="client write size (default 1MiB)")
    p.add_argument("--sink-buf", type=parse_size, default=1 << 20, help="sink recv_into buffer (default 1MiB)")
    p.add_argument("--haproxy-bufsize", type=parse_size, default=0,
                   help="HAProxy tune.bufsize for arms B and D (default: HAProxy's own, 16384)")
    p.add_argument("--haproxy-big-bufsize", type=parse_size, default=256 << 10,
                   help="HAProxy tune.bufsize for arms G and H (default 256KiB)")
    p.add_argument("--json", help="also write every trial as JSON to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, certs)")
    return runner_main(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
