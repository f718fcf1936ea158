"""`[channels.matrix]`: the Matrix channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class MatrixSettings(AccessSection):
    """A Matrix account the gateway answers as (channels/matrix, docs/matrix.md)."""

    enabled: bool = Field(False, description="Serve a Matrix account.")
    homeserver: str | None = Field(
        None,
        description="The homeserver's client-server API URL.",
        examples=["https://matrix.example.org"],
    )
    user_id: str | None = Field(
        None, description="The bot account's full Matrix id.", examples=["@gateway:example.org"]
    )
    access_token: SecretStr | None = secret(
        "the account's access token", "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN"
    )
    access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN", "matrix-access-token"
    )
    sync_timeout: int = Field(30, ge=0, le=120, description="Long-poll seconds per /sync.")
    encryption: bool = Field(
        True,
        description="Take part in end-to-end encrypted rooms (docs/matrix.md, section 7); "
        "false declines them with a reason.",
    )
    room_key_wait: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds an encrypted message waits for its room key before its sender "
        "is told it could not be read (later messages of its room wait behind it).",
    )

    @field_validator("user_id")
    @classmethod
    def _matrix_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"@[^:\s]+:\S+", value):
            raise ValueError("a Matrix user id looks like @gateway:example.org")
        return value

    def resolved_token(self) -> str | None:
        """The access token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)
