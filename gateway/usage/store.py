"""The usage ledger of one gateway: `usage.sqlite` in the workspace (`SqliteUsageLedger`).
An older file gains the provider column in place, its totals under provider ""."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.fsutil import open_sqlite
from gateway.usage.protocol import (
    USAGE_COLUMNS,
    USAGE_KEY,
    UsageRow,
    budget_sql,
    row_values,
    usage_row,
    where_clause,
)

#: The file mode's ledger, in the workspace folder.
USAGE_FILE = "usage.sqlite"

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,
    session_key TEXT NOT NULL,
    channel TEXT NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    provider TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (day, session_key, channel, model, kind, provider)
)
"""

_UPSERT = (
    f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    f"ON CONFLICT ({USAGE_KEY}) DO UPDATE SET "
    "calls = calls + excluded.calls, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = completion_tokens + excluded.completion_tokens, "
    "cost = cost + excluded.cost"
)

_BUSY_TIMEOUT_MS = 5000  # open_sqlite's default


def has_provider_column(conn: sqlite3.Connection) -> bool:
    """Whether a usage.sqlite's table has the provider column (files written before
    providers were counted have not)."""
    columns = conn.execute("SELECT name FROM pragma_table_info('usage')").fetchall()
    return ("provider",) in columns


def _create_usage_table(conn: sqlite3.Connection) -> None:
    """The ledger's table, made or brought up to date: a file of an older version gets
    the provider column (its totals under provider "") in one transaction, as a new
    table, since the column joins the key."""
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage'").fetchone()
    if exists is None or has_provider_column(conn):
        conn.execute(_SQLITE_SCHEMA)
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not has_provider_column(conn):  # another process may have done it meanwhile
            conn.execute("ALTER TABLE usage RENAME TO usage_before_providers")
            conn.execute(_SQLITE_SCHEMA)
            old = USAGE_COLUMNS.removesuffix(", provider")
            conn.execute(
                f"INSERT INTO usage ({USAGE_COLUMNS}) SELECT {old}, '' FROM usage_before_providers"
            )
            conn.execute("DROP TABLE usage_before_providers")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SqliteUsageLedger:
    """The file mode's ledger: `usage.sqlite` in the workspace (WAL, one writer lock)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        # 0600 like every workspace database (it names conversations), and a damaged file
        # is moved aside, not overwritten.
        self._db = open_sqlite(path, what="usage ledger", init=_create_usage_table)
        # Never waits for another process's lock unless a call says so (`_waiting`): the
        # turn's upsert on the event loop (`try_add_nowait`) then costs one statement.
        self._db.execute("PRAGMA busy_timeout = 0")

    @contextmanager
    def _waiting(self) -> Iterator[sqlite3.Connection]:
        """The connection, waiting up to the busy timeout for another writer's lock
        (under `_lock`, off the event loop)."""
        with self._lock:
            self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            try:
                yield self._db
            finally:
                self._db.execute("PRAGMA busy_timeout = 0")

    def add(self, row: UsageRow) -> None:
        with self._waiting() as db:
            db.execute(_UPSERT, row_values(row))

    def try_add_nowait(self, row: UsageRow) -> bool:
        """`add` here and now, on the event loop, when that cannot wait (the connection
        free, the file not locked by another writer); False, nothing written, else. An
        upsert in WAL mode without fsync takes microseconds: cheaper than a thread hop."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._db.execute(_UPSERT, row_values(row))  # busy timeout 0: never waits
            return True
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return False
            raise
        finally:
            self._lock.release()

    def rows(self, *, since: str | None = None, session_key: str | None = None) -> list[UsageRow]:
        where, params = where_clause(since, session_key, "?")
        sql = (
            f"SELECT {USAGE_COLUMNS} FROM usage{where} "
            "ORDER BY day, session_key, kind, model, provider"
        )
        with self._waiting() as db:
            return [usage_row(values) for values in db.execute(sql, params)]

    def tokens(self, day: str, session_key: str | None = None) -> int:
        sql, params = budget_sql("usage", day, session_key, "?")
        with self._waiting() as db:
            (total,) = db.execute(sql, params).fetchone()
        return int(total)

    def close(self) -> None:
        with self._lock:
            self._db.close()
