"""The `gateway` command as a user runs it: a subprocess against the fake OpenAI server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import base_env as gateway_env

ROOT = Path(__file__).resolve().parents[1]


def run_gateway(
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    stdin: str | None = None,
    *,
    prefix: Sequence[str] = (),
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`gateway ARGS` as a subprocess; `prefix` runs it through a wrapper (e.g. setpriv)."""
    return subprocess.run(
        [*prefix, sys.executable, "-m", "gateway.cli", *args],
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    env["GATEWAY_WORKSPACE"] = str(tmp_path / "ws")
    env["PYTHONPATH"] = str(ROOT)
    return env


def llm_env(tmp_path: Path, fake: FakeOpenAI) -> dict[str, str]:
    """`base_env` pointing at the fake OpenAI server."""
    return base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake.base_url,
        "OPENAI_API_KEY": fake.api_key or "",
    }


def test_one_shot_chat_twice_carries_the_first_turn(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    first = run_gateway(["chat", "-m", "my favourite colour is teal"], env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "echo: my favourite colour is teal"

    second = run_gateway(["chat", "-m", "what is my favourite colour?"], env, tmp_path)
    assert second.returncode == 0, second.stderr
    sent = fake_openai_thread.chat_requests[-1].messages
    contents = [m.get("content") for m in sent]
    assert "my favourite colour is teal" in contents
    assert "echo: my favourite colour is teal" in contents

    listing = run_gateway(["sessions", "list", "--json"], env, tmp_path)
    assert [s["key"] for s in json.loads(listing.stdout)] == ["cli:direct"]
    shown = run_gateway(["sessions", "show", "cli:direct"], env, tmp_path)
    assert "[user] what is my favourite colour?" in shown.stdout
    tree = run_gateway(["sessions", "tree", "cli:direct"], env, tmp_path)
    assert tree.returncode == 0 and "<- leaf" in tree.stdout
    exported = run_gateway(["sessions", "export", "cli:direct"], env, tmp_path)
    lines = [json.loads(x) for x in exported.stdout.splitlines()]
    assert lines[0]["type"] == "session_header" and len(lines) == 5

    forked = run_gateway(["sessions", "fork", "cli:direct"], env, tmp_path)
    assert forked.returncode == 0, forked.stderr
    new_key = forked.stdout.strip()
    third = run_gateway(["chat", "--session", new_key, "-m", "and now?"], env, tmp_path)
    assert third.returncode == 0, third.stderr
    assert "my favourite colour is teal" in [
        m.get("content") for m in fake_openai_thread.chat_requests[-1].messages
    ]

    no_entry = run_gateway(["sessions", "fork", "cli:direct", "--at", "nope"], env, tmp_path)
    assert no_entry.returncode == 1 and "no entry 'nope'" in no_entry.stderr
    taken = run_gateway(["sessions", "fork", "cli:direct", "--as", new_key], env, tmp_path)
    assert taken.returncode == 1 and "already exists" in taken.stderr
    assert "Traceback" not in no_entry.stderr + taken.stderr

    deleted = run_gateway(["sessions", "delete", new_key, "--yes"], env, tmp_path)
    assert deleted.returncode == 0
    missing = run_gateway(["sessions", "show", new_key], env, tmp_path)
    assert missing.returncode == 1 and "no session" in missing.stderr


def test_one_shot_chat_is_quiet_unless_asked(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    quiet = run_gateway(["chat", "-m", "hello"], env, tmp_path)
    assert quiet.returncode == 0 and quiet.stdout == "echo: hello\n"
    assert quiet.stderr == ""
    for verbose in (["-v", "chat", "-m", "hello"], ["chat", "-m", "hello", "--verbose"]):
        chatty = run_gateway(verbose, env, tmp_path)
        assert chatty.returncode == 0 and chatty.stdout == "echo: hello\n"
        assert "INFO" in chatty.stderr and "turn done" in chatty.stderr
    # Warnings still show without -v.
    refused = run_gateway(
        ["chat", "-m", "x" * 50], env | {"GATEWAY_AGENT__MAX_MESSAGE_CHARS": "10"}, tmp_path
    )
    assert refused.returncode == 1
    assert "WARNING" in refused.stderr and "message refused" in refused.stderr


def test_interactive_chat_reads_lines_until_eof(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    out = run_gateway(["chat", "--session", "work"], env, tmp_path, stdin="hello\n/status\n")
    assert out.returncode == 0, out.stderr
    assert "bot> echo: hello" in out.stdout
    assert "Session: cli:work" in out.stdout


def test_global_options_after_the_subcommand(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = gateway_env(tmp_path / "ws", fake_openai_thread)
    out = run_gateway(
        ["chat", "-m", "hi", "--model", "other-model", "--workspace", str(tmp_path / "w2")],
        env,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert fake_openai_thread.last_request.model == "other-model"
    listing = run_gateway(["sessions", "list", "--workspace", str(tmp_path / "w2")], env, tmp_path)
    assert listing.stdout.startswith("cli:direct")


def test_a_short_session_name_means_the_same_session_everywhere(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = gateway_env(tmp_path / "ws", fake_openai_thread)
    assert run_gateway(["chat", "--session", "branchy", "-m", "hi"], env, tmp_path).returncode == 0
    shown = run_gateway(["sessions", "show", "branchy"], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "[user] hi" in shown.stdout
    assert run_gateway(["sessions", "tree", "branchy"], env, tmp_path).returncode == 0
    forked = run_gateway(["sessions", "fork", "branchy", "--as", "twig"], env, tmp_path)
    assert forked.stdout.strip() == "cli:twig"
    assert "[user] hi" in run_gateway(["sessions", "show", "cli:twig"], env, tmp_path).stdout
    memory = run_gateway(["memory", "show", "branchy"], env, tmp_path)
    assert memory.returncode == 0 and "cli:branchy" in memory.stdout

    # A full key of any channel still works, and the config takes names too.
    run_gateway(["chat", "--session", "telegram:123", "-m", "yo"], env, tmp_path)
    assert "[user] yo" in run_gateway(["sessions", "show", "telegram:123"], env, tmp_path).stdout
    configured = env | {"GATEWAY_CHANNELS__CLI__SESSION": "twig"}
    run_gateway(["chat", "-m", "again"], configured, tmp_path)
    assert "[user] again" in run_gateway(["sessions", "show", "twig"], env, tmp_path).stdout


def test_sessions_archived_by_new_can_be_listed_and_shown(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = gateway_env(tmp_path / "ws", fake_openai_thread)
    chat = run_gateway(["chat", "--session", "w"], env, tmp_path, stdin="old topic\n/new\nnew\n")
    assert chat.returncode == 0, chat.stderr

    plain = run_gateway(["sessions", "list"], env, tmp_path)
    assert plain.stdout.count("cli:w") == 1
    listing = run_gateway(["sessions", "list", "--all"], env, tmp_path)
    current, archived = listing.stdout.splitlines()
    assert current.startswith("cli:w ") and "--archived" not in current
    assert archived.startswith("cli:w ") and archived.endswith("--archived 1")
    rows = json.loads(run_gateway(["sessions", "list", "--all", "--json"], env, tmp_path).stdout)
    assert [(r["key"], r["archived"]) for r in rows] == [("cli:w", None), ("cli:w", 1)]

    shown = run_gateway(["sessions", "show", "w", "--archived", "1"], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["[user] old topic", "[assistant] echo: old topic"]
    tree = run_gateway(["sessions", "tree", "w", "--archived", "1"], env, tmp_path)
    assert "old topic" in tree.stdout and "<- leaf" in tree.stdout
    exported = run_gateway(["sessions", "export", "w", "--archived", "1"], env, tmp_path)
    assert json.loads(exported.stdout.splitlines()[0])["id"] == rows[1]["session_id"]
    assert "[user] new" in run_gateway(["sessions", "show", "w"], env, tmp_path).stdout

    missing = run_gateway(["sessions", "show", "w", "--archived", "2"], env, tmp_path)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "has no archived session 2; it has 1" in missing.stderr
    bad = run_gateway(["sessions", "show", "w", "--archived", "0"], env, tmp_path)
    assert bad.returncode == 2 and "from 1 up" in bad.stderr


def test_failures_are_one_clear_line(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    env = base_env(tmp_path)
    no_key = run_gateway(["chat", "-m", "hi"], env, tmp_path)
    assert no_key.returncode == 78
    assert "OPENAI_API_KEY" in no_key.stderr and "OPENAI_BASE_URL" in no_key.stderr
    assert "Traceback" not in no_key.stderr

    bad = run_gateway(["chat", "-m", "hi"], env | {"GATEWAY_LLM__TIMEOUT": "never"}, tmp_path)
    assert bad.returncode == 78 and "llm.timeout" in bad.stderr
    assert "Traceback" not in bad.stderr

    fake_openai_thread.fail_model("gpt-4o-mini", status=500)
    env |= {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
    }
    down = run_gateway(["chat", "-m", "hi"], env, tmp_path)
    assert down.returncode == 1 and down.stderr.strip() and "Traceback" not in down.stderr
    assert fake_openai_thread.api_key not in down.stderr  # type: ignore[operator]

    hostile = run_gateway(["chat", "--session", "x" * 5000, "-m", "hi"], env, tmp_path)
    assert hostile.returncode == 2 and "Traceback" not in hostile.stderr


def test_init_writes_a_valid_config_once(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    made = run_gateway(["init"], env, tmp_path)
    assert made.returncode == 0 and (tmp_path / "gateway.toml").exists()
    again = run_gateway(["init"], env, tmp_path)
    assert again.returncode == 73, again.stderr  # EX_CANTCREAT: not a config error
    assert again.stderr.strip() == (
        "gateway: gateway.toml already exists; not overwriting it "
        "(move it away, or give another path)"
    )
    nested = run_gateway(["init", "sub/dir/g.toml"], env, tmp_path)
    assert nested.returncode == 0, nested.stderr
    assert (tmp_path / "sub" / "dir" / "g.toml").is_file()


def test_cache_operator_commands(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    for session in ("a", "b"):
        out = run_gateway(["chat", "--session", session, "-m", "what is DNS?"], env, tmp_path)
        assert out.returncode == 0, out.stderr
    assert len(fake_openai_thread.chat_requests) == 1  # the second was a shared cache hit

    stats = run_gateway(["cache", "stats", "--json"], env, tmp_path)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["entries"] == 1

    wrong = run_gateway(["cache", "invalidate", "--model", "nope"], env, tmp_path)
    assert wrong.returncode == 0 and "removed 0 entries" in wrong.stdout
    gone = run_gateway(["cache", "invalidate", "--model", "gpt-4o-mini"], env, tmp_path)
    assert "removed 1 entries" in gone.stdout
    run_gateway(["chat", "--session", "c", "-m", "what is DNS?"], env, tmp_path)
    assert len(fake_openai_thread.chat_requests) == 2
    cleared = run_gateway(["cache", "clear"], env, tmp_path)
    assert cleared.returncode == 0 and "removed 1 entries" in cleared.stdout
    usage = run_gateway(["cache", "invalidate"], env, tmp_path)
    assert usage.returncode == 2


def test_cache_stats_count_lookups_of_other_processes(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    for session in ("a", "b", "c"):
        out = run_gateway(["chat", "--session", session, "-m", "what is TCP?"], env, tmp_path)
        assert out.returncode == 0, out.stderr
    stats = json.loads(run_gateway(["cache", "stats", "--json"], env, tmp_path).stdout)
    assert (stats["hits"], stats["misses"]) == (2, 1)


def test_cache_commands_with_redis_down_say_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "GATEWAY_CACHE__URL": f"redis://127.0.0.1:{port}/0",
    }
    for action in (["stats"], ["clear"]):
        out = run_gateway(["cache", *action], env, tmp_path)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
        [line] = out.stderr.strip().splitlines()
        assert line.startswith(
            f"gateway: cache {action[0]} failed: redis cache at 127.0.0.1:{port}"
        )
        assert f":{port}: ConnectionError" in line
        assert "start Redis, or point cache.url (GATEWAY_CACHE__URL) at a running one" in line


def test_sessions_tree_keeps_its_shape_with_multi_line_messages(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    """A message of several lines is one line of the tree: every line of the output is
    an entry, under its parent's indentation."""
    env = gateway_env(tmp_path / "ws", fake_openai_thread)
    said = "first line\nsecond line\n\n   third"
    assert run_gateway(["chat", "--session", "lines", "-m", said], env, tmp_path).returncode == 0
    tree = run_gateway(["sessions", "tree", "lines"], env, tmp_path)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert len(lines) == 2, tree.stdout  # the message and its answer
    assert "[user] first line second line third" in lines[0]
    assert lines[1].startswith("`-- ") and "[assistant] echo: first line" in lines[1]
