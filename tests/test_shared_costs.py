"""Round trips the shared mode spends (real PostgreSQL behind a counting wire proxy): a
busy pool's statement is one round trip, a current session's append is one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from psycopg_pool import ConnectionPool

from gateway.llm.types import LLMMessage
from gateway.plumbing.postgres import sync_pool
from gateway.sessions.entries import MessageEntry
from gateway.sessions.manager import _message_factory
from gateway.sessions.pg_store import PostgresSessionStore
from gateway.sessions.store import EntryFactory
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
    store.append(_message("first"))  # creates the session with its first entry
    assert _round_trips(wire, lambda n: store.append(_message(f"turn {n}")), 5) == 5
    # The stored chain is intact: each entry's parent is the one before it.
    other = PostgresSessionStore(pool, "cli:costs")
    other.load()
    branch = other.tree.get_branch()
    assert [e.parent_id for e in branch[1:]] == [e.id for e in branch[:-1]]
    assert len(branch) == 12  # the first, 6 unmeasured, 5 measured


@pytest.mark.anyio
async def test_a_turns_session_steps_on_the_loop_are_one_round_trip_each(
    migrated_pg_url: str,
) -> None:
    """Over the loop's pool (the journal's): a new key's session is created with its
    first entry in one round trip, a current session's entry appended in one, and the
    cached session checked in one."""
    from gateway.journal.pg_store import PostgresDedupeStore
    from gateway.sessions import SessionManager
    from gateway.sessions.pg_store import PostgresSessions
    from gateway.usage.meter import PriceTable, UsageMeter, UsageScope
    from gateway.usage.pg_store import PostgresUsageLedger

    parts = urlsplit(migrated_pg_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    with PgWireCounter.in_thread(host, port) as wire:
        netloc = parts.netloc.replace(f"{host}:{port}", f"127.0.0.1:{wire.listen_port}")
        journal = PostgresDedupeStore(parts._replace(netloc=netloc).geturl(), pool_size=1)
        with sync_pool(migrated_pg_url, max_size=1) as threads_pool:
            manager = SessionManager.shared(PostgresSessions(threads_pool))
            manager.use_loop_connections(journal.connection)
            async with journal.connection() as conn:  # opened, and warm
                await conn.execute("SELECT 1")

            async def trips(step: Callable[[], Any]) -> int:
                before = wire.round_trips
                await step()
                return wire.round_trips - before

            for n in range(6):  # psycopg prepares a statement at its 5th use: warm it
                warm = await manager.aget_or_create(f"api:warm{n}")
                await warm.aadd_message(LLMMessage(role="user", content="hi"))
                await warm.aadd_message(LLMMessage(role="assistant", content="hello"))
            session = await manager.aget_or_create("api:new")
            first = await trips(lambda: session.aadd_message(LLMMessage(role="user", content="a")))
            later = await trips(lambda: session.aadd_message(LLMMessage(role="user", content="b")))
            check = await trips(lambda: manager.aget_or_create("api:new"))
            # A turn's model call counted: its usage row rides in the reply's append.
            ledger = PostgresUsageLedger(threads_pool)
            ledger.aconnect = journal.connection
            meter = UsageMeter(ledger, PriceTable({}))

            async def answered() -> None:
                async with meter.riding():
                    await meter.arecord(UsageScope("api:new", "api", "turn"), "m", 5, 1)
                    await session.aadd_message(LLMMessage(role="assistant", content="c"))

            counted = await trips(answered)
            assert ledger.rows(session_key="api:new")[0].calls == 1
        await journal._pool.close()
    assert (first, later, check, counted) == (1, 1, 1, 1)
