"""A turn's session and usage writes in the shared mode run on the event loop, over the
journal's pool (real PostgreSQL): a new key's session is created with its first entry,
a current session's entry is appended, a cached session is checked, each in one round
trip and without a worker thread; whenever another replica got there first, the worker
thread's locking path catches up and nothing is lost, doubled or mis-parented."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from gateway.journal.pg_store import PostgresDedupeStore
from gateway.llm.types import LLMMessage
from gateway.sessions import SessionManager
from gateway.sessions.entries import MessageEntry
from gateway.sessions.pg_store import PostgresSessions
from gateway.usage.meter import PriceTable, UsageMeter, UsageScope
from gateway.usage.pg_store import PostgresUsageLedger, riding_rows

pytestmark = pytest.mark.anyio


class Hops:
    """Counts the worker-thread hops made while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = anyio.to_thread.run_sync

        async def counting(func: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            self.count += 1
            return await original(func, *args, **kw)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counting)


@pytest.fixture
async def journal(migrated_pg_url: str) -> AsyncIterator[PostgresDedupeStore]:
    store = PostgresDedupeStore(migrated_pg_url)
    yield store
    await store._pool.close()


@pytest.fixture
def replica(
    pg_pools: Callable[[], Any], journal: PostgresDedupeStore
) -> Callable[[], SessionManager]:
    """A replica's session manager: its own worker-thread pool, the loop's pool shared."""

    def make() -> SessionManager:
        manager = SessionManager.shared(PostgresSessions(pg_pools()))
        manager.use_loop_connections(journal.connection)
        return manager

    return make


def texts(manager: SessionManager, key: str) -> list[str]:
    """The stored branch of `key` as a fresh replica reads it, parents checked."""
    fresh = SessionManager.shared(PostgresSessions(manager._shared.pool))  # type: ignore[union-attr]
    branch = fresh.get_or_create(key).get_branch()
    assert [e.parent_id for e in branch[1:]] == [e.id for e in branch[:-1]]
    return [str(e.message.content) for e in branch if isinstance(e, MessageEntry)]


def user(text: str) -> LLMMessage:
    return LLMMessage(role="user", content=text)


