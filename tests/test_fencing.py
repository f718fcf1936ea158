"""Fencing tokens on real PostgreSQL (`gateway.plumbing.fence`, migration 0010): a session's
lease gets a new epoch whenever its owner changes, and every kind of write a turn makes
in the shared mode is refused, writing nothing, once the lease has moved on from the
epoch the turn started under; the same write under the current epoch goes through. A
write in progress and a change of owner never interleave (the lease row's share lock)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.to_thread
import pytest

from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.router import SessionRouter
from gateway.journal.pg_store import LEASE_TAKE, PostgresDedupeStore
from gateway.journal.protocol import dedupe_key
from gateway.llm.types import LLMMessage
from gateway.memory.pg_store import PostgresConsolidationGuard, PostgresMemoryStore
from gateway.messages import InboundMessage, OutboundMessage, reply_for
from gateway.plumbing.fence import Fence, FencedOut, fenced
from gateway.schedules.pg_store import PostgresJobStore
from gateway.schedules.protocol import ScheduledJob
from gateway.sessions import SessionManager
from gateway.sessions.pg_store import PostgresSessions

pytestmark = pytest.mark.anyio

KEY = "telegram:4242"

_TAKE = LEASE_TAKE.format(
    source="VALUES (%(key)s, %(me)s, extract(epoch FROM clock_timestamp()) + %(ttl)s)"
)


def take_lease(url: str, owner: str, key: str = KEY, ttl: float = 30.0) -> int | None:
    """The lease of `key` taken for `owner` as the router takes it: its epoch, or None."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(_TAKE, {"key": key, "me": owner, "ttl": ttl}).fetchone()
    return None if row is None else int(row[1])


