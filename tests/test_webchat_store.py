"""The web chat's store keeps its promises in both modes (a SQLite file in the workspace,
and PostgreSQL shared by replicas): events numbered in commit order per visitor, so a
reader resuming after N misses nothing; a message logged once per id, a reply once per
(message, text); replies in their message's conversation; files only for their owner."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from channels.webchat.store import (
    STORE_FILE,
    FileWebChatStore,
    NewFile,
    PostgresWebChatStore,
    WebChatStore,
)

pytestmark = pytest.mark.anyio

ANN, BOB = "ann-visitor-0001", "bob-visitor-0002"


@pytest.fixture(params=["file", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], WebChatStore]]:
    """Opens stores on one place, as several processes (or replicas) would."""
    if request.param == "file":
        yield lambda: FileWebChatStore(tmp_path / STORE_FILE)
        return
    pools = request.getfixturevalue("pg_pools")
    yield lambda: PostgresWebChatStore(pools())


async def test_the_signing_key_is_made_once_for_everyone(
    stores: Callable[[], WebChatStore],
) -> None:
    one, other = stores(), stores()
    assert await one.signing_key("first") == "first"
    assert await other.signing_key("second") == "first"
    await one.aclose()
    await other.aclose()


async def test_a_message_is_logged_once_and_its_reply_once(
    stores: Callable[[], WebChatStore],
) -> None:
    store = stores()
    event, created = await store.add_message(
        ANN, "msg-00000001", "hello", (), new_conversation=False, title="hello"
    )
    assert created and event.seq == 1 and event.conversation == 1
    again, created = await store.add_message(
        ANN, "msg-00000001", "hello", (), new_conversation=False, title="hello"
    )
    assert not created and again.seq == 1
    reply = await store.add_reply(ANN, "msg-00000001", "echo: hello", ())
    assert reply is not None and reply.seq == 2 and reply.kind == "reply"
    assert await store.add_reply(ANN, "msg-00000001", "echo: hello", ()) is None  # sent again
    # A notice that answers nothing is logged each time (an approval, a reminder).
    assert await store.add_reply(ANN, "", "you may write now", ()) is not None
    assert await store.add_reply(ANN, "", "you may write now", ()) is not None
    events = await store.events_after(ANN, 0, 100)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [e.seq for e in await store.events_after(ANN, 2, 100)] == [3, 4]
    assert await store.events_after(BOB, 0, 100) == []
    state = await store.state(ANN)
    assert (state.last_seq, state.conversation, state.known) == (4, 1, True)
    assert not (await store.state(BOB)).known
    await store.aclose()


async def test_new_starts_a_conversation_and_late_replies_stay_in_theirs(
    stores: Callable[[], WebChatStore],
) -> None:
    store = stores()
    await store.add_message(
        ANN, "first-0001", "plan a trip", (), new_conversation=False, title="plan a trip"
    )
    new, _ = await store.add_message(ANN, "new-000001", "/new", (), new_conversation=True, title="")
    assert new.conversation == 2
    late = await store.add_reply(ANN, "first-0001", "Porto, then Lisbon", ())
    assert late is not None and late.conversation == 1  # the answer to a message of the first
    assert (await store.state(ANN)).conversation == 2  # and the visitor stays in the second
    done = await store.add_reply(ANN, "new-000001", "Started a new conversation.", ())
    assert done is not None and done.conversation == 2
    await store.add_message(
        ANN, "second-001", "what is 2+2", (), new_conversation=False, title="what is 2+2"
    )
    listed = await store.conversations(ANN, 10)
    assert [(c.number, c.title) for c in listed] == [(2, "what is 2+2"), (1, "plan a trip")]
    first = await store.conversation_events(ANN, 1, 10)
    assert [e.text for e in first] == ["plan a trip", "Porto, then Lisbon"]
    assert [e.text for e in await store.conversation_events(ANN, 2, 2)] == [
        "Started a new conversation.",
        "what is 2+2",
    ]
    await store.aclose()


async def test_files_are_read_back_with_their_owner(stores: Callable[[], WebChatStore]) -> None:
    store = stores()
    ref = await store.save_file(ANN, NewFile("cat.png", "image/png", b"\x89PNG data"))
    stored = await store.file(ref.id)
    assert stored is not None and stored.visitor == ANN and stored.data == b"\x89PNG data"
    assert (stored.ref.name, stored.ref.mime, stored.ref.size) == ("cat.png", "image/png", 9)
    assert await store.file("no-such-file") is None
    info = await store.file_info(ref.id)
    assert info is not None and info.visitor == ANN and info.ref == ref and info.data == b""
    reply = await store.add_reply(
        BOB, "m-00000001", "here", (NewFile("a.txt", "text/plain", b"x"),)
    )
    assert reply is not None and reply.files[0].name == "a.txt"
    kept = await store.file(reply.files[0].id)
    assert kept is not None and kept.visitor == BOB
    await store.aclose()


async def test_purge_forgets_what_is_older_than_the_log_keeps(
    stores: Callable[[], WebChatStore],
) -> None:
    store = stores()
    await store.add_message(ANN, "old-000001", "old", (), new_conversation=False, title="old")
    ref = await store.save_file(ANN, NewFile("a.txt", "text/plain", b"x"))
    assert await store.purge(0.0, visitors_before=0.0) == 0
    # The event, the file, the conversation; the visitor stays (a page may hold position 1).
    assert await store.purge(9e12, visitors_before=0.0) >= 3
    assert await store.events_after(ANN, 0, 10) == []
    assert await store.file(ref.id) is None
    assert (await store.state(ANN)).last_seq == 1
    await store.purge(9e12, visitors_before=9e12)
    assert not (await store.state(ANN)).known
    await store.aclose()


async def test_readers_resuming_after_a_position_miss_nothing_while_writers_race(
    stores: Callable[[], WebChatStore],
) -> None:
    """Four writers (replicas, or one process's tasks) log replies for one visitor while a
    reader resumes from its last position over and over: it sees every event once, in
    order, with no gap (a number taken by a transaction committed later would be skipped
    by a reader that had moved past it)."""
    writers = [stores() for _ in range(4)]
    reader = stores()
    per_writer = 25
    seen: list[int] = []
    done = anyio.Event()

    async def write(store: WebChatStore, n: int) -> None:
        for i in range(per_writer):
            await store.add_reply(ANN, f"m{n:02d}x{i:04d}", f"reply {n} {i}", ())

    async def read() -> None:
        after = 0
        while True:
            finished = done.is_set()
            events = await reader.events_after(ANN, after, 7)
            for event in events:
                seen.append(event.seq)
                after = event.seq
            if finished and not events:
                return
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        async with anyio.create_task_group() as writing:
            for n, store in enumerate(writers):
                writing.start_soon(write, store, n)
        done.set()
    assert seen == list(range(1, 4 * per_writer + 1))
    for store in [*writers, reader]:
        await store.aclose()


def test_replicas_numbering_one_visitor_from_threads_never_collide(
    request: pytest.FixtureRequest,
) -> None:
    """Shared mode: writers on separate connections at once (threads, as replicas)."""
    pools = request.getfixturevalue("pg_pools")
    errors: list[BaseException] = []

    def replica(n: int) -> None:
        store = PostgresWebChatStore(pools())
        try:
            for i in range(20):
                anyio.run(store.add_reply, ANN, f"r{n}x{i:04d}", f"reply {n} {i}", ())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    store = PostgresWebChatStore(pools())
    events = anyio.run(store.events_after, ANN, 0, 1000)
    assert [e.seq for e in events] == list(range(1, 61))
