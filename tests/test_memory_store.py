"""Memory scopes and MemoryStore: whose memory lives where, and one manager per scope."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from gateway.memory import WORKSPACE_SCOPE, KnowledgeBase, MemoryManager, MemoryStore
from gateway.memory.scopes import scope_dir, scope_dirname


def test_scope_names_are_percent_encoded_and_collision_free() -> None:
    assert scope_dirname("telegram:1") == "telegram%3A1"
    assert scope_dirname("telegram_1") == "telegram_1"
    assert scope_dirname("slack:C1:thread:17.5") == "slack%3AC1%3Athread%3A17.5"
    assert scope_dirname("cli:Ünï") == "cli%3A%C3%9Cn%C3%AF"
    assert scope_dirname(WORKSPACE_SCOPE) == "_workspace"
    assert len({scope_dirname(k) for k in ["a:b", "a_b", "a%3Ab", "a/b", "a.b"]}) == 5


@pytest.mark.parametrize("scope", ["..", ".", "../../etc", "/abs", "a/../../b", "\x00"])
def test_scope_folders_never_leave_the_memory_folder(tmp_path: Path, scope: str) -> None:
    path = scope_dir(tmp_path, scope)
    assert path.parent == tmp_path / "memory"
    assert path.name not in (".", "..")
    assert len(path.name) <= 200
    MemoryManager(tmp_path, scope).append_history("inside")
    assert (path / "HISTORY.md").exists()


@pytest.mark.parametrize("scope", ["", "x" * 300])
def test_unusable_scope_names_are_rejected(tmp_path: Path, scope: str) -> None:
    with pytest.raises(ValueError):
        MemoryManager(tmp_path, scope)


def test_per_session_scopes_keep_users_apart(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path)
    alice = store.for_session("telegram:1")
    bob = store.for_session("telegram_1")
    assert alice is not bob
    alice.append_facts([("user_preference", "Alice likes jazz")])
    assert bob.search_memory("jazz") == []
    assert alice.search_memory("jazz") == ["- [user_preference] Alice likes jazz"]
    assert store.for_session("telegram:1") is alice


def test_workspace_mode_shares_one_scope(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, mode="workspace")
    a = store.for_session("telegram:1")
    assert a is store.for_session("slack:C9")
    assert a.dir == tmp_path / "memory" / "_workspace"


def test_reserved_key_and_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        MemoryStore(tmp_path).for_session(WORKSPACE_SCOPE)
    with pytest.raises(ValueError, match="per_session"):
        MemoryStore(tmp_path, mode="shared")  # type: ignore[arg-type]


def test_eviction_flushes_and_never_doubles_a_live_manager(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, max_open=2, knowledge_flush_every=1000)
    first = store.for_session("cli:a")
    first.knowledge.add("learned_fact", "unsaved until flushed")
    store.for_session("cli:b")
    store.for_session("cli:c")  # evicts cli:a from the LRU: flushed
    on_disk = KnowledgeBase(first.dir / "knowledge.json")  # reads the files afresh
    assert [e.content for e in on_disk] == ["unsaved until flushed"]
    assert store.for_session("cli:a") is first  # still alive: the same object
    del first
    store.for_session("cli:d")
    store.for_session("cli:e")
    gc.collect()
    assert "cli:a" not in store.open_scopes()  # evicted and unused: freed
    assert len(store.for_session("cli:a").knowledge) == 1  # reopened from its files


def test_close_flushes_every_manager(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path, knowledge_flush_every=1000)
    for key in ("cli:a", "cli:b"):
        store.for_session(key).knowledge.add("learned_fact", f"fact of {key}")
    store.close()
    for key in ("cli:a", "cli:b"):
        path = tmp_path / "memory" / key.replace(":", "%3A") / "knowledge.json"
        assert [e.content for e in KnowledgeBase(path)] == [f"fact of {key}"]
