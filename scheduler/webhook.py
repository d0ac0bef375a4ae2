"""The platform's webhook: every event to ``idle`` or ``waking`` (``store.WEBHOOK_STATES``) POSTed to one URL,
at least once, in the order they happened (docs/scheduler-api.md "Status and events", "Wake").

The events come from the store's log, not from memory, so an event survives a restart until it is
delivered, and on a shared store each event is sent by one replica: ``claim_webhooks`` leases a run of
events to this sender (``owner``) for ``lease_s``; a replica that dies mid-delivery lets its lease run
out and another sends them. Delivery is at least once (an answer lost after the platform acted means
a resend): each body carries the event's ``id`` so the platform can drop a repeat.

A body is the event's JSON plus ``id``; with a secret, ``X-Sbxnet-Signature: sha256=<hex HMAC-SHA256 of
the body>`` lets the platform check it came from us. A 2xx marks the event delivered. Anything else (a
status, a time-out, a refused connection) is retried after a capped, jittered backoff (0.25 s doubling
to 10 s), and nothing later is sent before it, so the platform sees a sandbox's ``idle`` before its
``waking``.

The store is called on the scheduler's store thread (``worker``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import random
import ssl
import time
import uuid
from collections.abc import Callable

import aiohttp

from scheduler.store import Store, StoredEvent, StoreError
from scheduler.store_thread import StoreThread

log = logging.getLogger("sbxnet.scheduler")

BACKOFF_INITIAL_S = 0.25
BACKOFF_CAP_S = 10.0
POLL_S = 1.0  # look at the log this often even without news (events another replica committed)


def body_of(stored: StoredEvent) -> bytes:
    return json.dumps({"id": stored.id, **stored.event.to_json()}, separators=(",", ":"), sort_keys=True).encode()


def signature(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class WebhookSender:
    def __init__(
        self,
        store: Store,
        url: str,
        *,
        news: Callable[[], asyncio.Event],
        worker: StoreThread,
        secret: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 5.0,
        lease_s: float = 30.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.worker = worker  # the thread ``store`` is used on (the service's)
        self.url = url
        self.secret = secret
        self._news = news
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.lease_s = lease_s
        self._now = now
        self.owner = uuid.uuid4().hex
        self._task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failures: dict[str, int] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-webhook")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True, limit=4)
        async with aiohttp.ClientSession(connector=connector, timeout=self._timeout) as session:
            while True:
                news = self._news()
                try:
                    batch = await self.worker.run(self.store.claim_webhooks, self.owner, self._now(), self.lease_s)
                except StoreError as e:
                    self._fail(f"store_{e.reason}")
                    batch = []
                ok = True
                for stored in batch:
                    ok = await self._send(session, stored)
                    if not ok:
                        break
                if not ok:
                    await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                    backoff = min(backoff * 2, BACKOFF_CAP_S)
                    continue
                backoff = BACKOFF_INITIAL_S
                if batch:
                    continue  # there may be more than one claim's worth
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(news.wait(), POLL_S)

    async def _send(self, session: aiohttp.ClientSession, stored: StoredEvent) -> bool:
        body = body_of(stored)
        headers = {"Content-Type": "application/json"}
        if self.secret is not None:
            headers["X-Sbxnet-Signature"] = signature(self.secret, body)
        try:
            async with session.post(self.url, data=body, headers=headers) as resp:
                await resp.read()
                if not 200 <= resp.status < 300:
                    self._fail(f"status_{resp.status}")
                    return False
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._fail(type(e).__name__)
            return False
        try:
            await self.worker.run(self.store.mark_delivered, [stored.id])
        except StoreError as e:
            # Sent but not marked: it will be sent again (the platform drops the repeat by id).
            self._fail(f"store_{e.reason}")
            return False
        self.delivered += 1
        return True

    def _fail(self, reason: str) -> None:
        first = not self.failures
        self.failures[reason] = self.failures.get(reason, 0) + 1
        if first or self.failures[reason] in (1, 10, 100, 1000):
            log.warning("webhook delivery failed; retrying", extra={"event": "webhook_failed", "reason": reason,
                                                                   "fields": {"url": self.url}})
