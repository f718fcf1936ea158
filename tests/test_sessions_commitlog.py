"""The commit log of ``fsync="batch"``: a round is durable in one fsync of the log; after
a power cut the lines the session files lost come back from it, and nothing else is
ever written to a session file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from loguru import logger

from gateway.sessions import SessionError, SessionManager, commitlog
from gateway.sessions.commitlog import LOG_DIR, recover_commit_logs
from gateway.sessions.store import FileSessionStore
from tests.llm_messages import assistant, user


@pytest.fixture
def logs() -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handler)


def the_log(folder: Path) -> Path:
    (path,) = (folder / LOG_DIR).iterdir()
    return path


def died_with_log(folder: Path, key: str, texts: list[str]) -> tuple[Path, bytes]:
    """A process appended ``texts`` under "batch" and died (its log left behind, unlocked);
    the session file's path and its bytes as written."""
    manager = SessionManager(folder, fsync="batch")
    session = manager.get_or_create(key)
    for text in texts:
        session.add_message(user(text))
    assert session.path is not None
    kept = the_log(folder).read_bytes()
    data = session.path.read_bytes()
    manager.close()  # removes its own log ...
    (folder / LOG_DIR / "4242-dead.jsonl").write_bytes(kept)  # ... a dead one's stays
    return session.path, data


def contents(folder: Path, key: str) -> list[str]:
    session = SessionManager(folder, fsync="never").get(key)
    assert session is not None and session.load_report.clean
    return [m.content for m in session.messages]  # type: ignore[misc]


