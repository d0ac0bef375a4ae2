"""The idle feed when things go wrong, with real parts (the forwarder command, real tunnels, the scheduler's
``FeedService`` over real mTLS on a real SQLite file): a 30 s scheduler outage, a 500 then a 200 for one
batch, a worker SIGKILLed mid-stream, forwarders the scheduler refuses, a 409, a scheduler that never
answers; and the forwarder's memory with 10,000 sandboxes pending through an outage."""

from __future__ import annotations

import gc
import http.client
import os
import random
import signal
import socket
import ssl
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fwd_support import GwClient, Pki, preamble_for
from test_feed_wiring import (
    FeedPki,
    Moved,
    SchedulerThread,
    db_totals,
    echo_app,
    echo_round_trip,
    feed_config,
    fpki,
    free_port,
    make_scheduler,
    posts,
    procs,
    samples,
    shaped_app,
    start,
    transfer,
    wait_until,
)
from test_fwd_process import Proc

from certs import loader
from forwarder.ingress.feed_outbox import Outbox
from forwarder.ingress.metering import Meter
from sbxnet.protocol.feed import Batch, epoch_is_newer, new_epoch
from sbxnet.protocol.status import Status
from scheduler.feed_ledger import Decision
from scheduler.sqlite_store import SqliteStore, SqliteTx
from scheduler.store import StoreError

__all__ = ["fpki", "make_scheduler", "procs"]  # fixtures, used by name

Applied = tuple[str, str, int, dict[str, tuple[int, int]]]  # identity, epoch, seq, {sandbox: (in, out)}


class RecordingStore(SqliteStore):
    """A real ``SqliteStore`` that remembers each feed batch it was asked to claim (``attempts``) and each
    one that committed (``applied``), and fails the next ``fail_claims`` claims with a ``StoreError`` (the
    transaction rolls back, the feed answers 500)."""

    def __init__(self, path: Path, **kw: Any) -> None:
        self.attempts: list[Applied] = []
        self.applied: list[Applied] = []
        self.fail_claims = 0
        super().__init__(path, **kw)  # which writes the schema in a transaction

    @contextmanager
    def transaction(self) -> Iterator[SqliteTx]:
        claimed: list[Applied] = []
        with super().transaction() as tx:
            real_claim = tx.claim

            def claim(identity: str, batch: Batch, decision: Decision) -> None:
                entries = {r.sandbox: (r.bytes_in, r.bytes_out) for r in batch.sandboxes}
                entry = (identity, batch.epoch, batch.seq, entries)
                self.attempts.append(entry)
                if self.fail_claims:
                    self.fail_claims -= 1
                    raise StoreError("test_fault", "a write that fails")
                real_claim(identity, batch, decision)
                claimed.append(entry)

            tx.claim = claim  # type: ignore[method-assign]
            yield tx
        self.applied += claimed  # committed


def recorded(sched: SchedulerThread) -> tuple[list[Applied], list[Applied]]:
    store = sched.store
    assert isinstance(store, RecordingStore)
    out: tuple[list[Applied], list[Applied]] = sched.call(lambda: (list(store.attempts), list(store.applied)))
    return out


