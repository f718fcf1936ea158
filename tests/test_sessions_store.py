"""The session file: append-only writes, damage handling, fsync modes, sharing a file
between managers/processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loguru import logger

from gateway.llm import LLMMessage
from gateway.sessions import (
    GroupCommitter,
    MessageEntry,
    SessionError,
    SessionManager,
    UnsupportedVersionError,
)
from gateway.sessions.spares import SPARES_DIR
from gateway.sessions.store import FileSessionStore, encode_line
from tests.llm_messages import user

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("sessions_child.py")


@pytest.fixture
def logs() -> Iterator[list[str]]:
    seen: list[str] = []
    handler = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    yield seen
    logger.remove(handler)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


def lines_of(path: Path) -> list[dict[str, object]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode().splitlines()]


def contents(manager: SessionManager, key: str) -> list[str | None]:
    s = manager.get(key)
    assert s is not None
    return [e.message.content for e in s.entries if isinstance(e, MessageEntry)]


def write_session(path: Path, *contents: str) -> list[str]:
    """A valid file written by hand (as another program would): header + messages."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "id": "h" * 32,
        "parent_id": None,
        "timestamp": 1.0,
        "type": "session_header",
        "key": "k",
        "version": 1,
    }
    out = [json.dumps(header)]
    parent = None
    for i, text in enumerate(contents):
        eid = f"e{i:011d}"
        out.append(
            json.dumps(
                {
                    "id": eid,
                    "parent_id": parent,
                    "timestamp": 2.0 + i,
                    "type": "message",
                    "message": {"role": "user", "content": text},
                },
                separators=(",", ":"),
            )
        )
        parent = eid
    path.write_text("\n".join(out) + "\n")
    return out


# -- creating and appending ---------------------------------------------------------


def test_file_appears_with_first_entry_and_is_private(folder: Path) -> None:
    manager = SessionManager(folder, fsync="always")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    s = manager.get_or_create("telegram:1")
    assert s.path == folder / "telegram%3A1.jsonl"
    assert not s.path.exists()
    entry = s.add_message(user("hi"), meta={"cached": True})
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
    header, first = lines_of(s.path)
    assert header == {
        "id": s.session_id,
        "parent_id": None,
        "timestamp": s.created_at,
        "type": "session_header",
        "key": "telegram:1",
        "version": 1,
    }
    assert first == {
        "id": entry.id,
        "parent_id": None,
        "timestamp": entry.timestamp,
        "type": "message",
        "message": {"role": "user", "content": "hi"},
        "meta": {"cached": True},
    }
    # No temp files left behind (the spare-file pool keeps its own private folder).
    assert [p for p in folder.iterdir() if p.name != SPARES_DIR] == [s.path]


def test_each_append_adds_exactly_one_line(folder: Path) -> None:
    """Promise: the transcript stays append-only, one whole line per entry."""
    s = SessionManager(folder, fsync="never").get_or_create("k")
    s.add_message(user("first"))
    assert s.path is not None
    for i in range(50):
        before = s.path.read_bytes()
        entry = s.add_message(user("é" * i))
        after = s.path.read_bytes()
        assert after.startswith(before)
        line = after[len(before) :]
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == entry.to_dict()


def test_fsync_modes_acknowledge_only_durable_appends(folder: Path) -> None:
    """Promise: an acknowledged append is on disk (always/batch); never waits for save()."""
    for mode in ("always", "batch", "never"):
        s = SessionManager(folder / mode, fsync=mode).get_or_create("k")  # type: ignore[arg-type]
        s.add_message(user("a"))
        s.add_message(user("b"))
        store = s._store
        assert isinstance(store, FileSessionStore) and store._handle is not None
        assert store._handle.dirty is (mode == "never")
        SessionManager(folder / mode, fsync=mode).save(s)  # type: ignore[arg-type]
        assert store._handle.dirty is False
    with pytest.raises(ValueError, match="fsync must be one of"):
        SessionManager(folder, fsync="sometimes")  # type: ignore[arg-type]