def test_an_acknowledged_append_is_in_the_fsynced_log_not_yet_in_an_fsynced_file(
    tmp_path: Path,
) -> None:
    """Promise: under "batch" an acknowledged append is durable through the log; the
    session file itself is fsynced only at a checkpoint."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("one"))  # creates the file
    session.add_message(assistant("two"))
    store = session._store
    assert isinstance(store, FileSessionStore) and store._handle is not None
    handle = store._handle
    assert not handle.dirty  # acknowledged, so durable ...
    assert handle._synced < handle.written  # ... by the log, not by the file's fsync
    rows = [json.loads(line) for line in the_log(tmp_path).read_text().splitlines()]
    assert [r["file"] for r in rows] == ["k.jsonl"] * 3  # header, one, two
    assert rows[-1]["line"]["message"]["content"] == "two"  # readable JSONL
    assert session.path is not None
    assert rows[-1]["at"] + len(json.dumps(rows[-1]["line"], separators=(",", ":"))) + 1 == (
        session.path.stat().st_size
    )
    manager.close()
    assert not handle.dirty and handle._synced == handle.written
    assert list((tmp_path / LOG_DIR).iterdir()) == []  # a clean close leaves no log


@pytest.mark.anyio
async def test_loop_appends_share_one_log_fsync_per_round(tmp_path: Path) -> None:
    manager = SessionManager(tmp_path, fsync="batch")
    sessions = [manager.get_or_create(f"t:{n}") for n in range(40)]
    for session in sessions:
        session.add_message(user("first"))
    fsyncs: list[int] = []
    real = commitlog._datasync
    commitlog._datasync = lambda fd: (fsyncs.append(fd), real(fd))[1]  # type: ignore[assignment]
    try:
        before = manager._async_committer.rounds

        async def turn(n: int) -> None:
            await sessions[n].aadd_message(assistant(f"reply {n}"))

        async with anyio.create_task_group() as tg:
            for n in range(40):
                tg.start_soon(turn, n)
    finally:
        commitlog._datasync = real  # type: ignore[assignment]
    rounds = manager._async_committer.rounds - before
    assert 1 <= rounds < 40 and len(fsyncs) == rounds  # one log fsync per round
    for n in range(40):
        assert contents(tmp_path, f"t:{n}") == ["first", f"reply {n}"]
    manager.close()


def test_lines_a_power_cut_took_come_back_from_a_dead_log(tmp_path: Path) -> None:
    path, data = died_with_log(tmp_path, "k", ["one", "two", "three"])
    lines = data.splitlines(keepends=True)
    # The power cut kept the header and "one" and half of "two" (page cache lost).
    path.write_bytes(b"".join(lines[:2]) + lines[2][:25])
    assert recover_commit_logs(tmp_path) == 2
    assert path.read_bytes() == data  # byte for byte
    assert list((tmp_path / LOG_DIR).iterdir()) == []
    assert contents(tmp_path, "k") == ["one", "two", "three"]


def test_a_new_file_lost_whole_comes_back(tmp_path: Path) -> None:
    path, data = died_with_log(tmp_path, "k", ["only"])
    path.write_bytes(b"")  # the name survived, the bytes did not
    SessionManager(tmp_path, fsync="batch").close()  # opening the folder recovers
    assert path.read_bytes() == data


def test_a_replay_never_overwrites_other_bytes(tmp_path: Path, logs: list[str]) -> None:
    """Promise: recovery only appends a logged line's missing end; bytes that differ
    are reported and kept."""
    path, data = died_with_log(tmp_path, "k", ["one", "two"])
    lines = data.splitlines(keepends=True)
    other = lines[2].replace(b'"two"', b'"TWO"')
    path.write_bytes(lines[0] + lines[1] + other)
    assert recover_commit_logs(tmp_path) == 0
    assert path.read_bytes() == lines[0] + lines[1] + other
    assert any("differ from the commit log" in m for m in logs)


def test_a_replay_leaves_a_replaced_file_alone(tmp_path: Path) -> None:
    path, data = died_with_log(tmp_path, "k", ["one", "two"])
    log = the_log(tmp_path).read_bytes()
    SessionManager(tmp_path, fsync="never").reset("k")  # /new: the old file archived
    (tmp_path / LOG_DIR / "4242-dead.jsonl").write_bytes(log)
    fresh = SessionManager(tmp_path, fsync="batch")
    session = fresh.get_or_create("k")
    session.add_message(user("new"))
    before = path.read_bytes()
    fresh.close()
    (tmp_path / LOG_DIR / "4242-dead.jsonl").write_bytes(log)
    assert recover_commit_logs(tmp_path) == 0  # another inode under the name
    assert path.read_bytes() == before
    archived = SessionManager(tmp_path).list_archived("k")
    assert len(archived) == 1 and archived[0].path.read_bytes() == data


def test_a_live_process_log_is_not_replayed(tmp_path: Path) -> None:
    alive = SessionManager(tmp_path, fsync="batch")
    alive.get_or_create("k").add_message(user("one"))
    log = the_log(tmp_path)
    SessionManager(tmp_path, fsync="batch").close()  # another owner opens the folder
    assert log.exists()  # flocked by its owner: not replayed, not removed
    alive.close()
    assert not log.exists()


def test_a_torn_log_line_is_ignored(tmp_path: Path) -> None:
    path, data = died_with_log(tmp_path, "k", ["one", "two"])
    dead = tmp_path / LOG_DIR / "4242-dead.jsonl"
    dead.write_bytes(dead.read_bytes() + b'{"file":"k.jsonl","ino":1,"at":')
    lines = data.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]))
    assert recover_commit_logs(tmp_path) == 1
    assert path.read_bytes() == data


def test_a_checkpoint_bounds_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound the log is emptied, after every file it covers was fsynced."""
    monkeypatch.setattr(commitlog, "MAX_LOG_BYTES", 2_000)
    manager = SessionManager(tmp_path, fsync="batch")
    sessions = [manager.get_or_create(f"k:{n}") for n in range(3)]
    for i in range(20):
        for session in sessions:
            session.add_message(user(f"message {i} " + "x" * 50))
    log = manager._commit_log
    assert log is not None and log.checkpoints >= 3
    assert the_log(tmp_path).stat().st_size <= 2_000 + 3 * 300
    for session in sessions:
        store = session._store
        assert isinstance(store, FileSessionStore) and store._handle is not None
        assert not store._handle.dirty
    manager.close()
    for n in range(3):
        assert len(contents(tmp_path, f"k:{n}")) == 20


