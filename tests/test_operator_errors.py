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
    (tmp_path / "gateway.toml").write_text('[cache]\nenabled = "yes"\n')
    out = run_gateway(["sessions", "list"], base_env(tmp_path), tmp_path)
    assert out.returncode == EX_CONFIG
    assert_one_line(out.stderr, "cache.enabled: expected true or false, got 'yes'")
