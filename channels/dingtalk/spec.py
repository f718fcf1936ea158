"""The DingTalk channel's declaration (`chat_gateway.channels` entry point `dingtalk`):
DingTalk's stream mode (a WebSocket the robot opens) and its robot API, over the gateway's
own aiohttp (channels/dingtalk/channel.py says why not the `dingtalk-stream` library)."""

from __future__ import annotations

from typing import Any

from channels.dingtalk.settings import DingTalkSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__DINGTALK__"


def build(section: DingTalkSettings, services: ChannelServices) -> Any:
    """The channel and its counts on /metrics. No leader role: DingTalk pushes each
    callback to one of an app's stream connections, so every replica holds its own."""
    from channels.dingtalk.channel import DingTalkChannel

    channel = DingTalkChannel(section, client_secret=section.resolved_secret() or "")
    metrics, stats = services.metrics, channel.stats
    repushes = metrics.counter(
        "repushes_total",
        "DingTalk callbacks pushed again after this process had journaled them (acked at once).",
    )
    rate_limited = metrics.counter(
        "rate_limited_total", "DingTalk sends refused for a rate limit and waited out."
    )
    fallbacks = metrics.counter(
        "webhook_fallbacks_total",
        "Replies sent through the robot API because the session webhook expired or refused.",
    )

    async def refresh() -> None:
        repushes.set_total(stats.repushes)
        rate_limited.set_total(stats.rate_limited)
        fallbacks.set_total(stats.webhook_fallbacks)

    metrics.on_scrape(refresh)
    return channel


async def checks(section: DingTalkSettings) -> list[Finding]:
    """The app's Client ID and Secret set, and accepted by DingTalk."""
    missing = required_settings(
        "dingtalk",
        [
            (
                "a Client ID",
                "set channels.dingtalk.client_id (Credentials & Basic Info in the developer "
                "console)",
                section.client_id,
            ),
            ("a Client Secret", f"set {PREFIX}CLIENT_SECRET", section.resolved_secret()),
        ],
    )
    if missing:
        return missing
    from channels.dingtalk.channel import check_credentials

    return [
        await remote_check("dingtalk", check_credentials(section, section.resolved_secret() or ""))
    ]


SPEC = ChannelSpec(
    name="dingtalk",
    settings=DingTalkSettings,
    build=build,
    summary="a DingTalk robot: one-to-one chats and groups (stream mode, markdown replies)",
    docs="docs/dingtalk.md",
    offers=Offers(groups=True, threads=False, edits=False, catch_up=True, webhooks=False),
    extra="dingtalk",
    checks=checks,
    people=PersonIds(
        r"[A-Za-z0-9_$:+/=.-]{1,128}",
        "a DingTalk id is the person's userId (staffId) in the organization, e.g. "
        "dingtalk:manager4220",
        dm_keyed=False,
    ),
)
