"""`gateway doctor` as an operator runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.fakes._serving import free_port
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeOpenAI, Flavor
from tests.gateway_process import GatewayProcess
from tests.local_redis import REDIS_URL, require_redis
from tests.unwritable import unprivileged

ROOT = Path(__file__).resolve().parents[1]


def doctor(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    return env | {
        "PYTHONPATH": str(ROOT),
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "GATEWAY_HTTP__PORT": "0",  # the doctor listens on it: not on a port others use
    }


def test_healthy_install_passes(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    (tmp_path / "ws").mkdir(mode=0o700)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "model gpt-4o-mini is available" in out.stdout
    assert f"ok    response cache (sqlite) at {tmp_path / 'ws' / 'cache.sqlite'}" in out.stdout
    assert "all checks passed" in out.stdout
    # The doctor makes the folders `run` makes (to know it can), and nothing else.
    assert sorted(os.listdir(tmp_path / "ws")) == ["memory", "sessions"]
    assert os.listdir(tmp_path / "ws" / "sessions") == []


def test_problems_are_named_with_a_fix(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    ws = tmp_path / "ws"
    ws.mkdir(mode=0o755)
    (ws / "notes.txt").write_text("x")
    os.chmod(ws / "notes.txt", 0o644)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",  # nothing listens there
        "GATEWAY_HTTP__HOST": "0.0.0.0",
        "GATEWAY_HTTP__TOKEN": "",
        "GATEWAY_CHANNELS__TELEGRAM__ENABLED": "true",
        "GATEWAY_CHANNELS__SLACK__ENABLED": "true",
        "GATEWAY_HEARTBEAT__JOBS__DISKS__EVERY": "1h",
        "GATEWAY_HEARTBEAT__JOBS__DISKS__PROMPT": "check the disks",
        "GATEWAY_HEARTBEAT__JOBS__DISKS__DELIVER_TO": "discord:123",
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 1
    text = out.stdout
    assert "readable by other users" in text and f"chmod -R go-rwx {ws}" in text
    assert "not reachable" in text
    assert "GATEWAY_HTTP__TOKEN" in text
    assert "GATEWAY_CHANNELS__TELEGRAM__TOKEN" in text
    assert "GATEWAY_CHANNELS__SLACK__BOT_TOKEN" in text
    assert "GATEWAY_CHANNELS__SLACK__APP_TOKEN" in text
    assert "heartbeat job 'disks' delivers to discord:123, but discord is not enabled" in text
    assert "Traceback" not in out.stderr


def test_a_local_model_server_that_dies_on_its_first_completion_is_named(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    """A local server that lists its models and then dies on a completion (llama.cpp
    built for another CPU did, with SIGSEGV): the doctor asks it for one token and says
    it crashed, where listing its models alone said all was well."""
    from tests.fakes.openai_server import Reply

    (tmp_path / "ws").mkdir(mode=0o700)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_MODEL": "gpt-4o-mini",
    }
    fake_openai_thread.add(Reply(text="never sent", break_after=0))
    text = doctor(env, tmp_path).stdout
    assert (
        f"FAIL  LLM endpoint {fake_openai_thread.base_url} lists gpt-4o-mini, then closed the "
        "connection on a one-token completion: its server crashed"
    ) in text, text
    assert "docs/real-llm.md" in text
    requests = fake_openai_thread.chat_requests
    assert len(requests) == 1 and requests[0].body["max_tokens"] == 1
    healthy = doctor(env, tmp_path).stdout  # the next completion is answered
    assert "LLM endpoint" in healthy and "crashed" not in healthy, healthy


def test_rejected_key_is_reported(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": "sk-wrong-key-000",
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 1 and "rejected the API key" in out.stdout
    assert "sk-wrong-key-000" not in out.stdout


def test_the_context_window_in_use_and_its_source_are_shown(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    (tmp_path / "ws").mkdir(mode=0o700)
    hosted_like = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
    }
    out = doctor(hosted_like, tmp_path)
    assert (
        "ok    context window for gpt-4o-mini: 32,768 tokens (from the default; the server "
        "does not say)"
    ) in out.stdout
    with FakeOpenAI.in_thread(
        api_key=None, flavor="llama.cpp", context_window=2048, models=("gpt-4o-mini",)
    ) as llama:
        env = base_env(tmp_path) | {"OPENAI_BASE_URL": llama.base_url}
        fitted = doctor(env, tmp_path)
        larger = doctor(env | {"GATEWAY_LLM__CONTEXT_WINDOW": "32768"}, tmp_path)
    assert (
        "ok    context window for gpt-4o-mini: 2,048 tokens (from llama.cpp /props n_ctx)"
    ) in fitted.stdout
    assert (
        "warn  [llm] context_window is 32,768 but llama.cpp /props n_ctx says 2,048: "
        "gpt-4o-mini is used with 2,048 tokens\n"
        "      fix: set [llm] context_window = 2048 (or leave it unset), or start "
        "llama-server with a larger --ctx-size (-c)"
    ) in larger.stdout


@pytest.mark.parametrize("flavor", ["ollama", "vllm"])
def test_a_base_url_without_v1_gets_the_corrected_url(tmp_path: Path, flavor: Flavor) -> None:
    (tmp_path / "ws").mkdir(mode=0o700)
    with FakeOpenAI.in_thread(api_key=None, flavor=flavor, models=("gpt-4o-mini",)) as local:
        out = doctor(base_env(tmp_path) | {"OPENAI_BASE_URL": local.url}, tmp_path)
    assert out.returncode == 1, out.stdout
    assert (
        f"FAIL  LLM endpoint: the server at {local.url} answered 404 for /models; "
        f"OpenAI-compatible base URLs usually end in /v1 (try {local.url}/v1); "
        f"{local.url}/v1 answers\n"
        f"      fix: set llm.base_url (or OPENAI_BASE_URL) to {local.url}/v1"
    ) in out.stdout
    assert "Traceback" not in out.stderr


def test_the_cache_backend_is_checked(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    ws = tmp_path / "ws"
    ws.mkdir(mode=0o700)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
    }
    (ws / "cache.sqlite").write_bytes(b"not a database, whatever its name says" * 100)
    os.chmod(ws / "cache.sqlite", 0o600)
    out = doctor(env, tmp_path)
    assert out.returncode == 1
    assert f"FAIL  cache file {ws / 'cache.sqlite'}: cannot be opened" in out.stdout
    assert "fix: make it writable for the gateway's user, or set cache.url" in out.stdout

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = doctor(env | {"GATEWAY_CACHE__URL": f"redis://127.0.0.1:{port}/0"}, tmp_path)
    assert down.returncode == 1 and "Traceback" not in down.stderr
    assert f"FAIL  redis cache at 127.0.0.1:{port}: ConnectionError" in down.stdout
    assert "fix: start Redis, or point cache.url (GATEWAY_CACHE__URL)" in down.stdout


def test_a_running_redis_cache_passes(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    require_redis()
    (tmp_path / "ws").mkdir(mode=0o700)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
        "GATEWAY_CACHE__URL": REDIS_URL,
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    host = urlparse(REDIS_URL)
    assert f"ok    response cache (redis) at {host.hostname}:{host.port or 6379}" in out.stdout


# ------------------------------------------------------------- doctor predicts run


def gateway(
    command: str, env: dict[str, str], cwd: Path, prefix: list[str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "gateway.cli", command],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _port_taken(tmp_path: Path, env: dict[str, str], stack: ExitStack) -> str:
    taken = stack.enter_context(socket.socket())
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env["GATEWAY_HTTP__PORT"] = str(port)
    return f"cannot listen on 127.0.0.1:{port}"


def _locked(folder: Path, stack: ExitStack) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o500)
    stack.callback(folder.chmod, 0o700)


def _workspace_read_only(tmp_path: Path, env: dict[str, str], stack: ExitStack) -> str:
    _locked(tmp_path / "ws", stack)
    return f"cannot write in {tmp_path / 'ws'} (Permission denied)"


def _workspace_not_creatable(tmp_path: Path, env: dict[str, str], stack: ExitStack) -> str:
    _locked(tmp_path / "locked", stack)
    env["GATEWAY_WORKSPACE"] = str(tmp_path / "locked" / "ws")
    return f"cannot write in {tmp_path / 'locked'} (Permission denied)"


def _sessions_read_only(tmp_path: Path, env: dict[str, str], stack: ExitStack) -> str:
    (tmp_path / "ws").mkdir(mode=0o700)
    _locked(tmp_path / "ws" / "sessions", stack)
    return f"cannot write in {tmp_path / 'ws' / 'sessions'} (Permission denied)"


def _memory_read_only(tmp_path: Path, env: dict[str, str], stack: ExitStack) -> str:
    (tmp_path / "ws").mkdir(mode=0o700)
    _locked(tmp_path / "ws" / "memory", stack)
    return f"cannot write in {tmp_path / 'ws' / 'memory'} (Permission denied)"


Setup = Callable[[Path, dict[str, str], ExitStack], str]


@pytest.mark.parametrize(
    "setup",
    [
        _port_taken,
        _workspace_read_only,
        _workspace_not_creatable,
        _sessions_read_only,
        _memory_read_only,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_doctor_fails_exactly_where_run_fails(
    tmp_path: Path, fake_openai_thread: FakeOpenAI, setup: Setup
) -> None:
    prefix = unprivileged()
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
    }
    with ExitStack() as stack:
        problem = setup(tmp_path, env, stack)
        checked = gateway("doctor", env, tmp_path, prefix)
        ran = gateway("run", env, tmp_path, prefix)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    failures = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert any(problem in line for line in failures), checked.stdout
    assert ran.returncode != 0 and problem in ran.stderr, ran.stderr
    assert "Traceback" not in checked.stderr + ran.stderr


def test_when_the_doctor_passes_run_starts(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    port = free_port()
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
        "GATEWAY_HTTP__PORT": str(port),
    }
    checked = gateway("doctor", env, tmp_path, unprivileged())
    assert checked.returncode == 0, checked.stdout
    assert f"ok    HTTP server can listen on 127.0.0.1:{port}" in checked.stdout
    running = GatewayProcess(env, tmp_path)
    try:
        assert running.wait_ready() == port
        assert running.terminate() == 0
    finally:
        running.stop()


def test_a_config_readable_by_others_in_the_workspace_is_fine(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    """Where deploy/README puts it: /data/gateway.toml, mode 0644."""
    ws = tmp_path / "ws"
    ws.mkdir(mode=0o700)
    config = ws / "gateway.toml"
    config.write_text('[llm]\nmodel = "gpt-4o-mini"\n')
    config.chmod(0o644)
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
        "GATEWAY_CONFIG": str(config),
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 0, out.stdout
    assert "readable by other users" not in out.stdout and "warn  " + str(config) not in out.stdout

    config.write_text('[llm]\nbase_url = "https://bob:hunter2secret@llm.example/v1"\n')
    leaky = doctor(env | {"OPENAI_BASE_URL": ""}, tmp_path)
    assert f"warn  {config} holds what looks like a credential in llm.base_url" in leaky.stdout
    assert "other users can read it" in leaky.stdout
    assert "hunter2secret" not in leaky.stdout


def test_each_provider_of_the_chain_is_checked(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    (tmp_path / "ws").mkdir(mode=0o700)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    env = base_env(tmp_path) | {
        "GATEWAY_LLM__CHAIN": '["primary", "backup"]',
        "GATEWAY_LLM__PROVIDERS__PRIMARY__BASE_URL": dead,
        "GATEWAY_LLM__PROVIDERS__BACKUP__BASE_URL": fake_openai_thread.base_url,
        "GATEWAY_LLM__PROVIDERS__BACKUP__API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_LLM__PROVIDERS__SPARE__BASE_URL": fake_openai_thread.base_url,
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 1
    assert (
        f"FAIL  provider primary: LLM endpoint {dead} is not reachable\n"
        "      fix: start the server or fix llm.providers.primary.base_url"
    ) in out.stdout
    assert (
        f"ok    provider backup: LLM endpoint {fake_openai_thread.base_url} answers; "
        "model gpt-4o-mini is available"
    ) in out.stdout
    assert "ok    provider backup: context window for gpt-4o-mini: 32,768 tokens" in out.stdout
    assert "warn  llm.providers.spare is configured but never asked" in out.stdout
    # [llm]'s own server is not in the chain: it is neither needed nor checked.
    assert "api.openai.com" not in out.stdout and "OPENAI_API_KEY" not in out.stdout
    assert "Traceback" not in out.stderr


def test_a_provider_without_its_key_is_named_before_anything_starts(tmp_path: Path) -> None:
    env = base_env(tmp_path) | {
        "GATEWAY_LLM__CHAIN": '["primary"]',
        "GATEWAY_LLM__PROVIDERS__PRIMARY__BASE_URL": "https://api.openai.com/v1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "chat", "-m", "hi"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 78
    assert (
        "llm.providers.primary: no API key; set GATEWAY_LLM__PROVIDERS__PRIMARY__API_KEY, "
        "or api_key_file"
    ) in out.stderr
    assert "Traceback" not in out.stderr


def discord_env(tmp_path: Path, llm: FakeOpenAI, fake: FakeDiscord, token: str) -> dict[str, str]:
    return base_env(tmp_path) | {
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": llm.api_key or "",
        "GATEWAY_HTTP__TOKEN": "tok-123456",
        "GATEWAY_CHANNELS__DISCORD__ENABLED": "true",
        "GATEWAY_CHANNELS__DISCORD__TOKEN": token,
        "GATEWAY_CHANNELS__DISCORD__API_URL": fake.api_url,
        "GATEWAY_CHANNELS__DISCORD__GATEWAY_URL": fake.gateway_url,
    }


def test_discord_is_checked_token_intent_and_gateway(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    (tmp_path / "ws").mkdir(mode=0o700)
    with FakeDiscord.in_thread() as fake:
        good = doctor(discord_env(tmp_path, fake_openai_thread, fake, fake.token), tmp_path)
        assert good.returncode == 0, good.stdout + good.stderr
        assert f"ok    discord credentials work: @gateway ({fake.bot_id})" in good.stdout
        assert "ok    discord: the Message Content intent is enabled" in good.stdout
        assert "ok    discord: the Gateway answers" in good.stdout
        # The doctor opened the Gateway without identifying (no session made).
        assert fake.connections and not fake.identified_connections()
        wrong = doctor(discord_env(tmp_path, fake_openai_thread, fake, "wrong-token"), tmp_path)
        assert wrong.returncode == 1 and "refused the bot token" in wrong.stdout
        assert "wrong-token" not in wrong.stdout
        fake.application_flags = 0  # the Message Content intent switched off
        off = doctor(discord_env(tmp_path, fake_openai_thread, fake, fake.token), tmp_path)
        assert off.returncode == 1
        assert "the Message Content intent is not enabled" in off.stdout
        assert "message_content = false" in off.stdout
        env = discord_env(tmp_path, fake_openai_thread, fake, fake.token)
        fine = doctor(env | {"GATEWAY_CHANNELS__DISCORD__MESSAGE_CONTENT": "false"}, tmp_path)
        assert fine.returncode == 0, fine.stdout
    assert "Traceback" not in good.stderr + wrong.stderr + off.stderr


def test_the_files_mode_names_where_the_state_is(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = base_env(tmp_path) | {"OPENAI_BASE_URL": fake_openai_thread.base_url}
    out = doctor(env, tmp_path)
    assert f"ok    state in workspace files under {tmp_path / 'ws'}" in out.stdout


def test_the_shared_storage_is_checked_without_being_migrated(
    tmp_path: Path, fake_openai_thread: FakeOpenAI, pg_url: str
) -> None:
    # An empty schema: the doctor says the start will migrate it, and migrates nothing.
    from gateway.plumbing.postgres import connect, migrations, schema_status

    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "GATEWAY_STORAGE__URL": pg_url,
    }
    out = doctor(env, tmp_path)
    line = f"schema version 0, {len(migrations())} migrations to apply at start"
    assert "ok    state in PostgreSQL at " in out.stdout and line in out.stdout, out.stdout
    with connect(pg_url) as conn:
        assert schema_status(conn).applied == ()
    # With migrations left to `gateway db migrate`, the same database is a problem.
    out = doctor(env | {"GATEWAY_STORAGE__MIGRATE": "never"}, tmp_path)
    assert out.returncode == 1
    assert "FAIL  storage: the database at " in out.stdout
    assert "run `gateway db migrate` first" in out.stdout


def test_unreachable_shared_storage_is_named_with_a_fix(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "GATEWAY_STORAGE__URL": f"postgresql://gw@127.0.0.1:{port}/gw",
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 1
    assert f"FAIL  storage: PostgreSQL at postgresql://gw@127.0.0.1:{port}/gw" in out.stdout
    assert "fix: start PostgreSQL or fix storage.url" in out.stdout
    assert "Traceback" not in out.stderr
