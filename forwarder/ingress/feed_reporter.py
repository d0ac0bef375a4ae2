"""The forwarder's HTTP adapter for the idle feed: a task that drives the ``Outbox`` (``feed_outbox.py``)
against the scheduler's ``POST /v1/feed``.

Each ``interval`` it takes the meter's deltas (``Meter.take``, the only call it makes on the data
path's state: synchronous, no I/O) into the outbox, and reports them even when there are none (an empty
batch: the scheduler idles a sandbox only while its forwarder's feed is live); then, while ``next_body``
gives a body, it POSTs it over one ``aiohttp.ClientSession`` with a timeout per request. A 200 or 409 whose body
``pull_answer`` accepts goes to ``on_answer``; any other status, a refused answer body, a timeout or a
connection or TLS error goes to ``on_failure`` with a counted reason. While backing off it sleeps until
``outbox.wake_at()`` (or the next interval, whichever is first), still taking deltas every interval so the
meter's memory stays bounded (the outbox merges them per sandbox).

Nothing here makes the data path wait. ``take`` is the one per-sandbox step on the event loop (it
reads the planes' meters, which only the loop may touch); the outbox's per-sandbox work (merging,
freezing, ``push_columns``, an answer's bookkeeping) runs in a thread of the reporter's own, one call at
a time and awaited, so nothing else touches the outbox meanwhile; at 10,000 sandboxes those calls take a
few milliseconds that the loop would otherwise not get back (bench/bench_feed_cpu.py). A scheduler that
never answers costs one pending request and its timeout.

Each worker process reports on a stream of its own (``?stream=<worker index>``): the workers share one
certificate, and the scheduler keeps a ledger per ``<SAN>#<stream>`` (docs/scheduler-api.md).

``stop(final_timeout)`` is called once the forwarder's connections are closed (after the drain): it takes
the last deltas and makes one more attempt to report them, backoff or not, bounded by ``final_timeout``;
what still is not acknowledged then is lost with the process, and logged as such.

The scheduler's certificate is checked by ``ssl_context``: ``feed_ssl_context`` chains it to the feed's
CA and checks the URL's host name against it. Counted in ``ForwarderMetrics`` (``feed_*``); logged: each
409, and each change between reporting and backing off (not every failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp

from certs import loader
from forwarder.ingress.feed_outbox import Outbox
from forwarder.ingress.metering import Meter
from forwarder.ingress.metrics import ForwarderMetrics
from forwarder.ingress.settings import ForwarderSettings
from sbxnet.protocol.feed import MAX_ANSWER_BYTES, MAX_STREAM, Answer, FeedError, new_epoch, pull_answer

log = logging.getLogger("sbxnet.forwarder")
T = TypeVar("T")

FINAL_ATTEMPTS = 4  # at stop: the batch in flight, what the drain added, and room for one 409's resend
ANSWERED = ("ok", "replay", "gap", "stale_epoch", "mismatch")  # results with an answer from the scheduler


def feed_ssl_context(settings: ForwarderSettings) -> ssl.SSLContext:
    """The feed's client context from ``settings.feed_files`` (``certs.loader``'s profile: TLS 1.3,
    our certificate presented, the server's chain verified against the feed CA), plus the host name
    check: unlike a forwarder, the scheduler is reached by name and carries it in its certificate.
    Raises ``certs.loader.LOAD_ERRORS`` on unreadable material."""
    cert, key, ca = settings.feed_files
    ctx = loader.client_context(cert_file=cert, key_file=key, ca_file=ca)
    ctx.check_hostname = True
    return ctx


def reporter_for(
    settings: ForwarderSettings, meter: Meter, *, stream: int, metrics: ForwarderMetrics | None = None
) -> FeedReporter | None:
    """The reporter this process runs (None when ``feed_url`` is unset). Its outbox makes its first epoch
    here, so call it in the worker process itself: each process gets an epoch of its own."""
    if settings.feed_url is None:
        return None
    outbox = Outbox(lambda: new_epoch(time.time_ns(), os.urandom(8)), random.Random(),
                    backoff_cap_s=settings.feed_retry_cap)
    return FeedReporter(
        meter,
        outbox,
        settings.feed_url,
        feed_ssl_context(settings),
        settings.feed_interval,
        request_timeout_s=settings.feed_request_timeout,
        stream=stream,
        metrics=metrics,
        open_refresh_s=settings.feed_open_refresh,
    )


class FeedReporter:
    """Owns the reporting task. ``start()`` once, ``stop()`` once: it ends the task (a POST in flight is cut
    off and the outbox told it failed, so the batch is resent; an outbox call in its thread is let finish),
    makes the final attempt if asked to, and closes the session and the thread."""

    def __init__(
        self,
        meter: Meter,
        outbox: Outbox,
        url: str,
        ssl_context: ssl.SSLContext,
        interval: float = 1.0,
        now: Callable[[], float] = time.monotonic,
        *,
        request_timeout_s: float = 5.0,
        stream: int = 0,
        metrics: ForwarderMetrics | None = None,
        open_refresh_s: float | None = 10.0,
    ) -> None:
        if not interval > 0 or not request_timeout_s > 0:
            raise ValueError("interval and request_timeout_s must be positive")
        if not 0 <= stream <= MAX_STREAM:
            raise ValueError(f"stream must be in [0, {MAX_STREAM}]")
        self._meter = meter
        # A sandbox whose connections are open but silent is reported again this often: the scheduler
        # forgets a stream's open connections once the stream falls silent (its source_stale_s).
        self._open_refresh = open_refresh_s
        self._outbox = outbox
        self._url = f"{url}?stream={stream}"
        self._stream = stream
        self._ssl = ssl_context
        self._ssl_changed = False
        self._interval = interval
        self._now = now
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = asyncio.Event()
        self._exchange_task: asyncio.Task[tuple[int, bytes]] | None = None
        self._last_sent: tuple[str, int] | None = None
        self._epochs_counted = 0
        self._backing_off_since: float | None = None  # None while reporting
        self._failed_posts = 0  # since backing off began
        # Counters for metrics (the outbox counts the failures by reason).
        self.posts = 0
        self.ticks = 0

    @property
    def outbox(self) -> Outbox:
        return self._outbox

    @property
    def url(self) -> str:
        return self._url

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("FeedReporter.start() called twice")
        self._session = self._new_session()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feed-outbox")
        self._observe(self._now())
        self._task = asyncio.get_running_loop().create_task(self._run(), name="feed-reporter")
        log.info(
            "feed reporting",
            extra={
                "event": "feed_started",
                "fields": {"url": self._url, "epoch": self._outbox.epoch, "interval": self._interval},
            },
        )

    def set_ssl_context(self, ssl_context: ssl.SSLContext) -> None:
        """Use ``ssl_context`` from the next POST on (a certificate reload); the one in flight keeps its own."""
        self._ssl = ssl_context
        self._ssl_changed = True

    async def stop(self, final_timeout: float = 0.0) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping.set()
            if self._exchange_task is not None:
                self._exchange_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if final_timeout > 0 and self._session is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(final_timeout):
                    await self._final_report()
            ob, now = self._outbox, self._now()
            self._observe(now)
            log.info(
                "feed stopped",
                extra={
                    "event": "feed_stopped",
                    "fields": {
                        "unreported_sandboxes": ob.pending_count + ob.in_flight_count,
                        "lag_s": round(ob.lag(now), 3),
                    },
                },
            )
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # idle: every call it was given has been awaited

    # --- the loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        next_tick = self._now()
        while not self._stopping.is_set():
            now = self._now()
            if now >= next_tick:
                self.ticks += 1
                # On the loop: the planes' meters are the loop's.
                deltas = self._meter.take(now, self._open_refresh)
                # Reported even when empty: a live feed is never silent (the scheduler idles by it).
                await self._off_loop(self._outbox.add, deltas, now, report_empty=True)
                self._observe(now)
                next_tick = max(next_tick + self._interval, now)
            while not self._stopping.is_set() and await self._next_body() is not None:
                await self._post()
            wake = self._outbox.wake_at()
            until = next_tick if wake is None or not math.isfinite(wake) else min(next_tick, wake)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, until - self._now()))

    async def _final_report(self) -> None:
        now = self._now()
        await self._off_loop(self._outbox.add, self._meter.take(now, self._open_refresh), now)
        for _ in range(FINAL_ATTEMPTS):
            if await self._next_body(ignore_backoff=True) is None:
                return
            if await self._post() not in ANSWERED:
                return  # no second try at stop: the scheduler is away

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` (an outbox method) in the reporter's thread, awaited: the outbox is never
        touched by two at once. Not cut off by a cancellation: the call is bounded, and a half-made change
        to the outbox would be worse than waiting for it."""
        assert self._executor is not None
        fut = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kw))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    async def _next_body(self, *, ignore_backoff: bool = False) -> bytes | None:
        return await self._off_loop(self._outbox.next_body, self._now(), ignore_backoff=ignore_backoff)

    async def _post(self) -> str:
        """POST the in-flight batch, hand the outcome to the outbox, count and log it; returns the result
        label (``ANSWERED`` or a failure reason)."""
        body, key = self._outbox.in_flight_body, self._outbox.in_flight_key
        assert body is not None and key is not None
        self.posts += 1
        if key == self._last_sent and self._metrics is not None:
            self._metrics.feed_resends.inc()
        self._last_sent = key
        self._exchange_task = asyncio.get_running_loop().create_task(self._exchange(body), name="feed-post")
        try:
            status, data = await self._exchange_task
        except asyncio.CancelledError:
            self._failed(self._now(), "stopped")
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task was cancelled, not only the POST (which stop() cuts off)
            return "stopped"
        except TimeoutError:
            return self._failed(self._now(), "timeout")
        except aiohttp.ClientSSLError:
            return self._failed(self._now(), "tls")
        except (aiohttp.ClientError, OSError):
            return self._failed(self._now(), "connect")
        finally:
            self._exchange_task = None
        if status not in (200, 409):
            return self._failed(self._now(), f"http_{status}")
        try:
            answer = pull_answer(data, status)
        except FeedError as e:
            return self._failed(self._now(), f"bad_answer_{e.reason}")
        now = self._now()
        outcome = await self._off_loop(self._outbox.on_answer, answer, now)
        result = "mismatch" if outcome == "mismatch" else (answer.error or "ok")
        if answer.error is not None:
            self._log_refusal(answer, key, outcome)
        self._record(result, now)
        return result

    def _failed(self, now: float, reason: str) -> str:
        self._outbox.on_failure(now, reason)
        self._record(reason, now)
        return reason

    async def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """POST one body; the status and at most MAX_ANSWER_BYTES + 1 bytes of the answer (a longer one
        is refused by ``pull_answer``, and never read whole)."""
        if self._ssl_changed or self._session is None:
            old, self._session, self._ssl_changed = self._session, self._new_session(), False
            if old is not None:
                await old.close()
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self._url, data=body, headers=headers, timeout=self._timeout) as resp:
            data = bytearray()
            async for chunk in resp.content.iter_chunked(4096):
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    break
            return resp.status, bytes(data)

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=1))

    # --- what it counts and says ----------------------------------------------------------------------

    def _observe(self, now: float) -> None:
        m, ob = self._metrics, self._outbox
        if m is None:
            return
        m.feed_lag.set(ob.lag(now))
        m.feed_pending.set(ob.pending_count)
        m.feed_in_flight.set(ob.in_flight_count)
        if ob.epochs_started > self._epochs_counted:
            m.feed_epochs.inc(ob.epochs_started - self._epochs_counted)
            self._epochs_counted = ob.epochs_started

    def _record(self, result: str, now: float) -> None:
        if self._metrics is not None:
            self._metrics.feed_posts.labels(result).inc()
        self._observe(now)
        if result == "stopped":
            return
        if result == "ok":
            if self._backing_off_since is not None:
                log.info(
                    "feed reporting again",
                    extra={
                        "event": "feed_reporting",
                        "fields": {
                            "failed_posts": self._failed_posts,
                            "backed_off_s": round(now - self._backing_off_since, 3),
                        },
                    },
                )
                self._backing_off_since = None
            return
        self._failed_posts += 1
        if self._backing_off_since is None:
            self._backing_off_since, self._failed_posts = now, 1
            wake = self._outbox.wake_at()
            log.warning(
                "feed backing off",
                extra={
                    "event": "feed_backing_off",
                    "reason": result,
                    "fields": {"retry_in_s": round(wake - now, 3) if wake is not None and math.isfinite(wake) else 0},
                },
            )

    def _log_refusal(self, answer: Answer, key: tuple[str, int], outcome: str) -> None:
        log.warning(
            "feed batch refused",
            extra={
                "event": "feed_refused",
                "reason": answer.error,
                "fields": {
                    "epoch": key[0],
                    "seq": key[1],
                    "acked": answer.acked,
                    "outcome": outcome,  # dropped (it was applied) or requeued (reported again)
                    "new_epoch": self._outbox.epoch,
                },
            },
        )
