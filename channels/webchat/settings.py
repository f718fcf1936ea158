"""`[channels.web]`: the web chat's settings (validated by the gateway's loader)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator

from gateway.config.section import Section, reveal, secret, secret_file

#: What a visitor id may be (the `<visitor>` of a session key `web:<visitor>`).
VISITOR_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def origin_problem(origin: str) -> str | None:
    """Why `origin` is not an origin a page may embed the widget from (None: it is one):
    a scheme, a host and maybe a port, nothing else; https, or http on this machine."""
    parts = urlsplit(origin)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        return f"{origin!r} is not an origin such as https://shop.example"
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        return f"{origin!r} has more than a scheme, a host and a port"
    if origin != origin.lower() or origin.endswith("/"):
        return f"{origin!r}: write it in lower case without a trailing slash"
    if parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1", "::1"):
        return f"{origin!r}: a site off this machine must use https"
    return None


class WebChatSettings(Section):
    enabled: bool = Field(
        False, description="Serve the web chat: a page at /webchat/ and a widget for sites."
    )
    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "pairing",
        description="open: every visitor; allowlist: the visitor ids in allow_from only; "
        "pairing: a new visitor gets a code for `gateway pairing approve web CODE`.",
    )
    allow_from: list[str] = Field(
        default_factory=list, description='Visitor ids always allowed; "*" = anyone.'
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")
    streaming: bool = Field(
        True, description="Show the reply while it is written (needs llm.stream = true)."
    )
    password: SecretStr | None = secret(
        "the password (or a long random token) the page asks for; everyone who knows it is "
        "one person, the owner",
        "GATEWAY_CHANNELS__WEB__PASSWORD",
    )
    password_file: Path | None = secret_file("GATEWAY_CHANNELS__WEB__PASSWORD", "webchat-password")
    owner: str = Field(
        "owner",
        description="With a password: the visitor id of whoever knows it (session key "
        "web:<owner>), the same in every browser.",
    )
    title: str = Field("Chat", max_length=80, description="The page's title and heading.")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Sites whose pages may embed the widget (one <script> tag), e.g. "
        '["https://shop.example"]; none: the widget is off.',
    )
    visitor_messages_per_minute: int = Field(
        20, ge=0, description="Messages one visitor may send a minute (0: no limit)."
    )
    address_messages_per_minute: int = Field(
        60,
        ge=0,
        description="Messages all visitors from one address (an IPv6 /64) may send a minute "
        "(0: no limit).",
    )
    address_new_visitors_per_hour: int = Field(
        30,
        ge=0,
        description="New visitors (browsers without the cookie) one address may start an hour "
        "(0: no limit).",
    )
    max_message_chars: int = Field(
        8000, ge=100, le=100_000, description="The longest message a visitor may send."
    )
    max_upload_mb: float = Field(
        10.0, ge=0, le=100, description="The largest file a visitor may upload (0: no uploads)."
    )
    remember_days: int = Field(
        180, ge=1, le=400, description="How long a browser stays the same visitor (its cookie)."
    )
    history_days: int = Field(
        90,
        ge=1,
        description="How long the conversation log (what the page shows) and uploads are kept.",
    )

    @field_validator("owner")
    @classmethod
    def _owner_is_an_id(cls, value: str) -> str:
        if not VISITOR_ID.fullmatch(value):
            raise ValueError("use 1-64 characters from A-Z, a-z, 0-9, _ and -")
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            problem = origin_problem(origin)
            if problem is not None:
                raise ValueError(problem)
        return value

    def resolved_password(self) -> str | None:
        """The password (from the environment or `password_file`), if any."""
        return reveal(self.password)
