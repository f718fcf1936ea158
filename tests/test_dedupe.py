"""Inbound dedupe stores: check-and-claim, expiry, bounds, restarts, damaged files."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.journal.protocol import DedupeStore, dedupe_key
from gateway.journal.store import FileDedupeStore, MemoryDedupeStore
from gateway.messages import InboundMessage
from tests.loop_probe import hold_sqlite_write_lock, loop_ticks

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_key_is_none_without_an_id_and_keeps_parts_apart() -> None:
    assert dedupe_key(InboundMessage(channel="telegram", chat_id="1", text="x")) is None
    a = InboundMessage(channel="telegram", chat_id="1", text="x", message_id="5")
    b = InboundMessage(channel="telegram", chat_id="2", text="x", message_id="5")
    c = InboundMessage(channel="slack", chat_id="1", text="x", message_id="5")
    # Platform ids are unique per chat only, and a separator inside a part is harmless.
    d = InboundMessage(channel="t", chat_id='1","5', text="x", message_id="")
    e = InboundMessage(channel="t", chat_id="1", text="x", message_id='5","x')
    keys = {dedupe_key(m) for m in (a, b, c, e)}
    assert len(keys) == 4 and dedupe_key(d) is None


MakeStore = Callable[..., DedupeStore]


@pytest.fixture(params=["memory", "file", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStore:
    url = request.getfixturevalue("migrated_pg_url") if request.param == "postgres" else ""

    def make(clock: Clock, ttl: float = 3600) -> DedupeStore:
        if request.param == "memory":
            return MemoryDedupeStore(clock=clock, ttl=ttl)
        if request.param == "postgres":
            from gateway.journal.pg_store import PostgresDedupeStore

            return PostgresDedupeStore(url, clock=clock, ttl=ttl)
        return FileDedupeStore(tmp_path / "dedupe.sqlite3", clock=clock, ttl=ttl)

    return make


async def test_second_sight_is_a_duplicate_until_expiry(make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(clock, ttl=60)
    try:
        assert await store.seen_or_add("k") is False
        assert await store.seen_or_add("k") is True
        assert await store.seen_or_add("other") is False
        clock.now += 61
        assert await store.seen_or_add("k") is False
    finally:
        await store.aclose()


async def test_concurrent_claims_of_one_key_let_exactly_one_through(make_store: MakeStore) -> None:
    store = make_store(Clock())
    results: list[bool] = []

    async def claim() -> None:
        results.append(await store.seen_or_add("same"))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(claim)
    finally:
        await store.aclose()
    assert results.count(False) == 1 and len(results) == 20


async def test_file_store_remembers_answered_keys_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "ws" / "dedupe.sqlite3"
    first = FileDedupeStore(path)
    assert await first.seen_or_add("answered") is False
    await first.mark_done("answered")
    await first.aclose()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    second = FileDedupeStore(path)
    try:
        assert await second.seen_or_add("answered") is True
    finally:
        await second.aclose()


async def test_a_claim_never_answered_before_a_crash_is_answered_after_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "dedupe.sqlite3"
    crashed = FileDedupeStore(path)
    assert await crashed.seen_or_add("answered") is False
    await crashed.mark_done("answered")
    assert await crashed.seen_or_add("mid-turn") is False
    assert await crashed.seen_or_add("mid-turn") is True  # a duplicate while in flight
    # The process dies here, before the turn of "mid-turn" finished: no mark_done.
    await crashed.aclose()

    restarted = FileDedupeStore(path)
    try:
        assert await restarted.seen_or_add("mid-turn") is False  # answered after all
        assert await restarted.seen_or_add("mid-turn") is True  # but only once
    finally:
        await restarted.aclose()


async def test_file_store_is_bounded_by_count_and_age(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "d.sqlite3"
    store = FileDedupeStore(path, max_entries=50, purge_every=10, clock=clock)
    try:
        for n in range(200):
            clock.now += 1
            assert await store.seen_or_add(f"k{n}") is False
            await store.mark_done(f"k{n}")
        assert 50 <= await store.count() <= 60
    finally:
        await store.aclose()

    clock.now += 100
    restarted = FileDedupeStore(path, max_entries=50, ttl=3600, clock=clock)
    try:
        assert await restarted.seen_or_add("k199") is True  # the newest are kept
        assert await restarted.seen_or_add("k0") is False  # the oldest went
        clock.now += 3600
        assert await restarted.seen_or_add("k198") is False  # expired
        await restarted.purge()
        assert await restarted.count() == 0
    finally:
        await restarted.aclose()


async def test_answers_at_the_same_time_share_one_transaction(tmp_path: Path) -> None:
    store = FileDedupeStore(tmp_path / "d.sqlite3")
    try:
        await store.seen_or_add("warm-up")
        await store.mark_done("warm-up")
        before = store.batches_written

        async def answer(n: int) -> None:
            assert await store.seen_or_add(f"k{n}") is False
            await store.mark_done(f"k{n}")

        async with anyio.create_task_group() as tg:
            for n in range(100):
                tg.start_soon(answer, n)
        assert store.batches_written - before <= 3
        assert await store.count() == 101
    finally:
        await store.aclose()


async def test_answers_still_queued_are_saved_on_close(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite3"
    store = FileDedupeStore(path)
    await store.seen_or_add("k")
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.mark_done, "k")
        tg.start_soon(store.aclose)
    again = FileDedupeStore(path)
    try:
        assert await again.seen_or_add("k") is True
    finally:
        await again.aclose()


async def test_memory_store_is_bounded() -> None:
    store = MemoryDedupeStore(max_entries=10)
    for n in range(100):
        await store.seen_or_add(f"k{n}")
    assert len(store) <= 10 and await store.seen_or_add("k99") is True


async def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "dedupe.sqlite3"
    path.write_bytes(b"this is not sqlite, just some bytes" * 200)
    store = FileDedupeStore(path)
    try:
        assert await store.seen_or_add("k") is False
    finally:
        await store.aclose()
    assert any(name.startswith("dedupe.sqlite3.broken-") for name in os.listdir(tmp_path))


@given(st.tuples(st.text(min_size=1), st.text(min_size=1), st.text(min_size=1)), st.data())
def test_keys_of_different_messages_never_collide(
    parts: tuple[str, str, str], data: st.DataObject
) -> None:
    other = data.draw(st.tuples(st.text(min_size=1), st.text(min_size=1), st.text(min_size=1)))
    a = InboundMessage(channel=parts[0], chat_id=parts[1], text="", message_id=parts[2])
    b = InboundMessage(channel=other[0], chat_id=other[1], text="", message_id=other[2])
    assert (dedupe_key(a) == dedupe_key(b)) == (parts == other)


async def test_journaled_messages_survive_until_answered(tmp_path: Path) -> None:
    """Promise: a journaled message stays on file until `mark_done`, across restarts,
    so what a crash left unanswered can be replayed, oldest first."""
    path = tmp_path / "dedupe.sqlite3"
    store = FileDedupeStore(path)
    first = InboundMessage(
        channel="telegram",
        chat_id="1",
        sender_id="1",
        text="first",
        message_id="1:10",
        received_at=100.0,
        metadata={"is_group": False},
    )
    second = InboundMessage(
        channel="telegram",
        chat_id="1",
        sender_id="1",
        text="second",
        message_id="1:11",
        received_at=101.0,
    )
    answered = InboundMessage(
        channel="slack", chat_id="C1", text="done", message_id="E1", received_at=99.0
    )
    for msg in (second, first, answered):
        key = dedupe_key(msg)
        assert key is not None
        assert not await store.seen_or_add(key)
        await store.journal(key, msg)
    answered_key = dedupe_key(answered)
    assert answered_key is not None
    await store.mark_done(answered_key)
    await store.aclose()

    reopened = FileDedupeStore(path)
    assert [u.message for u in await reopened.unanswered()] == [first, second]
    assert await reopened.seen_or_add(answered_key)  # answered: a duplicate for good
    key = dedupe_key(first)
    assert key is not None
    await reopened.mark_done(key)
    assert [u.message for u in await reopened.unanswered()] == [second]
    await reopened.aclose()


async def test_memory_store_journals_nothing() -> None:
    store = MemoryDedupeStore()
    msg = InboundMessage(channel="telegram", chat_id="1", text="x", message_id="1:1")
    await store.journal("k", msg)
    assert await store.unanswered() == []


async def test_a_journal_write_never_waits_on_the_loop(tmp_path: Path) -> None:
    """The journal commit runs on the loop only when SQLite's lock is free; while
    another process holds it the write waits in a worker thread and the loop runs on.
    Either way the message is on file when `journal` returns."""
    path = tmp_path / "d.sqlite3"
    store = FileDedupeStore(path)
    msg = InboundMessage(channel="t", chat_id="1", text="first", message_id="1")
    await store.journal("k1", msg)  # the loop path (the file is open now)
    holder = hold_sqlite_write_lock(path, 0.3)  # another process's write transaction
    try:
        async with loop_ticks() as ticks:
            second = InboundMessage(channel="t", chat_id="1", text="second", message_id="2")
            await store.journal("k2", second)
    finally:
        holder.join()
    assert ticks.count >= 10  # the loop kept running while the write waited for the lock
    assert [u.message.text for u in await store.unanswered()] == ["first", "second"]
    await store.aclose()