def sum_applied(applied: list[Applied]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for _, _, _, entries in applied:
        for sid, (i, o) in entries.items():
            a, b = out.get(sid, (0, 0))
            out[sid] = (a + i, b + o)
    return out


def events_named(proc: Proc, event: str) -> list[dict[str, Any]]:
    return proc.events(event)


# -- a 30 s outage -----------------------------------------------------------------------------------


def test_a_30s_scheduler_outage_during_traffic_loses_and_doubles_nothing(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    short = [f"sbx-s{i}" for i in range(4)]
    sched = make_scheduler(["sbx-long", *short])
    mport = free_port()
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, metrics_port=mport))
    echo, shaped, moved = echo_app(), shaped_app(), Moved()
    long = GwClient(proc.port, pki.client_ctx())
    assert long.open(preamble_for(echo.port, sandbox_id="sbx-long")) is Status.OK
    echo_round_trip(long, "sbx-long", b"x" * 3000, moved)
    transfer(proc.port, pki, shaped, short[0], 5000, moved)
    wait_until(lambda: sched.totals() == {**dict.fromkeys(short, (0, 0)), **moved.get()}, 20)

    sched.stop()
    began = time.monotonic()
    k = 0
    while (t := time.monotonic() - began) < 30:
        echo_round_trip(long, "sbx-long", random.Random(k).randbytes(1000 + k), moved)
        if k % 4 == 0:
            transfer(proc.port, pki, shaped, short[k // 4 % 4], 2000 + k, moved)
        k += 1
        if t > 25 and k % 8 == 0:
            s = samples(mport)
            assert s[("sbxnet_forwarder_feed_lag_seconds", "")] > 20
            assert s[("sbxnet_forwarder_feed_pending_sandboxes", "")] + s[
                ("sbxnet_forwarder_feed_in_flight_sandboxes", "")
            ] >= 1
        time.sleep(0.25)
    assert posts(mport, "connect") >= 3  # retried, with the backoff (0.25 s doubling to 10 s)
    assert len(events_named(proc, "feed_backing_off")) == 1  # one line for the whole outage
    assert not events_named(proc, "feed_reporting")

    sched.start()  # the same port, the same file
    echo_round_trip(long, "sbx-long", b"after" * 100, moved)
    long.close_write()
    assert long.recv_all() == b""
    long.close()
    expected = moved.get()
    assert set(expected) == {"sbx-long", *short}
    wait_until(lambda: sched.totals() == expected, 40, lambda: (sched.totals(), expected))
    wait_until(lambda: samples(mport)[("sbxnet_forwarder_feed_lag_seconds", "")] == 0, 10)
    time.sleep(0.5)  # settled: nothing more arrives, nothing was applied twice
    assert sched.totals() == expected
    back = events_named(proc, "feed_reporting")
    assert len(back) == 1 and back[0]["failed_posts"] >= 3 and back[0]["backed_off_s"] > 25
    assert set(sched.counters()["answered"]) <= {"apply", "duplicate"}
    code, err = proc.stop()
    assert code == 0, err
    sched.stop()
    assert db_totals(sched.db) == expected


# -- 500 then 200 ------------------------------------------------------------------------------------


def test_a_500_then_a_200_for_the_same_batch_counts_it_once(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    sched = make_scheduler(["sbx-1"], store=RecordingStore)
    store = sched.store
    assert isinstance(store, RecordingStore)
    sched.call(lambda: setattr(store, "fail_claims", 1))
    mport = free_port()
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, metrics_port=mport))
    moved = Moved()
    transfer(proc.port, pki, shaped_app(), "sbx-1", 12345, moved)
    wait_until(lambda: sched.totals() == moved.get(), 20, sched.totals)
    attempts, applied = recorded(sched)
    assert len(attempts) >= 2 and attempts[0] == attempts[1]  # the same epoch, seq and entries, sent again
    assert applied[0] == attempts[1] and sum_applied(applied) == moved.get() == {"sbx-1": (12345, 3 * 12345 + 7)}
    assert sched.counters()["store_errors"] == {"": 1}
    wait_until(lambda: posts(mport, "ok") >= 1, 10)
    assert posts(mport, "http_500") == 1
    assert samples(mport)[("sbxnet_forwarder_feed_resends_total", "")] >= 1
    time.sleep(0.5)
    assert sched.totals() == moved.get()
    assert len(events_named(proc, "feed_backing_off")) == len(events_named(proc, "feed_reporting")) == 1


# -- a worker SIGKILLed mid-stream -------------------------------------------------------------------


def pid_of(proc: Proc, sandbox: str) -> int:
    """The worker that connected ``sandbox``'s connection (its "connected" log line)."""
    deadline = time.monotonic() + 10
    while True:
        for r in proc.events("connected"):
            if r.get("sandbox_id") == sandbox:
                return int(r["pid"])
        assert time.monotonic() < deadline, f"no connection for {sandbox}"
        time.sleep(0.02)


class Pump(threading.Thread):
    """Echo round trips on one connection until told to stop or the connection breaks."""

    def __init__(self, c: GwClient, sandbox: str, moved: Moved, attempted: Moved) -> None:
        super().__init__(daemon=True)
        self.c, self.sandbox, self.moved, self.attempted = c, sandbox, moved, attempted
        self.stop = threading.Event()
        self.broken = False

    def run(self) -> None:
        data = os.urandom(4096)
        while not self.stop.is_set():
            self.attempted.add(self.sandbox, len(data), len(data))
            try:
                echo_round_trip(self.c, self.sandbox, data, self.moved)
            except (OSError, EOFError, ssl.SSLError):
                self.broken = True
                return
            time.sleep(0.01)


def test_a_worker_sigkilled_mid_stream_and_restarted(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    before, after = [f"sbx-k{i}" for i in range(24)], [f"sbx-n{i}" for i in range(32)]
    sched = make_scheduler(before + after, store=RecordingStore)
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, workers=2), workers=2)
    app, moved, attempted = echo_app(), Moved(), Moved()
    conns: dict[str, GwClient] = {}
    workers: dict[str, int] = {}
    for sid in before:  # long-lived connections until both workers hold at least two
        c = GwClient(proc.port, pki.client_ctx())
        assert c.open(preamble_for(app.port, sandbox_id=sid)) is Status.OK
        conns[sid], workers[sid] = c, pid_of(proc, sid)
        held = list(workers.values())
        if len(held) >= 4 and all(held.count(p) >= 2 for p in set(held)) and len(set(held)) == 2:
            break
    assert len(set(workers.values())) == 2, workers
    for sid, c in conns.items():
        echo_round_trip(c, sid, b"a" * 1000, moved)
        attempted.add(sid, 1000, 1000)
    acked = moved.get()
    wait_until(lambda: {s: t for s, t in sched.totals().items() if t != (0, 0)} == acked, 20)
    victim = workers[next(iter(conns))]
    doomed = [s for s, p in workers.items() if p == victim]
    survivors = [s for s, p in workers.items() if p != victim]
    _, applied = recorded(sched)
    streams = {ident for ident, _, _, entries in applied if set(entries) & set(doomed)}
    assert len(streams) == 1, streams  # one worker, one stream
    victim_stream = streams.pop()
    old_epoch = next(e for ident, e, _, _ in applied if ident == victim_stream)

    pumps = {sid: Pump(c, sid, moved, attempted) for sid, c in conns.items()}
    for p in pumps.values():
        p.start()
    time.sleep(0.5)  # bytes flowing through both workers, some of them reported
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    for p in pumps.values():
        p.stop.set()
        p.join(30)
    assert all(pumps[s].broken for s in doomed) and not any(pumps[s].broken for s in survivors)
    for sid in survivors:
        conns[sid].close_write()
        assert conns[sid].recv_all() == b""
    for c in conns.values():
        c.close()

    # The supervisor starts a worker in the victim's place, on its stream, with a new epoch.
    proc.wait_for("worker_started", count=3, timeout=30)
    listening = proc.wait_for("listening", count=3, timeout=30)
    new_pid = next(int(r["pid"]) for r in listening if int(r["pid"]) not in workers.values())
    shaped = shaped_app()
    for sid in after:  # until one is served by the new worker
        transfer(proc.port, pki, shaped, sid, 700 + len(sid), moved)
        if pid_of(proc, sid) == new_pid:
            break
    assert pid_of(proc, sid) == new_pid

    final = moved.get()
    exact = {s: final[s] for s in final if s not in doomed}
    wait_until(lambda: {s: t for s, t in sched.totals().items() if s in exact} == exact, 20)
    _, applied = recorded(sched)
    wait_until(lambda: any(e != old_epoch for i, e, _, _ in recorded(sched)[1] if i == victim_stream), 20)
    time.sleep(0.5)
    totals = sched.totals()
    _, applied = recorded(sched)
    # Exactly once for what each epoch had acknowledged: the store's totals are the sum of the batches it
    # committed, every sandbox, each epoch's seqs 1, 2, 3, ... without a hole or a repeat.
    nonzero = {s: t for s, t in totals.items() if t != (0, 0)}
    assert {s: t for s, t in sum_applied(applied).items() if t != (0, 0)} == nonzero
    by_epoch: dict[tuple[str, str], list[int]] = {}
    for ident, epoch, seq, _ in applied:
        by_epoch.setdefault((ident, epoch), []).append(seq)
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in by_epoch.values()), by_epoch
    epochs = [e for i, e in dict.fromkeys((i, e) for i, e, _, _ in applied) if i == victim_stream]
    assert len(epochs) == 2 and epoch_is_newer(epochs[1], epochs[0]), epochs  # the new epoch accepted
    assert set(sched.counters()["answered"]) <= {"apply", "duplicate"}
    # What the killed worker had not reported is lost with it, never more than it moved.
    for sid in doomed:
        got, was, tried = totals[sid], acked[sid], attempted.get()[sid]
        assert was[0] <= got[0] <= tried[0] and was[1] <= got[1] <= tried[1], (sid, got, was, tried)
    code, err = proc.stop()
    assert code == 0, err


