"""Running a gateway process: logging, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT drain (``GatewayServer.drain``: stop accepting, close idle HTTP connections in order,
GOAWAY to HTTP/2, ``Connection: close`` on the answers in flight, return once the last connection is gone or
cut what is left, upgrades and raw TCP among them, at ``drain_timeout``); SIGHUP
reloads the client-facing certificates (and client CA), the link's client certificate (``upstream_*``), the
scheduler client's (``scheduler_*``) and the routes file, all or nothing (``sbxnet.reload``): if one fails
to load, all are kept as they were and one line names the file.
With ``workers`` > 1 the supervisor in ``sbxnet.supervisor`` starts that many of these processes
(``gateway.worker``) on one port (SO_REUSEPORT), serves the ops endpoints with their metrics summed, and
passes the signals on. Each worker has its own route source, route cache and wake coalescing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import sys
from dataclasses import replace

from gateway.route_source import StaticRoutes
from gateway.scheduler_routes import SchedulerRoutes
from gateway.server import GatewayConfig, GatewayServer
from gateway.settings import GatewaySettings
from sbxnet import jsonlog
from sbxnet.errors import SbxnetError
from sbxnet.reload import Part, ReloadError, reload, wire_signals

log = logging.getLogger("sbxnet.gateway")


def route_source(s: GatewaySettings) -> StaticRoutes | SchedulerRoutes:
    """The routes file, or the scheduler's client (its certificate the link's unless set apart)."""
    if s.routes_file is not None:
        return StaticRoutes(s.routes_file)
    assert s.scheduler_url is not None
    return SchedulerRoutes(s.scheduler_url, scheduler_context(s), timeout_s=s.scheduler_timeout)


def scheduler_files(s: GatewaySettings) -> tuple[str, str, str]:
    """The scheduler client's certificate, key and CA: ``scheduler_*``, each the link's unless set apart."""
    return (str(s.scheduler_cert_file or s.upstream_cert_file), str(s.scheduler_key_file or s.upstream_key_file),
            str(s.scheduler_ca_file or s.upstream_ca_file))


def scheduler_context(s: GatewaySettings) -> ssl.SSLContext:
    from certs.loader import client_context

    cert, key, ca = scheduler_files(s)
    ctx = client_context(cert_file=cert, key_file=key, ca_file=ca)
    ctx.check_hostname = True  # the scheduler is one service reached by name: its certificate must name it
    return ctx


def build_config(settings: GatewaySettings) -> GatewayConfig:
    """Everything the server needs, loaded from the settings; raises what loading certificates and the
    routes file raises (certs.loader.LOAD_ERRORS, EnvironmentFault)."""
    from certs.loader import client_context
    from gateway.auth import AuthConfig
    from gateway.names import Names
    from gateway.tls_front import CertPair, FrontTls
    from gateway.upstream import UpstreamPolicy

    s = settings
    return GatewayConfig(
        names=Names(s.domain, listen_port=s.listen_port),
        front=FrontTls([CertPair(c, k) for c, k in zip(s.cert_files, s.key_files, strict=True)],
                       client_ca_file=s.client_ca_file),
        routes=route_source(s),
        upstream=UpstreamPolicy(
            client_context(cert_file=s.upstream_cert_file, key_file=s.upstream_key_file, ca_file=s.upstream_ca_file)
        ),
        auth=AuthConfig(header=s.token_header.encode(), cookie=s.token_cookie.encode(),
                        query_param=s.token_param.encode()),
        handshake_timeout=s.handshake_timeout,
        header_timeout=s.header_timeout,
        idle_timeout=s.idle_timeout,
        websocket_idle_timeout=s.websocket_idle_timeout,
        tcp_idle_timeout=s.tcp_idle_timeout,
        max_header_bytes=s.max_header_bytes,
        max_connections=s.max_connections,
        max_connections_per_sandbox=s.max_connections_per_sandbox,
        wake_wait=s.wake_wait,
        route_stale_s=s.route_stale_s,
        pool_size=s.upstream_pool_size,
        pool_idle=s.upstream_pool_idle,
        pool_max=s.upstream_pool_max,
    )


def tls_files(s: GatewaySettings) -> dict[str, list[str]]:
    """Every certificate, key and CA file the gateway loads, certificates and keys paired in order (for
    ``certs.loader.diagnose``)."""
    sched_cert, sched_key, sched_ca = scheduler_files(s)
    certs = [*s.cert_files, sched_cert, s.upstream_cert_file]
    keys = [*s.key_files, sched_key, s.upstream_key_file]
    cas = [s.client_ca_file, sched_ca, s.upstream_ca_file]
    return {"certs": [str(f) for f in certs], "keys": [str(f) for f in keys],
            "cas": [str(f) for f in cas if f is not None]}


def serve(settings: GatewaySettings, *, check_only: bool = False) -> int:
    jsonlog.setup(settings.log_level)
    from certs.loader import LOAD_ERRORS, diagnose
    from sbxnet.errors import SbxnetError

    try:
        build_config(settings)
    except LOAD_ERRORS as e:
        file, why = diagnose(e, **tls_files(settings))
        print(f"gateway: cannot load the TLS material: {file}: {why} (cert_files, key_files, client_ca_file, "
              "upstream_*, scheduler_*)", file=sys.stderr)
        return 2
    except SbxnetError as e:
        print(f"gateway: {e.detail or e}", file=sys.stderr)
        return 2
    if check_only:
        print("gateway: settings, certificates and routes are valid")
        return 0
    workers = settings.workers or (os.cpu_count() or 1)
    if workers > 1:
        from sbxnet.supervisor import WorkerPlan, supervise

        s = settings
        return supervise(WorkerPlan(
            component="gateway",
            worker_module="gateway.worker",
            settings_json=json.dumps(s.model_dump(mode="json")),
            workers=workers,
            listen_host=str(s.listen_host),
            listen_port=s.listen_port,
            port_setting="listen_port / SBXNET_GATEWAY_LISTEN_PORT",
            metrics_host=str(s.metrics_host),
            metrics_port=s.metrics_port,
            stop_grace=s.drain_timeout + 5,
        ))
    return run_single(settings)


def run_single(settings: GatewaySettings, *, reuse_port: bool = False, ops: bool = True) -> int:
    """One gateway process until SIGTERM or SIGINT: alone (``reuse_port`` False, its own ops endpoints), or
    as a supervisor's worker (SO_REUSEPORT on the listen port, no ops endpoints: the supervisor serves them)."""
    import uvloop

    return uvloop.run(_main(settings, reuse_port=reuse_port, ops=ops))


