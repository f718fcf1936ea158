"""`gateway run` as a real subprocess for tests, with its log lines readable as they come."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tests.fakes.discord_server import FakeDiscord
    from tests.fakes.openai_server import FakeOpenAI
    from tests.fakes.telegram_server import FakeTelegram


class BotApiServer(Protocol):
    """A Bot API server the gateway can poll: the fake, or the bridge to the emulator
    (tests/emulators/telegram_emulator.py)."""

    token: str

    @property
    def api_url(self) -> str: ...

    @property
    def file_url(self) -> str: ...


ROOT = Path(__file__).resolve().parents[1]


def wait_until(predicate: Callable[[], object], timeout: float = 20, what: str = "") -> None:
    """Poll `predicate` every 50 ms until it is true; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what or 'condition'} not met within {timeout:g}s")


class GatewayProcess:
    """A running `gateway run` (stdin closed: headless) whose stderr is collected."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "run"],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []  # every line so far, for diagnostics
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)

    def wait_for_line(self, text: str, timeout: float = 20) -> str:
        """The first log line containing `text`; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        tail = "".join(self.log[-20:])
        raise AssertionError(f"the gateway never logged {text!r}; its last lines:\n{tail}")

    def wait_logged(self, text: str, timeout: float = 20) -> str:
        """A line containing `text` logged at any time so far, or within `timeout`
        (unlike `wait_for_line`, which reads on from the lines already waited past)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.log):
                if text in line:
                    return line
            if time.monotonic() >= deadline or self.proc.poll() is not None:
                tail = "".join(self.log[-20:])
                raise AssertionError(f"the gateway never logged {text!r}; its last lines:\n{tail}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 60) -> int:
        """Wait for start-up (a cold start imports for seconds, more on a busy machine);
        the HTTP port it listens on."""
        line = self.wait_for_line("gateway ready: http://", timeout)
        return int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])

    def wait_readyz(self, port: int, timeout: float = 60) -> None:
        """Poll ``GET /readyz`` until it answers 200 (every channel is up)."""

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, timeout, f"/readyz 200 on port {port}")

    def kill(self) -> None:
        """SIGKILL: no drain, no flush, nothing after this instant."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM (drain, then stop); the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill it if it still runs (for `finally`)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def base_env(workspace: Path, llm: FakeOpenAI, *, llm_timeout: float = 30) -> dict[str, str]:
    """The environment of a `gateway run` on `workspace` answering through `llm`: this
    process's, less any GATEWAY_*/OPENAI_* of the developer's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    return env | {
        "PYTHONPATH": str(ROOT),
        "GATEWAY_WORKSPACE": str(workspace),
        "OPENAI_BASE_URL": llm.base_url,
        "OPENAI_API_KEY": llm.api_key or "",
        "GATEWAY_LLM__MAX_RETRIES": "0",
        "GATEWAY_LLM__TIMEOUT": f"{llm_timeout:g}",
    }


def telegram_env(
    workspace: Path, llm: FakeOpenAI, telegram: BotApiServer, *, llm_timeout: float = 30
) -> dict[str, str]:
    """`base_env` plus long polling of `telegram`, open to everyone, on a free port."""
    return base_env(workspace, llm, llm_timeout=llm_timeout) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_CHANNELS__TELEGRAM__ENABLED": "true",
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": telegram.token,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_URL": telegram.api_url,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_FILE_URL": telegram.file_url,
        "GATEWAY_CHANNELS__TELEGRAM__POLL_TIMEOUT": "1",
        "GATEWAY_CHANNELS__TELEGRAM__DM_POLICY": "open",
    }


def discord_env(workspace: Path, llm: FakeOpenAI, discord: FakeDiscord) -> dict[str, str]:
    """`base_env` plus the bot of `discord` (its HTTP API and Gateway), open to everyone,
    on a free port."""
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_CHANNELS__DISCORD__ENABLED": "true",
        "GATEWAY_CHANNELS__DISCORD__TOKEN": discord.token,
        "GATEWAY_CHANNELS__DISCORD__API_URL": discord.api_url,
        "GATEWAY_CHANNELS__DISCORD__GATEWAY_URL": discord.gateway_url,
        "GATEWAY_CHANNELS__DISCORD__DM_POLICY": "open",
        "GATEWAY_CHANNELS__DISCORD__GROUP_POLICY": "open",
    }


def telegram_webhook_env(telegram: FakeTelegram, secret: str) -> dict[str, str]:
    """The settings of a Telegram channel in webhook mode on `telegram`, open to everyone
    (the webhook URL is only what the gateway registers; tests POST to its port)."""
    return {
        "GATEWAY_CHANNELS__TELEGRAM__ENABLED": "true",
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": telegram.token,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_URL": telegram.api_url,
        "GATEWAY_CHANNELS__TELEGRAM__BASE_FILE_URL": telegram.file_url,
        "GATEWAY_CHANNELS__TELEGRAM__MODE": "webhook",
        "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_URL": "https://bot.example.org/telegram/webhook",
        "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET": secret,
        "GATEWAY_CHANNELS__TELEGRAM__DM_POLICY": "open",
    }
