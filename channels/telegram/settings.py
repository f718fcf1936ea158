"""`[channels.telegram]`: the Telegram channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class TelegramSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Telegram bot.")
    token: SecretStr | None = secret("the BotFather token", "GATEWAY_CHANNELS__TELEGRAM__TOKEN")
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__TELEGRAM__TOKEN", "telegram-token")
    mode: Literal["polling", "webhook"] = Field(
        "polling", description="polling (no public URL needed) or webhook."
    )
    base_url: str | None = Field(
        None,
        description="Bot API server for self-hosted servers, e.g. http://127.0.0.1:8081/bot "
        "(the token is appended).",
        examples=["http://127.0.0.1:8081/bot"],
    )
    base_file_url: str | None = Field(
        None,
        description="File download URL prefix, likewise.",
        examples=["http://127.0.0.1:8081/file/bot"],
    )
    webhook_url: str | None = Field(
        None,
        description="Public HTTPS URL that reaches this gateway's /telegram/webhook "
        "(webhook mode).",
        examples=["https://bot.example.com/telegram/webhook"],
    )
    webhook_secret: SecretStr | None = secret(
        "webhook secret token ([A-Za-z0-9_-])", "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET"
    )
    webhook_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET", "telegram-webhook-secret"
    )
    poll_timeout: int = Field(30, ge=0, le=50, description="Long-poll seconds per request.")

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)
