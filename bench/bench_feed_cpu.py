"""The idle feed's CPU on the forwarder at scale: 10,000 active sandboxes reporting every second (issue 10).

    .venv/bin/python bench/bench_feed_cpu.py --sandboxes 10000 --intervals 30 --interval 1.0

A runner script (not pytest-benchmark: the figure is CPU over many real intervals, not a timed call).
The forwarder's side runs in this process exactly as a worker runs it: a ``Meter`` with one live
connection per sandbox, the ``FeedReporter`` that ``reporter_for`` builds from real ``ForwarderSettings``
(its ``Outbox``, its metrics, one aiohttp session over mTLS), on uvloop. The scheduler's feed endpoint
(``scheduler/feed_http.py``: ``FeedService`` + ``serve`` on a ``SqliteStore``, the sandboxes registered)
runs in a child process on loopback, so its CPU is not counted here.

Each interval a traffic task adds bytes to every sandbox's connection (what the data plane does; its CPU
is measured apart and left out of the feed's figure). The feed's CPU is this process's CPU time
(``time.process_time``) over the measured intervals minus the traffic task's: ``Meter.take``, the outbox
(merge, freeze, ``push_columns``), the answer, the HTTP client and TLS, and the event loop around them.
The pieces on the event loop are timed too (thread CPU, and the longest single call, which is how long
the data path waits on it). At the end the scheduler's stored totals must equal the bytes moved.

``--loop-probe`` adds a task that asks to wake every 2 ms and records how late it woke: the longest and
the 99th percentile are what a connection's bytes would have waited for the event loop (its own CPU is
then in the figures, so measure CPU without it).

The first ``--warmup`` intervals (TLS handshake, first batch) are not measured. Machines here are shared
and noisy: run it more than once and give the range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FWD_SAN = "spiffe://bench.sbxnet/forwarder/1"
PIN = "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="


def sandbox_ids(n: int) -> list[str]:
    return [f"sbx-{i:05d}" for i in range(n)]


# -- the scheduler, in a child process -------------------------------------------------------------


def serve_scheduler(work: Path, port: int, n: int) -> None:
    from certs import loader
    from sbxnet.protocol.routes import pull_registration
    from scheduler.feed_http import FeedService, serve
    from scheduler.sqlite_store import SqliteStore
    from scheduler.timers import SandboxConfig, TimerCore

    store, core = SqliteStore(work / "sched.db"), TimerCore()
    at = time.time() - 60
    body = {
        "incarnation": "inc-1", "forwarder": {"address": "127.0.0.1:8443", "spki_pin": PIN},
        "target_ip": "10.200.0.1", "default_port": 8080,
        "ports": {"8080": {"protocol": "http", "auth": "public"}}, "idle_period_s": 300, "activity": "bytes",
    }
    reg = pull_registration(json.dumps(body).encode())
    with store.transaction() as tx:
        for sid in sandbox_ids(n):
            config = SandboxConfig(sid, reg.incarnation, reg.idle_period_s, reg.activity, at)  # type: ignore[arg-type]
            events = core.register(config, at)
            tx.put_registration(sid, reg, at, core.snapshot(sid), events)

    async def main() -> None:
        service = FeedService(store, allow=[FWD_SAN])
        ctx = loader.server_context(
            cert_file=work / "scheduler.crt", key_file=work / "scheduler.key", ca_file=work / "ca.crt"
        )
        runner = await serve(service, "127.0.0.1", port, ctx)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        await runner.cleanup()
        print(json.dumps({"answered": service.answered, "store_errors": service.store_errors}), flush=True)

    asyncio.run(main())
    store.close()


# -- the forwarder's side --------------------------------------------------------------------------


class Timed:
    """Wraps a callable: thread CPU summed, the longest single call's wall time, calls."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.cpu = 0.0
        self.longest = 0.0
        self.calls = 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            self.cpu += time.thread_time() - c0
            self.longest = max(self.longest, time.perf_counter() - w0)
            self.calls += 1

    def reset(self) -> None:
        self.cpu, self.longest, self.calls = 0.0, 0.0, 0


