"""Running a scheduler process: logging, the store, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT stop it: the listener closes, requests in flight finish (aiohttp's shutdown), the
timer loop and the webhook sender stop, the store is closed.

The store is opened, used and closed on the service's store thread (``store_thread.StoreThread``), and a
second connection to it for the reads that must not wait behind a write (route lookups, status on a
shared store, the event stream) on a thread of its own: the event loop never calls the store.

Nothing is lost by stopping: every change was committed before it was answered, and undelivered
webhooks are sent after the next start.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import ssl
import sys

from scheduler.settings import SchedulerSettings
from scheduler.store import Store
from scheduler.store_thread import StoreThread

log = logging.getLogger("sbxnet.scheduler")


def open_store(settings: SchedulerSettings) -> Store:
    """The store the settings name; raises StoreError when it cannot be opened."""
    path = settings.sqlite_path
    if path is not None:
        from scheduler.sqlite_store import SqliteStore

        path.parent.mkdir(parents=True, exist_ok=True)
        return SqliteStore(path, synchronous=settings.sqlite_synchronous)
    from scheduler.pg_store import PgStore

    return PgStore(settings.database)


def server_tls(settings: SchedulerSettings) -> ssl.SSLContext:
    """TLS 1.3; a client certificate is asked for (gateways, forwarders) but not required (the platform
    calls with a bearer token); one that does not chain to ``ca_file`` fails the handshake."""
    from certs.loader import server_context

    ctx = server_context(cert_file=settings.cert_file, key_file=settings.key_file, ca_file=settings.ca_file)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def serve(settings: SchedulerSettings, *, check_only: bool = False) -> int:
    from sbxnet import jsonlog

    jsonlog.setup(settings.log_level)
    from certs.loader import LOAD_ERRORS
    from sbxnet.errors import SbxnetError

    try:
        server_tls(settings)
        settings.admin_hash()
        store = open_store(settings)
    except LOAD_ERRORS as e:
        print(f"scheduler: cannot load the TLS material ({e}); check cert_file, key_file and ca_file",
              file=sys.stderr)
        return 2
    except SbxnetError as e:
        print(f"scheduler: {e.detail or e}", file=sys.stderr)
        return 2 if e.reason.startswith("config") else 1
    if check_only:
        store.close()
        print("scheduler: settings, certificates and the store are valid")
        return 0
    store.close()  # checked; it is opened again on its own thread
    import uvloop

    return uvloop.run(_main(settings))


async def _main(settings: SchedulerSettings) -> int:
    from sbxnet.errors import SbxnetError

    worker, reader_thread = StoreThread(), StoreThread("sbxnet-store-read")
    stores: list[tuple[StoreThread, Store]] = []
    try:
        for thread in (worker, reader_thread):
            stores.append((thread, await thread.run(open_store, settings)))
        return await _serve(settings, worker, stores[0][1], reader_thread, stores[1][1])
    except SbxnetError as e:
        print(f"scheduler: {e.detail or e}", file=sys.stderr)
        return 1
    finally:
        for thread, store in stores:
            await thread.run(store.close)
        worker.close()
        reader_thread.close()


GC_YOUNG_THRESHOLD = 20_000  # container allocations between collections of the youngest generation


def _settle_heap() -> None:
    """Take what is in memory now (the timer core, the stores' caches: a few objects per sandbox, millions
    at 100,000 sandboxes) out of the garbage collector's full collections. They live as long as the
    process and hold no reference cycles, and each full collection walked them all (0.4-0.5 s at 100,000
    sandboxes, every few seconds under the feed's load: a tenth of the scheduler's CPU); freed by their
    reference counts they still are. And collect the young less often: a feed batch allocates a few
    thousand containers that live until it is applied (a second or two under load), which the default
    threshold (700) walked again and again in every young collection until they moved to the old."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


async def _serve(settings: SchedulerSettings, worker: StoreThread, store: Store, reader_thread: StoreThread,
                 reader: Store) -> int:
    from aiohttp import web
    from prometheus_client import generate_latest

    from sbxnet.ops_http import OpsServer
    from scheduler.api_http import Api
    from scheduler.metrics import registry_for
    from scheduler.service import SchedulerService
    from scheduler.store import load_core
    from scheduler.webhook import WebhookSender

    core = await worker.run(load_core, store)
    _settle_heap()
    service = SchedulerService(store, forwarder_allow=settings.forwarder_san_allow,
                               auto_ready=settings.webhook_url is None, resync_s=settings.resync_s,
                               source_stale_s=settings.source_stale_s, feed_stale_s=settings.feed_stale_s,
                               worker=worker, reader=reader,
                               reader_thread=reader_thread, core=core)
    api = Api(service, admin_token_sha256=settings.admin_hash(), gateway_allow=settings.gateway_san_allow,
              route_cache_s=settings.route_cache_s, negative_cache_s=settings.negative_cache_s)
    webhook = None
    if settings.webhook_url is not None:
        secret = settings.webhook_secret_file.read_bytes().strip() if settings.webhook_secret_file else None
        wctx = ssl.create_default_context(cafile=str(settings.webhook_ca_file) if settings.webhook_ca_file else None)
        webhook = WebhookSender(store, settings.webhook_url, news=service.new_events, worker=worker, secret=secret,
                                ssl_context=wctx)
    runner = web.AppRunner(api.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, str(settings.listen_host), settings.listen_port, ssl_context=server_tls(settings),
                           reuse_address=True)
        await site.start()
    except OSError as e:
        await runner.cleanup()
        print(f"scheduler: cannot listen on {settings.listen_host}:{settings.listen_port}: {e.strerror} "
              "(another process holds it? choose another listen_port / SBXNET_SCHEDULER_LISTEN_PORT)",
              file=sys.stderr)
        return 1
    ops = None
    if settings.metrics_port:
        reg = registry_for(api, webhook)
        ops = OpsServer(lambda: generate_latest(reg), lambda: True)
        try:
            await ops.start(str(settings.metrics_host), settings.metrics_port)
        except OSError as e:
            await runner.cleanup()
            print(f"scheduler: cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: "
                  f"{e.strerror} (choose another metrics_port, or 0 to disable)", file=sys.stderr)
            return 1
    service.start()
    if webhook is not None:
        webhook.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else settings.listen_port
    log.info("scheduler listening", extra={"event": "listening", "fields": {
        "address": f"{settings.listen_host}:{port}", "database": settings.database.split("@")[-1],
        "sandboxes": len(service.core), "driver": "webhook" if webhook else "none (wakes complete at once)"}})
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    log.info("stopping", extra={"event": "stopping"})
    await runner.cleanup()
    await service.stop()
    if webhook is not None:
        await webhook.stop()
    if ops is not None:
        await ops.close()
    log.info("stopped", extra={"event": "stopped"})
    return 0
