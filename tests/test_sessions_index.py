"""The sidecar index of a session file: a cold load with it parses (almost) no lines,
finds the same session as a full parse, and a stale or damaged index is never trusted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from gateway.llm import LLMMessage
from gateway.sessions import SessionManager
from gateway.sessions.index import INDEX_DIR, MIN_ENTRIES
from gateway.sessions.store import FileSessionStore

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("sessions_child.py")
KEY = "telegram:42"
SMALL = 20  # index_min_entries of the stores below: an index from 20 entries on


@pytest.fixture
def logs() -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handler)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


def session_file(folder: Path) -> Path:
    manager = SessionManager(folder, fsync="never")
    path = manager.path_for(KEY)
    manager.close()
    assert path is not None
    return path


def index_file(folder: Path) -> Path:
    return folder / INDEX_DIR / (session_file(folder).name + ".idx")


def load(folder: Path, *, index: bool = True, minimum: int = SMALL) -> FileSessionStore:
    """A cold load of the session, as a fresh manager's store does it."""
    store = FileSessionStore(
        session_file(folder),
        KEY,
        fsync="never",
        index_dir=folder / INDEX_DIR if index else None,
        index_min_entries=minimum,
    )
    store.load()
    return store


def rich_session(folder: Path, messages: int = 40) -> None:
    """Messages, a branch, labels, a name, custom info, a model change, a compaction."""
    manager = SessionManager(folder, fsync="never")
    s = manager.get_or_create(KEY)
    for i in range(messages):
        s.add_message(LLMMessage(role="user" if i % 2 == 0 else "assistant", content=f"m{i} é"))
    ids = [e.id for e in s.get_branch()]
    s.label(ids[3], "start")
    s.set_name("the name")
    s.append_model_change("model-b")
    s.append_thinking_level_change("high")
    s.append_custom_info("plan", {"step": 2})
    s.append_custom_message("note", "a custom message")
    s.branch(ids[10])
    s.add_message(LLMMessage(role="user", content="on a side branch"))
    s.branch_with_summary(ids[-1], "the side branch, summarised")
    s.compact("summary so far", ids[-5])
    s.add_message(LLMMessage(role="user", content="after the compaction"))
    s.label(ids[3], None)
    s.label(ids[4], "kept")
    manager.close()


def snapshot(store: FileSessionStore) -> dict[str, object]:
    """Everything the public API answers about a loaded session."""
    tree = store.tree
    report = store.report
    return {
        "entries": tree.entries(),
        "leaf": tree.leaf_id,
        "labels": dict(tree.labels),
        "name": tree.name,
        "info": tree.custom_info("plan"),
        "branch": tree.get_branch(),
        "context": tree.build_context(),
        "tree": tree.get_tree(),
        "children": tree.children(None),
        "header": store.header,
        "bad": report.bad_line_numbers,
        "damaged": report.damaged_entry_ids,
        "torn": report.torn,
        "size": store.size,
    }


def test_a_cold_load_uses_the_index_and_finds_the_same_session(folder: Path) -> None:
    rich_session(folder)
    full = load(folder, index=False)
    assert full.report.index == "" and not index_file(folder).exists()

    first = load(folder)  # no index yet: a full parse, then one is written
    assert first.report.index == "missing"
    assert first.report.parsed_lines == len(full.tree)
    assert list((folder / INDEX_DIR).iterdir()) == [index_file(folder)]  # no temp file left
    assert index_file(folder).stat().st_mode & 0o777 == 0o600

    cold = load(folder)
    assert cold.report.index == "used"
    assert cold.report.parsed_lines == 0
    assert snapshot(cold) == snapshot(full) == snapshot(first)
    # The JSONL is never touched for the index.
    assert session_file(folder).read_bytes().count(b"\n") == len(full.tree) + 1


def test_a_small_session_keeps_no_index(folder: Path) -> None:
    rich_session(folder, messages=12)
    assert load(folder, minimum=1000).report.index == "missing"
    assert not index_file(folder).exists()


