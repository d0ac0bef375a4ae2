"""Idle tunnels at 10,000 (issue 11): RSS per idle tunnel in our userspace plane and in HAProxy holding
the same tunnels, the forwarder's CPU while they idle, and bulk throughput on 8 tunnels with and without
them open.

    .venv/bin/python bench/bench_idle_tunnels.py [--tunnels 10000] [--rounds 1] [--idle-seconds 30]

Every party is its own process: the hop under test, a holding sandbox (accepts, echoes the little it is
sent, holds every connection open), client processes that open the tunnels (TLS 1.3 with a client
certificate; for our forwarder the PROXY v2 preamble and its status; then one 4-byte round trip, so the
tunnel is live end to end before it goes idle) and hold them. The arms run A B B A per round, each
measurement in fresh hop processes:

  F  our forwarder, ``data_plane = "userspace"``, run with ``PYTHONMALLOC=malloc`` (docs/forwarder.md,
     Memory)
  H  HAProxy (Debian's /usr/sbin/haproxy), mode tcp, terminating TLS 1.3 with the same certificate and
     verifying the client's against the same CA, nbthread 1, its default buffers (tune.bufsize 16384)

Per measurement: the hop's RSS (VmRSS summed over its processes) after 32 tunnels opened and closed (the
baseline), with every tunnel open and idle, and after they have all closed (the lowest within 15 s);
the hop's CPU-seconds (utime + stime of all its processes, /proc/<pid>/stat) over ``--idle-seconds``
with every tunnel idle, as % of one core. For F also bulk throughput on 8 tunnels, before the idle
tunnels are opened and while they are, with bench/forwarder_hop.py's client, sink and trial
(``--bulk`` bytes over the 8, client -> sandbox).

Descriptors: a hop holds two per tunnel. Where RLIMIT_NOFILE's hard limit cannot hold them in one
process (an unprivileged container: 20,000 here, not raisable), each arm is split over the fewest
processes that can, the same number for both: forwarder ``workers`` and HAProxy instances sharing the
port (SO_REUSEPORT). The per-tunnel figure is (held - baseline) summed over the arm's processes, over the
tunnels. The ktls plane (arm K, F H K K H F) runs only where ``forwarder.ingress.planes.ktls_keys.probe()``
says the kernel can carry TLS; elsewhere it is reported as not measured, with the probe's reason. Its
pipes (two a tunnel) are kernel memory, not in its RSS, and count against ``fs/pipe-user-pages-soft``
unless the forwarder runs as root with CAP_SYS_RESOURCE (docs/forwarder.md, Memory). Arm K has not yet
run: no kernel here carries TLS.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import forwarder_hop as hop  # noqa: E402  (the sibling bench: its hops, sink, client and trial)

PY = hop.PY
WARM = 32
PER_CLIENT = 2500  # tunnels per client process
KiB = 1024
MiB = 1 << 20


# -- the holding sandbox ------------------------------------------------------------------------------


def hold_main() -> int:
    """Accept every connection, echo what arrives (4-byte pings), close a connection when its peer ends,
    hold the rest. Prints its port, then the count of open connections whenever asked on stdin."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4096)
    ls.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(ls, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print(f"port {ls.getsockname()[1]}", flush=True)
    open_ = 0
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not sys.stdin.readline():
                    return 0
                print(f"open {open_}", flush=True)
                continue
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is ls:
                while True:
                    try:
                        conn, _ = ls.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    open_ += 1
                continue
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                sock.send(data)  # a few bytes: never blocks
            else:
                sel.unregister(sock)
                sock.close()
                open_ -= 1


# -- the clients --------------------------------------------------------------------------------------


def recv_exact(s: ssl.SSLSocket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"eof after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def clients_main(args: argparse.Namespace) -> int:
    """Open ``--count`` tunnels one after another, print ``open``; on ``close`` from stdin close them all
    (TCP FIN, no close_notify: the hop's end is not what is measured), print ``closed``, exit."""
    import ipaddress

    from sbxnet.protocol.preamble import Preamble, push_preamble

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(Path(args.certs) / "ca.crt"))
    ctx.load_cert_chain(str(Path(args.certs) / "gateway.crt"), str(Path(args.certs) / "gateway.key"))
    preamble = push_preamble(Preamble(
        src=ipaddress.ip_address("203.0.113.7"), src_port=40000, dst=ipaddress.ip_address("127.0.0.1"),
        dst_port=args.target_port, sandbox_id="idle",
    ))
    socks = []
    for _ in range(args.count):
        raw = socket.create_connection(("127.0.0.1", args.port), timeout=60)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s = ctx.wrap_socket(raw, server_hostname="localhost")
        if args.mode == "fwd":
            s.sendall(preamble)
            status = recv_exact(s, 4)
            if status != b"SX\x01\x00":
                raise SystemExit(f"clients: forwarder status {status!r}")
        s.sendall(b"ping")
        if recv_exact(s, 4) != b"ping":
            raise SystemExit("clients: no echo")
        socks.append(s)
    print("open", flush=True)
    sys.stdin.readline()
    for s in socks:
        s.close()
    print("closed", flush=True)
    return 0


class Clients:
    """``n`` tunnels through ``port``, opened by client processes of PER_CLIENT each, run in parallel."""

    def __init__(self, port: int, mode: str, target_port: int, certs: Path, n: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        left = n
        while left > 0:
            k = min(PER_CLIENT, left)
            left -= k
            cmd = [PY, __file__, "_clients", "--port", str(port), "--mode", mode, "--target-port",
                   str(target_port), "--certs", str(certs), "--count", str(k)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                               cwd=ROOT))

    def wait_open(self) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "open":
                self.kill()
                raise RuntimeError(f"a client process failed to open its tunnels (got {line!r}, exit {p.poll()})")

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("close\n")
            p.stdin.flush()
        for p in self.procs:
            assert p.stdout is not None
            p.stdout.readline()
            p.wait(60 * hop.SLOW)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# -- the hop's processes --------------------------------------------------------------------------------


def tree(roots: list[int]) -> list[int]:
    """``roots`` and every live descendant."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = hop._proc_stat(int(entry))
            if st:
                parent[int(entry)] = st[0]
    out = []
    for pid in parent:
        p = pid
        while p and p not in roots:
            p = parent.get(p, 0)
        if p:
            out.append(pid)
    return out


def rss(roots: list[int]) -> int:
    total = 0
    for pid in tree(roots):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * KiB
        except OSError:
            pass
    return total


def cpu(roots: list[int]) -> float:
    return sum(hop.tree_cpu(r) for r in roots)


@dataclass
class Arm:
    name: str
    mode: str  # the clients' mode: fwd | haproxy
    port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    hop: hop.Hop | None = None  # for forwarder_hop.run_trial

    @property
    def roots(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_forwarder(work: Path, certs: Path, procs: int, per_proc: int, plane: str = "userspace") -> Arm:
    port = hop.free_port()
    values = hop.forwarder_values(port, certs, workers=procs, data_plane=plane)
    values["max_connections"] = per_proc + 64
    cfg = work / f"forwarder-idle-{plane}.toml"
    cfg.write_text(hop.toml_table("forwarder", values))
    log = (work / f"forwarder-idle-{plane}.log").open("ab")
    env = dict(os.environ, PYTHONMALLOC="malloc")
    proc = subprocess.Popen([hop.SBXNET, "forwarder", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env)
    hop.wait_port(port, proc)
    if procs > 1:
        time.sleep(1.0)  # every worker bound before load arrives
    name = "F" if plane == "userspace" else "K"
    return Arm(name, "fwd", port, [proc], hop.Hop(name, port, proc, "fwd"))


def start_haproxy(work: Path, certs: Path, procs: int, per_proc: int, backend: int) -> Arm:
    port = hop.free_port()
    pem = work / "forwarder.pem"
    if not pem.exists():
        pem.write_bytes((certs / "forwarder.crt").read_bytes() + (certs / "forwarder.key").read_bytes())
        pem.chmod(0o600)
    cfg = work / "haproxy-idle.cfg"
    cfg.write_text(
        f"global\n    nbthread 1\n    maxconn {per_proc + 64}\n"
        "defaults\n    mode tcp\n    timeout connect 5s\n    timeout client 600s\n    timeout server 600s\n"
        f"frontend fe\n    bind 127.0.0.1:{port} ssl crt {pem} ca-file {certs / 'ca.crt'} verify required "
        "ssl-min-ver TLSv1.3\n    default_backend be\n"
        f"backend be\n    server sandbox 127.0.0.1:{backend}\n"
    )
    check = subprocess.run([hop.HAPROXY, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy -c failed: {check.stdout}{check.stderr}")
    arm = Arm("H", "haproxy", port)
    log = (work / "haproxy-idle.log").open("ab")
    for _ in range(procs):  # independent instances on one port: HAProxy binds with SO_REUSEPORT
        arm.procs.append(subprocess.Popen([hop.HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT))
    for p in arm.procs:
        hop.wait_port(port, p)
    time.sleep(0.5)
    return arm


# -- one measurement ------------------------------------------------------------------------------------


class Hold:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([PY, __file__, "_hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline().split()[1])

    def open(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1])

    def wait_open(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (got := self.open()) != n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the holding sandbox has {got} connections, expected {n}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def slab() -> int:
    """The whole machine's kernel slab bytes (/proc/meminfo Slab): sockets, pipes, kTLS contexts and the rest
    of every party's kernel objects; the difference between arms is what the hop adds in the kernel."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Slab:"):
            return int(line.split()[1]) * KiB
    return 0


def measure(arm: Arm, hold: Hold, sink: hop.Sink | None, certs: Path, args: argparse.Namespace) -> dict[str, Any]:
    n = args.tunnels
    warm = Clients(arm.port, arm.mode, hold.port, certs, WARM)
    warm.wait_open()
    warm.close()
    hold.wait_open(0, 30 * hop.SLOW)
    time.sleep(2)
    base, slab0 = rss(arm.roots), slab()
    r: dict[str, Any] = {"arm": arm.name, "base": base}
    if sink is not None and arm.hop is not None:
        r["bulk_alone"] = hop.run_trial(arm.hop, sink, certs, 8, args.bulk, 0, 1 << 20)["gbps"]
    t0 = time.monotonic()
    clients = Clients(arm.port, arm.mode, hold.port, certs, n)
    try:
        clients.wait_open()
        r["open_s"] = time.monotonic() - t0
        hold.wait_open(n, 60 * hop.SLOW)
        time.sleep(2)
        r["held"] = rss(arm.roots)
        r["slab_per_tunnel"] = (slab() - slab0) / n
        c0, w0 = cpu(arm.roots), time.monotonic()
        time.sleep(args.idle_seconds)
        r["idle_core_pct"] = 100 * (cpu(arm.roots) - c0) / (time.monotonic() - w0)
        if sink is not None and arm.hop is not None:
            r["bulk_with_idle"] = hop.run_trial(arm.hop, sink, certs, 8, args.bulk, 0, 1 << 20)["gbps"]
        r["held_after_bulk"] = rss(arm.roots)
        clients.close()
    except BaseException:
        clients.kill()
        raise
    hold.wait_open(0, 120 * hop.SLOW)
    lowest, deadline = rss(arm.roots), time.monotonic() + 15 * min(hop.SLOW, 4)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        lowest = min(lowest, rss(arm.roots))
    r["after"] = lowest
    r["per_tunnel"] = (r["held"] - base) / n
    return r


# -- report ---------------------------------------------------------------------------------------------


def med_range(xs: list[float], fmt: str) -> str:
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def report(rows: list[dict[str, Any]], names: dict[str, str], n: int, procs: int) -> str:
    lines = [
        f"| arm | RSS per idle tunnel, KiB | baseline, MiB | {n:,} idle, MiB | after close, MiB | "
        f"CPU with {n:,} idle, % of a core | open, s | kernel slab per tunnel, KiB (whole machine) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, name in names.items():
        rs = [r for r in rows if r["arm"] == a]
        if not rs:
            continue
        cols = [
            med_range([r["per_tunnel"] / KiB for r in rs], ".1f"),
            *(med_range([r[k] / MiB for r in rs], ".1f") for k in ("base", "held", "after")),
            med_range([r["idle_core_pct"] for r in rs], ".2f"),
            med_range([r["open_s"] for r in rs], ".0f"),
            med_range([r["slab_per_tunnel"] / KiB for r in rs], ".1f"),
        ]
        lines.append(f"| {a}: {name} | " + " | ".join(cols) + " |")
    fw = [r for r in rows if "bulk_alone" in r]
    if fw:
        lines.append("")
        lines.append(f"Bulk on 8 tunnels through F (GB/s, client -> sandbox): alone "
                     f"{med_range([r['bulk_alone'] for r in fw], '.3f')}, with the {n:,} idle tunnels open "
                     f"{med_range([r['bulk_with_idle'] for r in fw], '.3f')}.")
    lines.append(f"Each arm ran as {procs} process(es) (forwarder workers / HAProxy instances on one port).")
    return "\n".join(lines)


def runner_main(args: argparse.Namespace) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.tunnels + 1024
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))  # root with CAP_SYS_RESOURCE
        except (ValueError, OSError):
            pass
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the hops and the holding sandbox inherit it
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if args.tunnels + 64 > limit:
        raise SystemExit(f"RLIMIT_NOFILE {limit}: the holding sandbox cannot hold {args.tunnels} connections")
    procs = max(args.procs, math.ceil((2 * args.tunnels + 256) / limit))
    per_proc = math.ceil(args.tunnels / procs * 1.25)  # SO_REUSEPORT spreads by hash, not evenly
    k_procs = max(args.procs, math.ceil((6 * args.tunnels + 256) / limit))  # ktls: + 2 pipes a tunnel
    k_per_proc = math.ceil(args.tunnels / k_procs * 1.25)
    work = Path(tempfile.mkdtemp(prefix="sbxnet-idle-"))
    certs = work / "certs"
    subprocess.run([hop.SBXNET, "certs", "dev", "--dir", str(certs)], check=True, capture_output=True)
    from forwarder.ingress.planes import ktls_keys

    probe = ktls_keys.probe()
    info = hop.machine_info()
    arms = args.arms.split(",") if args.arms else ["F", "H", "K"] if probe.ok else ["F", "H"]
    if "K" in arms and not probe.ok:
        raise SystemExit(f"arm K: this kernel cannot carry TLS ({probe.cause}: {probe.detail})")
    order = arms + arms[::-1]  # A B C C B A: each arm measured early and late in the round
    print(f"# {args.tunnels} tunnels, {args.rounds} x ({' '.join(order)}), {procs} process(es) per arm "
          f"(RLIMIT_NOFILE {limit}); "
          f"load {os.getloadavg()}", file=sys.stderr)
    hold = Hold()
    sink = hop.start_sink(1 << 20)
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for a in order:
                if a == "H":
                    arm = start_haproxy(work, certs, procs, per_proc, hold.port)
                elif a == "K":
                    arm = start_forwarder(work, certs, k_procs, k_per_proc, plane="ktls")
                else:
                    arm = start_forwarder(work, certs, procs, per_proc)
                try:
                    r = measure(arm, hold, sink if a == "F" and not args.no_bulk else None, certs, args)
                finally:
                    arm.stop()
                r["round"] = rnd
                rows.append(r)
                print(f"round {rnd} arm {a}: {r['per_tunnel'] / KiB:.1f} KiB a tunnel (base {r['base'] / MiB:.1f}, "
                      f"held {r['held'] / MiB:.1f}, after {r['after'] / MiB:.1f} MiB), idle CPU "
                      f"{r['idle_core_pct']:.2f}% of a core, opened in {r['open_s']:.0f} s"
                      + (f", bulk 8 tunnels {r['bulk_alone']:.3f} -> {r['bulk_with_idle']:.3f} GB/s"
                         if "bulk_alone" in r else ""), file=sys.stderr)
    finally:
        hold.stop()
        sink.proc.kill()
        sink.proc.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    info["nproc"] = str(os.cpu_count())
    print("Machine: " + "; ".join(f"{k} {v}" for k, v in info.items()))
    print("Command: " + " ".join(["bench/bench_idle_tunnels.py", *sys.argv[1:]]))
    print()
    names = {
        "F": "our forwarder, userspace plane, PYTHONMALLOC=malloc",
        "H": f"HAProxy {info['haproxy'].split()[2]}, tcp mode, TLS 1.3 terminated, nbthread 1",
        "K": f"our forwarder, ktls plane ({k_procs} process(es); its pipes are kernel memory, not in RSS)",
    }
    print(report(rows, names, args.tunnels, procs))
    if os.environ.get("SBXNET_IN_VM"):
        print("Inside the emulated kernel (bench/in_vm.sh): the CPU and open columns are emulated, functional only; "
              "RSS and slab are memory and hold.")
    if not probe.ok:
        print(f"ktls plane: not measured: this kernel cannot carry TLS ({probe.cause}: {probe.detail}; "
              f"Linux {platform.release()}).")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_hold":
        return hold_main()
    if len(sys.argv) > 1 and sys.argv[1] == "_clients":
        p = argparse.ArgumentParser()
        p.add_argument("role")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--mode", choices=["fwd", "haproxy"], required=True)
        p.add_argument("--target-port", type=int, required=True)
        p.add_argument("--certs", required=True)
        p.add_argument("--count", type=int, required=True)
        return clients_main(p.parse_args())
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tunnels", type=int, default=10_000, help="idle tunnels per measurement (default 10000)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of F H H F (default 1)")
    p.add_argument("--idle-seconds", type=float, default=30.0, help="CPU sampling window with every tunnel idle")
    p.add_argument("--bulk", type=hop.parse_size, default=hop.parse_size("256MiB"),
                   help="bytes of the 8-tunnel bulk trial through F, split over the 8 (default 256MiB)")
    p.add_argument("--procs", type=int, default=1, help="at least this many processes per arm (default 1)")
    p.add_argument("--arms", type=lambda v: ",".join(a for a in v.split(",") if a in ("F", "H", "K")) or None,
                   help="which arms, comma-separated, of F, H and K (default F,H and K where the kernel has TLS)")
    p.add_argument("--no-bulk", action="store_true", help="skip the 8-tunnel bulk trials through F")
    p.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, certs)")
    return runner_main(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