# -- forwarders the scheduler refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "failures"),
    [
        ("unlisted_san", ("http_403",)),  # a certificate from the CA with a SAN not on the allowlist
        ("foreign_client_ca", ("tls", "connect")),  # the scheduler refuses the handshake
        ("wrong_server_ca", ("tls",)),  # the forwarder cannot verify the scheduler
    ],
)
def test_refused_forwarders_are_counted_on_both_sides_and_nothing_is_applied(
    tmp_path: Path,
    pki: Pki,
    fpki: FeedPki,
    procs: list[Proc],
    make_scheduler: Callable[..., SchedulerThread],
    case: str,
    failures: tuple[str, ...],
) -> None:
    sched = make_scheduler(["sbx-1"])
    mport = free_port()
    extra: dict[str, object] = {"metrics_port": mport}
    stem = {"unlisted_san": "unlisted", "foreign_client_ca": "foreign"}.get(case, "feed")
    if case == "wrong_server_ca":
        extra["feed_ca_file"] = f'"{fpki["other-ca"]}"'
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, stem, **extra))
    transfer(proc.port, pki, shaped_app(), "sbx-1", 1000, Moved())
    wait_until(lambda: sum(posts(mport, f) for f in failures) >= 2, 20, lambda: samples(mport))
    assert posts(mport, "ok") == 0
    assert sched.totals() == {"sbx-1": (0, 0)}
    c = sched.counters()
    assert c["answered"] == {}
    if case == "unlisted_san":
        assert c["forbidden"].get("san_not_allowed", 0) >= 2
    else:
        assert c["forbidden"] == {}  # refused by TLS, before any HTTP
    assert len(events_named(proc, "feed_backing_off")) == 1
    assert events_named(proc, "feed_backing_off")[0]["reason"] in failures


