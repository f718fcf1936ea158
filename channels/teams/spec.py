"""The Microsoft Teams channel's declaration (`chat_gateway.channels` entry point `teams`):
the Bot Framework protocol over the gateway's own HTTP port and aiohttp, light to import."""

from __future__ import annotations

from typing import Any

from channels.teams.settings import TeamsSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__TEAMS__"


def build(section: TeamsSettings, services: ChannelServices) -> Any:
    """The channel, its messaging endpoint on the gateway's port (with replicas, every
    replica takes activities and sends replies), its counts on /metrics."""
    from channels.teams.channel import TeamsChannel

    channel = TeamsChannel.from_settings(section)
    channel.mount(services.http)
    stats = channel.stats
    refused = services.metrics.counter(
        "refused_activities_total",
        "Teams activities refused: 401 without a valid Bot Framework token, 403 for a token "
        "not endorsed for Teams or naming another service URL.",
        ("status",),
    )
    throttled = services.metrics.counter(
        "throttled_total", "Bot Connector requests answered 429 (waited out, then retried)."
    )
    edits = services.metrics.counter("edits_total", "Teams message edits taken in.")

    async def refresh() -> None:
        for status, count in stats.refused.items():
            refused.set_total(count, status)
        throttled.set_total(stats.throttled)
        edits.set_total(stats.edits)

    services.metrics.on_scrape(refresh)
    return channel


async def checks(section: TeamsSettings) -> list[Finding]:
    """The App ID and secret set; the Bot Framework's signing keys readable (and some
    endorsed for Teams); a token from the sign-in service with the App ID and secret."""
    missing = required_settings(
        "teams",
        [
            (
                "the bot's Microsoft App ID",
                'set channels.teams.app_id = "<Microsoft App ID>" (Azure Bot > Configuration)',
                section.app_id,
            ),
            (
                "a client secret",
                f"set {PREFIX}APP_PASSWORD (Entra app registration > Certificates & secrets)",
                section.resolved_password(),
            ),
        ],
    )
    if missing:
        return missing
    import anyio

    from channels.teams.channel import check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section, section.resolved_password() or "")
    except Exception as exc:
        return [Finding("fail", f"teams credentials were not accepted: {exc}")]
    findings = [
        Finding(
            "ok",
            f"teams credentials work: a token for {section.app_id} from {found.token_url}",
        )
    ]
    if found.endorsed:
        findings.append(
            Finding(
                "ok",
                f"teams: {found.endorsed} of {found.keys} signing keys of {found.issuer} are "
                "endorsed for msteams",
            )
        )
    else:
        findings.append(
            Finding(
                "fail",
                f"teams: none of the {found.keys} signing keys at "
                f"{section.openid_metadata_url} is endorsed for msteams; every activity "
                "would be refused",
                "leave channels.teams.openid_metadata_url at its default",
            )
        )
    findings.append(
        Finding(
            "ok",
            f"teams: the Azure Bot's messaging endpoint must be https://<this host>"
            f"{section.endpoint_path} (the gateway's HTTP port behind TLS)",
        )
    )
    return findings


SPEC = ChannelSpec(
    name="teams",
    settings=TeamsSettings,
    build=build,
    summary="a Microsoft Teams bot (Azure Bot, Bot Framework): personal chats, group chats "
    "and channel threads, activities on the gateway's port",
    docs="docs/teams.md",
    offers=Offers(groups=True, threads=True, edits=True, catch_up=False, webhooks=True, media=True),
    requires=("jwt", "cryptography"),
    extra="teams",
    checks=checks,
    failpoints=("teams.before_ack",),
    people=PersonIds(
        r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
        "a Teams person is their Microsoft Entra object ID (Entra admin center > Users > "
        "the person > Object ID), e.g. teams:7faf8ab2-3d56-4244-b585-20c8a42ed2b8",
        dm_keyed=False,
    ),
)
