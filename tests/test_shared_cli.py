"""The shared mode from the command line: `gateway db`, and conversations kept in
PostgreSQL instead of workspace files, as an operator runs them (subprocesses)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg

from tests.fakes.openai_server import FakeOpenAI
from tests.test_cli_e2e import base_env, run_gateway
from tests.test_memory_e2e import consolidating_responder


def test_db_status_then_migrate_then_current(pg_url: str, tmp_path: Path) -> None:
    env = base_env(tmp_path) | {"GATEWAY_STORAGE__URL": pg_url}
    before = run_gateway(["db", "status", "--json"], env, tmp_path)
    assert before.returncode == 3, before.stderr
    status = json.loads(before.stdout)
    assert status["applied"] == [] and status["pending"][0]["version"] == 1

    applied = run_gateway(["db", "migrate"], env, tmp_path)
    assert applied.returncode == 0, applied.stderr
    assert "applied 0001_sessions" in applied.stdout

    after = run_gateway(["db", "status"], env, tmp_path)
    assert after.returncode == 0 and "schema is current" in after.stdout
    again = run_gateway(["db", "migrate"], env, tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_db_without_a_url_or_server_is_one_clear_line(tmp_path: Path) -> None:
    files = run_gateway(["db", "status"], base_env(tmp_path), tmp_path)
    assert files.returncode == 1 and "storage.url is not set" in files.stderr
    env = base_env(tmp_path) | {"GATEWAY_STORAGE__URL": "postgresql://u:sekrit@127.0.0.1:1/x"}
    down = run_gateway(["db", "migrate"], env, tmp_path)
    assert down.returncode == 69
    assert "not reachable" in down.stderr and "sekrit" not in down.stderr
    assert "Traceback" not in down.stderr and len(down.stderr.strip().splitlines()) == 1


def test_a_password_in_gateway_toml_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gateway.toml").write_text('[storage]\nurl = "postgresql://u:pw@h/db"\n')
    result = run_gateway(["sessions", "list"], base_env(tmp_path), tmp_path)
    assert result.returncode == 78
    assert "GATEWAY_STORAGE__URL" in result.stderr and "pw@" not in result.stderr


def test_chat_turns_live_in_postgresql_not_in_files(
    pg_url: str, tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = base_env(tmp_path) | {
        "GATEWAY_STORAGE__URL": pg_url,
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
    }
    first = run_gateway(["chat", "-m", "my favourite colour is teal"], env, tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_gateway(["chat", "-m", "what is my favourite colour?"], env, tmp_path)
    assert second.returncode == 0, second.stderr
    contents = [m.get("content") for m in fake_openai_thread.chat_requests[-1].messages]
    assert "echo: my favourite colour is teal" in contents  # the first turn, from PostgreSQL

    assert not list((tmp_path / "ws" / "sessions").glob("*.jsonl"))
    listing = run_gateway(["sessions", "list", "--json"], env, tmp_path)
    assert [s["key"] for s in json.loads(listing.stdout)] == ["cli:direct"]
    exported = run_gateway(["sessions", "export", "cli:direct"], env, tmp_path)
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    assert lines[0]["type"] == "session_header" and lines[0]["key"] == "cli:direct"
    said = [e["message"]["content"] for e in lines[1:] if e["type"] == "message"]
    assert said[:2] == ["my favourite colour is teal", "echo: my favourite colour is teal"]
    assert len(said) == 4


def test_memory_lives_in_postgresql_and_the_cli_searches_it(
    pg_url: str, tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.responder = consolidating_responder
    env = base_env(tmp_path) | {
        "GATEWAY_STORAGE__URL": pg_url,
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_AGENT__MEMORY_WINDOW": "1",  # the second turn triggers a consolidation
    }
    for text in ("I like green tea", "The launch is on Friday"):
        turn = run_gateway(["chat", "-m", text], env, tmp_path)
        assert turn.returncode == 0, turn.stderr
    assert any(r.body.get("tool_choice") for r in fake_openai_thread.chat_requests)

    found = run_gateway(["memory", "search", "cli:direct", "green tea"], env, tmp_path)
    assert found.returncode == 0, found.stderr
    assert "- [user_preference] prefers green tea" in found.stdout
    shown = run_gateway(["memory", "show", "cli:direct"], env, tmp_path)
    assert shown.stdout.startswith("### Consolidated ")
    history = run_gateway(["memory", "history", "cli:direct", "launch"], env, tmp_path)
    assert "Tea and the Friday launch came up again" in history.stdout
    knowledge = run_gateway(["memory", "knowledge", "cli:direct"], env, tmp_path)
    assert "[project_decision] the launch is on Friday" in knowledge.stdout
    said = run_gateway(["memory", "search", "cli:direct", "launch", "--messages"], env, tmp_path)
    assert said.returncode == 0, said.stderr
    assert "cli:direct, user, entry " in said.stdout and "The launch is on Friday" in said.stdout
    other = run_gateway(["memory", "search", "cli:other", "tea"], env, tmp_path)
    assert other.returncode == 0 and "no matching facts" in other.stdout

    workspace = tmp_path / "ws"
    assert not (workspace / "memory").exists() or not any((workspace / "memory").rglob("*"))
    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT count(*) FROM gw_memory_facts").fetchone()
        assert row is not None and row[0] >= 2
        done = conn.execute("SELECT session_key FROM gw_consolidations").fetchall()
        assert done == [("cli:direct",)]


def test_pairing_approved_from_the_cli_is_in_postgresql(pg_url: str, tmp_path: Path) -> None:
    from gateway.access.pg_store import PostgresPairingStore
    from gateway.access.protocol import PendingRequest
    from gateway.plumbing.postgres import sync_pool

    env = base_env(tmp_path) | {"GATEWAY_STORAGE__URL": pg_url}
    assert run_gateway(["db", "migrate"], env, tmp_path).returncode == 0
    pool = sync_pool(pg_url, max_size=1)
    pool.open()
    try:
        replica = PostgresPairingStore(pool, where="test")
        now = time.time()
        replica.add_pending(
            PendingRequest("telegram", "42", "ABCD2345", now, now + 600, label="Ada"),
            max_pending=10,
        )
        listing = run_gateway(["pairing", "list"], env, tmp_path)
        assert "42 (Ada)  code ABCD2345" in listing.stdout, listing.stderr
        approved = run_gateway(["pairing", "approve", "telegram", "abcd-2345"], env, tmp_path)
        assert approved.returncode == 0 and "Approved 42 (Ada)" in approved.stdout
        assert replica.is_approved("telegram", "42")
        again = run_gateway(["pairing", "approve", "telegram", "ABCD2345"], env, tmp_path)
        assert again.returncode == 1 and "no pending request" in again.stderr
    finally:
        pool.close()
    assert not (tmp_path / "ws" / "pairing.json").exists()
