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
Free memory can only go back where nothing live is left on it, and after a wave of closes a few hundred
small objects that outlive the tunnels are spread over the heap the tunnels filled: the interpreter's free
lists (up to 2,000 tuples of each size, dicts, lists, floats, contexts) and the names held by CPython's
method cache. :func:`trim_heap` releases those first, when the live heap has shrunk (see
:class:`HeapTrimmer`). Python's own allocator gives memory back only in whole 1 MiB arenas, which one live
object keeps; run with ``PYTHONMALLOC=malloc`` and the tunnels' objects sit in malloc's heap, where
``malloc_trim`` returns every free page (``docs/forwarder.md``, Memory).

OpenSSL's memory BIOs keep the buffer of their largest write for the session (they never shrink it):
the handshake's flights leave about 3 KiB in a tunnel's two, and a burst fed 64 KiB at a time about
87 KiB in each. :func:`release_bio_buffers` swaps an empty BIO's buffer for a new, empty one. Python's
``ssl`` exposes neither the ``BIO *`` behind a ``MemoryBIO`` nor the ``SSL *`` behind an ``SSLObject``;
as ``ktls_keys`` does, we read them where CPython (3.11-3.13) lays them out, right after the object
header, and use them only once OpenSSL confirms them: the ``SSL *``'s context must be the ``SSL_CTX *``
of the very ``SSLContext`` Python names, and its read and write BIOs must be the two we read. Anywhere
else nothing is released, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import mmap
import ssl
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


_LIBC = _libc()


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = _LIBC.malloc_trim  # type: ignore[union-attr]
    except AttributeError:  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = _LIBC.mallinfo2  # type: ignore[union-attr]
    except AttributeError:  # glibc before 2.33, or not glibc
        return None
    fn.argtypes = []
    fn.restype = _MallInfo2
    return fn


_TRIM = _malloc_trim()
_MALLINFO2 = _mallinfo2()


def live_heap() -> int:
    """How much of the heap is in use, in a unit fixed for the process: Python's allocated blocks, or,
    where objects come from malloc (``PYTHONMALLOC=malloc``: no blocks of Python's own), malloc's bytes in
    use. 0 where neither can be read."""
    blocks = sys.getallocatedblocks()
    if blocks or _MALLINFO2 is None:
        return blocks
    return int(_MALLINFO2().uordblks)


def release_free_lists() -> None:
    """Drop what the interpreter keeps for reuse: a full collection empties its free lists, and the method
    cache lets go of the attribute names it holds (names made at run time, e.g. by C code looking up
    ``result`` on a future, are new strings each time, and the cache keeps the last one in each of its
    4,096 slots). Costs a full collection: in proportion to the live objects."""
    gc.collect()
    sys._clear_type_cache()


SHRUNK = 0.9  # free lists are released once the live heap is at most this part of its peak since last time
# and no more often than keeps those full collections under 5% of the time: a collection costs about 40 ms
# in an idle forwarder and 0.2 s with 2,000 tunnels open (2 shared cores), so the release that follows the
# end of a wave of closes is let through, and the ones during a wave at 10,000 tunnels are spaced out.
MAX_DUTY = 0.05


def _call_later(delay: float, fn: Callable[[], None]) -> None:
    try:
        asyncio.get_running_loop().call_later(delay, fn)
    except RuntimeError:
        pass  # no event loop in this thread: the caller's next trim tries again


class HeapTrimmer:
    """When to release the free lists before trimming: only once the live heap has shrunk to ``SHRUNK`` of
    its peak since the last release (a wave of closes: while tunnels come and go at a steady count there is
    nothing to give back), and at most at a rate that keeps the collection, predicted from the last one's
    cost per unit of live heap, under ``MAX_DUTY`` of the time. A release held back by that rate is
    deferred (``defer``: the running loop's ``call_later``) to when it is allowed: the wave's last ends may
    come just after a release, and nothing else would call again once they have."""

    def __init__(
        self,
        *,
        live: Callable[[], int] = live_heap,
        release: Callable[[], None] = release_free_lists,
        clock: Callable[[], float] = time.monotonic,
        defer: Callable[[float, Callable[[], None]], None] = _call_later,
    ) -> None:
        self._live = live
        self._release = release
        self._clock = clock
        self._defer = defer
        self._level = live()  # the peak of the live heap since the last release (or since start)
        self._cost_per_unit = 0.0  # seconds of collection per unit of live heap, the last time
        self._released_at = float("-inf")
        self._deferred = False
        self._idle_due = False  # every connection ended since the last release: one is due, heap or not
        self.releases = 0

    def trim(self, *, idle: bool = False) -> bool:
        """Release the free lists if due, then ``malloc_trim(0)``; False where there is no such call.
        ``idle``: no connection is open, so a release is due whatever the live heap says (the cyclic garbage
        of the tunnels that ended after a release mid-wave keeps the live heap above ``SHRUNK``)."""
        self._idle_due = self._idle_due or idle
        self._maybe_release()
        if _TRIM is None:
            return False
        _TRIM(0)
        return True

    def _maybe_release(self) -> None:
        live = self._live()
        if live > self._level * SHRUNK and not self._idle_due:
            self._level = max(self._level, live)
            return
        wait = self._cost_per_unit * live / MAX_DUTY - (self._clock() - self._released_at)
        if wait > 0:
            if not self._deferred:
                self._deferred = True
                self._defer(wait, self._retry)
            return
        t0 = self._clock()
        self._release()
        self._released_at = self._clock()
        self._cost_per_unit = (self._released_at - t0) / max(live, 1)
        self._level = self._live()
        self._idle_due = False
        self.releases += 1

    def _retry(self) -> None:
        self._deferred = False
        self.trim()


