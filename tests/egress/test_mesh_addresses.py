"""The mesh's address allocator against a real PostgreSQL server (tests/scheduler/pg_support.py): one
statement per claim, two daemons never hand out the same address, the database down refuses the claim
with a clear error and leaves nothing half-allocated."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scheduler"))
import pg_support

from forwarder.egress.router.addresses import AllocationError
from forwarder.egress.router.mesh_addresses import MeshAllocator

NET = ipaddress.IPv4Network("100.64.0.0/26")  # .2-.62: 61 claim addresses
BASE = int(NET.network_address)


@pytest.fixture
def dsn() -> str:
    try:
        server = pg_support.shared_server()
    except pg_support.PgUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    return pg_support.fresh_schema(server)


@pytest.fixture
def own_server() -> Iterator[pg_support.PgServer]:
    try:
        server = pg_support.PgServer().start()
    except pg_support.PgUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    try:
        yield server
    finally:
        server.stop()


def _mesh(dsn: str, node: str, window: float = 3600, net: ipaddress.IPv4Network = NET) -> MeshAllocator:
    return MeshAllocator(dsn, pool=net, reuse_window=window, node=node)


def _rows(dsn: str) -> list[tuple[int, str, str | None, bool]]:
    with psycopg.connect(dsn) as conn:
        return [(int(a), c, n, h) for a, c, n, h in
                conn.execute("SELECT address, claim, node, held FROM egress_addresses ORDER BY address").fetchall()]


async def test_one_statement_per_claim_and_the_same_claim_keeps_its_address(dsn: str) -> None:
    m = _mesh(dsn, "h1")
    try:
        a = await m.allocate("c1")  # the first call also creates the table
        before = m.statements
        b = await m.allocate("c2")
        assert m.statements - before == 1
        assert (a - BASE, b - BASE) == (2, 3)
        assert await m.allocate("c1") == a  # asked again: the address it holds
        assert _rows(dsn) == [(a, "c1", "h1", True), (b, "c2", "h1", True)]
    finally:
        await m.close()


async def test_two_daemons_never_hand_out_the_same_address(dsn: str) -> None:
    one, two = _mesh(dsn, "h1"), _mesh(dsn, "h2")
    try:
        await one.allocate("warm1")
        await two.allocate("warm2")

        async def many(m: MeshAllocator, tag: str) -> list[int]:
            return [await m.allocate(f"{tag}{i}") for i in range(25)]

        # Both daemons race for the lowest free address every time.
        got1, got2 = await asyncio.gather(many(one, "a"), many(two, "b"))
        every = got1 + got2
        assert len(set(every)) == len(every) == 50
        rows = _rows(dsn)
        assert len(rows) == 52 and len({r[0] for r in rows}) == 52
        # the pool then has 61 - 52 = 9 left; the 10th claim is refused as exhausted
        for i in range(9):
            await one.allocate(f"rest{i}")
        with pytest.raises(AllocationError) as e:
            await two.allocate("one-too-many")
        assert e.value.reason == "pool_exhausted"
    finally:
        await one.close()
        await two.close()


async def test_release_window_and_reserve(dsn: str) -> None:
    m = _mesh(dsn, "h1", window=3600)
    other = _mesh(dsn, "h2", window=3600)
    try:
        a = await m.allocate("c1")
        await m.release("c1", a)
        b = await m.allocate("c2")
        assert b != a  # inside the window: not reused
        with pytest.raises(AllocationError, match="address_in_use"):
            await other.reserve("c9", a)  # nor taken by another claim
        await other.reserve("c1", a)  # the claim itself, imported on another node, takes it back
        assert (a, "c1", "h2", True) in _rows(dsn)
        with pytest.raises(AllocationError, match="claim_has_address"):
            await other.reserve("c1", a + 30)
        with pytest.raises(AllocationError, match="outside_pool"):
            await other.reserve("c3", BASE + 1)
    finally:
        await m.close()
        await other.close()
    zero = _mesh(dsn, "h3", window=0)
    try:
        await zero.release("c2", b)
        # window 0: the lowest free address is the one just released (c1 holds a again)
        assert await zero.allocate("c4") == b
    finally:
        await zero.close()


async def test_database_down_refuses_the_claim_and_allocates_nothing(own_server: pg_support.PgServer) -> None:
    m = _mesh(own_server.dsn, "h1")
    try:
        await m.allocate("c1")
        own_server.halt()
        with pytest.raises(AllocationError) as e:
            await m.allocate("c2")
        assert e.value.reason == "allocator_unavailable" and "address database" in str(e.value)
        with pytest.raises(AllocationError, match="allocator_unavailable"):
            await m.reserve("c3", BASE + 9)
        own_server.resume()
        assert [r[1] for r in _rows(own_server.dsn)] == ["c1"]  # nothing of c2 or c3
        assert await m.allocate("c2") == BASE + 3  # and it works again once the database is back
    finally:
        await m.close()


async def test_the_daemon_refuses_a_claim_while_the_database_is_down(own_server: pg_support.PgServer,
                                                                     tmp_path: Path) -> None:
    # Through the control API: 201 with the mesh's address; the server halted -> 503 naming the cause, no
    # claim armed, no socket made, no row; back -> armed.
    import aiohttp

    from forwarder.egress.router.control_api import ControlServer
    from forwarder.egress.router.daemon import Router
    from forwarder.egress.router.settings import EgressSettings

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = EgressSettings(listen="127.0.0.1", port=port, exits=["a=127.0.0.2@02:00:00:00:00:01"],
                              mesh_dsn=own_server.dsn, node="h1")
    m = MeshAllocator(own_server.dsn, pool=settings.overlay, reuse_window=3600, node="h1")
    router = Router(settings, allocator=m)
    await router.start()
    ctl = ControlServer(router, tmp_path / "ctl.sock")
    await ctl.start()
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / "ctl.sock")))

    async def arm(cid: str) -> tuple[int, dict[str, str]]:
        body = {"uds": str(tmp_path / cid), "exit": "a"}
        async with session.put(f"http://egress/v1/claims/{cid}", json=body) as r:
            return r.status, await r.json()

    try:
        st, body = await arm("c1")
        assert st == 201 and body["address"] == "100.64.0.2"
        own_server.halt()
        st, body = await arm("c2")
        assert (st, body["error"]) == (503, "allocator_unavailable") and "address database" in body["detail"]
        assert list(router.paths) == ["c1"] and not (tmp_path / "c2_2051").exists()
        own_server.resume()
        assert [r[1] for r in _rows(own_server.dsn)] == ["c1"]
        st, body = await arm("c2")
        assert st == 201 and body["address"] == "100.64.0.3"
    finally:
        await session.close()
        await ctl.stop()
        await router.stop()



async def test_a_restart_while_the_database_is_down_fails_and_keeps_the_state(own_server: pg_support.PgServer,
                                                                             tmp_path: Path) -> None:
    from forwarder.egress.router.claim_state import StateFile
    from forwarder.egress.router.claims import ClaimState
    from forwarder.egress.router.daemon import Router
    from forwarder.egress.router.settings import EgressSettings

    state = StateFile(tmp_path)
    state.save([ClaimState(id="c1", address="100.64.0.2", exit="a", uds=tmp_path / "vm1")])
    before = (tmp_path / "claims.json").read_bytes()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = EgressSettings(listen="127.0.0.1", port=port, exits=["a=127.0.0.2@02:00:00:00:00:01"])
    own_server.halt()
    router = Router(settings, allocator=_mesh(own_server.dsn, "h1", net=settings.overlay), state=state)
    with pytest.raises(AllocationError, match="allocator_unavailable"):
        await router.start()
    await router.stop()
    assert (tmp_path / "claims.json").read_bytes() == before  # the claim is not given up
    own_server.resume()
    router = Router(settings, allocator=_mesh(own_server.dsn, "h1", net=settings.overlay), state=state)
    await router.start()
    try:
        assert str(router.paths["c1"].spec.address) == "100.64.0.2"
        assert [r[:2] for r in _rows(own_server.dsn)] == [(0x64400002, "c1")]
    finally:
        await router.stop()
