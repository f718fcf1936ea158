"""MemoryManager: MEMORY.md, HISTORY.md (rotation, search), consolidation records."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

import gateway.memory.manager as manager_module
from gateway.memory import KnowledgeBase, MemoryManager


class Clock:
    """A settable UTC clock for deterministic timestamps."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2024, 2, 28, 14, 23, 45, tzinfo=UTC))


@pytest.fixture
def mm(tmp_path: Path, clock: Clock) -> MemoryManager:
    return MemoryManager(tmp_path, "telegram:42", clock=clock)


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(str(m)), level="WARNING", format="{message}")
    yield messages
    logger.remove(handler)


# -- MEMORY.md -------------------------------------------------------------------


def test_scope_folder_and_private_permissions(mm: MemoryManager, tmp_path: Path) -> None:
    assert mm.dir == tmp_path / "memory" / "telegram%3A42"
    mm.append_to_memory("- [learned_fact] a")
    mm.append_history("b")
    mm.record_consolidation([("learned_fact", "c")], "d")
    assert stat.S_IMODE(os.stat(mm.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(mm.dir.parent).st_mode) == 0o700
    mm.search_history("b")
    mm.search_memory("a")
    mm.close()  # the saved indexes too
    names = sorted(p.name for p in mm.dir.iterdir())
    assert names == [
        "HISTORY.md",
        "HISTORY.md.index",
        "MEMORY.md",
        "MEMORY.md.index",
        "MEMORY.md.lock",  # other processes' rewrites (gateway memory forget) wait on it
        "knowledge.json.index",
        "knowledge.json.lock",
        "knowledge.json.log",
    ]
    for name in names:
        assert stat.S_IMODE(os.stat(mm.dir / name).st_mode) == 0o600, name


def test_write_and_read_memory(mm: MemoryManager) -> None:
    assert mm.read_memory() == ""
    mm.write_memory("### Consolidated 2024-01-01\n- [user_preference] Likes tea\n")
    assert mm.read_memory() == "### Consolidated 2024-01-01\n- [user_preference] Likes tea\n"
    assert stat.S_IMODE(os.stat(mm.memory_path).st_mode) == 0o600
    assert not list(mm.dir.glob("*.tmp"))


def test_append_to_memory_starts_on_its_own_line(mm: MemoryManager) -> None:
    mm.memory_path.write_text("- [learned_fact] no trailing newline")
    mm.append_to_memory("- [learned_fact] second")
    mm.append_to_memory("- [learned_fact] third\n\n")
    assert mm.read_memory() == (
        "- [learned_fact] no trailing newline\n- [learned_fact] second\n- [learned_fact] third\n"
    )


def test_appends_never_read_the_whole_file(
    mm: MemoryManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm.write_memory("- [learned_fact] x\n" * 1000)
    reads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    def no_full_read(*args: object, **kwargs: object) -> str:
        raise AssertionError("an append read the whole file")

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(manager_module, "read_text", no_full_read)
    monkeypatch.setattr(Path, "read_bytes", no_full_read)
    monkeypatch.setattr(Path, "read_text", no_full_read)
    mm.append_to_memory("- [learned_fact] y")
    mm.append_history("an entry")
    assert all(n == 1 for n in reads)  # at most the last byte, for its newline


def test_an_append_after_a_rewrite_or_an_edit_without_final_newline_starts_a_line(
    mm: MemoryManager,
) -> None:
    """An append reads no byte back only where the file surely ends with a line of
    ours; after a rewrite or an edit whose last line has no newline it still starts a
    line of its own."""
    mm.write_memory("- [learned_fact] no newline")
    mm.append_to_memory("- [learned_fact] next")
    mm.append_to_memory("- [learned_fact] third")
    assert mm.read_memory() == (
        "- [learned_fact] no newline\n- [learned_fact] next\n- [learned_fact] third\n"
    )
    with mm.memory_path.open("a") as handle:
        handle.write("- [learned_fact] typed by hand")
    mm.append_to_memory("- [learned_fact] after the edit")
    assert mm.read_memory().endswith("typed by hand\n- [learned_fact] after the edit\n")
    assert mm.search_memory("edit") == ["- [learned_fact] after the edit"]


def test_search_memory_ranks_by_relevance_and_filters_category(mm: MemoryManager) -> None:
    mm.append_facts(
        [
            ("project_decision", "Decided to drop cron for systemd timers"),
            ("project_decision", "Decided to drop Terraform"),
            ("user_preference", "Prefers systemd over cron for scheduling"),
            ("learned_fact", "The staging database runs Postgres 16"),
        ]
    )
    hits = mm.search_memory("drop cron timers")
    assert hits[0] == "- [project_decision] Decided to drop cron for systemd timers"
    assert all(not h.startswith("###") for h in hits)
    assert mm.search_memory("cron", category="user_preference") == [
        "- [user_preference] Prefers systemd over cron for scheduling"
    ]
    assert mm.search_memory("decisions")[0].startswith("- [project_decision]")  # stemmed
    assert mm.search_memory("postgres") == [
        "- [learned_fact] The staging database runs Postgres 16"
    ]
    assert mm.search_memory("", category="project_decision") == [
        "- [project_decision] Decided to drop Terraform",
        "- [project_decision] Decided to drop cron for systemd timers",
    ]


def test_memory_index_follows_appends_and_rewrites(mm: MemoryManager) -> None:
    assert mm.search_memory("kubernetes") == []
    mm.append_to_memory("- [learned_fact] Cluster runs kubernetes 1.29")
    assert mm.search_memory("kubernetes") == ["- [learned_fact] Cluster runs kubernetes 1.29"]
    mm.write_memory("- [learned_fact] Cluster moved to nomad\n")
    assert mm.search_memory("kubernetes") == []
    assert mm.search_memory("nomad") == ["- [learned_fact] Cluster moved to nomad"]


def test_hand_edits_of_memory_are_picked_up(mm: MemoryManager) -> None:
    mm.append_to_memory("- [learned_fact] Office is in Berlin")
    assert mm.search_memory("berlin")
    mm.memory_path.write_text("- [learned_fact] Office moved to Hamburg for good\n")
    assert mm.search_memory("berlin") == []
    assert mm.search_memory("hamburg") == ["- [learned_fact] Office moved to Hamburg for good"]
    with mm.memory_path.open("a") as handle:  # edited again, then an append
        handle.write("- [learned_fact] Parking in the yard\n")
    mm.append_to_memory("- [learned_fact] Parking costs extra")
    assert len(mm.search_memory("parking")) == 2


def test_searches_never_reread_the_files(
    mm: MemoryManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm.append_facts([("learned_fact", "Backups run nightly at two")])
    mm.append_history("talked about nightly backups")
    mm.load_indexes()

    def no_read(*args: object, **kwargs: object) -> str:
        raise AssertionError("a search read a file")

    monkeypatch.setattr(manager_module, "read_text", no_read)
    monkeypatch.setattr(Path, "read_bytes", no_read)
    monkeypatch.setattr(Path, "read_text", no_read)
    for _ in range(3):
        mm.append_history("more about backups")
        assert mm.search_memory("nightly backups")
        assert mm.search_history("nightly backups")[0].endswith("talked about nightly backups")


def test_append_facts_writes_one_heading_per_day(mm: MemoryManager, clock: Clock) -> None:
    assert mm.append_facts([("user_preference", "Likes tea"), ("bogus", "Has a cat")]) == 2
    assert mm.append_facts([("project_decision", "Uses uv")]) == 1
    clock.now += timedelta(days=1)
    mm.append_facts([("learned_fact", "Moved to Lisbon")])
    assert mm.append_facts([("learned_fact", "   ")]) == 0
    assert mm.read_memory() == (
        "### Consolidated 2024-02-28\n"
        "- [user_preference] Likes tea\n"
        "- [learned_fact] Has a cat\n"
        "- [project_decision] Uses uv\n"
        "\n### Consolidated 2024-02-29\n"
        "- [learned_fact] Moved to Lisbon\n"
    )


def test_append_facts_sees_hand_edits_and_far_headings(mm: MemoryManager) -> None:
    # The last heading is 200 KB back: found by reading backwards across chunks.
    mm.write_memory("### Consolidated 2024-02-28\n" + "- [learned_fact] filler\n" * 9000)
    mm.append_facts([("learned_fact", "same day")])
    assert mm.read_memory().count("### Consolidated 2024-02-28") == 1
    # A person adds another section: new facts must not land under it.
    mm.memory_path.write_text(mm.read_memory() + "## My notes\nfree text\n")
    mm.append_facts([("learned_fact", "after notes")])
    assert mm.read_memory().endswith(
        "## My notes\nfree text\n\n### Consolidated 2024-02-28\n- [learned_fact] after notes\n"
    )
    assert mm.append_facts([("learned_fact", "x")], day=date(2024, 3, 1)) == 1
    assert "### Consolidated 2024-03-01\n- [learned_fact] x\n" in mm.read_memory()


# -- HISTORY.md ------------------------------------------------------------------


def test_append_history_writes_timestamped_single_lines(mm: MemoryManager) -> None:
    assert mm.append_history("User asked about\nthe database") == (
        "[2024-02-28 14:23:45] User asked about the database"
    )
    assert mm.append_history("  \n ") == ""
    assert mm.read_history() == "[2024-02-28 14:23:45] User asked about the database\n"


def test_rotation_never_loses_a_line_even_within_one_second(tmp_path: Path, clock: Clock) -> None:
    mm = MemoryManager(tmp_path, "cli:direct", history_max_bytes=300, clock=clock)
    entries = [f"entry number {i} about topic{i % 5}" for i in range(300)]
    for entry in entries:  # the clock never moves: every rotation within one second
        mm.append_history(entry)
    archives = mm.history_archives()
    assert len(archives) > 20
    assert len({a.name for a in archives}) == len(archives)
    assert all(os.stat(a).st_mode & 0o777 == 0o600 for a in archives)
    lines = [
        line for path in [*archives, mm.history_path] for line in path.read_text().splitlines()
    ]
    assert lines == [f"[2024-02-28 14:23:45] {e}" for e in entries]
    assert mm.history_path.stat().st_size <= 300

    reopened = MemoryManager(tmp_path, "cli:direct", history_max_bytes=300, clock=clock)
    assert reopened.search_history("entry number 3 topic3", max_results=1) == [
        "[2024-02-28 14:23:45] entry number 3 about topic3"
    ]
    assert mm.search_history("entry number 7", max_results=1)[0].endswith("number 7 about topic2")


def test_rotation_keeps_an_oversized_line_whole(tmp_path: Path, clock: Clock) -> None:
    mm = MemoryManager(tmp_path, "cli:direct", history_max_bytes=50, clock=clock)
    mm.append_history("x" * 200)
    mm.append_history("short")
    text = "".join(p.read_text() for p in [*mm.history_archives(), mm.history_path])
    assert text == f"[2024-02-28 14:23:45] {'x' * 200}\n[2024-02-28 14:23:45] short\n"


def test_crash_during_rotation_duplicates_rather_than_loses(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    mm = MemoryManager(tmp_path, "cli:direct", history_max_bytes=100, clock=clock)
    mm.append_history("first line of the log")
    mm.append_history("second line of the log")

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(manager_module, "atomic_write_bytes", crash)
    with pytest.raises(OSError):
        mm.append_history("third line of the log")
    everything = "".join(p.read_text() for p in [*mm.history_archives(), mm.history_path])
    for n in ("first", "second", "third"):
        assert f"{n} line of the log" in everything


def test_search_history_decays_by_age(tmp_path: Path, clock: Clock) -> None:
    mm = MemoryManager(tmp_path, "cli:direct", clock=clock)
    mm.append_history("deploy to staging failed because of the missing migration")
    clock.now += timedelta(days=300)
    mm.append_history("deploy failed")
    query = "deploy failed staging migration"
    assert mm.search_history(query, decay_rate=0.0)[0].endswith("missing migration")
    assert mm.search_history(query, decay_rate=0.01)[0].endswith("deploy failed")
    assert mm.search_history("")[0].endswith("deploy failed")  # no words: newest first


def test_history_lines_without_timestamp_are_indexed(mm: MemoryManager) -> None:
    mm.history_path.write_text(
        "[2024-02-27 10:00:00 UTC] seed style line about kafka\nhand written note on kafka\n"
    )
    assert set(mm.search_history("kafka")) == {
        "[2024-02-27 10:00:00 UTC] seed style line about kafka",
        "hand written note on kafka",
    }


# -- consolidation API -----------------------------------------------------------


def test_needs_consolidation_past_twice_the_window() -> None:
    assert not MemoryManager.needs_consolidation(20, 10)
    assert MemoryManager.needs_consolidation(21, 10)


def test_record_consolidation_writes_all_three_files(
    mm: MemoryManager, warnings: list[str]
) -> None:
    mm.record_consolidation(
        [("user_preference", "Prefers short answers"), ("mystery", "Has two cats"), ("x", " ")],
        "Talked about answer length and pets",
    )
    assert mm.read_memory() == (
        "### Consolidated 2024-02-28\n"
        "- [user_preference] Prefers short answers\n"
        "- [learned_fact] Has two cats\n"
    )
    assert mm.read_history() == "[2024-02-28 14:23:45] Talked about answer length and pets\n"
    stored = KnowledgeBase(mm.dir / "knowledge.json")  # what the files hold
    assert {(e.category, e.content, e.source) for e in stored} == {
        ("user_preference", "Prefers short answers", "consolidation"),
        ("learned_fact", "Has two cats", "consolidation"),
    }
    assert sum("Unknown memory category 'mystery'" in w for w in warnings) == 1
    assert [e.content for e in mm.knowledge.search("cats")] == ["Has two cats"]


def test_record_consolidation_without_facts_still_logs_summary(mm: MemoryManager) -> None:
    mm.record_consolidation([], "Small talk only")
    assert mm.read_memory() == ""
    assert mm.read_history().endswith("Small talk only\n")


# -- threads ---------------------------------------------------------------------


def test_concurrent_appends_from_worker_threads(mm: MemoryManager) -> None:
    mm.load_indexes()

    def work(worker: int) -> None:
        for i in range(40):
            mm.append_history(f"worker{worker} item{i}")
            mm.append_to_memory(f"- [learned_fact] worker{worker} fact{i}")
            mm.knowledge.add("learned_fact", f"worker{worker} knows {i}")
            mm.search_history(f"worker{worker}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(mm.read_history().splitlines()) == 320
    assert len(mm.read_memory().splitlines()) == 320
    assert len(mm.knowledge) == 320
    assert len(mm.search_history("worker3", max_results=100)) == 40
    mm.close()
    reopened = MemoryManager(mm.dir.parent.parent, mm.scope)
    assert len(reopened.search_memory("worker5", max_results=100)) == 40
    assert len(reopened.knowledge) == 320


# -- saved search indexes --------------------------------------------------------------


def _history(manager: MemoryManager, lines: int, clock: Clock) -> None:
    for i in range(lines):
        clock.now += timedelta(seconds=1)
        manager.append_history(f"entry {i} about topic{i} and some filler words here")


def _saved_scope(tmp_path: Path, clock: Clock) -> MemoryManager:
    """A closed scope of 50 history lines whose index is saved."""
    first = MemoryManager(tmp_path, "s", clock=clock)
    _history(first, 50, clock)
    first.load_indexes()
    first.close()
    return first


def test_a_reopened_scope_reads_the_saved_index_and_catches_up(
    tmp_path: Path, clock: Clock
) -> None:
    first = MemoryManager(tmp_path, "s", clock=clock, history_max_bytes=20_000)
    _history(first, 600, clock)  # rotates several times
    first.append_to_memory("- [learned_fact] the saved fact")
    first.load_indexes()
    first.close()
    index_file = first.dir / "HISTORY.md.index"
    saved = index_file.stat().st_mtime_ns
    assert len(first.history_archives()) > 2

    # Another writer appends a line while no manager is open.
    with (first.dir / "HISTORY.md").open("a") as handle:
        handle.write("[2024-02-28 15:00:00] written by hand: zebra\n")
    again = MemoryManager(tmp_path, "s", clock=clock)
    assert again.search_history("topic3 entry", 1) == [first.search_history("topic3 entry", 1)[0]]
    assert again.search_history("zebra", 1)[0].endswith("written by hand: zebra")
    assert again.search_memory("saved fact") == ["- [learned_fact] the saved fact"]
    assert index_file.stat().st_mtime_ns == saved  # loaded, not rebuilt
    again.close()
    assert index_file.stat().st_mtime_ns != saved  # the caught-up line is saved now


def test_a_rewritten_history_is_not_served_from_the_old_index(tmp_path: Path, clock: Clock) -> None:
    first = MemoryManager(tmp_path, "s", clock=clock)
    _history(first, 50, clock)
    first.load_indexes()
    first.close()
    (first.dir / "HISTORY.md").write_text("[2024-02-28 15:00:00] only this line: walrus\n")
    again = MemoryManager(tmp_path, "s", clock=clock)
    assert again.search_history("topic3") == []
    assert again.search_history("walrus", 5) == ["[2024-02-28 15:00:00] only this line: walrus"]


def test_a_damaged_index_is_kept_aside_and_rebuilt(
    tmp_path: Path, clock: Clock, warnings: list[str]
) -> None:
    first = _saved_scope(tmp_path, clock)
    index_file = first.dir / "HISTORY.md.index"
    damaged = index_file.read_bytes()[:-7]
    index_file.write_bytes(damaged)
    again = MemoryManager(tmp_path, "s", clock=clock)
    assert again.search_history("topic7 entry", 1)[0].endswith(
        "entry 7 about topic7 and some filler words here"
    )
    assert (first.dir / "HISTORY.md.index.damaged").read_bytes() == damaged
    assert any("damaged" in m for m in warnings)
    again.close()
    assert index_file.read_bytes() != damaged


def test_a_large_missing_index_builds_in_the_background_and_searches_wait_for_it(
    tmp_path: Path, clock: Clock
) -> None:
    first = MemoryManager(tmp_path, "s", clock=clock, history_max_bytes=10_000_000)
    lines = [f"[2024-02-28 14:00:00] old line {i} with filler text" for i in range(12_000)]
    oldest = "[2024-01-01 00:00:00] the oldest aardvark"
    first.history_path.write_text("\n".join([oldest, *lines]) + "\n")
    again = MemoryManager(tmp_path, "s", clock=clock, history_max_bytes=10_000_000)
    release = threading.Event()
    original = again._history_index._build

    def slow_build(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("report"):  # the background build, not its catch-up under the lock
            release.wait(10)
        return original(*args, **kwargs)

    again._history_index._build = slow_build  # type: ignore[method-assign]
    # A search that cannot wait answers from the newest lines, and says so.
    found = again.search_history("aardvark", wait=0)
    assert found == [] and not found.complete
    newest = again.search_history("line 11999", 1, wait=0.05)
    assert newest[0].startswith("[2024-02-28 14:00:00] old line 11999") and not newest.complete
    # The build holds no lock: appends go on, and the bounded scan has them.
    again.append_history("a new kiwi line")
    kiwi = again.search_history("kiwi", 1, wait=0)
    assert kiwi[0].endswith("a new kiwi line") and not kiwi.complete
    # A search without a bound waits for the build (let go from another thread).
    threading.Timer(0.3, release.set).start()
    found = again.search_history("aardvark", 1, decay_rate=0)
    assert found == [oldest] and found.complete
    kiwi = again.search_history("kiwi", 1, wait=0)
    assert kiwi[0].endswith("a new kiwi line") and kiwi.complete
    assert (again.dir / "HISTORY.md.index").exists()


def test_a_flipped_byte_in_a_saved_index_is_caught_by_its_checksum(
    tmp_path: Path, clock: Clock, warnings: list[str]
) -> None:
    first = _saved_scope(tmp_path, clock)
    index_file = first.dir / "HISTORY.md.index"
    data = bytearray(index_file.read_bytes())
    data[-3] ^= 0xFF  # inside the payload: the shapes still look right
    index_file.write_bytes(bytes(data))
    again = MemoryManager(tmp_path, "s", clock=clock)
    again.search_history("topic7")  # served at once; the checksum is checked meanwhile
    damaged = first.dir / "HISTORY.md.index.damaged"
    deadline = time.monotonic() + 10
    while not damaged.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert damaged.read_bytes() == bytes(data)
    assert any("checksum" in m for m in warnings)
    assert again.search_history("topic7 entry", 1)[0].endswith(
        "entry 7 about topic7 and some filler words here"
    )


# -- forgetting and correcting facts in the files ---------------------------------------


def _all_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


def test_forget_leaves_the_words_in_no_file_of_the_scope(mm: MemoryManager) -> None:
    mm.write_memory(
        "# About Alice\n\nFree text she wrote <!-- her own comment -->\n\n"
        "### Consolidated 2024-02-01\n- [learned_fact] Takes the Zyrtecor pill daily\n"
        "- [learned_fact] Takes the Zyrtecor pill daily\n- plain note\n"
    )
    mm.append_facts([("learned_fact", "A duplicate drug: Zyrtecor")])
    mm.compact_memory()  # MEMORY.md.bak now holds the old text too
    mm.knowledge.add("learned_fact", "takes the zyrtecor pill daily.", source="remember")
    mm.knowledge.flush()
    assert mm.search_memory("zyrtecor") and mm.knowledge.search("zyrtecor")
    mm.flush()  # the saved indexes hold the word
    assert b"Zyrtecor pill" in _all_bytes(mm.dir)
    pill = next(f for f in mm.list_facts() if f.text == "Takes the Zyrtecor pill daily")
    assert mm.forget_fact(pill.id) is not None
    mm.close()
    assert b"Zyrtecor pill" not in _all_bytes(mm.dir)
    # Every other byte as it was: headings, free text, another's comment, other facts.
    assert mm.read_memory() == (
        "# About Alice\n\nFree text she wrote <!-- her own comment -->\n\n"
        "### Consolidated 2024-02-01\n- plain note\n\n"
        "### Consolidated 2024-02-28\n- [learned_fact] A duplicate drug: Zyrtecor\n"
    )
    assert mm.search_memory("zyrtecor") == ["- [learned_fact] A duplicate drug: Zyrtecor"]
    assert not list(mm.dir.glob("*.tmp"))


def test_a_forget_by_another_process_is_not_undone_by_the_running_gateway(
    tmp_path: Path, clock: Clock
) -> None:
    running = MemoryManager(tmp_path, "telegram:42", clock=clock)
    running.record_consolidation(
        [("learned_fact", "Secret hobby is karaoke"), ("learned_fact", "Likes maps")], "s"
    )
    running.knowledge.search("karaoke")  # touched: a pending change in the running base
    assert "karaoke" in running.knowledge.export_for_context()
    operator = MemoryManager(tmp_path, "telegram:42", clock=clock)  # `gateway memory forget`
    secret = next(f for f in operator.list_facts() if "karaoke" in f.text)
    assert operator.forget_fact(secret.id) is not None
    operator.close()
    # The running gateway sees it at once and does not write it back.
    assert "karaoke" not in running.knowledge.export_for_context()
    assert running.search_memory("karaoke") == []
    running.knowledge.add("learned_fact", "Added after the forget", source="remember")
    running.close()
    reopened = MemoryManager(tmp_path, "telegram:42", clock=clock)
    assert sorted(e.content for e in reopened.knowledge) == ["Added after the forget", "Likes maps"]
    assert b"karaoke" not in _all_bytes(reopened.dir)


def test_appends_wait_for_a_rewrite_by_another_process(tmp_path: Path, clock: Clock) -> None:
    """The flock on MEMORY.md.lock: an append during another process's rewrite lands in
    the rewritten file, never in the one being replaced."""
    from gateway.fsutil import file_lock

    mm = MemoryManager(tmp_path, "telegram:42", clock=clock)
    mm.append_facts([("learned_fact", "first")])
    done = threading.Event()

    def append() -> None:
        mm.append_facts([("learned_fact", "second")])
        done.set()

    with file_lock(mm.dir / "MEMORY.md.lock"):  # as `gateway memory forget` holds it
        worker = threading.Thread(target=append)
        worker.start()
        assert not done.wait(0.5)
        manager_module.atomic_write_text(mm.memory_path, "- [learned_fact] rewritten\n")
    worker.join(10)
    assert mm.read_memory().splitlines()[-1] == "- [learned_fact] second"
    assert "- [learned_fact] rewritten" in mm.read_memory()