def expire(url: str, key: str = KEY) -> None:
    """The lease of `key` runs out (its holder paused past it)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE gw_session_leases SET expires_at = 0 WHERE session_key = %s", (key,))


def count(url: str, sql: str, *params: Any) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def stolen(migrated_pg_url: str) -> tuple[Fence, Fence]:
    """Replica a's lease of `KEY` (its old fence), then b's after a's ran out (the
    current one)."""
    old = take_lease(migrated_pg_url, "a")
    expire(migrated_pg_url)
    new = take_lease(migrated_pg_url, "b")
    assert old is not None and new is not None and new > old
    return Fence(KEY, old), Fence(KEY, new)


def test_an_epoch_changes_with_the_owner_only(migrated_pg_url: str) -> None:
    first = take_lease(migrated_pg_url, "a")
    assert take_lease(migrated_pg_url, "b") is None  # held: not taken
    assert take_lease(migrated_pg_url, "a") == first  # its holder's renewal
    expire(migrated_pg_url)  # released (or run out) with nobody taking it
    assert take_lease(migrated_pg_url, "a") == first  # taken back unchallenged: same
    expire(migrated_pg_url)
    second = take_lease(migrated_pg_url, "b")
    assert second is not None and first is not None and second > first
    expire(migrated_pg_url)
    third = take_lease(migrated_pg_url, "a")  # back to a: a new epoch all the same
    assert third is not None and third > second


async def test_a_renewal_never_brings_back_a_lease_another_replica_took(
    migrated_pg_url: str,
) -> None:
    """a holds a lease; b takes it while a is paused and releases it again (the row says
    b, expired). a's renewal must not take it back: a's turn under the old epoch would
    then pass the fence after b ran the session."""

    async def handle(msg: InboundMessage) -> OutboundMessage:
        return reply_for(msg, "x")

    async def deliver(reply: OutboundMessage) -> None:
        return None

    store = PostgresDedupeStore(migrated_pg_url)
    router = SessionRouter(store, Dispatcher(handle, deliver, dedupe=store))
    try:
        lease = await router._acquire(KEY)
        assert lease is not None
        router._leases[KEY] = lease
        expire(migrated_pg_url)
        assert take_lease(migrated_pg_url, "b") is not None
        expire(migrated_pg_url)
        await router.renew()
        assert lease.lost
        import psycopg

        with psycopg.connect(migrated_pg_url) as conn:
            row = conn.execute(
                "SELECT owner, expires_at FROM gw_session_leases WHERE session_key = %s", (KEY,)
            ).fetchone()
        assert row is not None and row[0] == "b" and row[1] == 0
        assert not await router.confirm(lease)
    finally:
        await store.aclose()


# -- every kind of write a turn makes ---------------------------------------------------


@pytest.fixture
async def journal(migrated_pg_url: str) -> AsyncIterator[PostgresDedupeStore]:
    store = PostgresDedupeStore(migrated_pg_url)
    yield store
    await store._pool.close()


def _message(n: int) -> InboundMessage:
    return InboundMessage(
        channel="telegram", chat_id="4242", sender_id="4242", text=f"m{n}", message_id=f"4242:{n}"
    )


Write = Callable[[], Awaitable[None]]
Written = Callable[[], int]


@pytest.fixture
def writes(
    migrated_pg_url: str, pg_pools: Callable[[], Any], journal: PostgresDedupeStore
) -> Callable[[str], tuple[Write, Written]]:
    """For a kind of write: (the write, as a turn makes it; how many rows it left)."""
    url = migrated_pg_url

    def make(kind: str) -> tuple[Write, Written]:
        pool = pg_pools()
        manager = SessionManager.shared(PostgresSessions(pool))
        manager.use_loop_connections(journal.connection)
        memory = PostgresMemoryStore(pool).for_session(KEY)
        entries = "SELECT count(*) FROM gw_session_entries"
        if kind in ("append", "thread append", "archive"):
            # The session exists already (a turn before the pause stored it).
            manager.get_or_create(KEY).add_message(LLMMessage(role="user", content="before"))
        if kind in ("reply", "mark", "publish"):
            msg = _message(1)
            anyio.from_thread.run(journal.take_in, dedupe_key(msg) or "", msg)
        if kind == "cancel job":
            PostgresJobStore(pool).add(_job("j1"), limit=5)

        async def write() -> None:
            if kind == "new session":
                session = await manager.aget_or_create(KEY)
                await session.aadd_message(LLMMessage(role="user", content="hi"))
            elif kind == "append":
                session = await manager.aget_or_create(KEY)
                await session.aadd_message(LLMMessage(role="assistant", content="hello"))
            elif kind == "thread append":
                session = await manager.aget_or_create(KEY)
                message = LLMMessage(role="assistant", content="hello")
                await anyio.to_thread.run_sync(session.add_message, message)
            elif kind == "archive":
                await anyio.to_thread.run_sync(manager.reset, KEY)
            elif kind == "reply":
                await journal.record_reply([dedupe_key(_message(1)) or ""], _reply())
            elif kind == "mark":
                await journal.mark_done(dedupe_key(_message(1)) or "")
            elif kind == "publish":
                store = journal
                router = SessionRouter(store, Dispatcher(_echo, _drop, dedupe=store))
                await router.publish(dedupe_key(_message(1)) or "", _reply())
            elif kind == "facts":
                await anyio.to_thread.run_sync(memory.append_facts, [("preference", "tea")])
            elif kind == "history":
                await anyio.to_thread.run_sync(memory.append_history, "talked about tea")
            elif kind == "knowledge":
                await anyio.to_thread.run_sync(memory.knowledge.add, "learned_fact", "tea")
            elif kind == "consolidation":
                await anyio.to_thread.run_sync(
                    lambda: memory.record_consolidation([("preference", "tea")], "a summary")
                )
            elif kind == "consolidated span":
                guard = PostgresConsolidationGuard(pool, "a")
                lease = await anyio.to_thread.run_sync(guard.acquire, KEY)
                assert lease is not None
                try:
                    await anyio.to_thread.run_sync(
                        lambda: lease.record("s1", "e1", summarized=3, facts=1)
                    )
                finally:
                    await anyio.to_thread.run_sync(lease.release)
            elif kind == "add job":
                await anyio.to_thread.run_sync(
                    lambda: PostgresJobStore(pool).add(_job("j2"), limit=5)
                )
            elif kind == "cancel job":
                await anyio.to_thread.run_sync(
                    lambda: PostgresJobStore(pool).remove("j1", owner=KEY)
                )
            else:  # pragma: no cover
                raise AssertionError(kind)

        def written() -> int:
            if kind in ("new session", "append", "thread append"):
                return count(url, entries)
            if kind == "archive":
                return count(url, "SELECT count(*) FROM gw_sessions WHERE archived_at IS NOT NULL")
            if kind == "reply":
                return count(url, "SELECT count(*) FROM gw_inbound WHERE reply IS NOT NULL")
            if kind in ("mark", "publish"):
                return count(url, "SELECT count(*) FROM gw_inbound WHERE state = 'done'")
            if kind in ("facts", "consolidation"):
                return count(url, "SELECT count(*) FROM gw_memory_facts")
            if kind == "history":
                return count(url, "SELECT count(*) FROM gw_memory_history")
            if kind == "knowledge":
                return count(url, "SELECT count(*) FROM gw_memory_knowledge")
            if kind == "consolidated span":
                return count(url, "SELECT count(*) FROM gw_consolidations")
            if kind == "add job":
                return count(url, "SELECT count(*) FROM gw_schedules")
            if kind == "cancel job":
                return -count(url, "SELECT count(*) FROM gw_schedules")
            raise AssertionError(kind)

        return write, written

    return make


def _job(ident: str) -> ScheduledJob:
    now = datetime.now(UTC)
    return ScheduledJob(
        id=ident,
        owner=KEY,
        text="remind me",
        timezone="UTC",
        next_run=now + timedelta(hours=1),
        created_at=now,
        address={"channel": "telegram", "chat_id": "4242"},
    )


def _reply() -> OutboundMessage:
    return reply_for(_message(1), "echo: m1")


async def _echo(msg: InboundMessage) -> OutboundMessage:
    return reply_for(msg, "echo")


async def _drop(reply: OutboundMessage) -> None:
    return None


KINDS = [
    "new session",
    "append",
    "thread append",
    "archive",
    "reply",
    "mark",
    "publish",
    "facts",
    "history",
    "knowledge",
    "consolidation",
    "consolidated span",
    "add job",
    "cancel job",
]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_write_under_a_lease_that_moved_on_is_refused_and_leaves_nothing(
    kind: str,
    stolen: tuple[Fence, Fence],
    writes: Callable[[str], tuple[Write, Written]],
) -> None:
    old, new = stolen
    write, written = await anyio.to_thread.run_sync(writes, kind)
    before = await anyio.to_thread.run_sync(written)
    with fenced(old), pytest.raises(FencedOut):
        await write()
    assert old.lost  # later writes of that turn fail without asking the database
    assert await anyio.to_thread.run_sync(written) == before
    with fenced(new):
        await write()
    assert await anyio.to_thread.run_sync(written) > before


async def test_a_lost_fence_refuses_without_a_round_trip(
    stolen: tuple[Fence, Fence], writes: Callable[[str], tuple[Write, Written]]
) -> None:
    """Once a write found the lease gone, the turn's next write is refused at once (the
    database is not asked), also where the next statement would not name the fence."""
    old, _ = stolen
    write, _ = await anyio.to_thread.run_sync(writes, "append")
    old.lost = True
    started = time.perf_counter()
    with fenced(old), pytest.raises(FencedOut):
        await write()
    assert time.perf_counter() - started < 1.0


def test_a_write_in_progress_holds_off_a_change_of_owner(migrated_pg_url: str) -> None:
    """The fence's share lock: b cannot take the lease while a write that passed a's
    fence is still open; once it commits, b takes it (a new epoch) and a's next write is
    refused. So b, reading the session after it took the lease, sees all of a's writes."""
    import psycopg

    from gateway.plumbing import fence

    epoch = take_lease(migrated_pg_url, "a")
    assert epoch is not None
    expire(migrated_pg_url)  # a paused: its lease ran out, b is about to take it
    took: list[int | None] = []
    with psycopg.connect(migrated_pg_url) as conn, fenced(Fence(KEY, epoch)):
        fence.check(conn)  # a's write passed the fence; its transaction is open
        taker = threading.Thread(target=lambda: took.append(take_lease(migrated_pg_url, "b")))
        taker.start()
        taker.join(1.0)
        assert taker.is_alive() and not took  # b waits for a's write to end
        conn.commit()
    taker.join(5.0)
    assert took and took[0] is not None and took[0] > epoch
    with (
        psycopg.connect(migrated_pg_url) as conn,
        fenced(Fence(KEY, epoch)),
        pytest.raises(FencedOut),
    ):
        fence.check(conn)