def test_a_409_is_logged_and_counted_and_starts_a_new_epoch(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    """The scheduler holds an epoch for stream 0 from the future (another host's clock, a restored file):
    every epoch this forwarder makes is older, and is answered stale_epoch."""
    sched = make_scheduler(["sbx-1"])
    future = new_epoch(time.time_ns() + 3600 * 10**9, bytes(8))
    ctx = loader.client_context(cert_file=fpki["feed"], key_file=fpki["feed_key"], ca_file=fpki["ca"])
    conn = http.client.HTTPSConnection("127.0.0.1", sched.port, context=ctx, timeout=10)
    conn.request("POST", "/v1/feed?stream=0", body=b'{"epoch":"%s","seq":1,"sandboxes":[]}' % future.encode())
    assert conn.getresponse().status == 200
    conn.close()
    mport = free_port()
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, metrics_port=mport))
    transfer(proc.port, pki, shaped_app(), "sbx-1", 1000, Moved())
    wait_until(lambda: posts(mport, "stale_epoch") >= 2, 20, lambda: samples(mport))
    refused = events_named(proc, "feed_refused")
    assert len(refused) >= 2 and {r["reason"] for r in refused} == {"stale_epoch"}
    assert all(r["outcome"] == "requeued" and r["new_epoch"] != r["epoch"] for r in refused)
    assert samples(mport)[("sbxnet_forwarder_feed_epochs_total", "")] >= 3
    assert len(events_named(proc, "feed_backing_off")) == 1
    assert sched.counters()["answered"].get("stale_epoch", 0) >= 2
    assert sched.totals() == {"sbx-1": (0, 0)}


