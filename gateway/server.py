"""The gateway's listener: accept (a slot taken first), client TLS, then per connection raw TCP or HTTP.

After the handshake the connection's server name decides: a name whose port is a ``tcp`` route is
forwarded raw (``routing.decide_connection``), everything else is served as HTTP/2 (``http2.py``) when
the client's ALPN chose h2, otherwise as HTTP/1.1 (``http1.py``), where each request is routed on its
own. Routes come from a ``RouteSource`` through a short cache (positive and negative, TTLs from the
source); a sandbox that is not active is woken once however many requests wait (``route_source.Waker``).
Limits: ``max_connections`` (taken before accept, so at the limit the kernel's backlog holds new clients)
and ``max_connections_per_sandbox``.

Raw TCP routes (``relay.relay``) have auth ``public`` or ``client_cert``. With a ``client_ca_file`` the
ClientHello's server name is read before the handshake (``tls_front.hello_server_name``, on bytes peeked,
not taken, off the socket), and a connection for a ``client_cert`` route is made from a context that
requires a client certificate chaining to that CA: a missing or unverifiable certificate fails the
handshake, so nothing goes upstream. Without a client CA such a route is closed right after the
handshake, also before anything goes upstream. Half-close and reset follow one rule at both TLS ends, the
forwarder's (docs/forwarder.md): close_notify ends one direction (passed on as close_notify then FIN, as
FIN to the sandbox); a TCP FIN without close_notify, a reset, a TLS error, or ``tcp_idle_timeout`` without
a byte resets both sides, so a truncated stream never looks complete.

Drain (``drain``, on SIGTERM): the listener closes at once, then each session is told
(``H1Session.drain``, ``H2Session.drain``): an idle HTTP/1.1 keep-alive connection is closed in order at
once, one with a request in flight answers it with ``Connection: close`` and closes; an HTTP/2 connection
gets GOAWAY (NO_ERROR, the last stream it had taken), finishes those streams, refuses later ones and closes.
Upgraded connections (WebSocket) and raw TCP routes are not told: their bytes are not read here, so nothing
can be said to them in band (docs/gateway.md says why no WebSocket close frame is injected); they run on.
``drain`` returns as soon as the last connection is gone, or at its timeout, when every connection still
open is cut (reset at both ends) and counted (``sbxnet_gateway_drain_cut_total{kind}``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.auth import AuthConfig
from gateway.http1 import H1Session
from gateway.http2 import H2Session
from gateway.names import NameRefused, Names
from gateway.relay import relay
from gateway.route_cache import RouteCache
from gateway.route_source import Lookups, RouteLookupFailed, RouteSource, Waker, WakeRefused
from gateway.routing import Forward, RawForward, decide_connection
from gateway.tls_front import NEED_MORE, FrontTls, HelloName, hello_server_name
from gateway.upstream import Upstream, UpstreamFailed, UpstreamPolicy, open_upstream
from gateway.upstream_pool import WarmPool
from sbxnet.accept import Acceptor
from sbxnet.protocol.preamble import Preamble
from sbxnet.protocol.routes import Route
from sbxnet.tls_stream import TlsStream

log = logging.getLogger("sbxnet.gateway")

HELLO_PEEK = 65536  # bytes of ClientHello looked at; a longer one is read by the handshake as unreadable
HELLO_POLL = 0.002  # peeked bytes keep the socket readable: wait this long for the rest of a split hello


@dataclass
class _Live:
    """What a client connection is, for a drain: its kind so far, and its session once it has one."""

    kind: str = "handshake"
    session: H1Session | H2Session | None = None

    @property
    def now(self) -> str:
        return self.session.kind if self.session is not None else self.kind


@dataclass
class GatewayConfig:
    names: Names
    front: FrontTls
    routes: RouteSource
    upstream: UpstreamPolicy
    auth: AuthConfig = field(default_factory=AuthConfig)
    handshake_timeout: float = 10.0
    header_timeout: float = 10.0
    idle_timeout: float = 75.0  # an idle HTTP keep-alive connection
    websocket_idle_timeout: float = 3600.0
    tcp_idle_timeout: float = 3600.0
    max_header_bytes: int = 16384
    max_connections: int = 10000
    max_connections_per_sandbox: int = 1000
    wake_wait: float = 10.0
    route_stale_s: float = 60.0  # the scheduler unreachable: the last route it gave, served for this long
    max_waiting_per_sandbox: int = 256
    pool_size: int = 0  # ready links kept per forwarder (gateway/upstream_pool.py); 0: no warm pool
    pool_idle: float = 20.0  # a pooled link unused this long is retired
    pool_max: int = 1024  # pooled links in all


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("sbxnet_gateway_requests", "Requests by route kind and status", ["kind", "status"],
                                registry=r)
        self.refusals = Counter("sbxnet_gateway_refusals", "Requests or connections refused, by reason", ["reason"],
                                registry=r)
        # With workers, the supervisor serves the sum over the live ones (counters and histograms sum anyway).
        self.connections = Gauge("sbxnet_gateway_open_connections", "Client connections open", registry=r,
                                 multiprocess_mode="livesum")
        self.handshake_failures = Counter("sbxnet_gateway_handshake_failures", "Client TLS handshakes failed",
                                          registry=r)
        self.upstream_attempts = Counter("sbxnet_gateway_upstream_attempts", "TCP attempts to forwarders",
                                         registry=r)
        self.upstream_retries = Counter("sbxnet_gateway_upstream_retries", "Link attempts retried, by why",
                                        ["reason"], registry=r)
        self.upstream_seconds = Histogram("sbxnet_gateway_upstream_seconds", "Time to the forwarder's OK",
                                          registry=r)
        self.first_byte = Histogram("sbxnet_gateway_first_byte_seconds", "Request sent to response head", registry=r)
        self.wakes = Counter("sbxnet_gateway_wakes", "Wakes sent to the scheduler", registry=r)
        self.rechecks = Counter("sbxnet_gateway_route_rechecks",
                                "Routes looked up afresh after a failed connect", registry=r)
        self.cache = Counter("sbxnet_gateway_route_cache", "Route lookups by result", ["result"], registry=r)
        self.route_lookups = Counter("sbxnet_gateway_route_lookups",
                                     "Route lookups sent to the route source (one per sandbox in flight)",
                                     registry=r)
        self.pool_takes = Counter("sbxnet_gateway_pool_takes", "Warm pool takes by result (hit, miss, stale)",
                                  ["result"], registry=r)
        self.pool_links = Gauge("sbxnet_gateway_pool_links", "Ready links in the warm pool", registry=r,
                                multiprocess_mode="livesum")
        self.drain_cut = Counter("sbxnet_gateway_drain_cut", "Connections still open at a drain's timeout, cut, "
                                 "by kind (handshake, http/1.1, h2, upgrade, tcp)", ["kind"], registry=r)
        # Children of the per-request counters, made on first use (so a series appears when first counted,
        # as with .labels) and then reused: .labels() validates and builds its key on every call.
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._cache_children: dict[str, Counter] = {}

    def count_request(self, kind: str, status: int) -> None:
        """``requests{kind, status}`` += 1, for an HTTP status (an int, so the children stay bounded)."""
        child = self._request_children.get((kind, status))
        if child is None:
            child = self._request_children[(kind, status)] = self.requests.labels(kind, str(status))
        child.inc()

    def count_cache(self, result: str) -> None:
        """``route_cache{result}`` += 1 (hit, negative_hit, miss, stale)."""
        child = self._cache_children.get(result)
        if child is None:
            child = self._cache_children[result] = self.cache.labels(result)
        child.inc()


class GatewayServer:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.cache: RouteCache[Route] = RouteCache(max_stale=config.route_stale_s)
        self.lookups = Lookups(config.routes, on_call=self.metrics.route_lookups.inc)
        self.waker = Waker(config.routes, max_waiting=config.max_waiting_per_sandbox, wait=config.wake_wait,
                           stamp=self.lookups.ticket)
        self._acceptor = Acceptor(self._serve, max_connections=config.max_connections, log=log, name="gateway-accept")
        self._per_sandbox: dict[str, int] = {}
        self._draining = False
        self._sessions: set[H1Session | H2Session] = set()  # HTTP sessions running, told when a drain starts
        self.pool: WarmPool | None = None
        if config.pool_size > 0:
            self.pool = WarmPool(config.upstream.context, size=config.pool_size, max_idle=config.pool_idle,
                                 max_total=config.pool_max, handshake_timeout=config.upstream.handshake_timeout,
                                 takes=self.metrics.pool_takes, links=self.metrics.pool_links)

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._acceptor.port

    @property
    def ready(self) -> bool:
        return self._acceptor.listener is not None and not self._draining

    @property
    def open_connections(self) -> int:
        return self._acceptor.open_connections

    @property
    def draining(self) -> bool:
        return self._draining

    async def start(self, listener: socket.socket) -> None:
        if self.pool is not None:
            self.pool.start()
        self._acceptor.start(listener)

    async def drain(self, timeout: float = 10.0) -> int:
        """Stop accepting; close idle HTTP connections in order and tell the others (``Connection: close``,
        GOAWAY) to finish what is in flight and close; return as soon as every connection is gone, or at
        ``timeout``, when the rest (upgrades and raw TCP among them) are cut and counted. How many were cut."""
        self._draining = True
        await self._acceptor.stop_accepting()
        for session in list(self._sessions):
            session.drain()
        if self.pool is not None:
            await self.pool.close()  # requests still in flight connect afresh
        return await self._acceptor.drain(timeout)

    # -- one connection ----------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        conn_id = secrets.token_hex(8)
        live = _Live()
        self.metrics.connections.inc()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.handshake_timeout
            try:
                ctx = self.config.front.context
                if self.config.front.verifies_client_certs:
                    async with asyncio.timeout_at(deadline):
                        ctx = await self._handshake_context(sock)
            except (OSError, TimeoutError):
                sock.close()
                self.metrics.handshake_failures.inc()
                return
            except BaseException:
                sock.close()
                raise
            try:
                client = await TlsStream.accept(sock, ctx, timeout=max(0.001, deadline - loop.time()))
            except (ssl.SSLError, OSError, TimeoutError):
                self.metrics.handshake_failures.inc()
                return
            try:
                await self._dispatch(client, peer, conn_id, live)
            except asyncio.CancelledError:
                client.abort()  # a drain's cut: reset, so the client cannot take what it got for the whole
                raise
            finally:
                client.close()
        except asyncio.CancelledError:
            if self._draining:
                self.metrics.drain_cut.labels(live.now).inc()
                log.info("cut at the drain's timeout", extra={"event": "drain_cut", "conn_id": conn_id,
                                                               "fields": {"kind": live.now}})
            raise
        except Exception:
            log.exception("internal error", extra={"event": "internal", "conn_id": conn_id})
        finally:
            self.metrics.connections.dec()

    async def _handshake_context(self, sock: socket.socket) -> ssl.SSLContext:
        """The context to make this connection from: the client-certificate one when its ClientHello names
        a raw route whose auth is ``client_cert``, the listening one otherwise (HTTP, public raw routes, a
        hello without SNI or one OpenSSL cannot read, which the handshake then refuses)."""
        front = self.config.front
        hello = await _peek_hello(sock)
        if not isinstance(hello, HelloName):
            return front.context
        try:
            name = self.config.names.parse_sni(hello.server_name)
        except NameRefused:
            return front.context
        if name is None:
            return front.context
        try:
            route = await self.route(name.sandbox)
        except RouteLookupFailed:
            return front.context  # the dispatch looks again and answers for it
        decision = decide_connection(name, route)
        if isinstance(decision, RawForward) and decision.require_client_cert:
            return front.client_cert_context(hello.server_name)
        return front.context

    async def _dispatch(self, client: TlsStream, peer: tuple[str, int], conn_id: str, live: _Live) -> None:
        names = self.config.names
        sni = self.config.front.server_name(client.ssl_object)
        bad_sni = False
        conn_name = None
        try:
            conn_name = names.parse_sni(sni)
        except NameRefused:
            bad_sni = True
        if conn_name is not None and client.ssl_object.selected_alpn_protocol() is None:
            try:
                route = await self.route(conn_name.sandbox)
            except RouteLookupFailed:
                # Without the route it cannot be told whether this is a raw route; a client that offered
                # no ALPN gets the raw answer to a failure: a close.
                self.metrics.refusals.labels("route_lookup_failed").inc()
                log.warning("route lookup failed; closed", extra={
                    "event": "route_lookup_failed", "conn_id": conn_id, "sandbox_id": conn_name.sandbox})
                client.abort()
                return
            decision = decide_connection(conn_name, route)
            if isinstance(decision, RawForward):
                live.kind = "tcp"
                await self._raw(client, decision, peer, conn_id)
                return
        session: H1Session | H2Session
        if client.ssl_object.selected_alpn_protocol() == "h2":
            session = H2Session(self, client, peer, conn_name, bad_sni, conn_id)
        else:
            session = H1Session(self, client, peer, conn_name, bad_sni, conn_id)
        live.session = session
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)

    async def _raw(self, client: TlsStream, d: RawForward, peer: tuple[str, int], conn_id: str) -> None:
        if d.require_client_cert and not self.config.front.client_cert_verified(client.ssl_object):
            # The handshake asked for no certificate: no client CA is configured, or the route became
            # client_cert between the ClientHello and now. Closed before anything goes upstream.
            reason = "client_cert_required" if self.config.front.verifies_client_certs else "client_cert_unconfigured"
            self.metrics.refusals.labels(reason).inc()
            log.warning("raw route needs a client certificate; closed", extra={
                "event": "tcp_refused", "reason": reason, "conn_id": conn_id, "sandbox_id": d.sandbox})
            client.abort()
            return
        route = d.route
        if route.state != "active":
            woken = await self.wake(d.sandbox)
            if woken is None:
                self.metrics.refusals.labels("wake_pending").inc()
                client.abort()
                return
            route = woken
        if not self.take_sandbox_slot(d.sandbox):
            self.metrics.refusals.labels("sandbox_connection_limit").inc()
            client.abort()
            return
        try:
            fwd = Forward(route, d.sandbox, d.port, "http", "public")
            try:
                up = await self.open_upstream(fwd, peer, conn_id)
            except UpstreamFailed as e:
                self.invalidate(d.sandbox)
                self.metrics.refusals.labels(e.reason).inc()
                client.abort()
                return
            started = time.monotonic()
            ended, sent, received = await relay(client, up.stream, idle=self.config.tcp_idle_timeout,
                                                leftover=up.leftover)
            self.metrics.requests.labels("tcp", ended).inc()
            log.info("raw connection ended", extra={
                "event": "tcp_ended", "reason": ended, "conn_id": conn_id, "sandbox_id": d.sandbox,
                "fields": {"port": d.port, "bytes_up": sent, "bytes_down": received,
                           "seconds": round(time.monotonic() - started, 3)}})
        finally:
            self.release_sandbox_slot(d.sandbox)

    # -- what sessions call ------------------------------------------------------------------------

    async def route(self, sandbox: str, *, started_after: int = -1) -> Route | None:
        """The route from the cache, or looked up (one lookup per sandbox in flight; ``started_after``: a
        ``Lookups.ticket`` the lookup must be newer than), or the last route known while the scheduler
        cannot be reached; ``RouteLookupFailed`` otherwise."""
        loop = asyncio.get_running_loop()
        hit = self.cache.get(sandbox, loop.time())
        if hit is not None:
            self.metrics.count_cache("hit" if hit.route is not None else "negative_hit")
            return hit.route
        self.metrics.count_cache("miss")
        try:
            found = await self.lookups.lookup(sandbox, started_after=started_after)
        except RouteLookupFailed as e:
            stale = self.cache.stale(sandbox, loop.time())
            if stale is None:
                raise
            # The scheduler cannot be asked (down, restarting): the last route it gave, for a bounded time.
            self.metrics.count_cache("stale")
            if stale.first:
                log.warning("route service unreachable: serving the last route it gave", extra={
                    "event": "route_stale", "sandbox_id": sandbox, "reason": e.reason,
                    "fields": {"age_s": round(stale.age, 3), "route_stale_s": self.config.route_stale_s}})
            return stale.route
        if found.route is None:
            self.cache.put_unknown(sandbox, found.ttl, loop.time())
        else:
            self.cache.put_found(sandbox, found.route, found.ttl, loop.time())
        return found.route

    def invalidate(self, sandbox: str) -> None:
        self.cache.invalidate(sandbox)

    async def wake(self, sandbox: str) -> Route | None:
        """Wake ``sandbox`` (coalesced) and return its fresh route once active, or None."""
        calls = self.waker.calls
        try:
            state, ticket = await self.waker.wake_stamped(sandbox)
        except WakeRefused:
            return None
        finally:
            self.metrics.wakes.inc(self.waker.calls - calls)
        if state != "active":
            return None
        self.invalidate(sandbox)
        # A lookup begun while the wake ran may answer "waking": the route comes from one begun after
        # the wake was answered (the waiters share it).
        route = await self.route(sandbox, started_after=ticket)
        return route if route is not None and route.state == "active" else None

    async def open_upstream(self, fwd: Forward, peer: tuple[str, int], conn_id: str) -> Upstream:
        p = Preamble(
            src=ipaddress.ip_address(peer[0]),
            src_port=peer[1],
            dst=fwd.route.target_ip,
            dst_port=fwd.port,
            sandbox_id=fwd.sandbox,
            connection_id=conn_id.encode(),
        )
        try:
            up = await open_upstream(fwd.route, fwd.port, p, self.config.upstream, pool=self.pool,
                                     recheck=lambda: self._recheck(fwd.sandbox, fwd.route))
        except UpstreamFailed as e:
            self.metrics.upstream_attempts.inc(e.attempts)
            raise
        self.metrics.upstream_attempts.inc(up.attempts)
        self.metrics.upstream_seconds.observe(up.elapsed)
        for why in up.failures:
            self.metrics.upstream_retries.labels(why).inc()
        # One line per link: which client connection (conn_id) reached which sandbox, for tracing with
        # the forwarder's log (its gateway_conn_id) and for telling coalesced HTTP/2 requests apart.
        log.info("link open", extra={"event": "link_open", "conn_id": conn_id, "sandbox_id": fwd.sandbox,
                                     "fields": {"port": fwd.port, "attempts": up.attempts, "pooled": up.pooled,
                                                "seconds": round(up.elapsed, 4)}})
        return up

    async def _recheck(self, sandbox: str, current: Route) -> Route | None:
        """After a failed connect: the route afresh (the cached one may say active for a sandbox stopped
        since, or name a host it left), woken if it is not active. ``current`` when nothing changed or the
        scheduler cannot be asked (the retries go on as they were); None when the sandbox is gone."""
        self.metrics.rechecks.inc()
        self.invalidate(sandbox)
        try:
            route = await self.route(sandbox)
            if route is None:
                return None
            if route.state != "active":
                # Not woken in time (or too many waiting): go on with what we have until the deadline.
                route = await self.wake(sandbox) or current
        except RouteLookupFailed:
            return current
        return current if route == current else route

    def take_sandbox_slot(self, sandbox: str) -> bool:
        n = self._per_sandbox.get(sandbox, 0)
        if n >= self.config.max_connections_per_sandbox:
            return False
        self._per_sandbox[sandbox] = n + 1
        return True

    def release_sandbox_slot(self, sandbox: str) -> None:
        n = self._per_sandbox.get(sandbox, 0) - 1
        if n > 0:
            self._per_sandbox[sandbox] = n
        else:
            self._per_sandbox.pop(sandbox, None)


async def _peek_hello(sock: socket.socket) -> HelloName | str:
    """Read the server name of the ClientHello waiting on ``sock`` without taking any byte off it (the
    handshake reads them again). The caller bounds the wait; OSError if the peer resets."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = sock.recv(HELLO_PEEK, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
            continue
        if not data:
            return "eof"
        result = hello_server_name(data)
        if result != NEED_MORE or len(data) >= HELLO_PEEK:
            return result
        await asyncio.sleep(HELLO_POLL)


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())
