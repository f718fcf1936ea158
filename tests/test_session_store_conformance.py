"""One contract, every session store: the JSONL files (the default) and PostgreSQL (the
shared mode). Each `open_manager()` call is a new process or replica over the same storage."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.sessions import MessageEntry, SessionExistsError, SessionManager
from gateway.sessions.entries import SessionHeader
from tests.llm_messages import assistant, user

OpenManager = Callable[[], SessionManager]


@pytest.fixture(params=["files", "postgres"])
def open_manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenManager]:
    managers: list[SessionManager] = []
    pools = []
    if request.param == "files":

        def make() -> SessionManager:
            manager = SessionManager(tmp_path / "sessions")
            managers.append(manager)
            return manager
    else:
        from gateway.plumbing.postgres import sync_pool
        from gateway.sessions.pg_store import PostgresSessions

        url = request.getfixturevalue("migrated_pg_url")

        def make() -> SessionManager:
            pool = sync_pool(url, max_size=4)
            pool.open(wait=True)
            pools.append(pool)
            manager = SessionManager.shared(PostgresSessions(pool))
            managers.append(manager)
            return manager

    yield make
    for manager in managers:
        manager.close()
    for pool in pools:
        pool.close()


def chain_ok(entries: list[MessageEntry]) -> bool:
    """Each entry's parent is the one before it: one linear branch, nothing lost."""
    return all(b.parent_id == a.id for a, b in itertools.pairwise(entries))


def test_appended_entries_come_back_in_a_new_process(open_manager: OpenManager) -> None:
    first = open_manager()
    session = first.get_or_create("telegram:42")
    ids = [session.add_message(user(f"q{i}")).id for i in range(3)]
    session.add_message(assistant("a"))
    header = session.header
    again = open_manager().get("telegram:42")
    assert again is not None
    assert [m.content for m in again.messages] == ["q0", "q1", "q2", "a"]
    assert [e.id for e in again.entries][:3] == ids
    assert again.header == header and again.leaf_id == session.leaf_id
    assert again.load_report.clean


def test_a_key_without_entries_is_not_stored(open_manager: OpenManager) -> None:
    manager = open_manager()
    manager.get_or_create("slack:C1")
    assert manager.get("slack:C1") is None
    assert open_manager().get("slack:C1") is None
    assert [i.key for i in manager.list_sessions()] == []


def test_listing_is_most_recently_active_first(open_manager: OpenManager) -> None:
    manager = open_manager()
    for key in ("cli:a", "cli:b", "cli:c"):
        manager.get_or_create(key).add_message(user(key))
        time.sleep(0.02)  # file listings order by mtime, whose clock ticks every few ms
    manager.get_or_create("cli:a").add_message(user("again"))
    listed = [info.key for info in open_manager().list_sessions()]
    assert listed == ["cli:a", "cli:c", "cli:b"]


def test_branches_labels_and_the_leaf_survive_a_reload(open_manager: OpenManager) -> None:
    manager = open_manager()
    session = manager.get_or_create("cli:tree")
    root = session.add_message(user("root"))
    session.add_message(assistant("first answer"))
    session.branch(root.id)
    other = session.add_message(assistant("second answer"))
    session.label(other.id, "keep")
    again = open_manager().get("cli:tree")
    assert again is not None
    assert again.leaf_id == session.leaf_id
    assert [m.content for m in again.messages] == ["root", "second answer"]
    assert again.labels == {other.id: "keep"}
    assert len(again.children(root.id)) == 2


def test_two_replicas_appending_in_turn_keep_one_branch(open_manager: OpenManager) -> None:
    one, two = open_manager(), open_manager()
    a = one.get_or_create("telegram:7")
    b = two.get_or_create("telegram:7")
    a.add_message(user("1"))
    b.add_message(assistant("2"))  # b has not looked since: the store must catch up first
    a.add_message(user("3"))
    final = open_manager().get("telegram:7")
    assert final is not None
    entries = [e for e in final.entries if isinstance(e, MessageEntry)]
    assert [e.message.content for e in entries] == ["1", "2", "3"]
    assert chain_ok(entries)