async def test_a_new_session_and_its_appends_need_no_worker_thread(
    replica: Callable[[], SessionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = replica()
    hops = Hops(monkeypatch)
    session = await manager.aget_or_create("api:new")
    for n in range(4):
        await session.aadd_message(user(f"m{n}"))
    again = await manager.aget_or_create("api:new")  # cached and current: one check
    await again.aadd_message(user("m4"))
    assert hops.count == 0
    assert again is session
    assert texts(manager, "api:new") == [f"m{n}" for n in range(5)]
    # The session row as the locking path writes it: made (its header) before its first
    # entry, last active at its last entry (an import of its export gives the same row).
    header, branch = session._store.header, session.get_branch()
    pool = manager._shared.pool  # type: ignore[union-attr]
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT created_at, updated_at, last_seq FROM gw_sessions WHERE key = 'api:new'"
        ).fetchone()
    assert header.timestamp <= branch[0].timestamp
    assert row == (header.timestamp, branch[-1].timestamp, 5)


async def test_another_replicas_appends_between_ours_are_caught_up(
    replica: Callable[[], SessionManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = replica(), replica()
    session = await ours.aget_or_create("telegram:7")
    await session.aadd_message(user("a1"))
    other = await theirs.aget_or_create("telegram:7")
    await other.aadd_message(user("b1"))
    hops = Hops(monkeypatch)
    # Our tree is behind: the one-statement append writes nothing, the locking one
    # reads b1 and stores a2 after it.
    entry = await session.aadd_message(user("a2"))
    assert hops.count == 1
    assert texts(ours, "telegram:7") == ["a1", "b1", "a2"]
    assert entry.parent_id == other.get_branch()[-1].id
    # And a cached session another replica wrote to is read afresh, not taken as is.
    await other.aadd_message(user("b2"))
    reopened = await ours.aget_or_create("telegram:7")
    assert [str(e.message.content) for e in reopened.get_branch()[-2:]] == ["a2", "b2"]


async def test_a_key_another_replica_created_first_is_adopted(
    replica: Callable[[], SessionManager],
) -> None:
    ours, theirs = replica(), replica()
    session = await ours.aget_or_create("slack:C1")  # no row yet: a new, empty session
    other = await theirs.aget_or_create("slack:C1")
    await other.aadd_message(user("theirs"))
    # Ours would create the key's session: it exists, so ours joins it instead.
    entry = await session.aadd_message(user("ours"))
    assert texts(ours, "slack:C1") == ["theirs", "ours"]
    assert entry.parent_id == other.get_branch()[-1].id
    assert len(theirs._shared.list_sessions()) == 1  # type: ignore[union-attr]


async def test_a_stopped_turns_append_is_stored_and_known(
    replica: Callable[[], SessionManager],
) -> None:
    manager = replica()
    session = await manager.aget_or_create("cli:direct")
    await session.aadd_message(user("first"))
    with anyio.CancelScope() as scope:
        scope.cancel()  # cancelled before the append even starts its round trip
        await session.aadd_message(user("second"))
        await anyio.lowlevel.checkpoint()  # the turn's next step is where the stop lands
    assert scope.cancelled_caught
    # Stored, and the tree knows it: the next append chains after it in one statement.
    await session.aadd_message(user("third"))
    assert texts(manager, "cli:direct") == ["first", "second", "third"]


async def test_a_model_calls_usage_is_counted_on_the_loop(
    pg_pools: Callable[[], Any], journal: PostgresDedupeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = PostgresUsageLedger(pg_pools())
    ledger.aconnect = journal.connection
    meter = UsageMeter(ledger, PriceTable({}))
    hops = Hops(monkeypatch)
    scope = UsageScope("api:u1", "api", "turn")
    for _ in range(3):
        await meter.arecord(scope, "gpt-x", 100, 20)
    assert hops.count == 0
    (row,) = ledger.rows(session_key="api:u1")
    assert (row.calls, row.prompt_tokens, row.completion_tokens) == (3, 300, 60)
    # Without the loop's pool it still counts, in a worker thread.
    ledger.aconnect = None
    await meter.arecord(scope, "gpt-x", 1, 1)
    assert hops.count == 1
    assert ledger.rows(session_key="api:u1")[0].calls == 4


async def test_a_turns_usage_rides_with_its_next_append_or_is_written_at_its_end(
    replica: Callable[[], SessionManager], pg_pools: Callable[[], Any], journal: PostgresDedupeStore
) -> None:
    """In a turn (`UsageMeter.riding`) the model calls' rows are written in the statement
    of the turn's next session append (merged per model), counted for the listeners once
    committed; a turn that appends nothing after its call writes them on its way out."""
    manager = replica()
    ledger = PostgresUsageLedger(pg_pools())
    ledger.aconnect = journal.connection
    meter = UsageMeter(ledger, PriceTable({}))
    heard: list[int] = []
    meter.on_record(lambda row: heard.append(row.calls))
    scope = UsageScope("api:ride", "api", "turn")
    session = await manager.aget_or_create("api:ride")
    await session.aadd_message(user("hello"))  # the session exists: a current append

    def calls() -> int:
        rows = ledger.rows(session_key="api:ride")
        return rows[0].calls if rows else 0

    async with meter.riding():
        await meter.arecord(scope, "gpt-x", 10, 2)
        await meter.arecord(scope, "gpt-x", 10, 2)  # a tool round: same key, merged
        assert calls() == 0 and heard == []  # nothing written yet
        await session.aadd_message(LLMMessage(role="assistant", content="hi"))
        assert calls() == 2 and heard == [2]  # rode with the append
        await meter.arecord(scope, "gpt-x", 1, 1)  # no append follows this one
        assert calls() == 2
    assert calls() == 3 and heard == [2, 1]
    assert texts(manager, "api:ride") == ["hello", "hi"]


async def test_usage_rows_a_failed_append_did_not_carry_are_written_once_at_the_end(
    pg_pools: Callable[[], Any], journal: PostgresDedupeStore
) -> None:
    """Rows taken by an append whose statement failed go back to the turn's pending rows
    (merged with what was counted meanwhile) and are written once when the turn ends."""
    ledger = PostgresUsageLedger(pg_pools())
    ledger.aconnect = journal.connection
    meter = UsageMeter(ledger, PriceTable({}))
    scope = UsageScope("api:fail", "api", "turn")
    async with meter.riding():
        await meter.arecord(scope, "gpt-x", 10, 1)
        rider = riding_rows()  # what an append's statement takes
        assert rider is not None and riding_rows() is None  # taken: nothing rides twice
        await meter.arecord(scope, "gpt-x", 5, 1)  # counted while that statement ran
        rider[2](False)  # ... which failed
    (row,) = ledger.rows(session_key="api:fail")
    assert (row.calls, row.prompt_tokens, row.completion_tokens) == (2, 15, 2)


async def test_the_store_is_not_changed_under_an_append_of_the_loop(
    replica: Callable[[], SessionManager],
) -> None:
    """While a loop append awaits its round trip it holds the store; a blocking call
    from the loop's own thread (which the RLock would let in) is refused, not allowed to
    read the entry in twice."""
    from gateway.sessions.errors import SessionError

    manager = replica()
    session = await manager.aget_or_create("cli:busy")
    await session.aadd_message(user("first"))
    store = session._store
    refused: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(session.aadd_message, user("second"))
        with anyio.fail_after(5):
            while not store._loop_busy:  # type: ignore[attr-defined]
                await anyio.lowlevel.checkpoint()
        for call in (store.load, lambda: store.append(session_factory("x"))):
            try:
                call()
            except SessionError as exc:
                refused.append(str(exc))
    assert len(refused) == 2 and all("in use by a call of the event loop" in r for r in refused)
    assert texts(manager, "cli:busy") == ["first", "second"]
    assert [str(e.message.content) for e in session.get_branch()] == ["first", "second"]  # type: ignore[attr-defined]


def session_factory(text: str) -> Any:
    from gateway.sessions.manager import _message_factory

    return _message_factory(user(text), None)
