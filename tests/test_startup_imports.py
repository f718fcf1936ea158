"""One-shot commands load only what they use: each runs in a fresh interpreter, which
then reports every module it imported. The times are bench/startup.py's; this file keeps
a later eager import of a heavy library from slowing every command again."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI

ROOT = Path(__file__).resolve().parents[1]

# `gateway ARGS` in this interpreter, then the modules it loaded into the file argv[1].
PROBE = """
import json, sys
from gateway.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""

#: Platforms, optional extras and backends that no one-shot command of a file-mode
#: workspace uses, `gateway chat -m` included.
UNUSED_BY_CHAT = (
    "telegram",
    "discord",
    "slack_bolt",
    "slack_sdk",
    "nio",
    "vodozemac",
    "peewee",
    "jinja2",
    "PIL",
    "pypdf",
    "docx",
    "psycopg",
    "psycopg_pool",
    "redis",
    "wordllama",
    "mcp",
    "trafilatura",
    "prompt_toolkit",
    "uvloop",
    "prometheus_client",
)
#: What only a turn needs: the LLM client and its HTTP stacks, the memory index's
#: numpy, and the daemon's assembly of every part.
TURN_ONLY = ("openai", "httpx", "aiohttp", "numpy", "gateway.daemon")
#: What commands need once they read the configuration, but parsing arguments does not.
CONFIG_ONLY = ("pydantic", "loguru", "anyio", "gateway.config", "gateway.sessions")


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    return env | {"GATEWAY_WORKSPACE": str(tmp_path / "ws"), "PYTHONPATH": str(ROOT)}


def loaded_by(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, set[str]]:
    """The exit code of `gateway ARGS` and the top-level packages and modules it imported
    (`gateway.daemon` stays as it is)."""
    report = tmp_path / "modules.json"
    subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=False,
    )
    result = json.loads(report.read_text())
    modules = set(result["modules"])
    return result["code"], modules | {name.split(".")[0] for name in modules}


def present(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [name for name in names if name in modules]


def test_importing_the_cli_loads_no_heavy_module(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gateway.cli, json, sys; print(json.dumps(sorted(sys.modules)))",
        ],
        env=base_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    names = set(json.loads(done.stdout))
    modules = names | {name.split(".")[0] for name in names}
    assert present(modules, UNUSED_BY_CHAT + TURN_ONLY + CONFIG_ONLY) == []
    assert sorted(n for n in names if n.startswith("gateway")) == ["gateway", "gateway.cli"]


def test_help_loads_neither_the_configuration_nor_the_agent(tmp_path: Path) -> None:
    code, modules = loaded_by(["--help"], base_env(tmp_path), tmp_path)
    assert code == 0
    assert present(modules, UNUSED_BY_CHAT + TURN_ONLY + CONFIG_ONLY) == []


def test_sessions_list_loads_the_sessions_and_not_the_agent(tmp_path: Path) -> None:
    from gateway.llm import LLMMessage
    from gateway.sessions import SessionManager

    manager = SessionManager(tmp_path / "ws" / "sessions")
    manager.get_or_create("telegram:42").add_message(LLMMessage(role="user", content="hi"))
    manager.close()
    code, modules = loaded_by(["sessions", "list"], base_env(tmp_path), tmp_path)
    assert code == 0
    assert "gateway.sessions.listing" in modules  # it did list them
    assert present(modules, UNUSED_BY_CHAT + TURN_ONLY) == []


def make_session(workspace: Path, key: str) -> Path:
    from gateway.llm import LLMMessage
    from gateway.sessions import SessionManager

    manager = SessionManager(workspace / "sessions")
    manager.get_or_create(key).add_message(LLMMessage(role="user", content="hi"))
    manager.close()
    return workspace / "sessions"


#: What the sessions commands read of the configuration (`cli.SESSIONS_SECTIONS`): the
#: loader, the base of the models, the top level and those four sections' models.
SESSIONS_CONFIG = [
    "gateway.config.loader",
    "gateway.config.log",
    "gateway.config.memory",
    "gateway.config.section",
    "gateway.config.sessions",
    "gateway.config.storage",
    "gateway.config.toplevel",
]


#: The session machinery a listing of files does without (gateway.sessions.listing).
SESSION_MACHINERY = (
    "gateway.sessions.manager",
    "gateway.sessions.store",
    "gateway.sessions.entries",
    "gateway.llm",
)


def test_sessions_list_builds_only_the_configuration_it_reads(tmp_path: Path) -> None:
    """Most of `sessions list`'s start went to building every section's model, to
    loguru (with asyncio and multiprocessing) and to the session machinery; the times
    are bench/startup.py's."""
    make_session(tmp_path / "ws", "telegram:42")
    for args in (["sessions", "list"], ["sessions", "list", "--all", "--json"]):
        code, modules = loaded_by(args, base_env(tmp_path), tmp_path)
        assert code == 0
        assert sorted(m for m in modules if m.startswith("gateway.config.")) == SESSIONS_CONFIG
        assert present(modules, ("loguru", "asyncio", "multiprocessing")) == []
        assert present(modules, SESSION_MACHINERY) == []


def test_a_sessions_command_logs_as_configured_though_it_loads_loguru_late(
    tmp_path: Path,
) -> None:
    """Logging is set up at the first line logged: in the configured format, at the
    configured level, with the secrets redacted, those of sections not loaded too."""
    folder = make_session(tmp_path / "ws", "cli:plain-unread-token")
    with (folder / "cli%3Aplain-unread-token.jsonl").open("a") as fh:
        fh.write("not json\n")  # an unreadable line, reported when the file is read
    env = base_env(tmp_path) | {
        "GATEWAY_LOG__FORMAT": "json",
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": "plain-unread-token",
    }
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "sessions", "show", "plain-unread-token"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[user] hi\n"
    [line] = done.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "WARNING" and record["logger"] == "gateway.sessions.store"
    assert "skipped 1 unreadable line(s)" in record["message"]
    assert "plain-unread-token" not in done.stderr and "***" in record["message"]


@pytest.mark.parametrize("command", [["run"], ["doctor"], ["sessions", "list"]])
def test_a_mistake_in_a_section_is_reported_by_the_commands_that_read_it(
    tmp_path: Path, command: list[str]
) -> None:
    """The sessions commands do not read [channels]: they list on, while the daemon and
    the doctor refuse the configuration (gateway/config/loader.py says why)."""
    make_session(tmp_path / "ws", "telegram:42")
    env = base_env(tmp_path) | {"GATEWAY_CHANNELS__TELEGRAM__ENABLED": "maybe"}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *command],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if command[0] == "sessions":
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("telegram:42 ")
    else:
        assert done.returncode == 78
        assert done.stderr == (
            "gateway: config error: channels.telegram.enabled: expected true or false, got "
            "'maybe' (write it without quotes); fix it in gateway.toml or "
            "GATEWAY_CHANNELS__TELEGRAM__ENABLED\n"
        )