def test_concurrent_appends_from_two_replicas_lose_nothing(open_manager: OpenManager) -> None:
    managers = [open_manager(), open_manager()]
    managers[0].get_or_create("slack:C9").add_message(user("start"))

    def write(n: int) -> None:
        session = managers[n].get_or_create("slack:C9")
        for i in range(40):
            session.add_message(user(f"{n}-{i}"))

    threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = open_manager().get("slack:C9")
    assert final is not None
    entries = [e for e in final.entries if isinstance(e, MessageEntry)]
    assert len(entries) == 81 and chain_ok(entries)
    for n in range(2):  # each writer's own order is kept
        mine = [e.message.content for e in entries if str(e.message.content).startswith(f"{n}-")]
        assert mine == [f"{n}-{i}" for i in range(40)]


def test_a_replica_sees_another_replicas_appends_on_its_next_use(
    open_manager: OpenManager,
) -> None:
    one, two = open_manager(), open_manager()
    one.get_or_create("cli:x").add_message(user("from one"))
    seen = two.get_or_create("cli:x")
    one.get_or_create("cli:x").add_message(user("later from one"))
    assert [m.content for m in two.get_or_create("cli:x").messages] == [
        "from one",
        "later from one",
    ]
    assert seen is two.get_or_create("cli:x")


def test_reset_keeps_the_old_session_and_links_to_it(open_manager: OpenManager) -> None:
    manager = open_manager()
    session = manager.get_or_create("telegram:5")
    session.add_message(user("old"))
    old_id = session.session_id
    manager.reset("telegram:5")
    session.add_message(user("new"))
    again = open_manager().get("telegram:5")
    assert again is not None
    assert [m.content for m in again.messages] == ["new"]
    assert again.header.previous_session == old_id and again.session_id != old_id


def test_a_reset_by_another_replica_is_picked_up(open_manager: OpenManager) -> None:
    one, two = open_manager(), open_manager()
    one.get_or_create("telegram:8").add_message(user("before"))
    two.get_or_create("telegram:8")
    one.reset("telegram:8")
    one.get_or_create("telegram:8").add_message(user("after reset"))
    session = two.get_or_create("telegram:8")
    session.add_message(user("from two"))
    assert [m.content for m in open_manager().get_or_create("telegram:8").messages] == [
        "after reset",
        "from two",
    ]


def test_fork_copies_the_branch_and_links_back(open_manager: OpenManager) -> None:
    manager = open_manager()
    source = manager.get_or_create("cli:src")
    first = source.add_message(user("one"))
    source.add_message(assistant("two"))
    fork = manager.fork("cli:src", "cli:copy", first.id)
    assert fork is not None
    again = open_manager().get("cli:copy")
    assert again is not None
    assert [m.content for m in again.messages] == ["one"]
    ref = again.header.parent_session
    assert ref is not None and ref.key == "cli:src" and ref.entry_id == first.id
    with pytest.raises(SessionExistsError):
        open_manager().fork("cli:src", "cli:copy")


def test_delete_removes_the_current_session(open_manager: OpenManager) -> None:
    manager = open_manager()
    manager.get_or_create("slack:D1").add_message(user("bye"))
    assert manager.delete("slack:D1") is True
    assert open_manager().get("slack:D1") is None
    assert manager.delete("slack:D1") is False


def test_hostile_text_and_keys_round_trip(open_manager: OpenManager) -> None:
    text = "nul\x00 'quote\" \\ back; DROP TABLE gw_sessions; -- \u202e bidi \U0001f600" * 50
    key = "slack:C1:thread:1700000000.000100'; --"
    open_manager().get_or_create(key).add_message(user(text))
    again = open_manager().get(key)
    assert again is not None and [m.content for m in again.messages] == [text]
    assert isinstance(again.header, SessionHeader)
