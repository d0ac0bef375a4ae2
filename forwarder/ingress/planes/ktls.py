"""The ``ktls`` data plane: keys in the kernel, bytes moved by the splice pump, none through Python.

Per connection: deliver the tenant bytes that shared a record with the end of the preamble, install
the session's TLS 1.3 keys on the gateway socket (TLS_TX and TLS_RX, continuing the exact record
sequence numbers), then give both descriptors to the pump. The ``SSLObject`` is never used again:
its fd is detached and the pump owns the socket. The pump ends the gateway's direction at its
close_notify (FIN to the sandbox, the other direction goes on) and resets both sides at a TCP FIN
without one (``reset_gateway``), as the userspace plane does. It reports the end of the connection with
exact byte counts; live meters are refreshed from its counters twice a second (per connection, not
per chunk) for the idle-timer feed and the metrics.

Fail closed: constructing the plane probes the kernel and raises :class:`KtlsUnavailable` if the TLS
ULP cannot be attached; nothing falls back to the userspace plane.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import ssl
import struct
import time
from dataclasses import dataclass

from forwarder.ingress.metering import ConnMeter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.planes import ktls_keys as ktls
from forwarder.ingress.planes.interface import Handoff, Outcome, abort
from forwarder.ingress.planes.splice_pump import (
    DEFAULT_PIPE_SIZE,
    EV_GW_CLOSE_NOTIFY,
    EV_GW_FIN,
    Detached,
    PipeTooSmall,
    PumpEvent,
    PumpOutcome,
    SplicePump,
)
from sbxnet.errors import EnvironmentFault

log = logging.getLogger("sbxnet.forwarder")
METER_REFRESH_S = 0.5

_OUTCOMES = {
    PumpOutcome.CLOSED: Outcome.CLOSED,
    PumpOutcome.RESET_GATEWAY: Outcome.RESET_GATEWAY,
    PumpOutcome.RESET_SANDBOX: Outcome.RESET_SANDBOX,
    PumpOutcome.CLOSE_TIMEOUT: Outcome.CLOSE_TIMEOUT,
    PumpOutcome.TLS_ERROR: Outcome.TLS_ERROR,
    PumpOutcome.ABORTED: Outcome.DRAINED,
    PumpOutcome.INTERNAL: Outcome.INTERNAL,
}


@dataclass(eq=False)
class _Waiting:
    end: asyncio.Future[PumpEvent | None]  # the pump's event; None: moved to another process, or dropped
    meter: ConnMeter
    up_base: int  # added to the pump's counters for the meter
    down_base: int


@dataclass(frozen=True)
class MovingTunnel:
    """A tunnel detached for the process taking over: who it is, and its pump state and descriptors."""

    conn_id: str
    sandbox_id: str
    head: int
    detached: Detached


class KtlsUnavailable(ktls.KtlsError, EnvironmentFault):
    """The kernel cannot carry kernel TLS; ``message`` is the one start-up line (cause and fixes)."""

    def __init__(self, result: ktls.ProbeResult) -> None:
        super().__init__(result.cause, result.detail)
        self.result = result
        self.message = result.message()

    def __str__(self) -> str:
        return self.message


def _close_fd(fd: int, *, reset: bool) -> None:
    with contextlib.suppress(OSError):
        if reset:
            s = socket.socket(fileno=fd)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        else:
            os.close(fd)


class KtlsPlane:
    name = "ktls"

    def __init__(
        self, *, threads: int = 1, max_conns: int = 65536, pipe_size: int = DEFAULT_PIPE_SIZE,
        metrics: ForwarderMetrics | None = None,
    ) -> None:
        result = ktls.probe()
        if not result.ok:
            raise KtlsUnavailable(result)
        self._threads = threads
        # Asked of the kernel for each pipe; what it gives is judged per connection (PipeTooSmall).
        self.pipe_size = pipe_size
        self._max_conns = max_conns
        self._pump: SplicePump | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Per pump connection: its end, its meter, and what to add to the pump's counters for the meter
        # (the preamble record's tenant bytes up; for an adopted tunnel minus what moved before, so its
        # meter counts only what moved here).
        self._waiting: dict[int, _Waiting] = {}
        # Takeover: tunnels detached for the new process, until it commits or fails (old process), and
        # tunnels adopted paused until the old one commits (new process).
        self._moving: list[tuple[_Waiting, Detached]] = []
        self._paused: list[int] = []
        self._refresh: asyncio.Task[None] | None = None
        # Why connections ended, by the pump's reason token (tls_key_update, tls_decrypt_error, ...),
        # and refusals before the hand-over (install failures), by KtlsError reason.
        self.ends: collections.Counter[str] = collections.Counter()
        self.install_failures: collections.Counter[str] = collections.Counter()
        self._metrics = metrics

    @staticmethod
    def prepare_context(ctx: ssl.SSLContext) -> None:
        """Called on every server context before it serves (start-up and each reload)."""
        ktls.prepare_context(ctx)

    @staticmethod
    def on_accept(sock: socket.socket) -> None:
        """Attach the TLS ULP while the socket is ESTABLISHED (a fast gateway may FIN before install).

        A failure here is not final: ``install`` tries again and refuses the connection if it must.
        """
        with contextlib.suppress(ktls.KtlsError):
            ktls.attach_ulp(sock)

    @property
    def pump(self) -> SplicePump | None:
        return self._pump

    def _ensure_pump(self) -> SplicePump:
        loop = asyncio.get_running_loop()
        if self._pump is None:
            self._pump = SplicePump(threads=self._threads, max_conns=self._max_conns, pipe_size=self.pipe_size)
            self._loop = loop
            loop.add_reader(self._pump.event_fd, self._on_events)
            self._refresh = loop.create_task(self._refresh_meters(), name="ktls-meters")
        elif self._loop is not loop:
            raise RuntimeError("KtlsPlane used from two event loops")
        return self._pump

    def _on_events(self) -> None:
        assert self._pump is not None
        for ev in self._pump.take_events():
            entry = self._waiting.pop(ev.conn_id, None)
            if entry and not entry.end.done():
                entry.end.set_result(ev)

    async def _refresh_meters(self) -> None:
        while True:
            await asyncio.sleep(METER_REFRESH_S)
            pump = self._pump
            if pump is None:
                return
            now = time.monotonic()
            # Only the tunnels whose counters changed: idle ones cost nothing here (a counters() call
            # each was 1.6 us, 3% of a core at 10,000 idle tunnels and two refreshes a second).
            for conn_id, up, down in pump.take_moved():
                w = self._waiting.get(conn_id)
                if w is not None and (w.up_base + up, w.down_base + down) != (w.meter.up, w.meter.down):
                    w.meter.up, w.meter.down = w.up_base + up, w.down_base + down
                    w.meter.last_activity = now

    async def close(self) -> None:
        """Stop the pump (connections still in it are reset). For tests and shutdown."""
        if self._refresh:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
        if self._pump is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._pump.event_fd)
            self._pump.close()
            self._pump = None

    # -- takeover: live tunnels to the new process (takeover.py; docs/forwarder.md) ---------------------

    def detach_all(self) -> list[MovingTunnel]:
        """Old process, after the listener's release: take every live tunnel out of the pump (nothing moves
        on them from now on) for the new process. Their ``run`` goes on waiting until :meth:`commit_moved`
        or :meth:`give_back`. A tunnel that ended first is not among them (it ends here as usual)."""
        pump = self._pump
        out: list[MovingTunnel] = []
        if pump is None:
            return out
        for conn_id, w in list(self._waiting.items()):
            d = pump.detach(conn_id)
            if d is None:
                continue
            del self._waiting[conn_id]
            self._moving.append((w, d))
            out.append(MovingTunnel(w.meter.conn_id, w.meter.sandbox_id, w.up_base, d))
        return out

    def commit_moved(self) -> int:
        """The new process has them all: each meter closes with what moved here (its last feed report
        covers exactly that), each ``run`` returns ``moved``, and this process's copies of the descriptors
        are closed (the new one's keep the sockets and pipes open: nothing is sent)."""
        moved, self._moving = self._moving, []
        now = time.monotonic()
        for w, d in moved:
            w.meter.up, w.meter.down = w.up_base + d.bytes_up, w.down_base + d.bytes_down
            w.meter.last_activity = now
            d.close()
            if not w.end.done():
                w.end.set_result(None)
        return len(moved)

    def give_back(self) -> int:
        """The takeover failed before its commit: adopt every detached tunnel back into this pump, where
        it goes on as it was. Returns how many came back (one that cannot is reset)."""
        moving, self._moving = self._moving, []
        pump = self._pump
        back = 0
        for w, d in moving:
            try:
                assert pump is not None
                self._waiting[pump.adopt(d)] = w
                back += 1
            except (OSError, AssertionError):
                _close_fd(d.gw_fd, reset=True)
                _close_fd(d.sb_fd, reset=True)
                for fd in d.fds[2:]:
                    _close_fd(fd, reset=False)
                if not w.end.done():
                    w.end.set_exception(OSError("tunnel lost on a failed takeover"))
        return back

    def adopt(self, d: Detached, meter: ConnMeter) -> int:
        """New process: take a tunnel the old one detached, paused until :meth:`resume_adopted`; returns
        its id for :meth:`until_end`. Its meter counts only what moves here. OSError (the descriptors stay
        the caller's) if the pump cannot take it."""
        pump = self._ensure_pump()
        conn_id = pump.adopt(d, paused=True)
        self._waiting[conn_id] = _Waiting(asyncio.get_running_loop().create_future(), meter, -d.bytes_up,
                                          -d.bytes_down)
        self._paused.append(conn_id)
        return conn_id

    async def until_end(self, conn_id: int) -> Outcome:
        """An adopted tunnel's end, as ``run`` returns it for an accepted one (``moved``: dropped unstarted)."""
        w = self._waiting.get(conn_id)
        if w is None or self._pump is None:
            return Outcome.MOVED
        return await self._until_end(self._pump, conn_id, w)

    def resume_adopted(self) -> int:
        """The old process committed: start every tunnel adopted paused."""
        paused, self._paused = self._paused, []
        assert self._pump is not None or not paused
        return sum(1 for conn_id in paused if self._pump is not None and self._pump.resume(conn_id))

    def drop_adopted(self) -> int:
        """The old process gave up before its commit (it keeps the tunnels): let go of the paused ones,
        closing only this process's copies of their descriptors, never a byte sent."""
        paused, self._paused = self._paused, []
        dropped = 0
        for conn_id in paused:
            w = self._waiting.pop(conn_id, None)
            d = self._pump.detach(conn_id) if self._pump is not None else None
            if d is not None:
                d.close()
                dropped += 1
            if w is not None and not w.end.done():
                w.end.set_result(None)
        return dropped

    async def run(self, h: Handoff) -> Outcome:
        loop = asyncio.get_running_loop()
        pump = self._ensure_pump()
        link = h.link
        # Tenant bytes that came in the preamble's record go first, so the sandbox sees them in order.
        if h.leftover:
            try:
                await loop.sock_sendall(h.upstream, h.leftover)
            except OSError:
                abort(h.upstream)
                abort(link.sock)
                return Outcome.RESET_SANDBOX
            h.meter.up += len(h.leftover)
            h.meter.last_activity = time.monotonic()
        head = len(h.leftover)
        try:
            installed = ktls.install(
                link.ssl, link.incoming, link.sock.fileno(),
                expect_tx=link.tx_app_records, expect_rx=link.rx_app_records,
            )
        except ktls.KtlsError as e:
            self.install_failures[e.reason] += 1
            if self._metrics:
                self._metrics.plane_refusals.labels(self.name, e.reason).inc()
            log.warning(f"kernel TLS install refused: {e.reason} {e.detail}",
                        extra={"event": "ktls_install_failed", "reason": e.reason})
            abort(h.upstream)
            abort(link.sock)
            return Outcome.TLS_ERROR if e.reason == "record_count_mismatch" else Outcome.INTERNAL
        # From here on OpenSSL's object is dead to us: never read, written or shut down again. Its
        # memory BIOs hold nothing (checked by install); dropping it frees the SSL without a byte sent,
        # now rather than at the connection's end (its session and the peer's certificate: user-space
        # memory a long-lived tunnel would otherwise hold for nothing).
        del installed
        link.drop_tls()
        gw_fd = link.sock.detach()
        sb_fd = h.upstream.detach()
        try:
            conn_id = pump.add(gw_fd, sb_fd, ktls=True, close_timeout=h.close_timeout)
        except PipeTooSmall as e:
            # A pipe that cannot hold a whole record would cut the stream: both sides are reset instead,
            # so neither end takes what came through for all of it.
            self.install_failures["pipe_too_small"] += 1
            if self._metrics:
                self._metrics.plane_refusals.labels(self.name, "pipe_too_small").inc()
            log.warning(f"connection refused: {e.strerror}",
                        extra={"event": "ktls_pipe_too_small", "reason": "pipe_too_small"})
            _close_fd(gw_fd, reset=True)
            _close_fd(sb_fd, reset=True)
            return Outcome.INTERNAL
        except OSError:
            _close_fd(gw_fd, reset=True)
            _close_fd(sb_fd, reset=True)
            return Outcome.INTERNAL
        waiting = _Waiting(loop.create_future(), h.meter, head, 0)
        self._waiting[conn_id] = waiting
        return await self._until_end(pump, conn_id, waiting)

    async def _until_end(self, pump: SplicePump, conn_id: int, w: _Waiting) -> Outcome:
        try:
            ev = await w.end
        except asyncio.CancelledError:
            # The tunnel may have been given back (a failed takeover) under another id: abort that one.
            conn_id = next((i for i, x in self._waiting.items() if x is w), conn_id)
            self._waiting.pop(conn_id, None)
            if self._pump is pump:  # not already closed (which reset everything it held)
                c = pump.counters(conn_id)
                if c is not None:
                    w.meter.up, w.meter.down = w.up_base + c[0], w.down_base + c[1]
                pump.abort(conn_id, reset=True)
            raise
        if ev is None:
            return Outcome.MOVED  # handed over (old process), or dropped unstarted (new process)
        w.meter.up = w.up_base + ev.bytes_up
        w.meter.down = w.down_base + ev.bytes_down
        w.meter.last_activity = time.monotonic()
        self.ends[ev.reason] += 1
        if self._metrics:
            self._metrics.plane_ends.labels(self.name, ev.reason).inc()
            if ev.outcome is PumpOutcome.RESET_GATEWAY and not ev.flags & EV_GW_CLOSE_NOTIFY:
                # The gateway's direction never ended in order: the upload was cut short (and the pump reset
                # the sandbox). A reset after its close_notify cut only the other direction.
                self._metrics.truncated.labels(self.name, "fin" if ev.flags & EV_GW_FIN else "reset").inc()
        if ev.outcome is not PumpOutcome.CLOSED:
            if ev.outcome is PumpOutcome.RESET_GATEWAY and ev.flags & EV_GW_FIN:
                err = "TCP FIN without close_notify"
            else:
                err = os.strerror(ev.err) if ev.err else "-"
            log.warning(f"pump ended the connection: {ev.outcome.name.lower()} {ev.reason} ({err})",
                        extra={"event": "ktls_close", "reason": ev.reason})
        return _OUTCOMES[ev.outcome]
