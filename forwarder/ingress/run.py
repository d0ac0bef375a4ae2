"""Running a forwarder process: logging, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT drain (stop accepting, let live connections finish up to ``drain_timeout``);
SIGHUP reloads certificates without touching live connections. With ``workers`` > 1 the supervisor
in ``forwarder.ingress.workers`` starts that many of these processes on one port (SO_REUSEPORT).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from certs import loader
from forwarder.ingress.settings import ForwarderSettings
from sbxnet import jsonlog

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
    if check_only:
        print("forwarder: settings and certificates are valid")
        return 0
    if workers > 1:
        from forwarder.ingress.workers import supervise

        return supervise(settings, workers)
    return run_single(settings)


def run_single(settings: ForwarderSettings, *, reuse_port: bool = False, ops: bool = True) -> int:
    import uvloop

    return uvloop.run(_main(settings, reuse_port=reuse_port, ops=ops))


async def _main(settings: ForwarderSettings, *, reuse_port: bool, ops: bool) -> int:
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

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    await stop.wait()
    cut = await server.drain()
    if ops_server:
        await ops_server.close()
    log.info("stopped", extra={"event": "stopped", "fields": {"cut": cut}})
    return 0
