"""The egress router daemon's TCP throughput, CPU and syscalls per GiB (issue 12, "Performance").

The four namespaces of the end-to-end tests (``tests/egress/netns_support.py``: guest with the test relay's
TUN device, host with ``sbxnet egress``, a plain Linux exit, the internet's server), one claim armed
through the control API, the e2e tests' peer (``e2e_peer.py``: ``tcp-up`` and ``tcp-down``, SHA-256
checked at both ends). Arms up (guest -> internet) and down (internet -> guest), interleaved
``up down down up`` each round; per transfer:

- Gbit/s by the client's monotonic clock (the payload; the client hashes and makes the seeded stream in
  Python on the same two cores, so this is a floor of what the daemon alone would carry);
- the daemon's CPU-seconds (utime + stime of its process, every thread, ``/proc/<pid>/stat``) per GiB;
- the CPU-seconds per GiB of every other part of the chain on the same cores: the test guest's relay,
  the server, the client (its own ``process_time`` over the transfer, which excludes working out the
  expected digest beforehand) and what the rest of the machine was busy with meanwhile (``/proc/stat``
  read by the client at the transfer's start and end: kernel threads, softirq work charged to no task,
  other jobs), and the machine's busy cores, so whether the daemon or the machine was the limit is in every result;
- from the daemon's own counters (its ``/metrics``, scraped in the host namespace before and after):
  guest frames, VXLAN datagrams and GSO sends per GiB, both directions.

Then, one run each and not timed: ``strace -c -f -p`` on the daemon during an upload and a download
(every syscall counted, per GiB; strace slows the daemon, so its rates are not the timed ones), and
``py-spy`` (or ``perf``) on the daemon during an upload and a download, its hottest functions by own time.
Prints one JSON document (and ``--out`` writes it). Run as root::

    .venv/bin/python bench/egress/bench_router.py --rounds 3 --size-mib 256 --out /tmp/bench_router.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "egress"))
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402  (four_namespaces skips with pytest.skip where namespaces cannot be made)
from netns_support import CLAIM, HOST_IP, SERVER, Net, _readline, four_namespaces, scrape_metrics  # noqa: E402
from test_router_e2e_control import _daemon, _relay, _stop  # noqa: E402

from forwarder.egress.router.control_client import call  # noqa: E402

GIB = 1 << 30
PYSPY = Path("/tmp/pyspy-venv/bin/py-spy")
METRIC = re.compile(r'^(sbxnet_egress_\w+?)(?:_total)?\{(?:claim="[^"]*",)?\w+="([^"]*)"\}$')
KEPT = {f"sbxnet_egress_{m}" for m in ("frames", "packets", "bytes", "datagrams", "socket_events", "drops")}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _counters(n: Net) -> Counter[str]:
    """The daemon's counters this benchmark reads, from its /metrics (host namespace, 127.0.0.1:9467)."""
    got: Counter[str] = Counter()
    for sample, value in scrape_metrics(n).items():
        m = METRIC.match(sample)
        if m is not None and m.group(1) in KEPT:
            got[f"{m.group(1).removeprefix('sbxnet_egress_')}_{m.group(2)}"] += int(value)
    return got


def _transfer(n: Net, direction: str, size: int, seed: int) -> dict[str, Any]:
    args = ("tcp-up", SERVER, str(size)) if direction == "up" else ("tcp-down", SERVER, str(size), str(seed))
    out = n.client(*args, timeout=600)
    assert out["match"] is True, out  # SHA-256 checked at both ends
    return out


def timed(n: Net, pids: dict[str, int], direction: str, size: int, seed: int) -> dict[str, Any]:
    """One transfer: the daemon's counters and CPU, and the CPU of every other part of the chain (the test
    guest's relay, the client, the server) and of the whole machine, so the daemon's share is in view."""
    c0, cpu0 = _counters(n), {role: _cpu_s(pid) for role, pid in pids.items()}
    out = _transfer(n, direction, size, seed)
    cpus = {role: _cpu_s(pid) - cpu0[role] for role, pid in pids.items()}
    c1 = _counters(n)
    d = {k: c1[k] - c0[k] for k in c1 if c1[k] - c0[k]}
    gib, secs = size / GIB, float(out["s"])
    # The client's CPU and the machine's busy time are the client's own figures over the transfer (they
    # leave out its working out of the expected digest); the others' CPU is over the whole call, in which
    # they had nothing else to do.
    chain = {**cpus, "client": float(out["cpu_s"])}
    busy = float(out["machine_busy_s"])
    chain["rest_of_machine"] = busy - sum(chain.values())  # kernel threads, softirq not charged to a task, others
    return {"direction": direction, "s": secs, "gbit_s": size * 8 / secs / 1e9, "cpu_s": cpus["daemon"],
            "cpu_s_per_gib": cpus["daemon"] / gib, "per_gib": {k: v / gib for k, v in sorted(d.items())}, "counters": d,
            "chain_cpu_s_per_gib": {k: round(v / gib, 3) for k, v in chain.items()},
            "machine_busy_cores": round(busy / secs, 3), "cores": os.cpu_count()}


