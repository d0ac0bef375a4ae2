"""The idle feed wired into the forwarder, end to end with real parts: the forwarder command (its server, its
workers, its reporter) moving bytes through real tunnels, reporting over real mTLS to the scheduler's feed
endpoint (``scheduler/feed_http.py``: ``FeedService`` + ``serve``) on a real ``SqliteStore``; certificates
from ``certs/mint.py``. The helpers here serve ``test_feed_outage.py`` too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fwd_support import GwClient, Pki, SandboxApp, payload, preamble_for, recv_all
from test_fwd_process import SBXNET, Proc, http_get, write_config

from certs import loader
from certs.mint import mint_ca, mint_leaf, write_issued
from sbxnet.protocol.routes import pull_registration
from sbxnet.protocol.status import Status
from scheduler.feed_http import FeedService, serve
from scheduler.feed_ledger import Stored
from scheduler.sqlite_store import SqliteStore
from scheduler.timers import SandboxConfig, TimerCore

FWD_SAN = "spiffe://sbxnet.test/forwarder/host-1"
PIN = "47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="


# -- certificates for the feed -----------------------------------------------------------------------


@dataclass
class FeedPki:
    """The scheduler's server certificate and the forwarders' feed client certificates (from the test CA,
    unless named foreign), beside the link's ``Pki``."""

    paths: dict[str, Path]

    def __getitem__(self, stem: str) -> Path:
        return self.paths[stem]


@pytest.fixture(scope="session")
def fpki(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> FeedPki:
    d = tmp_path_factory.mktemp("feed-pki")
    other = mint_ca("another CA")
    write_issued(other, d, "other-ca")
    leaves = {
        "scheduler": mint_leaf(pki.ca, "scheduler", dns=("localhost",), ips=("127.0.0.1",), server=True),
        "feed": mint_leaf(pki.ca, "fwd-feed", uris=(FWD_SAN,), server=False, client=True),
        "unlisted": mint_leaf(pki.ca, "fwd-x", uris=("spiffe://sbxnet.test/forwarder/x",), server=False, client=True),
        "foreign": mint_leaf(other, "fwd-feed", uris=(FWD_SAN,), server=False, client=True),
    }
    paths = {"ca": pki.ca_file, "other-ca": d / "other-ca.crt"}
    for stem, leaf in leaves.items():
        paths[stem], paths[stem + "_key"] = write_issued(leaf, d, stem)
    return FeedPki(paths)


# -- the scheduler's feed endpoint -----------------------------------------------------------------------


def register(db: Path, sandboxes: list[str]) -> None:
    """The sandboxes registered (as the registry's PUT does), a minute before any traffic."""
    store, core = SqliteStore(db), TimerCore()
    try:
        at = time.time() - 60
        for sid in sandboxes:
            body = {
                "incarnation": "inc-1", "forwarder": {"address": "127.0.0.1:8443", "spki_pin": PIN},
                "target_ip": "127.0.0.1", "default_port": 8080,
                "ports": {"8080": {"protocol": "http", "auth": "public"}}, "idle_period_s": 300,
                "activity": "bytes",
            }
            r = pull_registration(json.dumps(body).encode())
            config = SandboxConfig(sid, r.incarnation, r.idle_period_s, r.activity, at)  # type: ignore[arg-type]
            events = core.register(config, at)
            store.put_registration(sid, r, at, core.snapshot(sid), events)
    finally:
        store.close()


class SchedulerThread:
    """``FeedService`` served over mTLS on a fixed port, on an event loop of its own in a thread (the test's
    gateway clients block); stopped and started again at will on the same port and database file. The
    store is only touched in that thread (sqlite3's rule)."""

    def __init__(
        self,
        db: Path,
        fpki: FeedPki,
        port: int,
        *,
        store: Callable[[Path], SqliteStore] = SqliteStore,
        allow: tuple[str, ...] = (FWD_SAN,),
    ) -> None:
        self.db, self.fpki, self.port = db, fpki, port
        self.store_factory, self.allow = store, allow
        self.store: SqliteStore | None = None
        self.service: FeedService | None = None
        self._runner: Any = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/v1/feed"

    def start(self) -> FeedService:
        async def go() -> FeedService:
            self.store = self.store_factory(self.db)
            self.service = FeedService(self.store, allow=self.allow)
            ctx = loader.server_context(
                cert_file=self.fpki["scheduler"], key_file=self.fpki["scheduler_key"], ca_file=self.fpki["ca"]
            )
            self._runner = await serve(self.service, "127.0.0.1", self.port, ctx)
            return self.service

        service: FeedService = self.call(go)
        return service

    def stop(self) -> None:
        async def go() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            if self.store is not None:
                self.store.close()
                self.store = None

        self.call(go)

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def totals(self) -> dict[str, tuple[int, int]]:
        def read() -> dict[str, tuple[int, int]]:
            assert self.store is not None, "the scheduler is stopped"
            return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in self.store.sandboxes()}

        out: dict[str, tuple[int, int]] = self.call(read)
        return out

    def ledger(self, identity: str) -> Stored | None:
        assert self.store is not None
        store = self.store
        out: Stored | None = self.call(lambda: store.ledger(identity))
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        s = self.service
        assert s is not None
        out: dict[str, dict[str, int]] = self.call(
            lambda: {
                "answered": dict(s.answered),
                "forbidden": dict(s.forbidden),
                "refused": dict(s.refused),
                "store_errors": {"": s.store_errors},
            }
        )
        return out


