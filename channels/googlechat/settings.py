"""`[channels.googlechat]`: the Google Chat channel's settings (validated by the loader)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: The largest message the Chat API creates, text and cards together, in bytes.
MAX_MESSAGE_BYTES = 32_000
#: Who signs the bearer token of a request from Google Chat (the project number form),
#: and whose email an ID token (the endpoint URL form) names.
CHAT_ISSUER = "chat@system.gserviceaccount.com"


class GoogleChatSettings(AccessSection):
    """A Google Chat app on an HTTP endpoint (channels/googlechat, docs/googlechat.md)."""

    enabled: bool = Field(False, description="Serve a Google Chat app (an HTTP endpoint).")
    audience: str | None = Field(
        None,
        description="The Chat app's authentication audience, as set in the Google Cloud "
        "console (Chat API > Configuration > Connection settings): the project number, or "
        "the HTTP endpoint URL. Every request from Google Chat is checked against it.",
        examples=["1234567890", "https://gateway.example.com/googlechat/events"],
    )
    service_account_key: SecretStr | None = secret(
        "the service account's key (its JSON file's content), with which replies go out",
        "GATEWAY_CHANNELS__GOOGLECHAT__SERVICE_ACCOUNT_KEY",
    )
    service_account_key_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__GOOGLECHAT__SERVICE_ACCOUNT_KEY", "googlechat-service-account.json"
    )
    api_url: str = Field(
        "https://chat.googleapis.com", description="The Chat API's root (no version)."
    )
    chat_certs_url: str = Field(
        f"https://www.googleapis.com/service_accounts/v1/metadata/x509/{CHAT_ISSUER}",
        description="Where the keys that sign Google Chat's bearer tokens are published "
        "(the project number audience).",
    )
    google_certs_url: str = Field(
        "https://www.googleapis.com/oauth2/v1/certs",
        description="Where Google's ID token keys are published (the endpoint URL audience).",
    )
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES,
        ge=1000,
        le=MAX_MESSAGE_BYTES,
        description="The longest message sent, in bytes of UTF-8 (the Chat API takes "
        "32,000); longer replies are split.",
    )

    @field_validator("audience")
    @classmethod
    def _audience(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value.isdigit() and not value.startswith(("https://", "http://")):
            raise ValueError(
                "the audience is the project number (digits) or the app's endpoint URL "
                "(https://...), as in the console's Connection settings"
            )
        return value

    def resolved_key(self) -> str | None:
        """The service account's key JSON (from the environment or its file), if any."""
        return reveal(self.service_account_key)
