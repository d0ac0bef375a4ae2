"""The userspace plane's buffer pool and the heap trim (forwarder/ingress/planes/memory.py)."""

from __future__ import annotations

import mmap
import threading

from forwarder.ingress.planes.memory import BufferPool, thread_pool, trim_heap


def test_buffers_are_lent_reused_and_kept_only_up_to_keep() -> None:
    pool = BufferPool(4096 * 3, keep=1)
    a, b = pool.take(), pool.take()
    assert (len(a), len(b), pool.lent, pool.pooled) == (4096 * 3, 4096 * 3, 2, 0)
    assert isinstance(a.obj, mmap.mmap) and a.obj is not b.obj  # each its own mapping
    a[:5] = b"hello"  # writable, as ssl's read(n, buffer) and recv_into need
    pool.give(a)
    pool.give(b)  # beyond keep: dropped, unmapped once no view of it is left
    assert (pool.lent, pool.pooled) == (0, 1)
    again = pool.take()
    assert again.obj is a.obj  # the kept one comes back first
    assert pool.take().obj is not b.obj  # the dropped one never does
    assert pool.lent == 2


def test_each_thread_has_its_own_pool() -> None:
    here = thread_pool(8192, 2)
    assert thread_pool(8192, 2) is here
    assert thread_pool(16384, 2) is not here and thread_pool(16384, 2).size == 16384  # a pool per size
    there: list[BufferPool] = []
    t = threading.Thread(target=lambda: there.append(thread_pool(8192, 2)))
    t.start()
    t.join()
    assert there and there[0] is not here


def test_trim_heap_runs_on_glibc() -> None:
    import platform

    libc, _ = platform.libc_ver()
    assert trim_heap() is (libc == "glibc")
