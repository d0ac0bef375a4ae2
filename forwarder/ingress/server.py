"""The forwarder's listener: accept loop, drain, certificate reload, metrics flush.

Per connection it takes a slot, accepts, and runs the steps in ``sequence.py`` (handshake, allowlist,
preamble, target guard, connect, status, data plane), counting the outcome they end with. A userspace
tunnel outlives its connection's task (the acceptor holds its slot, ``sbxnet/accept.py``): its outcome is
counted when the plane tells of its end (:meth:`ForwarderServer._tunnel_ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import ssl
import time
from typing import TYPE_CHECKING

from certs import loader
from certs.loader import Reloadable
from forwarder.ingress.host_addrs import IPAddress, host_addresses
from forwarder.ingress.metering import ConnMeter, Meter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.planes.interface import DataPlane, Outcome, abort
from forwarder.ingress.planes.memory import trim_heap
from forwarder.ingress.sequence import ConnectionSequence, LiveTunnel
from forwarder.ingress.settings import ForwarderSettings
from forwarder.ingress.target_guard import TargetPolicy
from forwarder.ingress.tls_context import server_context
from sbxnet.accept import Acceptor
from sbxnet.listen import bind_listener
from sbxnet.reload import Part, ReloadError

if TYPE_CHECKING:
    from forwarder.ingress.planes.ktls import KtlsPlane
    from forwarder.ingress.takeover_codec import Tunnel

log = logging.getLogger("sbxnet.forwarder")
HOST_ADDRESS_REFRESH_S = 10
# Connections ended since the last heap trim that make the next one worth its walk of the heap (and a
# trim every TRIM_EVERY_S seconds for fewer): what tunnels freed goes back to the kernel, not in bulk only.
TRIM_AFTER_ENDS = 64
TRIM_EVERY_S = 10


def pump_thread_count(settings: ForwarderSettings, cores: int) -> int:
    """The ktls plane's splice threads in one worker: ``pump_threads``, or by default the cores shared
    among the workers (one per core in all), at least one. One thread splices every tunnel it holds in
    turn, so a single one is what limited the public system's eight-tunnel figure."""
    if settings.pump_threads:
        return settings.pump_threads
    workers = settings.workers or cores
    return max(1, cores // workers)


def make_plane(settings: ForwarderSettings, metrics: ForwarderMetrics | None = None) -> DataPlane:
    if settings.data_plane == "userspace":
        from forwarder.ingress.planes.userspace import UserspacePlane

        return UserspacePlane(metrics=metrics)
    if settings.data_plane == "ktls":
        from forwarder.ingress.planes.ktls import KtlsPlane

        # raises KtlsUnavailable (fail closed) where the kernel has no TLS
        return KtlsPlane(threads=pump_thread_count(settings, os.cpu_count() or 1), metrics=metrics)
    raise ValueError(f"unknown data plane {settings.data_plane!r}")


class ForwarderServer:
    def __init__(
        self,
        settings: ForwarderSettings,
        *,
        metrics: ForwarderMetrics | None = None,
        plane: DataPlane | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or ForwarderMetrics()
        self.plane = plane or make_plane(settings, self.metrics)
        self.tls = Reloadable(lambda: server_context(settings))
        self.policy = self._policy(frozenset())
        self.meter = Meter()
        self.sequence = ConnectionSequence(settings, self.metrics, self.plane, self.meter, on_end=self._tunnel_ended)
        self._reuse_port = reuse_port
        self._acceptor = Acceptor(self._serve, max_connections=settings.max_connections, log=log)
        self._flush_task: asyncio.Task[None] | None = None
        self._draining = False
        self._adopted: set[asyncio.Task[None]] = set()  # kTLS tunnels taken over from the previous process
        self._flushed = (0, 0)
        self._ended = 0  # connections ended since start
        self._ended_at_trim = 0

    def _policy(self, addresses: frozenset[IPAddress]) -> TargetPolicy:
        s = self.settings
        return TargetPolicy(prefixes=tuple(s.sandbox_prefixes), allow=tuple(s.allow_targets), host_addresses=addresses)

    async def refresh_host_addresses(self) -> None:
        # Netlink from a thread: pyroute2 runs its own event loop, which must not be this one.
        self.policy = self._policy(await asyncio.to_thread(host_addresses))

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._acceptor.port

    @property
    def ready(self) -> bool:
        return self._acceptor.listener is not None and not self._draining

    @property
    def open_connections(self) -> int:
        return self._acceptor.open_connections + len(self._adopted)

    async def start(self, listener: socket.socket | None = None) -> None:
        s = self.settings
        await self.refresh_host_addresses()
        listener = listener or bind_listener(
            str(s.listen_host),
            s.listen_port,
            reuse_port=self._reuse_port,
            setting="listen_port / SBXNET_FORWARDER_LISTEN_PORT",
        )
        self.metrics.data_plane.labels(self.plane.name).set(1)
        self._acceptor.start(listener)
        self._flush_task = asyncio.create_task(self._flush_loop(), name="metrics-flush")
        log.info(
            "forwarder listening",
            extra={
                "event": "listening",
                "plane": self.plane.name,
                "fields": {"address": f"{s.listen_host}:{self.port}", "max_connections": s.max_connections},
            },
        )

    def reload_part(self) -> Part:
        """SIGHUP's part for the link's certificates (``sbxnet.reload``): ``cert_file``, ``key_file`` and
        ``ca_file`` loaded again; live connections keep the context they were accepted with."""
        s = self.settings

        def load() -> object:
            try:
                return self.tls.load()
            except loader.LOAD_ERRORS as e:
                why = loader.diagnose(e, certs=[s.cert_file], keys=[s.key_file], cas=[s.ca_file])
                raise ReloadError(*why, kind=type(e).__name__) from None

        def use(ctx: object) -> None:
            assert isinstance(ctx, ssl.SSLContext)
            self.tls.use(ctx)

        return Part("certificates", load, use, files=(str(s.cert_file), str(s.key_file), str(s.ca_file)))

    @property
    def listener(self) -> socket.socket | None:
        """The TLS listening socket while this process accepts on it (a takeover offers it)."""
        return None if self._draining else self._acceptor.listener

    async def release(self) -> int:
        """Stop accepting on the listening socket, which another process (the one taking over) accepts on:
        the socket stays open here too, so no connect is refused, and what waits in its backlog is the
        other's. Live connections go on. Returns how many there are. Then :meth:`let_go` (the other
        has it) or :meth:`resume` (it failed)."""
        self._draining = True
        await self._acceptor.pause()
        log.info(
            "released the listener",
            extra={"event": "released", "fields": {"open": self._acceptor.open_connections}},
        )
        return self._acceptor.open_connections

    def resume(self) -> None:
        """Accept again on the socket :meth:`release` kept: a takeover failed after its READY."""
        self._draining = False
        self._acceptor.resume()
        log.info("accepting again", extra={"event": "resumed", "fields": {"open": self._acceptor.open_connections}})

    def let_go(self) -> None:
        """Close this process's copy of the listening socket :meth:`release` kept: the process that took
        over serves it."""
        if self._acceptor.listener is not None:
            self._acceptor.listener.close()

    async def wait_connections(self) -> None:
        """Until every live connection has ended by itself (after :meth:`release`: a takeover's old process
        keeps its userspace tunnels, whose TLS state is in its memory, until they end)."""
        await self._acceptor.drain(None)
        if self._adopted:
            await asyncio.wait(set(self._adopted))

    # -- kTLS tunnels adopted from the process this one took over from (takeover.py) ------------------

    def adopt_tunnel(self, tunnel: Tunnel, fds: list[int]) -> None:
        """Take one live kTLS tunnel, paused until :meth:`resume_adopted`: its meter counts what moves
        here from then on, and its end is counted and logged here under its own conn_id. OSError (the
        descriptors stay the caller's) if the plane cannot take it."""
        from forwarder.ingress.planes.ktls import KtlsPlane
        from forwarder.ingress.planes.splice_pump import Detached

        if not isinstance(self.plane, KtlsPlane):
            raise OSError(errno.EINVAL, f"the {self.plane.name} plane adopts no kTLS tunnel")
        d = Detached(*fds, **dict(tunnel.pump))
        meter = self.meter.open(tunnel.sandbox_id, tunnel.conn_id, time.monotonic())
        try:
            conn_id = self.plane.adopt(d, meter)
        except OSError:
            self.meter.close(meter)
            raise
        task = asyncio.create_task(self._serve_adopted(self.plane, conn_id, meter, tunnel))
        self._adopted.add(task)
        task.add_done_callback(self._adopted.discard)

    def resume_adopted(self) -> int:
        from forwarder.ingress.planes.ktls import KtlsPlane

        return self.plane.resume_adopted() if isinstance(self.plane, KtlsPlane) else 0

    def drop_adopted(self) -> int:
        from forwarder.ingress.planes.ktls import KtlsPlane

        return self.plane.drop_adopted() if isinstance(self.plane, KtlsPlane) else 0

    async def _serve_adopted(self, plane: KtlsPlane, conn_id: int, meter: ConnMeter, tunnel: Tunnel) -> None:
        ctx = {"conn_id": tunnel.conn_id, "sandbox_id": tunnel.sandbox_id}
        started = time.monotonic()
        self.metrics.open_connections.inc()
        outcome = Outcome.INTERNAL
        try:
            outcome = await plane.until_end(conn_id)
        except asyncio.CancelledError:
            outcome = Outcome.DRAINED
            raise
        except Exception:
            log.exception("internal error", extra={**ctx, "event": "internal"})
        finally:
            self.metrics.open_connections.dec()
            self.meter.close(meter)
            self._ended += 1
            if outcome is not Outcome.MOVED:  # moved: dropped before it ever ran here
                self.metrics.connections.labels(outcome.value).inc()
                log.info("closed", extra={**ctx, "event": "closed", "fields": {
                    "outcome": outcome.value, "adopted": True, "bytes_up": meter.up, "bytes_down": meter.down,
                    "seconds": round(time.monotonic() - started, 3)}})

    async def drain(self, timeout: float | None = None) -> int:
        """Stop accepting, let live connections finish up to ``timeout``, then cut the rest.
        Returns how many connections had to be cut."""
        timeout = self.settings.drain_timeout if timeout is None else timeout
        self._draining = True
        await self._acceptor.stop_accepting()
        log.info(
            "draining",
            extra={"event": "draining", "fields": {"open": self._acceptor.open_connections, "timeout": timeout}},
        )
        cut = await self._acceptor.drain(timeout)
        if self._adopted:
            _, pending = await asyncio.wait(set(self._adopted), timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            cut += len(pending)
        if self._flush_task:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
        self._flush_bytes()
        log.info("drained", extra={"event": "drained", "fields": {"cut": cut}})
        return cut

    async def _flush_loop(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(1.0)
            self._flush_bytes()
            tick += 1
            self._trim_heap(every=tick % TRIM_EVERY_S == 0)
            if tick % HOST_ADDRESS_REFRESH_S == 0:
                # Addresses come and go (taps, VIPs); the guard must refuse the current ones.
                await self.refresh_host_addresses()

    def _trim_heap(self, *, every: bool) -> None:
        ended = self._ended - self._ended_at_trim
        if ended >= TRIM_AFTER_ENDS or (ended and every):
            self._ended_at_trim = self._ended
            trim_heap(idle=self.open_connections == 0)

    def _flush_bytes(self) -> None:
        up, down = self.meter.totals()
        self.metrics.bytes.labels("up").inc(up - self._flushed[0])
        self.metrics.bytes.labels("down").inc(down - self._flushed[1])
        self._flushed = (up, down)

    # -- one connection ----------------------------------------------------------------------------

    async def _serve(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        conn_id = secrets.token_hex(8)
        peer = f"{addr[0]}:{addr[1]}"
        ctx = {"conn_id": conn_id, "peer": peer}
        self.metrics.open_connections.inc()
        live = False
        try:
            outcome = await self.sequence.run(sock, ctx, self.tls.current, self.policy)
            if isinstance(outcome, LiveTunnel):
                # Its bytes move without this task, which ends here; so does its frames' hold on the
                # preamble's objects. The tunnel keeps the slot until its end (_tunnel_ended).
                self._acceptor.hold(outcome)
                live = True
                return
            self.metrics.connections.labels(outcome.value).inc()
        except asyncio.CancelledError:
            self.metrics.connections.labels(Outcome.DRAINED.value).inc()
            abort(sock)
            raise
        except Exception:
            self.metrics.connections.labels(Outcome.INTERNAL.value).inc()
            log.exception("internal error", extra={**ctx, "event": "internal"})
            abort(sock)
        finally:
            if not live:
                self.metrics.open_connections.dec()
                self._ended += 1

    def _tunnel_ended(self, tunnel: LiveTunnel, outcome: Outcome) -> None:
        """A tunnel :meth:`_serve` handed on has ended (metered and logged already): counted, its slot freed."""
        self.metrics.connections.labels(outcome.value).inc()
        self.metrics.open_connections.dec()
        self._ended += 1
        self._acceptor.let_go(tunnel)
