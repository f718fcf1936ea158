"""`[channels.dingtalk]`: the DingTalk channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class DingTalkSettings(AccessSection):
    """A DingTalk robot of an internal app, in stream mode (channels/dingtalk,
    docs/dingtalk.md)."""

    enabled: bool = Field(False, description="Serve a DingTalk robot (stream mode).")
    client_id: str = Field(
        "", description="The app's Client ID (formerly AppKey), under Credentials & Basic Info."
    )
    client_secret: SecretStr | None = secret(
        "the app's Client Secret (formerly AppSecret)", "GATEWAY_CHANNELS__DINGTALK__CLIENT_SECRET"
    )
    client_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__DINGTALK__CLIENT_SECRET", "dingtalk-client-secret"
    )
    robot_code: str = Field(
        "",
        description="The robot's RobotCode, for replies through the robot API; empty = the "
        "Client ID (the same for an internal app's robot).",
    )
    api_url: str = Field(
        "https://api.dingtalk.com",
        description="DingTalk's open API root (the stream connection and the robot API).",
    )
    part_chars: int = Field(
        3500,
        ge=200,
        le=5000,
        description="The longest reply part, in characters (a markdown message holds 5,000).",
    )
    session_webhook: bool = Field(
        True,
        description="Reply through the message's session webhook while it is valid (it "
        "can @ the sender); false = always through the robot API.",
    )

    def resolved_secret(self) -> str | None:
        """The Client Secret (from the environment or `client_secret_file`), if any."""
        return reveal(self.client_secret)

    def resolved_robot_code(self) -> str:
        """The robot code the robot API is called with."""
        return self.robot_code or self.client_id

    def base_url(self) -> str:
        """The open API's root the channel calls."""
        return self.api_url.rstrip("/")
