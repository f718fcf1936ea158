"""`gateway storage import|export`: a file workspace into PostgreSQL and back, as an
operator runs it (subprocesses), checked byte for byte and row for row."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.access.protocol import PendingRequest
from gateway.access.store import PairingStore
from gateway.memory import MemoryStore
from gateway.memory.facts import NewFact, Origin
from gateway.memory.format import memory_documents
from gateway.memory.manager import MemoryManager
from gateway.people.store import FilePeopleStore
from gateway.schedules.protocol import ScheduledJob
from gateway.schedules.runs import HeartbeatState
from gateway.schedules.store import FileJobStore
from gateway.sessions import SessionManager
from gateway.sessions.keys import encode_key
from gateway.usage.protocol import UsageRow
from gateway.usage.store import SqliteUsageLedger
from tests.llm_messages import assistant, user
from tests.test_cli_e2e import base_env, run_gateway

HOSTILE_KEY = "slack:C1:thread:1700000000.000100'; --"
HOSTILE_TEXT = "nul\x00 'quote\" \\ back; DROP TABLE gw_sessions; \u202e bidi \U0001f600"


#: A stored tool output (`gateway.sessions.outputs`): non-ASCII, NUL, no final newline.
PAGE = "".join(f"line {i}: Grüße \x00 {'x' * (i % 40)}\n" for i in range(2000)) + "end"


def populate(manager: SessionManager) -> None:
    """Every shape a session takes: turns, `/new` (twice), a branch, a label, a fork,
    custom entries, hostile text and keys, non-ASCII; and tool outputs stored beside
    them (one in an archived session, one a fork copied, one of the hostile key)."""
    first = manager.get_or_create("telegram:1")
    for i in range(3):
        first.add_message(user(f"question {i}"))
        first.add_message(assistant(f"answer {i}"))
    manager.outputs.put("telegram:1", first.session_id, PAGE)
    manager.reset("telegram:1")
    first.add_message(user("after the first /new"))
    manager.reset("telegram:1")
    first.add_message(user("Grüße aus Köln, 日本語"))
    thread = manager.get_or_create("slack:C9:thread:1.5")
    root = thread.add_message(user("root"))
    thread.add_message(assistant("one way"))
    thread.label(root.id, "start")
    thread.branch(root.id)
    thread.add_message(assistant("another way"))
    thread.append_custom_info("note", {"nested": [1, 2.5, None, "x"]})
    manager.outputs.put("slack:C9:thread:1.5", thread.session_id, PAGE[:30_000])
    manager.fork("slack:C9:thread:1.5", new_key="cli:forked")
    hostile = manager.get_or_create(HOSTILE_KEY)
    hostile.add_message(user(HOSTILE_TEXT))
    manager.outputs.put(HOSTILE_KEY, hostile.session_id, HOSTILE_TEXT * 500)


def file_workspace(tmp_path: Path) -> Path:
    """A file-mode workspace holding every shape of `populate`."""
    source = tmp_path / "source"
    manager = SessionManager(source / "sessions", fsync="never")
    populate(manager)
    manager.close()
    return source


def session_files(workspace: Path) -> dict[str, bytes]:
    """Every session file under the workspace (archive included), by relative path."""
    root = workspace / "sessions"
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*.jsonl"))
        if path.is_file()
    }


def output_files(workspace: Path) -> dict[str, tuple[bytes, float]]:
    """Every stored tool output file under the workspace's sessions: its bytes and time."""
    root = workspace / "sessions" / "outputs"
    return {
        str(path.relative_to(root)): (path.read_bytes(), path.stat().st_mtime)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def same_outputs(a: dict[str, tuple[bytes, float]], b: dict[str, tuple[bytes, float]]) -> bool:
    """The same files with the same bytes, and times within a microsecond (a double in
    PostgreSQL keeps no more of a time than that)."""
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and abs(a[k][1] - b[k][1]) < 2e-6 for k in a
    )


def dump_rows(url: str) -> tuple[list[tuple[Any, ...]], ...]:
    """Every column of every session row, entry row and tool output row, in a stable
    order."""
    import psycopg

    with psycopg.connect(url) as conn:
        sessions = conn.execute(
            "SELECT session_id, key, header::text, created_at, updated_at, last_seq, bytes, "
            "archived_at FROM gw_sessions ORDER BY session_id"
        ).fetchall()
        entries = conn.execute(
            "SELECT session_id, seq, entry_id, parent_id, type, body::text "
            "FROM gw_session_entries ORDER BY session_id, seq"
        ).fetchall()
        outputs = conn.execute(
            "SELECT session_key, handle, session_id, created_at, content "
            "FROM gw_tool_outputs ORDER BY session_key, handle"
        ).fetchall()
    return sessions, entries, outputs


@pytest.fixture
def shared_manager(migrated_pg_url: str) -> Iterator[SessionManager]:
    from gateway.plumbing.postgres import sync_pool
    from gateway.sessions.pg_store import PostgresSessions

    pool = sync_pool(migrated_pg_url, max_size=2)
    pool.open(wait=True)
    manager = SessionManager.shared(PostgresSessions(pool))
    yield manager
    manager.close()
    pool.close()


def storage(args: list[str], url: str, tmp_path: Path) -> Any:
    env = base_env(tmp_path) | {"GATEWAY_STORAGE__URL": url}
    return run_gateway(["storage", *args], env, tmp_path)


