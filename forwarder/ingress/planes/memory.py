"""Memory that follows bytes in flight, not tunnels: plaintext buffers lent while bytes move, and freed
heap memory handed back to the kernel once tunnels close.

A tunnel borrows a buffer from its thread's :class:`BufferPool` when a burst arrives and gives it back
before it waits for the next one, so an idle tunnel holds none. Each buffer is an anonymous mapping of
its own: its pages cost nothing until they are written, and dropping it unmaps them at once. (A large
``bytearray`` comes from malloc, whose heap keeps freed chunks, so a thousand tunnels' buffers stayed in
the process after the tunnels had gone.) The pool keeps a few given-back buffers for the next burst and
drops the rest.

What the tunnels' small objects leave behind (Python's, and OpenSSL's: the SSL object, its session, the
peer's certificate) is scattered over malloc's heap; :func:`trim_heap` returns the free pages between them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from collections.abc import Callable


class BufferPool:
    """Buffers of ``size`` bytes, lent by :meth:`take` and given back by :meth:`give`; at most ``keep``
    given-back ones are kept for reuse. One pool per thread (:func:`thread_pool`): it is not locked."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[memoryview] = []
        self.lent = 0  # buffers taken and not given back: the bytes in flight, in buffers

    def take(self) -> memoryview:
        self.lent += 1
        if self._free:
            return self._free.pop()
        return memoryview(mmap.mmap(-1, self.size))

    def give(self, buf: memoryview) -> None:
        """Return a buffer from :meth:`take`; the caller keeps no view of it. Beyond ``keep`` it is
        dropped, and unmapped as soon as no slice of it is alive."""
        self.lent -= 1
        if len(self._free) < self.keep:
            self._free.append(buf)

    @property
    def pooled(self) -> int:
        return len(self._free)


_per_thread = threading.local()


def thread_pool(size: int, keep: int) -> BufferPool:
    """This thread's pool of ``size``-byte buffers (made on first use, keeping ``keep``)."""
    pools: dict[int, BufferPool] | None = getattr(_per_thread, "pools", None)
    if pools is None:
        pools = _per_thread.pools = {}
    pool = pools.get(size)
    if pool is None:
        pool = pools[size] = BufferPool(size, keep)
    return pool


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give malloc's free heap pages back to the kernel (glibc ``malloc_trim(0)``, which also releases
    free pages inside the heap, not only at its top). False where the C library has no such call. It
    walks the heap: call it after many frees, not per connection."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
