"""The thread the scheduler's store is used on (docs/scheduler.md, "The store thread").

A store call blocks: a PostgreSQL row lock waits up to ``lock_timeout_s``, a SQLite commit waits for its
fsync. Made on the event loop, every one of them would stall every other request of the process (the
gateways' route lookups and wakes among them). So a store object is used on one thread of its own, a
single-worker executor: its operations run one at a time in the order they were submitted, and two
transactions never interleave, which is what the service's lock -> refresh -> apply -> save -> commit
pattern needs of the one connection (and what keeps the timer core, which the operations change, to
one thread).

``run`` submits one operation (a plain function, the whole transaction) and awaits its result. The
waiter may be cancelled (the HTTP client went away); an operation that has started runs to its end
regardless, and whatever it publishes it publishes itself (the service hands its events to the loop
with ``call_soon_threadsafe`` from inside the operation, after the commit, so they reach the loop in
commit order whoever still waits). An operation not started yet when its waiter is cancelled is not
run.

Back-pressure: ``run(..., bounded=True)`` (requests from the network) raises ``Busy`` when
``max_pending`` operations are already submitted and not finished; the HTTP adapters answer 503 with
``Retry-After``. The process's own work (the timer loop, the webhook sender) is never refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

from sbxnet.errors import EnvironmentFault

T = TypeVar("T")

DEFAULT_MAX_PENDING = 512  # a few seconds of a hundred feed streams and the gateways' calls


class Busy(EnvironmentFault):
    """The store thread has ``max_pending`` operations waiting: refused, nothing done (503 + Retry-After)."""

    def __init__(self, pending: int) -> None:
        super().__init__("store_busy", f"{pending} store operations waiting")


class StoreThread:
    """One worker thread; ``name`` names it (and shows in py-spy and /proc)."""

    def __init__(self, name: str = "sbxnet-store", *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.name = name
        self.max_pending = max_pending
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident: int | None = None
        self.pending = 0  # submitted, not finished (read and written on the loop only)
        self.refused = 0  # Busy answers
        self.submitted = 0  # operations submitted so far (one that joins the last can tell nothing came between)

    def on_thread(self) -> bool:
        """Whether the caller is this store thread."""
        return threading.get_ident() == self._ident

    def _mark(self) -> None:
        self._ident = threading.get_ident()

    async def run(self, fn: Callable[..., T], *args: object, bounded: bool = False) -> T:
        """``fn(*args)`` on the store thread, after everything submitted before it."""
        return await self.submit(fn, *args, bounded=bounded)

    def submit(self, fn: Callable[..., T], *args: object, bounded: bool = False) -> asyncio.Future[T]:
        """``run`` without awaiting: ``Busy`` is raised here; the future is the result (cancelling it
        before the operation starts means it is not run)."""
        if bounded and self.pending >= self.max_pending:
            self.refused += 1
            raise Busy(self.pending)
        loop = asyncio.get_running_loop()

        def call() -> T:
            if self._ident is None:
                self._mark()
            return fn(*args)

        self.pending += 1
        self.submitted += 1
        cf = self._pool.submit(call)
        # Counted down when the work ends, not when its waiter stops waiting (a cancelled waiter's
        # operation still holds the thread).
        cf.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return asyncio.wrap_future(cf)

    def _done(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        """Wait for what was submitted, then end the thread."""
        self._pool.shutdown(wait=True)
