"""`[channels.teams]`: the Microsoft Teams channel's settings (validated by the loader)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: Where the Bot Connector's signing keys are announced (the Bot Framework's OpenID
#: metadata; "Authenticate requests from the Bot Connector service to your bot").
OPENID_METADATA_URL = "https://login.botframework.com/v1/.well-known/openidconfiguration"
#: The sign-in authority's root; the token URL is `<root>/<tenant>/oauth2/v2.0/token`.
LOGIN_URL = "https://login.microsoftonline.com"
#: The tenant a multi-tenant bot asks for its token ("Authenticate requests from your bot
#: to the Bot Connector service").
MULTI_TENANT = "botframework.com"
#: What the bot's token is for: the Bot Connector.
TOKEN_SCOPE = "https://api.botframework.com/.default"
#: The public cloud's Teams service URL for messages that answer nothing (a scheduled
#: job's): used only for a conversation no activity has come from since the start.
SERVICE_URL = "https://smba.trafficmanager.net/teams/"
#: A Teams message holds at most 100 KB of JSON, counted in UTF-16 (format-your-bot-
#: messages): 20,000 characters stay far below it, emoji and formatting included.
MAX_MESSAGE_CHARS = 20_000

_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class TeamsSettings(AccessSection):
    """A Microsoft Teams bot (an Azure Bot with the Teams channel; docs/teams.md)."""

    enabled: bool = Field(False, description="Serve a Microsoft Teams bot (an Azure Bot).")
    app_id: str | None = Field(
        None,
        description="The bot's Microsoft App ID (its Entra app registration's Application "
        "(client) ID, shown on the Azure Bot's Configuration page).",
        examples=["00000000-0000-0000-0000-000000000000"],
    )
    app_password: SecretStr | None = secret(
        "a client secret of the bot's Entra app registration (Certificates & secrets)",
        "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD",
    )
    app_password_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD", "teams-app-password"
    )
    tenant_id: str | None = Field(
        None,
        description="The Directory (tenant) ID of a single-tenant bot (its token comes from "
        "that tenant); unset for a multi-tenant bot (botframework.com).",
        examples=["00000000-0000-0000-0000-000000000000"],
    )
    endpoint_path: str = Field(
        "/api/messages",
        description="The path of the messaging endpoint on the gateway's HTTP port (the Azure "
        "Bot's messaging endpoint is https://<your host><this path>).",
    )
    openid_metadata_url: str = Field(
        OPENID_METADATA_URL,
        description="The Bot Framework's OpenID metadata: where the keys that sign every "
        "activity are listed (change only for a sovereign cloud or a test double).",
    )
    token_url: str | None = Field(
        None,
        description="Where the bot gets its access token (client credentials); unset: "
        "https://login.microsoftonline.com/<tenant_id or botframework.com>/oauth2/v2.0/token.",
    )
    service_url: str = Field(
        SERVICE_URL,
        description="The Teams service URL for a message that answers no activity (a "
        "scheduled job's) to a conversation not heard from since the start; replies go to "
        "the service URL of the activity they answer.",
    )
    max_message_chars: int = Field(
        MAX_MESSAGE_CHARS,
        ge=1000,
        le=40_000,
        description="The longest message sent, in characters; longer replies are split.",
    )

    @field_validator("tenant_id")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        if value is not None and value != MULTI_TENANT and not _GUID.fullmatch(value):
            raise ValueError(
                f"{value!r}: the Directory (tenant) ID is a GUID (Entra admin center > "
                "Overview > Tenant ID)"
            )
        return value

    @field_validator("endpoint_path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r}: a path starts with / (e.g. /api/messages)")
        return value

    def resolved_password(self) -> str | None:
        """The client secret (from the environment or `app_password_file`), if any."""
        return reveal(self.app_password)

    def resolved_token_url(self) -> str:
        """Where the client-credentials token is asked for."""
        if self.token_url:
            return self.token_url
        return f"{LOGIN_URL}/{self.tenant_id or MULTI_TENANT}/oauth2/v2.0/token"
