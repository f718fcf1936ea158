"""Where each conversation of a platform was read up to: the start of the next backfill.

Some platforms confirm nothing and keep nothing for a bot that was away: Discord's
Gateway replays what a dropped connection missed only to a RESUME of the same session,
never to a new process. A channel on such a platform reads the conversation's history
itself when it (re)connects, from the position this store gives, and moves that
position on only past messages the gateway has settled (journaled, or decided to leave
alone). The promise this store keeps for it: a position saved here is never lost
by a crash once `save` returned, and `load` gives back the last one saved for each
conversation (a position saved late only means reading a little more history again,
which the journal's dedupe drops).

Positions are opaque strings (Discord: a message id, a snowflake). One store serves
every channel; rows are keyed by (channel, conversation). `FileCursorStore` is a SQLite
file in the workspace (the file mode), `PostgresCursorStore` the shared mode's table
``gw_channel_cursors`` (written by the one replica that holds the platform's
connection), `MemoryCursorStore` is for tests.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.fsutil import SqliteFile

if TYPE_CHECKING:
    from psycopg import AsyncConnection

#: The file of `FileCursorStore`, in the workspace.
CURSORS_FILE = "cursors.sqlite"


@dataclass(frozen=True, slots=True)
class Cursor:
    """A conversation's position and when it was last moved (Unix seconds)."""

    position: str
    updated_at: float


class CursorStore(Protocol):
    """Positions per (channel, conversation); see the module docstring."""

    async def load(self, channel: str) -> dict[str, Cursor]:
        """Every conversation of `channel` with its last saved position."""
        ...

    async def save(self, channel: str, positions: Mapping[str, str]) -> None:
        """Store the positions (replacing earlier ones); returns once they are durable."""
        ...

    async def forget(self, channel: str, conversations: Iterable[str]) -> None:
        """Drop the positions of `conversations` (a channel gone, or too old to read)."""
        ...

    async def aclose(self) -> None: ...


class MemoryCursorStore:
    """Positions in a dict (tests, and a channel run without a workspace)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.rows: dict[tuple[str, str], Cursor] = {}
        self.saves = 0

    async def load(self, channel: str) -> dict[str, Cursor]:
        return {conv: cursor for (name, conv), cursor in self.rows.items() if name == channel}

    async def save(self, channel: str, positions: Mapping[str, str]) -> None:
        now = self._clock()
        for conversation, position in positions.items():
            self.rows[(channel, conversation)] = Cursor(position, now)
        self.saves += 1

    async def forget(self, channel: str, conversations: Iterable[str]) -> None:
        for conversation in conversations:
            self.rows.pop((channel, conversation), None)

    async def aclose(self) -> None:
        return None


def _schema(conn: sqlite3.Connection) -> None:
    conn.execute(
        """CREATE TABLE IF NOT EXISTS cursors (
            channel TEXT NOT NULL,
            conversation TEXT NOT NULL,
            position TEXT NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (channel, conversation)
        ) WITHOUT ROWID"""
    )


class FileCursorStore:
    """Positions in a SQLite file (WAL, 0600): a `save` is committed before it returns
    (it survives a killed process; with `durable`, a power cut too)."""

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        io_on_loop: bool = True,
        durable: bool = False,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self._clock = clock
        self._db = SqliteFile(self.path, what="cursors", init=_schema, io_on_loop=io_on_loop)

    async def load(self, channel: str) -> dict[str, Cursor]:
        def read(conn: sqlite3.Connection) -> dict[str, Cursor]:
            rows = conn.execute(
                "SELECT conversation, position, updated_at FROM cursors WHERE channel = ?",
                (channel,),
            ).fetchall()
            return {str(c): Cursor(str(p), float(t)) for c, p, t in rows}

        return await self._db.run(read)

    async def save(self, channel: str, positions: Mapping[str, str]) -> None:
        if not positions:
            return
        now = self._clock()
        rows = [(channel, conv, position, now) for conv, position in positions.items()]

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "INSERT OR REPLACE INTO cursors (channel, conversation, position, updated_at) "
                "VALUES (?, ?, ?, ?)",
                rows,
            )

        await self._db.transaction(write, durable=self.durable)

    async def forget(self, channel: str, conversations: Iterable[str]) -> None:
        gone = [(channel, conv) for conv in conversations]
        if not gone:
            return

        def write(conn: sqlite3.Connection) -> None:
            conn.executemany("DELETE FROM cursors WHERE channel = ? AND conversation = ?", gone)

        await self._db.transaction(write)

    async def aclose(self) -> None:
        await self._db.aclose()


ConnectionFactory = Callable[[], AbstractAsyncContextManager["AsyncConnection[Any]"]]


class PostgresCursorStore:
    """Positions in ``gw_channel_cursors`` (migration 0012), over the journal's pool
    (`PostgresDedupeStore.connection`): one statement per save, committed on return."""

    def __init__(self, connection: ConnectionFactory, *, clock: Callable[[], float] = time.time):
        self._connection = connection
        self._clock = clock

    async def load(self, channel: str) -> dict[str, Cursor]:
        async with self._connection() as conn:
            cur = await conn.execute(
                "SELECT conversation, position, updated_at FROM gw_channel_cursors "
                "WHERE channel = %s",
                (channel,),
            )
            rows = await cur.fetchall()
        return {str(c): Cursor(str(p), float(t)) for c, p, t in rows}

    async def save(self, channel: str, positions: Mapping[str, str]) -> None:
        if not positions:
            return
        now = self._clock()
        conversations = list(positions)
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO gw_channel_cursors (channel, conversation, position, updated_at) "
                "SELECT %s, c, p, %s FROM unnest(%s::text[], %s::text[]) AS t(c, p) "
                "ON CONFLICT (channel, conversation) DO UPDATE "
                "SET position = EXCLUDED.position, updated_at = EXCLUDED.updated_at",
                (channel, now, conversations, [positions[c] for c in conversations]),
            )

    async def forget(self, channel: str, conversations: Iterable[str]) -> None:
        gone = list(conversations)
        if not gone:
            return
        async with self._connection() as conn:
            await conn.execute(
                "DELETE FROM gw_channel_cursors WHERE channel = %s AND conversation = ANY(%s)",
                (channel, gone),
            )

    async def aclose(self) -> None:
        return None  # the pool is the journal's


__all__ = [
    "CURSORS_FILE",
    "Cursor",
    "CursorStore",
    "FileCursorStore",
    "MemoryCursorStore",
    "PostgresCursorStore",
]
