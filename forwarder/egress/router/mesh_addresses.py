"""Claim addresses for a mesh of router daemons: one PostgreSQL table, one statement per claim.

Table (``mesh_table``, created if missing)::

    address bigint PRIMARY KEY    -- the IPv4 address as an integer
    claim text NOT NULL           -- the claim that holds it, or last held it
    node text                     -- the daemon (``node`` setting) the claim is armed on
    held boolean NOT NULL         -- false once released
    released_at timestamptz       -- when released (the reuse window runs from here, on the server's clock)
    UNIQUE (claim) WHERE held     -- a claim holds at most one address

``allocate`` is one ``INSERT ... ON CONFLICT`` statement (autocommit): it returns the address the claim
already holds, or takes the lowest address that is neither held nor released inside the window. Two
daemons that pick the same candidate at the same moment cannot both have it: the primary key makes the
second wait for the first's row, and its ``ON CONFLICT ... WHERE`` then finds it held and takes nothing;
that daemon runs the statement again (a few times at most) and gets the next one. ``reserve`` (a restart,
an import) and ``release`` are one statement each too. The database down, or any error on the way,
refuses the claim with ``AllocationError("allocator_unavailable")`` naming the cause: a statement either
commits whole or not at all, so nothing is ever half-allocated.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import re
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from forwarder.egress.router.addresses import AllocationError

_TABLE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
RACE_RETRIES = 64  # daemons asking at once take the same lowest free address: the loser asks again
RACE_PAUSE_S = 0.005  # at most, drawn at random after a lost race, so two losers do not stay in step

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    address bigint PRIMARY KEY,
    claim text NOT NULL,
    node text,
    held boolean NOT NULL,
    released_at timestamptz
);
CREATE UNIQUE INDEX IF NOT EXISTS {t}_held_claim ON {t} (claim) WHERE held
"""

# The candidates are the pool's first address, the address after each row's (the lowest gap is one of
# them) and the rows free again; the lowest that is free wins.
_ALLOCATE = """
WITH mine AS (SELECT address FROM {t} WHERE claim = %(claim)s AND held),
cand AS (
    SELECT c.a FROM (
        SELECT %(first)s::bigint AS a
        UNION ALL SELECT address + 1 FROM {t} WHERE address >= %(first)s AND address < %(last)s
        UNION ALL SELECT x + 1 FROM unnest(%(exclude)s::bigint[]) AS x
        UNION ALL SELECT address FROM {t} WHERE NOT held AND released_at <= now() - %(window)s * interval '1 second'
    ) AS c
    WHERE c.a BETWEEN %(first)s AND %(last)s AND c.a <> ALL(%(exclude)s::bigint[])
      AND NOT EXISTS (SELECT 1 FROM {t} AS x WHERE x.address = c.a
                      AND (x.held OR x.released_at > now() - %(window)s * interval '1 second'))
      AND NOT EXISTS (SELECT 1 FROM mine)
    ORDER BY c.a LIMIT 1
),
ins AS (
    INSERT INTO {t} AS e (address, claim, node, held, released_at)
    SELECT a, %(claim)s, %(node)s, true, NULL FROM cand
    ON CONFLICT (address) DO UPDATE SET claim = EXCLUDED.claim, node = EXCLUDED.node, held = true, released_at = NULL
        WHERE NOT e.held AND e.released_at <= now() - %(window)s * interval '1 second'
    RETURNING address
)
SELECT address FROM mine UNION ALL SELECT address FROM ins
"""

_RESERVE = """
INSERT INTO {t} AS e (address, claim, node, held, released_at) VALUES (%(address)s, %(claim)s, %(node)s, true, NULL)
ON CONFLICT (address) DO UPDATE SET claim = EXCLUDED.claim, node = EXCLUDED.node, held = true, released_at = NULL
    WHERE e.claim = EXCLUDED.claim
       OR (NOT e.held AND e.released_at <= now() - %(window)s * interval '1 second')
RETURNING address
"""

_RELEASE = """
UPDATE {t} SET held = false, node = NULL, released_at = now() WHERE address = %(address)s AND claim = %(claim)s AND held
"""


