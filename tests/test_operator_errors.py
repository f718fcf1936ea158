"""Errors an operator meets, as a subprocess shows them: one line that names the path
or key and the fix, a fitting exit code, never a traceback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.test_cli_e2e import base_env, run_gateway
from tests.unwritable import unprivileged

EX_CONFIG = 78

# Every command that touches the workspace, each with arguments it accepts.
COMMANDS = [
    ["run"],
    ["chat", "-m", "hi"],
    ["chat"],
    ["sessions", "list"],
    ["sessions", "show", "cli:direct"],
    ["memory", "show", "cli:direct"],
    ["memory", "compact", "cli:direct"],
    ["cache", "stats"],
    ["pairing", "list"],
]


def llm_env(tmp_path: Path, fake: FakeOpenAI) -> dict[str, str]:
    return base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake.base_url,
        "OPENAI_API_KEY": fake.api_key or "",
        "GATEWAY_HTTP__PORT": "0",
    }


def assert_one_line(stderr: str, *parts: str) -> None:
    assert "Traceback" not in stderr, stderr
    [line] = stderr.strip().splitlines()
    for part in parts:
        assert part in line, line


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_unwritable_workspace_is_one_line_and_exit_78(
    tmp_path: Path, fake_openai_thread: FakeOpenAI, command: list[str]
) -> None:
    prefix = unprivileged()
    ws = tmp_path / "ws"
    ws.mkdir()
    ws.chmod(0o500)  # an existing workspace this user cannot write in
    try:
        out = run_gateway(command, llm_env(tmp_path, fake_openai_thread), tmp_path, prefix=prefix)
    finally:
        ws.chmod(0o700)
    assert out.returncode == EX_CONFIG, out.stderr
    assert_one_line(out.stderr, f"cannot write in {ws} (Permission denied)", f"chmod u+rwx {ws}")
    assert "--workspace" in out.stderr


def test_an_unwritable_sessions_folder_is_named(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    prefix = unprivileged()
    sessions = tmp_path / "ws" / "sessions"
    sessions.mkdir(parents=True, mode=0o700)
    sessions.chmod(0o500)
    try:
        out = run_gateway(
            ["sessions", "list"], llm_env(tmp_path, fake_openai_thread), tmp_path, prefix=prefix
        )
    finally:
        sessions.chmod(0o700)
    assert out.returncode == EX_CONFIG
    assert_one_line(out.stderr, f"cannot write in {sessions} (Permission denied)")


def test_a_workspace_that_cannot_be_created_is_one_line(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    prefix = unprivileged()
    parent = tmp_path / "locked"
    parent.mkdir(mode=0o500)
    env = llm_env(tmp_path, fake_openai_thread) | {"GATEWAY_WORKSPACE": str(parent / "ws")}
    try:
        out = run_gateway(["chat", "-m", "hi"], env, tmp_path, prefix=prefix)
    finally:
        parent.chmod(0o700)
    assert out.returncode == EX_CONFIG
    assert_one_line(out.stderr, f"cannot write in {parent} (Permission denied)")
    assert not (parent / "ws").exists()


def test_a_writable_workspace_still_works_under_the_same_wrapper(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    """The wrapper the tests above use does not by itself break the gateway."""
    out = run_gateway(
        ["chat", "-m", "hi"], llm_env(tmp_path, fake_openai_thread), tmp_path, prefix=unprivileged()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "echo: hi"
    assert stat.S_IMODE(os.stat(tmp_path / "ws").st_mode) == 0o700


def test_init_where_it_cannot_write_is_one_line(tmp_path: Path) -> None:
    prefix = unprivileged()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        out = run_gateway(
            ["init", "locked/sub/g.toml"], base_env(tmp_path), tmp_path, prefix=prefix
        )
    finally:
        locked.chmod(0o700)
    assert out.returncode == 73
    assert_one_line(out.stderr, "cannot write locked/sub (Permission denied)")


def test_a_misspelt_variable_is_warned_about_with_the_closest_key(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread) | {"GATEWAY_HTTP_PORT": "9000"}
    out = run_gateway(["sessions", "list"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "GATEWAY_HTTP_PORT is not a setting and is ignored; did you mean GATEWAY_HTTP__PORT?"
        in (out.stderr)
    )
    checked = run_gateway(["doctor"], env, tmp_path)
    assert "warn  GATEWAY_HTTP_PORT is not a setting" in checked.stdout


def test_a_quoted_boolean_in_the_config_is_refused(tmp_path: Path) -> None:
    # [memory], which `sessions list` reads: it checks no section it does not read
    # (tests/test_startup_imports.py).
    (tmp_path / "gateway.toml").write_text('[memory]\nenabled = "yes"\n')
    out = run_gateway(["sessions", "list"], base_env(tmp_path), tmp_path)
    assert out.returncode == EX_CONFIG
    assert_one_line(out.stderr, "memory.enabled: expected true or false, got 'yes'")


def test_memory_commands_for_an_unknown_key_create_nothing(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    ws = tmp_path / "ws"
    ws.mkdir(mode=0o700)
    for args, said in [
        (["show", "nope"], "no remembered facts for cli:nope yet"),
        (["search", "nope", "tea"], "no matching facts"),
        (["history", "nope", "tea"], "no matching history"),
        (["knowledge", "nope"], "the knowledge base is empty"),
    ]:
        out = run_gateway(["memory", *args], env, tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == said
    assert os.listdir(ws) == []  # no memory/nope, not even memory/


def test_memory_compact_that_fails_says_so_once_and_promises_no_retry(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread) | {
        "GATEWAY_AGENT__MEMORY_WINDOW": "2",
        "GATEWAY_MEMORY__AUTO_CONSOLIDATE": "false",
        "GATEWAY_LLM__MAX_RETRIES": "0",
    }
    for text in ("I like green tea", "The launch is on Friday", "Remind me later"):
        assert run_gateway(["chat", "-m", text], env, tmp_path).returncode == 0
    fake_openai_thread.fail_model("gpt-4o-mini", status=500)
    out = run_gateway(["memory", "compact", "cli:direct"], env, tmp_path)
    assert out.returncode == 1
    assert out.stdout == ""
    assert_one_line(out.stderr, "gateway: compacting cli:direct failed, nothing was lost")
    assert "retry" not in out.stderr.lower()
    shown = run_gateway(["sessions", "show", "cli:direct"], env, tmp_path)
    assert "[user] I like green tea" in shown.stdout  # history kept


def test_pairing_refuses_an_unknown_channel(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    for args in (["approve", "foo", "CODE"], ["list", "foo"], ["revoke", "foo", "123"]):
        out = run_gateway(["pairing", *args], env, tmp_path)
        assert out.returncode == 2, out.stderr
        assert_one_line(
            out.stderr,
            "unknown channel 'foo'; pairing is for discord, email, matrix, mattermost, qq, slack, "
            "telegram or whatsapp",
        )
    known = run_gateway(["pairing", "approve", "telegram", "CODE"], env, tmp_path)
    assert known.returncode == 1 and "no pending request on telegram" in known.stderr
