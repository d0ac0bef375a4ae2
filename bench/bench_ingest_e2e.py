"""The issue's ingest goal end to end: one ``sbxnet scheduler`` process, ``--streams`` feed streams (real
HTTPS ``POST /v1/feed?stream=<n>`` with mTLS from client processes other than the scheduler, each process
a forwarder with a certificate of its own as the tests mint them), each posting a ``--sandboxes``-sandbox
batch every second in the column format (``sbxnet.protocol.feed.push_columns``). Does the scheduler keep
up (every batch acknowledged within its second, no growing lag), and what does it cost: the scheduler
process's CPU (utime + stime from /proc over the measured window) per sandbox update, and that split
between its main thread (``loop_us``: the event loop, TLS, HTTP and the body's parse) and the rest
(``store_us``: the store threads). Every update is committed before its 200 (the store's transaction per
batch).

Run: .venv/bin/python bench/bench_ingest_e2e.py [--streams 100 --procs 4 --sandboxes 1000 --seconds 20
--arms sqlite-FULL,sqlite-NORMAL,pg --rounds 1]. Arms run interleaved A B ... B A (each arm twice per
round); the table has one line per run and then each arm's median and range. The sandboxes are
registered in the store before the scheduler starts (a copy of one file per SQLite run; on PostgreSQL one
schema, on a throw-away local server with fsync on, reused by every run: each run's streams start new
epochs). A stream posts its next batch one second after the previous one was due, or at once when its
answer came later than that (then it is behind: ``late``); its start is spread over the second. The
goal is 100,000 updates per second per scheduler core: ``updates per CPU-s`` at or above it, with
every batch acknowledged in time. The machine is shared: compare the arms of one run of this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "scheduler"))

GOAL_PER_CPU_S = 100_000
ADMIN_TOKEN = "bench-admin-token"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def sid(stream: int, i: int) -> str:
    return f"s{stream:03d}-{i:05d}"


# -- the clients (a process each: ``--client``) -------------------------------------------------------


async def client_main(spec: dict[str, Any]) -> dict[str, Any]:
    import ssl

    import aiohttp

    from certs import loader
    from sbxnet.protocol.feed import new_epoch, push_columns

    ctx = loader.client_context(cert_file=Path(spec["cert"]), key_file=Path(spec["key"]), ca_file=Path(spec["ca"]))
    ctx.check_hostname = True
    assert isinstance(ctx, ssl.SSLContext)
    n, t0, end, total = spec["sandboxes"], spec["t0"], spec["end"], spec["total_streams"]
    posts: list[list[float]] = []  # [stream, due, sent, answered, status]

    async def stream(s: int) -> None:
        sids = [sid(s, i) for i in range(n)]
        epoch = new_epoch(time.time_ns(), os.urandom(8))
        ones, zeros = array("q", [1] * n), array("q", [0] * n)
        idle = array("q", [0] * n)
        connector = aiohttp.TCPConnector(ssl=ctx, limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            url = f"{spec['url']}/v1/feed?stream={s}"
            due = t0 + s / total
            seq = 0
            while due < end:
                await asyncio.sleep(max(0.0, due - time.time()))
                seq += 1
                body = push_columns(epoch, seq, sids, ones, ones, zeros, idle)
                sent = time.time()
                try:
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                answered = time.time()
                posts.append([s, due, sent, answered, status])
                if status != 200:
                    seq -= 1  # not applied: the same seq again (a retry, as the outbox would)
                due = due + 1.0 if answered <= due + 1.0 else answered  # behind: the next one at once

    await asyncio.gather(*(stream(s) for s in spec["streams"]))
    return {"posts": posts, "cpu_s": sum(os.times()[:2])}


# -- the scheduler and its store -------------------------------------------------------------------


def mint(d: Path, procs: int) -> dict[str, Any]:
    from certs.mint import mint_ca, mint_leaf, write_issued

    ca = mint_ca()
    write_issued(ca, d, "ca")
    write_issued(mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True), d, "scheduler")
    sans = []
    for p in range(procs):
        san = f"spiffe://bench/forwarder/{p}"
        write_issued(mint_leaf(ca, f"fwd{p}", uris=(san,), server=False, client=True), d, f"fwd{p}")
        sans.append(san)
    write_issued(mint_leaf(ca, "gw", uris=("spiffe://bench/gateway",), server=False, client=True), d, "gw")
    (d / "admin.token").write_text(ADMIN_TOKEN + "\n")
    return {"dir": d, "sans": sans}


def populate(store: Any, streams: int, n: int) -> None:
    from sched_support import registration

    from sbxnet.protocol.routes import pull_registration
    from scheduler.timers import SandboxConfig, TimerCore

    r = pull_registration(json.dumps(registration(idle_period_s=3600.0)).encode())
    core, now = TimerCore(), time.time()
    with store.transaction() as tx:
        for s in range(streams):
            for i in range(n):
                x = sid(s, i)
                core.register(SandboxConfig(x, r.incarnation, r.idle_period_s, registered_at=now), now)
                tx.put_registration(x, r, now, core.snapshot(x), [])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu(pid: int) -> float:
    return _cpu(Path(f"/proc/{pid}/stat"))


def loop_cpu(pid: int) -> float:
    """The CPU of the process's main thread: the event loop (TLS, HTTP, the body's parse, the answers); the
    rest of ``proc_cpu`` is the store threads' (the batches' transactions, the timer loop's rounds)."""
    return _cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


