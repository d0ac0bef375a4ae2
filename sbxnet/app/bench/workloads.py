"""One trial of each kind, as a flat dict of figures.

Every bulk trial gives ``gbps`` and CPU-seconds per GB (10^9 bytes) by role, from the kernel's
utime + stime of each process, its threads and its children (``Bench.snap``, the forwarder-hop
runner's ``tree_cpu``): ``front`` (the gateway or nginx front), ``hop`` (the second hop, or the one hop
of a reference), ``app`` (the sandbox app or sink), ``client`` (curl or the load clients), and
``chain`` = front + hop, what the edge itself costs. ``others_cores`` is what the rest of the machine
used meanwhile (the noise).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

from sbxnet.app.bench.plan import Workload

GB = 1e9


def http_bulk(lab: Any, arm: Any, wl: Workload) -> dict[str, Any]:
    """``wl.conns`` curl processes at once, each moving the whole body of its file one way."""
    b = lab.bench
    name = "large" if wl.conns == 1 else "part"
    size = (lab.work / "www" / name).stat().st_size
    fmt = "%{http_code} %{size_download} %{size_upload}"
    cmds = []
    for i in range(wl.conns):
        out = lab.work / f"answer-{i}"
        if wl.direction == "down":
            cmds.append([*b.curl_base(arm), "-o", "/dev/null", "-w", fmt, b.url(arm, f"/{name}")])
        else:  # no "Expect: 100-continue" wait: every arm would pay it once, the app would answer it
            cmds.append([*b.curl_base(arm), "-H", "Expect:", "-T", str(lab.work / "www" / name), "-o", str(out),
                         "-w", fmt, b.url(arm, "/upload")])
    s0 = b.snap(arm)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=600) for p in procs]
    s1 = b.snap(arm)
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outs, strict=True)):
        code, down, up = stdout.split() if len(stdout.split()) == 3 else ("?", "0", "0")
        moved = int(down) if wl.direction == "down" else int(up)
        ok = p.returncode == 0 and code == "200" and moved == size
        if ok and wl.direction == "up":
            ok = (lab.work / f"answer-{i}").read_text().strip() == str(size)  # what the app counted
        if not ok:
            raise RuntimeError(f"curl {wl.direction} {i}: {stdout!r} rc {p.returncode} {stderr[-1000:]}")
    return figures(b.cpu(s0, s1), size * wl.conns)


def figures(cpu: dict[str, float], nbytes: int) -> dict[str, Any]:
    gb = nbytes / GB
    per = {role: cpu[f"{role}_cpu_s"] / gb for role in ("front", "hop", "app", "client")}
    return {"bytes": nbytes, "wall_s": cpu["wall_s"], "gbps": gb / cpu["wall_s"],
            "cpu_s_per_gb": {**per, "chain": per["front"] + per["hop"]}, "others_cores": cpu["others_cores"]}


def stream_bulk(lab: Any, hop: Any, wl: Workload, nbytes: int) -> dict[str, Any]:
    """The forwarder-hop runner's trial: set-up first, then only the data phase is timed."""
    r = lab.fh.run_trial(hop, lab.sink, lab.work, wl.conns, nbytes, 0.0, 1 << 20)
    gb = r["bytes"] / GB
    hop_s = r["hop_cpu_per_gb"]
    return {"bytes": r["bytes"], "wall_s": r["wall_s"], "gbps": r["gbps"],
            "cpu_s_per_gb": {"front": 0.0, "hop": hop_s, "app": r["sink_cpu_per_gb"],
                             "client": r["client_cpu_per_gb"], "chain": hop_s},
            "others_cores": r["others_cores"], "cipher": r["cipher"], "hop_cpu_s": hop_s * gb}


def small(lab: Any, arm: Any, wl: Workload, seconds: float, requests: int) -> dict[str, Any]:
    """h2load (HTTP/1.1) on the small body: keep-alive for ``seconds``, or ``requests`` requests each on
    a connection of its own (h2load reconnects after ``Connection: close`` only when given a count)."""
    b = lab.bench
    if wl.close:
        r = b.h2load(arm, wl.conns, 0, close=True, proto="h1", count=requests)
    else:
        r = b.h2load(arm, wl.conns, seconds, close=False, proto="h1")
    if r["failed"]:
        raise RuntimeError(f"h2load: {r['failed']} of {r['requests'] + r['failed']} requests failed")
    chain = r["front_cpu_s"] + r["hop_cpu_s"]
    return {"rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "requests": r["requests"],
            "wall_s": r["wall_s"], "chain_cpu_ms_per_request": 1000 * chain / r["requests"] if r["requests"] else None,
            "others_cores": r["others_cores"]}


def wait_quiet(seconds: float) -> None:
    """A pause between trials so that one trial's tail (closing connections) does not fall in the next."""
    time.sleep(seconds)
