"""Round trips the shared mode spends (real PostgreSQL behind a counting wire proxy): a
busy pool's statement is one round trip, a current session's append is one."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from gateway.llm.types import LLMMessage
from gateway.sessions.entries import MessageEntry
from gateway.sessions.manager import _message_factory
from gateway.sessions.pg_store import PostgresSessionStore
from gateway.sessions.store import EntryFactory
from gateway.storage.postgres import sync_pool
from tests.fakes.pg_wire_counter import PgWireCounter


@pytest.fixture
def counted_url(migrated_pg_url: str) -> Iterator[tuple[str, PgWireCounter]]:
    parts = urlsplit(migrated_pg_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    with PgWireCounter.in_thread(host, port) as wire:
        netloc = parts.netloc.replace(f"{host}:{port}", f"127.0.0.1:{wire.listen_port}")
        yield parts._replace(netloc=netloc).geturl(), wire


def _message(text: str) -> EntryFactory[MessageEntry]:
    return _message_factory(LLMMessage(role="user", content=text), None)


def test_a_statement_on_a_busy_pool_is_one_round_trip(
    counted_url: tuple[str, PgWireCounter],
) -> None:
    url, wire = counted_url
    with sync_pool(url, max_size=1) as pool:
        pool.wait()
        for _ in range(6):  # psycopg prepares a statement at its 5th use: one more trip
            with pool.connection() as conn:
                conn.execute("SELECT 1")
        before = wire.round_trips
        for _ in range(10):
            with pool.connection() as conn:
                conn.execute("SELECT 1")
        # No BEGIN/COMMIT around it and no check of a connection just used.
        assert wire.round_trips - before == 10


def test_appending_to_a_current_session_is_one_round_trip(
    counted_url: tuple[str, PgWireCounter],
) -> None:
    url, wire = counted_url
    with sync_pool(url, max_size=1) as pool:
        pool.wait()
        store = PostgresSessionStore(pool, "cli:costs")
        store.append(_message("first"))  # creates the session (the locked path)
        for n in range(6):  # psycopg prepares a statement at its 5th use: one more trip
            store.append(_message(f"warm {n}"))
        before = wire.round_trips
        for n in range(5):
            store.append(_message(f"turn {n}"))
        assert wire.round_trips - before == 5
        # The stored chain is intact: each entry's parent is the one before it.
        other = PostgresSessionStore(pool, "cli:costs")
        other.load()
        branch = other.tree.get_branch()
        assert [e.parent_id for e in branch[1:]] == [e.id for e in branch[:-1]]
        assert len(branch) == 12
