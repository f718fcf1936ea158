"""The Discord channel's declaration (`chat_gateway.channels` entry point `discord`): light to
import; discord.py is imported only when the channel is built."""

from __future__ import annotations

from typing import Any

from channels.discord.settings import DiscordSettings
from gateway.registry import ChannelServices, ChannelSpec, Finding, Offers, PersonIds

#: With replicas, one holds the Gateway connection and reads back what was missed; every
#: replica sends replies.
GATEWAY_ROLE = "discord gateway"


def build(section: DiscordSettings, services: ChannelServices) -> Any:
    from channels.discord.channel import DiscordChannel

    return DiscordChannel(
        section,
        token=section.resolved_token() or "",
        lead=services.storage.lead(GATEWAY_ROLE),
        replicas=services.replicas,
    )


async def checks(section: DiscordSettings) -> list[Finding]:
    """The bot token (logged in through the HTTP API), the Message Content intent enabled
    for the app when the bot asks for it, and the Gateway answering."""
    import anyio

    token = section.resolved_token()
    if not token:
        return [
            Finding(
                "fail",
                "discord is enabled without a bot token",
                "set GATEWAY_CHANNELS__DISCORD__TOKEN (Developer Portal > Bot > Reset Token)",
            )
        ]
    from channels.discord.channel import check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section, token)
    except Exception as exc:
        return [Finding("fail", f"discord credentials were not accepted: {exc}")]
    findings = [Finding("ok", f"discord credentials work: {found.identity}")]
    if section.message_content and not found.message_content_enabled:
        findings.append(
            Finding(
                "fail",
                "discord: the Message Content intent is not enabled for the app; the "
                "Gateway would refuse the bot (close code 4014)",
                "Developer Portal > your app > Bot > Privileged Gateway Intents > Message "
                "Content Intent, or set channels.discord.message_content = false (the bot "
                "then reads only DMs and messages that mention it)",
            )
        )
    elif section.message_content:
        findings.append(Finding("ok", "discord: the Message Content intent is enabled"))
    if found.gateway_problem:
        findings.append(
            Finding(
                "fail",
                f"discord: {found.gateway_problem}",
                "check the network, or channels.discord.gateway_url",
            )
        )
    else:
        findings.append(Finding("ok", "discord: the Gateway answers"))
    return findings


SPEC = ChannelSpec(
    name="discord",
    settings=DiscordSettings,
    build=build,
    summary="a Discord bot: DMs, server channels and threads, with the backfill of what "
    "was written while the gateway was down",
    docs="docs/discord.md",
    offers=Offers(groups=True, threads=True, edits=True, catch_up=True, media=True),
    requires=("discord",),
    extra="discord",
    checks=checks,
    leader_roles=(GATEWAY_ROLE,),
    people=PersonIds(
        r"[1-9][0-9]{15,19}",
        "a Discord user id is a number of 16 to 20 digits, e.g. discord:80351110224678912",
    ),
)
