"""The gateway's side of the link: reach the sandbox's forwarder and get its OK, riding out cold starts.

One attempt: TCP to the forwarder (``sbxnet.connect``: a fresh SYN every 50 ms while unanswered, the
5 ms → 50 ms backoff while refused), mutual TLS 1.3 with the forwarder's key pinned from the route (not
just its CA), the preamble, the status (``sbxnet.protocol.link.GatewaySequence``). A refused or
unanswered connect, a failed handshake, and a NOT_LISTENING or UNAVAILABLE status are tried again with
the same backoff, jittered, until the route's deadline; FORBIDDEN, BAD_PREAMBLE, INTERNAL or a malformed
status are not (another attempt would be refused the same way). Nor is a pin mismatch: the forwarder at
that address has another key than the route says, which no retry changes; the route is looked up once
more (it may name the sandbox's new host, or the host's next key) and, if it still names that key, the
answer is 502 with no further handshake.

Nothing from the client is sent before OK, so a retry never repeats a request. The caller gets the
open streams and any tenant bytes that arrived with the status, or ``UpstreamFailed`` carrying the
HTTP answer to synthesise (502, 503 with Retry-After, 504) and a reason to count.

Failed attempts are aborted (closed at once; the forwarder sees a reset): a graceful TLS close would
wait on a forwarder that has no reason to answer, and a transport left to the garbage collector held the
forwarder's preamble slot until its timeout (the pin-mismatch test caught that).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from certs.loader import PinMismatch, check_pin
from sbxnet.backoff import BACKOFF_CAP_S, BACKOFF_INITIAL_S, SYN_INTERVAL_S, backoff_delays
from sbxnet.connect import connect_with_retry
from sbxnet.errors import SbxnetError
from sbxnet.protocol.link import GatewaySequence
from sbxnet.protocol.preamble import Preamble
from sbxnet.protocol.routes import Route
from sbxnet.protocol.status import Status, StatusError
from sbxnet.tls_stream import TlsStream

if TYPE_CHECKING:
    from gateway.upstream_pool import WarmPool

_NO_RETRY = {
    Status.FORBIDDEN: "forwarder_forbidden",
    Status.BAD_PREAMBLE: "forwarder_bad_preamble",
    Status.INTERNAL: "forwarder_internal",
}


@dataclass(frozen=True)
class UpstreamPolicy:
    context: ssl.SSLContext  # certs.loader.client_context: the gateway's client certificate, the CA
    syn_interval: float = SYN_INTERVAL_S
    backoff_initial: float = BACKOFF_INITIAL_S
    backoff_cap: float = BACKOFF_CAP_S
    jitter: float = 0.2  # each wait is drawn from [1 - jitter, 1 + jitter] x the schedule's step
    handshake_timeout: float = 5.0
    status_timeout: float = 5.0  # the forwarder's answer, which includes its own connect to the sandbox


class UpstreamFailed(SbxnetError):
    """No OK before the deadline, or a refusal not worth retrying. ``http_status`` is what to answer."""

    def __init__(self, reason: str, detail: str, *, http_status: int, retry_after: int | None, attempts: int) -> None:
        super().__init__(reason, detail)
        self.http_status = http_status
        self.retry_after = retry_after
        self.attempts = attempts


@dataclass
class Upstream:
    stream: TlsStream  # the link, after the OK: tenant bytes both ways, half-close as half-close
    leftover: bytes  # tenant bytes that came with the status: the first of the response
    attempts: int
    elapsed: float  # from the first SYN to the OK
    failures: list[str] = field(default_factory=list)  # why each earlier attempt failed, in order
    pooled: bool = False  # the link came ready from the warm pool


def jittered(delays: Iterator[float], rng: random.Random, jitter: float) -> Iterator[float]:
    for d in delays:
        yield d * rng.uniform(1 - jitter, 1 + jitter)


class _Retry(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


Recheck = Callable[[], Awaitable[Route | None]]


async def open_upstream(
    route: Route, port: int, preamble: Preamble, policy: UpstreamPolicy, *, rng: random.Random | None = None,
    recheck: Recheck | None = None, pool: WarmPool | None = None,
) -> Upstream:
    """Reach ``route``'s forwarder for ``port`` and get its OK within ``route.connect_deadline_s``.

    ``recheck``: called once, after the first attempt that fails in a way worth retrying. A cached route
    can say ``active`` for a sandbox that has since gone idle and been stopped; the caller looks the route
    up afresh and wakes the sandbox if it must, and returns the route to go on with (None: it is gone).
    A route other than the one given restarts the deadline (the wake took its own time).

    ``pool``: the first attempt takes a ready link from it when there is one, and skips the connect and
    the handshake. If that link fails before the status (the forwarder had closed it), the next attempt
    follows at once on a fresh connection, with no backoff and no recheck: the sandbox did nothing wrong."""
    loop = asyncio.get_running_loop()
    rng = rng or random.Random()
    start = loop.time()
    deadline = start + route.connect_deadline_s
    waits = jittered(backoff_delays(policy.backoff_initial, policy.backoff_cap), rng, policy.jitter)
    failures: list[str] = []
    attempts = 0
    fwd = route.forwarder
    wire = GatewaySequence.for_preamble(preamble, now=start, timeout=policy.status_timeout).start()
    pooled = pool.take(fwd) if pool is not None else None
    if pooled is not None:
        try:
            stream, leftover = await _exchange(pooled, wire, policy, loop.time())
            return Upstream(stream, leftover, 0, loop.time() - start, failures, pooled=True)
        except _Retry as r:
            failures.append(f"pooled_{r.reason}")
        except UpstreamFailed as e:
            e.attempts = attempts
            raise
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _give_up(failures, attempts)
        connected = await connect_with_retry(
            ipaddress.ip_address(fwd.host),
            fwd.port,
            deadline_s=remaining,
            syn_interval=policy.syn_interval,
            backoff_initial=policy.backoff_initial,
            backoff_cap=policy.backoff_cap,
        )
        attempts += connected.attempts
        if connected.sock is None:
            failures.append(f"connect_{connected.last_error}")
            raise _give_up(failures, attempts)
        try:
            stream, leftover = await _attempt(connected.sock, route, wire, policy, loop.time())
        except _Retry as r:
            failures.append(r.reason)
            if recheck is not None:
                check, recheck = recheck, None
                fresh = await check()
                if fresh is None:
                    raise UpstreamFailed("sandbox_gone", "the sandbox is no longer routed", http_status=503,
                                         retry_after=1, attempts=attempts) from None
                if fresh is not route:
                    route, fwd = fresh, fresh.forwarder
                    preamble = replace(preamble, dst=fresh.target_ip)
                    wire = GatewaySequence.for_preamble(preamble, now=loop.time(),
                                                        timeout=policy.status_timeout).start()
                    deadline = loop.time() + fresh.connect_deadline_s
                    continue
            if r.reason == "pin_mismatch":  # not transient: the route, looked up again, names that key still
                raise UpstreamFailed("pin_mismatch", "the sandbox's host has another key than its route names",
                                     http_status=502, retry_after=None, attempts=attempts) from None
            wait = min(next(waits), deadline - loop.time())
            if wait > 0:
                await asyncio.sleep(wait)
            continue
        except UpstreamFailed as e:
            e.attempts = attempts
            raise
        return Upstream(stream, leftover, attempts, loop.time() - start, failures)


async def _attempt(
    sock: socket.socket, route: Route, wire: bytes, policy: UpstreamPolicy, now: float
) -> tuple[TlsStream, bytes]:
    try:
        stream = await TlsStream.connect(sock, policy.context, server_hostname=None, timeout=policy.handshake_timeout)
    except (ssl.SSLError, OSError, TimeoutError) as e:
        _close_raw(sock)
        raise _Retry("handshake_failed") from e
    try:
        check_pin(stream.ssl_object, {route.forwarder.spki_pin})
    except PinMismatch:
        stream.abort()
        raise _Retry("pin_mismatch") from None
    return await _exchange(stream, wire, policy, now)


async def _exchange(stream: TlsStream, wire: bytes, policy: UpstreamPolicy, now: float) -> tuple[TlsStream, bytes]:
    """The preamble and the forwarder's status on a handshaken, pin-checked link."""
    loop = asyncio.get_running_loop()
    try:
        seq = GatewaySequence(wire, now=now, timeout=policy.status_timeout)
        await stream.write(seq.start())
        answer = None
        async with asyncio.timeout_at(seq.deadline):
            while answer is None:
                data = await stream.read()
                if not data:
                    raise _Retry("closed_before_status")
                answer = seq.receive_data(data, loop.time())
    except TimeoutError:
        stream.abort()
        raise UpstreamFailed(
            "status_timeout", "the forwarder did not answer", http_status=504, retry_after=None, attempts=0
        ) from None
    except StatusError as e:
        stream.abort()
        raise UpstreamFailed(e.reason, "malformed status", http_status=502, retry_after=None, attempts=0) from None
    except _Retry:
        stream.abort()
        raise
    except (OSError, ssl.SSLError) as e:
        stream.abort()
        raise _Retry("reset_before_status") from e
    if answer.status is Status.OK:
        return stream, answer.leftover
    stream.abort()
    if answer.status.retryable:
        raise _Retry(answer.status.name.lower())
    reason = _NO_RETRY.get(answer.status, "forwarder_refused")
    raise UpstreamFailed(reason, f"forwarder answered {answer.status.name}", http_status=502, retry_after=None,
                         attempts=0)


def _give_up(failures: list[str], attempts: int) -> UpstreamFailed:
    last = failures[-1] if failures else "deadline"
    if last in ("not_listening", "unavailable"):
        detail = "the sandbox is not listening yet"
    elif last.startswith("connect_"):
        detail = "the sandbox's host does not answer"
    else:
        detail = f"the sandbox's host could not be reached ({last})"
    return UpstreamFailed(last, detail, http_status=503, retry_after=1, attempts=attempts)


def _close_raw(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