def test_group_commit_shares_fsyncs_across_threads(folder: Path) -> None:
    committer = GroupCommitter()
    manager = SessionManager(folder, fsync="batch", committer=committer)
    sessions = [manager.get_or_create(f"user:{i}") for i in range(8)]
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        for n in range(25):
            sessions[i].add_message(user(f"{i}:{n}"))
            sessions[0].add_message(user(f"shared {i}:{n}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sessions:
        store = s._store
        assert isinstance(store, FileSessionStore) and store._handle is not None
        assert not store._handle.dirty
    assert committer.rounds < 400  # 400 appends, fewer fsync rounds: they were grouped
    fresh = SessionManager(folder, fsync="never")
    assert len(contents(fresh, "user:0")) == 25 + 200
    for i in range(1, 8):
        assert contents(fresh, f"user:{i}") == [f"{i}:{n}" for n in range(25)]
    chain = fresh.get("user:0")
    assert chain is not None and len(chain.get_branch()) == 225  # one unbroken chain


# -- damaged files --------------------------------------------------------------------


def test_torn_last_line_is_ignored_then_set_aside(folder: Path, logs: list[str]) -> None:
    path = folder / "k.jsonl"
    lines = write_session(path, "one", "two")
    torn = lines[-1][:40].encode()
    with path.open("ab") as f:
        f.write(b'{"id":"e99","parent_id":"e00000000001","timestamp":9,"type":"mess')
    good_size = len(("\n".join(lines) + "\n").encode())
    del torn

    s = SessionManager(folder, fsync="always").get("k")
    assert s is not None
    assert [m.content for m in s.messages] == ["one", "two"]
    report = s.load_report
    assert report.torn and report.bad_lines == 0 and report.torn_sidecar is None
    assert any("incomplete" in m for m in logs)

    entry = s.add_message(user("three"))
    assert entry.parent_id == "e00000000001"
    report = s.load_report
    assert report.torn_sidecar is not None and report.torn_sidecar.name.startswith("k.jsonl.torn-")
    assert report.torn_sidecar.read_bytes().startswith(b'{"id":"e99"')
    data = path.read_bytes()
    assert data[:good_size] == ("\n".join(lines) + "\n").encode()
    assert [d["type"] for d in lines_of(path)] == [
        "session_header",
        "message",
        "message",
        "message",
    ]
    again = SessionManager(folder, fsync="never").get("k")
    assert again is not None and again.load_report.clean
    assert [m.content for m in again.messages] == ["one", "two", "three"]


def test_torn_tail_repaired_by_another_writer(folder: Path) -> None:
    path = folder / "k.jsonl"
    write_session(path, "one")
    with path.open("ab") as f:
        f.write(b'{"id":"torn')
    a = SessionManager(folder, fsync="never").get("k")
    b = SessionManager(folder, fsync="never").get("k")
    assert a is not None and b is not None and a.load_report.torn
    b.add_message(user("from b"))  # b sets the fragment aside
    a.add_message(user("from a"))  # a must not set aside (or cut) anything again
    assert len(list(folder.glob("k.jsonl.torn-*"))) == 1
    assert [m.content for m in a.messages] == ["one", "from b", "from a"]
    assert contents(SessionManager(folder, fsync="never"), "k") == ["one", "from b", "from a"]


def test_complete_last_line_without_newline_is_kept(folder: Path) -> None:
    path = folder / "k.jsonl"
    write_session(path, "one", "two")
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    s = SessionManager(folder, fsync="never").get("k")
    assert s is not None and [m.content for m in s.messages] == ["one", "two"]
    assert s.load_report.clean
    s.add_message(user("three"))
    assert [d.get("message", {}).get("content") for d in lines_of(path)[1:]] == [  # type: ignore[union-attr]
        "one",
        "two",
        "three",
    ]


def test_bad_middle_lines_are_counted_and_kept(folder: Path, logs: list[str]) -> None:
    path = folder / "k.jsonl"
    lines = write_session(path, "one", "two", "three")
    lines.insert(2, "this is not json")
    lines.insert(3, '{"id":"x","parent_id":null,"timestamp":1,"type":"bogus"}')
    lines.insert(4, "")  # blank lines are harmless, not counted
    path.write_text("\n".join(lines) + "\n")
    original = path.read_bytes()

    s = SessionManager(folder, fsync="never").get("k")
    assert s is not None
    assert s.load_report.bad_lines == 2 and s.load_report.bad_line_numbers == (3, 4)
    assert any("skipped 2 unreadable line(s): 3, 4" in m and str(path) in m for m in logs)
    assert [m.content for m in s.messages] == ["one", "two", "three"]
    s.add_message(user("four"))
    assert path.read_bytes().startswith(original)  # never rewritten


def test_damaged_message_body_is_reported_when_decoded(folder: Path, logs: list[str]) -> None:
    path = folder / "k.jsonl"
    lines = write_session(path, "one", "two", "three")
    lines[2] = lines[2].replace('"content":"two"}}', '"content":"tw')  # prefix still fine
    path.write_text("\n".join(lines) + "\n")
    s = SessionManager(folder, fsync="never").get("k")
    assert s is not None
    assert [m.content for m in s.messages] == ["one", "three"]  # the chain stays connected
    assert s.load_report.bad_lines == 1
    assert s.load_report.damaged_entry_ids == ("e00000000001",)
    assert any("damaged" in m for m in logs)


def test_invalid_utf8_line_is_a_bad_line(folder: Path) -> None:
    path = folder / "k.jsonl"
    write_session(path, "one")
    with path.open("ab") as f:
        f.write(b'{"id":"zz","parent_id":null,"timestamp":1,"type":"label","target_id":"\xff"}\n')
    s = SessionManager(folder, fsync="never").get("k")
    assert s is not None and s.load_report.bad_line_numbers == (3,)


@pytest.mark.parametrize(
    "content",
    [b"garbage\n", b'{"id":"a","parent_id":null,"timestamp":1,"type":"message"}\n', b'{"id"'],
)
def test_bad_header_moves_file_aside(folder: Path, content: bytes, logs: list[str]) -> None:
    folder.mkdir()
    path = folder / "k.jsonl"
    path.write_bytes(content + b'{"more":"data"}\n')
    manager = SessionManager(folder, fsync="always")
    assert manager.get("k") is None
    s = manager.get_or_create("k")
    report = s.load_report
    assert report.moved_aside is not None and report.started_fresh
    assert report.moved_aside.name.startswith("k.jsonl.corrupt-")
    assert report.moved_aside.read_bytes() == content + b'{"more":"data"}\n'
    assert any("no valid header" in m for m in logs)
    assert not path.exists()
    s.add_message(user("fresh"))
    assert manager.get("k") is s
    # A second damaged file is moved aside too, without overwriting the first.
    path.unlink()
    path.write_bytes(b"more garbage\n")
    assert SessionManager(folder, fsync="never").get("k") is None
    corrupt = [p for p in folder.iterdir() if ".corrupt-" in p.name]
    assert {p.read_bytes() for p in corrupt} == {
        content + b'{"more":"data"}\n',
        b"more garbage\n",
    }


def test_empty_file_counts_as_no_session(folder: Path) -> None:
    folder.mkdir()
    (folder / "k.jsonl").touch()
    manager = SessionManager(folder, fsync="never")
    assert manager.get("k") is None
    s = manager.get_or_create("k")
    s.add_message(user("a"))
    assert [d["type"] for d in lines_of(folder / "k.jsonl")] == ["session_header", "message"]


def test_newer_format_version_is_left_untouched(folder: Path) -> None:
    folder.mkdir()
    path = folder / "k.jsonl"
    data = (
        b'{"id":"h","parent_id":null,"timestamp":1,"type":"session_header","key":"k","version":9}\n'
    )
    path.write_bytes(data)
    with pytest.raises(UnsupportedVersionError, match="upgrade"):
        SessionManager(folder, fsync="never").get("k")
    assert path.read_bytes() == data


# -- several writers ------------------------------------------------------------------


def test_two_managers_share_one_session(folder: Path) -> None:
    a = SessionManager(folder, fsync="never").get_or_create("k")
    b = SessionManager(folder, fsync="never").get_or_create("k")
    assert a is not b
    ids = []
    for i in range(20):
        ids.append((a if i % 2 == 0 else b).add_message(user(str(i))).id)
    assert a.session_id == b.session_id  # b adopted the file a created
    a.refresh()  # reads don't touch the disk; appends and refresh() do
    for s in (a, b):
        assert [m.content for m in s.messages] == [str(i) for i in range(20)]
        assert [e.id for e in s.get_branch()] == ids
    records = lines_of(folder / "k.jsonl")
    assert len(records) == 21
    for prev, rec in pairwise(records[1:]):
        assert rec["parent_id"] == prev["id"]


def test_cached_session_picks_up_other_writers(folder: Path) -> None:
    mine = SessionManager(folder, fsync="never")
    s = mine.get_or_create("k")
    s.add_message(user("mine"))
    other = SessionManager(folder, fsync="never").get_or_create("k")
    other.add_message(user("theirs"))
    again = mine.get_or_create("k")
    assert again is s
    assert [m.content for m in again.messages] == ["mine", "theirs"]


def test_reset_elsewhere_is_followed(folder: Path) -> None:
    a = SessionManager(folder, fsync="never").get_or_create("k")
    a.add_message(user("old"))
    old_id = a.session_id
    b_manager = SessionManager(folder, fsync="never")
    b = b_manager.reset("k")
    assert b.session_id != old_id and b.header.previous_session == old_id
    entry = a.add_message(user("new"))  # a notices its file was archived
    assert entry.parent_id is None
    assert a.header.previous_session == old_id and [m.content for m in a.messages] == ["new"]
    b.add_message(user("from b"))  # b adopts the file a created for the key
    assert b.session_id == a.session_id
    assert contents(SessionManager(folder, fsync="never"), "k") == ["new", "from b"]
    (archived,) = (folder / "archive" / "k").iterdir()
    assert [d["type"] for d in lines_of(archived)] == ["session_header", "message"]


def test_delete_elsewhere_starts_fresh(folder: Path) -> None:
    a = SessionManager(folder, fsync="never").get_or_create("k")
    a.add_message(user("old"))
    assert SessionManager(folder, fsync="never").delete("k")
    a.add_message(user("again"))
    assert [m.content for m in a.messages] == ["again"]
    assert contents(SessionManager(folder, fsync="never"), "k") == ["again"]


def test_two_processes_append_to_one_session(folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(folder), "shared:key", fsync, "0", "200", tag],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for tag, fsync in (("A", "never"), ("B", "batch"))
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.split("\n")[-2] == "ack 199"
    records = lines_of(folder / "shared%3Akey.jsonl")  # every line is whole JSON
    assert records[0]["type"] == "session_header"
    assert len(records) == 401
    assert len({r["id"] for r in records}) == 401
    for prev, rec in pairwise(records[1:]):
        assert rec["parent_id"] == prev["id"]  # one chain: parents chosen under the lock
    for tag in "AB":
        seq = [
            int(r["message"]["content"].split(":")[1])
            for r in records[1:]  # type: ignore[index]
            if r["message"]["content"].startswith(tag)
        ]  # type: ignore[index]
        assert seq == list(range(200))


def test_unstorable_payload_is_refused_before_writing(folder: Path) -> None:
    s = SessionManager(folder, fsync="never").get_or_create("k")
    s.add_message(user("a"))
    assert s.path is not None
    before = s.path.read_bytes()
    with pytest.raises(SessionError, match="cannot be stored as JSON"):
        s.add_message(user("b"), meta={"x": object()})
    with pytest.raises(SessionError, match="cannot be stored as JSON"):
        s.append_custom_info("ext", float("nan"))
    assert s.path.read_bytes() == before and len(s.entries) == 1


def test_concurrent_first_appends_make_one_file(folder: Path) -> None:
    """Many writers racing to create the file: one header, every entry on one chain."""
    managers = [SessionManager(folder, fsync="never") for _ in range(6)]
    sessions = [m.get_or_create("race") for m in managers]
    barrier = threading.Barrier(len(sessions))

    def first_append(i: int) -> None:
        barrier.wait()
        for n in range(5):
            sessions[i].add_message(user(f"{i}:{n}"))

    threads = [threading.Thread(target=first_append, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = lines_of(folder / "race.jsonl")
    assert [r["type"] for r in records].count("session_header") == 1
    assert len(records) == 31
    for prev, rec in pairwise(records[1:]):
        assert rec["parent_id"] == prev["id"]
    assert len({s.session_id for s in sessions}) == 1


_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from('"\\\n\t\x00\x7f\u2028'))


@given(
    content=_TEXT,
    role=st.sampled_from(["user", "assistant", "system", "tool"]) | _TEXT,
    parent=st.none() | _TEXT,
    timestamp=st.floats(allow_nan=False, allow_infinity=False) | st.just(1764400000.123456),
)
def test_a_message_line_is_what_the_json_encoder_writes(
    content: str, role: str, parent: str | None, timestamp: float
) -> None:
    """The message entry's own line writer (`store._message_line`, the turn's fast path)
    writes the very characters of the generic encoder."""
    entry = MessageEntry(
        id="0123456789ab",
        parent_id=parent,
        timestamp=timestamp,
        message=LLMMessage(role=role, content=content),  # type: ignore[arg-type]
    )
    generic = json.dumps(entry.to_dict(), ensure_ascii=False, separators=(",", ":"))
    assert encode_line(entry) == generic + "\n"
    if role in ("user", "assistant", "system", "tool"):
        assert MessageEntry.from_dict(json.loads(encode_line(entry))) == entry
