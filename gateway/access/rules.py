"""Who may talk to the bot on one channel: `ChannelAccessPolicy`, the value a channel's
settings become. A pure vocabulary, below the configuration (channels declare theirs from
their settings: `gateway.registry.ChannelSpec.access`); `gateway.access.policy` decides
with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.messages import InboundMessage

#: In `allow_from`: anyone.
WILDCARD = "*"

#: Seconds before a pending pairing code is sent again to a sender who keeps writing.
PAIRING_RESEND_INTERVAL = 300.0

DmPolicy = Literal["open", "allowlist", "pairing"]

GroupPolicy = Literal["open", "allowlist", "disabled"]


@dataclass(frozen=True, slots=True)
class ChannelAccessPolicy:
    """Who may talk to the bot on one channel.

    `allow_from` holds sender ids or chat ids (a group's id lets everyone in it in),
    or "*" for anyone. DMs: `open` answers everyone, `allowlist` only `allow_from`,
    `pairing` also senders an operator approved by code. Groups: `open`, `allowlist`
    (`allow_from` and approved senders) or `disabled`; with `require_mention` the bot
    answers in a group only when mentioned or replied to. A pending code is sent again
    to its sender at most once per `pairing_resend_interval` seconds.
    """

    dm_policy: DmPolicy = "pairing"
    allow_from: frozenset[str] = frozenset()
    group_policy: GroupPolicy = "allowlist"
    require_mention: bool = True
    pairing_ttl: float = 3600.0
    max_pending: int = 100
    pairing_resend_interval: float = PAIRING_RESEND_INTERVAL
    #: Domains whose every sender is listed (email: `example.com` lets in
    #: `*@example.com`, not `*@sub.example.com`); matched on the sender id's part after
    #: its last "@".
    allow_domains: frozenset[str] = frozenset()
    #: Refuse unlisted senders without a reply (`Ignore` instead of `Deny`): on email most
    #: of them are spam with a forged sender, whom a refusal would only reach as backscatter.
    silent_refusals: bool = False

    def __post_init__(self) -> None:
        if self.dm_policy not in ("open", "allowlist", "pairing"):
            raise ValueError(
                f"dm_policy must be open, allowlist or pairing, not {self.dm_policy!r}"
            )
        if self.group_policy not in ("open", "allowlist", "disabled"):
            raise ValueError(
                f"group_policy must be open, allowlist or disabled, not {self.group_policy!r}"
            )
        if not isinstance(self.allow_from, frozenset):
            object.__setattr__(self, "allow_from", frozenset(self.allow_from))
        if not isinstance(self.allow_domains, frozenset):
            object.__setattr__(self, "allow_domains", frozenset(self.allow_domains))
        if self.pairing_ttl <= 0 or self.max_pending < 1:
            raise ValueError("pairing_ttl and max_pending must be positive")
        if self.pairing_resend_interval < 0:
            raise ValueError("pairing_resend_interval must not be negative")

    def lists(self, msg: InboundMessage) -> bool:
        """Is the sender or the chat in `allow_from`?"""
        allowed = self.allow_from
        if WILDCARD in allowed or msg.sender_id in allowed or msg.chat_id in allowed:
            return True
        _, at, domain = msg.sender_id.rpartition("@")
        return bool(at and self.allow_domains and domain in self.allow_domains)
