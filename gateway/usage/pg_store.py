"""The usage ledger in PostgreSQL (`gw_usage`), shared by replicas so that a budget holds
across them; a turn's rows ride on its session append (`riding_rows`), in the same
statement, so counting costs no round trip of its own."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.to_thread

from gateway.usage.meter import take_riding
from gateway.usage.protocol import (
    USAGE_COLUMNS,
    USAGE_KEY,
    UsageRow,
    budget_sql,
    row_values,
    usage_row,
    where_clause,
)


def riding_rows() -> tuple[str, tuple[Any, ...], Callable[[bool], None]] | None:
    """For the shared session store's next append: the data-modifying statement that
    writes the current turn's pending usage rows (for a CTE), its parameters, and what
    to call with the outcome (True: committed; False: not, and the rows wait for the
    next append or the turn's end). None when nothing rides."""
    taken = take_riding()
    if taken is None:
        return None
    rows, settle = taken
    values = ", ".join([_PG_ROW] * len(rows))
    params = tuple(value for row in rows for value in _pg_params(row))
    return _PG_INSERT + values + _PG_UPSERT, params, settle


_PG_INSERT = f"INSERT INTO gw_usage ({USAGE_COLUMNS}) VALUES "

_PG_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"

_PG_UPSERT = (
    f" ON CONFLICT ({USAGE_KEY}) DO UPDATE SET "
    "calls = gw_usage.calls + excluded.calls, "
    "prompt_tokens = gw_usage.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = gw_usage.completion_tokens + excluded.completion_tokens, "
    "cost = gw_usage.cost + excluded.cost"
)

_PG_ADD = _PG_INSERT + _PG_ROW + _PG_UPSERT


def _pg_params(row: UsageRow) -> tuple[Any, ...]:
    return row_values(row)


class PostgresUsageLedger:
    """The shared mode's ledger (`gw_usage`, migrations 0007 and 0014): replicas add to
    the same totals, so a budget holds across them."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        #: A connection of the event loop's pool (`PostgresDedupeStore.connection`), for
        #: `aadd`; None until the gateway gives one.
        self.aconnect: Callable[[], AbstractAsyncContextManager[Any]] | None = None

    def add(self, row: UsageRow) -> None:
        with self._pool.connection() as conn:
            conn.execute(_PG_ADD, _pg_params(row))

    async def aadd(self, row: UsageRow) -> bool:
        """`add` on the event loop over its pool (no worker thread: see
        `gateway.sessions.pg_store` on what a thread hop per call costs a turn's
        latency); False, nothing added, when the gateway gave no loop pool."""
        if self.aconnect is None:
            return False
        with anyio.CancelScope(shield=True):  # a stopped turn's call still counts
            async with self.aconnect() as conn:
                await conn.execute(_PG_ADD, _pg_params(row))
        return True

    def rows(self, *, since: str | None = None, session_key: str | None = None) -> list[UsageRow]:
        where, params = where_clause(since, session_key, "%s")
        sql = (
            f"SELECT {USAGE_COLUMNS} FROM gw_usage{where} "
            "ORDER BY day, session_key, kind, model, provider"
        )
        with self._pool.connection() as conn:
            return [usage_row(values) for values in conn.execute(sql, params).fetchall()]

    def tokens(self, day: str, session_key: str | None = None) -> int:
        sql, params = budget_sql("gw_usage", day, session_key, "%s")
        with self._pool.connection() as conn:
            row = conn.execute(sql, params).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        pass  # the pool belongs to the shared storage
