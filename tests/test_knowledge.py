"""KnowledgeBase: dedup, search, export, batched atomic writes, damaged files."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

import gateway.memory.knowledge as knowledge_module
from gateway.memory.index import SearchIndex
from gateway.memory.knowledge import KnowledgeBase, _flush_open_bases


class Ticker:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "knowledge.json"


@pytest.fixture
def kb(path: Path) -> KnowledgeBase:
    return KnowledgeBase(path, flush_every=1000, clock=Ticker())


@pytest.fixture
def logs() -> Iterator[list[str]]:
    messages: list[str] = []
    handler = logger.add(
        lambda m: messages.append(str(m)), level="WARNING", format="{level} {message}"
    )
    yield messages
    logger.remove(handler)


def stored(path: Path) -> list[dict[str, object]]:
    """What is on disk: the snapshot's entries, replaced by the log's, in order."""
    by_id: dict[object, dict[str, object]] = {}
    if path.exists():
        entries = json.loads(path.read_text())["entries"]
        assert isinstance(entries, list)
        by_id = {e["id"]: e for e in entries}
    log = path.with_name(path.name + ".log")
    if log.exists():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            by_id[record["id"]] = record
    return list(by_id.values())


# -- adding ----------------------------------------------------------------------


def test_add_dedupes_normalized_content_per_category(kb: KnowledgeBase) -> None:
    first = kb.add("user_preference", "Prefers dark mode", tags=["ui"])
    again = kb.add("user_preference", "  prefers DARK   mode. ", source="chat", tags=["theme"])
    assert again.id == first.id
    assert again.access_count == 1
    assert again.accessed_at > first.accessed_at
    assert again.tags == ("ui", "theme")
    assert again.source == "chat"
    assert again.content == "Prefers dark mode"
    other = kb.add("learned_fact", "Prefers dark mode")
    assert other.id != first.id
    assert len(kb) == 2


def test_unknown_category_falls_back_with_a_warning(kb: KnowledgeBase, logs: list[str]) -> None:
    entry = kb.add("pets", "Has a cat named Miso")
    assert entry.category == "learned_fact"
    assert any(m.startswith("WARNING") and "'pets'" in m for m in logs)


def test_empty_content_is_rejected(kb: KnowledgeBase) -> None:
    with pytest.raises(ValueError):
        kb.add("learned_fact", "   ")


# -- searching -------------------------------------------------------------------


def test_multi_word_queries_find_entries_with_any_of_the_words(kb: KnowledgeBase) -> None:
    kb.add("project_decision", "Using Postgres as the primary database")
    kb.add("system_behavior", "Nightly backups go to S3", tags=["backup"])
    kb.add("user_preference", "Prefers short answers")
    found = kb.search("which database holds primary data")
    assert [e.content for e in found] == ["Using Postgres as the primary database"]
    found = kb.search("postgres backups")
    assert {e.content for e in found} == {
        "Using Postgres as the primary database",
        "Nightly backups go to S3",
    }
    assert kb.search("backup", category="system_behavior")[0].tags == ("backup",)
    assert kb.search("backup", category="user_preference") == []


def test_entries_matching_more_words_rank_first(kb: KnowledgeBase) -> None:
    kb.add("system_behavior", "Deploys run on Fridays")
    kb.add("system_behavior", "Deploys to staging run on Fridays after the tests pass")
    kb.add("error_pattern", "Staging tests are flaky")
    found = kb.search("staging deploys tests")
    assert found[0].content == "Deploys to staging run on Fridays after the tests pass"


def test_search_counts_as_an_access(kb: KnowledgeBase) -> None:
    kb.add("learned_fact", "Runs Arch Linux")
    assert kb.search("arch linux")[0].access_count == 1
    assert kb.search("linux")[0].access_count == 2
    entry = kb.by_category("learned_fact")[0]
    assert entry.access_count == 2
    assert kb.dirty


def test_tag_change_is_searchable(kb: KnowledgeBase) -> None:
    kb.add("learned_fact", "Owns a bakery")
    assert kb.search("business") == []
    kb.add("learned_fact", "owns a bakery", tags=["business"])
    assert [e.content for e in kb.search("business")] == ["Owns a bakery"]
    assert len(kb.search("bakery")) == 1


def test_empty_query_lists_most_accessed(kb: KnowledgeBase) -> None:
    kb.add("learned_fact", "A fact")
    kb.add("learned_fact", "B fact")
    kb.add("learned_fact", "B fact")
    assert [e.content for e in kb.search("", category="learned_fact")] == ["B fact", "A fact"]
    assert kb.search("", category="error_pattern") == []


# -- export ----------------------------------------------------------------------


def test_export_follows_category_priority_and_budget(kb: KnowledgeBase) -> None:
    kb.add("learned_fact", "learned one")
    kb.add("system_behavior", "behaviour one")
    kb.add("error_pattern", "error one")
    kb.add("project_decision", "decision one")
    kb.add("user_preference", "pref one")
    kb.add("user_preference", "pref two")
    kb.add("user_preference", "pref two")  # more accessed: first within its category
    assert kb.export_for_context().splitlines() == [
        "[user_preference] pref two",
        "[user_preference] pref one",
        "[project_decision] decision one",
        "[error_pattern] error one",
        "[system_behavior] behaviour one",
        "[learned_fact] learned one",
    ]
    for budget in range(0, 200, 7):
        text = kb.export_for_context(max_chars=budget)
        assert len(text) <= budget
    kb.add("user_preference", "x" * 500)  # too long: skipped, the rest still fits
    assert kb.export_for_context(max_chars=60) == (
        "[user_preference] pref two\n[user_preference] pref one"
    )


# -- persistence -----------------------------------------------------------------


def test_writes_are_batched_until_flush(kb: KnowledgeBase, path: Path) -> None:
    kb.add("learned_fact", "Lives in Porto", source="chat", tags=["home"])
    assert not path.exists()
    assert kb.flush() is True
    assert kb.flush() is False
    assert os.stat(path.with_name("knowledge.json.log")).st_mode & 0o777 == 0o600
    (entry,) = stored(path)
    assert entry["content"] == "Lives in Porto"
    assert entry["tags"] == ["home"]
    reopened = KnowledgeBase(path)
    (loaded,) = list(reopened)
    assert loaded == kb.get(loaded.id)


def test_autoflush_after_flush_every_changes(path: Path) -> None:
    kb = KnowledgeBase(path, flush_every=3)
    kb.add("learned_fact", "one")
    kb.add("learned_fact", "two")
    assert not path.exists()
    kb.add("learned_fact", "three")  # the writer thread flushes now
    deadline = time.monotonic() + 10
    while kb.dirty and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stored(path)) == 3
    assert not kb.dirty


def test_close_and_garbage_collection_and_exit_flush(path: Path, tmp_path: Path) -> None:
    with KnowledgeBase(path, flush_every=1000) as kb:
        kb.add("learned_fact", "saved on close")
    assert [e["content"] for e in stored(path)] == ["saved on close"]

    other = tmp_path / "other.json"
    dropped = KnowledgeBase(other, flush_every=1000)
    dropped.add("learned_fact", "saved when collected")
    del dropped
    gc.collect()
    assert [e["content"] for e in stored(other)] == ["saved when collected"]

    third = tmp_path / "third.json"
    alive = KnowledgeBase(third, flush_every=1000)
    alive.add("learned_fact", "saved at exit")
    _flush_open_bases()  # what atexit runs
    assert [e["content"] for e in stored(third)] == ["saved at exit"]


def test_failed_flush_keeps_changes_pending_and_files_intact(
    kb: KnowledgeBase, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kb.add("learned_fact", "first")
    kb.flush()
    kb.add("learned_fact", "second")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        kb.flush()
    assert kb.dirty
    monkeypatch.undo()
    assert kb.flush()
    assert sorted(str(e["content"]) for e in stored(path)) == ["first", "second"]

    # A failed snapshot rewrite leaves the old snapshot and the log as they were.
    monkeypatch.setattr(knowledge_module, "_COMPACT_AT", 1)
    kb.add("learned_fact", "third")
    kb.flush()  # 3 records >= 3 entries: the snapshot is rewritten, the log emptied
    assert path.with_name("knowledge.json.log").read_bytes() == b""
    for content in ("first", "second"):
        kb.add("learned_fact", content)  # reinforced: one log record each
        kb.flush()
    before = path.read_bytes()
    log_before = path.with_name("knowledge.json.log").read_bytes()
    kb.add("learned_fact", "third")  # the third record: time for a snapshot again
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        kb.flush()
    assert path.read_bytes() == before
    assert path.with_name("knowledge.json.log").read_bytes() == log_before
    assert kb.dirty
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]  # no temp left


def test_log_replays_after_a_crash_and_ignores_a_torn_last_line(path: Path) -> None:
    kb = KnowledgeBase(path, flush_every=2)
    kb.add("learned_fact", "kept one")
    kb.add("learned_fact", "kept two")  # flushed: in the log
    kb.add("learned_fact", "kept one")  # reinforced, flushed below
    kb.flush()
    log = path.with_name("knowledge.json.log")
    with log.open("a") as handle:
        handle.write('{"id": "torn", "categ')  # a crash in the middle of a write
    reopened = KnowledgeBase(path)
    assert sorted((e.content, e.access_count) for e in reopened) == [
        ("kept one", 1),
        ("kept two", 0),
    ]
    assert reopened.load_error is None
    assert [e.content for e in reopened.search("two")] == ["kept two"]


def test_damaged_log_is_kept_and_the_readable_records_are_used(path: Path) -> None:
    kb = KnowledgeBase(path)
    kb.add("learned_fact", "before the damage")
    kb.flush()
    log = path.with_name("knowledge.json.log")
    damaged = log.read_bytes() + b"garbage line\n"
    log.write_bytes(damaged)
    reopened = KnowledgeBase(path)
    assert [e.content for e in reopened] == ["before the damage"]
    assert reopened.load_error is not None and "malformed log" in reopened.load_error
    assert reopened.corrupt_path is not None and reopened.corrupt_path.read_bytes() == damaged
    assert [e.content for e in KnowledgeBase(path)] == ["before the damage"]


def test_a_json_workspace_of_an_earlier_version_loads_and_keeps_working(path: Path) -> None:
    """Migration: knowledge.json as earlier versions wrote it (indented, no log)."""
    old = {
        "version": 1,
        "entries": [
            {
                "id": "whatever",
                "category": "user_preference",
                "content": "Prefers tea",
                "source": None,
                "tags": ["drinks"],
                "created_at": 5.0,
                "last_accessed": 6.0,
                "access_count": 2,
            }
        ],
    }
    path.write_text(json.dumps(old, indent=1))
    kb = KnowledgeBase(path)
    (loaded,) = list(kb)
    assert (loaded.created_at, loaded.accessed_at) == (5.0, 6.0)  # accessed_at was last_accessed
    (entry,) = kb.search("tea")
    assert (entry.content, entry.tags, entry.access_count) == ("Prefers tea", ("drinks",), 3)
    assert kb.add("user_preference", "prefers TEA").id == entry.id  # ids recomputed
    kb.close()
    again = KnowledgeBase(path)
    assert [(e.content, e.access_count) for e in again] == [("Prefers tea", 4)]


def test_reload_uses_the_saved_index_and_indexes_only_later_entries(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kb = KnowledgeBase(path, flush_every=1000)
    for i in range(300):
        kb.add("learned_fact", f"fact number {i} about topic{i}")
    kb.close()
    kb.add("learned_fact", "added after the index was saved: walrus")
    kb.flush()
    indexed: list[int] = []
    original = SearchIndex.add_many

    def counting(self: SearchIndex, docs: Any) -> list[int]:
        docs = list(docs)
        indexed.append(len(docs))
        return original(self, docs)

    monkeypatch.setattr(SearchIndex, "add_many", counting)
    again = KnowledgeBase(path)
    assert [e.content for e in again.search("walrus")] == [
        "added after the index was saved: walrus"
    ]
    assert again.search("topic7 number")[0].content == "fact number 7 about topic7"
    assert indexed == [1]  # only the entry logged after the save
    # A stale index (the files changed by hand) is not used: everything is reindexed.
    again.close()
    log = path.with_name("knowledge.json.log")
    log.write_text(log.read_text().replace("topic7", "topic7 zebra"))
    indexed.clear()
    third = KnowledgeBase(path)
    assert [e.content for e in third.search("zebra")] == ["fact number 7 about topic7 zebra"]
    assert indexed == [301]


@pytest.mark.parametrize(
    "damage",
    [b"{not json", b'{"version": 1, "entries": "oops"}', b"42", b"\xff\xfe"],
    ids=["bad-json", "entries-not-a-list", "a-number", "not-utf8"],
)
def test_damaged_file_is_moved_aside_and_reported(
    path: Path, logs: list[str], damage: bytes
) -> None:
    path.write_bytes(damage)
    kb = KnowledgeBase(path)
    assert len(kb) == 0
    assert kb.load_error is not None
    assert kb.corrupt_path is not None
    assert kb.corrupt_path.name.startswith("knowledge.json.corrupt-")
    assert kb.corrupt_path.read_bytes() == damage
    assert not path.exists()
    assert any(m.startswith("ERROR") for m in logs)
    kb.add("learned_fact", "fresh start")
    kb.flush()
    assert kb.corrupt_path.read_bytes() == damage  # never overwritten
    assert [e["content"] for e in stored(path)] == ["fresh start"]


def test_partly_damaged_file_keeps_the_readable_entries(path: Path) -> None:
    good = {"category": "user_preference", "content": "Likes tea", "access_count": 3}
    path.write_text(
        json.dumps({"version": 1, "entries": [good, {"content": 5}, "junk", {"category": "x"}]})
    )
    kb = KnowledgeBase(path)
    assert kb.load_error is not None and "3 malformed" in kb.load_error
    assert [(e.content, e.access_count) for e in kb] == [("Likes tea", 3)]
    assert kb.corrupt_path is not None and kb.corrupt_path.exists()
    kb.close()
    assert [e["content"] for e in stored(path)] == ["Likes tea"]


def test_two_damaged_loads_keep_both_copies(path: Path) -> None:
    path.write_text("{")
    first = KnowledgeBase(path).corrupt_path
    path.write_text("[")
    second = KnowledgeBase(path).corrupt_path
    assert first is not None and second is not None and first != second
    assert first.read_text() == "{" and second.read_text() == "["


def test_add_takes_the_seeds_parameters_in_the_seeds_order(tmp_path: Path) -> None:
    """Seed 001: `add(category, content, *, source="", tags=None)`. Called as the seed
    calls it, the category is the category and the content the content."""
    kb = KnowledgeBase(tmp_path / "knowledge.json")
    entry = kb.add("user_preference", "Prefers tea", source="chat", tags=["drinks"])
    assert (entry.category, entry.content) == ("user_preference", "Prefers tea")
    assert entry.source == "chat" and entry.tags == ("drinks",)
    plain = kb.add("learned_fact", "Lives by the sea")
    assert plain.source is None and plain.tags == ()
    with pytest.raises(TypeError):
        kb.add("learned_fact", "x", "positional source")  # type: ignore[misc]


def test_a_base_in_a_missing_folder_creates_it_and_saves(tmp_path: Path) -> None:
    """A base whose folder does not exist makes it (0700) at construction, so what it
    accepts is saved; a folder that cannot be made is refused before any entry."""
    path = tmp_path / "new" / "scope" / "knowledge.json"
    kb = KnowledgeBase(path)
    kb.add("learned_fact", "Saved for sure")
    assert kb.flush()
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert [e.content for e in KnowledgeBase(path)] == ["Saved for sure"]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="cannot create"):
        KnowledgeBase(blocker / "knowledge.json")


def test_the_surface_as_seed_001_calls_it(tmp_path: Path) -> None:
    """Written exactly as seed 001 calls the knowledge base; what it shows must hold."""
    kb = KnowledgeBase(tmp_path / "knowledge.json")

    entry = kb.add("user_preference", "Prefers TypeScript over JavaScript", source="chat")
    kb.add("project_decision", "Using PostgreSQL for primary database", tags=["db"])
    kb.add("system_behavior", "API rate limit is 1000 requests/hour")
    kb.add("error_pattern", "CORS errors fixed by adding origin header", source="", tags=None)
    existing = kb.add("user_preference", "Prefers TypeScript over JavaScript", source="chat")
    assert existing.id == entry.id
    assert existing.access_count == entry.access_count + 1
    assert existing.accessed_at >= entry.accessed_at
    assert (entry.category, entry.content, entry.source) == (
        "user_preference",
        "Prefers TypeScript over JavaScript",
        "chat",
    )
    unknown = kb.add("hobby", "Plays chess")
    assert unknown.category == "learned_fact"

    results = kb.search(query="PostgreSQL", category="", max_results=20)
    assert [e.content for e in results] == ["Using PostgreSQL for primary database"]
    assert [e.content for e in kb.search("typescript", category="user_preference")] == [
        "Prefers TypeScript over JavaScript"
    ]
    assert len(kb.search()) == 5  # no query: every entry, most accessed first
    assert kb.search()[0].content == "Prefers TypeScript over JavaScript"
    assert [e.content for e in kb.by_category("error_pattern")] == [
        "CORS errors fixed by adding origin header"
    ]
    context = kb.export_for_context(max_chars=2000)
    assert context.splitlines()[0] == "[user_preference] Prefers TypeScript over JavaScript"
    assert len(kb.export_for_context(max_chars=60)) <= 60


def test_the_log_writes_entries_as_to_dict_describes_them(tmp_path: Path) -> None:
    kb = KnowledgeBase(tmp_path / "knowledge.json")
    entry = kb.add("user_preference", "Prefers tea", source="chat", tags=["drinks"])
    kb.flush()
    (line,) = (tmp_path / "knowledge.json.log").read_text().splitlines()
    assert json.loads(line) == entry.to_dict()
