"""`AccessSection`: the settings every chat platform's section shares (who may talk to the
bot: DMs, groups, mentions, pairing). A channel's settings model extends it; its
`gateway.registry.ChannelSpec.access` turns it into an access policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Section


class AccessSection(Section):
    """Who may talk to the bot on a chat platform."""

    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "pairing",
        description="Direct messages: open = anyone, allowlist = allow_from only, pairing = "
        "strangers get a code for `gateway pairing approve`.",
    )
    allow_from: list[str] = Field(
        default_factory=list, description='Sender or chat ids always allowed; "*" = anyone.'
    )
    group_policy: Literal["open", "allowlist", "disabled"] = Field(
        "allowlist", description="Groups and channels: open, allowlist or disabled."
    )
    require_mention: bool = Field(
        True, description="In groups, answer only when mentioned or replied to."
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")
    streaming: bool = Field(
        False, description="Show the reply while it is written (needs llm.stream = true)."
    )