def test_a_log_outside_the_folder_is_never_followed(tmp_path: Path) -> None:
    (tmp_path / LOG_DIR).mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"")
    line = {"file": "../victim.txt", "ino": os.stat(victim).st_ino, "at": 0, "text": "x\n"}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / LOG_DIR).mkdir()
    (tmp_path / "s" / LOG_DIR / "1-x.jsonl").write_text(json.dumps(line) + "\n")
    assert recover_commit_logs(tmp_path / "s") == 0
    assert victim.read_bytes() == b""


def test_an_append_whose_log_fsync_failed_is_not_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promise: no acknowledgement before the log is on disk. A failed log fsync raises
    for every append of its round and takes their lines back out of the log."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("one"))
    session.add_message(user("two"))
    size = the_log(tmp_path).stat().st_size

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(commitlog, "_datasync", fail)
    with pytest.raises(SessionError, match="could not be fsynced"):
        session.add_message(user("three"))
    assert the_log(tmp_path).stat().st_size == size  # no half round for the next to extend
    monkeypatch.undo()
    session.add_message(user("four"))
    rows = [json.loads(line) for line in the_log(tmp_path).read_text().splitlines()]
    assert [r["line"]["message"]["content"] for r in rows[-2:]] == ["two", "four"]
    manager.close()


@pytest.mark.anyio
async def test_a_checkpoint_bounds_the_files_held_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files a log covers stay open until its checkpoint: past `MAX_LOG_FILES` of
    them the checkpoint comes, whatever the log's size."""
    monkeypatch.setattr(commitlog, "MAX_LOG_FILES", 4)
    manager = SessionManager(tmp_path, fsync="batch")
    sessions = [manager.get_or_create(f"k:{n}") for n in range(10)]
    for session in sessions:
        session.add_message(user("first"))
    async with anyio.create_task_group() as tg:
        for session in sessions:
            tg.start_soon(session.aadd_message, assistant("reply"))
    log = manager._commit_log
    assert log is not None and log.checkpoints >= 1 and len(log._covered) <= 4
    manager.close()


# -- deferred appends: a turn's question and reply in one round ----------------------


def log_texts(folder: Path) -> list[str]:
    rows = [json.loads(line) for line in the_log(folder).read_text().splitlines()]
    return [r["line"]["message"]["content"] for r in rows if r["line"].get("type") == "message"]


def file_handle(session: object) -> Any:
    store = session._store  # type: ignore[attr-defined]
    assert isinstance(store, FileSessionStore) and store._handle is not None
    return store._handle


@pytest.mark.anyio
async def test_a_deferred_append_is_in_the_file_and_durable_with_the_next_round(
    tmp_path: Path,
) -> None:
    """Promise: a deferred append is written at once (a killed process keeps it) and
    made durable in the round of the session's next append: one round for both."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("earlier"))
    rounds = manager._async_committer.rounds
    await session.aadd_message(user("question"), defer=True)
    assert session.path is not None and b'"question"' in session.path.read_bytes()
    handle = file_handle(session)
    assert handle.dirty and manager._async_committer.rounds == rounds  # not yet durable
    assert "question" not in log_texts(tmp_path)
    await session.aadd_message(assistant("answer"))
    assert manager._async_committer.rounds == rounds + 1  # one round made both durable
    assert not handle.dirty
    assert log_texts(tmp_path)[-2:] == ["question", "answer"]
    await session.asettle()  # nothing left: no round
    assert manager._async_committer.rounds == rounds + 1
    manager.close()


@pytest.mark.anyio
async def test_settling_makes_a_deferred_append_durable_without_another(tmp_path: Path) -> None:
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("earlier"))
    await session.aadd_message(user("question"), defer=True)
    rounds = manager._async_committer.rounds
    await session.asettle()
    assert manager._async_committer.rounds == rounds + 1
    assert not file_handle(session).dirty and log_texts(tmp_path)[-1] == "question"
    manager.close()


@pytest.mark.anyio
async def test_a_blocking_append_takes_the_deferred_ones_into_its_round(tmp_path: Path) -> None:
    """The thread path (`append`: a model change, a compaction, a busy lock) commits
    what was deferred before its own line."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("earlier"))
    await session.aadd_message(user("question"), defer=True)
    session.append_model_change("other-model")
    assert not file_handle(session).dirty
    assert log_texts(tmp_path)[-1] == "question"
    manager.close()


