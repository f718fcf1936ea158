"""The embedded cache backend: one SQLite file, safe for several processes.

WAL journal, a busy timeout and `BEGIN IMMEDIATE` writes let several processes share the
file; every `put` is committed before it returns, so a restart loses none (WAL with
`synchronous=NORMAL` survives a process crash; a power cut may drop the last commits,
which for a cache costs a few misses, never a wrong answer). Entry and byte totals are
kept by triggers in the same transactions, so enforcing `max_entries` on a put never
counts the table. Queries run in a worker thread, one at a time per backend object.

A hit records its access time only when the stored one is at least `touch_resolution`
seconds old (default 1 s), so a hot entry's hits are pure reads; LRU order is exact
to that resolution.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import TypeVar

import anyio.to_thread
from loguru import logger

from gateway.cache.backend import BackendCounts, CacheRecord, CacheUnavailable
from gateway.cache.policy import SHARED_SCOPE
from gateway.cache.verified import MAX_OBSERVATIONS
from gateway.fsutil import SqliteFile, immediate

SCHEMA_VERSION = 3
_T = TypeVar("_T")
#: A put on the event loop purges at most this many expired entries ...
_NOWAIT_PURGE = 16
#: ... and evicts at most this many (more: the put goes to a worker thread).
_NOWAIT_EVICT = 16


class _TooMuchForTheLoop(Exception):
    """A put on the event loop met more work than it may do there."""


_SCHEMA = (
    """CREATE TABLE entries (
        key TEXT PRIMARY KEY,
        response TEXT NOT NULL,
        model TEXT NOT NULL,
        scope TEXT NOT NULL,
        partition TEXT NOT NULL,
        query TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        accessed_at REAL NOT NULL,
        size INTEGER NOT NULL
    )""",
    "CREATE INDEX entries_by_access ON entries(accessed_at)",
    "CREATE INDEX entries_by_expiry ON entries(expires_at)",
    "CREATE INDEX entries_by_model ON entries(model)",
    "CREATE INDEX entries_by_scope ON entries(scope)",
    f"CREATE INDEX entries_by_partition ON entries(partition) WHERE scope = '{SHARED_SCOPE}'",
    """CREATE TABLE totals (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        entries INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        hits INTEGER NOT NULL DEFAULT 0,
        misses INTEGER NOT NULL DEFAULT 0
    )""",
    "INSERT INTO totals (id, entries, bytes, hits, misses) VALUES (1, 0, 0, 0, 0)",
    """CREATE TRIGGER entries_inserted AFTER INSERT ON entries BEGIN
        UPDATE totals SET entries = entries + 1, bytes = bytes + NEW.size WHERE id = 1;
    END""",
    """CREATE TRIGGER entries_deleted AFTER DELETE ON entries BEGIN
        UPDATE totals SET entries = entries - 1, bytes = bytes - OLD.size WHERE id = 1;
    END""",
    """CREATE TRIGGER entries_resized AFTER UPDATE OF size ON entries BEGIN
        UPDATE totals SET bytes = bytes - OLD.size + NEW.size WHERE id = 1;
    END""",
    # Near-duplicate labels of an entry (gateway/cache/verified.py): they go with it.
    """CREATE TABLE observations (
        id INTEGER PRIMARY KEY,
        key TEXT NOT NULL,
        similarity REAL NOT NULL,
        correct INTEGER NOT NULL
    )""",
    "CREATE INDEX observations_by_key ON observations(key, id)",
    """CREATE TRIGGER entries_dropped_labels AFTER DELETE ON entries BEGIN
        DELETE FROM observations WHERE key = OLD.key;
    END""",
)

_COLUMNS = "key, response, model, scope, partition, query, created_at, expires_at"


class SqliteCacheBackend:
    """Cache entries in a SQLite file at `path` (created with its folder if missing).

    A file that is not a readable database, or has another schema version, is moved
    aside (`<name>.broken-<time>`) or rebuilt: it only ever held a cache.
    """

    name = "sqlite"

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_ms: int = 5000,
        purge_batch: int = 1000,
        touch_resolution: float = 1.0,
        io_on_loop: bool = True,
    ) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self._touch_resolution = touch_resolution
        self._purge_batch = purge_batch
        self._db = SqliteFile(
            self.path,
            what="cache",
            init=self._migrate,
            busy_timeout_ms=busy_timeout_ms,
            io_on_loop=io_on_loop,
        )
        # Lookups counted since the last fold into the file's totals: a lookup stays a
        # pure read; `counts` and `aclose` add these to the shared, persisted totals.
        self._counter_lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                if version != 0:
                    logger.info("cache schema {} -> {}: rebuilding", version, SCHEMA_VERSION)
                for table in ("observations", "entries", "totals"):
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _purge_expired(self, conn: sqlite3.Connection, now: float, limit: int) -> int:
        return conn.execute(
            "DELETE FROM entries WHERE key IN "
            "(SELECT key FROM entries WHERE expires_at <= ? LIMIT ?)",
            (now, limit),
        ).rowcount

    # -- the CacheBackend protocol ------------------------------------------------

    async def get(self, key: str, *, now: float) -> CacheRecord | None:
        def query(conn: sqlite3.Connection) -> CacheRecord | None:
            row = conn.execute(
                f"SELECT {_COLUMNS}, accessed_at FROM entries WHERE key = ?", (key,)
            ).fetchone()
            if row is None:
                return None
            record = CacheRecord(*row[:-1])
            if record.expires_at <= now:
                conn.execute("DELETE FROM entries WHERE key = ? AND expires_at <= ?", (key, now))
                return None
            if now - row[-1] >= self._touch_resolution:
                conn.execute("UPDATE entries SET accessed_at = ? WHERE key = ?", (now, key))
            return record

        ran, found = self._db.try_run_nowait(query)  # a lookup on the loop: no thread hop
        if ran:
            return found
        return await self._db.run(query)

    async def put(self, record: CacheRecord, *, now: float, max_entries: int) -> int:
        """Store `record` (one transaction, with the expired entries' purge and the
        eviction down to `max_entries`); the entries removed. On the event loop when the
        file is free and the work is small (at most `_NOWAIT_PURGE` expired entries
        purged, an eviction of at most `_NOWAIT_EVICT`), else in a worker thread."""

        def write(conn: sqlite3.Connection, *, nowait: bool) -> int:
            conn.execute(
                f"INSERT INTO entries ({_COLUMNS}, accessed_at, size) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET response = excluded.response, "
                "model = excluded.model, scope = excluded.scope, "
                "partition = excluded.partition, query = excluded.query, "
                "created_at = excluded.created_at, expires_at = excluded.expires_at, "
                "accessed_at = excluded.accessed_at, size = excluded.size",
                (
                    record.key,
                    record.response,
                    record.model,
                    record.scope,
                    record.partition,
                    record.query,
                    record.created_at,
                    record.expires_at,
                    now,
                    record.size,
                ),
            )
            # On the loop a few expired entries go a put (the rest with later puts, or
            # when a lookup meets them); a worker purges a whole batch.
            purge = _NOWAIT_PURGE if nowait else self._purge_batch
            removed = self._purge_expired(conn, now, purge)
            total = conn.execute("SELECT entries FROM totals WHERE id = 1").fetchone()[0]
            if total > max_entries:
                if nowait and total - max_entries > _NOWAIT_EVICT:
                    raise _TooMuchForTheLoop  # rolled back by `immediate`
                removed += conn.execute(
                    "DELETE FROM entries WHERE key IN (SELECT key FROM entries WHERE key != ? "
                    "ORDER BY accessed_at, rowid LIMIT ?)",
                    (record.key, total - max_entries),
                ).rowcount
            return removed

        try:
            ran, removed = self._db.try_transaction_nowait(lambda conn: write(conn, nowait=True))
        except _TooMuchForTheLoop:
            ran, removed = False, None  # nothing written: the worker does it whole
        if ran and removed is not None:
            return removed
        return await self._db.transaction(lambda conn: write(conn, nowait=False))

    async def delete(self, key: str) -> bool:
        def write(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount > 0

        return await self._db.run(write)

    async def delete_model(self, model: str) -> int:
        return await self._db.run(
            lambda conn: conn.execute("DELETE FROM entries WHERE model = ?", (model,)).rowcount
        )

    async def delete_scope(self, scope: str) -> int:
        return await self._db.run(
            lambda conn: conn.execute("DELETE FROM entries WHERE scope = ?", (scope,)).rowcount
        )

    async def clear(self) -> int:
        return await self._db.run(lambda conn: conn.execute("DELETE FROM entries").rowcount)

    async def record_lookup(self, *, hit: bool) -> None:
        with self._counter_lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1

    def _fold_counts(self, conn: sqlite3.Connection) -> None:
        """Add this process's lookups since the last fold to the file's totals, so
        every process (the daemon, `gateway cache stats`) reads the same counts."""
        with self._counter_lock:
            hits, misses = self._hits, self._misses
            self._hits = self._misses = 0
        if hits or misses:
            conn.execute(
                "UPDATE totals SET hits = hits + ?, misses = misses + ? WHERE id = 1",
                (hits, misses),
            )

    async def counts(self, *, now: float) -> BackendCounts:
        def read(conn: sqlite3.Connection) -> tuple[int, int, int, int]:
            def fold_and_purge(c: sqlite3.Connection) -> None:
                self._fold_counts(c)
                self._purge_expired(c, now, self._purge_batch)

            immediate(conn, fold_and_purge)
            entries, size, hits, misses = conn.execute(
                "SELECT entries, bytes, hits, misses FROM totals WHERE id = 1"
            ).fetchone()
            return int(entries), int(size), int(hits), int(misses)

        entries, size, hits, misses = await self._db.run(read)
        return BackendCounts(entries=entries, bytes=size, hits=hits, misses=misses)

    async def shared_queries(self, partition: str, *, now: float) -> list[tuple[str, str]]:
        def read(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            rows = conn.execute(
                "SELECT key, query FROM entries "
                "WHERE scope = ? AND partition = ? AND expires_at > ? AND query != ''",
                (SHARED_SCOPE, partition, now),
            ).fetchall()
            return [(str(k), str(q)) for k, q in rows]

        return await self._db.run(read)

    async def add_observation(
        self, key: str, similarity: float, correct: bool, *, now: float
    ) -> None:
        def write(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is None:
                return  # evicted meanwhile: its labels would have gone with it
            conn.execute(
                "INSERT INTO observations (key, similarity, correct) VALUES (?, ?, ?)",
                (key, similarity, int(correct)),
            )
            conn.execute(
                "DELETE FROM observations WHERE key = ? AND id NOT IN "
                "(SELECT id FROM observations WHERE key = ? ORDER BY id DESC LIMIT ?)",
                (key, key, MAX_OBSERVATIONS),
            )

        await self._db.run(lambda conn: immediate(conn, write))

    async def partition_observations(
        self, partition: str, *, now: float
    ) -> dict[str, list[tuple[float, bool]]]:
        def read(conn: sqlite3.Connection) -> dict[str, list[tuple[float, bool]]]:
            rows = conn.execute(
                "SELECT o.key, o.similarity, o.correct FROM observations o "
                "JOIN entries e ON e.key = o.key "
                "WHERE e.scope = ? AND e.partition = ? AND e.expires_at > ? ORDER BY o.id",
                (SHARED_SCOPE, partition, now),
            ).fetchall()
            found: dict[str, list[tuple[float, bool]]] = {}
            for key, similarity, correct in rows:
                found.setdefault(str(key), []).append((float(similarity), bool(correct)))
            return found

        return await self._db.run(read)

    async def check(self) -> None:
        """Raise `CacheUnavailable` unless the file can serve: a database this user may
        read and write, or not there yet in a folder where it can be made. Creates and
        changes nothing (`gateway doctor` may run as another user than the gateway)."""
        problem = await anyio.to_thread.run_sync(self._problem)
        if problem is not None:
            raise CacheUnavailable(
                f"cache file {self.path}: {problem}",
                "make it writable for the gateway's user, or set cache.url (GATEWAY_CACHE__URL)",
            )

    def _problem(self) -> str | None:
        path = self.path
        if not path.exists():
            folder = next(p for p in path.parents if p.exists())
            if not os.access(folder, os.W_OK | os.X_OK):
                return f"cannot be created: {folder} is not writable"
            return None
        if not os.access(path, os.R_OK | os.W_OK):
            return "not readable and writable by this user"
        try:
            # immutable: no lock, no -wal/-shm files made; reading the header suffices.
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
            try:
                conn.execute("PRAGMA schema_version").fetchone()
            finally:
                conn.close()
        except sqlite3.Error as exc:
            return f"cannot be opened ({exc})"
        return None

    async def aclose(self) -> None:
        await self._db.aclose(last_write=self._fold_counts)
