"""Running a scheduler process: logging, the store, the event loop, signals, the ops endpoints.

SIGTERM and SIGINT stop it: event streams end at once, the listener closes, requests in flight finish
(aiohttp's shutdown), the timer loop and the webhook sender stop, the store is closed. SIGHUP reloads
what can change safely, all or nothing with one line naming the file that failed (``sbxnet.reload``):
the server certificate, its key and the client CA (new handshakes use them; ``ServerTls``), the admin
token file and the webhook secret file. The database, the listener and the webhook's URL and CA are
read at start.

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
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sbxnet.reload import Part, ReloadError, reload, wire_signals
from scheduler.settings import SchedulerSettings
from scheduler.store import Store
from scheduler.store_thread import StoreThread

if TYPE_CHECKING:
    from scheduler.webhook import WebhookSender

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


SQLITE_HEADER = b"SQLite format 3\x00"


def check_store(settings: SchedulerSettings) -> str:
    """``--check``'s look at the store, changing nothing on disk or in the database: an SQLite file that
    exists must be an SQLite database this process may write (its header is read, nothing opened), one
    that does not must be creatable (its nearest existing directory writable); a PostgreSQL server must
    accept a connection (``SELECT 1``, no schema made). Returns what it found; raises StoreError."""
    import os

    from scheduler.store import StoreError

    path = settings.sqlite_path
    if path is None:
        import psycopg

        try:
            with psycopg.connect(settings.database, connect_timeout=5, autocommit=True) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as e:
            raise StoreError("open", f"cannot connect to the database: {str(e).strip()}") from None
        return "the database answers"
    if path.exists():
        if not path.is_file():
            raise StoreError("open", f"{path} is not a file")
        try:
            with path.open("rb") as f:
                head = f.read(len(SQLITE_HEADER))
        except OSError as e:
            raise StoreError("open", f"{path}: {e.strerror}") from None
        if head and head != SQLITE_HEADER:
            raise StoreError("open", f"{path} is not an SQLite database")
        if not os.access(path, os.R_OK | os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
            raise StoreError("open", f"{path}: this user cannot write it and its directory (WAL files live beside it)")
        return f"the SQLite database {path} exists"
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise StoreError("open", f"{path} does not exist and cannot be created: {existing} is not a writable directory")
    return f"the SQLite database {path} will be created at start"


def server_tls(settings: SchedulerSettings) -> ssl.SSLContext:
    """TLS 1.3; a client certificate is asked for (gateways, forwarders) but not required (the platform
    calls with a bearer token); one that does not chain to ``ca_file`` fails the handshake."""
    from certs.loader import server_context

    ctx = server_context(cert_file=settings.cert_file, key_file=settings.key_file, ca_file=settings.ca_file)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class ServerTls:
    """The listener's context, never replaced: at each handshake its SNI callback (called with or without
    a server name) switches the connection to the current context, which SIGHUP reloads."""

    def __init__(self, settings: SchedulerSettings) -> None:
        from certs.loader import Reloadable

        self.settings = settings
        self._set = Reloadable(lambda: server_tls(settings))
        self.context = server_tls(settings)
        self.context.sni_callback = self._on_hello

    def _on_hello(self, obj: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _ctx: ssl.SSLContext) -> None:
        obj.context = self._set.current

    def part(self) -> Part:
        from certs.loader import LOAD_ERRORS, diagnose

        s = self.settings

        def load() -> object:
            try:
                return self._set.load()
            except LOAD_ERRORS as e:
                why = diagnose(e, certs=[s.cert_file], keys=[s.key_file], cas=[s.ca_file])
                raise ReloadError(*why, kind=type(e).__name__) from None

        def use(ctx: object) -> None:
            assert isinstance(ctx, ssl.SSLContext)
            self._set.use(ctx)

        return Part("certificates", load, use, files=(str(s.cert_file), str(s.key_file), str(s.ca_file)))


def _token_part(path: Path, use: Callable[[str], None]) -> Part:
    from certs.tokens import TokenFileError, read_token_file, token_sha256

    def load() -> object:
        try:
            return token_sha256(read_token_file(path))
        except TokenFileError as e:
            raise ReloadError(str(path), str(e).replace(f"{path} ", "").replace(f" {path}", ""),
                              kind="token_file") from None

    return Part("admin token", load, lambda digest: use(str(digest)), files=(str(path),))


def read_secret(path: Path) -> bytes:
    """The webhook's HMAC key: the file's bytes, surrounding whitespace (its trailing newline) removed, as
    every token file is read; OSError, or ValueError when empty."""
    secret = path.read_bytes().strip()
    if not secret:
        raise ValueError("empty")
    return secret


def webhook_secret(settings: SchedulerSettings) -> bytes | None:
    """``webhook_secret_file``'s key at start, or ConfigError naming the setting and the file."""
    path = settings.webhook_secret_file
    if path is None:
        return None
    try:
        return read_secret(path)
    except (OSError, ValueError) as e:
        from sbxnet.errors import ConfigError

        why = e.strerror if isinstance(e, OSError) else str(e)
        raise ConfigError(f"config: scheduler.webhook_secret_file: {path}: {why}") from None


