"""`[channels.line]`: the LINE channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class LineSettings(AccessSection):
    """A LINE Official Account through the Messaging API (channels/line, docs/line.md)."""

    enabled: bool = Field(False, description="Serve a LINE Official Account (Messaging API).")
    channel_access_token: SecretStr | None = secret(
        "the Messaging API channel's access token (long-lived, or a v2.1 token)",
        "GATEWAY_CHANNELS__LINE__CHANNEL_ACCESS_TOKEN",
    )
    channel_access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__LINE__CHANNEL_ACCESS_TOKEN", "line-channel-access-token"
    )
    channel_secret: SecretStr | None = secret(
        "the channel secret, which signs every webhook (X-Line-Signature)",
        "GATEWAY_CHANNELS__LINE__CHANNEL_SECRET",
    )
    channel_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__LINE__CHANNEL_SECRET", "line-channel-secret"
    )
    api_url: str = Field("https://api.line.me", description="The Messaging API's root.")
    data_api_url: str = Field(
        "https://api-data.line.me",
        description="Where files people send are downloaded from (the content API's root).",
    )
    reply_token_seconds: float = Field(
        50.0,
        gt=0,
        le=3600,
        description="How long after the webhook a reply token is used; later replies are "
        "pushed (LINE guarantees a token for one minute only).",
    )
    push: bool = Field(
        True,
        description="Push a reply whose reply token has expired or was used (counts "
        "against the monthly message quota); false: such a reply is not sent.",
    )
    loading_animation: bool = Field(
        True, description="Show the loading animation in one-on-one chats while answering."
    )

    def resolved_token(self) -> str | None:
        """The channel access token (from the environment or its file), if any."""
        return reveal(self.channel_access_token)

    def resolved_secret(self) -> str | None:
        """The channel secret (from the environment or its file), if any."""
        return reveal(self.channel_secret)