_trimmer: HeapTrimmer | None = None

BIO_C_SET_BUF_MEM = 114
BIO_C_GET_BUF_MEM_PTR = 115
BIO_CLOSE = 1
BIO_TYPE_MEM = 0x0401  # 1 | BIO_TYPE_SOURCE_SINK


class _BufMem(ctypes.Structure):
    _fields_ = [("length", ctypes.c_size_t), ("data", ctypes.c_void_p), ("max", ctypes.c_size_t),
                ("flags", ctypes.c_ulong)]


class _OpenSsl:
    """The few OpenSSL calls :func:`release_bio_buffers` makes, resolved through CPython's ``_ssl`` module
    (so they are those of the OpenSSL it runs on), or ``None`` where they cannot be had."""

    def __init__(self) -> None:
        import _ssl

        lib = ctypes.CDLL(_ssl.__file__)  # its symbols and those of the libraries it was linked with
        vp = ctypes.c_void_p
        self.bio_ctrl = lib.BIO_ctrl
        self.bio_ctrl.argtypes = [vp, ctypes.c_int, ctypes.c_long, vp]
        self.bio_ctrl.restype = ctypes.c_long
        self.bio_method_type = lib.BIO_method_type
        self.bio_method_type.argtypes = [vp]
        self.bio_method_type.restype = ctypes.c_int
        self.buf_mem_new = lib.BUF_MEM_new
        self.buf_mem_new.argtypes = []
        self.buf_mem_new.restype = vp
        self.buf_mem_free = lib.BUF_MEM_free
        self.buf_mem_free.argtypes = [vp]
        self.buf_mem_free.restype = None
        self.ssl_get_ssl_ctx, self.ssl_get_rbio, self.ssl_get_wbio = (
            lib.SSL_get_SSL_CTX, lib.SSL_get_rbio, lib.SSL_get_wbio)
        for fn in (self.ssl_get_ssl_ctx, self.ssl_get_rbio, self.ssl_get_wbio):
            fn.argtypes = [vp]
            fn.restype = vp
        self.context_type = _ssl._SSLContext
        self.socket_type = _ssl._SSLSocket  # type: ignore[attr-defined]
        self.bio_type = _ssl.MemoryBIO


def _openssl() -> _OpenSsl | None:
    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    try:
        lib = _OpenSsl()
    except (ImportError, OSError, AttributeError):  # no _ssl, or an OpenSSL without these symbols
        return None
    if (lib.context_type.__basicsize__ < 24 or lib.socket_type.__basicsize__ < 40
            or lib.bio_type.__basicsize__ < 24):
        return None
    return lib


_OPENSSL: _OpenSsl | bool | None = False  # False: not looked up yet


def _word(obj: object, i: int) -> int:
    return ctypes.c_void_p.from_address(id(obj) + i * ctypes.sizeof(ctypes.c_void_p)).value or 0


def release_bio_buffers(tls: ssl.SSLObject, bios: tuple[ssl.MemoryBIO, ...], above: int = 0) -> int:
    """Give back the buffer of each of ``bios`` (``tls``'s incoming and/or outgoing BIO) that holds no
    byte and whose buffer is larger than ``above`` bytes: it gets a new, empty one, which grows again with
    the next write. Returns the bytes released; 0 where OpenSSL's objects cannot be reached and checked
    (see the module's docstring). Call it from the thread that drives ``tls``."""
    global _OPENSSL
    if _OPENSSL is False:
        _OPENSSL = _openssl()
    lib = _OPENSSL
    if not isinstance(lib, _OpenSsl):
        return 0
    inner: Any = getattr(tls, "_sslobj", None)
    if type(inner) is not lib.socket_type:
        return 0
    ctx = inner.context
    if not isinstance(ctx, lib.context_type):
        return 0
    ssl_p = _word(inner, 3)
    if not ssl_p or _word(inner, 4) != id(ctx) or lib.ssl_get_ssl_ctx(ssl_p) != _word(ctx, 2):
        return 0
    own = (lib.ssl_get_rbio(ssl_p) or 0, lib.ssl_get_wbio(ssl_p) or 0)
    released = 0
    for bio in bios:
        if type(bio) is not lib.bio_type or bio.pending:
            continue
        bio_p = _word(bio, 2)
        if not bio_p or bio_p not in own or lib.bio_method_type(bio_p) != BIO_TYPE_MEM:
            continue
        mem = ctypes.c_void_p()
        if lib.bio_ctrl(bio_p, BIO_C_GET_BUF_MEM_PTR, 0, ctypes.byref(mem)) <= 0 or not mem.value:
            continue
        buf = _BufMem.from_address(mem.value)
        if buf.length or buf.max <= above:
            continue
        size = buf.max
        fresh = lib.buf_mem_new()
        if not fresh:
            continue
        if lib.bio_ctrl(bio_p, BIO_C_SET_BUF_MEM, BIO_CLOSE, fresh) <= 0:  # frees the old buffer
            lib.buf_mem_free(fresh)
            continue
        released += size
    return released


def trim_heap(*, idle: bool = False) -> bool:
    """Give malloc's free heap pages back to the kernel (glibc ``malloc_trim(0)``, which also releases
    free pages inside the heap, not only at its top), after the interpreter's free lists when the live
    heap has shrunk (:class:`HeapTrimmer`). False where the C library has no such call. It walks the heap:
    call it after many frees, not per connection, from the event loop's thread."""
    global _trimmer
    if _trimmer is None:
        _trimmer = HeapTrimmer()
    return _trimmer.trim(idle=idle)
