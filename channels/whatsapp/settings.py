"""`[channels.whatsapp]`: the WhatsApp channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file


class WhatsAppSettings(AccessSection):
    """A WhatsApp Business number through the Cloud API (channels/whatsapp, docs/whatsapp.md)."""

    enabled: bool = Field(False, description="Serve WhatsApp Business numbers (Cloud API).")
    phone_number_ids: list[str] = Field(
        default_factory=list,
        description="The business numbers' phone number ids (WhatsApp Manager > API Setup); "
        "messages to other numbers are acknowledged and ignored.",
    )
    access_token: SecretStr | None = secret(
        "a system user's token with whatsapp_business_messaging",
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN",
    )
    access_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN", "whatsapp-access-token"
    )
    app_secret: SecretStr | None = secret(
        "the Meta app's secret, which signs every webhook (X-Hub-Signature-256)",
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET",
    )
    app_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET", "whatsapp-app-secret"
    )
    verify_token: SecretStr | None = secret(
        "the webhook's verify token, as typed in the App Dashboard",
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN",
    )
    verify_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN", "whatsapp-verify-token"
    )
    api_url: str = Field(
        "https://graph.facebook.com", description="The Graph API's root (no version)."
    )
    api_version: str = Field("v26.0", description="The Graph API version the requests name.")
    template: str | None = Field(
        None,
        description="An approved template sent instead of a reply that falls outside the "
        "24-hour customer-service window; unset: such a reply is kept as undeliverable.",
        examples=["pending_reply"],
    )
    template_language: str = Field("en", description="The template's language code.")
    template_parameter: bool = Field(
        True,
        description="Pass the start of the reply as the template body's {{1}} parameter.",
    )
    quote_replies: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Quote the person's message in the reply: auto = only when they wrote "
        "again meanwhile.",
    )
    read_receipts: bool = Field(
        True, description="Mark messages read and show the typing indicator while answering."
    )

    @field_validator("phone_number_ids")
    @classmethod
    def _digits(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.isdigit():
                raise ValueError(f"{item!r}: a phone number id is digits only (not the number)")
        return value

    def resolved_token(self) -> str | None:
        """The Graph API token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)
