"""The warm pool: handshaken mutual-TLS links to forwarders, kept ready so that a new client connection
does not wait for a TCP connect and a TLS handshake to the sandbox's host.

A pooled link has been connected, handshaken and its forwarder's key checked against the pin, and
nothing else: no preamble has been sent, so it can carry any sandbox on that host. Links are kept per
forwarder (address and pin) for forwarders that were asked for within ``keep`` seconds, ``size`` of
each, and ``max_total`` in all. A link is retired after ``max_idle`` seconds unused (set it below the
forwarders' ``preamble_idle_timeout``, 30 s by default, or they cut it first), and dropped when the
forwarder ended or reset it meanwhile (``TlsStream.usable_idle``, asked before each use and on each
tick).

``take`` never waits: it hands out a pooled link or None (the caller connects as it would without a
pool), and each take, hit or miss, marks the forwarder as wanted and tops its links up in the
background. A taken link that turns out dead at the preamble is the caller's to retry on a fresh
connection (``upstream.open_upstream``): nothing of the client's was sent on it.

``use_context`` (SIGHUP reloaded the gateway's client certificate) drains the pool: every ready link was
handshaken with the old certificate, so each is retired (an orderly end) and a link a refill had in flight
is dropped when it comes; the pool fills again with the new certificate, so no link made with the old one
is handed out after a reload. A link already taken keeps its certificate for its life.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import ssl
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from certs.loader import PinMismatch, check_pin
from sbxnet.backoff import BACKOFF_CAP_S, BACKOFF_INITIAL_S, SYN_INTERVAL_S
from sbxnet.connect import connect_with_retry
from sbxnet.protocol.routes import Forwarder
from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

CONNECT_DEADLINE = 1.0  # one refill connect; a forwarder that does not answer is tried again next tick
TICK = 1.0


@dataclass(frozen=True)
class PoolKey:
    host: str
    port: int
    pins: tuple[str, ...]  # the route's pins: a pooled link's key is one of them

    @classmethod
    def of(cls, fwd: Forwarder) -> PoolKey:
        return cls(fwd.host, fwd.port, fwd.spki_pins)


@dataclass
class _Ready:
    stream: TlsStream
    since: float  # loop time it joined the pool


class WarmPool:
    """Ready links per forwarder. One per event loop; ``start`` it, ``close`` it at shutdown."""

    def __init__(
        self,
        context: ssl.SSLContext,
        *,
        size: int,
        max_idle: float,
        keep: float = 60.0,
        max_total: int = 1024,
        handshake_timeout: float = 5.0,
        takes: Counter | None = None,
        links: Gauge | None = None,
    ) -> None:
        self.context = context
        self.size = size
        self.max_idle = max_idle
        self.keep = keep
        self.max_total = max_total
        self.handshake_timeout = handshake_timeout
        self._takes = takes
        self._links = links
        self._ready: dict[PoolKey, deque[_Ready]] = {}
        self._wanted: dict[PoolKey, float] = {}  # loop time each forwarder was last asked for
        self._filling: dict[PoolKey, asyncio.Task[None]] = {}
        self._opening = 0  # refill connects in flight, counted against max_total
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False
        self._generation = 0  # bumped by use_context: a link opened under an older one is not kept
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def total(self) -> int:
        return sum(len(q) for q in self._ready.values())

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever(), name="warm-pool")

    def take(self, fwd: Forwarder) -> TlsStream | None:
        """A ready link to ``fwd``, or None. Marks ``fwd`` wanted and tops its links up in the background."""
        if self._closed:
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        key = PoolKey.of(fwd)
        self._wanted[key] = now
        q = self._ready.get(key)
        result, stream = "miss", None
        while q:
            ready = q.popleft()
            if now - ready.since <= self.max_idle and ready.stream.usable_idle():
                result, stream = "hit", ready.stream
                break
            result = "stale"
            ready.stream.abort()
        self._count(result)
        self._set_gauge()
        self._top_up(key)
        return stream

    def use_context(self, context: ssl.SSLContext) -> None:
        """Handshake new links with ``context`` from now on (a reloaded client certificate): the ready links,
        made with the old one, are retired in the background and the forwarders still wanted are topped up
        afresh; a refill in flight drops the link it is opening."""
        self.context = context
        self._generation += 1
        old = [r.stream for q in self._ready.values() for r in q]
        for q in self._ready.values():
            q.clear()
        self._set_gauge()
        if old:
            task = asyncio.get_running_loop().create_task(self._retire_all(old), name="warm-pool-retire")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        for key in list(self._wanted):
            self._top_up(key)

    async def close(self) -> None:
        """Stop filling and close every pooled link (close_notify, then the socket)."""
        self._closed = True
        tasks = [t for t in (self._ticker, *self._filling.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        for q in self._ready.values():
            while q:
                await self._retire(q.popleft().stream)
        self._ready.clear()
        self._set_gauge()

    # -- keeping it full -----------------------------------------------------------------------------

    def _top_up(self, key: PoolKey) -> None:
        if self._closed or key in self._filling:
            return
        if len(self._ready.get(key, ())) >= self.size:
            return
        task = asyncio.get_running_loop().create_task(self._fill(key), name="warm-pool-fill")
        self._filling[key] = task

        def done(_: asyncio.Task[None]) -> None:
            self._filling.pop(key, None)

        task.add_done_callback(done)

    async def _fill(self, key: PoolKey) -> None:
        loop = asyncio.get_running_loop()
        q = self._ready.setdefault(key, deque())
        while len(q) < self.size and self.total + self._opening < self.max_total:
            self._opening += 1
            generation = self._generation
            try:
                stream = await self._open(key, self.context)
            except Exception:  # a bug here must not end the pool's filling for good, nor pass unseen
                log.exception("warm pool fill failed", extra={"event": "internal"})
                return
            finally:
                self._opening -= 1
            if stream is None:
                return  # the next tick tries again
            if self._closed:
                stream.abort()
                return
            if generation != self._generation:  # handshaken with the certificate a reload replaced
                stream.abort()
                continue
            q.append(_Ready(stream, loop.time()))
            self._set_gauge()

    async def _open(self, key: PoolKey, context: ssl.SSLContext) -> TlsStream | None:
        connected = await connect_with_retry(
            ipaddress.ip_address(key.host), key.port, deadline_s=CONNECT_DEADLINE, syn_interval=SYN_INTERVAL_S,
            backoff_initial=BACKOFF_INITIAL_S, backoff_cap=BACKOFF_CAP_S)
        if connected.sock is None:
            log.debug("warm pool connect failed", extra={"event": "pool_connect_failed",
                                                         "fields": {"forwarder": f"{key.host}:{key.port}",
                                                                    "reason": connected.last_error}})
            return None
        try:
            stream = await TlsStream.connect(connected.sock, context, server_hostname=None,
                                             timeout=self.handshake_timeout)
        except (ssl.SSLError, OSError, TimeoutError):
            return None
        try:
            check_pin(stream.ssl_object, key.pins)
        except PinMismatch:
            stream.abort()
            log.warning("warm pool: forwarder key does not match its pin", extra={
                "event": "pool_pin_mismatch", "fields": {"forwarder": f"{key.host}:{key.port}"}})
            return None
        return stream

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self._tick()
            except Exception:  # as in _fill: keep ticking, and say so
                log.exception("warm pool tick failed", extra={"event": "internal"})

    async def _tick(self) -> None:
        """Retire links past ``max_idle`` and dead ones, forget forwarders not wanted for ``keep``, and
        top up the rest."""
        now = asyncio.get_running_loop().time()
        for q in list(self._ready.values()):
            gone = []
            for _ in range(len(q)):
                r = q.popleft()
                if now - r.since <= self.max_idle and r.stream.usable_idle():
                    q.append(r)
                else:
                    gone.append(r)
            for r in gone:
                await self._retire(r.stream)
        for key, when in list(self._wanted.items()):
            if now - when > self.keep:
                del self._wanted[key]
                for r in self._ready.pop(key, ()):
                    await self._retire(r.stream)
            else:
                self._top_up(key)
        self._set_gauge()

    @classmethod
    async def _retire_all(cls, streams: list[TlsStream]) -> None:
        await asyncio.gather(*(cls._retire(s) for s in streams))

    @staticmethod
    async def _retire(stream: TlsStream) -> None:
        """An orderly end (close_notify, FIN): the forwarder counts it as ``unused``, quietly."""
        try:
            async with asyncio.timeout(1.0):
                await stream.write_eof()
        except (OSError, TimeoutError, ssl.SSLError):
            pass
        stream.close()

    def _count(self, result: str) -> None:
        if self._takes is not None:
            self._takes.labels(result).inc()

    def _set_gauge(self) -> None:
        if self._links is not None:
            self._links.set(self.total)
