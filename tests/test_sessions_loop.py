"""Sessions from the event loop: appends and loads that run on the loop when they cannot
block, a worker thread when they could, the same promises either way; and the pool of
spare files that lets a new session start without creating a file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from gateway.llm import LLMMessage
from gateway.sessions import MessageEntry, SessionManager
from gateway.sessions.spares import SPARES_DIR
from gateway.sessions.store import INLINE_READ_MAX, EntryFactory, FileSessionStore
from tests.llm_messages import assistant, user
from tests.loop_probe import hold_flock, loop_ticks

pytestmark = pytest.mark.anyio


def message_lines(path: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if row["type"] == "message"]


def factory_of(message: LLMMessage) -> EntryFactory[MessageEntry]:
    return lambda tree, eid, ts: MessageEntry(
        id=eid, parent_id=tree.leaf_id, timestamp=ts, message=message
    )


async def test_batch_appends_on_the_loop_are_group_committed(tmp_path: Path) -> None:
    """Promise: under fsync="batch" an append made on the loop returns only after a
    group commit covered it; concurrent turns share commit rounds."""
    manager = SessionManager(tmp_path, fsync="batch")
    sessions = [manager.get_or_create(f"t:{n}") for n in range(40)]
    for session in sessions:
        session.add_message(user("first"))  # the files exist: later appends are fast-path
    committer = manager._async_committer
    before = committer.rounds

    async def turn(n: int) -> None:
        await sessions[n].aadd_message(assistant(f"reply {n}"))

    async with anyio.create_task_group() as tg:
        for n in range(40):
            tg.start_soon(turn, n)
    rounds = committer.rounds - before
    assert 1 <= rounds < 40  # every append went through the loop's committer, grouped
    for n, session in enumerate(sessions):
        assert session.path is not None
        assert [r["message"]["content"] for r in message_lines(session.path)] == [
            "first",
            f"reply {n}",
        ]
    manager.close()


async def test_a_lock_held_elsewhere_sends_the_append_to_a_thread(tmp_path: Path) -> None:
    """The loop never waits for another process's lock: the append goes to a worker
    thread, which waits, and the loop keeps running meanwhile."""
    manager = SessionManager(tmp_path, fsync="never")
    session = manager.get_or_create("t:1")
    session.add_message(user("one"))
    assert session.path is not None
    store = session._store
    holder = hold_flock(session.path, 0.3)
    try:
        assert store.try_append_nowait(factory_of(user("not now"))) is None
        async with loop_ticks() as ticks:
            entry = await session.aadd_message(assistant("two"))
    finally:
        holder.join()
    assert isinstance(entry, MessageEntry)
    assert ticks.count >= 10  # the loop ran while the append waited for the lock
    assert [r["message"]["content"] for r in message_lines(session.path)] == ["one", "two"]


async def test_the_fast_path_reads_what_another_writer_appended(tmp_path: Path) -> None:
    """Promise kept on the loop too: entries another process appended are read first,
    and the new entry's parent is the true leaf."""
    ours = SessionManager(tmp_path, fsync="never").get_or_create("t:1")
    await ours.aadd_message(user("ours 1"))
    theirs = SessionManager(tmp_path, fsync="never").get_or_create("t:1")
    other = theirs.add_message(assistant("theirs"))
    entry = await ours.aadd_message(user("ours 2"))
    assert entry.parent_id == other.id
    assert [m.content for m in ours.messages] == ["ours 1", "theirs", "ours 2"]


async def test_a_large_session_loads_in_a_thread_and_whole(tmp_path: Path) -> None:
    seed = SessionManager(tmp_path, fsync="never")
    big = seed.get_or_create("t:big")
    text = "x" * 1000
    count = INLINE_READ_MAX // 1000 + 20
    for n in range(count):
        big.add_message(user(f"{n} {text}"))
    small = seed.get_or_create("t:small")
    small.add_message(user("hello"))
    seed.close()

    manager = SessionManager(tmp_path, fsync="never")
    assert manager.open_nowait("t:big") is None  # too much to read on the loop
    loaded = await manager.aget_or_create("t:big")
    assert len(loaded.messages) == count
    opened = manager.open_nowait("t:small")  # small: loaded on the loop
    assert opened is not None and [m.content for m in opened.messages] == ["hello"]
    assert manager.open_nowait("t:small") is opened  # one live object per key