async def _main(settings: GatewaySettings, *, reuse_port: bool, ops: bool) -> int:
    from prometheus_client import generate_latest

    from sbxnet.listen import ListenError, bind_listener
    from sbxnet.ops_http import OpsServer

    config = build_config(settings)
    server = GatewayServer(config)
    ops_server = None
    if ops and settings.metrics_port:
        ops_server = OpsServer(lambda: generate_latest(server.metrics.registry), lambda: server.ready)
        try:
            port = await ops_server.start(str(settings.metrics_host), settings.metrics_port)
        except OSError as e:
            print(f"gateway: cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: {e.strerror} "
                  "(choose another metrics_port, or 0 to disable)", file=sys.stderr)
            return 1
        log.info("ops endpoints up", extra={"event": "ops_listening",
                                             "fields": {"address": f"{settings.metrics_host}:{port}"}})
    try:
        listener = bind_listener(str(settings.listen_host), settings.listen_port, reuse_port=reuse_port,
                                 setting="listen_port / SBXNET_GATEWAY_LISTEN_PORT")
    except ListenError as e:
        print(f"gateway: {e.detail}", file=sys.stderr)
        if ops_server:
            await ops_server.close()
        return 1
    # The signals before the listening line: from then on a SIGHUP reloads and a SIGTERM drains.
    stop = asyncio.Event()
    parts = reload_parts(settings, server)
    wire_signals(stop, lambda: reload(log, parts))
    await server.start(listener)
    log.info("gateway listening", extra={"event": "listening",
                                         "fields": {"address": f"{settings.listen_host}:{server.port}",
                                                    "domain": settings.domain}})
    loop = asyncio.get_running_loop()
    await stop.wait()
    log.info("draining", extra={"event": "draining", "fields": {"open": server.open_connections}})
    started = loop.time()
    cut = await server.drain(settings.drain_timeout)
    drained_s = round(loop.time() - started, 3)
    if isinstance(config.routes, SchedulerRoutes):
        await config.routes.close()
    if ops_server:
        await ops_server.close()
    log.info("stopped", extra={"event": "stopped", "fields": {"cut": cut, "drain_seconds": drained_s}})
    return 0


def reload_parts(settings: GatewaySettings, server: GatewayServer) -> list[Part]:
    """What SIGHUP reloads: the client-facing certificates (and the client CA), the link's client
    certificate (new links, and the warm pool drained), the scheduler client's (new lookups and wakes) if
    routes come from the scheduler, or the routes file if they come from one."""
    from certs.loader import LOAD_ERRORS, client_context, diagnose

    config = server.config
    certs = [str(f) for f in settings.cert_files]
    keys = [str(f) for f in settings.key_files]
    cas = [str(settings.client_ca_file)] if settings.client_ca_file is not None else []
    front = config.front

    def load_front() -> object:
        try:
            return front.load()
        except LOAD_ERRORS as e:
            raise ReloadError(*diagnose(e, certs=certs, keys=keys, cas=cas), kind=type(e).__name__) from None

    link = (str(settings.upstream_cert_file), str(settings.upstream_key_file), str(settings.upstream_ca_file))

    def load_link() -> object:
        cert, key, ca = link
        try:
            return client_context(cert_file=cert, key_file=key, ca_file=ca)
        except LOAD_ERRORS as e:
            raise ReloadError(*diagnose(e, certs=[cert], keys=[key], cas=[ca]), kind=type(e).__name__) from None

    def use_link(ctx: object) -> None:
        # Links opened from now on present it; live ones keep theirs, the warm pool is drained.
        assert isinstance(ctx, ssl.SSLContext)
        config.upstream = replace(config.upstream, context=ctx)
        if server.pool is not None:
            server.pool.use_context(ctx)

    parts = [Part("certificates", load_front, front.use, files=(*certs, *keys, *cas)),
             Part("link client certificate", load_link, use_link, files=link)]
    routes = config.routes
    if isinstance(routes, SchedulerRoutes):
        scheduler = routes
        sched = scheduler_files(settings)

        def load_scheduler() -> object:
            try:
                return scheduler_context(settings)
            except LOAD_ERRORS as e:
                cert, key, ca = sched
                raise ReloadError(*diagnose(e, certs=[cert], keys=[key], cas=[ca]), kind=type(e).__name__) from None

        def use_scheduler(ctx: object) -> None:
            assert isinstance(ctx, ssl.SSLContext)
            scheduler.use_ssl_context(ctx)

        parts.append(Part("scheduler client certificate", load_scheduler, use_scheduler, files=sched))
    if isinstance(routes, StaticRoutes):
        static = routes

        def load_routes() -> object:
            try:
                return static.load()
            except SbxnetError as e:
                raise ReloadError(str(static.path), e.detail or str(e), kind=e.reason) from None

        parts.append(Part("routes file", load_routes, static.use, files=(str(static.path),)))
    return parts
