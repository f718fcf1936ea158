"""`[tools]`: the built-in tools' settings."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.section import Section


class WebFetchSettings(Section):
    """The `web_fetch` tool; it is offered only when agent.tools lists it."""

    timeout: float = Field(15.0, gt=0, le=300, description="Seconds one fetch may take in all.")
    max_bytes: int = Field(
        2_000_000, ge=1024, description="Bytes of a page read at most; the rest is cut."
    )
    max_chars: int = Field(
        200_000,
        ge=100,
        description="Characters of a page's text kept; past [agent] "
        "tool_output_inline_chars the model sees a preview and reads the rest on demand.",
    )
    max_redirects: int = Field(5, ge=0, le=20, description="Redirects followed, each checked.")
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Private, loopback or link-local addresses (CIDR) it may still reach, "
        'e.g. ["10.1.2.0/24"]; everything but public addresses is refused otherwise.',
    )

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an address or a CIDR network") from None
        return value


class ToolsSettings(Section):
    web_fetch: WebFetchSettings = Field(default_factory=WebFetchSettings)