def test_the_lease_rows_a_replica_releases_keep_their_epoch(migrated_pg_url: str) -> None:
    """A released lease is expired, not deleted: its epoch still fences the writes of
    a turn that started under it, and comes back if the same replica takes it again."""
    epoch = take_lease(migrated_pg_url, "a")
    expire(migrated_pg_url)
    rows = count(migrated_pg_url, "SELECT count(*) FROM gw_session_leases WHERE epoch = %s", epoch)
    assert rows == 1


@pytest.fixture
def lease_rows(migrated_pg_url: str) -> Iterator[Callable[[], list[tuple[str, float]]]]:
    import psycopg

    def rows() -> list[tuple[str, float]]:
        with psycopg.connect(migrated_pg_url) as conn:
            return [
                (str(k), float(e))
                for k, e in conn.execute(
                    "SELECT session_key, expires_at FROM gw_session_leases ORDER BY 1"
                ).fetchall()
            ]

    yield rows


async def test_old_released_leases_are_cleared_by_the_beat(
    migrated_pg_url: str, lease_rows: Callable[[], list[tuple[str, float]]]
) -> None:
    take_lease(migrated_pg_url, "a", key="telegram:old")
    take_lease(migrated_pg_url, "a", key="telegram:recent")
    expire(migrated_pg_url, "telegram:old")
    store = PostgresDedupeStore(migrated_pg_url)
    try:
        await store.beat()
    finally:
        await store.aclose()
    assert [k for k, _ in lease_rows()] == ["telegram:recent"]


def test_a_refusal_names_the_session_and_the_epoch(migrated_pg_url: str) -> None:
    """`gw_fence` names the session and epoch in its refusal (what an operator reads)."""
    import psycopg

    with psycopg.connect(migrated_pg_url) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute("SELECT gw_fence(%s, %s)", (KEY, 999999))
    assert caught.value.sqlstate == "GWF01"
    assert f"the lease of {KEY} has moved on from epoch 999999" in str(caught.value)
