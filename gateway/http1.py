"""One HTTP/1.1 client connection: every request routed, authenticated and proxied on its own.

``h1_codec`` (httptools, llhttp in C, underneath) parses both sides (the client's requests, the sandbox
app's responses) and writes both; nothing here parses HTTP. What it refuses (request smuggling's tricks:
Content-Length with Transfer-Encoding, a duplicate Content-Length, obs-fold, control bytes, any
Transfer-Encoding but chunked; a head over ``max_header_bytes``: 431) is answered with its status and
reason token and the connection closed, before anything goes upstream.

Per request: the head within ``header_timeout``; the target's form (``request_rules.upstream_target``:
400; the app gets origin-form only) and ``routing.request_target`` (400, 421) and the route
(``routing.decide_http``: 404), a wake if the sandbox is not active (503 with Retry-After if it does not
come up), ``auth.authorize`` (401, 403, or the ``?token=`` redirect), then the link to the sandbox's
forwarder (``upstream.open_upstream``; 502/503/504 from it). Only then does a request byte go upstream,
so no request is ever sent twice. A client that leaves while its request waits for the route, a wake or
the link ends the exchange at once with nothing sent upstream (``_unless_client_leaves``: the client is
read only once that wait is real, so the keep-alive fast path costs no task). The request body and the
response stream both ways at once, never buffered whole. Keep-alive and pipelining (the codec queues
pipelined requests), WebSocket and other upgrades (after a 101 the bytes pass through both ways by the raw
routes' rule, ``relay.relay``: close_notify ends one direction and is passed on, a TCP FIN without
close_notify, a reset or a TLS error resets both sides, ``websocket_idle_timeout`` without a byte too).
Once a response byte has gone to the client nothing is retried or synthesised: a failure then closes the
connection.

How connections end. The link to the sandbox is kept between requests to the same sandbox port; once no
exchange is under way on it (no request sent since the last whole exchange, or the app's close after a
whole response) it is closed in order (close_notify then FIN, ``relay.close_cleanly``: the app reads an
end of stream), and it is aborted (the forwarder passes a reset on to the app) only when a request or
response was cut. A link whose app sent bytes nobody asked for after a response (``H1Client.unfit``) is
not reused. The client
connection is closed in order too when the gateway ends it by choice: ``idle_timeout``, a drain, an exchange
after which HTTP/1.1 says close (``Connection: close``, HTTP/1.0). On a drain (``drain``) a connection waiting
for its next request is closed at once; one with a request in flight gets ``Connection: close`` on its
response (when its head has not gone yet) and is closed after it; one that has not sent its first request
yet is given that request within ``header_timeout`` and closed after it. An upgraded connection is not told
(``relay.relay`` moves its bytes without reading them): it runs on until the drain's cut.

Every request gets one access-log line when it ends (``RequestLog``, shared with the HTTP/2 front), the
gateway's own answers (400, 401, 403, 404, 421, 431, 503...) included: the client connection's
``conn_id``, the sandbox and port it asked for, the method, the authority (the routed host name and the
port the client named, never the client's text), the status, body bytes each way, the duration and, for
a refusal, its reason token. No target, query, header or cookie is logged, so no token in any form is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gateway import h1_codec as h1
from gateway.auth import Allow, Deny, Redirect, authorize
from gateway.names import Name, NameRefused, Names
from gateway.relay import close_cleanly, drop_link, relay
from gateway.request_rules import RequestRefused, upstream_target
from gateway.route_source import RouteLookupFailed
from gateway.routing import Answer, Forward, decide_http, request_target, requested_port
from gateway.upstream import Upstream, UpstreamFailed
from sbxnet.errors import LocalProtocolError, RemoteProtocolError
from sbxnet.tls_stream import ReadInterrupted, TlsStream

log = logging.getLogger("sbxnet.gateway")

HOP_BY_HOP = h1.HOP_BY_HOP
# RFC 9110 9.2.2. Such a request without a body may be sent again on a fresh link when a kept one fails
# before any answer (the app closed it just as the request went out: RFC 9112 9.3.1).
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})


def replayable(method: bytes, headers: Any) -> bool:
    """An idempotent request with no body: nothing of it is lost if it is sent again."""
    if method not in IDEMPOTENT:
        return False
    for n, v in headers:
        if n.lower() == b"transfer-encoding" or (n.lower() == b"content-length" and v.strip() != b"0"):
            return False
    return True


@dataclass(frozen=True)
class Refusal:
    """An answer the gateway gives a request itself (nothing went upstream)."""

    status: int
    message: str
    headers: list[tuple[bytes, bytes]]
    reason: str  # a metrics token; "" for none
    close: bool = False  # HTTP/1.1: close the connection after it (a request whose authority is malformed)


@dataclass(frozen=True)
class Admitted:
    fwd: Forward  # the route, fresh after a wake
    allow: Allow  # the target and headers to send upstream
    host: str  # the Host to send upstream


@dataclass
class RequestLog:
    """One request's access-log line (event ``request``), filled in as it is served and written once by
    ``emit``. Only values the gateway made or validated go in: the method (a token, bounded), the routed
    authority, numbers and reason tokens."""

    proto: str  # "http/1.1" or "h2"
    conn_id: str
    started: float  # time.monotonic() when the request head was whole
    method: str = ""
    authority: str | None = None  # host_of(the name asked for), ":port" when the client named one
    sandbox: str | None = None
    port: int | None = None  # the sandbox's port it was routed to
    status: int = 0  # 0: nothing was answered (the client left, or the stream was reset first)
    reason: str = ""  # the refusal's reason token, or how an exchange broke
    bytes_down: int = 0  # response body bytes sent to the client
    bytes_up: int = 0  # request body bytes sent to the sandbox
    _done: bool = False

    def set_method(self, method: bytes) -> None:
        self.method = method[:32].decode("ascii", "replace")

    def emit(self) -> None:
        if self._done:
            return
        self._done = True
        if not log.isEnabledFor(logging.INFO):
            return  # the line would be dropped: do not build it (every request pays this)
        fields: dict[str, object] = {"proto": self.proto, "method": self.method or None, "authority": self.authority,
                                     "port": self.port, "status": self.status, "bytes": self.bytes_down,
                                     "bytes_up": self.bytes_up,
                                     "duration": round(time.monotonic() - self.started, 6)}
        log.info("request", extra={"event": "request", "conn_id": self.conn_id, "sandbox_id": self.sandbox,
                                   "reason": self.reason or None, "fields": fields})


def _asked_for(names: Names, target: bytes, hosts: list[bytes], authority: bytes | None, http2: bool,
               http10: bool) -> Name | None:
    """The name a request asked for, for its log line only (None when none parses)."""
    try:
        return names.request_name(target, hosts, authority=authority, http2=http2, http10=http10)
    except NameRefused:
        return None


def _log_name(rec: RequestLog, names: Names, name: Name, port: int | None) -> None:
    try:
        host = names.host_of(name)
    except LocalProtocolError:
        return
    rec.authority = host if port is None else f"{host}:{port}"
    rec.sandbox = name.sandbox


# The scheduler could not be asked (down, timed out, a bad answer): nothing is cached, the client retries.
def _no_route_service() -> Refusal:
    return Refusal(503, "the route service is unavailable: try again shortly", [(b"retry-after", b"1")],
                   "route_lookup_failed")


async def admit(gw: Any, conn_name: Name | None, client_ip: str, *, method: bytes, target: bytes,
                hosts: list[bytes], headers: list[tuple[bytes, bytes]], authority: bytes | None = None,
                http2: bool = False, http10: bool = False, upgrade: bool = False, cert_names: tuple[str, ...] = (),
                rec: RequestLog | None = None) -> Admitted | Refusal:
    """One request's decision, shared by the HTTP/1.1 and HTTP/2 fronts: the target's form
    (``request_rules.upstream_target``: 400, before anything else; ``Admitted.allow.target`` is origin-form),
    ``routing.request_target`` (400, 421; ``cert_names``, the SANs the connection's certificate has, let an
    HTTP/2 request for another name it covers through, and hold a connection without SNI to the names they
    cover), the route of the request's own name (``decide_http``: 404), a wake if not active (503),
    ``auth.authorize`` against that route (401, 403, the ``?token=`` redirect, or for an ``upgrade``
    request the ``?token=`` taken as its credential). ``rec`` is told the name asked for (authority,
    sandbox) and the port routed to."""
    cfg = gw.config
    rec = rec if rec is not None else RequestLog("", "", 0.0)
    try:
        origin = upstream_target(method, target, scheme=cfg.names.scheme, http2=http2)
    except RequestRefused as e:
        return Refusal(400, f"bad request target ({e.reason})", [], e.reason, close=True)
    t = request_target(cfg.names, conn_name, target=target, hosts=hosts, authority=authority, http2=http2,
                       http10=http10, cert_names=cert_names)
    port = requested_port(cfg.names, target=target, hosts=hosts, authority=authority, http2=http2)
    if isinstance(t, Answer):
        if t.status == 421:  # a valid name, for another connection: say which in the log
            asked = _asked_for(cfg.names, target, hosts, authority, http2, http10)
            if asked is not None:
                _log_name(rec, cfg.names, asked, port)
        return Refusal(t.status, t.message, [], t.reason, close=t.status == 400)
    name = t
    _log_name(rec, cfg.names, name, port)
    try:
        route = await gw.route(name.sandbox)
    except RouteLookupFailed:
        return _no_route_service()
    decision = decide_http(name, route)
    if isinstance(decision, Answer):
        return Refusal(decision.status, decision.message, [], decision.reason)
    fwd = decision
    rec.port = fwd.port
    if fwd.route.state != "active":
        try:
            woken = await gw.wake(name.sandbox)
        except RouteLookupFailed:
            return _no_route_service()
        if woken is None:
            return Refusal(503, "the sandbox is starting: try again shortly", [(b"retry-after", b"1")],
                           "wake_pending")
        fwd = Forward(woken, fwd.sandbox, fwd.port, fwd.protocol, fwd.auth)
    host = cfg.names.host_of(name)
    verdict = authorize(cfg.auth, auth=fwd.auth, token_sha256=fwd.route.token_sha256, target=origin,
                        headers=headers, client_ip=client_ip, host=host, port=port, upgrade=upgrade)
    if isinstance(verdict, Deny):
        return Refusal(verdict.status, verdict.message, list(verdict.headers), verdict.reason)
    if isinstance(verdict, Redirect):
        return Refusal(verdict.status, "authenticated: continue at the location given", list(verdict.headers), "")
    if fwd.protocol == "h2c" and not http2:
        # Not translated (yet): an HTTP/1.1 request would reach an app that only speaks HTTP/2 and fail there.
        return Refusal(505, "this port speaks HTTP/2 only (h2c, e.g. gRPC): connect with HTTP/2", [],
                       "h2c_needs_http2")
    return Admitted(fwd, verdict, host)


class _ClientGone(Exception):
    pass


_T = TypeVar("_T")

# What the client sends while its request waits for admission or a link, read ahead into the codec (so its
# end is seen) per request; past it the client is left to TCP's flow control and watched no more.
READ_AHEAD = 65536


class _OnFirstWait(Generic[_T]):
    """``await _OnFirstWait(coro, on_wait)`` is ``await coro`` in the awaiting task (what ``coro`` yields
    goes to the task as it is, what the task sends or throws goes back), and calls ``on_wait`` once, the
    first time ``coro`` waits: a coroutine that returns without waiting (a cached route, a kept link)
    costs no more than the call."""

    __slots__ = ("coro", "on_wait")

    def __init__(self, coro: Coroutine[Any, Any, _T], on_wait: Callable[[], None]) -> None:
        self.coro = coro
        self.on_wait: Callable[[], None] | None = on_wait

    def __await__(self) -> Generator[Any, Any, _T]:
        coro = self.coro
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                waits_on = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as e:
                return e.value
            if self.on_wait is not None:
                on_wait, self.on_wait = self.on_wait, None
                on_wait()
            try:
                value, error = (yield waits_on), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # the task's cancellation, as ``await`` passes it on
                value, error = None, e


def _client_cut(task: asyncio.Task[None]) -> BaseException | None:
    """How the client's side broke a request body's pump (its framing refused, or the client gone), or None."""
    if not task.done() or task.cancelled():
        return None
    e = task.exception()
    return e if isinstance(e, (h1.H1Error, _ClientGone)) else None


def _upgrade(req: h1.Request) -> bool:
    """``Connection: upgrade`` with an ``Upgrade`` header: the link is asked to switch too."""
    tokens = {t.strip().lower() for n, v in req.headers if n == b"connection" for t in v.split(b",")}
    return b"upgrade" in tokens and any(n == b"upgrade" for n, _ in req.headers)


class _KeptLinkFailed(Exception):
    """A kept link failed before any answer to a replayable request: send it again on a fresh link."""


@dataclass
class _Up:
    key: tuple[str, int]
    upstream: Upstream
    conn: h1.H1Client
    reused: bool = False  # kept from an earlier exchange (not opened for this one)


class H1Session:
    """Serve one client connection; ``run`` returns when it is closed."""

    def __init__(self, gw: Any, client: TlsStream, peer: tuple[str, int], conn_name: Name | None,
                 bad_sni: bool, conn_id: str) -> None:
        self.gw = gw  # gateway.server.GatewayServer: config, routes, metrics
        self.client = client
        self.peer = peer
        self.conn_name = conn_name
        self.bad_sni = bad_sni
        self.conn_id = conn_id
        # The names this connection's certificate covers: without SNI, the names its requests may ask for.
        self.cert_names = gw.config.front.presented_names(client.ssl_object)
        self.h = h1.H1Server(gw.config.max_header_bytes)
        self.up: _Up | None = None
        self._requests = 0
        self._rec = RequestLog("http/1.1", conn_id, time.monotonic())  # the request being served
        self.kind = "http/1.1"  # "upgrade" once its bytes are piped (what a drain's cut counts it as)
        self._drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # set by ``drain``
        if gw.draining:
            self._drained.set_result(None)
        self._idle_end = False  # the wait for a next request ended by idle_timeout or a drain, not the client
        # The wait for a next request: one timer per connection (``_idle_check``), not one per request, and
        # the read woken by TlsStream.interrupt_read when the deadline passes or the gateway drains.
        self._idle_waiting = False
        self._idle_deadline = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[bool]] = set()  # links being closed in order
        # The client watched while a request waits for admission or its link (``_unless_client_leaves``).
        self._setting_up = False
        self._client_left = False
        self._watch: asyncio.Task[None] | None = None
        self._read_ahead = 0  # bytes read ahead for the request being served

    def drain(self) -> None:
        """The gateway drains: a connection waiting for its next request is closed now; a response not yet
        begun says ``Connection: close``; after the exchange in flight the connection is closed."""
        if not self._drained.done():
            self._drained.set_result(None)
        self._end_idle_wait()

    # -- reading the client ------------------------------------------------------------------------

    async def _client_event(self) -> Any:
        while True:
            ev = self.h.next_event()
            if ev is not h1.NEED_DATA:
                return ev
            try:
                data = await self.client.read()
            except OSError:
                raise _ClientGone() from None
            self.h.receive_data(data)

    async def _next_request(self) -> h1.Request | None:
        """The next request head, or None when the client closed or stayed idle too long. The first head
        must be whole within header_timeout of the handshake; a later one may wait idle_timeout for its
        first byte, then has header_timeout for the rest (so a slow drip is cut, an idle keep-alive is not)."""
        cfg = self.gw.config
        if self._requests and not self.h.has_pending:  # no pipelined bytes already received
            data = await self._idle_read(cfg.idle_timeout)
            if data is None:
                return None
            self.h.receive_data(data)
        ev = self.h.next_event()
        if ev is h1.NEED_DATA:  # a head not whole yet (a timer only then: usually the first read had it all)
            async with asyncio.timeout(cfg.header_timeout):
                ev = await self._client_event()
        return ev if isinstance(ev, h1.Request) else None

    async def _idle_read(self, timeout: float) -> bytes | None:
        """The first bytes of a next request; None when ``timeout`` passed or the gateway drains first (what
        the client sends after that is dropped by the orderly close). Bytes that came just as the wait
        ended are a request to serve (with ``Connection: close`` if the gateway drains)."""
        if self._drained.done():
            self._idle_end = True
            return None
        loop = asyncio.get_running_loop()
        self._idle_deadline = loop.time() + timeout
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(self._idle_deadline, self._idle_check)
        self._idle_waiting = True
        try:
            return await self.client.read()
        except ReadInterrupted:
            self._idle_end = True
            return None
        except OSError:
            raise _ClientGone() from None
        finally:
            self._idle_waiting = False

    def _idle_check(self) -> None:
        """The idle timer: it ends a wait past its deadline, and follows a deadline that moved on (a later
        request's wait); while an exchange is under way it is not kept (the next wait sets it again)."""
        self._idle_timer = None
        if not self._idle_waiting:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._idle_deadline:
            self._idle_timer = loop.call_at(self._idle_deadline, self._idle_check)
        else:
            self._end_idle_wait()

    def _end_idle_wait(self) -> None:
        """End the wait for a next request, if one is under way. A read that cannot be woken just now (it is
        taking bytes that came, or answering a TLS message) is tried again shortly, unless it returns first."""
        if not self._idle_waiting or self.client.interrupt_read():
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = asyncio.get_running_loop().call_later(0.01, self._end_idle_wait_later)

    def _end_idle_wait_later(self) -> None:
        self._idle_timer = None
        self._end_idle_wait()

    # -- a client gone while its request waits ------------------------------------------------------

    async def _unless_client_leaves(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """``await coro`` (a request's admission, its link's set-up), ended at once if the client leaves
        meanwhile: a reset, a TLS error, an end of stream (close_notify or a bare FIN) raises ``_ClientGone``,
        ``coro`` cancelled (a link being opened is aborted; a wake or a lookup others share goes on), the
        request logged ``client_gone`` and the client reset; nothing of it went upstream. The client is
        read only once ``coro`` waits (``_OnFirstWait``: a cached route and a kept link never do), what it
        sends meanwhile kept for the request (its body, a pipelined request), ``READ_AHEAD`` at most."""
        self._setting_up, self._client_left = True, False
        try:
            return await _OnFirstWait(coro, self._watch_client)
        except asyncio.CancelledError:
            # The watch cancels this task only while it waits in ``coro`` (as asyncio.timeout does): a
            # cancellation of its own (a drain's cut) goes on.
            owner = asyncio.current_task()
            if self._client_left and owner is not None and owner.uncancel() == 0:
                self._rec.reason = "client_gone"
                self.client.abort()
                raise _ClientGone() from None
            raise
        finally:
            self._setting_up = False
            watch, self._watch = self._watch, None
            # Nobody else reads the client before the watch has ended: woken with nothing taken, or (when it
            # cannot be woken just now) once it has taken the bytes that came and sees it is over.
            while watch is not None and not watch.done():
                self.client.interrupt_read()
                await asyncio.wait((watch,), timeout=0.01)

    def _watch_client(self) -> None:
        """``coro`` waits (called in its task): watch the client from now on."""
        owner = asyncio.current_task()
        if self._watch is None and self._read_ahead < READ_AHEAD and owner is not None:
            self._watch = asyncio.create_task(self._watch_reads(owner))

    async def _watch_reads(self, owner: asyncio.Task[Any]) -> None:
        """Read the client while ``_unless_client_leaves`` waits: bytes go to the codec; its end cancels
        ``owner``'s wait."""
        while self._setting_up and self._read_ahead < READ_AHEAD:
            try:
                data = await self.client.read(READ_AHEAD - self._read_ahead)
            except ReadInterrupted:
                return
            except OSError:
                data = b""
            if not data:
                if self._setting_up:
                    self._client_left = True
                    owner.cancel()
                return  # else the end stays for the next read (the stream keeps it)
            self._read_ahead += len(data)
            self.h.receive_data(data)

    # -- answering ourselves -----------------------------------------------------------------------

    async def answer(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                     *, close: bool = False, reason: str = "") -> None:
        body = (message + "\n").encode()
        hdrs = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                *(headers or [])]
        if close or self._drained.done():
            hdrs.append((b"connection", b"close"))
        self.gw.metrics.count_request("http", status)
        if reason:
            self.gw.metrics.refusals.labels(reason).inc()
        self._rec.status, self._rec.reason = status, reason
        await self.client.write(self.h.send_response(status, hdrs) + self.h.send_data(body) + self.h.send_eom())
        self._rec.bytes_down += len(body)

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        orderly = False  # the gateway ends the connection by choice: close_notify, FIN (``close_cleanly``)
        cut = False  # cancelled (a drain's cut): everything is reset at once
        try:
            while True:
                try:
                    req = await self._next_request()
                except TimeoutError:
                    self.gw.metrics.refusals.labels("header_timeout").inc()
                    return
                except h1.H1Error as e:
                    status = 431 if e.http_status == 431 else 400
                    self._rec = RequestLog("http/1.1", self.conn_id, time.monotonic())
                    self._rec.set_method(e.method)
                    try:
                        await self.answer(status, "bad request" if status == 400 else "request header too large",
                                          close=True, reason=e.reason)
                    finally:
                        self._rec.emit()
                    return
                if req is None:
                    orderly = self._idle_end  # else the client closed
                    return
                self._requests += 1
                self._rec = RequestLog("http/1.1", self.conn_id, time.monotonic())
                self._rec.set_method(req.method)
                try:
                    keep = await self._one(req)
                except asyncio.CancelledError:
                    self._rec.reason = self._rec.reason or ("drain_cut" if self.gw.draining else "cancelled")
                    raise
                finally:
                    self._rec.emit()
                if not keep:
                    return
                if self.h.must_close or self._drained.done():
                    orderly = True  # the exchange is whole, and HTTP/1.1 (or the drain) says close
                    return
                try:
                    self.h.start_next_cycle()
                except LocalProtocolError:
                    return
        except _ClientGone:
            return
        except asyncio.CancelledError:
            cut = True
            raise
        finally:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            up, self.up = self.up, None
            if cut:
                if up is not None:
                    up.upstream.stream.abort()
                for task in self._closing:
                    task.cancel()
                self.client.abort()
            else:
                await self._end(up, orderly)

    async def _end(self, up: _Up | None, orderly: bool) -> None:
        """The connection's end: the link closed in order when no exchange is under way on it (aborted
        otherwise), the client in order when the gateway chose to end it (closed, not reset, otherwise)."""
        closes: list[Awaitable[bool]] = []
        if up is not None:
            if up.conn.idle:
                closes.append(close_cleanly(up.upstream.stream))
            else:
                up.upstream.stream.abort()
        if orderly:
            closes.append(close_cleanly(self.client))
        closes.extend(self._closing)
        if closes:
            await asyncio.gather(*closes, return_exceptions=True)

    def _close_link_later(self, stream: TlsStream) -> None:
        """Close a link whose exchanges are all complete, in order, without holding up the client."""
        task = asyncio.create_task(close_cleanly(stream))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _one(self, req: h1.Request) -> bool:
        """Handle one request; False when the connection must close."""
        if self.bad_sni:
            await self.answer(421, "this connection's server name is not served here", reason="misdirected")
            return await self._drain_body()
        hosts = [v for n, v in req.headers if n == b"host"]
        # Hop-by-hop headers go first (with whatever Connection names): what admit and auth pass on is
        # end to end, and the gateway's own (X-Forwarded-*, Host) are set after, so none can be named away.
        self._read_ahead = 0
        d = await self._unless_client_leaves(admit(
            self.gw, self.conn_name, self.peer[0], method=req.method, target=req.target, hosts=hosts,
            headers=h1.end_to_end(req.headers, keep_upgrade=_upgrade(req)), http10=req.http_version == b"1.0",
            upgrade=req.upgrade, cert_names=self.cert_names, rec=self._rec))
        if isinstance(d, Refusal):
            await self.answer(d.status, d.message, d.headers, close=d.close, reason=d.reason)
            return not d.close and await self._drain_body()
        refused = self.h.refusal_ahead()
        if refused is not None:
            # The body's framing broke in what came already: nothing of the request goes upstream.
            await self._refuse(refused)
            return False
        return await self._proxy(req, d.fwd, d.allow, d.host)

    async def _refuse(self, e: h1.H1Error) -> None:
        """A refused request answered (400, 431), the connection closed after it."""
        status = 431 if e.http_status == 431 else 400
        await self.answer(status, "bad request" if status == 400 else "request header too large", close=True,
                          reason=e.reason)

    async def _drain_body(self) -> bool:
        """Read and drop the body of a request we answered ourselves, so the connection can go on."""
        try:
            async with asyncio.timeout(self.gw.config.header_timeout):
                while True:
                    ev = await self._client_event()
                    if isinstance(ev, h1.EndOfMessage):
                        return True
                    if isinstance(ev, h1.ConnectionClosed):
                        return False
        except (TimeoutError, RemoteProtocolError):
            return False

    # -- proxying ----------------------------------------------------------------------------------

    def _upstream_head(self, req: h1.Request, allow: Allow, host: str, conn: h1.H1Client) -> bytes:
        """The request head for the link (``conn``'s body framing follows from its headers). ``allow.target``
        is origin-form or ``*`` already (``admit``: ``request_rules.upstream_target``)."""
        upgrade = _upgrade(req)
        # allow.headers are end to end already (``_one``), and end with the gateway's own.
        headers = [(b"host", host.encode()), *((n, v) for n, v in allow.headers if n.lower() != b"host")]
        if upgrade:
            headers.append((b"connection", b"upgrade"))
        return conn.send_request(req.method, allow.target, headers)

    async def _link(self, fwd: Forward) -> _Up:
        key = (fwd.sandbox, fwd.port)
        if self.up is not None and self.up.key == key and self.up.conn.idle:
            if self.up.upstream.stream.usable_idle():
                self.up.reused = True
                return self.up
            # The app closed its idle keep-alive connection meanwhile (on its own clock: Node.js after
            # 5 s), or sent something unasked: that link cannot carry this request, a fresh one will.
            drop_link(self.up.upstream.stream, self._close_link_later)
            self.up = None
        if self.up is not None:
            # Another sandbox port now: the old link's exchanges are complete (a cut one was dropped already).
            self._close_link_later(self.up.upstream.stream)
            self.up = None
        upstream = await self.gw.open_upstream(fwd, self.peer, self.conn_id)
        self.up = _Up(key, upstream, h1.H1Client())
        if upstream.leftover:
            self.up.conn.receive_data(upstream.leftover)
        return self.up

    async def _proxy(self, req: h1.Request, fwd: Forward, allow: Allow, host: str) -> bool:
        try:
            up = await self._unless_client_leaves(self._link(fwd))
        except UpstreamFailed as e:
            self.gw.invalidate(fwd.sandbox)
            extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
            await self.answer(e.http_status, e.detail, extra, reason=e.reason)
            return await self._drain_body()
        refused = self.h.refusal_ahead()
        if refused is not None:
            # The body's framing broke in what came while the link was set up: nothing goes upstream.
            await self._refuse(refused)
            return False
        sandbox_slot = self.gw.take_sandbox_slot(fwd.sandbox)
        if not sandbox_slot:
            await self.answer(503, "too many connections to this sandbox", [(b"retry-after", b"1")],
                              reason="sandbox_connection_limit")
            return await self._drain_body()
        try:
            try:
                return await self._exchange(req, fwd, allow, host, up)
            except _KeptLinkFailed:
                self.gw.metrics.upstream_retries.labels("kept_link_closed").inc()
            try:
                up = await self._unless_client_leaves(self._link(fwd))  # a fresh one: the failed link is gone
            except UpstreamFailed as e:
                self.gw.invalidate(fwd.sandbox)
                extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
                await self.answer(e.http_status, e.detail, extra, reason=e.reason)
                return True
            return await self._exchange(req, fwd, allow, host, up)
        finally:
            self.gw.release_sandbox_slot(fwd.sandbox)

    async def _exchange(self, req: h1.Request, fwd: Forward, allow: Allow, host: str, up: _Up) -> bool:
        stream = up.upstream.stream
        # The head and as much of the body as came with it (all of a GET, a small POST, its end) go up in
        # one write: one TLS record and one send, and no task to pump a body that is here already.
        first = [self._upstream_head(req, allow, host, up.conn)]
        self._body_here(up, first)
        started = time.monotonic()
        body_task: asyncio.Task[None] | None = None
        responded = False
        status = 0
        # What goes to the client next: what one read of the link gave (a head, body bytes, the end) is
        # written at once when the codec has no more events from it, not event by event (a small response
        # was a head and a body: two TLS records and two sends). Bounded by one read.
        out: list[bytes] = []
        try:
            # The link may break under the head's write as under any read of it (the app reset it just
            # after the forwarder's OK): one rule for both, below.
            await stream.write(b"".join(first))
            if not self.h.request_done:
                body_task = asyncio.create_task(self._pump_request_body(up))
                body_task.add_done_callback(lambda task: self._body_ended(task, stream))
            while True:
                ev = up.conn.next_event()
                if ev is h1.NEED_DATA:
                    if out:
                        await self.client.write(b"".join(out))
                        out.clear()
                    data = await stream.read()
                    up.conn.receive_data(data)
                    continue
                if isinstance(ev, h1.InformationalResponse):
                    out.append(self.h.send_informational(ev.status_code, self._response_headers(ev.headers),
                                                         ev.reason))
                    responded = True
                    if ev.status_code == 101:
                        await self.client.write(b"".join(out))
                        out.clear()
                        self.h.switched()
                        self._rec.status = 101
                        self.gw.metrics.count_request("upgrade", 101)
                        if body_task is not None:
                            body_task.cancel()
                            with contextlib.suppress(asyncio.CancelledError, Exception):
                                await body_task
                        await self._switch(up)
                        return False
                    continue
                if isinstance(ev, h1.Response):
                    status = ev.status_code
                    hdrs = self._response_headers(ev.headers)
                    if self._drained.done():
                        hdrs.append((b"connection", b"close"))  # the app's own Connection went with the hop
                    out.append(self.h.send_response(status, hdrs, ev.reason,
                                                    body_ends_by_close=up.conn.body_ends_by_close))
                    responded = True
                    self._rec.status = status
                    self.gw.metrics.first_byte.observe(time.monotonic() - started)
                elif isinstance(ev, h1.Data):
                    out.append(self.h.send_data(ev.data))
                    self._rec.bytes_down += len(ev.data)
                elif isinstance(ev, h1.EndOfMessage):
                    out.append(self.h.send_eom(ev.headers))
                    break
                elif isinstance(ev, h1.ConnectionClosed):
                    raise ConnectionResetError("the sandbox closed before its response ended")
            if out:
                await self.client.write(b"".join(out))
                out.clear()
            if body_task is not None:
                await body_task
        except asyncio.CancelledError:
            if body_task is not None:
                body_task.cancel()  # the session resets both ends
            raise
        except (OSError, RemoteProtocolError, LocalProtocolError, _ClientGone) as e:
            if body_task is not None:
                body_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await body_task
                cut = _client_cut(body_task)
                if cut is not None:  # the client's side broke: ``_body_ended`` reset both ends already
                    self.up = None
                    if isinstance(cut, h1.H1Error):
                        self._rec.reason = cut.reason
                        self.gw.metrics.refusals.labels(cut.reason).inc()
                    else:
                        self._rec.reason = "client_gone"
                    return False
            if out and not isinstance(e, _ClientGone):
                # What the link gave before it broke reaches the client as it did event by event.
                with contextlib.suppress(OSError):
                    await self.client.write(b"".join(out))
            stream.abort()
            self.up = None
            if isinstance(e, _ClientGone) or responded:
                self._rec.reason = "client_gone" if isinstance(e, _ClientGone) else "upstream_broken"
                return False
            if up.reused and replayable(req.method, req.headers):
                raise _KeptLinkFailed() from e
            await self.answer(502, "the sandbox's app broke the connection", close=True, reason="upstream_broken")
            return False
        self.gw.metrics.count_request("http", status)
        if up.conn.must_close:
            self._close_link_later(stream)  # the app said close after a whole response: in order
            self.up = None
        else:
            up.conn.start_next_cycle()
        return True

    def _body_ended(self, task: asyncio.Task[None], stream: TlsStream) -> None:
        """The request body's pump ended. If the client's side broke (a framing error after the head, the
        client gone mid-body), the exchange ends now, whatever ``_exchange`` waits for (the app's answer, a
        write to the client): the link is aborted (the app sees a reset, never a whole request) and the
        client reset, so it cannot take a cut exchange for a whole one."""
        if _client_cut(task) is not None:
            stream.abort()
            self.client.abort()

    def _response_headers(self, headers: Any) -> list[tuple[bytes, bytes]]:
        tokens = {t.strip().lower() for n, v in headers if n == b"connection" for t in v.split(b",")}
        upgrading = b"upgrade" in tokens  # a 101: Upgrade and "Connection: upgrade" are the answer itself
        out = []
        for n, v in headers:
            if upgrading and n == b"upgrade":
                out.append((n, v))
                continue
            if n in (b"connection", b"keep-alive", b"proxy-connection", b"trailer") or n in tokens:
                if n == b"connection" and upgrading:
                    out.append((n, b"upgrade"))
                continue
            out.append((n, v))
        return out

    def _body_here(self, up: _Up, out: list[bytes]) -> None:
        """Append to ``out`` the request's body and end as far as the client has sent them already, framed
        for the link (an error, the client's end of stream and what has not come yet are left for
        ``_pump_request_body``)."""
        if self.h.request_done:
            if up.conn.sending_body:
                # A replayed request (``_KeptLinkFailed``): the client's end of it was taken already.
                out.append(up.conn.send_eom())
            return
        while (ev := self.h.ready_body()) is not None:
            if isinstance(ev, h1.Data):
                out.append(up.conn.send_data(ev.data))
                self._rec.bytes_up += len(ev.data)
            else:
                out.append(up.conn.send_eom(ev.headers))

    async def _pump_request_body(self, up: _Up) -> None:
        """The rest of the request's body, as it comes (``_body_here`` sent what came with the head)."""
        while not self.h.request_done:  # a request without a body has its end to take too
            ev = await self._client_event()
            if isinstance(ev, h1.Data):
                await up.upstream.stream.write(up.conn.send_data(ev.data))
                self._rec.bytes_up += len(ev.data)
            elif isinstance(ev, h1.EndOfMessage):
                out = up.conn.send_eom(ev.headers)
                if out:
                    await up.upstream.stream.write(out)
            elif isinstance(ev, h1.ConnectionClosed):
                raise _ClientGone()
            else:
                return

    async def _switch(self, up: _Up) -> None:
        """After 101: bytes both ways by the raw routes' rule (``relay.relay``): close_notify ends one
        direction and is passed on; a bare FIN, a reset or a TLS error resets both sides."""
        client_rest = self.h.trailing_data
        up_rest = up.conn.trailing_data
        stream = up.upstream.stream
        self.up = None
        self.kind = "upgrade"
        if client_rest:
            try:
                await stream.write(client_rest)
            except OSError:
                stream.abort()
                self.client.abort()
                self._rec.reason = "reset"
                return
            self._rec.bytes_up += len(client_rest)
        ended, sent, received = await relay(self.client, stream, idle=self.gw.config.websocket_idle_timeout,
                                            leftover=up_rest)
        self._rec.bytes_up += sent
        self._rec.bytes_down += received
        if ended != "closed":
            self._rec.reason = ended  # truncated, reset or idle: both sides were reset