def counted(n: Net, pid: int, direction: str, size: int) -> dict[str, Any]:
    """Every syscall of the daemon (all threads) over one transfer, per GiB: ``strace -c -f -p``."""
    if shutil.which("strace") is None:
        return {"skipped": "no strace"}
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as f:
        st = subprocess.Popen(["strace", "-c", "-f", "-o", f.name, "-p", str(pid)], stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread
        out = _transfer(n, direction, size, 5)
        st.send_signal(signal.SIGINT)
        st.wait(timeout=60)
        calls: dict[str, int] = {}
        for line in f.read().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and not parts[-1].startswith("total"):
                calls[parts[-1]] = int(parts[3])
    gib = size / GIB
    return {"direction": direction, "s_under_strace": float(out["s"]),
            "per_gib": {k: round(v / gib) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}}


def profiled(n: Net, pid: int, direction: str, size: int) -> dict[str, Any]:
    """The daemon's hottest functions during one transfer: py-spy (own samples and with callees), else perf."""
    if PYSPY.exists():
        with tempfile.TemporaryDirectory() as d:
            raw = Path(d) / "stacks.txt"
            spy = subprocess.Popen([str(PYSPY), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                    "--native", "-o", str(raw)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            time.sleep(1.5)
            _transfer(n, direction, size, 5)
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
            own: Counter[str] = Counter()
            incl: Counter[str] = Counter()
            total = 0
            for line in raw.read_text().splitlines():
                stack, _, k = line.rpartition(" ")
                frames = stack.split(";")
                if any("epoll_wait" in f or "select (selectors.py" in f for f in frames[-3:]):
                    continue  # the loop waiting: not a cost
                total += int(k)
                own[frames[-1]] += int(k)
                for fr in set(frames):
                    incl[fr] += int(k)
        return {"direction": direction, "tool": "py-spy --native (pauses the daemon per sample: not a timed run)",
                "busy_samples": total,
                "own": [(f, round(v / total, 3)) for f, v in own.most_common(15)],
                "with_callees": [(f, round(v / total, 3)) for f, v in incl.most_common(25)]}
    if shutil.which("perf") is None:
        return {"skipped": "neither py-spy nor perf"}
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-g", "-p", str(pid), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        _transfer(n, direction, size, 5)
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
        rep = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--stdio", "--sort", "symbol"],
                             capture_output=True, text=True, timeout=120)
    top = [line for line in rep.stdout.splitlines() if "%" in line][:20]
    return {"direction": direction, "tool": "perf", "top": top}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def mr(key: str) -> dict[str, float]:
        v = [r[key] for r in runs]
        return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}

    keys = sorted({k for r in runs for k in r["per_gib"]})
    roles = list(runs[0]["chain_cpu_s_per_gib"])
    return {"runs": len(runs), "gbit_s": mr("gbit_s"), "cpu_s_per_gib": mr("cpu_s_per_gib"),
            "machine_busy_cores": mr("machine_busy_cores"),
            "chain_cpu_s_per_gib_median": {k: round(statistics.median(r["chain_cpu_s_per_gib"][k] for r in runs), 3)
                                           for k in roles},
            "per_gib_median": {k: round(statistics.median(r["per_gib"].get(k, 0) for r in runs)) for k in keys}}


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return {"nproc": os.cpu_count(), "cpu": model, "kernel": os.uname().release}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--no-strace", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    size = a.size_mib << 20
    result: dict[str, Any] = {"machine": machine(), "size_mib": a.size_mib, "rounds": a.rounds,
                              "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp, four_namespaces(Path(tmp)) as n:
            d, ctl = _daemon(n, "h1", HOST_IP, SBXNET_EGRESS_METRICS_PORT="9467")
            st, body = call(ctl, "PUT", "/v1/claims/c1", {"uds": str(n.tmp / "vm1.vsock"), "exit": "a"})
            assert st == 201 and body["address"] == CLAIM, body
            server = n.ns_python(n.inet, str(ROOT / "tests" / "egress" / "e2e_peer.py"), "server", SERVER)
            _readline(server, "ready")
            relay = _relay(n, n.tmp / "vm1.vsock")
            pids = {"daemon": d.pid, "relay": relay.pid, "server": server.pid}
            assert "sbxnet" in Path(f"/proc/{d.pid}/cmdline").read_text()  # ip netns exec execs the daemon
            _transfer(n, "up", 16 << 20, 1)  # warm: ARP learnt, the flows' first packets, the code paths
            runs: list[dict[str, Any]] = []
            for r in range(a.rounds):
                for i, direction in enumerate(("up", "down", "down", "up")):
                    run = timed(n, pids, direction, size, 100 * r + i)
                    print(f"round {r} {direction}: {run['gbit_s']:.2f} Gbit/s, {run['cpu_s_per_gib']:.2f} CPU-s/GiB;"
                          f" machine busy {run['machine_busy_cores']:.2f} cores; chain CPU-s/GiB "
                          + " ".join(f"{k} {v:.2f}" for k, v in run["chain_cpu_s_per_gib"].items()),
                          file=sys.stderr, flush=True)
                    runs.append(run)
            result["runs"] = runs
            if runs:
                result["up"] = _summary([x for x in runs if x["direction"] == "up"])
                result["down"] = _summary([x for x in runs if x["direction"] == "down"])
            result["loadavg_after_timed"] = Path("/proc/loadavg").read_text().split()[:3]
            if not a.no_strace:
                result["syscalls"] = [counted(n, d.pid, "up", size), counted(n, d.pid, "down", size)]
            if not a.no_profile:
                result["profiles"] = [profiled(n, d.pid, "up", size), profiled(n, d.pid, "down", size)]
            result["daemon_stopped"] = _stop(d)
    except pytest.skip.Exception as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 2
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    text = json.dumps(result, indent=1)
    if a.out is not None:
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
