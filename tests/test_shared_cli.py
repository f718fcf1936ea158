"""The shared mode from the command line: `gateway db`, and conversations kept in
PostgreSQL instead of workspace files, as an operator runs them (subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.fakes.openai_server import FakeOpenAI
from tests.test_cli_e2e import base_env, run_gateway


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
