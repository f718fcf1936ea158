"""`[channels.qq]`: the QQ channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: The longest text the channel puts in one message, by default (QQ publishes no limit;
#: docs/qq.md says why this one).
MAX_MESSAGE_CHARS = 3000


class QQSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a QQ account through a OneBot v11 server.")
    url: str = Field(
        "ws://127.0.0.1:3001",
        description="The OneBot v11 implementation's forward WebSocket (NapCat's or "
        "Lagrange.OneBot's WebSocket server): the channel connects to it.",
        examples=["ws://127.0.0.1:3001"],
    )
    access_token: SecretStr | None = secret(
        "the OneBot access token (NapCat: the WebSocket server's Token)",
        "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN",
    )
    access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN", "qq-access-token"
    )
    max_message_chars: int = Field(
        MAX_MESSAGE_CHARS,
        ge=100,
        le=20_000,
        description="The longest text of one message, in characters; longer replies are split.",
    )
    at_sender: bool = Field(
        True,
        description="In a group, a reply quotes the message it answers and @-mentions its "
        "sender (false: it only quotes it).",
    )
    read_back: bool = Field(
        True,
        description="After every connection, read back through the implementation's message "
        "history (get_group_msg_history, get_friend_msg_history) what was written while the "
        "gateway was away.",
    )
    backfill_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="Read back what was written while away up to this old; older messages "
        "are not answered.",
    )
    backfill_max_messages: int = Field(
        300, ge=1, le=10_000, description="At most this many messages read back per conversation."
    )
    backfill_max_conversations: int = Field(
        200,
        ge=1,
        description="At most this many conversations read back after a (re)connect, one "
        "request or more each: those the bot talked in (most recent first), then its groups "
        "and friends.",
    )

    def resolved_access_token(self) -> str | None:
        """The access token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)