def test_chat_without_a_model_refuses_before_loading_the_agent(tmp_path: Path) -> None:
    code, modules = loaded_by(["chat", "-m", "hello"], base_env(tmp_path), tmp_path)
    assert code == 78
    assert present(modules, UNUSED_BY_CHAT + TURN_ONLY) == []


def test_a_chat_answered_from_the_cache_loads_no_platform_or_extra(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
    }
    for session in ("a", "b"):  # the second one is answered from the shared cache
        code, modules = loaded_by(
            ["chat", "--session", session, "-m", "what is DNS?"], env, tmp_path
        )
        assert code == 0
    assert len(fake_openai_thread.chat_requests) == 1
    assert present(modules, UNUSED_BY_CHAT) == []


@pytest.mark.timeout(60)
def test_run_without_a_model_does_not_wait_for_postgresql(tmp_path: Path) -> None:
    """A gateway that could not start once PostgreSQL answers says so at once, instead
    of waiting for a database that is down (nothing listens on the port)."""
    env = base_env(tmp_path) | {
        "GATEWAY_STORAGE__URL": f"postgresql://gateway@127.0.0.1:{free_port()}/gateway",
        "GATEWAY_HTTP__PORT": "0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "run"],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 78, done.stderr
    assert "No LLM API key" in done.stderr
    assert "waiting for PostgreSQL" not in done.stderr


@pytest.mark.parametrize(
    "package", ["gateway.memory", "gateway.cache", "gateway.config", "gateway.sessions"]
)
def test_a_lazy_package_still_exports_every_name(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        module.nothing_here  # noqa: B018


def test_a_sessions_command_of_the_shared_mode_logs_as_configured_too(
    tmp_path: Path, pg_url: str
) -> None:
    """The shared mode's modules log through the same late-set-up logger: the first start
    on an empty schema logs its migrations in the configured format."""
    env = base_env(tmp_path) | {
        "GATEWAY_STORAGE__URL": pg_url,
        "GATEWAY_LOG__FORMAT": "json",
        "GATEWAY_LOG__LEVEL": "INFO",
    }
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "-v", "sessions", "list"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]
    applied = [r for r in records if r["message"].startswith("storage: applied migration")]
    assert applied and all(r["logger"] == "gateway.plumbing.postgres" for r in applied)