def db_totals(db: Path) -> dict[str, tuple[int, int]]:
    """The totals as the file holds them, read by a store of its own (the scheduler may be stopped)."""
    store = SqliteStore(db)
    try:
        return {s.sandbox: (s.state.bytes_in, s.state.bytes_out) for s in store.sandboxes()}
    finally:
        store.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def make_scheduler(tmp_path: Path, fpki: FeedPki) -> Iterator[Callable[..., SchedulerThread]]:
    started: list[SchedulerThread] = []

    def make(sandboxes: list[str], **kw: Any) -> SchedulerThread:
        db = tmp_path / f"sched-{len(started)}.db"
        register(db, sandboxes)
        sched = SchedulerThread(db, fpki, free_port(), **kw)
        started.append(sched)
        sched.start()
        return sched

    yield make
    for sched in started:
        sched.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()
        p.wait_exit(None)


# -- the forwarder and its traffic -------------------------------------------------------------------


def feed_config(path: Path, pki: Pki, fpki: FeedPki, url: str, stem: str = "feed", **extra: object) -> Path:
    """A forwarder config (``test_fwd_process.write_config``) with the feed to ``url``: the feed's own client
    certificate ``stem``, a short interval and request timeout."""
    values: dict[str, object] = {
        "feed_url": f'"{url}"',
        "feed_cert_file": f'"{fpki[stem]}"',
        "feed_key_file": f'"{fpki[stem + "_key"]}"',
        "feed_interval": 0.1,
        "feed_request_timeout": 1.0,
    }
    values.update(extra)
    return write_config(path, pki, **values)


def start(procs: list[Proc], config: Path, workers: int = 1) -> Proc:
    proc = Proc(config)
    procs.append(proc)
    proc.wait_listening()
    proc.wait_for("listening", count=workers, timeout=30)  # every worker listens before the first connection
    return proc


def shaped_app() -> SandboxApp:
    """Answers an upload of n bytes with 3n + 7 bytes, then FIN: the two directions differ."""

    def handler(conn: socket.socket) -> None:
        _, n = recv_all(conn)
        conn.sendall(payload(3 * n + 7, n))

    return SandboxApp(handler)


def echo_app() -> SandboxApp:
    def handler(conn: socket.socket) -> None:
        while data := conn.recv(65536):
            conn.sendall(data)

    return SandboxApp(handler)


