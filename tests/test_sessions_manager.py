"""SessionManager: one live object per key, listing, reset, fork, delete, hooks."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest

from gateway.llm import LLMMessage
from gateway.sessions import (
    BeforeCompactEvent,
    BeforeForkEvent,
    CancelOperation,
    CompactEvent,
    CompactionEntry,
    HookRegistry,
    MessageEntry,
    Session,
    SessionError,
    SessionExistsError,
    SessionKeyError,
    SessionManager,
    TreeEvent,
    encode_key,
)
from gateway.sessions.listing import FileSessionListing
from tests.llm_messages import user


def texts(session: Session) -> list[str | None]:
    return [m.content for m in session.messages]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


@pytest.fixture(params=["disk", "memory"])
def manager(request: pytest.FixtureRequest, folder: Path) -> SessionManager:
    if request.param == "memory":
        return SessionManager.in_memory()
    return SessionManager(folder, fsync="never")


# -- get / cache ----------------------------------------------------------------------


def test_get_and_get_or_create(manager: SessionManager) -> None:
    assert manager.get("k") is None
    s = manager.get_or_create("k")
    assert manager.get_or_create("k") is s
    assert manager.get("k") is None  # nothing saved yet
    s.add_message(user("a"))
    assert manager.get("k") is s
    with pytest.raises(SessionKeyError):
        manager.get_or_create("")


def test_lru_never_holds_two_live_objects_per_key(folder: Path) -> None:
    """Promise: at most one live Session per key, even after LRU eviction."""
    manager = SessionManager(folder, max_cache_size=2, fsync="never")
    held = manager.get_or_create("a")
    held.add_message(user("a1"))
    for key in ("b", "c", "d"):
        manager.get_or_create(key).add_message(user(key))
    gc.collect()
    assert manager.get_or_create("a") is held  # evicted but still referenced: same object
    assert texts(manager.get_or_create("b")) == ["b"]  # dropped entirely: reloaded from disk
    manager.clear_cache()
    assert manager.get("a") is held


def test_the_cache_is_bounded_by_bytes_too(folder: Path) -> None:
    """A few large sessions cannot hold the whole budget: least recent go first, and
    the cache always keeps the session in use."""
    manager = SessionManager(folder, max_cache_size=100, max_cache_bytes=30_000, fsync="never")
    for key in ("a", "b", "c"):
        manager.get_or_create(key).add_message(user(key * 12_000))  # ~12 KB each
    for key in ("a", "b", "c"):
        manager.get_or_create(key)  # touched: sizes are known now
    gc.collect()
    cached = [s.key for s in manager._lru.values()]
    assert cached == ["b", "c"]  # "a" (least recent) went to stay under 30,000 bytes
    assert manager._bytes == sum(s._store.size for s in manager._lru.values())
    manager.get_or_create("huge").add_message(user("x" * 50_000))
    manager.get_or_create("huge")  # touched with its new size: over the budget alone
    assert [s.key for s in manager._lru.values()] == ["huge"]  # the one in use stays
    assert texts(manager.get_or_create("a")) == ["a" * 12_000]  # reloaded from disk


def test_in_memory_never_evicts_and_touches_no_disk(tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        manager = SessionManager.in_memory()
        sessions = [manager.get_or_create(f"k{i}") for i in range(300)]
        for s in sessions:
            s.add_message(user(s.key))
        del sessions
        gc.collect()
        assert texts(manager.get_or_create("k0")) == ["k0"]
        assert manager.get_or_create("k0").path is None
        assert manager.sessions_dir is None
        assert list(tmp_path.iterdir()) == []
    finally:
        os.chdir(cwd)


def test_save_is_cheap_and_idempotent(folder: Path) -> None:
    manager = SessionManager(folder, fsync="never")
    s = manager.get_or_create("k")
    manager.save(s)  # nothing to do yet: no file
    assert s.path is not None and not s.path.exists()
    s.add_message(user("a"))
    size = s.path.stat().st_size
    manager.save(s)
    manager.save(s)
    assert s.path.stat().st_size == size  # save never rewrites


# -- listing ---------------------------------------------------------------------------


def test_list_sessions_newest_first_from_names_only(folder: Path) -> None:
    manager = SessionManager(folder, fsync="never")
    for i, key in enumerate(["telegram:1", "slack:T/C", "cli:default"]):
        s = manager.get_or_create(key)
        s.add_message(user(key))
        assert s.path is not None
        os.utime(s.path, (1000 + i, 1000 + i))
    (folder / "junk.txt").write_text("x")
    (folder / "telegram%3A1.jsonl.torn-1").write_text("x")
    (folder / "bad%zz.jsonl").write_text("x")
    manager.reset("cli:default")  # archived file must not be listed
    manager.get_or_create("cli:default").add_message(user("new"))
    infos = manager.list_sessions()
    assert [i.key for i in infos] == ["cli:default", "slack:T/C", "telegram:1"]
    assert infos[1].path == folder / "slack%3AT%2FC.jsonl"
    assert infos[1].updated_at == 1001 and infos[1].size_bytes == infos[1].path.stat().st_size
    assert manager.continue_recent() is manager.get("cli:default")


def test_list_sessions_in_memory() -> None:
    manager = SessionManager.in_memory()
    assert manager.list_sessions() == [] and manager.continue_recent() is None
    manager.get_or_create("a").add_message(user("a"))
    time.sleep(0.001)
    manager.get_or_create("b").add_message(user("b"))
    manager.get_or_create("empty")
    assert [i.key for i in manager.list_sessions()] == ["b", "a"]
    assert manager.continue_recent() is manager.get("b")


def test_list_sessions_does_not_parse_files(folder: Path) -> None:
    folder.mkdir()
    (folder / "x.jsonl").write_bytes(b"not even json")
    (infos,) = SessionManager(folder).list_sessions()
    assert infos.key == "x" and infos.size_bytes == 13


# -- delete / reset ----------------------------------------------------------------------


def test_delete(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    s.add_message(user("a"))
    path = s.path
    assert manager.delete("k") is True
    assert manager.delete("k") is False
    assert path is None or not path.exists()
    assert manager.get("k") is None
    assert manager.get_or_create("k") is s and s.messages == []  # same handle, now empty


def test_reset_keeps_the_old_file(manager: SessionManager, folder: Path) -> None:
    s = manager.get_or_create("telegram:1")
    s.add_message(user("old"))
    old_id = s.session_id
    new = manager.reset("telegram:1")
    assert new is s  # the key's handle, now pointing at the new session
    assert new.session_id != old_id and new.header.previous_session == old_id
    assert new.messages == []
    new.add_message(user("fresh"))
    assert texts(manager.get_or_create("telegram:1")) == ["fresh"]
    if manager.sessions_dir is not None:
        (archived,) = (folder / "archive" / "telegram%3A1").iterdir()
        assert archived.name.endswith(f"-{old_id}.jsonl")
        records = [json.loads(x) for x in archived.read_text().splitlines()]
        assert records[1]["message"]["content"] == "old"
        header = json.loads((folder / "telegram%3A1.jsonl").read_text().splitlines()[0])
        assert header["previous_session"] == old_id


def test_archived_sessions_are_listed_and_readable(folder: Path) -> None:
    manager = SessionManager(folder, fsync="never")
    assert manager.list_archived() == []
    s = manager.get_or_create("telegram:1")
    ids = []
    for text in ("first", "second", "third"):
        s.add_message(user(text))
        ids.append(s.session_id)
        manager.reset("telegram:1")
    manager.get_or_create("cli:work").add_message(user("w"))
    manager.reset("cli:work")
    (folder / "archive" / "not%ZZ a key").mkdir()  # someone else's folder: skipped

    mine = manager.list_archived("telegram:1")
    assert [(a.number, a.session_id) for a in mine] == [(1, ids[2]), (2, ids[1]), (3, ids[0])]
    assert mine[0].archived_at >= mine[1].archived_at > time.time() - 60
    assert {(a.key, a.number) for a in manager.list_archived()} == {
        ("telegram:1", 1),
        ("telegram:1", 2),
        ("telegram:1", 3),
        ("cli:work", 1),
    }
    assert texts(manager.open_archived("telegram:1", 3)) == ["first"]
    assert texts(manager.open_archived("telegram:1", 1)) == ["third"]
    assert texts(manager.get_or_create("telegram:1")) == []  # the current one is untouched
    with pytest.raises(SessionError, match="has no archived session 4; it has 3"):
        manager.open_archived("telegram:1", 4)
    with pytest.raises(SessionError, match="it has none"):
        manager.open_archived("slack:C1", 1)
    assert SessionManager.in_memory().list_archived() == []


def test_a_folder_listing_lists_what_the_manager_lists(folder: Path) -> None:
    """`gateway sessions list` reads a folder through FileSessionListing, without the
    manager: the same sessions, in the same order, current and archived."""
    manager = SessionManager(folder, fsync="never")
    for n, key in enumerate(("telegram:1", "cli:work", "slack:C1:thread:2.5", "x")):
        manager.get_or_create(key).add_message(user(f"m{n}"))
        os.utime(folder / f"{encode_key(key)}.jsonl", (1_700_000_000 - n, 1_700_000_000 - n))
    manager.reset("telegram:1")
    manager.reset("cli:work")
    manager.get_or_create("telegram:1").add_message(user("again"))
    manager.reset("telegram:1")
    (folder / "stray.txt").write_text("not a session\n")
    listing = FileSessionListing(folder)
    assert [i.key for i in listing.list_sessions()] == ["slack:C1:thread:2.5", "x"]
    assert listing.list_sessions() == manager.list_sessions()
    assert listing.list_archived() == manager.list_archived()
    assert [a.number for a in listing.list_archived("telegram:1")] == [1, 2]
    assert listing.list_archived("telegram:1") == manager.list_archived("telegram:1")


def test_reset_of_unsaved_session(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    first = s.session_id
    assert manager.reset("k") is s and s.session_id != first
    assert s.header.previous_session is None


# -- fork --------------------------------------------------------------------------------


def test_fork_copies_the_branch_with_a_back_link(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    s.add_message(user("abandoned"))
    s.branch(a.id)
    b = s.add_message(user("b"))
    fork = manager.fork("k", "k2")
    assert fork is not None and fork.key == "k2"
    ref = fork.header.parent_session
    assert ref is not None
    assert (ref.key, ref.session_id, ref.entry_id) == ("k", s.session_id, b.id)
    assert fork.entries == s.get_branch()  # the root-to-leaf path, ids kept
    assert texts(fork) == ["a", "b"]
    fork.add_message(user("only in fork"))
    assert texts(s) == ["a", "b"]
    assert manager.get("k2") is fork
    if manager.sessions_dir is not None:
        again = SessionManager(manager.sessions_dir).get("k2")
        assert again is not None and again.header == fork.header
        assert texts(again) == ["a", "b", "only in fork"]

    at_a = manager.fork("k", entry_id=a.id)
    assert at_a is not None and at_a.key.startswith("k:fork:") and texts(at_a) == ["a"]
    with pytest.raises(SessionExistsError):
        manager.fork("k", "k2")
    with pytest.raises(SessionError, match="no session"):
        manager.fork("missing")


# -- hooks -------------------------------------------------------------------------------


def test_hooks_can_cancel_fork_and_compact(folder: Path) -> None:
    hooks = HookRegistry()
    manager = SessionManager(folder, fsync="never", hooks=hooks)
    s = manager.get_or_create("k")
    for i in range(6):
        s.add_message(user(str(i)))
    seen: list[object] = []

    def veto_fork(event: BeforeForkEvent) -> bool:
        seen.append(event)
        return False

    def veto_compact(event: BeforeCompactEvent) -> None:
        seen.append(event)
        raise CancelOperation

    remove_fork = hooks.register("session_before_fork", veto_fork)
    remove_compact = hooks.register("session_before_compact", veto_compact)
    assert manager.fork("k", "k2") is None
    assert not (folder / "k2.jsonl").exists()
    assert s.compact("x", None) is None
    assert s.prune_to_window(2) == 0
    assert s.message_count == 6 and not any(isinstance(e, CompactionEntry) for e in s.entries)
    assert isinstance(seen[0], BeforeForkEvent) and seen[0].new_key == "k2"
    assert isinstance(seen[1], BeforeCompactEvent) and seen[1].summary == "x"

    remove_fork()
    remove_compact()
    done: list[CompactEvent] = []
    hooks.register("session_compact", done.append)
    assert s.prune_to_window(2) == 4
    assert [e.entry.first_kept_entry_id for e in done] == [s.build_context().entry_ids[0]]
    assert manager.fork("k", "k2") is not None


def test_tree_hook_and_failing_after_hooks(folder: Path) -> None:
    hooks = HookRegistry()
    s = SessionManager(folder, fsync="never", hooks=hooks).get_or_create("k")
    events: list[TreeEvent] = []
    hooks.register("session_tree", events.append)
    hooks.register("session_tree", lambda e: 1 / 0)  # logged, not raised
    a = s.add_message(user("a"))
    b = s.add_message(user("b"))
    leaf = s.branch(a.id)
    summary = s.branch_with_summary(a.id, "gone")
    assert [(e.old_leaf_id, e.new_leaf_id) for e in events] == [(b.id, a.id), (a.id, summary.id)]
    assert events[0].entry == leaf
    with pytest.raises(ValueError, match="unknown session hook event"):
        hooks.register("session_nope", print)  # type: ignore[arg-type]


# -- seed compatibility ----------------------------------------------------------------------


def test_seed_agent_lifecycle_runs_unchanged(manager: SessionManager) -> None:
    """The flow of the seed's agent loop: load, window, persist, consolidate."""
    window = 4
    session = manager.get_or_create("cli:default")
    for turn in range(5):
        history = session.get_recent(window)
        assert len(history) <= window + 1
        session.add_message(LLMMessage(role="user", content=f"q{turn}"))
        session.add_message(LLMMessage(role="assistant", content=f"a{turn}"))
        manager.save(session)
        if session.message_count > window:
            old = session.get_old_messages(window)
            assert old
            session.summary = f"[Previous conversation context]\nturn {turn}"
            pruned = session.prune_to_window(window)
            assert pruned == len(old)
            manager.save(session)
    assert session.message_count == window
    assert session.summary == "[Previous conversation context]\nturn 4"
    assert texts(session) == ["q3", "a3", "q4", "a4"]
    assert sum(isinstance(e, MessageEntry) for e in session.entries) == 10
    assert session.created_at <= session.updated_at
