"""The scheduler's HTTP API (docs/scheduler-api.md), on aiohttp: who may call what, the bodies in and out,
and the statuses. Everything it decides is in ``service.SchedulerService``; this module only checks the
caller and the request's shape and turns the answers into responses.

Callers (one TLS listener; the context asks for a client certificate but does not require one, so the
platform can call with a token alone; a certificate that does not chain to the CA fails the handshake):

- the gateway: a verified client certificate with a SAN on ``gateway_allow``: ``GET /v1/routes/{id}``,
  ``POST /v1/sandboxes/{id}/wake``;
- a forwarder: a SAN on the feed's allowlist: ``POST /v1/feed`` (``feed_http.FeedService``);
- the platform or an operator: ``Authorization: Bearer <token>`` whose SHA-256 equals the configured
  one (compared in constant time): the registry, holds, the driver's reports, status and events (and
  wake too, for an operator).

Refusals are one line: 400 with the reason for a bad body or parameter (unknown fields too), 401 without
credentials, 403 with the wrong ones (each 401 and 403 counted and logged, one warning line with the reason,
the caller's address and SANs and what it asked, never the token), 404 for an unknown sandbox, 503 when
the store is unavailable, and 503 with ``Retry-After: 1`` when the store thread has too many operations
waiting (``store_thread.Busy``).
Every store call is awaited on the service's store threads, never made on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from sbxnet.protocol.feed import MAX_BODY_BYTES
from sbxnet.protocol.routes import MAX_BODY, RouteError, check_sandbox_id, pull_registration, push_route
from scheduler.feed_http import FEED_PATH, peer_sans
from scheduler.service import SchedulerService, Unavailable
from scheduler.store import Store, StoredEvent, StoreError
from scheduler.store_thread import Busy
from scheduler.timers import UnknownSandbox

MAX_WAKE_WAIT_S = 30.0
DEFAULT_WAKE_WAIT_S = 10.0
SSE_HEARTBEAT_S = 15.0
DRIVER_EVENTS = ("stopping", "stopped", "ready", "failed")

log = logging.getLogger("sbxnet.scheduler")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj, separators=(",", ":")).encode(),
                        content_type="application/json", headers=headers)


def _error(status: int, message: str, **extra: object) -> web.Response:
    return _json({"error": message, **extra}, status)


class _Refused(Exception):
    def __init__(self, response: web.Response) -> None:
        self.response = response


def _bad(reason: str) -> _Refused:
    return _Refused(_error(400, reason))


async def _body(request: web.Request, fields: dict[str, type | tuple[type, ...]], required: Collection[str]
                ) -> dict[str, Any]:
    raw = await request.read()
    try:
        obj = json.loads(raw) if raw else {}
    except ValueError:
        raise _bad("body is not JSON") from None
    if not isinstance(obj, dict):
        raise _bad("body must be a JSON object")
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r}")
    for name in required:
        if name not in obj:
            raise _bad(f"missing field {name!r}")
    for name, kind in fields.items():
        if name in obj and (not isinstance(obj[name], kind) or isinstance(obj[name], bool)):
            raise _bad(f"field {name!r} has the wrong type")
    return obj


def _events_after(store: Store, after: int) -> list[StoredEvent]:
    return store.events_after(after, 500)


class Api:
    def __init__(
        self,
        service: SchedulerService,
        *,
        admin_token_sha256: str,
        gateway_allow: Collection[str],
        route_cache_s: int = 2,
        negative_cache_s: int = 1,
    ) -> None:
        self.service = service
        self._admin = bytes.fromhex(admin_token_sha256)
        self.gateway_allow = frozenset(gateway_allow)
        self.route_cache_s = route_cache_s
        self.negative_cache_s = negative_cache_s
        self.refused: dict[str, int] = {}  # 401/403 by reason
        self._closing = asyncio.Event()  # set at SIGTERM: event streams end at once

    def set_admin_hash(self, admin_token_sha256: str) -> None:
        """Take a new admin token's SHA-256 (SIGHUP read the token file again); calls from now on need it."""
        self._admin = bytes.fromhex(admin_token_sha256)

    def close_streams(self) -> None:
        """End every event stream now (the process is stopping): each handler returns, so the server's
        shutdown does not wait out its timeout for streams that never end by themselves."""
        self._closing.set()

    # -- who is calling -------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def _refuse(self, request: web.Request, reason: str, status: int, sans: list[str] | None) -> None:
        """Count a refused caller and log it, one line: who (address, certificate SANs), what it asked, why;
        never the token."""
        self._count(reason)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        hint = {
            "wrong_token": "the bearer token's SHA-256 is not admin_token_sha256 (a token file is read without its "
                           "trailing newline: `sbxnet certs token --hash FILE` prints the hash to configure)",
            "no_credentials": "no bearer token" + (" and no certificate" if sans is None else ""),
            "san_not_allowed": "the client certificate's SANs are not on gateway_san_allow",
        }[reason]
        log.warning(f"refused {request.method} {request.path}: {hint}", extra={
            "event": "refused", "reason": reason, "peer": f"{peer[0]}:{peer[1]}" if peer else None,
            "fields": {"status": status, "method": request.method, "path": request.path, "sans": sans}})

    def _is_admin(self, request: web.Request) -> bool | None:
        """True: the admin token; False: a wrong one; None: no bearer token at all."""
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._admin)

    @staticmethod
    def _peer_sans(request: web.Request) -> list[str] | None:
        """The verified client certificate's SANs; None without a certificate."""
        ssl_obj = request.transport.get_extra_info("ssl_object") if request.transport else None
        cert = ssl_obj.getpeercert() if ssl_obj is not None else None
        return peer_sans(cert) if cert else None

    def _require(self, request: web.Request, *, gateway: bool) -> None:
        sans = self._peer_sans(request)
        if gateway and sans is not None and any(s in self.gateway_allow for s in sans):
            return
        admin = self._is_admin(request)
        if admin:
            return
        if admin is None and sans is not None and gateway:
            self._refuse(request, "san_not_allowed", 403, sans)
            raise _Refused(web.Response(status=403, text="this certificate is not a gateway's\n"))
        if admin is None:
            self._refuse(request, "no_credentials", 401, sans)
            raise _Refused(web.Response(status=401, text="authentication required: a bearer token"
                                        + (" or a gateway certificate" if gateway else "") + "\n",
                                        headers={"WWW-Authenticate": "Bearer"}))
        self._refuse(request, "wrong_token", 403, sans)
        raise _Refused(web.Response(status=403, text="wrong token\n"))

    @staticmethod
    def _sandbox(request: web.Request) -> str:
        sid = request.match_info["sandbox"]
        try:
            return check_sandbox_id(sid)
        except RouteError as e:
            raise _bad(f"bad sandbox id: {e.detail or e.reason}") from None

    # -- the gateway's calls --------------------------------------------------------------------

    async def get_route(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=True)
        sandbox = self._sandbox(request)
        route = await self.service.lookup(sandbox)
        if route is None:
            return _json({"error": "unknown sandbox"}, 404,
                         {"Cache-Control": f"max-age={self.negative_cache_s}"})
        return web.Response(body=push_route(route), content_type="application/json",
                            headers={"Cache-Control": f"max-age={self.route_cache_s}"})

    async def wake(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=True)
        sandbox = self._sandbox(request)
        raw = request.query.get("wait", str(DEFAULT_WAKE_WAIT_S))
        try:
            wait = float(raw)
        except ValueError:
            raise _bad("wait: a number of seconds") from None
        if not (math.isfinite(wait) and 0 <= wait <= MAX_WAKE_WAIT_S):
            raise _bad(f"wait: 0..{MAX_WAKE_WAIT_S:g} seconds")
        answer = await self.service.wake(sandbox, wait)
        if answer.failed:
            return _error(502, "the driver could not start the sandbox", state=answer.state.value)
        if answer.state.value == "active":
            return _json({"state": "active"})
        return _json({"state": answer.state.value}, 202, {"Retry-After": "1"})

    # -- the platform's calls -------------------------------------------------------------------

    async def put_sandbox(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        sandbox = self._sandbox(request)
        body = await request.read()
        if len(body) > MAX_BODY:
            raise _Refused(_error(413, f"registration over {MAX_BODY} bytes"))
        try:
            registration = pull_registration(body)
        except RouteError as e:
            raise _bad(f"{e.reason}: {e.detail}" if e.detail else e.reason) from None
        created, state = await self.service.call(self.service.register, sandbox, registration)
        return _json({"sandbox": sandbox, "incarnation": registration.incarnation, "state": state.value},
                     201 if created else 200)

    async def delete_sandbox(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        sandbox = self._sandbox(request)
        if not await self.service.call(self.service.remove, sandbox):
            return _error(404, "unknown sandbox")
        return _json({"sandbox": sandbox, "removed": True})

    async def list_sandboxes(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        return _json({"sandboxes": [s.to_json() for s in await self.service.status_now()]})

    async def get_sandbox(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        sandbox = self._sandbox(request)
        return _json((await self.service.status_of_now(sandbox)).to_json())

    async def hold(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        sandbox = self._sandbox(request)
        obj = await _body(request, {"ttl_s": (int, float), "reason": str}, ["ttl_s"])
        ttl = float(obj["ttl_s"])
        if not (math.isfinite(ttl) and 0 < ttl <= 86400 * 30):
            raise _bad("ttl_s: more than 0 and at most 30 days")
        return _json({"hold_until": await self.service.call(self.service.hold, sandbox, ttl)})

    async def driver(self, request: web.Request) -> web.StreamResponse:
        self._require(request, gateway=False)
        sandbox = self._sandbox(request)
        obj = await _body(request, {"event": str}, ["event"])
        if obj["event"] not in DRIVER_EVENTS:
            raise _bad(f"event: one of {', '.join(DRIVER_EVENTS)}")
        state, proceed = await self.service.call(self.service.driver_report, sandbox, obj["event"])
        out: dict[str, object] = {"state": state.value}
        if proceed is not None:
            out["proceed"] = proceed
        return _json(out)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events from the store's log: ``id`` is the event's id, so a client that reconnects
        with ``Last-Event-ID`` (or ``?after=``) misses nothing. Without one the stream starts at the log's
        beginning. It ends when the process stops (``close_streams``), at once."""
        self._require(request, gateway=False)
        raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
        try:
            after = int(raw)
        except ValueError:
            raise _bad("Last-Event-ID / after: an event id") from None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, after)
        except (ConnectionResetError, ClientConnectionResetError):
            pass  # the operator went away
        return resp

    async def _stream_events(self, resp: web.StreamResponse, after: int) -> None:
        loop = asyncio.get_running_loop()
        beat = loop.time() + SSE_HEARTBEAT_S
        while not self._closing.is_set():
            news = self.service.new_events()
            try:
                batch = await self.service.read(_events_after, after, bounded=False)
            except StoreError:
                batch = []
            for stored in batch:
                data = json.dumps({"id": stored.id, **stored.event.to_json()}, separators=(",", ":"))
                await resp.write(f"id: {stored.id}\nevent: state\ndata: {data}\n\n".encode())
                after = stored.id
            if batch:
                continue
            if loop.time() >= beat:
                await resp.write(b": keep-alive\n\n")
                beat = loop.time() + SSE_HEARTBEAT_S
            # Local news wakes it at once; events another replica wrote arrive on the next poll; a stop
            # ends it at once.
            waits = [asyncio.ensure_future(news.wait()), asyncio.ensure_future(self._closing.wait())]
            try:
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)

    # -- the application ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except _Refused as r:
            return r.response
        except UnknownSandbox:
            return _error(404, "unknown sandbox")
        except Unavailable as e:
            return _error(503, f"store unavailable: {e.detail}")
        except Busy:
            self._count("busy")
            return _json({"error": "busy: try again"}, 503, {"Retry-After": "1"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=max(MAX_BODY_BYTES, MAX_BODY), middlewares=[self._errors])
        r = app.router
        r.add_post(FEED_PATH, self.service.feed.handle_feed)
        r.add_get("/v1/routes/{sandbox}", self.get_route)
        r.add_post("/v1/sandboxes/{sandbox}/wake", self.wake)
        r.add_put("/v1/sandboxes/{sandbox}", self.put_sandbox)
        r.add_delete("/v1/sandboxes/{sandbox}", self.delete_sandbox)
        r.add_get("/v1/sandboxes", self.list_sandboxes)
        r.add_get("/v1/sandboxes/{sandbox}", self.get_sandbox)
        r.add_post("/v1/sandboxes/{sandbox}/hold", self.hold)
        r.add_post("/v1/sandboxes/{sandbox}/driver", self.driver)
        r.add_get("/v1/events", self.events)
        return app
