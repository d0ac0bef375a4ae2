"""The scheduler's HTTP adapter for the idle feed (docs/scheduler-api.md, "The idle feed"): ``POST /v1/feed``.

A small adapter over the pure cores: the forwarder's identity from its verified client certificate, the
body through ``pull_batch``, the decision and the write through ``ingest_batch``, the answer through
``push_answer``. What it trusts and refuses:

- The TLS layer (the ``ssl_context`` the site is served with) must require a client certificate and
  verify it against the forwarders' CA: a wrong CA never reaches this code (the handshake fails).
  ``serve`` refuses a context that does not require one.
- The identity is the first URI or DNS SAN of the peer's certificate that is on ``allow``; a certificate
  with none on it (or no certificate) gets 403, counted in ``forbidden`` by reason.
- The ledger is kept per stream: ``?stream=<n>`` (decimal 0..``MAX_STREAM``, no leading zero; 0 when
  absent) makes the ledger identity ``<san>#<n>``, since a forwarder's SO_REUSEPORT workers share one
  certificate but each has an epoch and a seq of its own. A bad stream, a parameter given twice or one
  this endpoint does not know gets 400 with the reason (``bad_stream``, ``unknown_parameter``), counted
  in ``refused``.
- A body over ``MAX_BODY_BYTES`` gets 413 (aiohttp's ``client_max_size``); one ``pull_batch`` refuses gets
  400 (413 for ``too_large``) with the reason as the body, counted in ``refused``.
- The forwarder's key is the SPKI pin of that same certificate (``certs.loader.spki_pin_of_der``): the
  pin a route names its forwarder by. With a ``FeedLiveness`` (the scheduler's service always gives one),
  each batch the store applied, or acknowledged again as a duplicate of an applied one, is that
  forwarder's proof of life (``FeedLiveness.heard``), and the timer core, gated on feeds, is told when a
  feed becomes live (``TimerCore.feed_live``) or goes stale (``expire_feeds``): docs/scheduler-api.md
  "Feed liveness". A refused batch (409) is not: what it carried was not applied.
- A store write that fails (``CoreAhead``) gets 500 and no answer body the forwarder would accept, so it
  resends the same batch; the timer core is rebuilt from the store first, since it holds changes the
  store does not.

``ingest_batches`` runs on the store thread (``store_thread.StoreThread``, one worker: two batches never
interleave between the ledger read and its claim, and the event loop never waits on the store); when
that thread has too many operations waiting the batch gets 503 with ``Retry-After: 1`` and nothing is
done (the forwarder keeps its deltas and sends them again). Group commit: a batch that arrives while
the last operation submitted to the store thread is a group of batches not yet started joins it (up to
``MAX_GROUP``), so the batches that queue up while a transaction runs are applied in one transaction
with one commit (and one sync) after it, in the order they arrived, each judged against the ledger as
the ones before it left it; nothing else is ever overtaken (a batch joins only a group nothing was
submitted after). A store failure fails the whole group (each gets 500 and is resent). Without a store
thread (a bare feed endpoint, as some tests serve it) each batch runs on the event loop without
awaiting. Each commit syncs the WAL (SqliteStore's default): one fsync per group.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web

from certs.loader import spki_pin_of_der
from sbxnet.errors import ConfigError
from sbxnet.protocol.feed import MAX_BODY_BYTES, MAX_STREAM, Batch, FeedError, pull_batch, push_answer
from scheduler.feed_ledger import Decision, Verdict
from scheduler.feed_liveness import FeedLiveness
from scheduler.store import CoreAhead, Store, StoreError, ingest_batches, load_core
from scheduler.store_thread import Busy, StoreThread
from scheduler.timers import Event, TimerCore

log = logging.getLogger("sbxnet.scheduler")

FEED_PATH = "/v1/feed"
_HEARD = (Verdict.APPLY, Verdict.DUPLICATE)  # the verdicts that say the forwarder's report is applied
MAX_GROUP = 64  # batches per group transaction (a hundred streams' second is two)
_STREAM_RE = re.compile(r"0|[1-9][0-9]{0,3}", re.ASCII)


def peer_sans(peercert: dict[str, Any] | None) -> list[str]:
    """The URI and DNS SANs of a certificate as ``ssl`` gives it (``getpeercert()``), in order."""
    if not peercert:
        return []
    return [str(v) for k, v in peercert.get("subjectAltName", ()) if k in ("URI", "DNS")]


class FeedService:
    """The feed's state: the store, the timer core built from it, the allowlist and the counters.

    ``now`` is the scheduler's clock for the timer core (wall seconds by default: the store keeps these
    times across restarts). ``on_events`` gets the events of each applied batch once it has committed
    (on the store thread when there is one). ``worker``: the thread the store is used on. ``liveness``:
    which forwarders' feeds are live; given, the core idles only on a live feed (``gate_on_feeds``)."""

    def __init__(
        self,
        store: Store,
        allow: Collection[str],
        *,
        core: TimerCore | None = None,
        now: Callable[[], float] = time.time,
        on_events: Callable[[list[Event]], None] | None = None,
        worker: StoreThread | None = None,
        liveness: FeedLiveness | None = None,
    ) -> None:
        self.store = store
        self.worker = worker
        self._open: _Group | None = None  # the last group submitted; batches may join it until it starts
        self.groups = 0  # group transactions run (with answered["apply"]: the batches per commit)
        self.core = core if core is not None else load_core(store)
        self.liveness = liveness
        if liveness is not None:
            self.core.gate_on_feeds(liveness.live())
        self._pins: dict[bytes, str] = {}  # a certificate's DER -> its SPKI pin (a forwarder's, seen already)
        self.allow = frozenset(allow)
        self._now = now
        self._on_events = on_events
        # Counters for metrics.
        self.forbidden: dict[str, int] = {}  # 403s by reason
        self.refused: dict[str, int] = {}  # 400/413s by the codec's reason
        self.answered: dict[str, int] = {}  # by verdict ("apply", "retry", "replay", ...)
        self.core_rebuilds = 0
        self.store_errors = 0

    def identity(self, request: web.Request) -> str | None:
        """The first SAN of the verified peer certificate that is allowed, or None (counted)."""
        found = self._peer(request)
        return None if found is None else found[0]

    def _peer(self, request: web.Request) -> tuple[str, str] | None:
        """The allowed SAN of the verified peer certificate and its key's SPKI pin, or None (counted)."""
        ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
        cert = ssl_obj.getpeercert() if ssl_obj is not None else None
        if not cert or ssl_obj is None:
            _count(self.forbidden, "no_client_cert")
            return None
        for san in peer_sans(cert):
            if san in self.allow:
                return san, self._pin(ssl_obj.getpeercert(binary_form=True) or b"")
        _count(self.forbidden, "san_not_allowed")
        return None

    def _pin(self, der: bytes) -> str:
        pin = self._pins.get(der)
        if pin is None:
            if len(self._pins) >= 4096:
                self._pins.clear()
            pin = self._pins[der] = spki_pin_of_der(der)
        return pin

    def stream(self, request: web.Request) -> int | str:
        """The request's stream number, or the reason it is refused (``bad_stream``, ``unknown_parameter``)."""
        query = request.query
        if any(k != "stream" for k in query):
            return "unknown_parameter"
        values = query.getall("stream", [])
        if not values:
            return 0
        if len(values) > 1 or not _STREAM_RE.fullmatch(values[0]) or int(values[0]) > MAX_STREAM:
            return "bad_stream"
        return int(values[0])

    async def handle_feed(self, request: web.Request) -> web.Response:
        peer = self._peer(request)
        if peer is None:
            return web.Response(status=403, text="forbidden")
        san, key = peer
        stream = self.stream(request)
        if isinstance(stream, str):
            _count(self.refused, stream)
            return web.Response(status=400, text=stream)
        identity = f"{san}#{stream}"
        body = await request.read()  # bounded by the application's client_max_size (413 beyond)
        try:
            batch = pull_batch(body)
        except FeedError as e:
            _count(self.refused, e.reason)
            return web.Response(status=e.http_status, text=e.reason)
        if self.worker is None:
            decision = self.ingest(identity, batch, key)
        else:
            try:
                group, index = self._join(identity, batch, key)
            except Busy:
                _count(self.refused, "busy")
                return web.Response(status=503, text="busy", headers={"Retry-After": "1"})
            # Shielded: one request going away must not cancel the others' transaction.
            decision = (await asyncio.shield(group.done))[index]
        if decision is None:
            return web.Response(status=500, text="store_error")
        _count(self.answered, decision.verdict.value)
        answer = decision.answer
        return web.Response(status=answer.http_status, body=push_answer(answer), content_type="application/json")

    def _join(self, identity: str, batch: Batch, key: str | None) -> tuple[_Group, int]:
        """The group this batch goes in, and its place there: the open one if nothing was submitted to
        the store thread after it and it has not started, else a new one (``Busy`` if the thread is full)."""
        worker = self.worker
        assert worker is not None
        group = self._open
        if group is not None and worker.submitted == group.ticket:
            with group.lock:
                if not group.started and len(group.items) < MAX_GROUP:
                    group.items.append((identity, batch))
                    group.keys.append(key)
                    return group, len(group.items) - 1
        group = _Group([(identity, batch)], [key])
        group.done = worker.submit(self._ingest_group, group, bounded=True)
        group.ticket = worker.submitted
        self._open = group
        return group, 0

    def _ingest_group(self, group: _Group) -> list[Decision | None]:
        with group.lock:
            group.started = True
        return self.ingest_many(group.items, group.keys)

    def ingest(self, identity: str, batch: Batch, key: str | None = None) -> Decision | None:
        """``ingest_many`` of one batch."""
        return self.ingest_many([(identity, batch)], [key])[0]

    def ingest_many(
        self, items: list[tuple[str, Batch]], keys: list[str | None] | None = None
    ) -> list[Decision | None]:
        """These batches judged, applied and committed in one transaction (on the store thread); their
        events handed to ``on_events`` after the commit, in order. None for each: the store failed (the
        forwarders get 500 and resend). ``keys``: each batch's forwarder key (its certificate's SPKI
        pin; None: unknown), whose feed an applied batch proves live."""
        now = self._now()
        try:
            done = ingest_batches(self.core, self.store, items, now)
        except CoreAhead:
            self.store_errors += 1
            self._rebuild()
            return [None] * len(items)
        except StoreError:
            # Failed before the core changed (the store unreachable, the ledger unreadable): no rebuild.
            self.store_errors += 1
            return [None] * len(items)
        self.groups += 1
        if self.liveness is not None and keys is not None:
            for key, (decision, _) in zip(keys, done, strict=True):
                if key is not None and decision.verdict in _HEARD:
                    self._heard(key, now)
        events = [ev for _, evs in done for ev in evs]
        if events and self._on_events is not None:
            self._on_events(events)
        return [decision for decision, _ in done]

    def _heard(self, key: str, now: float) -> None:
        assert self.liveness is not None
        since = self.liveness.heard(key, now)
        if since is not None:
            self.core.feed_live(key, since)
            log.info("feed live: its forwarder's sandboxes may be idled again", extra={
                "event": "feed_live", "fields": {"forwarder_pin": key}})

    def expire_feeds(self, now: float) -> list[str]:
        """The feeds silent longer than the liveness bound from ``now`` on: no sandbox of theirs is idled
        until they report again (on the store thread: the core is its). Each logged once."""
        if self.liveness is None:
            return []
        stale = self.liveness.expire(now)
        for key in stale:
            self.core.feed_stale(key)
            log.warning("feed silent: its forwarder's sandboxes are not idled until it reports again", extra={
                "event": "feed_stale",
                "fields": {"forwarder_pin": key, "last_batch_at": self.liveness.silent_since(key)}})
        return stale

    def _rebuild(self) -> None:
        try:
            self.core = load_core(self.store)
        except StoreError:
            # The store cannot be read either: keep the core as it is; the next failure tries again.
            return
        if self.liveness is not None:
            self.core.gate_on_feeds(self.liveness.live())
        self.core_rebuilds += 1


