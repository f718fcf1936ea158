"""The Telegram channel's declaration (`chat_gateway.channels` entry point `telegram`):
light to import; python-telegram-bot is imported only when the channel is built."""

from __future__ import annotations

from typing import Any

from channels.telegram.settings import TelegramSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
)

#: With replicas, one holds the bot's long poll: Telegram allows one getUpdates at a time.
POLL_ROLE = "telegram poller"


def build(section: TelegramSettings, services: ChannelServices) -> Any:
    from channels.telegram.channel import TelegramChannel

    channel = TelegramChannel(section, token=section.resolved_token() or "")
    channel.mount(services.http)
    if section.mode == "polling":
        channel.poll_leader = services.storage.leader(POLL_ROLE)
    return channel


async def checks(section: TelegramSettings) -> list[Finding]:
    token = section.resolved_token()
    findings = []
    if not token:
        findings.append(
            Finding(
                "fail",
                "telegram is enabled without a bot token",
                "set GATEWAY_CHANNELS__TELEGRAM__TOKEN (from @BotFather)",
            )
        )
    else:
        from channels.telegram.channel import check_credentials

        findings.append(await remote_check("telegram", check_credentials(section, token)))
    if section.mode == "webhook" and not (section.webhook_url and section.webhook_secret):
        findings.append(
            Finding(
                "fail",
                "telegram webhook mode needs webhook_url and a secret",
                "set channels.telegram.webhook_url and GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET",
            )
        )
    return findings


SPEC = ChannelSpec(
    name="telegram",
    settings=TelegramSettings,
    build=build,
    summary="a Telegram bot: private chats, groups and forum topics (long polling or a webhook)",
    docs="docs/telegram.md",
    offers=Offers(groups=True, threads=True, edits=True, catch_up=True, webhooks=True, media=True),
    requires=("telegram",),
    extra="telegram",
    checks=checks,
    leader_roles=(POLL_ROLE,),
    people=PersonIds(r"[1-9][0-9]{0,19}", "a Telegram user id is a number, e.g. telegram:42"),
)
