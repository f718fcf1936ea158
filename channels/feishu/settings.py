"""`[channels.feishu]`: the Feishu / Lark channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: The open platform of each brand: Feishu (mainland China) and Lark (elsewhere).
DOMAINS = {"feishu": "https://open.feishu.cn", "lark": "https://open.larksuite.com"}


class FeishuSettings(AccessSection):
    """A Feishu or Lark bot: an enterprise self-built app (channels/feishu, docs/feishu.md)."""

    enabled: bool = Field(False, description="Serve a Feishu / Lark bot.")
    domain: Literal["feishu", "lark"] = Field(
        "feishu",
        description="The brand: feishu = open.feishu.cn (Feishu), lark = open.larksuite.com "
        "(Lark).",
    )
    api_url: str | None = Field(
        None,
        description="The open platform's root instead of the domain's (a proxy, a test server).",
        examples=["https://open.feishu.cn"],
    )
    app_id: str = Field("", description="The app's App ID (Credentials & Basic Info), cli_...")
    app_secret: SecretStr | None = secret(
        "the app's App Secret", "GATEWAY_CHANNELS__FEISHU__APP_SECRET"
    )
    app_secret_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__FEISHU__APP_SECRET", "feishu-app-secret"
    )
    mode: Literal["websocket", "webhook"] = Field(
        "websocket",
        description="How events arrive: websocket = Feishu's long connection (no public URL "
        "needed), webhook = events POSTed to this gateway's /feishu/events.",
    )
    encrypt_key: SecretStr | None = secret(
        "the Encrypt Key (Events & Callbacks > Encryption Strategy); webhook mode",
        "GATEWAY_CHANNELS__FEISHU__ENCRYPT_KEY",
    )
    encrypt_key_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__FEISHU__ENCRYPT_KEY", "feishu-encrypt-key"
    )
    verification_token: SecretStr | None = secret(
        "the Verification Token (Events & Callbacks > Encryption Strategy); webhook mode",
        "GATEWAY_CHANNELS__FEISHU__VERIFICATION_TOKEN",
    )
    verification_token_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__FEISHU__VERIFICATION_TOKEN", "feishu-verification-token"
    )
    part_chars: int = Field(
        4000,
        ge=200,
        le=10000,
        description="The longest reply part, in characters (Feishu takes 30 KB of rich text).",
    )
    read_sender_names: bool = Field(
        True,
        description="Look up a group message's sender name when its turn starts (needs the "
        "contact:user.base:readonly scope; without it the open_id is used).",
    )

    def resolved_secret(self) -> str | None:
        """The App Secret (from the environment or `app_secret_file`), if any."""
        return reveal(self.app_secret)

    def base_url(self) -> str:
        """The open platform's root the channel calls."""
        return (self.api_url or DOMAINS[self.domain]).rstrip("/")
