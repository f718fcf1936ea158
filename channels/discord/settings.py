"""`[channels.discord]`: the Discord channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class DiscordSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Discord bot.")
    token: SecretStr | None = secret(
        "the bot token (Developer Portal > Bot > Reset Token)", "GATEWAY_CHANNELS__DISCORD__TOKEN"
    )
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__DISCORD__TOKEN", "discord-token")
    api_url: str | None = Field(
        None,
        description="HTTP API base URL, for an egress proxy or tests (default "
        "https://discord.com/api/v10).",
        examples=["https://discord-proxy.internal/api/v10"],
    )
    gateway_url: str | None = Field(
        None,
        description="Gateway WebSocket URL; when set, resumes go there too (default "
        "wss://gateway.discord.gg/).",
        examples=["wss://discord-proxy.internal/gateway/"],
    )
    message_content: bool = Field(
        True,
        description="Ask for the privileged Message Content intent (enable it on the "
        "Developer Portal's Bot page); without it the bot reads only DMs and messages "
        "that mention it.",
    )
    backfill_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="After a (re)connect, read back what was written while away up to "
        "this old; older messages are not answered.",
    )
    backfill_max_messages: int = Field(
        500, ge=1, le=10_000, description="At most this many messages read back per conversation."
    )
    backfill_max_conversations: int = Field(
        1000,
        ge=1,
        description="At most this many conversations read back (the most recently active; "
        "each costs one request, DMs always, server channels only when they have news).",
    )

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)
