"""`gateway doctor` as an operator runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

from tests.fakes.openai_server import FakeOpenAI
from tests.local_redis import REDIS_URL, require_redis

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
    return env | {"PYTHONPATH": str(ROOT), "GATEWAY_WORKSPACE": str(tmp_path / "ws")}


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
    assert os.listdir(tmp_path / "ws") == []  # the doctor looks, it creates nothing


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


def test_rejected_key_is_reported(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": "sk-wrong-key-000",
    }
    out = doctor(env, tmp_path)
    assert out.returncode == 1 and "rejected the API key" in out.stdout
    assert "sk-wrong-key-000" not in out.stdout


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
