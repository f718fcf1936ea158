"""`[channels.slack]`: the Slack channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import secret, secret_file


class SlackSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Slack app.")
    bot_token: SecretStr | None = secret("xoxb- token", "GATEWAY_CHANNELS__SLACK__BOT_TOKEN")
    bot_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__BOT_TOKEN", "slack-bot-token"
    )
    app_token: SecretStr | None = secret(
        "xapp- token for Socket Mode", "GATEWAY_CHANNELS__SLACK__APP_TOKEN"
    )
    app_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__APP_TOKEN", "slack-app-token"
    )
    signing_secret: SecretStr | None = secret(
        "signing secret for HTTP mode", "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET"
    )
    signing_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET", "slack-signing-secret"
    )
    mode: Literal["socket", "http"] = Field(
        "socket", description="socket (no public URL needed) or http (/slack/events)."
    )
    base_url: str | None = Field(
        None,
        description="Web API URL, e.g. https://slack-gov.com/api/ for GovSlack.",
        examples=["https://slack-gov.com/api/"],
    )
    reply_mode: Literal["thread", "channel"] = Field(
        "thread",
        description="Where to answer: thread = always in a thread, channel = in the channel.",
    )
