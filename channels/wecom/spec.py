"""The WeCom channel's declaration (`chat_gateway.channels` entry point `wecom`): a WeCom
(企业微信) self-built app in callback mode, over the gateway's own HTTP client (aiohttp)
and port."""

from __future__ import annotations

from typing import Any

from channels.wecom.settings import ENV, WeComSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)


def build(section: WeComSettings, services: ChannelServices) -> Any:
    """The channel, its callback on the gateway's port (with replicas, every replica takes
    requests); counted on /metrics, replies it gave up listed on the admin page. Robot
    mode: the robot's long connection (one gateway: WeCom allows one connection)."""
    if section.mode == "robot":
        return build_robot(section, services)
    from channels.wecom.channel import REFUSAL_REASONS, WeComChannel

    channel = WeComChannel.from_settings(section)
    channel.mount(services.http)
    services.admin.undeliverable(channel.undeliverable)
    metrics, stats = services.metrics, channel.stats
    sent = metrics.counter("messages_sent_total", "WeCom text messages sent (message/send).")
    refused = metrics.counter(
        "replies_refused_total",
        "WeCom replies not sent, by why: not_visible (81013, the member is outside the "
        "app's visible range), ip_not_trusted (60020), refused (another errcode).",
        ("reason",),
    )
    rate_limited = metrics.counter(
        "rate_limited_total",
        "WeCom answers 45009 / 45033 / -1 (a frequency limit, busy), waited out and repeated.",
    )
    bad_signatures = metrics.counter(
        "bad_signatures_total",
        "WeCom callbacks refused: a missing or wrong msg_signature, or not for this corp id.",
    )

    async def refresh() -> None:
        sent.set_total(stats.sent)
        for reason in REFUSAL_REASONS:
            refused.set_total(stats.refused[reason], reason)
        rate_limited.set_total(stats.rate_limited)
        bad_signatures.set_total(stats.bad_signatures)

    metrics.on_scrape(refresh)
    return channel


def build_robot(section: WeComSettings, services: ChannelServices) -> Any:
    from channels.wecom.robot import WeComRobotChannel
    from gateway.config import ConfigError

    if services.replicas:
        raise ConfigError(
            "channels.wecom: robot mode holds the robot's one long connection and runs on one "
            'gateway; with replicas use mode = "callback" (docs/wecom.md)'
        )
    channel = WeComRobotChannel.from_settings(section)
    metrics = services.metrics
    sent = metrics.counter("robot_messages_sent_total", "WeCom robot replies sent.")
    refused = metrics.counter("robot_replies_refused_total", "WeCom robot replies refused.")
    connections = metrics.counter(
        "robot_connections_total", "The robot's long connections (the first, and every reconnect)."
    )

    async def refresh() -> None:
        sent.set_total(channel.sent)
        refused.set_total(channel.refused)
        connections.set_total(channel.connections)

    metrics.on_scrape(refresh)
    return channel


async def checks(section: WeComSettings) -> list[Finding]:
    """Callback mode: the corp id, AgentId, Secret, Token and EncodingAESKey set, and an
    access token issued for them. Robot mode: the BotID and Secret, and a subscription."""
    if section.mode == "robot":
        robot_missing = required_settings(
            "wecom",
            [
                (
                    "the robot's BotID",
                    f"set {ENV}BOT_ID (the robot's API mode page)",
                    section.bot_id,
                ),
                (
                    "the robot's Secret",
                    f"set {ENV}BOT_SECRET (the same page)",
                    section.resolved_bot_secret(),
                ),
            ],
        )
        if robot_missing:
            return robot_missing
        from channels.wecom.robot import check_robot

        return [await remote_check("wecom", check_robot(section))]
    console = "WeCom admin console > App Management > the app"
    missing = required_settings(
        "wecom",
        [
            (
                "the corp id",
                f"set {ENV}CORP_ID (My Company > Company Information)",
                section.corp_id,
            ),
            ("the app's AgentId", f"set {ENV}AGENT_ID ({console})", section.agent_id),
            ("the app's Secret", f"set {ENV}SECRET ({console})", section.resolved_secret()),
            (
                "the callback Token",
                f"set {ENV}TOKEN ({console} > Receive Messages > Set API Receiving)",
                section.resolved_token(),
            ),
            (
                "the EncodingAESKey",
                f"set {ENV}ENCODING_AES_KEY (the same page); every callback is encrypted with it",
                section.resolved_aes_key(),
            ),
        ],
    )
    if missing:
        return missing
    from channels.wecom.channel import check_credentials

    return [await remote_check("wecom", check_credentials(section))]


SPEC = ChannelSpec(
    name="wecom",
    settings=WeComSettings,
    build=build,
    summary="WeCom (企业微信): a self-built app's one-to-one chats (an encrypted, signed "
    "callback on the gateway's port), or an intelligent robot's chats and group @-mentions "
    "(its long connection)",
    docs="docs/wecom.md",
    offers=Offers(groups=True, catch_up=True, webhooks=True),
    checks=checks,
    failpoints=("wecom.before_ack",),
    people=PersonIds(
        r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}",
        "a WeCom id is the member's UserID (letters, digits, _ - . @), e.g. wecom:ZhangSan",
    ),
)
