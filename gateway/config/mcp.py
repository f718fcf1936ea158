"""`[mcp]`: MCP servers whose tools the model may call."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from pydantic import Field, field_validator, model_validator

from gateway.config.section import Section

_MCP_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_))*")


class MCPServerSettings(Section):
    """One MCP server: a command run over stdio, or a streamable HTTP url."""

    enabled: bool = Field(True, description="Start this server with the gateway.")
    command: str | None = Field(None, description="Program to run (stdio transport).")
    args: list[str] = Field(default_factory=list, description="Its arguments.")
    url: str | None = Field(None, description="Streamable HTTP endpoint instead of a command.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of the command (no secrets here)."
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the gateway's environment passed on to the command "
        "(secrets go this way); nothing else of it is, but PATH, HOME and the like.",
    )
    tools: list[str] | None = Field(
        None, description="Tools of the server offered to the model; unset = all."
    )
    timeout: float = Field(30.0, gt=0, le=3600, description="Seconds one tool call may take.")
    startup_timeout: float = Field(
        30.0, gt=0, le=600, description="Seconds the server may take to start and list tools."
    )

    def extra_secrets(self) -> Iterator[tuple[str, str]]:
        """The values of the variables `pass_env` hands the server: the way secrets go
        to it, so they are redacted like any configured secret."""
        for name in self.pass_env:
            value = os.environ.get(name)
            if value:
                yield f"pass_env {name}", value

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) and url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("url: use an http:// or https:// address")
        if self.url is not None and (self.env or self.pass_env):
            raise ValueError("env and pass_env are for a command, not for a url")
        return self


class MCPSettings(Section):
    servers: dict[str, MCPServerSettings] = Field(
        default_factory=dict,
        description="MCP servers whose tools the model may call, as NAME__tool: a "
        "[mcp.servers.NAME] table each. They reach outside the gateway: none by default.",
    )

    @field_validator("servers")
    @classmethod
    def _names(cls, value: dict[str, MCPServerSettings]) -> dict[str, MCPServerSettings]:
        for name in value:
            if len(name) > 32 or not _MCP_NAME.fullmatch(name):
                raise ValueError(
                    f"server name {name!r}: use up to 32 letters, digits, - and single _ "
                    "(tools are named NAME__tool)"
                )
        return value
