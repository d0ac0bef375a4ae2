"""The forwarder's HTTP adapter for the idle feed: a task that drives the ``Outbox`` (``feed_outbox.py``)
against the scheduler's ``POST /v1/feed``.

Each ``interval`` it takes the meter's deltas (``Meter.take_deltas``, the only call it makes on the data
path's state: synchronous, no I/O) into the outbox; then, while ``next_batch`` gives a batch, it POSTs
``in_flight_body`` over one ``aiohttp.ClientSession`` with a timeout per request. A 200 or 409 whose body
``pull_answer`` accepts goes to ``on_answer``; any other status, a refused answer body, a timeout or a
connection or TLS error goes to ``on_failure`` with a counted reason. While backing off it sleeps until
``outbox.wake_at()`` (or the next interval, whichever is first), still taking deltas every interval so the
meter's memory stays bounded (the outbox merges them per sandbox).

The scheduler's certificate is checked by ``ssl_context`` (the caller's: chain against the CA, and the
key pin or host name as the caller's profile decides). Not yet wired into the forwarder's server and
settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
from collections.abc import Callable

import aiohttp

from forwarder.ingress.feed_outbox import Outbox
from forwarder.ingress.metering import Meter
from sbxnet.protocol.feed import MAX_ANSWER_BYTES, FeedError, pull_answer


class FeedReporter:
    """Owns the reporting task. ``start()`` once, ``stop()`` once (it cancels the task and closes the
    session; a batch cut off in flight is left to be resent, since the outbox is told it failed)."""

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
    ) -> None:
        if not interval > 0 or not request_timeout_s > 0:
            raise ValueError("interval and request_timeout_s must be positive")
        self._meter = meter
        self._outbox = outbox
        self._url = url
        self._ssl = ssl_context
        self._interval = interval
        self._now = now
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        # Counters for metrics (the outbox counts the failures by reason).
        self.posts = 0
        self.ticks = 0

    @property
    def outbox(self) -> Outbox:
        return self._outbox

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("FeedReporter.start() called twice")
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=1))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="feed-reporter")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _run(self) -> None:
        next_tick = self._now()
        while True:
            now = self._now()
            if now >= next_tick:
                self.ticks += 1
                self._outbox.add(self._meter.take_deltas(now), now)
                next_tick = max(next_tick + self._interval, now)
            while self._outbox.next_batch(self._now()) is not None:
                await self._post()
            wake = self._outbox.wake_at()
            until = next_tick if wake is None or not math.isfinite(wake) else min(next_tick, wake)
            await asyncio.sleep(max(0.0, until - self._now()))

    async def _post(self) -> None:
        body = self._outbox.in_flight_body
        assert body is not None and self._session is not None
        self.posts += 1
        try:
            status, data = await self._exchange(body)
        except asyncio.CancelledError:
            self._outbox.on_failure(self._now(), "stopped")
            raise
        except TimeoutError:
            self._outbox.on_failure(self._now(), "timeout")
            return
        except aiohttp.ClientSSLError:
            self._outbox.on_failure(self._now(), "tls")
            return
        except (aiohttp.ClientError, OSError):
            self._outbox.on_failure(self._now(), "connect")
            return
        if status not in (200, 409):
            self._outbox.on_failure(self._now(), f"http_{status}")
            return
        try:
            answer = pull_answer(data, status)
        except FeedError as e:
            self._outbox.on_failure(self._now(), f"bad_answer_{e.reason}")
            return
        self._outbox.on_answer(answer, self._now())

    async def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """POST one body; the status and at most MAX_ANSWER_BYTES + 1 bytes of the answer (a longer one
        is refused by ``pull_answer``, and never read whole)."""
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self._url, data=body, headers=headers, timeout=self._timeout) as resp:
            data = bytearray()
            async for chunk in resp.content.iter_chunked(4096):
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    break
            return resp.status, bytes(data)
