"""The Slack channel's declaration (`chat_gateway.channels` entry point `slack`): light to
import; slack-bolt and slack-sdk are imported only when the channel is built."""

from __future__ import annotations

from typing import Any

from channels.slack.settings import SlackSettings
from gateway.config.section import reveal
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
)


def build(section: SlackSettings, services: ChannelServices) -> Any:
    from channels.slack.channel import SlackChannel

    channel = SlackChannel.from_settings(section)
    channel.mount(services.http)
    return channel


async def checks(section: SlackSettings) -> list[Finding]:
    findings = []
    bot = reveal(section.bot_token)
    if not bot:
        findings.append(
            Finding(
                "fail",
                "slack is enabled without a bot token",
                "set GATEWAY_CHANNELS__SLACK__BOT_TOKEN (xoxb-...)",
            )
        )
    else:
        from channels.slack.channel import check_credentials

        app = reveal(section.app_token) if section.mode == "socket" else None
        findings.append(await remote_check("slack", check_credentials(section, bot, app_token=app)))
    if section.mode == "socket" and not section.app_token:
        findings.append(
            Finding(
                "fail",
                "slack Socket Mode needs an app-level token",
                "set GATEWAY_CHANNELS__SLACK__APP_TOKEN (xapp-...)",
            )
        )
    if section.mode == "http" and not section.signing_secret:
        findings.append(
            Finding(
                "fail",
                "slack HTTP mode needs the signing secret",
                "set GATEWAY_CHANNELS__SLACK__SIGNING_SECRET",
            )
        )
    return findings


SPEC = ChannelSpec(
    name="slack",
    settings=SlackSettings,
    build=build,
    summary="a Slack app: DMs, channels and threads (Socket Mode or HTTP events)",
    docs="docs/slack.md",
    # No catch-up: Slack retries an event three times over about five minutes, then drops it.
    offers=Offers(groups=True, threads=True, edits=True, webhooks=True, media=True),
    requires=("slack_bolt", "slack_sdk"),
    extra="slack",
    checks=checks,
    people=PersonIds(r"[UW][A-Z0-9]{2,20}", "a Slack user id looks like slack:U0123ABC"),
)
