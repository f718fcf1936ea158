"""`[channels.example]`: the example channel's settings, validated by the gateway's loader
like every section (strict types, unknown keys refused, GATEWAY_CHANNELS__EXAMPLE__<KEY>)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file
from pydantic import Field, SecretStr

Defect = Literal["confirm_before_journal", "answer_unaddressed", "repost_on_replay"]


class ExampleSettings(AccessSection):
    enabled: bool = Field(False, description="Serve an Example Chat bot.")
    token: SecretStr | None = secret("the bot's API token", "GATEWAY_CHANNELS__EXAMPLE__TOKEN")
    token_file: Path | None = secret_file("GATEWAY_CHANNELS__EXAMPLE__TOKEN", "example-token")
    api_url: str = Field("http://127.0.0.1:8700", description="Example Chat's API root.")
    mode: Literal["polling", "webhook"] = Field(
        "polling", description="polling (GET /updates; no public URL needed) or webhook."
    )
    poll_timeout: int = Field(30, ge=0, le=60, description="Long-poll seconds per request.")
    webhook_url: str | None = Field(
        None,
        description="The URL Example Chat posts updates to: this gateway's /example/webhook "
        "(webhook mode).",
        examples=["https://bot.example.org/example/webhook"],
    )
    webhook_secret: SecretStr | None = secret(
        "the secret webhook deliveries are signed with", "GATEWAY_CHANNELS__EXAMPLE__WEBHOOK_SECRET"
    )
    webhook_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__EXAMPLE__WEBHOOK_SECRET", "example-webhook-secret"
    )
    # Not for a channel of your own: the kit's negative controls break this one on purpose.
    defect: Defect | None = Field(
        None,
        description="For the conformance kit's own tests only: run a variant of the channel "
        "that breaks the delivery promise on purpose (gateway_channel_example.defects).",
    )

    def resolved_token(self) -> str | None:
        return reveal(self.token)

    def resolved_webhook_secret(self) -> str | None:
        return reveal(self.webhook_secret)
