"""Plain-TCP splice arm of the splice pump vs HAProxy (tcp mode, ``option splice-auto``), interleaved.

    .venv/bin/python bench/splice_vs_haproxy.py [--mib 512] [--rounds 3] [--threads 2]

Each arm is a proxy process between a load source and a sink in this process: source -> proxy ->
sink, one direction, over loopback. The source sends with sendfile(2) from a tmpfs file and the sink
splices into /dev/null, so the load generator spends little CPU. Arms run A B B A per round, with one
connection and with eight. Reported per arm and connection count: GB/s (wall time until the sink has
every byte) and the proxy's CPU-seconds per GB (utime + stime of all its threads from /proc/<pid>/stat),
as the median and range over the rounds. This host's kernel has no TLS: this is the pump's splice loop
alone, the kTLS arm needs a kernel with CONFIG_TLS.

``sbxnet bench`` (sbxnet/app/bench, issue 13) serves its splice arms with ``--serve-pump`` and measures
them with bench/forwarder_hop.py's client and sink, next to the other hops.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (all threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


# -- the pump arm: a process that accepts, connects to the backend and hands both fds to the pump ------


def serve_pump(port: int, backend: int, threads: int) -> None:
    sys.path.insert(0, str(ROOT))
    from forwarder.ingress.planes.splice_pump import SplicePump

    pump = SplicePump(threads=threads)
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", port))
    lst.listen(64)
    while True:
        c, _ = lst.accept()
        b = socket.create_connection(("127.0.0.1", backend))
        c.setblocking(False)
        b.setblocking(False)
        pump.add(c.detach(), b.detach(), close_timeout=60)
        pump.take_events()


# -- sink and source ---------------------------------------------------------------------------------


class Sink:
    """Accepts connections and splices everything into /dev/null, counting bytes."""

    def __init__(self) -> None:
        self.lst = socket.socket()
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen(64)
        self.port = self.lst.getsockname()[1]
        self.received = 0
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            c, _ = self.lst.accept()
            threading.Thread(target=self._drain, args=(c,), daemon=True).start()

    def _drain(self, c: socket.socket) -> None:
        r, w = os.pipe()
        null = os.open("/dev/null", os.O_WRONLY)
        try:
            while True:
                try:
                    n = os.splice(c.fileno(), w, 1 << 20)
                except ConnectionResetError:  # the readiness probe's connection
                    break
                if n == 0:
                    break
                left = n
                while left:
                    left -= os.splice(r, null, left)
                with self.lock:
                    self.received += n
                    self.done.notify_all()
        finally:
            os.close(r)
            os.close(w)
            os.close(null)
            c.close()

    def wait_for(self, total: int, timeout: float = 300) -> None:
        with self.lock:
            if not self.done.wait_for(lambda: self.received >= total, timeout):
                raise TimeoutError(f"sink got {self.received} of {total}")


def send_file(port: int, path: str, size: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s, open(path, "rb") as f:
        sent = 0
        while sent < size:
            sent += os.sendfile(s.fileno(), f.fileno(), sent % (64 << 20), min(64 << 20, size - sent))
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


def run_once(port: int, pid: int, sink: Sink, path: str, conns: int, per_conn: int) -> tuple[float, float]:
    base = sink.received
    total = conns * per_conn
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=send_file, args=(port, path, per_conn)) for _ in range(conns)]
    for t in threads:
        t.start()
    sink.wait_for(base + total)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    for t in threads:
        t.join()
    gb = total / 1e9
    return gb / wall, cpu / gb


HAPROXY_CFG = """global
    nbthread {threads}
    maxconn 1000
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    {splice}
frontend fe
    bind 127.0.0.1:{port}
    default_backend be
backend be
    server s1 127.0.0.1:{backend}
"""


def describe_machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    load = os.getloadavg()
    return (f"{model}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
            f"load average {load[0]:.2f} at start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="MiB per run (split across the connections)")
    ap.add_argument("--rounds", type=int, default=3, help="A B B A rounds per connection count")
    ap.add_argument("--threads", type=int, default=2, help="pump threads and HAProxy nbthread")
    ap.add_argument("--haproxy-splice", choices=("auto", "always"), default="auto",
                    help="HAProxy's splice-auto (default), or splice-request + splice-response forced on")
    ap.add_argument("--serve-pump", nargs=3, type=int, metavar=("PORT", "BACKEND", "THREADS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_pump:
        serve_pump(*args.serve_pump)
        return 0
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    sink = Sink()
    workdir = Path(tempfile.mkdtemp(prefix="splice-bench-"))
    data = workdir / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(64 << 20))
    p_port, h_port = free_port(), free_port()
    cfg = workdir / "haproxy.cfg"
    forced = "option splice-request\n    option splice-response"
    splice = "option splice-auto" if args.haproxy_splice == "auto" else forced
    cfg.write_text(HAPROXY_CFG.format(threads=args.threads, port=h_port, backend=sink.port, splice=splice))
    procs = {
        "splice pump": subprocess.Popen([sys.executable, __file__, "--serve-pump", str(p_port), str(sink.port),
                                         str(args.threads)]),
        "haproxy": subprocess.Popen([haproxy, "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL),
    }
    ports = {"splice pump": p_port, "haproxy": h_port}
    try:
        for port in ports.values():
            wait_port(port)
        total = args.mib << 20
        print(f"machine: {describe_machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"{total >> 20} MiB per run, {args.rounds} x (A B B A), pump threads = HAProxy nbthread = {args.threads}")
        for conns in (1, 8):
            results: dict[str, list[tuple[float, float]]] = {a: [] for a in ports}
            run_once(p_port, procs["splice pump"].pid, sink, str(data), conns, 16 << 20)  # warm-up
            run_once(h_port, procs["haproxy"].pid, sink, str(data), conns, 16 << 20)
            for _ in range(args.rounds):
                for arm in ("splice pump", "haproxy", "haproxy", "splice pump"):
                    results[arm].append(
                        run_once(ports[arm], procs[arm].pid, sink, str(data), conns, total // conns)
                    )
            for arm, rs in results.items():
                gbps = [r[0] for r in rs]
                cpus = [r[1] for r in rs]
                print(f"{conns} conn  {arm:12s} GB/s median {statistics.median(gbps):5.2f} "
                      f"[{min(gbps):.2f}-{max(gbps):.2f}]  CPU-s/GB median {statistics.median(cpus):.3f} "
                      f"[{min(cpus):.3f}-{max(cpus):.3f}]")
            pm = statistics.median(r[0] for r in results["splice pump"])
            hm = statistics.median(r[0] for r in results["haproxy"])
            pc = statistics.median(r[1] for r in results["splice pump"])
            hc = statistics.median(r[1] for r in results["haproxy"])
            print(f"{conns} conn  ratio pump/haproxy: throughput {pm / hm:.2f}x, CPU per GB {pc / hc:.2f}x")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
