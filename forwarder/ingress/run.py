"""Running a forwarder process: logging, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT drain (stop accepting, let live connections finish up to ``drain_timeout``);
SIGHUP reloads the link's certificates and the feed's, all or nothing (``sbxnet.reload``: one line per
SIGHUP, naming the file that failed), without touching live connections. With ``workers`` > 1 the supervisor
in ``forwarder.ingress.workers`` starts that many of these processes on one port (SO_REUSEPORT).

With ``feed_url`` set, each process runs the idle feed's reporter (``feed_reporter.py``) over its own
meter, on its own stream (the worker's index; 0 for a single process), from when the listener is up
until after the drain: the bytes of connections that finish while draining are reported too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from certs import loader
from forwarder.ingress.settings import ForwarderSettings
from sbxnet import jsonlog
from sbxnet.reload import Part, ReloadError, reload, wire_signals

if TYPE_CHECKING:
    from forwarder.ingress.feed_reporter import FeedReporter
    from forwarder.ingress.server import ForwarderServer
    from forwarder.ingress.takeover import Taken
    from sbxnet.ops_http import OpsServer

log = logging.getLogger("sbxnet.forwarder")


def serve(settings: ForwarderSettings, *, check_only: bool = False, takeover: bool = False) -> int:
    jsonlog.setup(settings.log_level)
    workers = settings.workers or (os.cpu_count() or 1)
    if settings.data_plane == "ktls":
        from forwarder.ingress.planes.ktls_keys import probe

        # Fail closed, before anything listens: never fall back to the userspace plane by itself.
        result = probe()
        if not result.ok:
            print(result.message(), file=sys.stderr)
            return 1
    try:
        from forwarder.ingress.tls_context import server_context

        server_context(settings)
    except loader.LOAD_ERRORS as e:
        file, why = loader.diagnose(e, certs=[settings.cert_file], keys=[settings.key_file], cas=[settings.ca_file])
        print(f"forwarder: cannot load the TLS material: {file}: {why} (cert_file, key_file, ca_file)",
              file=sys.stderr)
        return 2
    if settings.feed_url is not None:
        from forwarder.ingress.feed_reporter import feed_ssl_context
        from sbxnet.protocol.feed import MAX_STREAM

        try:
            feed_ssl_context(settings)
        except loader.LOAD_ERRORS as e:
            cert, key, ca = settings.feed_files
            file, why = loader.diagnose(e, certs=[cert], keys=[key], cas=[ca])
            print(
                f"forwarder: cannot load the feed's TLS material: {file}: {why} (feed_cert_file, feed_key_file, "
                "feed_ca_file; by default cert_file, key_file and ca_file)",
                file=sys.stderr,
            )
            return 2
        if workers > MAX_STREAM + 1:
            print(f"forwarder: workers = {workers}: at most {MAX_STREAM + 1} can report on the feed", file=sys.stderr)
            return 2
    if check_only:
        print("forwarder: settings and certificates are valid")
        return 0
    if settings.feed_url is None:
        # Once per forwarder, before any worker starts: the scheduler idles a sandbox only on its
        # forwarder's feed, so without one this host's sandboxes are never idled (and never stopped).
        log.warning(
            "no feed_url: this forwarder sends the scheduler no idle feed, so the scheduler never idles its "
            "sandboxes; set feed_url to the scheduler's https://<host>:<port>/v1/feed (docs/forwarder.md)",
            extra={"event": "feed_disabled"},
        )
    elif _feed_key_differs(settings):
        # The scheduler ties a feed to the routes that pin its key (docs/scheduler-api.md "Feed liveness").
        log.warning(
            "feed_cert_file has another key than cert_file: the scheduler takes this feed as another "
            "forwarder's, not the one its routes pin, and never idles this host's sandboxes; use a feed "
            "certificate with cert_file's key, or leave feed_cert_file unset",
            extra={"event": "feed_key_differs"},
        )
    if workers > 1:
        from forwarder.ingress.workers import supervise

        return supervise(settings, workers)
    taken = None
    if takeover:
        from forwarder.ingress.takeover import TakeoverFailed, take_over

        assert settings.takeover_socket is not None  # --takeover sets it
        try:
            # Before any event loop: everything that can fail here fails before the running one is asked.
            taken = take_over(settings.takeover_socket, host=settings.listen_host, port=settings.listen_port,
                              timeout=settings.takeover_timeout)
        except TakeoverFailed as e:
            print(f"forwarder: {e.detail} (the running forwarder keeps serving)", file=sys.stderr)
            return 1
    return run_single(settings, taken=taken)


def run_single(
    settings: ForwarderSettings, *, reuse_port: bool = False, ops: bool = True, stream: int = 0,
    taken: Taken | None = None,
) -> int:
    import uvloop

    return uvloop.run(_main(settings, reuse_port=reuse_port, ops=ops, stream=stream, taken=taken))


async def _start_ops(settings: ForwarderSettings, server: ForwarderServer) -> OpsServer | None:
    """The ops endpoints, or None after printing why they cannot be had."""
    from prometheus_client import generate_latest

    from sbxnet.ops_http import OpsServer

    ops_server = OpsServer(lambda: generate_latest(server.metrics.registry), lambda: server.ready)
    try:
        port = await ops_server.start(str(settings.metrics_host), settings.metrics_port)
    except OSError as e:
        print(
            f"forwarder: cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: "
            f"{e.strerror} (choose another metrics_port, or 0 to disable)",
            file=sys.stderr,
        )
        return None
    log.info(
        "ops endpoints up",
        extra={"event": "ops_listening", "fields": {"address": f"{settings.metrics_host}:{port}"}},
    )
    return ops_server


async def _main(settings: ForwarderSettings, *, reuse_port: bool, ops: bool, stream: int, taken: Taken | None) -> int:
    from forwarder.ingress.server import ForwarderServer
    from forwarder.ingress.takeover import (
        ControlServer,
        TakeoverFailed,
        TunnelMover,
        announce_ready,
        bind_control,
        finish_takeover,
    )
    from forwarder.ingress.takeover_codec import Offer
    from sbxnet.listen import ListenError
    from sbxnet.protocol.feed import MAX_STREAM

    server = ForwarderServer(settings, reuse_port=reuse_port)
    # The signals before the listening line (``server.start``): from then on a SIGHUP reloads (the feed's
    # part joins once its reporter runs) and a SIGTERM drains.
    parts = [server.reload_part()]

    def on_hup() -> None:
        failed = reload(log, parts)
        server.metrics.reloads.labels("failed" if failed else "ok").inc()

    stop = asyncio.Event()
    wire_signals(stop, on_hup)
    want_ops = ops and bool(settings.metrics_port)
    control_sock = None
    if settings.takeover_socket is not None and taken is None:
        try:
            control_sock = bind_control(settings.takeover_socket)
        except TakeoverFailed as e:
            print(f"forwarder: {e.detail}", file=sys.stderr)
            return 1
    stepped_back = asyncio.Event()  # this process's takeover failed: it serves what it has, then exits 1
    # The ops endpoints come up first: /healthz answers as soon as the process is alive, and /readyz
    # says 503 until the listener is up, so an orchestrator never sees a port with no health to ask.
    # A process taking over binds them once the running one has closed its own (after RELEASED).
    ops_server = None
    if want_ops and taken is None:
        ops_server = await _start_ops(settings, server)
        if ops_server is None:
            return 1
    try:
        await server.start(taken.listener if taken else None)
    except ListenError as e:
        print(f"forwarder: {e.detail}", file=sys.stderr)
        if ops_server:
            await ops_server.close()
        return 1
    if taken is not None:
        # No await since the accept loop was made: it has not accepted yet, so a process killed before
        # this line took no connection, and the running one (still accepting) never stopped.
        adopts = server.plane.name == "ktls" and settings.takeover_move_ktls
        announce_ready(taken, tunnels=adopts)
        finished = await finish_takeover(taken, settings.takeover_timeout, server if adopts else None)
        released = finished.released
        stream = taken.offer.stream
        if finished.serving:
            log.info("took over the listener", extra={"event": "takeover_done", "fields": {
                "from_pid": taken.offer.pid, "stream": stream,
                "old_kept_connections": released.open_connections if released else None,
                "tunnels_moved": released.moving if released else 0,
                "released": released is not None}})
            control_sock = taken.control
            if want_ops:
                ops_server = await _start_ops(settings, server)  # absent on failure: the tunnels matter more
        else:
            # The running one lives and serves everything again: this one accepts no more, keeps what it
            # accepted since its READY until that ends, and exits 1.
            await server.release()
            server.let_go()
            if taken.control is not None:
                taken.control.close()
            stepped_back.set()
            log.error("the takeover did not finish; the running forwarder serves on, this one steps back",
                      extra={"event": "takeover_abandoned", "fields": {
                          "from_pid": taken.offer.pid, "released": released is not None,
                          "open": server.open_connections}})
    control = None
    if control_sock is not None:
        own_stream = stream

        def offer() -> tuple[Offer, list[int]] | str:
            lst = server.listener
            if lst is None or control_sock is None:
                return "draining"
            # The new process reports on the next stream: both report while this one's tunnels live on,
            # and one stream carries one epoch at a time.
            return (Offer(os.getpid(), f"{settings.listen_host}:{server.port}", (own_stream + 1) % (MAX_STREAM + 1),
                          ("tls", "control")), [lst.fileno(), control_sock.fileno()])

        async def release() -> int:
            nonlocal ops_server
            kept = await server.release()
            if ops_server is not None:
                await ops_server.close()  # the new process binds the port next
                ops_server = None
            return kept

        async def resume() -> None:
            nonlocal ops_server
            server.resume()
            if want_ops and ops_server is None:
                ops_server = await _start_ops(settings, server)  # absent on failure: serving matters more

        # The ktls plane moves its live tunnels to a new process that can adopt them (their TLS state is
        # in the kernel), where both set takeover_move_ktls; userspace tunnels stay here until they end.
        mover: TunnelMover | None = None
        if server.plane.name == "ktls" and settings.takeover_move_ktls:
            from forwarder.ingress.planes.ktls import KtlsPlane

            assert isinstance(server.plane, KtlsPlane)
            mover = server.plane
        control = ControlServer(control_sock, offer=offer, release=release, resume=resume, let_go=server.let_go,
                                timeout=settings.takeover_timeout, mover=mover)
        control.start()
        log.info("takeover control socket up", extra={"event": "takeover_listening",
                                                       "fields": {"path": str(settings.takeover_socket)}})
    reporter = None
    if settings.feed_url is not None:
        from forwarder.ingress.feed_reporter import reporter_for

        # Made here, in this process: its epoch is this process's own (a worker's, after the fork).
        reporter = reporter_for(settings, server.meter, stream=stream, metrics=server.metrics)
        assert reporter is not None
        reporter.start()

    if reporter is not None:
        parts.append(_feed_part(settings, reporter))
    taken_over = control.taken_over if control is not None else stepped_back
    if not stepped_back.is_set():
        await _first(stop.wait(), taken_over.wait())
    if taken_over.is_set():
        log.info("keeping the live connections until they end", extra={
            "event": "lingering", "fields": {"open": server.open_connections}})
        # Their TLS state is in this process: they end here, or at SIGTERM's drain.
        await _first(stop.wait(), server.wait_connections())
    cut = await server.drain()
    if reporter is not None:
        # After the drain, so what the last connections moved is in the final report.
        await reporter.stop(final_timeout=settings.feed_request_timeout)
    if control is not None:
        handed = control.taken_over.is_set() or control.handing_over
        await control.close()
        if not handed and settings.takeover_socket is not None:
            # Ours to remove; after a takeover (or stopped during one) the path is the new process's.
            with contextlib.suppress(OSError):
                os.unlink(settings.takeover_socket)
    if ops_server:
        await ops_server.close()
    up, down = server.meter.totals()
    log.info("stopped", extra={"event": "stopped", "fields": {
        "cut": cut, "taken_over": control is not None and control.taken_over.is_set(),
        "stepped_back": stepped_back.is_set(), "bytes_up": up, "bytes_down": down}})
    return 1 if stepped_back.is_set() else 0


async def _first(*aws: Coroutine[Any, Any, Any]) -> None:
    """Until the first of ``aws`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _feed_key_differs(settings: ForwarderSettings) -> bool:
    """Whether the feed's certificate has another public key than the link's (unreadable: not said here;
    the start checked both)."""
    if settings.feed_cert_file is None:
        return False
    from cryptography import x509

    from certs.mint import spki_pin

    try:
        pins = {spki_pin(x509.load_pem_x509_certificate(p.read_bytes()))
                for p in (settings.cert_file, settings.feed_cert_file)}
    except (OSError, ValueError):
        return False
    return len(pins) == 2


def _feed_part(settings: ForwarderSettings, reporter: FeedReporter) -> Part:
    """SIGHUP's part for the feed's client certificate (``feed_*_file``, by default the link's files)."""
    from forwarder.ingress.feed_reporter import feed_ssl_context

    cert, key, ca = settings.feed_files

    def load() -> object:
        try:
            return feed_ssl_context(settings)
        except loader.LOAD_ERRORS as e:
            raise ReloadError(*loader.diagnose(e, certs=[cert], keys=[key], cas=[ca]), kind=type(e).__name__) from None

    def use(ctx: object) -> None:
        assert isinstance(ctx, ssl.SSLContext)
        reporter.set_ssl_context(ctx)

    return Part("feed certificates", load, use, files=(str(cert), str(key), str(ca)))