class MeshAllocator:
    """``await allocate(claim)``, ``await reserve(claim, address)``, ``await release(claim, address)``
    against the table above; ``AllocationError`` on every refusal, never a ``psycopg`` error."""

    def __init__(
        self, dsn: str, *, pool: ipaddress.IPv4Network, reuse_window: float, node: str, table: str = "egress_addresses",
        exclude: tuple[int, ...] = (),
    ) -> None:
        if not _TABLE.fullmatch(table):
            raise ValueError(f"mesh table {table!r}: want a plain lower-case SQL name")
        self.dsn = dsn
        self.pool = pool
        self.window = reuse_window
        self.node = node
        self.table = table
        self.first = int(pool.network_address) + 2  # network and the exits' gateway address skipped
        self.last = int(pool.broadcast_address) - 1
        self.exclude = sorted(a for a in exclude if self.first <= a <= self.last)
        self.statements = 0  # statements run (the tests count one per claim)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._schema_done = False

    def __contains__(self, address: int) -> bool:
        return self.first <= address <= self.last and address not in self.exclude

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _run(self, sql: str, args: dict[str, object]) -> list[tuple[Any, ...]]:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True, connect_timeout=3)
            if not self._schema_done:
                await self._schema(self._conn)
            self.statements += 1
            cur = await self._conn.execute(sql.format(t=self.table), args)
            return await cur.fetchall() if cur.description is not None else []
        except pg_errors.UniqueViolation:
            raise
        except psycopg.Error as e:
            await self._drop()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise AllocationError("allocator_unavailable", f"address database: {first}") from None

    async def _schema(self, conn: psycopg.AsyncConnection[Any]) -> None:
        for stmt in _SCHEMA.format(t=self.table).split(";"):
            try:
                await conn.execute(stmt)
            except (pg_errors.UniqueViolation, pg_errors.DuplicateTable, pg_errors.DuplicateObject):
                pass  # another daemon created it at the same moment
        self._schema_done = True

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except psycopg.Error:
                pass

    def _args(self, claim: str, **more: object) -> dict[str, object]:
        return {"claim": claim, "node": self.node, "window": self.window, **more}

    async def allocate(self, claim: str) -> int:
        args = self._args(claim, first=self.first, last=self.last, exclude=self.exclude)
        for _ in range(RACE_RETRIES):
            try:
                rows = await self._run(_ALLOCATE, args)
            except pg_errors.UniqueViolation:
                continue  # the same claim allocated at the same moment elsewhere: ask again, find it held
            if rows:
                return int(rows[0][0])
            # No row: either another daemon took our candidate first (try again: the next one), or the pool
            # is full; the count tells which.
            if not await self._has_room():
                raise AllocationError("pool_exhausted", f"every address of {self.pool} is held or cooling")
            await asyncio.sleep(random.uniform(0, RACE_PAUSE_S))
        raise AllocationError("allocator_unavailable", f"address database: lost {RACE_RETRIES} races in a row")

    async def _has_room(self) -> bool:
        rows = await self._run(
            f"SELECT count(*) FROM {self.table} WHERE address BETWEEN %(first)s AND %(last)s AND "
            "(held OR released_at > now() - %(window)s * interval '1 second')",
            {"first": self.first, "last": self.last, "window": self.window},
        )
        return int(rows[0][0]) < self.last - self.first + 1 - len(self.exclude)

    async def reserve(self, claim: str, address: int) -> None:
        if address not in self:
            raise AllocationError("outside_pool", f"{ipaddress.IPv4Address(address)} is not a claim address of "
                                                  f"{self.pool}")
        try:
            rows = await self._run(_RESERVE, self._args(claim, address=address))
        except pg_errors.UniqueViolation:
            raise AllocationError("claim_has_address", f"claim {claim} already holds another address") from None
        if not rows:
            raise AllocationError("address_in_use", f"{ipaddress.IPv4Address(address)} is held by another claim "
                                                    "or inside its reuse window")

    async def hand_over(self, claim: str, address: int) -> None:
        """A move: the row stays held by the claim; the importing daemon's ``reserve`` makes it its node's."""

    async def release(self, claim: str, address: int) -> None:
        try:
            await self._run(_RELEASE, self._args(claim, address=address))
        except pg_errors.UniqueViolation:  # cannot happen for an UPDATE that clears held
            pass