def mint(work: Path) -> None:
    from certs.mint import mint_ca, mint_leaf, write_issued

    ca = mint_ca("bench CA")
    write_issued(ca, work, "ca")
    write_issued(mint_leaf(ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",)), work, "scheduler")
    write_issued(mint_leaf(ca, "fwd", uris=(FWD_SAN,), server=False, client=True), work, "fwd")


async def forwarder_side(args: argparse.Namespace, work: Path, port: int) -> dict[str, Any]:
    from forwarder.ingress.feed_reporter import reporter_for
    from forwarder.ingress.metering import Meter
    from forwarder.ingress.metrics import ForwarderMetrics
    from forwarder.ingress.settings import ForwarderSettings

    settings = ForwarderSettings(
        cert_file=work / "fwd.crt", key_file=work / "fwd.key", ca_file=work / "ca.crt",
        client_san_allow=["spiffe://bench.sbxnet/gateway"], sandbox_prefixes=["10.200.0.0/16"],
        data_plane="userspace", feed_url=f"https://127.0.0.1:{port}/v1/feed", feed_interval=args.interval,
    )
    meter = Meter()
    now = time.monotonic()
    conns = [meter.open(sid, f"c-{sid}", now) for sid in sandbox_ids(args.sandboxes)]
    reporter = reporter_for(settings, meter, stream=0, metrics=ForwarderMetrics())
    assert reporter is not None
    ob = reporter.outbox
    # What the reporter calls, by the names it calls (the old names for a tree from before the columns).
    take_name = "take" if hasattr(meter, "take") else "take_deltas"
    next_name = "next_body" if hasattr(ob, "next_body") else "next_batch"
    timed = {
        f"Meter.{take_name}": Timed(getattr(meter, take_name)),
        "outbox.add": Timed(ob.add),
        f"outbox.{next_name} (freeze + encoding)": Timed(getattr(ob, next_name)),
        "outbox.on_answer": Timed(ob.on_answer),
    }
    setattr(meter, take_name, timed[f"Meter.{take_name}"])
    ob.add = timed["outbox.add"]  # type: ignore[method-assign]
    body_sizes: list[int] = []

    def next_and_size(*args: Any, **kw: Any) -> Any:
        got = timed[f"outbox.{next_name} (freeze + encoding)"](*args, **kw)
        if got is not None and ob.in_flight_body is not None:
            body_sizes.append(len(ob.in_flight_body))
        return got

    setattr(ob, next_name, next_and_size)
    ob.on_answer = timed["outbox.on_answer"]  # type: ignore[method-assign]
    moved = [0, 0]
    traffic_cpu = 0.0

    def move() -> None:
        nonlocal traffic_cpu
        c0 = time.thread_time()
        t = time.monotonic()
        for i, m in enumerate(conns):
            up, down = 100 + i % 1000, 5000 + i % 7000
            m.up += up
            m.down += down
            m.last_activity = t
            moved[0] += up
            moved[1] += down
        traffic_cpu += time.thread_time() - c0

    lateness: list[float] = []

    async def probe() -> None:
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.002)
            lateness.append(loop.time() - t0 - 0.002)

    reporter.start()
    loop = asyncio.get_running_loop()
    probe_task = loop.create_task(probe()) if args.loop_probe else None
    # Traffic half an interval after the reporter's ticks, so a take never lands in the middle of it.
    await asyncio.sleep(args.interval / 2)
    for _ in range(args.warmup):
        move()
        await asyncio.sleep(args.interval)
    for t in timed.values():
        t.reset()
    traffic_cpu, acked0, ticks0 = 0.0, ob.batches_acked, reporter.ticks
    lateness.clear()
    cpu0, wall0 = time.process_time(), loop.time()
    for _ in range(args.intervals):
        move()
        await asyncio.sleep(args.interval)
    cpu, wall = time.process_time() - cpu0, loop.time() - wall0
    late = sorted(lateness)
    if probe_task is not None:
        probe_task.cancel()
    ticks, acked = reporter.ticks - ticks0, ob.batches_acked - acked0
    # Settle: the last deltas taken (two ticks), everything acknowledged; the stop's final report sends
    # whatever is left.
    await asyncio.sleep(2 * args.interval)
    deadline = time.monotonic() + 60
    while (ob.pending_count or ob.in_flight is not None) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await reporter.stop(final_timeout=5)
    feed_cpu = cpu - traffic_cpu
    pieces = {
        name: {"cpu_s_per_interval": t.cpu / args.intervals, "longest_call_ms": t.longest * 1000}
        for name, t in timed.items()
    }
    in_pieces = sum(t.cpu for t in timed.values())
    return {
        "sandboxes": args.sandboxes,
        "intervals_measured": args.intervals,
        "reporter_ticks": ticks,
        "batches_acked": acked,
        "wall_s": round(wall, 3),
        "process_cpu_s": round(cpu, 4),
        "traffic_cpu_s (left out)": round(traffic_cpu, 4),
        "feed_cpu_s_per_interval": round(feed_cpu / args.intervals, 5),
        "feed_fraction_of_one_core": round(feed_cpu / wall, 4),
        "http_tls_loop_cpu_s_per_interval": round((feed_cpu - in_pieces) / args.intervals, 5),
        "pieces": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in pieces.items()},
        "loop_lateness_ms": {
            "max": round(late[-1] * 1000, 2),
            "p99": round(late[int(len(late) * 0.99)] * 1000, 2),
            "over_20ms_per_interval": round(sum(x > 0.020 for x in late) / args.intervals, 2),
            "over_20ms_total_ms_per_interval": round(sum(x for x in late if x > 0.020) * 1000 / args.intervals, 1),
        } if late else None,
        "largest_body_bytes": max(body_sizes, default=0),
        "moved": moved,
        "failures": dict(ob.failures),
    }


