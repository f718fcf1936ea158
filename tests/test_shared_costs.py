"""Round trips the shared mode spends (real PostgreSQL behind a counting wire proxy): a
busy pool's statement is one round trip, a current session's append is one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
from psycopg_pool import ConnectionPool

from gateway.llm.types import LLMMessage
from gateway.sessions.entries import MessageEntry
from gateway.sessions.manager import _message_factory
from gateway.sessions.pg_store import PostgresSessionStore
from gateway.sessions.store import EntryFactory
from gateway.storage.postgres import sync_pool
from tests.fakes.pg_wire_counter import PgWireCounter


@pytest.fixture
def counted_pool(migrated_pg_url: str) -> Iterator[tuple[ConnectionPool, PgWireCounter]]:
    """A one-connection pool whose round trips `PgWireCounter` counts."""
    parts = urlsplit(migrated_pg_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    with PgWireCounter.in_thread(host, port) as wire:
        netloc = parts.netloc.replace(f"{host}:{port}", f"127.0.0.1:{wire.listen_port}")
        with sync_pool(parts._replace(netloc=netloc).geturl(), max_size=1) as pool:
            pool.wait()
            yield pool, wire


def _message(text: str) -> EntryFactory[MessageEntry]:
    return _message_factory(LLMMessage(role="user", content=text), None)


def _round_trips(wire: PgWireCounter, action: Callable[[int], object], times: int) -> int:
    """Round trips of `times` calls of `action`, after 6 unmeasured calls (psycopg prepares
    a statement at its 5th use, which costs one more trip once)."""
    for n in range(6):
        action(n)
    before = wire.round_trips
    for n in range(times):
        action(n)
    return wire.round_trips - before


def test_a_statement_on_a_busy_pool_is_one_round_trip(
    counted_pool: tuple[ConnectionPool, PgWireCounter],
) -> None:
    pool, wire = counted_pool

    def select(_: int) -> None:
        with pool.connection() as conn:
            conn.execute("SELECT 1")

    # No BEGIN/COMMIT around it and no check of a connection just used.
    assert _round_trips(wire, select, 10) == 10


def test_appending_to_a_current_session_is_one_round_trip(
    counted_pool: tuple[ConnectionPool, PgWireCounter],
) -> None:
    pool, wire = counted_pool

    store = PostgresSessionStore(pool, "cli:costs")
    store.append(_message("first"))  # creates the session (the locked path)
    assert _round_trips(wire, lambda n: store.append(_message(f"turn {n}")), 5) == 5
    # The stored chain is intact: each entry's parent is the one before it.
    other = PostgresSessionStore(pool, "cli:costs")
    other.load()
    branch = other.tree.get_branch()
    assert [e.parent_id for e in branch[1:]] == [e.id for e in branch[:-1]]
    assert len(branch) == 12  # the first, 6 unmeasured, 5 measured