def test_the_manager_keeps_an_index_past_its_threshold(folder: Path) -> None:
    manager = SessionManager(folder, fsync="never")
    s = manager.get_or_create(KEY)
    for i in range(MIN_ENTRIES):
        s.add_message(LLMMessage(role="user", content=f"m{i}"))
    manager.close()
    assert SessionManager(folder).get(KEY) is not None
    again = SessionManager(folder).get(KEY)
    assert again is not None
    assert again.load_report.index == "used" and again.load_report.parsed_lines == 0
    assert again.message_count == MIN_ENTRIES


def test_lines_another_writer_appended_are_parsed_after_the_index(folder: Path) -> None:
    rich_session(folder)
    load(folder)  # writes the index
    other = SessionManager(folder, fsync="never").get_or_create(KEY)
    for i in range(3):
        other.add_message(LLMMessage(role="user", content=f"later {i}"))
    cold = load(folder)
    assert cold.report.index == "used"
    assert cold.report.parsed_lines == 3
    assert snapshot(cold) == snapshot(load(folder, index=False))


def test_an_index_far_behind_its_file_is_written_anew(folder: Path) -> None:
    rich_session(folder)
    load(folder)
    other = SessionManager(folder, fsync="never").get_or_create(KEY)
    for i in range(SMALL):
        other.add_message(LLMMessage(role="user", content=f"later {i}"))
    assert load(folder).report.parsed_lines == SMALL  # and it indexes them
    cold = load(folder)
    assert (cold.report.index, cold.report.parsed_lines) == ("used", 0)
    assert snapshot(cold) == snapshot(load(folder, index=False))


def cut_lines(path: Path, keep: int) -> None:
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:keep]) + b"\n")


@pytest.mark.parametrize("change", ["truncated", "replaced", "same size", "rewritten"])
def test_a_stale_index_is_detected_and_rebuilt(folder: Path, change: str) -> None:
    rich_session(folder)
    load(folder)
    path = session_file(folder)
    data = path.read_bytes()
    if change == "truncated":  # cut back by hand to fewer lines
        cut_lines(path, 30)
    elif change == "replaced":  # another file at the name (a copy: same bytes, new inode)
        os.unlink(path)
        path.write_bytes(data)
    elif change == "same size":  # edited in place, same length, the index's tail intact
        at = data.index(b'"m7 \xc3\xa9"')
        with open(path, "r+b") as f:
            f.seek(at + 2)
            f.write(b"8")
        os.utime(path, ns=(0, 0))
    else:  # another session written over it (longer than the old one)
        os.unlink(path)
        rich_session(folder, messages=60)
    cold = load(folder)
    assert cold.report.index == "stale"
    assert snapshot(cold) == snapshot(load(folder, index=False))
    again = load(folder)
    assert (again.report.index, again.report.parsed_lines) == ("used", 0)
    assert snapshot(again) == snapshot(cold)


@pytest.mark.parametrize(
    "damage",
    ["garbage", "empty", "cut in half", "one byte flipped", "counts", "not json"],
)
def test_a_damaged_index_is_reported_and_ignored(
    folder: Path, logs: list[str], damage: str
) -> None:
    rich_session(folder)
    load(folder)
    idx = index_file(folder)
    raw = idx.read_bytes()
    meta, body = raw.split(b"\n", 1)
    if damage == "garbage":
        idx.write_bytes(os.urandom(len(raw)))
    elif damage == "empty":  # a power cut right after the rename (it is not fsynced)
        idx.write_bytes(b"")
    elif damage == "cut in half":
        idx.write_bytes(raw[: len(raw) // 2])
    elif damage == "one byte flipped":
        at = len(meta) + 1 + len(body) // 2
        idx.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :])
    elif damage == "counts":  # consistent checksum, wrong counts: written by a bug
        fields = json.loads(meta)
        fields["entries"] += 1
        idx.write_bytes(json.dumps(fields).encode() + b"\n" + body)
    else:
        idx.write_bytes(b"{not json\n" + body)
    cold = load(folder)
    assert cold.report.index == "damaged"
    assert any("session index" in m and "damaged" in m for m in logs)
    assert snapshot(cold) == snapshot(load(folder, index=False))
    assert cold.report.clean  # the session itself is fine
    again = load(folder)  # the damaged index was replaced
    assert (again.report.index, again.report.parsed_lines) == ("used", 0)