@pytest.mark.parametrize("fsync", ["never", "batch"])
async def test_new_sessions_start_from_spare_files(tmp_path: Path, fsync: str) -> None:
    """On the loop: under "batch" too, whose group commit fsyncs the folder and logs the
    new file's bytes."""
    manager = SessionManager(tmp_path, fsync=fsync, spare_files=4)  # type: ignore[arg-type]
    pool = manager._spares
    assert pool is not None
    first = await manager.aget_or_create("t:0")
    await first.aadd_message(user("hi"))  # no spare yet: a plain create, pool starts
    for _ in range(200):
        if len(pool._spares) == 4:
            break
        await anyio.sleep(0.01)
    assert len(pool._spares) == 4
    rounds = manager._async_committer.rounds
    for n in range(1, 4):
        session = await manager.aget_or_create(f"t:{n}")
        await session.aadd_message(user(f"hi {n}"))
        assert session.path is not None
        assert stat.S_IMODE(session.path.stat().st_mode) == 0o600
        assert [r["message"]["content"] for r in message_lines(session.path)] == [f"hi {n}"]
    assert pool.taken >= 3
    if fsync == "batch":  # each appended on the loop, made durable by its group commit
        assert manager._async_committer.rounds == rounds + 3
    spares_dir = tmp_path / SPARES_DIR
    assert stat.S_IMODE(spares_dir.stat().st_mode) == 0o700
    paths = [manager.get_or_create(f"t:{n}").path for n in range(4)]
    manager.close()
    assert list(spares_dir.iterdir()) == []  # used spares lost their names, unused went
    assert all(p is not None and p.stat().st_nlink == 1 for p in paths)
    again = SessionManager(tmp_path, fsync="never")
    assert [m.content for m in again.get_or_create("t:2").messages] == ["hi 2"]


async def test_a_spare_never_replaces_an_existing_session(tmp_path: Path) -> None:
    """The file appeared between "no file yet" and the create (another process won the
    race): the link fails, the spare goes back to the pool, and the file is untouched."""
    manager = SessionManager(tmp_path, fsync="never", spare_files=2)
    pool = manager._spares
    assert pool is not None
    pool.take()  # starts the top-up
    for _ in range(200):
        if len(pool._spares) == 2:
            break
        await anyio.sleep(0.01)
    ours = await manager.aget_or_create("t:race")  # no file yet
    other = SessionManager(tmp_path, fsync="never").get_or_create("t:race")
    other.add_message(user("first, elsewhere"))
    assert other.path is not None
    before = other.path.read_bytes()
    store = ours._store
    assert isinstance(store, FileSessionStore)
    held = {spare.path for spare in pool._spares}
    assert store._create_file(b"{}\n", wait=False) is False
    assert other.path.read_bytes() == before
    # The spare it took came back (the pool may have topped up meanwhile, too).
    assert held <= {spare.path for spare in pool._spares}
    await ours.aadd_message(user("second, here"))  # adopts the other's file
    contents = [r["message"]["content"] for r in message_lines(other.path)]
    assert contents == ["first, elsewhere", "second, here"]
    manager.close()


def test_spares_of_a_finished_process_are_removed(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    gone = int(child.stdout)
    spares_dir = tmp_path / SPARES_DIR
    spares_dir.mkdir()
    stale = spares_dir / f"spare-{gone}-abc"
    stale.write_bytes(b"")
    mine = spares_dir / f"spare-{os.getpid()}-def"
    mine.write_bytes(b"")
    manager = SessionManager(tmp_path, fsync="never", spare_files=1)
    assert not stale.exists()
    assert mine.exists()  # a live process's spare is left alone
    manager.close()


async def test_threads_mode_never_touches_files_on_the_loop(tmp_path: Path) -> None:
    """workspace_io = "threads" (network file systems): the loop's methods hand every
    file operation to a worker thread, with the same results."""
    manager = SessionManager(tmp_path, fsync="batch", io_on_loop=False)
    seed = manager.get_or_create("t:1")
    seed.add_message(user("one"))
    assert manager.open_nowait("t:1") is None  # even cached: not on the loop
    session = await manager.aget_or_create("t:1")
    assert session is seed
    assert session._store.try_append_nowait(factory_of(user("x"))) is None
    await session.aadd_message(assistant("two"))
    assert manager._async_committer.rounds == 0  # fsynced by the thread committer
    assert session.path is not None
    assert [r["message"]["content"] for r in message_lines(session.path)] == ["one", "two"]


async def test_a_vanished_spare_falls_back_to_a_plain_create(tmp_path: Path) -> None:
    manager = SessionManager(tmp_path, fsync="never", spare_files=2)
    pool = manager._spares
    assert pool is not None
    pool.take()  # starts the top-up
    for _ in range(200):
        if len(pool._spares) == 2:
            break
        await anyio.sleep(0.01)
    for spare in list(pool._spares):
        spare.path.unlink()  # e.g. removed by another process's clean-up
    session = await manager.aget_or_create("t:new")
    await session.aadd_message(user("still saved"))
    assert session.path is not None
    assert [r["message"]["content"] for r in message_lines(session.path)] == ["still saved"]
    manager.close()
