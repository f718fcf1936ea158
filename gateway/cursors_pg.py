"""Channel cursors and state blobs in PostgreSQL for the shared mode
(`gateway.cursors.CursorStore`): `gw_channel_cursors` and `gw_channel_blobs`.

Written only by the replica holding the channel's leader role, and on the very connection
that holds its advisory lock (`gateway.replicas.run_as_leader_on`): a replica that lost the
role (its session ended) cannot write a cursor any more, so a standby that took over never
has its position moved back by the old leader.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gateway.cursors import CursorStore, Lead

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
    from gateway.replicas import run_as_leader_on

    async def lead(work: Callable[[CursorStore], Awaitable[None]]) -> None:
        async def with_store(conn: psycopg.AsyncConnection[Any]) -> None:
            await work(PostgresCursorStore(conn))

        await run_as_leader_on(url, role, with_store)

    return lead