def scheduler_totals(db: Path) -> tuple[int, int]:
    from scheduler.sqlite_store import SqliteStore

    store = SqliteStore(db)
    try:
        rows = store.sandboxes()
        return sum(s.state.bytes_in for s in rows), sum(s.state.bytes_out for s in rows)
    finally:
        store.close()


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    import socket

    import uvloop

    with tempfile.TemporaryDirectory(prefix="bench-feed-") as d:
        work = Path(d)
        mint(work)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve-scheduler", str(work), str(port), str(args.sandboxes)],
            stdout=subprocess.PIPE, cwd=ROOT, text=True,
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            if line != "ready":
                raise SystemExit(f"scheduler did not start: {line!r}")
            result = uvloop.run(forwarder_side(args, work, port))
        finally:
            child.send_signal(signal.SIGTERM)
            out, _ = child.communicate(timeout=60)
        result["scheduler"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
        stored = scheduler_totals(work / "sched.db")
        result["stored_equals_moved"] = list(stored) == result["moved"]
        return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sandboxes", type=int, default=10_000)
    p.add_argument("--intervals", type=int, default=30)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--loop-probe", action="store_true", help="measure how late the event loop wakes")
    p.add_argument("--serve-scheduler", nargs=3, metavar=("DIR", "PORT", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_scheduler:
        work, port, n = args.serve_scheduler
        serve_scheduler(Path(work), int(port), int(n))
        return 0
    fractions = []
    for i in range(args.repeats):
        r = run_once(args)
        print(json.dumps(r, indent=2), flush=True)
        if not r["stored_equals_moved"]:
            print("FAIL: the scheduler's totals differ from the bytes moved", file=sys.stderr)
            return 1
        fractions.append(r["feed_fraction_of_one_core"])
        print(
            f"run {i + 1}: {r['sandboxes']} sandboxes, every {args.interval} s: the feed used "
            f"{r['feed_cpu_s_per_interval']:.4f} CPU-s per interval = {r['feed_fraction_of_one_core']:.2%} of one core",
            flush=True,
        )
    if len(fractions) > 1:
        lo, hi, mid = min(fractions), max(fractions), statistics.median(fractions)
        print(f"range {lo:.2%} .. {hi:.2%}, median {mid:.2%} of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