@pytest.mark.anyio
async def test_a_deferred_turn_lost_to_a_power_cut_comes_back_whole(tmp_path: Path) -> None:
    """Promise: an acknowledged turn survives a power cut that took both its lines from
    the session file: the reply's round logged the deferred question too."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("earlier"))
    assert session.path is not None
    before = session.path.read_bytes()
    await session.aadd_message(user("question"), defer=True)
    await session.aadd_message(assistant("answer"))  # acknowledged here
    data = session.path.read_bytes()
    kept = the_log(tmp_path).read_bytes()
    manager.close()
    (tmp_path / LOG_DIR / "4242-dead.jsonl").write_bytes(kept)  # the process died ...
    session.path.write_bytes(before)  # ... and the page cache with both lines
    assert recover_commit_logs(tmp_path) == 2
    assert session.path.read_bytes() == data
    assert contents(tmp_path, "k") == ["earlier", "question", "answer"]


@pytest.mark.anyio
async def test_an_append_after_another_writers_lines_fsyncs_the_file(tmp_path: Path) -> None:
    """Two processes on one session (each its own log): B's line comes after A's
    deferred one, which no log holds yet, so logging B's line alone could not bring it
    back after a power cut that lost A's. B's round fsyncs the file instead (both lines
    durable); B's next append, with nothing new of A's, is logged again."""
    a = SessionManager(tmp_path, fsync="batch")
    b = SessionManager(tmp_path, fsync="batch")
    mine = a.get_or_create("k")
    mine.add_message(user("first"))
    theirs = b.get_or_create("k")
    await theirs.aadd_message(assistant("loaded, then appended"))  # B read A's lines
    await mine.aadd_message(user("question"), defer=True)  # A: in the file, no log
    await theirs.aadd_message(assistant("after the question"))
    handle = file_handle(theirs)
    assert handle._synced == handle.written  # the file itself fsynced, A's line with it
    await theirs.aadd_message(assistant("nothing new of A's"))
    assert handle._synced < handle.written and not handle.dirty  # the cheap path again
    logged = [
        json.loads(line)["line"]["message"]["content"]
        for log in (tmp_path / LOG_DIR).iterdir()
        for line in log.read_text().splitlines()
        if '"type":"message"' in line
    ]
    assert "after the question" not in logged and "nothing new of A's" in logged
    await mine.asettle()
    a.close()
    b.close()
    assert contents(tmp_path, "k") == [
        "first",
        "loaded, then appended",
        "question",
        "after the question",
        "nothing new of A's",
    ]


def test_recovery_fsyncs_the_files_a_dead_log_covers_even_when_they_lost_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed process's lines are in the page cache, not necessarily on disk: the
    log that could restore them is removed only after their files were fsynced."""
    path, data = died_with_log(tmp_path, "k", ["one", "two"])
    synced: list[int] = []
    real = commitlog._datasync

    def datasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(commitlog, "_datasync", datasync)
    assert recover_commit_logs(tmp_path) == 0  # nothing was missing ...
    assert synced == [path.stat().st_ino]  # ... and the file was fsynced all the same
    assert list((tmp_path / LOG_DIR).iterdir()) == []
    assert path.read_bytes() == data


@pytest.mark.anyio
async def test_closing_the_file_settles_what_was_deferred_to_it(tmp_path: Path) -> None:
    """Closing a session's file fsyncs it, the deferred lines with it: nothing is left
    unsettled, and no later round logs them again."""
    manager = SessionManager(tmp_path, fsync="batch")
    session = manager.get_or_create("k")
    session.add_message(user("earlier"))
    await session.aadd_message(user("question"), defer=True)
    store = session._store
    assert isinstance(store, FileSessionStore) and store.unsettled
    handle = file_handle(session)
    store.close()
    assert not store.unsettled and handle.closed and handle._synced == handle.written
    rounds = manager._async_committer.rounds
    await session.asettle()
    assert manager._async_committer.rounds == rounds
    manager.close()
    assert contents(tmp_path, "k") == ["earlier", "question"]