class _Group:
    """Batches applied in one transaction; ``items`` grows on the loop until the store thread starts it
    (``started``, under ``lock``); ``done`` is each one's decision, in order."""

    def __init__(self, items: list[tuple[str, Batch]], keys: list[str | None]) -> None:
        self.items = items
        self.keys = keys  # each batch's forwarder key
        self.lock = threading.Lock()
        self.started = False
        self.ticket = -1  # the store thread's ``submitted`` right after this group's operation
        self.done: asyncio.Future[list[Decision | None]]


def _count(counter: dict[str, int], reason: str) -> None:
    counter[reason] = counter.get(reason, 0) + 1


def make_app(service: FeedService) -> web.Application:
    """The aiohttp application serving ``POST /v1/feed`` for ``service``."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(FEED_PATH, service.handle_feed)
    return app


async def serve(service: FeedService, host: str, port: int, ssl_context: ssl.SSLContext) -> web.AppRunner:
    """Serve the feed on ``host:port`` over TLS; the caller stops it with ``runner.cleanup()``.
    ``ssl_context`` must require and verify client certificates (``certs.loader.server_context``)."""
    if ssl_context.verify_mode is not ssl.CERT_REQUIRED:
        raise ConfigError("the feed's TLS context must require a client certificate")
    runner = web.AppRunner(make_app(service), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
