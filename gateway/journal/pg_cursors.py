"""Channel cursors and state blobs in PostgreSQL for the shared mode
(`gateway.journal.cursors.CursorStore`): `gw_channel_cursors` and `gw_channel_blobs`.

Written only by the replica holding the channel's leader role, and on the very connection
that holds its advisory lock (`run_as_leader_on`, below): a replica that lost the role (its
session ended) cannot write a cursor any more, so a standby that took over never has its
position moved back by the old leader.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from loguru import logger

if TYPE_CHECKING:
    import psycopg


from typing import TYPE_CHECKING

from gateway.journal.protocol import CursorStore, Lead

if TYPE_CHECKING:
    import psycopg


class PostgresCursorStore:
    """Cursors in `gw_channel_cursors` and blobs in `gw_channel_blobs`, over one
    connection (autocommit)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    async def load(self, name: str) -> str | None:
        cur = await self._conn.execute(
            "SELECT value FROM gw_channel_cursors WHERE name = %s", (name,)
        )
        row = await cur.fetchone()
        return str(row[0]) if row is not None else None

    async def save(self, name: str, value: str) -> None:
        await self._conn.execute(
            "INSERT INTO gw_channel_cursors (name, value, updated_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, "
            "updated_at = EXCLUDED.updated_at",
            (name, value, time.time()),
        )

    async def load_blob(self, name: str) -> bytes | None:
        cur = await self._conn.execute("SELECT data FROM gw_channel_blobs WHERE name = %s", (name,))
        row = await cur.fetchone()
        return bytes(row[0]) if row is not None else None

    async def save_blob(self, name: str, data: bytes) -> None:
        await self._conn.execute(
            "INSERT INTO gw_channel_blobs (name, data, updated_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data, "
            "updated_at = EXCLUDED.updated_at",
            (name, data, time.time()),
        )


def lead_as(url: str, role: str) -> Lead:
    """The shared mode's `Lead`: the intake loop runs on the replica holding `role`, with
    cursors written on the connection that holds it."""

    async def lead(work: Callable[[CursorStore], Awaitable[None]]) -> None:
        async def with_store(conn: psycopg.AsyncConnection[Any]) -> None:
            await work(PostgresCursorStore(conn))

        await run_as_leader_on(url, role, with_store)

    return lead


#: First key of the advisory locks naming a replica's role ("gwld" in ASCII); the second
#: is the hash of the schema and the role name (advisory locks are database-wide).
LEADER_LOCK = 0x67776C64


async def run_as_leader(
    url: str,
    role: str,
    work: Callable[[], Awaitable[None]],
    *,
    retry: float = 1.0,
    check: float = 2.0,
) -> None:
    """Run `work` once this replica holds the advisory lock of `role` (waiting for it
    meanwhile), and only while it holds it.

    The lock lives on a connection of its own: when the holder dies, PostgreSQL sees the
    connection close and frees the lock at once, and a standby takes it within `retry`
    seconds. Losing the connection while holding it stops `work` (by raising), since
    another replica may be about to take over.
    """

    async def run(_conn: psycopg.AsyncConnection[Any]) -> None:
        await work()

    await run_as_leader_on(url, role, run, retry=retry, check=check)


async def run_as_leader_on(
    url: str,
    role: str,
    work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]],
    *,
    retry: float = 1.0,
    check: float = 2.0,
) -> None:
    """`run_as_leader`, handing `work` the connection that holds the lock: a write made
    on it commits only while this replica still holds the role (a fenced write)."""
    import psycopg

    logged = False
    while True:
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5)
            cur = await conn.execute(
                "SELECT pg_try_advisory_lock(%s::int4, hashtext(current_schema() || ':' || %s))",
                (LEADER_LOCK, role),
            )
            row = await cur.fetchone()
            if row is not None and row[0]:
                break
            if not logged:
                logger.info("replicas: another replica is the {}; standing by", role)
                logged = True
        except psycopg.Error as exc:
            logger.warning("replicas: cannot ask for the {} role ({}); retrying", role, exc)
        if conn is not None:
            await conn.close()
        await anyio.sleep(retry)
    logger.info("replicas: this replica is now the {}", role)
    held = conn

    async def watch() -> None:
        while True:
            await anyio.sleep(check)
            try:
                await held.execute("SELECT 1")
            except psycopg.Error as exc:
                raise RuntimeError(f"lost the {role} role: {exc}") from None

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await work(held)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await held.close()  # frees the lock for the standbys
