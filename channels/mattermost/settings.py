"""`[channels.mattermost]`: the Mattermost channel's settings (validated by the loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: Mattermost's longest post by default (`model.PostMessageMaxRunesV2`), in characters.
MAX_POST_CHARS = 16383


class MattermostSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Mattermost bot account.")
    url: str | None = Field(
        None,
        description="The Mattermost server's address (what people open in a browser); the "
        "REST API is under /api/v4 and the WebSocket at /api/v4/websocket.",
        examples=["https://chat.example.com"],
    )
    token: SecretStr | None = secret(
        "the bot account's access token (System Console > Integrations > Bot Accounts)",
        "GATEWAY_CHANNELS__MATTERMOST__TOKEN",
    )
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__MATTERMOST__TOKEN", "mattermost-token")
    max_post_chars: int = Field(
        MAX_POST_CHARS,
        ge=1000,
        le=1_000_000,
        description="The longest post the server takes, in characters (its MaxPostSize; "
        "`gateway doctor` reads it); longer replies are split.",
    )
    backfill_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="After a (re)connect, read back what was written while away up to this "
        "old; older posts are not answered.",
    )
    backfill_max_messages: int = Field(
        500, ge=1, le=10_000, description="At most this many posts read back per channel."
    )
    backfill_max_channels: int = Field(
        1000,
        ge=1,
        description="At most this many channels read back after a (re)connect (the most "
        "recently active first; only those with posts newer than their read position).",
    )

    def resolved_token(self) -> str | None:
        """The bot's access token (from the environment or `token_file`), if any."""
        return reveal(self.token)