def _secret_part(path: Path, webhook: WebhookSender) -> Part:
    def load() -> object:
        try:
            return read_secret(path)
        except OSError as e:
            raise ReloadError(str(path), e.strerror or str(e), kind="unreadable") from None
        except ValueError as e:
            raise ReloadError(str(path), str(e), kind="empty") from None

    def use(secret: object) -> None:
        assert isinstance(secret, bytes)
        webhook.secret = secret

    return Part("webhook secret", load, use, files=(str(path),))


def serve(settings: SchedulerSettings, *, check_only: bool = False) -> int:
    from sbxnet import jsonlog

    jsonlog.setup(settings.log_level)
    from certs.loader import LOAD_ERRORS, diagnose
    from sbxnet.errors import SbxnetError

    try:
        server_tls(settings)
    except LOAD_ERRORS as e:
        file, why = diagnose(e, certs=[settings.cert_file], keys=[settings.key_file], cas=[settings.ca_file])
        print(f"scheduler: cannot load the TLS material: {file}: {why} (cert_file, key_file, ca_file)",
              file=sys.stderr)
        return 2
    try:
        settings.admin_hash()
        webhook_secret(settings)
        if check_only:
            found = check_store(settings)
        else:
            open_store(settings).close()  # it opens (creating it if new); then again on its own thread
    except OSError as e:  # the SQLite database's directory could not be made
        print(f"scheduler: cannot open the store: {e}", file=sys.stderr)
        return 1
    except SbxnetError as e:
        # a settings error reads as the loader's do ("config: <table>.<field>: ..."); others are the scheduler's
        print(str(e) if e.reason == "config" else f"scheduler: {e.detail or e}", file=sys.stderr)
        return 2 if e.reason.startswith("config") else 1
    if check_only:
        print(f"scheduler: settings and certificates are valid; {found}")
        return 0
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
        secret = webhook_secret(settings)
        wctx = ssl.create_default_context(cafile=str(settings.webhook_ca_file) if settings.webhook_ca_file else None)
        webhook = WebhookSender(store, settings.webhook_url, news=service.new_events, worker=worker, secret=secret,
                                ssl_context=wctx)
    runner = web.AppRunner(api.app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    tls = ServerTls(settings)
    try:
        site = web.TCPSite(runner, str(settings.listen_host), settings.listen_port, ssl_context=tls.context,
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
    # The signals before the listening line: from then on a SIGHUP reloads and a SIGTERM stops.
    parts = [tls.part()]
    if settings.admin_token_file is not None:
        parts.append(_token_part(settings.admin_token_file, api.set_admin_hash))
    if webhook is not None and settings.webhook_secret_file is not None:
        parts.append(_secret_part(settings.webhook_secret_file, webhook))
    stop = asyncio.Event()
    wire_signals(stop, lambda: reload(log, parts))
    log.info("scheduler listening", extra={"event": "listening", "fields": {
        "address": f"{settings.listen_host}:{port}", "database": settings.database.split("@")[-1],
        "sandboxes": len(service.core), "driver": "webhook" if webhook else "none (wakes complete at once)"}})
    await stop.wait()
    log.info("stopping", extra={"event": "stopping"})
    api.close_streams()
    await runner.cleanup()
    await service.stop()
    if webhook is not None:
        await webhook.stop()
    if ops is not None:
        await ops.close()
    log.info("stopped", extra={"event": "stopped"})
    return 0
