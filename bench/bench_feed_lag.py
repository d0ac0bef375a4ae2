"""How long the scheduler takes from a feed report to the state change it causes, and from an idle deadline
to the idle event (issue 10's "lag from a report to a state change").

A real scheduler (service and API over mutual TLS on loopback, SQLite with synchronous=FULL, or a
throw-away PostgreSQL with --pg) with ``--sandboxes`` registered sandboxes, all idle. Each round posts one
feed batch that moves bytes for all of them and measures:

- the POST's round trip (the batch judged, applied and committed before the answer);
- the time from sending the POST to the last of the ``idle -> active`` events arriving on the event
  stream (``GET /v1/events``), as an operator's dashboard would see it;
- the idle timers' lateness: each sandbox's idle event time (the scheduler's clock) minus its deadline
  (last activity + period), after the traffic stops.

    python bench/bench_feed_lag.py --sandboxes 1000 --rounds 5 [--pg]

Prints the machine, then median and range per figure over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests" / "scheduler"))
from sched_support import ADMIN, Client, SchedulerApp, mint_pki, registration  # noqa: E402

from sbxnet.protocol.feed import new_epoch  # noqa: E402
from scheduler.sqlite_store import SqliteStore  # noqa: E402


def machine() -> str:
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{os.cpu_count()} cores, {model}, Linux {platform.release()}, load {' '.join(load)}"


async def one_round(n: int, period: float, store_factory: object, pki: dict[str, Path]) -> dict[str, float]:
    app = await SchedulerApp(store_factory, pki).start()
    c = Client(app)
    try:
        sids = [f"sbx-{i:05d}" for i in range(n)]
        for sid in sids:
            await c.admin("PUT", f"/v1/sandboxes/{sid}", registration(idle_period_s=period))
        assert app.service is not None
        deadline = time.monotonic() + 30 + period
        while sum(1 for s in sids if app.service.core.state_of(s) == "idle") < n:
            assert time.monotonic() < deadline, "not all idle"
            await asyncio.sleep(0.05)
        assert app.store is not None
        after = max(e.id for e in app.store.events_after(0, 10 * n + 10))
        seen: list[float] = []

        async def watch() -> None:
            headers = {**ADMIN, "Last-Event-ID": str(after)}
            async with c.session().get(app.url + "/v1/events", headers=headers) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: ") and json.loads(line[6:])["to"] == "active":
                        seen.append(time.monotonic())
                        if len(seen) == n:
                            return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        body = {"epoch": new_epoch(time.time_ns(), os.urandom(8)), "seq": 1, "sandboxes": [
            {"sandbox": s, "bytes_in": 100, "bytes_out": 100, "open": 0, "idle_s": 0.0} for s in sids]}
        t0 = time.monotonic()
        status, _, doc = await c.call("POST", "/v1/feed", as_="forwarder", body=body)
        t_answer = time.monotonic()
        assert status == 200, doc
        await asyncio.wait_for(watcher, 60)
        # The idle timers after this burst: lateness of each idle event past its deadline.
        while sum(1 for s in sids if app.service.core.state_of(s) == "idle") < n:
            await asyncio.sleep(0.02)
        events = [e.event for e in app.store.events_after(after, 10 * n + 10) if e.event.to_state == "idle"]
        # Each deadline is its last activity as the scheduler recorded it plus the period (one clock).
        last = {r.sandbox: r.state.last_activity for r in app.store.sandboxes()}
        late = [ev.at - (float(last[ev.sandbox] or 0.0) + period) for ev in events]
        return {"post_ms": 1000 * (t_answer - t0), "last_event_ms": 1000 * (seen[-1] - t0),
                "idle_late_ms_median": 1000 * statistics.median(late), "idle_late_ms_max": 1000 * max(late)}
    finally:
        await c.close()
        await app.stop()


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--period", type=float, default=2.0)
    ap.add_argument("--pg", action="store_true", help="a throw-away PostgreSQL instead of SQLite")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sbxnet-lag-"))
    pki = mint_pki(work)
    server = None
    if args.pg:
        import pg_support

        from scheduler.pg_store import PgStore

        server = pg_support.shared_server()
    print(f"machine: {machine()}")
    print(f"store: {'PostgreSQL (throw-away, local)' if args.pg else 'SQLite, WAL, synchronous=FULL'}; "
          f"{args.sandboxes} sandboxes; period {args.period} s; {args.rounds} rounds")
    results: list[dict[str, float]] = []
    for i in range(args.rounds):
        if server is not None:
            dsn = pg_support.fresh_schema(server)
            factory: object = lambda dsn=dsn: PgStore(dsn)  # noqa: E731
        else:
            db = work / f"r{i}.db"
            factory = lambda db=db: SqliteStore(db)  # noqa: E731
        results.append(await one_round(args.sandboxes, args.period, factory, pki))
    for key in results[0]:
        vals = [r[key] for r in results]
        print(f"  {key:<22} median {statistics.median(vals):8.1f}   range {min(vals):8.1f} .. {max(vals):8.1f}")
    print(f"machine after: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