# -- a scheduler that never answers ------------------------------------------------------------------


def test_a_stuck_scheduler_does_not_slow_the_tunnel(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc]
) -> None:
    """The scheduler's port accepts TCP and never says a word: the reporter's POSTs time out (1 s) one after
    the other while echo round trips through a tunnel stay fast."""
    stuck = socket.socket()
    stuck.bind(("127.0.0.1", 0))
    stuck.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(stuck.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        mport = free_port()
        url = f"https://127.0.0.1:{stuck.getsockname()[1]}/v1/feed"
        proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, url, metrics_port=mport, feed_interval=0.05))
        app, moved = echo_app(), Moved()
        c = GwClient(proc.port, pki.client_ctx())
        assert c.open(preamble_for(app.port, sandbox_id="sbx-1")) is Status.OK
        rtts = []
        began = time.monotonic()
        while time.monotonic() - began < 4.5:  # spans several 1 s request timeouts
            rtts.append(echo_round_trip(c, "sbx-1", os.urandom(2048), moved))
            time.sleep(0.005)
        c.close()
        assert len(held) >= 2  # the reporter was connecting all along
        assert posts(mport, "timeout") >= 2
        rtts.sort()
        # A reporter that blocked the loop for its request would stall a round trip for ~1 s.
        assert rtts[-1] < 0.75 and rtts[len(rtts) // 2] < 0.05, (rtts[-5:], len(rtts))
        assert len(events_named(proc, "feed_backing_off")) == 1
        code, err = proc.stop()  # the final report is bounded too
        assert code == 0, err
    finally:
        stuck.close()
        for s in held:
            s.close()


# -- memory ------------------------------------------------------------------------------------------


def test_memory_stays_flat_with_10000_sandboxes_pending_through_a_long_outage() -> None:
    """The pure Meter and Outbox, a fake clock, every send failing: 10,000 sandboxes with a connection open
    each, a tenth of them moving bytes in each interval (each one every 10 intervals). Entries stay at
    most two per sandbox, and the traced bytes after 100 intervals are those after 11 (the first batch
    freezes every sandbox at the first interval; by the 11th, each has moved once more and is pending)."""
    n = 10_000
    tracemalloc.start()
    try:
        meter = Meter()
        outbox = Outbox(lambda: new_epoch(time.time_ns(), os.urandom(8)), random.Random(5))
        conns = [meter.open(f"sbx-{i}", f"c{i}", 0.0) for i in range(n)]
        now = 0.0
        sends = 0

        def interval(k: int) -> None:
            nonlocal now, sends
            now += 1.0
            for m in conns[k % 10 :: 10]:
                m.up += 1500
                m.down += 64000
                m.last_activity = now
            outbox.add(meter.take(now), now)  # the columns, as the reporter takes them
            if outbox.next_batch(now) is not None:
                sends += 1
                outbox.on_failure(now, "connect")
            assert outbox.pending_count <= n and outbox.in_flight_count <= n

        def traced() -> int:
            gc.collect()
            return tracemalloc.get_traced_memory()[0]

        for k in range(11):
            interval(k)
        at_11 = traced()
        for k in range(11, 100):
            interval(k)
        at_100 = traced()
    finally:
        tracemalloc.stop()
    assert outbox.pending_count == n and outbox.in_flight_count == n  # everything waiting, twice at most
    assert sends >= 10  # it kept trying (the backoff caps at 10 s)
    assert outbox.lag(now) == pytest.approx(99.0)
    assert at_11 > 1_000_000  # what 10,000 sandboxes cost (a sanity floor, not a bound)
    assert at_100 - at_11 < 0.02 * at_11, (at_11, at_100)
