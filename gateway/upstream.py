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
import math
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
from sbxnet.protocol.preamble import DEADLINE_MAX_MS, Preamble
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
    # The forwarder is told how long we still wait (the preamble's deadline) and answers NOT_LISTENING as
    # its connect gives up then: its status may come this long after the deadline.
    status_grace: float = 1.0


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


@dataclass
class _Target:
    """What the attempts aim at: the route, the preamble for it, and the deadline they share."""

    route: Route
    preamble: Preamble
    deadline: float  # loop time


async def open_upstream(
    route: Route, port: int, preamble: Preamble, policy: UpstreamPolicy, *, rng: random.Random | None = None,
    recheck: Recheck | None = None, pool: WarmPool | None = None,
) -> Upstream:
    """Reach ``route``'s forwarder for ``port`` and get its OK within ``route.connect_deadline_s``.

    One deadline for both ends: each preamble carries what is left of it (the deadline TLV), so the
    forwarder's own connect to the sandbox gives up by then and its NOT_LISTENING comes while we still
    wait; the wait for a status ends ``policy.status_grace`` after the deadline. Past the deadline the
    answer is 503 with Retry-After (504 only if the forwarder sent no status at all by then).

    ``recheck``: the route looked up afresh, and woken if it must be (None: the sandbox is gone). Called
    after the first attempt that fails in a way worth retrying (a cached route can say ``active`` for a
    sandbox that has since gone idle and been stopped), and once more before answering a failure (the
    sandbox may have moved to another host meanwhile); a pin mismatch calls it once and, if the route
    still names that key, is answered 502 with no further handshake. A route other than the one given
    restarts the deadline (the wake or the move took its own time).

    ``pool``: the first attempt takes a ready link from it when there is one, and skips the connect and
    the handshake. If that link fails before the status (the forwarder had closed it), the next attempt
    follows at once on a fresh connection, with no backoff and no recheck: the sandbox did nothing wrong."""
    loop = asyncio.get_running_loop()
    rng = rng or random.Random()
    start = loop.time()
    t = _Target(route, preamble, start + route.connect_deadline_s)
    waits = jittered(backoff_delays(policy.backoff_initial, policy.backoff_cap), rng, policy.jitter)
    failures: list[str] = []
    attempts = 0
    first_check = last_check = recheck

    async def moved(check: Recheck) -> bool:
        """Whether the route looked up afresh is another one (``t`` then aims at it)."""
        fresh = await check()
        if fresh is None:
            raise UpstreamFailed("sandbox_gone", "the sandbox is no longer routed", http_status=503,
                                 retry_after=1, attempts=attempts)
        if fresh is t.route:
            return False
        t.route, t.preamble = fresh, replace(t.preamble, dst=fresh.target_ip)
        t.deadline = loop.time() + fresh.connect_deadline_s
        return True

    pooled = pool.take(t.route.forwarder) if pool is not None else None
    if pooled is not None:
        try:
            stream, leftover = await _exchange(pooled, t, policy)
            return Upstream(stream, leftover, 0, loop.time() - start, failures, pooled=True)
        except _Retry as r:
            failures.append(f"pooled_{r.reason}")
        except UpstreamFailed as e:
            e.attempts = attempts
            raise
    while True:
        remaining = t.deadline - loop.time()
        connected = None
        if remaining > 0:
            fwd = t.route.forwarder
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
        if connected is None or connected.sock is None:
            # Past the deadline (or a connect error no retry mends): the route once more before answering.
            if last_check is not None:
                final, last_check = last_check, None
                first_check = None
                if await moved(final):
                    continue
            raise _give_up(failures, attempts)
        try:
            stream, leftover = await _attempt(connected.sock, t, policy)
        except _Retry as r:
            failures.append(r.reason)
            pin = r.reason == "pin_mismatch"
            check: Recheck | None = None
            if first_check is not None:
                check, first_check = first_check, None
            elif pin and last_check is not None:
                check, last_check = last_check, None
            if check is not None and await moved(check):
                continue
            if pin:  # not transient: the route, looked up again, names that key still
                raise UpstreamFailed("pin_mismatch", "the sandbox's host has another key than its route names",
                                     http_status=502, retry_after=None, attempts=attempts) from None
            wait = min(next(waits), t.deadline - loop.time())
            if wait > 0:
                await asyncio.sleep(wait)
            continue
        except UpstreamFailed as e:
            e.attempts = attempts
            raise
        return Upstream(stream, leftover, attempts, loop.time() - start, failures)


async def _attempt(sock: socket.socket, t: _Target, policy: UpstreamPolicy) -> tuple[TlsStream, bytes]:
    try:
        stream = await TlsStream.connect(sock, policy.context, server_hostname=None, timeout=policy.handshake_timeout)
    except (ssl.SSLError, OSError, TimeoutError) as e:
        _close_raw(sock)
        raise _Retry("handshake_failed") from e
    try:
        check_pin(stream.ssl_object, t.route.forwarder.spki_pins)
    except PinMismatch:
        stream.abort()
        raise _Retry("pin_mismatch") from None
    return await _exchange(stream, t, policy)


async def _exchange(stream: TlsStream, t: _Target, policy: UpstreamPolicy) -> tuple[TlsStream, bytes]:
    """The preamble and the forwarder's status on a handshaken, pin-checked link. The preamble tells the
    forwarder what is left of the deadline (at least 1 ms); the status is awaited until
    ``policy.status_grace`` past it."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    left = t.deadline - now
    p = replace(t.preamble, deadline_ms=min(DEADLINE_MAX_MS, max(1, math.ceil(left * 1000))))
    try:
        seq = GatewaySequence.for_preamble(p, now=now, timeout=max(left, 0.0) + policy.status_grace)
        await stream.write(seq.start())
        answer = None
        async with asyncio.timeout_at(seq.deadline):
            while answer is None:
                data = await stream.read()
                if not data:
                    raise _Retry("closed_before_status")
                answer = seq.receive_data(data, loop.time())
    except TimeoutError:
        # No status by the deadline and its grace, although the forwarder was told the deadline: past
        # it now, so the caller looks the route up once more and answers 504 for a silent forwarder.
        stream.abort()
        raise _Retry("status_timeout") from None
    except StatusError as e:
        stream.abort()
        raise UpstreamFailed(e.reason, "malformed status", http_status=502, retry_after=None, attempts=0) from None
    except _Retry:
        stream.abort()
        raise
    except (OSError, ssl.SSLError) as e:
        stream.abort()
        raise _Retry("reset_before_status") from e
    except asyncio.CancelledError:
        stream.abort()  # the request's client left (or a drain's cut): the forwarder sees the link reset
        raise
    if answer.status is Status.OK:
        return stream, answer.leftover
    stream.abort()
    if answer.status.retryable:
        raise _Retry(answer.status.name.lower())
    reason = _NO_RETRY.get(answer.status, "forwarder_refused")
    raise UpstreamFailed(reason, f"forwarder answered {answer.status.name}", http_status=502, retry_after=None,
                         attempts=0)


def _give_up(failures: list[str], attempts: int) -> UpstreamFailed:
    # A pooled link's failure is named pooled_<why>; the answer is the same as for a fresh link's.
    last = failures[-1].removeprefix("pooled_") if failures else "deadline"
    if last == "status_timeout":
        return UpstreamFailed(last, "the forwarder did not answer", http_status=504, retry_after=None,
                              attempts=attempts)
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
