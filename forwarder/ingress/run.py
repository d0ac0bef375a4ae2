"""Running a forwarder process: logging, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT drain (stop accepting, let live connections finish up to ``drain_timeout``);
SIGHUP reloads certificates without touching live connections. With ``workers`` > 1 the supervisor
in ``forwarder.ingress.workers`` starts that many of these processes on one port (SO_REUSEPORT).

With ``feed_url`` set, each process runs the idle feed's reporter (``feed_reporter.py``) over its own
meter, on its own stream (the worker's index; 0 for a single process), from when the listener is up
until after the drain: the bytes of connections that finish while draining are reported too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from certs import loader
from forwarder.ingress.settings import ForwarderSettings
from sbxnet import jsonlog

if TYPE_CHECKING:
    from forwarder.ingress.feed_reporter import FeedReporter
    from forwarder.ingress.server import ForwarderServer

log = logging.getLogger("sbxnet.forwarder")


def serve(settings: ForwarderSettings, *, check_only: bool = False) -> int:
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
        print(f"forwarder: cannot load the TLS material ({e}); check cert_file, key_file and ca_file", file=sys.stderr)
        return 2
    if settings.feed_url is not None:
        from forwarder.ingress.feed_reporter import feed_ssl_context
        from sbxnet.protocol.feed import MAX_STREAM

        try:
            feed_ssl_context(settings)
        except loader.LOAD_ERRORS as e:
            print(
                f"forwarder: cannot load the feed's TLS material ({e}); check feed_cert_file, feed_key_file and "
                "feed_ca_file (by default cert_file, key_file and ca_file)",
                file=sys.stderr,
            )
            return 2
        if workers > MAX_STREAM + 1:
            print(f"forwarder: workers = {workers}: at most {MAX_STREAM + 1} can report on the feed", file=sys.stderr)
            return 2
    if check_only:
        print("forwarder: settings and certificates are valid")
        return 0
    if workers > 1:
        from forwarder.ingress.workers import supervise

        return supervise(settings, workers)
    return run_single(settings)


def run_single(settings: ForwarderSettings, *, reuse_port: bool = False, ops: bool = True, stream: int = 0) -> int:
    import uvloop

    return uvloop.run(_main(settings, reuse_port=reuse_port, ops=ops, stream=stream))


async def _main(settings: ForwarderSettings, *, reuse_port: bool, ops: bool, stream: int) -> int:
    from prometheus_client import generate_latest

    from forwarder.ingress.server import ForwarderServer
    from sbxnet.listen import ListenError
    from sbxnet.ops_http import OpsServer

    server = ForwarderServer(settings, reuse_port=reuse_port)
    # The ops endpoints come up first: /healthz answers as soon as the process is alive, and /readyz
    # says 503 until the listener is up, so an orchestrator never sees a port with no health to ask.
    ops_server = None
    if ops and settings.metrics_port:
        ops_server = OpsServer(lambda: generate_latest(server.metrics.registry), lambda: server.ready)
        try:
            port = await ops_server.start(str(settings.metrics_host), settings.metrics_port)
        except OSError as e:
            print(
                f"forwarder: cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: "
                f"{e.strerror} (choose another metrics_port, or 0 to disable)",
                file=sys.stderr,
            )
            return 1
        log.info(
            "ops endpoints up",
            extra={"event": "ops_listening", "fields": {"address": f"{settings.metrics_host}:{port}"}},
        )
    try:
        await server.start()
    except ListenError as e:
        print(f"forwarder: {e.detail}", file=sys.stderr)
        if ops_server:
            await ops_server.close()
        return 1
    reporter = None
    if settings.feed_url is not None:
        from forwarder.ingress.feed_reporter import reporter_for

        # Made here, in this process: its epoch is this process's own (a worker's, after the fork).
        reporter = reporter_for(settings, server.meter, stream=stream, metrics=server.metrics)
        assert reporter is not None
        reporter.start()

    def reload() -> None:
        server.reload()
        if reporter is not None:
            _reload_feed(settings, server, reporter)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    await stop.wait()
    cut = await server.drain()
    if reporter is not None:
        # After the drain, so what the last connections moved is in the final report.
        await reporter.stop(final_timeout=settings.feed_request_timeout)
    if ops_server:
        await ops_server.close()
    log.info("stopped", extra={"event": "stopped", "fields": {"cut": cut}})
    return 0


def _reload_feed(settings: ForwarderSettings, server: ForwarderServer, reporter: FeedReporter) -> None:
    from forwarder.ingress.feed_reporter import feed_ssl_context

    try:
        ctx = feed_ssl_context(settings)
    except loader.LOAD_ERRORS as e:
        server.metrics.reloads.labels("feed_failed").inc()
        log.error(
            "feed certificate reload failed; keeping the current ones",
            extra={"event": "feed_reload_failed", "reason": type(e).__name__, "fields": {"error": str(e)}},
        )
        return
    reporter.set_ssl_context(ctx)
    server.metrics.reloads.labels("feed_ok").inc()
