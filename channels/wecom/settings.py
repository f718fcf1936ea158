"""`[channels.wecom]`: the WeCom channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from gateway.config.access import AccessSection
from gateway.config.section import reveal
from gateway.config.section import secret as secret_field
from gateway.config.section import secret_file as secret_path

ENV = "GATEWAY_CHANNELS__WECOM__"


class WeComSettings(AccessSection):
    """A WeCom (企业微信) self-built app, its messages through the callback URL
    (channels/wecom, docs/wecom.md)."""

    enabled: bool = Field(False, description="Serve a WeCom self-built app or intelligent robot.")
    mode: Literal["callback", "robot"] = Field(
        "callback",
        description='How WeCom reaches the gateway: "callback" for a self-built app\'s '
        'encrypted callback on the gateway\'s port (one-to-one chats), "robot" for an '
        "intelligent robot's long connection (one-to-one chats and group @-mentions).",
    )
    corp_id: str = Field(
        "",
        description="The corp id (My Company > Company Information > Company ID, ww...).",
        examples=["ww0123456789abcdef"],
    )
    agent_id: int = Field(
        0, ge=0, description="The app's AgentId (App Management > the app).", examples=[1000002]
    )
    secret: SecretStr | None = secret_field(
        "the app's Secret (App Management > the app), which fetches its access token",
        f"{ENV}SECRET",
    )
    secret_file: Path | None = secret_path(f"{ENV}SECRET", "wecom-secret")
    token: SecretStr | None = secret_field(
        "the callback's Token (the app > Receive Messages > Set API Receiving), which signs "
        "every callback (msg_signature)",
        f"{ENV}TOKEN",
    )
    token_file: Path | None = secret_path(f"{ENV}TOKEN", "wecom-token")
    encoding_aes_key: SecretStr | None = secret_field(
        "the callback's EncodingAESKey (43 characters, same page), which encrypts every callback",
        f"{ENV}ENCODING_AES_KEY",
    )
    encoding_aes_key_file: Path | None = secret_path(
        f"{ENV}ENCODING_AES_KEY", "wecom-encoding-aes-key"
    )
    api_url: str = Field(
        "https://qyapi.weixin.qq.com",
        description="WeCom's server API root (gettoken, message/send).",
    )

    duplicate_check_seconds: int = Field(
        600,
        ge=0,
        le=14400,
        description="WeCom's duplicate check on every reply: the same text to the same member "
        "within this many seconds is shown once, so a send that may have gone out is sent "
        "again safely; 0 turns it off (such a send is then not repeated).",
    )

    bot_id: str = Field("", description="robot mode: the intelligent robot's BotID.")
    bot_secret: SecretStr | None = secret_field(
        "robot mode: the intelligent robot's Secret (its long connection's credential)",
        f"{ENV}BOT_SECRET",
    )
    bot_secret_file: Path | None = secret_path(f"{ENV}BOT_SECRET", "wecom-bot-secret")
    ws_url: str = Field(
        "wss://openws.work.weixin.qq.com",
        description="robot mode: the long connection's address.",
    )

    def resolved_bot_secret(self) -> str | None:
        """The robot's Secret (from the environment or its file), if any."""
        return reveal(self.bot_secret)

    def resolved_secret(self) -> str | None:
        """The app's Secret (from the environment or its file), if any."""
        return reveal(self.secret)

    def resolved_token(self) -> str | None:
        """The callback Token (from the environment or its file), if any."""
        return reveal(self.token)

    def resolved_aes_key(self) -> str | None:
        """The EncodingAESKey (from the environment or its file), if any."""
        return reveal(self.encoding_aes_key)
