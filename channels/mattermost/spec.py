"""The Mattermost channel's declaration (`chat_gateway.channels` entry point `mattermost`):
the REST API v4 and the WebSocket over the gateway's own aiohttp, light to import."""

from __future__ import annotations

from typing import Any

from channels.mattermost.settings import MattermostSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    required_settings,
)

#: With replicas, one holds the WebSocket and reads back what was missed; every replica
#: sends replies.
WEBSOCKET_ROLE = "mattermost websocket"
PREFIX = "GATEWAY_CHANNELS__MATTERMOST__"


def build(section: MattermostSettings, services: ChannelServices) -> Any:
    """The channel, its WebSocket under the leader role, its counts on /metrics."""
    from channels.mattermost.channel import MattermostChannel

    channel = MattermostChannel(
        section,
        token=section.resolved_token() or "",
        lead=services.storage.lead(WEBSOCKET_ROLE),
        replicas=services.replicas,
    )
    stats = channel.stats
    backfilled = services.metrics.counter(
        "backfilled_total",
        "Mattermost posts read back through the REST API after a (re)connect.",
    )
    connections = services.metrics.counter(
        "websocket_connections_total",
        "Mattermost WebSocket connections that said hello (the first, and every reconnect).",
    )
    edits = services.metrics.counter("edits_total", "Mattermost post edits taken in.")

    async def refresh() -> None:
        backfilled.set_total(stats.backfilled)
        connections.set_total(stats.connections)
        edits.set_total(stats.edits)

    services.metrics.on_scrape(refresh)
    return channel


async def checks(section: MattermostSettings) -> list[Finding]:
    """The server's address and the token set; the token accepted (and a bot account's);
    the bot in a team; the server's longest post at least `max_post_chars`; the
    WebSocket answering."""
    missing = required_settings(
        "mattermost",
        [
            (
                "the server's address",
                'set channels.mattermost.url = "https://chat.example.com"',
                section.url,
            ),
            (
                "a bot token",
                f"set {PREFIX}TOKEN (System Console > Integrations > Bot Accounts > Create "
                "New Token)",
                section.resolved_token(),
            ),
        ],
    )
    if missing:
        return missing
    import anyio

    from channels.mattermost.channel import check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section, section.resolved_token() or "")
    except Exception as exc:
        return [Finding("fail", f"mattermost credentials were not accepted: {exc}")]
    findings = [Finding("ok", f"mattermost credentials work: {found.identity}")]
    if not found.is_bot:
        findings.append(
            Finding(
                "warn",
                "mattermost: the token is a person's, not a bot account's; the bot's posts "
                "show as theirs",
                "create a bot account (System Console > Integrations > Bot Accounts) and use "
                "its token",
            )
        )
    if found.teams:
        findings.append(Finding("ok", f"mattermost: the bot is in {', '.join(found.teams)}"))
    else:
        findings.append(
            Finding(
                "warn",
                "mattermost: the bot is in no team; nobody can mention it in a channel, and "
                "what was written while it was down is not read back",
                "add it to a team (Main Menu > Invite People > the bot's name)",
            )
        )
    if found.max_post_size is not None and found.max_post_size < section.max_post_chars:
        findings.append(
            Finding(
                "fail",
                f"mattermost: the server takes posts of at most {found.max_post_size} "
                f"characters; channels.mattermost.max_post_chars is {section.max_post_chars}",
                f"set channels.mattermost.max_post_chars = {found.max_post_size}",
            )
        )
    if found.websocket_problem:
        findings.append(
            Finding(
                "fail",
                f"mattermost: {found.websocket_problem}",
                "check that a proxy in front of Mattermost passes WebSocket upgrades on "
                "/api/v4/websocket",
            )
        )
    else:
        findings.append(Finding("ok", "mattermost: the WebSocket answers"))
    return findings


SPEC = ChannelSpec(
    name="mattermost",
    settings=MattermostSettings,
    build=build,
    summary="a Mattermost bot account: direct messages, channels and threads, with the "
    "read-back of what was written while the gateway was down",
    docs="docs/mattermost.md",
    offers=Offers(groups=True, threads=True, edits=True, catch_up=True, media=True),
    requires=(),
    extra="mattermost",
    checks=checks,
    leader_roles=(WEBSOCKET_ROLE,),
    people=PersonIds(
        r"[a-z0-9]{26}",
        "a Mattermost user id is 26 lower-case letters and digits (Profile > ... > Copy "
        "User ID), e.g. mattermost:6dkqa8fjmi8ebqxabi1xcyn6aw",
        dm_keyed=False,
    ),
)
