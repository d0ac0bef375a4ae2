"""The forwarder's steps for one connection, from accept to the data plane.

TLS handshake within ``handshake_timeout``; the peer's SAN against the allowlist; the preamble's first
byte within ``preamble_idle_timeout`` (a gateway's warm pool holds links before it has requests for
them), the whole preamble within ``preamble_timeout`` of that byte and ``preamble_max_bytes``
(``sbxnet.protocol.link.ForwarderSequence``); the target guard; connect with cold-start retry (within
``connect_deadline``, or the preamble's deadline when that is shorter); one OK status; then the data
plane. Nothing reaches a sandbox before the peer is authenticated and the preamble is whole and allowed.

A plane that can start a tunnel and tell of its end later (``start``: the userspace plane) gets it that
way: ``run`` returns a :class:`LiveTunnel` at the handoff and the connection's task ends, so an idle
tunnel keeps no coroutine chain waiting; its end is metered, logged (``closed``, when it ends) and passed
to the server's ``on_end`` from the plane's callback. The ktls plane's ``run`` is awaited as before.

Each step either returns what the next one needs or raises ``Refusal``, which carries everything the
one handler (``ConnectionSequence._refuse``) does with it: the outcome counted in
``sbxnet_forwarder_connections``, the reason counted in the step's own counter and logged, and how the
gateway hears of it (a status record, a plain close, or a reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

from forwarder.ingress.metering import ConnMeter, Meter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.planes.interface import DataPlane, Handoff, Outcome, abort
from forwarder.ingress.san_acl import SanAllowlist, peer_sans
from forwarder.ingress.settings import ForwarderSettings
from forwarder.ingress.target_guard import TargetPolicy, TargetRefused, canonical, judge_target
from forwarder.ingress.tls_context import handshake_failure_reason
from forwarder.ingress.tls_link import LinkClosed, NotTls, TlsLink
from sbxnet.connect import connect_with_retry
from sbxnet.errors import RemoteProtocolError
from sbxnet.protocol.link import ForwarderSequence, Opened
from sbxnet.protocol.preamble import PreambleError
from sbxnet.protocol.status import Status, push_status

log = logging.getLogger("sbxnet.forwarder")

Counted = Literal["handshake", "preamble", "target"]


@dataclass
class Refusal(Exception):
    """A step refused the connection. ``status`` None means the gateway gets no status record: the
    socket is closed plainly, or reset when ``reset`` is set (the link itself is broken)."""

    outcome: Outcome
    reason: str
    message: str
    event: str
    status: Status | None = None
    counted: Counted | None = None
    reset: bool = False
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Connected:
    sock: socket.socket  # to the sandbox, non-blocking; ours to close
    attempts: int
    elapsed: float
    attempt_started: float  # time.monotonic() when the attempt that connected began


class Running(Protocol):
    def cut(self) -> None:
        """End the tunnel now, as a drain does (its end is still told)."""


class StartingPlane(Protocol):
    """A data plane that starts a tunnel and returns (the userspace plane): ``owner.tunnel_ended`` is
    called once, when the tunnel has ended."""

    def start(self, handoff: Handoff, owner: LiveTunnel) -> Running: ...


class LiveTunnel:
    """A tunnel past its handoff that no task waits for: what its end needs (the log context, the meter,
    when it started) until the plane calls :meth:`tunnel_ended`. Slotted: an idle tunnel holds it."""

    __slots__ = ("ctx", "meter", "running", "sequence", "started")

    def __init__(self, sequence: ConnectionSequence, ctx: dict[str, str], meter: ConnMeter, started: float) -> None:
        self.sequence = sequence
        self.ctx = ctx
        self.meter = meter
        self.started = started
        self.running: Running | None = None

    def cut(self) -> None:
        if self.running is not None:
            self.running.cut()

    def tunnel_ended(self, outcome: Outcome) -> None:
        # The plane's tunnel refers to this object as its owner: without this cycle's break, the ended
        # tunnel (its SSL object, OpenSSL's 20 KiB, the sockets' objects) would wait for a collection.
        self.running = None
        self.sequence._tunnel_ended(self, outcome)


class ConnectionSequence:
    """The per-connection steps; one instance per server, ``run`` once per accepted socket.

    ``on_end`` hears of the end of each tunnel ``run`` returned as a :class:`LiveTunnel` (the outcome to
    count), after it is metered and logged."""

    def __init__(
        self, settings: ForwarderSettings, metrics: ForwarderMetrics, plane: DataPlane, meter: Meter,
        on_end: Callable[[LiveTunnel, Outcome], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.plane = plane
        self.meter = meter
        self.on_end = on_end
        self.acl = SanAllowlist(tuple(settings.client_san_allow))

    async def run(
        self, sock: socket.socket, ctx: dict[str, str], tls: ssl.SSLContext, policy: TargetPolicy
    ) -> Outcome | LiveTunnel:
        """The connection's steps. An outcome once it has ended; a :class:`LiveTunnel` when its tunnel
        goes on without this coroutine (a plane with ``start``, and ``on_end`` given), whose end comes to
        ``on_end``."""
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.plane.on_accept(sock)  # the ktls plane attaches the TLS ULP while the socket is ESTABLISHED
        link = TlsLink(sock, tls)
        try:
            await self._handshake(link)
            ctx["client"] = self._authorize(link)
            opened = await self._read_preamble(link)
            self._note_preamble(opened, ctx)
            self._judge(opened, policy)
            upstream = await self._connect(opened)
        except Refusal as r:
            await self._refuse(link, r, ctx)
            return r.outcome
        try:
            await link.write(push_status(Status.OK))
        except OSError:
            abort(upstream.sock)
            abort(sock)
            return Outcome.RESET_GATEWAY
        return await self._hand_over(link, upstream, opened, ctx)

    # -- the steps ---------------------------------------------------------------------------------

    async def _handshake(self, link: TlsLink) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.settings.handshake_timeout):
                await link.handshake()
        except (ssl.SSLError, OSError, TimeoutError, RemoteProtocolError) as e:
            # How long the refusal took, on our clock; and for clear text, its first bytes (hex, at
            # most 5: enough to tell a PROXY header or an HTTP request from noise, never raw peer text).
            fields: dict[str, Any] = {"handshake_ms": round((time.monotonic() - started) * 1000, 2)}
            if isinstance(e, NotTls):
                fields["first_bytes"] = e.first.hex()
            raise Refusal(
                Outcome.HANDSHAKE_REFUSED,
                handshake_failure_reason(e),
                "handshake refused",
                "handshake_refused",
                counted="handshake",
                fields=fields,
            ) from None

    def _authorize(self, link: TlsLink) -> str:
        sans = peer_sans(link.peercert())
        who = self.acl.first_match(sans)
        if who is None:
            raise Refusal(
                Outcome.HANDSHAKE_REFUSED,
                "san_not_allowed",
                "peer not on the allowlist",
                "handshake_refused",
                status=Status.FORBIDDEN,
                counted="handshake",
                fields={"peer_sans": sans[:8]},
            )
        return who

    async def _read_preamble(self, link: TlsLink) -> Opened:
        s = self.settings
        loop = asyncio.get_running_loop()
        seq = ForwarderSequence(
            now=loop.time(), timeout=s.preamble_timeout, max_len=s.preamble_max_bytes,
            idle_timeout=s.preamble_idle_timeout,
        )
        try:
            try:
                async with asyncio.timeout_at(seq.deadline) as deadline:
                    while True:
                        record = await link.read_app_record()
                        if not record:
                            seq.receive_eof()
                        opened = seq.receive_data(record, loop.time())
                        if opened is not None:
                            return opened
                        deadline.reschedule(seq.deadline)  # the first byte starts the preamble's own
            except TimeoutError:
                seq.expire()
            except LinkClosed:  # a TCP FIN: ``unused`` before the first byte, ``eof`` after
                try:
                    seq.receive_eof()
                except PreambleError as e:  # the peer is gone: no status, the link is reset
                    raise self._preamble_refusal(e, status=None, started=seq.started) from None
            except ssl.SSLError as e:
                raise RemoteProtocolError("tls_error", e.reason or "") from None
            except OSError as e:
                raise RemoteProtocolError("reset", e.strerror or "") from None
        except PreambleError as e:
            raise self._preamble_refusal(e, status=e.status_hint, started=seq.started) from None
        except RemoteProtocolError as e:  # eof, reset or an undecryptable record before the preamble
            raise self._preamble_refusal(e, status=None, started=seq.started) from None

    @staticmethod
    def _preamble_refusal(e: RemoteProtocolError, *, status: Status | None, started: bool) -> Refusal:
        """``no_preamble`` when not one byte of it came (no preamble was sent, so none was bad: a pooled
        link retired, a gateway that refused our key), ``bad_preamble`` otherwise; the reason is counted
        in ``preamble_rejects`` either way."""
        return Refusal(
            Outcome.BAD_PREAMBLE if started else Outcome.NO_PREAMBLE,
            e.reason,
            "preamble refused",
            "preamble_refused",
            status=status,
            counted="preamble",
            reset=status is None,
        )

    @staticmethod
    def _note_preamble(opened: Opened, ctx: dict[str, str]) -> None:
        p = opened.preamble
        ctx["sandbox_id"] = p.sandbox_id
        if p.connection_id:
            # The gateway's UNIQUE_ID, so its logs and ours join on one key. Printable ASCII is logged
            # as is; anything else as hex, never raw peer bytes.
            cid = p.connection_id
            ctx["gateway_conn_id"] = cid.decode() if cid.isascii() and cid.decode().isprintable() else cid.hex()
        ctx["target"] = f"{p.dst}:{p.dst_port}"

    @staticmethod
    def _judge(opened: Opened, policy: TargetPolicy) -> None:
        p = opened.preamble
        try:
            judge_target(p.dst, p.dst_port, policy)
        except TargetRefused as e:
            raise Refusal(
                Outcome.FORBIDDEN,
                e.reason,
                "target refused",
                "target_refused",
                status=e.status_hint,
                counted="target",
            ) from None

    async def _connect(self, opened: Opened) -> Connected:
        s = self.settings
        p = opened.preamble
        # The gateway's deadline (the preamble's, when it sent one) shortens ours, never lengthens it: our
        # NOT_LISTENING then comes while the gateway still waits for it.
        deadline = s.connect_deadline if p.deadline_ms is None else min(s.connect_deadline, p.deadline_ms / 1000)
        result = await connect_with_retry(
            canonical(p.dst),
            p.dst_port,  # connect to exactly what was judged
            deadline_s=deadline,
            syn_interval=s.connect_syn_interval,
            backoff_initial=s.connect_backoff_initial,
            backoff_cap=s.connect_backoff_cap,
        )
        self.metrics.connect_attempts.inc(result.attempts)
        self.metrics.connect_latency.labels("ok" if result.sock else "failed").observe(result.elapsed)
        if result.sock is None:
            raise Refusal(
                Outcome.NOT_LISTENING,
                result.last_error,
                "sandbox not listening",
                "not_listening",
                status=Status.NOT_LISTENING,
                fields={"attempts": result.attempts, "elapsed_ms": round(result.elapsed * 1000, 1),
                        "deadline_ms": round(deadline * 1000)},
            )
        return Connected(result.sock, result.attempts, result.elapsed, result.attempt_started)

    async def _hand_over(
        self, link: TlsLink, upstream: Connected, opened: Opened, ctx: dict[str, str]
    ) -> Outcome | LiveTunnel:
        s = self.settings
        meter = self.meter.open(opened.preamble.sandbox_id, ctx["conn_id"], time.monotonic())
        started = time.monotonic()
        log.info(
            "connected",
            extra={
                **ctx,
                "event": "connected",
                "plane": self.plane.name,
                "fields": {
                    "attempts": upstream.attempts,
                    "connect_ms": round(upstream.elapsed * 1000, 2),
                    "attempt_started": round(upstream.attempt_started, 6),  # time.monotonic(), this host's
                },
            },
        )
        handoff = Handoff(link=link, upstream=upstream.sock, leftover=opened.leftover, meter=meter,
                          close_timeout=s.close_timeout)
        start = getattr(self.plane, "start", None) if self.on_end is not None else None
        if start is not None:
            live = LiveTunnel(self, ctx, meter, started)
            try:
                live.running = cast(StartingPlane, self.plane).start(handoff, live)
            except BaseException:
                self.meter.close(meter)
                raise
            return live
        try:
            outcome = await self.plane.run(handoff)
        finally:
            self.meter.close(meter)
        self._log_closed(ctx, outcome, meter, started)
        return outcome

    def _tunnel_ended(self, live: LiveTunnel, outcome: Outcome) -> None:
        """A started tunnel's end, from its plane: metered and logged as an awaited one's is (a drained
        one unlogged, as a cancelled ``run``'s end is), then counted by ``on_end``."""
        try:
            self.meter.close(live.meter)
            if outcome is not Outcome.DRAINED:
                self._log_closed(live.ctx, outcome, live.meter, live.started)
        except Exception:
            log.exception("internal error", extra={**live.ctx, "event": "internal"})
            outcome = Outcome.INTERNAL
        finally:
            assert self.on_end is not None
            self.on_end(live, outcome)

    @staticmethod
    def _log_closed(ctx: dict[str, str], outcome: Outcome, meter: ConnMeter, started: float) -> None:
        log.info(
            "closed",
            extra={
                **ctx,
                "event": "closed",
                "fields": {
                    "outcome": outcome.value,
                    "bytes_up": meter.up,
                    "bytes_down": meter.down,
                    "seconds": round(time.monotonic() - started, 3),
                },
            },
        )

    # -- the one place a refusal is handled ----------------------------------------------------------

    async def _refuse(self, link: TlsLink, r: Refusal, ctx: dict[str, str]) -> None:
        if r.counted == "handshake":
            self.metrics.handshake_rejects.labels(r.reason).inc()
        elif r.counted == "preamble":
            self.metrics.preamble_rejects.labels(r.reason).inc()
        elif r.counted == "target":
            self.metrics.target_rejects.labels(r.reason).inc()
        extra: dict[str, Any] = {**ctx, "event": r.event, "reason": r.reason}
        if r.fields:
            extra["fields"] = r.fields
        # A link that ended or idled out before its first byte is a gateway's warm pool at work (or its
        # pin check refusing us, which the gateway logs): counted, but not worth a warning each time.
        quiet = r.counted == "preamble" and r.reason in ("unused", "idle")
        log.log(logging.INFO if quiet else logging.WARNING, r.message, extra=extra)
        if r.status is not None:
            await self._finish(link, r.status)
        elif r.reset:
            abort(link.sock)
        else:
            link.sock.close()

    @staticmethod
    async def _finish(link: TlsLink, status: Status) -> None:
        """Tell the gateway why, then close (best effort: the peer may already be gone)."""
        try:
            async with asyncio.timeout(1.0):
                await link.write(push_status(status))
                with contextlib.suppress(ssl.SSLError):
                    link.ssl.unwrap()
                await asyncio.get_running_loop().sock_sendall(link.sock, link.outgoing.read())
        except (OSError, TimeoutError, ssl.SSLError):
            pass
        link.sock.close()
