"""The gateway's ``RouteSource`` on the reference scheduler (docs/scheduler-api.md "Route lookup", "Wake"):
``GET /v1/routes/{sandbox}`` and ``POST /v1/sandboxes/{sandbox}/wake?wait=`` over mutual TLS.

The gateway is identified by its client certificate (a SAN on the scheduler's ``gateway_san_allow``) and
checks the scheduler's certificate against ``ca_file`` and its host name (the URL's). Answers:

- a route: ``pull_route`` checks every field, and the route must be for the sandbox asked about; its
  ``Cache-Control: max-age`` is how long the gateway may serve it (``route_cache.ttl_from_cache_control``:
  an unreadable header caches nothing);
- 404: an unknown sandbox, cached for its max-age as well;
- anything else (another status, a body that does not decode, a time-out, a refused connection, a
  failed handshake): ``RouteLookupFailed``, which the gateway answers 503 with Retry-After; nothing is
  cached, so the next request asks again.

A wake's HTTP time-out is the wait the scheduler was given plus ``timeout_s``, so a long-poll that ends
on time is not cut short.

``use_ssl_context`` (SIGHUP reloaded the gateway's client certificate for the scheduler): lookups and wakes
begun from then on go through a new session with the new context, so no connection kept alive with the old
certificate is used again; those in flight finish on the old session, which is closed once they have.
"""

from __future__ import annotations

import asyncio
import ssl

import aiohttp

from gateway.route_cache import ttl_from_cache_control
from gateway.route_source import Lookup, RouteLookupFailed
from sbxnet.protocol.routes import MAX_BODY, RouteError, pull_route


class SchedulerRoutes:
    def __init__(self, base_url: str, ssl_context: ssl.SSLContext, *, timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._ssl = ssl_context
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._in_flight: dict[int, int] = {}  # calls under way, by id() of the session they use
        self._retired: dict[int, aiohttp.ClientSession] = {}  # replaced sessions that still have calls
        self._closing: set[asyncio.Task[None]] = set()
        self.failures: dict[str, int] = {}  # by reason, for metrics

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=64, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    def use_ssl_context(self, ssl_context: ssl.SSLContext) -> None:
        """Calls begun from now on present the certificate of ``ssl_context``; those in flight keep theirs."""
        self._ssl = ssl_context
        old, self._session = self._session, None
        if old is None:
            return
        if self._in_flight.get(id(old)):
            self._retired[id(old)] = old
        else:
            self._close_later(old)

    def _close_later(self, session: aiohttp.ClientSession) -> None:
        task = asyncio.get_running_loop().create_task(session.close(), name="scheduler-session-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _done(self, session: aiohttp.ClientSession) -> None:
        left = self._in_flight[id(session)] - 1
        if left:
            self._in_flight[id(session)] = left
            return
        del self._in_flight[id(session)]
        retired = self._retired.pop(id(session), None)
        if retired is not None:
            self._close_later(retired)

    async def close(self) -> None:
        sessions = [*self._retired.values(), *([self._session] if self._session is not None else [])]
        self._retired.clear()
        self._session = None
        for session in sessions:
            await session.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _failed(self, reason: str, detail: str) -> RouteLookupFailed:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        return RouteLookupFailed(reason, detail)

    async def _call(self, method: str, path: str, timeout_s: float) -> tuple[int, str | None, bytes]:
        session = self._client()
        self._in_flight[id(session)] = self._in_flight.get(id(session), 0) + 1
        try:
            return await self._request(session, method, path, timeout_s)
        finally:
            self._done(session)

    async def _request(self, session: aiohttp.ClientSession, method: str, path: str,
                       timeout_s: float) -> tuple[int, str | None, bytes]:
        try:
            async with session.request(method, self.base_url + path,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.content.read(MAX_BODY + 1)
                if len(body) > MAX_BODY:
                    raise self._failed("answer_too_large", f"{method} {path}: answer over {MAX_BODY} bytes")
                return resp.status, resp.headers.get("Cache-Control"), body
        except (aiohttp.ClientError, ssl.SSLError, OSError) as e:
            raise self._failed("unreachable", f"{method} {path}: {type(e).__name__}: {e}") from None
        except TimeoutError:
            raise self._failed("timeout", f"{method} {path}: no answer within {timeout_s:g} s") from None

    async def lookup(self, sandbox: str) -> Lookup:
        status, cache_control, body = await self._call("GET", f"/v1/routes/{sandbox}", self.timeout_s)
        ttl = ttl_from_cache_control(cache_control, default=0.0)
        if status == 404:
            return Lookup(None, ttl)
        if status != 200:
            raise self._failed(f"status_{status}", f"route lookup for {sandbox!r}: the scheduler answered {status}")
        try:
            route = pull_route(body)
        except RouteError as e:
            raise self._failed("bad_answer", f"route for {sandbox!r} refused: {e.reason}") from None
        if route.sandbox != sandbox:
            raise self._failed("bad_answer", f"asked for {sandbox!r}, got the route of {route.sandbox!r}")
        return Lookup(route, ttl)

    async def wake(self, sandbox: str, wait: float) -> str:
        """The sandbox's state after the scheduler's long-poll: ``active``, ``waking`` (its wait ran out),
        ``unknown`` (404) or ``failed`` (the driver could not start it)."""
        status, _, _ = await self._call("POST", f"/v1/sandboxes/{sandbox}/wake?wait={wait:g}",
                                        wait + self.timeout_s)
        if status == 200:
            return "active"
        if status == 202:
            return "waking"
        if status == 404:
            return "unknown"
        if status == 502:
            return "failed"
        raise self._failed(f"status_{status}", f"wake of {sandbox!r}: the scheduler answered {status}")
