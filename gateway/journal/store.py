"""The inbound journal of one gateway: `FileDedupeStore`, one SQLite file in the workspace
(the embedded default, one daemon per workspace), and `MemoryDedupeStore` for tests and
one-shot runs, which journals nothing. The promises are `gateway.journal.protocol`'s."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
from loguru import logger

from gateway.fsutil import SqliteFile
from gateway.journal.protocol import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL,
    Unanswered,
)
from gateway.messages import InboundMessage, OutboundMessage

SCHEMA_VERSION = 3

_T = TypeVar("_T")


class MemoryDedupeStore:
    """Dedupe in a dict: bounded, expiring, lost on restart."""

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_TTL,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._seen)

    async def seen_or_add(self, key: str) -> bool:
        now = self._clock()
        seen_at = self._seen.get(key)
        if seen_at is not None and seen_at > now - self.ttl:
            return True
        # Room for one more: expired keys go first, then the oldest beyond the bound.
        while self._seen:
            oldest, oldest_at = next(iter(self._seen.items()))
            if oldest_at > now - self.ttl and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        self._seen[key] = now
        self._seen.move_to_end(key)
        return False

    async def release(self, key: str) -> None:
        self._seen.pop(key, None)

    async def mark_done(self, key: str) -> None:
        return None  # nothing survives a restart, so nothing to tell apart

    async def journal(self, key: str, msg: InboundMessage) -> None:
        return None  # nothing survives a crash here anyway

    async def record_reply(self, keys: Sequence[str], reply: OutboundMessage) -> None:
        return None

    async def unanswered(self) -> list[Unanswered]:
        return []

    def claimed_at(self, key: str) -> float | None:
        return self._seen.get(key)

    def preload(self, items: list[tuple[str, float]]) -> None:
        """Remember `items` (key, time), oldest first, as seen."""
        for key, seen_at in items:
            self._seen[key] = seen_at
            self._seen.move_to_end(key)

    async def aclose(self) -> None:
        self._seen.clear()


_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS answered (
        key TEXT PRIMARY KEY,
        seen_at REAL NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS answered_by_time ON answered(seen_at)",
    """CREATE TABLE IF NOT EXISTS inbox (
        key TEXT PRIMARY KEY,
        received_at REAL NOT NULL,
        message TEXT NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS outbox (
        key TEXT PRIMARY KEY,
        reply_id TEXT NOT NULL,
        reply TEXT NOT NULL
    ) WITHOUT ROWID""",
)


def _migrate(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, 1, 2, SCHEMA_VERSION):  # 1 -> 2 -> 3 only add tables
        logger.info("dedupe schema {} -> {}: starting afresh", version, SCHEMA_VERSION)
        conn.execute("DROP TABLE IF EXISTS answered")
        conn.execute("DROP TABLE IF EXISTS inbox")
    for statement in _SCHEMA:
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


class FileDedupeStore:
    """Dedupe with answered keys kept in a SQLite file (WAL): survives restarts, bounded
    by age (`ttl`) and count (`max_entries`).

    Claims live in memory (a `MemoryDedupeStore`, loaded with the file's answered keys
    on first use), so `seen_or_add` costs no I/O. Only answered keys are written, by
    `mark_done`, which returns once its key is committed; concurrent calls share one
    transaction (group commit), so a busy gateway pays one worker-thread hop per batch,
    not per message. A key claimed but never answered before a crash or a stop is not
    on file, hence answered when the platform redelivers it after the restart.

    With WAL and `synchronous=NORMAL` a commit survives a process crash; a power cut
    may forget the last few commits. With `durable` (the daemon's default, unless
    `sessions.fsync = "never"`) journal and outbox commits are fsynced, in a worker
    thread: a power cut loses no message a platform was told we have; it may forget
    the last few answered marks (such a reply is then sent again). Expired and
    surplus keys are purged every `purge_every` written keys. One daemon per file.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        ttl: float = DEFAULT_TTL,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        purge_every: int = 1000,
        busy_timeout_ms: int = 5000,
        clock: Callable[[], float] = time.time,
        io_on_loop: bool = True,
        durable: bool = False,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self.ttl = ttl
        self.max_entries = max_entries
        self.purge_every = purge_every
        self._clock = clock
        self._claims = MemoryDedupeStore(ttl=ttl, max_entries=max_entries, clock=clock)
        self._loaded = False
        self._loading: anyio.Lock | None = None
        # Which messages people sent, and when: a private file (open_sqlite: 0600).
        self._db = SqliteFile(
            self.path,
            what="dedupe",
            init=_migrate,
            busy_timeout_ms=busy_timeout_ms,
            io_on_loop=io_on_loop,
        )
        self._written_since_purge = 0
        # Group commit: keys waiting for the next transaction, and batch generations.
        self._pending: dict[str, float] = {}  # answered: key -> claimed at
        self._journaled: dict[str, tuple[float, str]] = {}  # key -> (received, JSON)
        self._recorded: dict[str, tuple[str, str]] = {}  # key -> (reply id, JSON)
        self._batch = 0  # generation of the batch `_pending` belongs to
        self._committed = 0  # last generation on disk
        self._flushing: anyio.Event | None = None
        self.batches_written = 0  # for tests and the benchmark

    # -- the DedupeStore protocol ---------------------------------------------------

    async def seen_or_add(self, key: str) -> bool:
        if not self._loaded:
            await self._load()
        return await self._claims.seen_or_add(key)

    async def _load(self) -> None:
        if self._loading is None:
            self._loading = anyio.Lock()
        async with self._loading:  # the first caller loads, the others wait for it
            if not self._loaded:
                await self._load_answered()

    async def _load_answered(self) -> None:
        since = self._clock() - self.ttl

        def load(conn: sqlite3.Connection) -> list[tuple[str, float]]:
            rows = conn.execute(
                "SELECT key, seen_at FROM answered WHERE seen_at > ? ORDER BY seen_at DESC LIMIT ?",
                (since, self.max_entries),
            ).fetchall()
            return [(str(k), float(t)) for k, t in reversed(rows)]

        self._claims.preload(await self._db.run(load))
        self._loaded = True

    async def release(self, key: str) -> None:
        await self._claims.release(key)

    async def mark_done(self, key: str) -> None:
        self._pending[key] = self._claims.claimed_at(key) or self._clock()
        await self._committed_batch()

    async def journal(self, key: str, msg: InboundMessage) -> None:
        self._journaled[key] = (msg.received_at, json.dumps(msg.to_dict(), default=str))
        await self._committed_batch()

    async def record_reply(self, keys: Sequence[str], reply: OutboundMessage) -> None:
        if not keys:
            return
        entry = (uuid.uuid4().hex, json.dumps(reply.to_dict(), default=str))
        for key in keys:
            self._recorded[key] = entry
        await self._committed_batch()

    async def unanswered(self) -> list[Unanswered]:
        def read(conn: sqlite3.Connection) -> list[tuple[str, str | None, str | None]]:
            rows = conn.execute(
                "SELECT inbox.message, outbox.reply_id, outbox.reply FROM inbox "
                "LEFT JOIN outbox ON outbox.key = inbox.key ORDER BY inbox.received_at"
            ).fetchall()
            return [(str(m), r_id, r) for m, r_id, r in rows]

        rows = await self._db.run(read)
        found = [Unanswered.from_stored(*row) for row in rows]
        return [entry for entry in found if entry is not None]

    async def _committed_batch(self) -> None:
        """Wait until the batch holding what was just queued is on disk."""
        wanted = self._batch + 1  # the generation that holds it, once committed
        if self._flushing is None:
            # Let the other tasks that are ready now queue theirs: one commit for all.
            await anyio.lowlevel.checkpoint()
        while self._committed < wanted:
            if self._flushing is not None:
                await self._flushing.wait()
                continue
            await self._flush()

    async def _flush(self) -> None:
        batch, journaled, recorded = self._pending, self._journaled, self._recorded
        generation = self._batch
        self._pending, self._journaled, self._recorded = {}, {}, {}
        self._batch += 1
        self._flushing = flushing = anyio.Event()
        now = self._clock()
        purge = self._written_since_purge + len(batch) >= self.purge_every

        def write(conn: sqlite3.Connection) -> None:
            # Journal and outbox first, answers second: a message journaled and
            # answered within one batch leaves no row behind.
            conn.executemany(
                "INSERT OR REPLACE INTO inbox (key, received_at, message) VALUES (?, ?, ?)",
                [(key, at, raw) for key, (at, raw) in journaled.items()],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO outbox (key, reply_id, reply) VALUES (?, ?, ?)",
                [(key, reply_id, raw) for key, (reply_id, raw) in recorded.items()],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO answered (key, seen_at) VALUES (?, ?)", batch.items()
            )
            done = [(key,) for key in batch]
            conn.executemany("DELETE FROM inbox WHERE key = ?", done)
            conn.executemany("DELETE FROM outbox WHERE key = ?", done)
            if purge:
                self._purge(conn, now)

        # With `durable`, what a platform is told we have (the journal) and a reply
        # about to go out (the outbox) are fsynced; answered marks need not be (one
        # lost to a power cut means a reply sent again, never a message lost).
        fsync = self.durable and bool(journaled or recorded)
        try:
            # On the loop when the connection is free (tens of microseconds, no fsync
            # in a WAL commit), else in a worker thread; an fsync or a purge (a table
            # scan) always.
            ran = False
            if not purge and not fsync:
                ran, _ = self._db.try_transaction_nowait(write)
            if not ran:
                await self._db.transaction(write, durable=fsync)
        except BaseException:
            # Back into the queue: the next flush retries them (the callers see the error).
            self._pending = {**batch, **self._pending}
            self._journaled = {**journaled, **self._journaled}
            self._recorded = {**recorded, **self._recorded}
            raise
        finally:
            self._flushing = None
            flushing.set()
        self._committed = generation + 1
        self.batches_written += 1
        self._written_since_purge = 0 if purge else self._written_since_purge + len(batch)

    def _purge(self, conn: sqlite3.Connection, now: float) -> None:
        conn.execute("DELETE FROM answered WHERE seen_at <= ?", (now - self.ttl,))
        total = conn.execute("SELECT count(*) FROM answered").fetchone()[0]
        if total > self.max_entries:
            conn.execute(
                "DELETE FROM answered WHERE key IN "
                "(SELECT key FROM answered ORDER BY seen_at LIMIT ?)",
                (total - self.max_entries,),
            )

    async def purge(self) -> None:
        """Drop expired keys and the oldest beyond `max_entries` from the file now."""
        now = self._clock()
        await self._db.transaction(lambda c: self._purge(c, now))

    async def count(self) -> int:
        """Answered keys on file (for tests and metrics)."""
        return int(
            await self._db.run(lambda c: c.execute("SELECT count(*) FROM answered").fetchone()[0])
        )

    async def aclose(self) -> None:
        if self._pending or self._journaled or self._recorded:
            try:
                while self._pending or self._journaled or self._recorded:
                    if self._flushing is not None:
                        await self._flushing.wait()
                    else:
                        await self._flush()
            except Exception as exc:
                logger.error("dedupe: {} answered keys not saved: {}", len(self._pending), exc)

        await self._db.aclose()
