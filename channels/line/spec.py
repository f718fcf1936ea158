"""The LINE channel's declaration (`chat_gateway.channels` entry point `line`): the LINE
Messaging API over the gateway's own HTTP client (aiohttp) and port."""

from __future__ import annotations

from typing import Any

from channels.line.settings import LineSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__LINE__"


def build(section: LineSettings, services: ChannelServices) -> Any:
    """The channel, its webhook on the gateway's port (with replicas, every replica takes
    requests); counted on /metrics, replies it gave up listed on the admin page."""
    from channels.line.channel import REFUSAL_REASONS, LineChannel

    channel = LineChannel.from_settings(section)
    channel.mount(services.http)
    services.admin.undeliverable(channel.undeliverable)
    metrics, stats = services.metrics, channel.stats
    sent = metrics.counter(
        "messages_sent_total",
        "LINE messages sent, by how: reply (a reply token, free) or push (counted "
        "against the monthly message quota).",
        ("how",),
    )
    refused = metrics.counter(
        "replies_refused_total",
        "LINE replies not sent, by why: monthly_limit (push quota used up), refused "
        "(another 4xx), push_disabled (token expired and channels.line.push off).",
        ("reason",),
    )
    expired = metrics.counter(
        "expired_reply_tokens_total",
        "LINE replies pushed because their reply token was too old, used or refused.",
    )
    bad_signatures = metrics.counter(
        "bad_signatures_total",
        "LINE webhook requests refused for a missing or wrong X-Line-Signature.",
    )

    async def refresh() -> None:
        for how in ("reply", "push"):
            sent.set_total(stats.sent[how], how)
        for reason in REFUSAL_REASONS:
            refused.set_total(stats.refused[reason], reason)
        expired.set_total(stats.expired_tokens)
        bad_signatures.set_total(stats.bad_signatures)

    metrics.on_scrape(refresh)
    return channel


async def checks(section: LineSettings) -> list[Finding]:
    """The token and the channel secret set, the token valid, and the month's push
    messages not used up."""
    missing = required_settings(
        "line",
        [
            (
                "a channel access token",
                f"set {PREFIX}CHANNEL_ACCESS_TOKEN (LINE Developers Console > the channel > "
                "Messaging API > Channel access token)",
                section.resolved_token(),
            ),
            (
                "the channel secret",
                f"set {PREFIX}CHANNEL_SECRET (the channel's Basic settings); every webhook "
                "is checked against it",
                section.resolved_secret(),
            ),
        ],
    )
    if missing:
        return missing
    from channels.line.channel import check_credentials, quota_line

    found = [await remote_check("line", check_credentials(section))]
    if found[0].status == "ok" and section.push:
        try:
            status, text = await quota_line(section)
        except Exception as exc:
            found.append(Finding("warn", f"line push quota not read: {exc}"))
        else:
            fix = (
                "replies that miss their reply token's minute cannot be pushed; raise the "
                "plan in LINE Official Account Manager (docs/line.md, 'The message quota')"
                if status != "ok"
                else ""
            )
            found.append(Finding(status, text, fix))  # type: ignore[arg-type]
    return found


SPEC = ChannelSpec(
    name="line",
    settings=LineSettings,
    build=build,
    summary="a LINE Official Account: one-on-one chats, groups and rooms (a signed webhook "
    "on the gateway's port)",
    docs="docs/line.md",
    offers=Offers(groups=True, catch_up=True, webhooks=True, media=True),
    checks=checks,
    failpoints=("line.before_ack",),
    people=PersonIds(
        r"U[0-9a-f]{32}", "a LINE user id is U and 32 hex digits, e.g. line:U4af4980629..."
    ),
)