def test_damaged_lines_are_reported_the_same_with_the_index(folder: Path) -> None:
    rich_session(folder)
    path = session_file(folder)
    lines = path.read_bytes().split(b"\n")
    lines[5] = b"not json at all"  # a bad line: skipped at load
    # A message line whose prefix reads but whose body does not: found when decoded.
    lines[8] = lines[8][: lines[8].index(b'"message":')] + b'"message":{"role":"user",}}'
    lines[12:12] = [b"", b"  "]  # blank lines: skipped, not bad
    path.write_bytes(b"\n".join(lines))
    full = load(folder, index=False)
    assert full.report.bad_line_numbers == (6,)
    load(folder)
    cold = load(folder)
    assert cold.report.index == "used"
    assert snapshot(cold) == snapshot(full)
    assert cold.report.damaged_entry_ids and cold.report.bad_line_numbers == (6,)


def test_a_torn_tail_after_the_index_is_handled_as_without(folder: Path) -> None:
    rich_session(folder)
    load(folder)
    path = session_file(folder)
    with open(path, "ab") as f:
        f.write(b'{"id":"abc","parent_id":null,"timest')  # a crash mid-write
    cold = load(folder)
    assert cold.report.index == "used" and cold.report.torn
    assert snapshot(cold) == snapshot(load(folder, index=False))


def test_a_kill_between_appends_and_the_index_loses_nothing(folder: Path) -> None:
    """The index is a cache written at load: a writer killed after appending (before
    any load wrote a new index) leaves an old index; every acknowledged line loads."""
    manager = SessionManager(folder, fsync="always")
    s = manager.get_or_create(KEY)
    for i in range(MIN_ENTRIES):
        s.add_message(LLMMessage(role="user", content=f"seed:{i}"))
    manager.close()
    assert SessionManager(folder).get(KEY) is not None  # writes the index
    assert index_file(folder).exists()
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(folder), KEY, "always", "0", "0", "kill"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    acked = -1
    while acked < 50:
        acked = int(child.stdout.readline().split()[1])
    child.send_signal(signal.SIGKILL)
    child.wait()
    cold = SessionManager(folder).get(KEY)
    assert cold is not None
    assert cold.load_report.index == "used" and cold.load_report.parsed_lines > acked
    contents = [m.content for m in cold.build_context().messages]
    assert contents[:MIN_ENTRIES] == [f"seed:{i}" for i in range(MIN_ENTRIES)]
    assert contents[MIN_ENTRIES : MIN_ENTRIES + acked + 1] == [
        f"kill:{i}" for i in range(acked + 1)
    ]


def test_archive_and_delete_remove_the_index(folder: Path) -> None:
    rich_session(folder)
    store = load(folder)
    assert index_file(folder).exists()
    store.archive()
    assert not index_file(folder).exists()
    rich_session(folder)
    store = load(folder)
    assert index_file(folder).exists()
    assert store.delete()
    assert not index_file(folder).exists()


def test_listing_ignores_the_index_folder(folder: Path) -> None:
    rich_session(folder)
    load(folder)
    assert [s.key for s in SessionManager(folder).list_sessions()] == [KEY]


@pytest.mark.parametrize("ascii_only", [True, False])
def test_a_blank_line_and_an_unterminated_last_entry(folder: Path, ascii_only: bool) -> None:
    """A complete last line without its newline is an entry the index does not cover;
    a blank line before it holds none (the line count alone would say otherwise)."""
    manager = SessionManager(folder, fsync="never")
    s = manager.get_or_create(KEY)
    for i in range(SMALL + 5):
        s.add_message(LLMMessage(role="user", content=f"m{i}" if ascii_only else f"é{i}"))
    manager.close()
    path = session_file(folder)
    last = path.read_bytes().split(b"\n")[-2]
    with open(path, "ab") as f:
        f.write(b"\n" + last.replace(last[7:19], b"0123456789ab"))
    full = load(folder, index=False)
    assert len(full.tree) == SMALL + 6 and not full.report.bad_lines
    load(folder)
    cold = load(folder)
    assert (cold.report.index, cold.report.parsed_lines) == ("used", 1)
    assert snapshot(cold) == snapshot(full)
    assert not cold.report.damaged_entry_ids