def test_files_to_postgresql_to_files_gives_identical_session_files(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = file_workspace(tmp_path)
    # A line as another tool may have written it: stored and given back as it is.
    hand = source / "sessions" / (encode_key("cli:hand") + ".jsonl")
    hand.write_text(
        '{"type":"session_header","id":"h1","parent_id":null,"timestamp":1.0,'
        '"key":"cli:hand","version":1}\n'
        '{ "type": "message", "id": "e1", "parent_id": null, "timestamp": 2.5, '
        '"message": {"role": "user", "content": "spaced  out"} }\n'
    )
    before = session_files(source)
    assert sum("archive/" in name for name in before) == 2

    imported = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().split("; ")[0] == (
        "sessions: 7 imported, 0 already there, 0 damaged (skipped), "
        "0 conflicting (left as they are)"
    )
    assert "sessions [7/7] imported" in imported.stderr
    assert imported.stdout.strip().split("; ")[1] == (
        "tool outputs: 4 imported, 0 already there, 0 damaged (skipped), "
        "0 conflicting (left as they are)"
    )
    outputs = output_files(source)
    assert len(outputs) == 4

    exported = storage(["export", str(tmp_path / "back")], migrated_pg_url, tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert session_files(tmp_path / "back") == before
    assert session_files(source) == before  # the import only read
    # The tool outputs come back byte for byte, with their times, where they were.
    assert same_outputs(output_files(tmp_path / "back"), outputs)
    assert output_files(source) == outputs

    # The file mode reads the exported workspace as it read the original.
    back = SessionManager(tmp_path / "back" / "sessions")
    again = back.get("telegram:1")
    assert again is not None and [m.content for m in again.messages] == ["Grüße aus Köln, 日本語"]
    assert [a.number for a in back.list_archived("telegram:1")] == [1, 2]
    assert back.open_archived("telegram:1", 2).message_count == 6
    hostile = back.get(HOSTILE_KEY)
    assert hostile is not None and [m.content for m in hostile.messages] == [HOSTILE_TEXT]
    # ...and its conversations read their tool outputs under the same handles.
    handles = {name.split("/")[0]: name.split("/")[2][:-4] for name in outputs}
    assert back.outputs.get(HOSTILE_KEY, handles[encode_key(HOSTILE_KEY)]) == HOSTILE_TEXT * 500
    assert back.outputs.get("telegram:1", handles[encode_key("telegram:1")]) == PAGE
    assert back.outputs.get("cli:forked", handles[encode_key("cli:forked")]) == PAGE[:30_000]


def test_postgresql_to_files_to_postgresql_gives_identical_rows(
    migrated_pg_url: str, shared_manager: SessionManager, tmp_path: Path
) -> None:
    import psycopg

    populate(shared_manager)
    rows = dump_rows(migrated_pg_url)
    assert len(rows[0]) == 6 and sum(r[7] is not None for r in rows[0]) == 2
    assert len(rows[2]) == 4 and HOSTILE_TEXT.encode() * 500 in [bytes(r[4]) for r in rows[2]]

    exported = storage(["export", str(tmp_path / "files")], migrated_pg_url, tmp_path)
    assert exported.returncode == 0, exported.stderr
    with psycopg.connect(migrated_pg_url) as conn:
        conn.execute("DELETE FROM gw_sessions")
    imported = storage(["import", str(tmp_path / "files")], migrated_pg_url, tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert dump_rows(migrated_pg_url) == rows


def test_a_second_import_skips_and_reports_what_is_there(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = file_workspace(tmp_path)
    assert storage(["import", str(source)], migrated_pg_url, tmp_path).returncode == 0
    rows = dump_rows(migrated_pg_url)

    again = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("sessions: 0 imported, 6 already there, 0 damaged")
    assert "tool outputs: 0 imported, 4 already there, 0 damaged" in again.stdout
    assert again.stderr.count("skipped") == 10 and "already imported" in again.stderr
    assert dump_rows(migrated_pg_url) == rows

    # A replica appended since the import: still the same session, nothing duplicated.
    from gateway.plumbing.postgres import sync_pool
    from gateway.sessions.pg_store import PostgresSessions

    with sync_pool(migrated_pg_url, max_size=1) as pool:
        shared = SessionManager.shared(PostgresSessions(pool))
        shared.get_or_create("cli:forked").add_message(user("later, in the shared mode"))
        shared.close()
    third = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert third.returncode == 0, third.stderr
    assert "the database has 1 newer entries" in third.stderr


def test_damaged_files_are_reported_and_skipped_never_half_imported(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    manager = SessionManager(source / "sessions", fsync="never")
    handles = {}
    for key in ("telegram:good", "telegram:middle", "telegram:torn"):
        session = manager.get_or_create(key)
        for i in range(3):
            session.add_message(user(f"{key} {i}"))
        handles[key] = manager.outputs.put(key, session.session_id, f"{key} " * 2000)
    manager.close()
    folder = source / "sessions"
    # A file in the outputs folder that is no output, and a write a crash cut short.
    (folder / "outputs" / "notes.txt").write_text("mine")
    good_outputs = next((folder / "outputs" / encode_key("telegram:good")).iterdir())
    (good_outputs / ".out_0123456789ab.txt.tmp").write_text("half")
    middle = folder / (encode_key("telegram:middle") + ".jsonl")
    lines = middle.read_text().splitlines(keepends=True)
    middle.write_text("".join([*lines[:2], "{not json\n", *lines[2:]]))
    torn = folder / (encode_key("telegram:torn") + ".jsonl")
    with torn.open("a") as fh:
        fh.write('{"type":"message","id":"cut')
    bad_header = folder / (encode_key("telegram:header") + ".jsonl")
    bad_header.write_text('{"type":"message"}\n')
    damaged = {p: p.read_bytes() for p in (middle, torn, bad_header)}

    result = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert result.returncode == 1
    assert result.stdout.startswith("sessions: 1 imported, 0 already there, 3 damaged")
    errors = [line for line in result.stderr.splitlines() if "sessions [" in line]
    errors = [line for line in errors if "DAMAGED" in line]
    assert len(errors) == 3
    assert any("telegram:middle" in e and "1 unreadable line(s): 3" in e for e in errors)
    assert any("telegram:torn" in e and "last line is cut off" in e for e in errors)
    assert any("telegram:header" in e and "not a session header" in e for e in errors)
    assert "tool outputs: 1 imported, 0 already there, 3 damaged" in result.stdout
    outputs = [line for line in result.stderr.splitlines() if "tool outputs [" in line]
    assert len(outputs) == 4 and "DAMAGED outputs/notes.txt: not at" in outputs[-1]
    for key in ("telegram:middle", "telegram:torn"):
        assert any(f"DAMAGED {key} {handles[key]}: its session" in e for e in outputs)
    assert "Traceback" not in result.stderr
    sessions, entries, stored = dump_rows(migrated_pg_url)
    assert [row[1] for row in sessions] == ["telegram:good"]
    assert len(entries) == 3
    assert [(row[0], row[1]) for row in stored] == [("telegram:good", handles["telegram:good"])]
    assert {p: p.read_bytes() for p in damaged} == damaged  # kept as they were


def test_a_key_a_replica_already_started_is_a_conflict_left_alone(
    migrated_pg_url: str, shared_manager: SessionManager, tmp_path: Path
) -> None:
    shared_manager.get_or_create("telegram:1").add_message(user("from a replica"))
    rows = dump_rows(migrated_pg_url)
    source = tmp_path / "source"
    files = SessionManager(source / "sessions", fsync="never")
    files.get_or_create("telegram:1").add_message(user("from the files"))
    files.close()

    result = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert result.returncode == 1
    assert "CONFLICT telegram:1" in result.stderr
    assert "already has another current session" in result.stderr
    assert dump_rows(migrated_pg_url) == rows


def test_export_never_overwrites_a_different_file(
    migrated_pg_url: str, shared_manager: SessionManager, tmp_path: Path
) -> None:
    shared_manager.get_or_create("telegram:1").add_message(user("hello"))
    target = tmp_path / "out"
    assert storage(["export", str(target)], migrated_pg_url, tmp_path).returncode == 0
    again = storage(["export", str(target)], migrated_pg_url, tmp_path)
    assert again.returncode == 0 and "already exported" in again.stderr

    path = target / "sessions" / (encode_key("telegram:1") + ".jsonl")
    path.write_bytes(b"someone else's file\n")
    clash = storage(["export", str(target)], migrated_pg_url, tmp_path)
    assert clash.returncode == 1 and "it was not overwritten" in clash.stderr
    assert path.read_bytes() == b"someone else's file\n"
    assert os.listdir(path.parent) == [path.name]  # no temp file left behind


def test_a_tool_output_that_differs_is_a_conflict_left_alone_both_ways(
    migrated_pg_url: str, shared_manager: SessionManager, tmp_path: Path
) -> None:
    session = shared_manager.get_or_create("telegram:1")
    session.add_message(user("fetch it"))
    handle = shared_manager.outputs.put("telegram:1", session.session_id, PAGE)
    target = tmp_path / "out"
    assert storage(["export", str(target)], migrated_pg_url, tmp_path).returncode == 0
    (path,) = (target / "sessions" / "outputs").rglob(f"{handle}.txt")
    assert path.read_bytes() == PAGE.encode()
    path.write_bytes(b"edited by hand")
    clash = storage(["export", str(target)], migrated_pg_url, tmp_path)
    assert clash.returncode == 1 and f"CONFLICT telegram:1 {handle}" in clash.stderr
    assert path.read_bytes() == b"edited by hand"
    back = storage(["import", str(target)], migrated_pg_url, tmp_path)
    assert back.returncode == 1 and f"CONFLICT telegram:1 {handle}" in back.stderr
    assert shared_manager.outputs.get("telegram:1", handle) == PAGE  # the row as it was


def test_exported_files_keep_the_last_activity_order(
    migrated_pg_url: str, shared_manager: SessionManager, tmp_path: Path
) -> None:
    for key in ("telegram:old", "telegram:new"):
        shared_manager.get_or_create(key).add_message(user(key))
    assert storage(["export", str(tmp_path / "out")], migrated_pg_url, tmp_path).returncode == 0
    listed = SessionManager(tmp_path / "out" / "sessions").list_sessions()
    assert [info.key for info in listed] == [i.key for i in shared_manager.list_sessions()]
    assert [info.key for info in listed] == ["telegram:new", "telegram:old"]


def test_a_database_without_the_current_schema_is_refused(pg_url: str, tmp_path: Path) -> None:
    source = tmp_path / "source"
    manager = SessionManager(source / "sessions", fsync="never")
    manager.get_or_create("telegram:1").add_message(user("hello"))
    manager.close()
    for direction in ("import", "export"):
        result = storage([direction, str(source)], pg_url, tmp_path)
        assert result.returncode == 1
        assert "run `gateway db migrate` first" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_operator_mistakes_are_one_line(migrated_pg_url: str, tmp_path: Path) -> None:
    missing = storage(["import", str(tmp_path / "nowhere")], migrated_pg_url, tmp_path)
    assert missing.returncode == 2 and "no such folder" in missing.stderr
    manager = SessionManager(tmp_path / "ws2" / "sessions", fsync="never")
    manager.get_or_create("telegram:1").add_message(user("hello"))
    manager.close()
    inner = storage(["import", str(tmp_path / "ws2" / "sessions")], migrated_pg_url, tmp_path)
    assert inner.returncode == 2 and "give the workspace that holds it" in inner.stderr
    no_url = run_gateway(["storage", "import", str(tmp_path)], base_env(tmp_path), tmp_path)
    assert no_url.returncode == 1 and "storage.url is not set" in no_url.stderr
    for result in (missing, inner, no_url):
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_progress_names_each_session_with_its_shape(migrated_pg_url: str, tmp_path: Path) -> None:
    source = file_workspace(tmp_path)
    result = storage(["import", str(source)], migrated_pg_url, tmp_path)
    lines = result.stderr.splitlines()
    assert lines[0] == f"sessions: 6 found in {source / 'sessions'}"
    archived = [line for line in lines if "(archive/" in line]
    assert len(archived) == 2 and all("archived, " in line for line in archived)
    assert json.loads(json.dumps(result.stdout))  # one summary line on stdout
    assert len(result.stdout.strip().splitlines()) == 1


def test_a_crash_while_writing_an_exported_file_leaves_nothing_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway import fsutil

    def power_cut(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsutil.os, "fsync", power_cut)
    target = tmp_path / "session.jsonl"
    with pytest.raises(OSError):
        fsutil.create_exclusive(target, b'{"type":"session_header"}\n')
    # A half-written file under the name would be taken for a conflict by the next run.
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    fsutil.create_exclusive(target, b"x\n")
    with pytest.raises(FileExistsError):
        fsutil.create_exclusive(target, b"y\n")
    assert target.read_bytes() == b"x\n" and os.listdir(tmp_path) == [target.name]
    assert target.stat().st_mode & 0o777 == 0o600


# ----------------------------------------------------------------------------- memory,
# pairing and heartbeat runs

DAY_ONE = datetime(2024, 3, 1, 9, 30, tzinfo=UTC)
DAY_TWO = datetime(2024, 3, 2, 18, 5, 7, tzinfo=UTC)


def state_workspace(tmp_path: Path) -> Path:
    """A file-mode workspace with every kind of state: the sessions of `populate`, every
    shape of memory (facts over two days under a hand-written title and note, history
    rotated into archives plus a hand-written line, knowledge with tags, sources and
    reinforcement, hostile text, the workspace scope), pairing (approvals, a live and an
    expired code), heartbeat runs, usage totals, schedules and people links."""
    source = tmp_path / "source"
    sessions = SessionManager(source / "sessions", fsync="never")
    populate(sessions)
    sessions.close()
    clock = [DAY_ONE]
    store = MemoryStore(source, history_max_bytes=300, clock=lambda: clock[0])
    alice = store.for_session("telegram:1")
    alice.write_memory("# What I know about Alice\n\nShe writes in the evening.\n")
    alice.append_facts([("user_preference", "Likes tea"), ("project_decision", "Use PG")])
    for i in range(12):
        alice.append_history(f"talked about topic {i}")
    alice.knowledge.add("user_preference", "Likes tea", source="chat", tags=["drinks"])
    alice.knowledge.add("user_preference", "likes tea.", tags=["morning"])  # reinforced
    alice.knowledge.add("error_pattern", HOSTILE_TEXT.replace("\x00", ""), source="")
    clock[0] = DAY_TWO
    alice.append_facts([("learned_fact", "Has a cat named Köln")])
    alice.append_to_memory("## Notes\nfree text after a note heading")
    alice.append_facts([("learned_fact", "Moved to Berlin")])
    # Facts with their origin, a corrected one and a forgotten one.
    told = Origin("telegram:1", "a1b2c3d4e5f6")
    alice.record_consolidation([NewFact("user_preference", "Answers in Dutch", told)], "")
    alice.record_consolidation([NewFact("learned_fact", "Forget me: quokka-4711", told)], "")
    dutch, secret = (f for f in alice.list_facts() if f.origin is not None)
    alice.correct_fact(dutch.id, "Answers in Frisian", by="telegram:1 (/correct)")
    alice.forget_fact(secret.id)
    with alice.history_path.open("a") as fh:
        fh.write("a line without a timestamp\n")
    store.for_scope("_workspace").record_consolidation([("system_behavior", "Be brief")], "s")
    store.for_session(HOSTILE_KEY).append_history(HOSTILE_TEXT)
    store.close()
    assert len(alice.history_archives()) >= 2

    pairing = PairingStore(source / "pairing.json", clock=lambda: NOW)
    for sender, code in (("u1", "ABCDEFGH"), ("u2", "BCDEFGHJ")):
        pairing.add_pending(
            PendingRequest("telegram", sender, code, NOW - 10, NOW + 3600, "c" + sender, sender),
            max_pending=5,
        )
    assert pairing.approve("telegram", "ABCDEFGH") == "u1"
    state = pairing.state()
    expired = PendingRequest("slack", "U9", "CDEFGHJK", NOW - 7200, NOW - 3600, "D9", "old")
    pairing._write(replace(state, pending=(*state.pending, expired)))

    runs = HeartbeatState(source / "heartbeat-state.json")
    runs.record("daily", DAY_ONE)
    runs.record("hourly", DAY_TWO.replace(microsecond=123456))

    usage = SqliteUsageLedger(source / "usage.sqlite")
    for row in USAGE_ROWS:
        usage.add(row)
    usage.add(USAGE_ROWS[0])  # totals add up
    usage.close()

    jobs = FileJobStore(source / "schedules.json")
    for job in JOBS:
        assert jobs.add(job, limit=20)

    people = FilePeopleStore(source / "people.json")
    people.link(["telegram:42", "slack:U123"])
    people.link(["telegram:7", "slack:UABC", "telegram:8"])
    people.note_dm("telegram:42", "telegram:42")
    people.note_dm("slack:D1", "slack:U123")
    people.note_dm(HOSTILE_KEY, "slack:U9")
    return source


USAGE_ROWS = (
    UsageRow("2024-03-01", "telegram:1", "telegram", "gpt-4o-mini", "turn", 1, 120, 30, 0.0000375,
             provider="primary"),
    UsageRow("2024-03-01", "telegram:1", "telegram", "cheap", "consolidation", 2, 900, 80, 0.1,
             provider="default"),
    UsageRow("2024-03-02", "system:heartbeat:daily", "system", "gpt-4o-mini", "heartbeat", 1, 50,
             5, 1 / 3, provider="backup"),
    UsageRow("2024-03-02", HOSTILE_KEY, "slack", "modèle-ü", "turn", 3, 7, 0, 0.0),
    UsageRow("2024-03-02", "-", "none", "unknown", "turn", 1, 1, 1, 0.0),
)  # fmt: skip
JOBS = (
    ScheduledJob(
        id="a1b2c3d4", owner="slack:C9:thread:1.5", text="call Ann", timezone="UTC",
        next_run=datetime(2030, 5, 1, 9, 30, tzinfo=UTC), created_at=DAY_ONE,
        address={"channel": "slack", "chat_id": "C9", "sender_id": "U1",
                 "thread_kind": "thread", "thread_id": "1.5"},
    ),
    ScheduledJob(
        id="e5f6a7b8", owner="telegram:1", text=HOSTILE_TEXT.replace("\x00", ""),
        timezone="Europe/Berlin", next_run=datetime(2030, 1, 6, 7, 0, tzinfo=UTC),
        created_at=DAY_TWO, address={"channel": "telegram", "chat_id": "1"},
        cron="0 8 * * mon-fri", runs=2,
    ),
)  # fmt: skip


NOW = 1_900_000_000.0  # pending codes above expire after the tests run


def memory_view(workspace: Path, scope: str) -> tuple[Any, ...]:
    """What the file mode reads of a scope: fact lines, history lines, knowledge."""
    manager = MemoryManager(workspace, scope)
    facts = [line for line, _ in memory_documents(manager.read_memory())]
    history = manager.search_history("", max_results=1000, decay_rate=0)
    knowledge = sorted(manager.knowledge, key=lambda e: e.id)
    categories = {fact: manager.search_memory(fact, 50, "learned_fact") for fact in ("cat",)}
    ids = manager.list_facts()  # ids, origins and corrections
    manager.close()
    return facts, sorted(history), knowledge, categories, ids


def dump_state_rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the memory, pairing, heartbeat, usage, schedules and people tables
    but serial ids and the time a fact line was appended (no file keeps it), in a
    stable order."""
    import psycopg

    queries = {
        "scopes": "SELECT scope, created_at FROM gw_memory_scopes ORDER BY scope",
        "facts": "SELECT scope, day, category, line, tsv::text FROM gw_memory_facts "
        "ORDER BY scope, id",
        "history": "SELECT scope, at, line, tsv::text FROM gw_memory_history ORDER BY scope, id",
        "knowledge": "SELECT scope, id, category, content, source, tags, created_at, "
        "accessed_at, access_count, tsv::text FROM gw_memory_knowledge ORDER BY scope, id",
        "approved": "SELECT * FROM gw_pairing_approved ORDER BY channel, sender_id",
        "pending": "SELECT * FROM gw_pairing_pending ORDER BY channel, sender_id",
        "heartbeat": "SELECT * FROM gw_heartbeat_runs ORDER BY job",
        "usage": "SELECT * FROM gw_usage ORDER BY day, session_key, channel, model, kind, provider",
        "schedules": "SELECT id, owner, next_run, job::text FROM gw_schedules ORDER BY id",
        "people": "SELECT * FROM gw_people ORDER BY sender_id",
        "dms": "SELECT * FROM gw_people_dms ORDER BY session_key",
    }
    with psycopg.connect(url) as conn:
        return {name: conn.execute(sql).fetchall() for name, sql in queries.items()}


EVERY_KIND = (
    ("sessions", 6),
    ("tool outputs", 4),
    ("memory", 3),
    ("pairing", 3),
    ("heartbeat", 2),
    ("usage", 5),
    ("schedules", 2),
    ("people", 5),
)


def test_every_kind_of_state_goes_files_to_postgresql_to_files(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = state_workspace(tmp_path)
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    imported = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert imported.returncode == 0, imported.stderr
    # Only read: not even SQLite's -wal and -shm files appear next to usage.sqlite.
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    assert imported.stdout.strip() == "; ".join(
        f"{kind}: {n} imported, 0 already there, 0 damaged (skipped), "
        "0 conflicting (left as they are)"
        for kind, n in EVERY_KIND
    )
    assert "memory [1/3] imported" in imported.stderr
    assert "pairing [2/3] imported pending telegram:u2" in imported.stderr
    assert "usage [1/5] imported 2024-03-01 telegram:1 consolidation cheap" in imported.stderr
    assert "schedules [2/2] imported e5f6a7b8 (telegram:1)" in imported.stderr
    assert (
        "people [2/5] imported person slack:UABC: linked ids slack:UABC, telegram:7, telegram:8"
        in imported.stderr
    )

    # The shared mode reads what the files held.
    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.people.pg_store import PostgresPeopleStore
    from gateway.plumbing.postgres import sync_pool
    from gateway.schedules.pg_store import PostgresJobStore
    from gateway.usage.pg_store import PostgresUsageLedger

    files_usage = SqliteUsageLedger(source / "usage.sqlite")
    with sync_pool(migrated_pg_url, max_size=1) as pool:
        assert PostgresUsageLedger(pool).rows() == files_usage.rows()
        assert PostgresJobStore(pool).jobs() == FileJobStore(source / "schedules.json").jobs()
        shared_people = PostgresPeopleStore(pool)
        assert shared_people.people() == FilePeopleStore(source / "people.json").people()
        assert shared_people.dm_owner("slack:D1") == "slack:U123"
        shared = PostgresMemoryStore(pool).for_session("telegram:1")
        assert shared.read_memory() == MemoryManager(source, "telegram:1").read_memory().replace(
            "\n\n## Notes", "\n## Notes"
        ).replace("Alice\n\nShe", "Alice\nShe")
        assert shared.search_memory("cat", category="learned_fact") == [
            "- [learned_fact] Has a cat named Köln"
        ]
        assert shared.search_memory("alice") == []  # a title is no fact
        assert "a line without a timestamp" in shared.search_history("timestamp")[0]
        # Fact ids, origins and corrections are the same in both modes.
        facts = MemoryManager(source, "telegram:1").list_facts()
        assert shared.list_facts() == facts
        assert [(f.text, f.origin, f.correction is not None) for f in facts if f.origin] == [
            ("Answers in Frisian", Origin("telegram:1", "a1b2c3d4e5f6"), True)
        ]
        assert shared.search_memory("frisian") == ["- [user_preference] Answers in Frisian"]

    back = tmp_path / "back"
    exported = storage(["export", str(back)], migrated_pg_url, tmp_path)
    assert exported.returncode == 0, exported.stderr
    # A word no random id or timestamp holds (four digits did: a pairing file's).
    assert b"quokka" not in b"".join(p.read_bytes() for p in back.rglob("*") if p.is_file())
    for scope in ("telegram:1", "_workspace"):
        assert memory_view(back, scope) == memory_view(source, scope), scope
    # PostgreSQL text holds no NUL: it becomes U+FFFD, as in every shared-mode write.
    hostile = memory_view(source, HOSTILE_KEY)[1]
    assert memory_view(back, HOSTILE_KEY)[1] == [h.replace("\x00", "\ufffd") for h in hostile]
    pairs = [PairingStore(w / "pairing.json").state() for w in (source, back)]
    assert pairs[0].approved == pairs[1].approved
    assert sorted(pairs[0].pending, key=repr) == sorted(pairs[1].pending, key=repr)
    for name in ("heartbeat-state.json", "schedules.json", "people.json"):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name
    assert HeartbeatState(back / "heartbeat-state.json").last_run("daily") == DAY_ONE
    assert session_files(back) == session_files(source)
    back_usage = SqliteUsageLedger(back / "usage.sqlite")
    assert back_usage.rows() == files_usage.rows() and len(files_usage.rows()) == 5
    assert back_usage.tokens("2024-03-01", "telegram:1") == 2 * 150  # budgets read it alike
    back_usage.close()
    files_usage.close()
    assert (back / "usage.sqlite").stat().st_mode & 0o777 == 0o600
    assert FileJobStore(back / "schedules.json").jobs() == sorted(JOBS, key=lambda j: j.next_run)


def test_every_kind_of_state_goes_postgresql_to_files_to_postgresql(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    import psycopg

    from gateway.access.pg_store import PostgresPairingStore
    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.people.pg_store import PostgresPeopleStore
    from gateway.plumbing.postgres import sync_pool
    from gateway.schedules.pg_store import PostgresJobStore
    from gateway.usage.pg_store import PostgresUsageLedger

    clock = [DAY_ONE]
    with sync_pool(migrated_pg_url, max_size=1) as pool:
        memory = PostgresMemoryStore(pool, clock=lambda: clock[0])
        scope = memory.for_session("slack:C1")
        scope.record_consolidation([("user_preference", "Short answers")], "first talk")
        clock[0] = DAY_TWO
        scope.record_consolidation([("learned_fact", "Uses Köln time")], "second talk")
        scope.knowledge.add("learned_fact", "uses köln time", tags=["tz"], source="x")
        scope.knowledge.search("time")  # counts as an access
        told = Origin("slack:C1", "0a0b0c0d0e0f")
        scope.record_consolidation([NewFact("project_decision", "Ship on Friday", told)], "")
        (friday,) = (f for f in scope.list_facts() if f.origin is not None)
        scope.correct_fact(friday.id, "Ship on Monday", by="operator")
        memory.for_session(HOSTILE_KEY).append_facts([("learned_fact", HOSTILE_TEXT)])
        pairing = PostgresPairingStore(pool, where="test", clock=lambda: NOW)
        pairing.add_pending(
            PendingRequest("telegram", "7", "ABCDEFGH", NOW, NOW + 60, "7", "Bo"), max_pending=3
        )
        pairing.add_pending(
            PendingRequest("telegram", "8", "BCDEFGHJ", NOW, NOW + 60, "8", ""), max_pending=3
        )
        pairing.approve("telegram", "ABCDEFGH")
        usage = PostgresUsageLedger(pool)
        for row in (*USAGE_ROWS, USAGE_ROWS[2]):
            usage.add(row)
        jobs = PostgresJobStore(pool)
        for job in JOBS:
            assert jobs.add(job, limit=20)
        assert jobs.advance(JOBS[1].id, JOBS[1].next_run, datetime(2030, 1, 7, 7, tzinfo=UTC))
        people = PostgresPeopleStore(pool)
        people.link(["telegram:42", "slack:U123", "telegram:43"])
        people.note_dm("telegram:42", "telegram:42")
        people.note_dm(HOSTILE_KEY, "telegram:43")
    with psycopg.connect(migrated_pg_url) as conn:
        conn.execute(
            "INSERT INTO gw_heartbeat_runs VALUES ('daily', %s), ('x', %s)",
            (DAY_ONE, DAY_TWO.replace(microsecond=5)),
        )
    rows = dump_state_rows(migrated_pg_url)
    counted = ("scopes", "approved", "pending", "heartbeat", "usage", "schedules", "people", "dms")
    assert [len(rows[t]) for t in counted] == [2, 1, 1, 2, 5, 2, 3, 2]

    files = tmp_path / "files"
    exported = storage(["export", str(files)], migrated_pg_url, tmp_path)
    assert exported.returncode == 0, exported.stderr
    with psycopg.connect(migrated_pg_url) as conn:
        for table in (
            "gw_memory_scopes",
            "gw_pairing_approved",
            "gw_pairing_pending",
            "gw_heartbeat_runs",
            "gw_usage",
            "gw_schedules",
            "gw_people",
            "gw_people_dms",
        ):
            conn.execute(f"DELETE FROM {table}")
    imported = storage(["import", str(files)], migrated_pg_url, tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert dump_state_rows(migrated_pg_url) == rows

    again = storage(["export", str(files)], migrated_pg_url, tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count(" 0 exported") == 8 and "already exported" in again.stderr


def test_a_second_state_import_skips_and_a_replicas_writes_are_left_alone(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    import psycopg

    source = state_workspace(tmp_path)
    assert storage(["import", str(source)], migrated_pg_url, tmp_path).returncode == 0
    rows = dump_state_rows(migrated_pg_url)
    again = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "memory: 0 imported, 3 already there" in again.stdout
    assert "pairing: 0 imported, 3 already there" in again.stdout
    assert "heartbeat: 0 imported, 2 already there" in again.stdout
    assert "usage: 0 imported, 5 already there" in again.stdout
    assert "schedules: 0 imported, 2 already there" in again.stdout
    assert "people: 0 imported, 5 already there" in again.stdout
    assert dump_state_rows(migrated_pg_url) == rows

    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.people.pg_store import PostgresPeopleStore
    from gateway.plumbing.postgres import sync_pool
    from gateway.schedules.pg_store import PostgresJobStore
    from gateway.usage.pg_store import PostgresUsageLedger

    # What replicas do after an import: counters grow, a task runs, a link is added.
    with sync_pool(migrated_pg_url, max_size=1) as pool:
        PostgresMemoryStore(pool).for_session("telegram:1").append_history("later, shared")
        PostgresUsageLedger(pool).add(USAGE_ROWS[1])
        cron = JOBS[1]
        assert PostgresJobStore(pool).advance(
            cron.id, cron.next_run, datetime(2030, 2, 1, tzinfo=UTC)
        )
        PostgresPeopleStore(pool).link(["telegram:42", "telegram:99"])
    with psycopg.connect(migrated_pg_url) as conn:
        conn.execute("UPDATE gw_heartbeat_runs SET last_run = last_run + interval '1 hour'")
        conn.execute("UPDATE gw_pairing_approved SET label = 'renamed'")
        conn.execute(
            "UPDATE gw_people_dms SET sender_id = 'slack:U7' WHERE session_key = 'slack:D1'"
        )
        conn.execute("UPDATE gw_usage SET calls = 0 WHERE model = 'unknown'")
        conn.execute(
            "UPDATE gw_schedules SET job = jsonb_set(job, '{text}', '\"other\"') "
            "WHERE id = 'a1b2c3d4'"
        )
    rows = dump_state_rows(migrated_pg_url)
    third = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert "the database has 1 history lines more" in third.stderr
    assert "the database has a later run" in third.stderr
    assert third.returncode == 1 and "CONFLICT approved telegram:u1" in third.stderr
    assert "the database has counted 2 more calls since; nothing added" in third.stderr
    assert "skipped e5f6a7b8 (telegram:1): the database has run it 1 more times" in third.stderr
    assert "skipped person slack:U123: already imported; the database links 1 more" in third.stderr
    assert "CONFLICT dm slack:D1: the database has it as slack:U7's" in third.stderr
    assert (
        "CONFLICT 2024-03-02 - (none) turn unknown: the database has other totals" in third.stderr
    )
    assert "CONFLICT a1b2c3d4 (slack:C9:thread:1.5): the database has another job" in third.stderr
    assert "usage: 0 imported, 4 already there, 0 damaged (skipped), 1 conflicting" in third.stdout
    assert dump_state_rows(migrated_pg_url) == rows

    # A person linked otherwise in the database: the whole person is a conflict.
    with sync_pool(migrated_pg_url, max_size=1) as pool:
        PostgresPeopleStore(pool).unlink("telegram:7")
    rows = dump_state_rows(migrated_pg_url)
    fifth = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert "CONFLICT person slack:UABC: the database links these ids otherwise" in fifth.stderr
    assert dump_state_rows(migrated_pg_url) == rows

    # A scope a replica wrote to before the import: a conflict, nothing merged.
    with psycopg.connect(migrated_pg_url) as conn:
        conn.execute("DELETE FROM gw_memory_scopes WHERE scope = '_workspace'")
    with sync_pool(migrated_pg_url, max_size=1) as pool:
        PostgresMemoryStore(pool).for_scope("_workspace").append_history("replica first")
    rows = dump_state_rows(migrated_pg_url)
    fourth = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert "CONFLICT _workspace" in fourth.stderr and "nothing changed" in fourth.stderr
    assert dump_state_rows(migrated_pg_url) == rows


def test_damaged_state_files_are_reported_and_skipped_whole(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = state_workspace(tmp_path)
    scope = source / "memory" / encode_key("telegram:1")
    log = scope / "knowledge.json.log"
    log.write_bytes(log.read_bytes() + b"{not json\n")
    hostile = source / "memory" / encode_key(HOSTILE_KEY) / "HISTORY.md"
    hostile.write_bytes(hostile.read_bytes() + b"\xff\xfe not text\n")
    (source / "pairing.json").write_text('{"version": 1, "approved": [{"channel": 1}]}')
    (source / "heartbeat-state.json").write_text('{"daily": "2024-03-01T09:30:00"}')
    usage = source / "usage.sqlite"
    usage.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    jobs = json.loads((source / "schedules.json").read_text())
    del jobs["jobs"][1]["owner"]
    (source / "schedules.json").write_text(json.dumps(jobs))
    (source / "people.json").write_text('{"links": {"telegram:1": 1}, "dms": {}}')
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}

    result = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert result.returncode == 1
    damaged = [line for line in result.stderr.splitlines() if "DAMAGED" in line]
    assert len(damaged) == 7, result.stderr
    assert any("usage.sqlite cannot be read" in d for d in damaged)
    assert any(
        "schedules.json" in d and "job 2 is unreadable (KeyError: 'owner')" in d for d in damaged
    )
    assert any("people.json" in d and "1 unreadable links entries" in d for d in damaged)
    assert all(d.endswith("the file stays as it is") for d in damaged[-3:])
    assert any("telegram:1" in d and "knowledge.json.log: line " in d for d in damaged)
    assert any("HISTORY.md line 2 is not UTF-8" in d for d in damaged)
    assert any("pairing.json" in d and "1 unreadable entries" in d for d in damaged)
    assert any("heartbeat-state.json" in d and "no time zone" in d for d in damaged)
    assert "Traceback" not in result.stderr
    rows = dump_state_rows(migrated_pg_url)
    assert [r[0] for r in rows["scopes"]] == ["_workspace"]
    assert {r[0] for r in rows["facts"]} == {"_workspace"}  # nothing of the damaged scopes
    assert not rows["approved"] and not rows["pending"] and not rows["heartbeat"]
    assert not rows["usage"] and not rows["schedules"] and not rows["people"] and not rows["dms"]
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before


def test_export_never_overwrites_state_that_differs(migrated_pg_url: str, tmp_path: Path) -> None:
    source = state_workspace(tmp_path)
    assert storage(["import", str(source)], migrated_pg_url, tmp_path).returncode == 0
    target = tmp_path / "out"
    folder = target / "memory" / encode_key("telegram:1")
    folder.mkdir(parents=True)
    (folder / "MEMORY.md").write_text("- [learned_fact] someone else's\n")
    (target / "pairing.json").write_text('{"version": 1, "approved": [], "pending": []}')
    theirs = SqliteUsageLedger(target / "usage.sqlite")
    theirs.add(USAGE_ROWS[2])  # the same as in the database
    theirs.add(replace(USAGE_ROWS[3], calls=1))  # another total
    theirs.close()
    FileJobStore(target / "schedules.json").add(JOBS[0], limit=20)
    FilePeopleStore(target / "people.json").link(["telegram:42", "slack:U123"])
    mine = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}

    result = storage(["export", str(target)], migrated_pg_url, tmp_path)
    assert result.returncode == 1
    assert "CONFLICT telegram:1" in result.stderr and "it was not overwritten" in result.stderr
    assert result.stderr.count("pairing.json is there without it") == 3
    assert result.stderr.count("usage.sqlite is there without it") == 4
    assert "usage: 0 exported, 1 already there, 0 damaged (skipped), 4 conflicting" in result.stdout
    assert "schedules: 0 exported, 1 already there, 0 damaged (skipped), 1 conflicting" in (
        result.stdout
    )
    assert "people: 0 exported, 1 already there, 0 damaged (skipped), 4 conflicting" in (
        result.stdout
    )
    assert {p: p.read_bytes() for p in mine} == mine
    assert not list((target / "memory").glob(".export-*"))  # nothing left half-built
    assert memory_view(target, "_workspace") == memory_view(source, "_workspace")


def test_usage_still_in_the_write_ahead_log_is_imported(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    ledger = SqliteUsageLedger(source / "usage.sqlite")
    try:
        for row in USAGE_ROWS:
            ledger.add(row)
        # Not closed (a gateway that was killed): the totals are in usage.sqlite-wal only.
        assert (source / "usage.sqlite-wal").stat().st_size > 0
        result = storage(["import", str(source)], migrated_pg_url, tmp_path)
    finally:
        ledger.close()
    assert result.returncode == 0, result.stderr
    assert "usage: 5 imported, 0 already there" in result.stdout
    assert dump_state_rows(migrated_pg_url)["usage"] == sorted(
        (r.day, r.session_key, r.channel, r.model, r.kind, r.calls, r.prompt_tokens,
         r.completion_tokens, r.cost, r.provider)
        for r in USAGE_ROWS
    )  # fmt: skip


def test_a_usage_ledger_of_an_older_version_is_imported_and_exported_with_its_totals(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    """A usage.sqlite written before providers were counted (no provider column) is
    read as it is, its totals under provider "" (and the file is left untouched); the
    export writes today's ledger with the same totals."""
    from tests.test_usage import write_old_ledger

    source = tmp_path / "source"
    write_old_ledger(source / "usage.sqlite")
    before = (source / "usage.sqlite").read_bytes()
    imported = storage(["import", str(source)], migrated_pg_url, tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert "usage: 1 imported" in imported.stdout
    assert (source / "usage.sqlite").read_bytes() == before
    assert dump_state_rows(migrated_pg_url)["usage"] == [
        ("2026-11-20", "telegram:1", "telegram", "m", "turn", 4, 400, 40, 0.5, "")
    ]
    back = tmp_path / "back"
    exported = storage(["export", str(back)], migrated_pg_url, tmp_path)
    assert exported.returncode == 0, exported.stderr
    ledger = SqliteUsageLedger(back / "usage.sqlite")
    try:
        assert ledger.rows() == [
            UsageRow("2026-11-20", "telegram:1", "telegram", "m", "turn", 4, 400, 40, 0.5)
        ]
    finally:
        ledger.close()
