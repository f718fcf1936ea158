"""`gateway run` as a real subprocess for tests, with its log lines readable as they come
(`gateway.testing.process`, which the conformance kit uses too), and the environments
the channel tests start it with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gateway.testing.process import GatewayProcess as _Process
from gateway.testing.process import wait_until

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

__all__ = [
    "ROOT",
    "BotApiServer",
    "GatewayProcess",
    "base_env",
    "discord_env",
    "telegram_env",
    "telegram_webhook_env",
    "wait_until",
]


class GatewayProcess(_Process):
    """`gateway.testing.process.GatewayProcess` as these tests start it: ready once it
    logs its address (a test of a channel that is not up yet polls /readyz itself,
    `wait_readyz`), and stopped within 30 s."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        super().__init__(env, cwd)

    def wait_ready(self, timeout: float = 60, *, readyz: bool = False) -> int:
        return super().wait_ready(timeout, readyz=readyz)

    def terminate(self, timeout: float = 30) -> int:
        return super().terminate(timeout)


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
