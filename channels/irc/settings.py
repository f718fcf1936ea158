"""`[channels.irc]`: the IRC channel's settings (validated by the gateway's loader)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, SecretStr, field_validator

from gateway.config.access import AccessSection
from gateway.config.section import reveal, secret, secret_file

#: A nick as servers take it (RFC 2812, with the digits and `-` most servers allow first).
NICK = re.compile(r"[A-Za-z\[\]\\`_^{|}][A-Za-z0-9\[\]\\`_^{|}-]{0,49}")
#: A network's name in session keys: no colon (the key's separator), no space.
NETWORK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class IrcSettings(AccessSection):
    """One nick on one IRC network: its channels (groups, answered when addressed by
    nick) and private messages (DMs, pairing by default)."""

    enabled: bool = Field(False, description="Serve an IRC bot.")
    host: str | None = Field(None, description="IRC server.", examples=["irc.libera.chat"])
    port: int | None = Field(
        None, ge=1, le=65535, description="Default: 6697 with tls, 6667 without."
    )
    tls: bool = Field(True, description="TLS from the first byte (IRC over TLS, port 6697).")
    tls_ca_file: Path | None = Field(
        None,
        description="CA certificate(s) the server's certificate is checked against, for a "
        "server with a private CA; default: the system's.",
        examples=["/etc/ssl/private-ca.pem"],
    )
    network: str | None = Field(
        None,
        description="The network's name in session keys (irc:<network>:#channel), kept when "
        "the server changes; default: the host.",
        examples=["libera"],
    )
    nick: str = Field("gateway", description="The bot's nick (`_` is appended while it is taken).")
    username: str | None = Field(None, description="The user name (ident); default: the nick.")
    realname: str = Field("chat gateway", description="The real name (shown by WHOIS).")
    channels: list[str] = Field(
        default_factory=list,
        description='Channels joined after connecting; a key after a space: "#team secret".',
        examples=[["#team", "#help"]],
    )
    password: SecretStr | None = secret(
        "the server password (PASS)", "GATEWAY_CHANNELS__IRC__PASSWORD"
    )
    password_file: Path | None = secret_file("GATEWAY_CHANNELS__IRC__PASSWORD", "irc-password")
    sasl_username: str | None = Field(
        None,
        description="Log in with SASL PLAIN as this account before registering (the network's "
        "services account); the connection fails when the server cannot do SASL.",
    )
    sasl_password: SecretStr | None = secret(
        "the SASL account's password", "GATEWAY_CHANNELS__IRC__SASL_PASSWORD"
    )
    sasl_password_file: Path | None = secret_file(
        "GATEWAY_CHANNELS__IRC__SASL_PASSWORD", "irc-sasl-password"
    )
    burst_lines: int = Field(
        5, ge=1, le=50, description="Lines the bot may send at once before it is paced."
    )
    line_interval_seconds: float = Field(
        1.0,
        gt=0,
        le=10,
        description="After the burst, one line per this many seconds (servers disconnect or "
        "delay a client that floods).",
    )
    formatting: bool = Field(
        True, description="Bold, italics and monospace as mIRC codes; false: plain text."
    )
    reconnect_max_seconds: float = Field(
        300.0, ge=1, description="The longest wait between two connection attempts."
    )
    history_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="Where the server has IRCv3 chathistory: after a reconnect, read back "
        "what was written while away up to this old.",
    )
    history_max_messages: int = Field(
        500, ge=1, le=10_000, description="At most this many messages read back per conversation."
    )

    @field_validator("nick")
    @classmethod
    def _nick(cls, value: str) -> str:
        if not NICK.fullmatch(value):
            raise ValueError(
                "a nick is a letter or one of [ ] \\ ` _ ^ { | } followed by those, digits or -"
            )
        return value

    @field_validator("network")
    @classmethod
    def _network(cls, value: str | None) -> str | None:
        if value is not None and not NETWORK.fullmatch(value):
            raise ValueError("letters, digits, '.', '_' and '-' only (it is part of session keys)")
        return value

    @field_validator("channels")
    @classmethod
    def _channels(cls, value: list[str]) -> list[str]:
        for entry in value:
            name = entry.split(" ", 1)[0]
            if not name or name[0] not in "#&+!" or "," in name or "\x07" in name:
                raise ValueError(f"{entry!r} is not a channel name (#name)")
        return value

    def resolved_port(self) -> int:
        return self.port or (6697 if self.tls else 6667)

    def resolved_network(self) -> str:
        """The network's name in session keys."""
        return self.network or (self.host or "irc").lower()

    def resolved_password(self) -> str | None:
        return reveal(self.password)

    def resolved_sasl_password(self) -> str | None:
        return reveal(self.sasl_password)
