"""The daemon's one view of its address allocator: the single node's (``AddressPool`` in memory, its
``ReleaseLog`` on disk, the wall clock) or the mesh's (``MeshAllocator``, PostgreSQL). Both refuse with
``AllocationError``; only a release touches the single node's disk."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from forwarder.egress.router.addresses import AddressPool
from forwarder.egress.router.release_log import ReleaseLog
from forwarder.egress.router.settings import EgressSettings


class Allocator(Protocol):
    async def allocate(self, claim: str) -> int: ...
    async def reserve(self, claim: str, address: int) -> None: ...
    async def release(self, claim: str, address: int) -> None: ...
    async def hand_over(self, claim: str, address: int) -> None: ...
    async def close(self) -> None: ...


class LocalAllocator:
    def __init__(self, pool: AddressPool, log: ReleaseLog | None, clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.log = log
        self.clock = clock

    async def allocate(self, claim: str) -> int:
        return self.pool.allocate(claim, self.clock())

    async def reserve(self, claim: str, address: int) -> None:
        self.pool.reserve(claim, address, self.clock())

    async def release(self, claim: str, address: int) -> None:
        r = self.pool.release(claim, address, self.clock())
        if r is not None and self.log is not None:
            self.log.append(r)

    async def hand_over(self, claim: str, address: int) -> None:
        # Moved to another host: released here, so it cools (and comes back only to this claim).
        await self.release(claim, address)

    async def close(self) -> None:
        if self.log is not None:
            self.log.close()


def make_allocator(settings: EgressSettings) -> Allocator:
    """The allocator the settings ask for: the mesh's if ``mesh_dsn`` is set, else the single node's (its
    release log in ``state_dir``, compacted now; none without a ``state_dir``)."""
    pool = settings.address_pool or settings.overlay
    exclude = tuple(int(a) for a in settings.address_exclude)
    if settings.mesh_dsn is not None:
        from forwarder.egress.router.mesh_addresses import MeshAllocator

        return MeshAllocator(settings.mesh_dsn, pool=pool, reuse_window=settings.reuse_window, node=settings.node,
                             table=settings.mesh_table, exclude=exclude)
    now = time.time()
    log = None
    released = []
    if settings.state_dir is not None:
        log = ReleaseLog.open(Path(settings.state_dir) / "releases.log", settings.reuse_window, now)
        released = log.released
    return LocalAllocator(AddressPool(pool, settings.reuse_window, exclude=exclude, released=released, now=now), log)