class Moved:
    """What the test moved through tunnels, per sandbox: (gateway -> sandbox, sandbox -> gateway)."""

    def __init__(self) -> None:
        self.totals: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def add(self, sandbox: str, up: int, down: int) -> None:
        with self._lock:
            i, o = self.totals.get(sandbox, (0, 0))
            self.totals[sandbox] = (i + up, o + down)

    def get(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            return dict(self.totals)


def transfer(port: int, pki: Pki, app: SandboxApp, sandbox: str, n: int, moved: Moved) -> None:
    """One connection to the shaped app: n bytes up, 3n + 7 down, both checked."""
    c = GwClient(port, pki.client_ctx())
    try:
        assert c.open(preamble_for(app.port, sandbox_id=sandbox)) is Status.OK
        c.exchange(payload(n, 1))
        assert c.received_len == 3 * n + 7
    finally:
        c.close()
    moved.add(sandbox, n, 3 * n + 7)


def echo_round_trip(c: GwClient, sandbox: str, data: bytes, moved: Moved) -> float:
    """One echo through the tunnel; its round-trip time."""
    t0 = time.monotonic()
    c.send(data)
    assert c.recv_exact(len(data)) == data
    rtt = time.monotonic() - t0
    moved.add(sandbox, len(data), len(data))
    return rtt


def wait_until(cond: Callable[[], bool], timeout: float, what: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not met within {timeout}s: {what()}")
        time.sleep(0.05)


def samples(mport: int) -> dict[tuple[str, str], float]:
    """Every sample /metrics serves, keyed by name and sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(http_get(mport, "/metrics")[1]):
        for smp in fam.samples:
            out[(smp.name, ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items())))] = smp.value
    return out


def posts(mport: int, result: str) -> float:
    return samples(mport).get(("sbxnet_forwarder_feed_posts_total", f"result={result}"), 0.0)


# -- the tests ---------------------------------------------------------------------------------------


def test_tunnel_bytes_reach_the_store_exactly_each_worker_on_its_own_stream(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    sandboxes = [f"sbx-{i}" for i in range(8)]
    sched = make_scheduler(sandboxes)
    mport = free_port()
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, metrics_port=mport, workers=2), 2)
    app, moved = shaped_app(), Moved()
    # SO_REUSEPORT spreads connections by source port: with 24, both workers serve some (1 in 2**23 not).
    for k in range(24):
        transfer(proc.port, pki, app, sandboxes[k % 8], 1000 + 997 * k, moved)
    expected = moved.get()
    assert len(expected) == 8 and all(i != o for i, o in expected.values())
    wait_until(lambda: sched.totals() == expected, 20, lambda: (sched.totals(), expected))

    served = {r["pid"] for r in proc.events("connected")}
    assert len(served) == 2, served
    epochs = [sched.ledger(f"{FWD_SAN}#{stream}") for stream in (0, 1)]
    assert all(e is not None and e.last_seq >= 1 for e in epochs), epochs
    assert epochs[0] is not None and epochs[1] is not None and epochs[0].epoch != epochs[1].epoch
    assert sched.ledger(f"{FWD_SAN}#2") is None and sched.ledger(FWD_SAN) is None
    started = proc.events("feed_started")
    assert sorted(r["url"].rsplit("=", 1)[1] for r in started) == ["0", "1"]
    assert sorted({r["epoch"] for r in started}) == sorted({e.epoch for e in epochs if e is not None})

    # Metrics, summed over the workers by the supervisor.
    wait_until(
        lambda: samples(mport).get(("sbxnet_forwarder_feed_in_flight_sandboxes", ""), -1) == 0,
        10,
        lambda: samples(mport),
    )
    s = samples(mport)
    assert s[("sbxnet_forwarder_feed_posts_total", "result=ok")] >= 2
    assert s[("sbxnet_forwarder_feed_epochs_total", "")] == 2
    assert s[("sbxnet_forwarder_feed_pending_sandboxes", "")] == 0
    assert s[("sbxnet_forwarder_feed_lag_seconds", "")] == 0
    assert s.get(("sbxnet_forwarder_feed_resends_total", ""), 0) == 0
    assert not [k for k in s if k[0] == "sbxnet_forwarder_feed_posts_total" and k[1] != "result=ok"], s
    assert sched.counters()["answered"].keys() == {"apply"}
    code, err = proc.stop()
    assert code == 0, err
    assert len(proc.events("feed_stopped")) == 2
    assert sched.totals() == expected


def test_bytes_moved_while_draining_are_in_the_final_report(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    """With an interval longer than the test, only the report made at stop can carry the bytes."""
    sched = make_scheduler(["sbx-drain"])
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url, feed_interval=60))
    app, moved = echo_app(), Moved()
    c = GwClient(proc.port, pki.client_ctx())
    assert c.open(preamble_for(app.port, sandbox_id="sbx-drain")) is Status.OK
    echo_round_trip(c, "sbx-drain", b"a" * 5000, moved)
    proc.p.send_signal(signal.SIGTERM)
    proc.wait_for("draining")
    echo_round_trip(c, "sbx-drain", b"b" * 7000, moved)  # the drain lets the live connection go on
    c.close_write()
    assert c.recv_all() == b""
    c.close()
    code, err = proc.stop(signalled=True)
    assert code == 0, err
    assert moved.get() == {"sbx-drain": (12000, 12000)}
    assert sched.totals() == moved.get()
    assert proc.events("feed_stopped")[0]["unreported_sandboxes"] == 0


def test_no_feed_url_no_feed(tmp_path: Path, pki: Pki, procs: list[Proc]) -> None:
    mport = free_port()
    proc = start(procs, write_config(tmp_path / "f.toml", pki, metrics_port=mport))
    transfer(proc.port, pki, shaped_app(), "sbx-1", 4096, Moved())
    s = samples(mport)
    assert s[("sbxnet_forwarder_feed_epochs_total", "")] == 0
    assert not [k for k in s if k[0] == "sbxnet_forwarder_feed_posts_total"]
    code, err = proc.stop()
    assert code == 0, err
    # One warning at start, and nothing else of the feed: without one the scheduler never idles this
    # host's sandboxes, which an operator must hear about (issue 22, point 2).
    (warned,) = proc.events("feed_disabled")
    assert warned["level"] == "warning" and "feed_url" in warned["msg"], warned
    assert err.count('"event": "feed_') == 1


def test_a_feed_certificate_with_another_key_is_warned_about(
    tmp_path: Path, pki: Pki, fpki: FeedPki, procs: list[Proc], make_scheduler: Callable[..., SchedulerThread]
) -> None:
    # The scheduler ties a feed to the routes that pin its key: the "feed" certificate's key is not the
    # link's, so this forwarder's sandboxes would never be idled. One warning at start says so.
    sched = make_scheduler(["sbx-1"])
    proc = start(procs, feed_config(tmp_path / "f.toml", pki, fpki, sched.url))
    (warned,) = proc.wait_for("feed_key_differs")
    assert warned["level"] == "warning" and "feed_cert_file" in warned["msg"], warned
    code, err = proc.stop()
    assert code == 0, err
    assert err.count('"event": "feed_key_differs"') == 1


def check(cfg: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    argv = [*SBXNET, "forwarder", "--config", str(cfg), "--check"]
    return subprocess.run(argv, capture_output=True, env=env, timeout=30)


BAD_FEED: list[tuple[dict[str, object], str]] = [
    ({"feed_url": '"http://127.0.0.1:9/v1/feed"'}, "forwarder.feed_url = 'http://127.0.0.1:9/v1/feed'"),
    ({"feed_url": '"https://127.0.0.1:99999/v1/feed"'}, "not a URL with a valid port"),
    ({"feed_url": '"https://:9/v1/feed"'}, "must name the scheduler's host"),
    ({"feed_url": '"https://127.0.0.1:9/v1/feed?stream=1"'}, "must not carry a query"),
    ({"feed_url": '"https://127.0.0.1:9/"'}, "a path ending in /v1/feed"),
    ({"feed_url": '"https://me@127.0.0.1:9/v1/feed"'}, "must not carry user information"),
    ({"feed_url": '"https://127.0.0.1:0/v1/feed"'}, "port 0"),
    ({"feed_interval": 0.01}, "forwarder.feed_interval = 0.01"),
    ({"feed_interval": 61}, "forwarder.feed_interval = 61"),
    ({"feed_request_timeout": 0}, "forwarder.feed_request_timeout = 0"),
    ({"feed_cert_file": '"/nonexistent/feed.crt"'}, "forwarder.feed_cert_file = '/nonexistent/feed.crt'"),
    ({"feed_ca_file": '"/nonexistent/ca.crt"'}, "forwarder.feed_ca_file = '/nonexistent/ca.crt'"),
    ({"feed_cert_file": "CERT"}, "feed_cert_file and feed_key_file go together"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_FEED, ids=[f"{next(iter(b))}{i}" for i, (b, _) in enumerate(BAD_FEED)])
def test_bad_feed_settings_name_the_setting_and_exit_2(
    tmp_path: Path, pki: Pki, fpki: FeedPki, bad: dict[str, object], message: str
) -> None:
    bad = {k: (f'"{fpki["feed"]}"' if v == "CERT" else v) for k, v in bad.items()}
    if "feed_url" not in bad:
        bad = {"feed_url": '"https://127.0.0.1:9/v1/feed"', **bad}
    r = check(write_config(tmp_path / "f.toml", pki, **bad))
    assert r.returncode == 2, r.stderr
    err = r.stderr.decode()
    assert message in err
    assert err.count("\n") <= 2  # one message, not a traceback


def test_bad_feed_environment_value_and_unloadable_feed_material(tmp_path: Path, pki: Pki, fpki: FeedPki) -> None:
    cfg = feed_config(tmp_path / "f.toml", pki, fpki, "https://127.0.0.1:9/v1/feed")
    env = {**os.environ, "SBXNET_FORWARDER_FEED_INTERVAL": "often"}
    r = check(cfg, env)
    assert r.returncode == 2
    assert "forwarder.feed_interval = 'often'" in r.stderr.decode()
    assert "SBXNET_FORWARDER_FEED_INTERVAL" in r.stderr.decode()

    r = check(cfg)
    assert r.returncode == 0, r.stderr
    broken = tmp_path / "broken.key"
    broken.write_text("not a key")
    env = {**os.environ, "SBXNET_FORWARDER_FEED_KEY_FILE": str(broken)}
    r = check(cfg, env)
    assert r.returncode == 2
    assert "cannot load the feed's TLS material" in r.stderr.decode()
    assert "feed_key_file" in r.stderr.decode()