def _cpu(stat: Path) -> float:
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def run_arm(arm: str, args: argparse.Namespace, pki: dict[str, Any], work: Path, pg: dict[str, Any]) -> dict[str, Any]:
    d = pki["dir"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBXNET_")}
    env.update({
        "SBXNET_SCHEDULER_LISTEN_PORT": str(port), "SBXNET_SCHEDULER_METRICS_PORT": "0",
        "SBXNET_SCHEDULER_CERT_FILE": str(d / "scheduler.crt"), "SBXNET_SCHEDULER_KEY_FILE": str(d / "scheduler.key"),
        "SBXNET_SCHEDULER_CA_FILE": str(d / "ca.crt"), "SBXNET_SCHEDULER_GATEWAY_SAN_ALLOW": "spiffe://bench/gateway",
        "SBXNET_SCHEDULER_FORWARDER_SAN_ALLOW": ",".join(pki["sans"]),
        "SBXNET_SCHEDULER_ADMIN_TOKEN_FILE": str(d / "admin.token"), "SBXNET_SCHEDULER_LOG_LEVEL": "warning",
    })
    if arm.startswith("sqlite"):
        sync = arm.partition("-")[2]
        db = work / f"run-{time.time_ns()}.db"
        shutil.copy(work / "template.db", db)
        env.update({"SBXNET_SCHEDULER_DATABASE": f"sqlite://{db}", "SBXNET_SCHEDULER_SQLITE_SYNCHRONOUS": sync})
    else:
        env["SBXNET_SCHEDULER_DATABASE"] = pg["url"]
    sched = subprocess.Popen([sys.executable, "-m", "sbxnet.app.cli", "scheduler"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import socket

        deadline = time.monotonic() + 120
        while True:
            if sched.poll() is not None:
                raise RuntimeError(f"scheduler exited: {sched.stderr.read().decode()[-2000:] if sched.stderr else ''}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("scheduler did not listen")
            time.sleep(0.2)
        t0 = time.time() + 3.0  # the clients' imports and handshakes before the first batch
        start, end = t0 + args.warmup, t0 + args.warmup + args.seconds
        clients = []
        per = args.streams // args.procs
        for p in range(args.procs):
            streams = list(range(p * per, args.streams if p == args.procs - 1 else (p + 1) * per))
            spec = {"url": f"https://127.0.0.1:{port}", "cert": str(d / f"fwd{p}.crt"), "key": str(d / f"fwd{p}.key"),
                    "ca": str(d / "ca.crt"), "streams": streams, "sandboxes": args.sandboxes, "t0": t0,
                    "end": end, "total_streams": args.streams}
            clients.append(subprocess.Popen([sys.executable, __file__, "--client", json.dumps(spec)],
                                            stdout=subprocess.PIPE, cwd=ROOT))
        time.sleep(max(0.0, start - time.time()))
        cpu0, loop0, w0 = proc_cpu(sched.pid), loop_cpu(sched.pid), time.time()
        spy = None
        if args.profile:  # py-spy on the scheduler over the window: collapsed stacks, every thread
            out = args.profile / f"{arm}-{time.time_ns()}.txt"
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(sched.pid), "--format", "raw", "--threads",
                                    "--rate", "200", "--duration", str(int(args.seconds)), "--output", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(max(0.0, end - time.time()))
        cpu1, loop1, w1 = proc_cpu(sched.pid), loop_cpu(sched.pid), time.time()
        if spy is not None:
            spy.wait(60)
        posts: list[list[float]] = []
        client_cpu = 0.0
        for c in clients:
            out, _ = c.communicate(timeout=120)
            doc = json.loads(out)
            posts += doc["posts"]
            client_cpu += doc["cpu_s"]
    finally:
        sched.terminate()
        try:
            sched.wait(30)
        except subprocess.TimeoutExpired:
            sched.kill()
    window = [p for p in posts if w0 <= p[3] < w1]
    ok = [p for p in window if p[4] == 200]
    lat = sorted(p[3] - p[2] for p in ok)
    late = [p for p in window if p[3] - p[1] > 1.0 or p[4] != 200]
    # Lag growth: how far behind its schedule each stream's last send in the window was, against its first.
    behind: dict[int, list[float]] = {}
    for post in sorted(window, key=lambda q: q[2]):
        behind.setdefault(int(post[0]), []).append(post[2] - post[1])
    growth = max((v[-1] - v[0] for v in behind.values()), default=0.0)
    updates = len(ok) * args.sandboxes
    cpu, loop = cpu1 - cpu0, loop1 - loop0
    return {
        "arm": arm, "batches": len(window), "ok": len(ok), "late": len(late),
        "statuses": sorted({int(p[4]) for p in window}),
        "lat_p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
        "lat_p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else float("nan"),
        "lat_max_ms": 1000 * lat[-1] if lat else float("nan"), "lag_growth_s": growth,
        "updates_per_s": updates / (w1 - w0), "sched_cpu_s": cpu, "sched_cpu_frac": cpu / (w1 - w0),
        "us_per_update": 1e6 * cpu / updates if updates else float("nan"),
        "loop_us": 1e6 * loop / updates if updates else float("nan"),
        "store_us": 1e6 * (cpu - loop) / updates if updates else float("nan"),
        "updates_per_cpu_s": updates / cpu if cpu else float("nan"), "client_cpu_s": client_cpu,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--procs", type=int, default=4, help="client processes (each one forwarder certificate)")
    ap.add_argument("--sandboxes", type=int, default=1000, help="per stream and batch")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window per run")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    ap.add_argument("--arms", default="sqlite-FULL,sqlite-NORMAL,pg")
    ap.add_argument("--rounds", type=int, default=1, help="each round runs the arms A B .. B A")
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    ap.add_argument("--profile", type=Path, help="a folder: py-spy's collapsed stacks of the scheduler per run")
    ap.add_argument("--py-spy", default="/tmp/pyspy-venv/bin/py-spy", help="the py-spy binary for --profile")
    args = ap.parse_args()
    if args.client:
        import uvloop

        print(json.dumps(uvloop.run(client_main(json.loads(args.client)))))
        return 0
    arms = args.arms.split(",")
    work = Path(tempfile.mkdtemp(prefix="sbxnet-e2e-"))
    pg: dict[str, Any] = {}
    server = None
    try:
        (work / "pki").mkdir()
        pki = mint(work / "pki", args.procs)
        from scheduler.sqlite_store import SqliteStore

        if any(a.startswith("sqlite") for a in arms):
            with SqliteStore(work / "template.db") as store:
                populate(store, args.streams, args.sandboxes)
        if "pg" in arms:
            import pg_support
            import psycopg

            from scheduler.pg_store import PgStore

            server = pg_support.PgServer(fsync=True).start()
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                conn.execute("CREATE SCHEMA bench")
            pg["url"] = (f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
                         "?options=-csearch_path%3Dbench&connect_timeout=5")
            with PgStore(pg["url"]) as pstore:
                populate(pstore, args.streams, args.sandboxes)
        order = [a for _ in range(args.rounds) for a in (*arms, *reversed(arms))]
        load0 = os.getloadavg()
        results = []
        for arm in order:
            r = run_arm(arm, args, pki, work, pg)
            results.append(r)
            print(f"  {arm}: {r['ok']}/{r['batches']} acked, {r['late']} late, "
                  f"{r['updates_per_cpu_s']:,.0f} updates/CPU-s", file=sys.stderr, flush=True)
        load1 = os.getloadavg()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    print(f"machine: {model}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, after {load1[0]:.2f} "
          f"{load1[1]:.2f} {load1[2]:.2f}")
    print(f"{args.streams} streams x {args.sandboxes} sandboxes every second from {args.procs} client processes; "
          f"{args.seconds:g} s measured after {args.warmup:g} s")
    cols = ("arm", "ok", "batches", "late", "lat_p50_ms", "lat_p99_ms", "lat_max_ms", "lag_growth_s",
            "updates_per_s", "sched_cpu_frac", "us_per_update", "loop_us", "store_us", "updates_per_cpu_s",
            "client_cpu_s")
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(_fmt(r[c]) for c in cols) + ("" if r["statuses"] == [200] else f"  statuses {r['statuses']}"))
    print("per arm: median [min..max]")
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        parts = []
        for c in ("late", "lat_p99_ms", "updates_per_s", "sched_cpu_frac", "us_per_update", "loop_us", "store_us",
                  "updates_per_cpu_s"):
            v = [r[c] for r in rs]
            parts.append(f"{c} {_fmt(statistics.median(v))} [{_fmt(min(v))}..{_fmt(max(v))}]")
        goal = statistics.median(r["updates_per_cpu_s"] for r in rs) >= GOAL_PER_CPU_S and all(
            r["late"] == 0 for r in rs)
        verdict = "met" if goal else "NOT met"
        print(f"{arm}: " + ", ".join(parts) + f"; goal {GOAL_PER_CPU_S:,}/CPU-s in time: {verdict}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
