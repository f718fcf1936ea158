"""The Google Chat channel's declaration (`chat_gateway.channels` entry point
`googlechat`): a Chat app on an HTTP endpoint of the gateway's port, replies through the
Chat API as a service account. Light to import: PyJWT (the `googlechat` extra) is
imported by `build` and the checks."""

from __future__ import annotations

from typing import Any

from channels.googlechat.settings import GoogleChatSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__GOOGLECHAT__"
#: Event types counted by name on /metrics; others count as "other".
EVENT_TYPES = ("MESSAGE", "ADDED_TO_SPACE", "REMOVED_FROM_SPACE", "CARD_CLICKED")


def build(section: GoogleChatSettings, services: ChannelServices) -> Any:
    """The channel, its endpoint on the gateway's port (with replicas, every replica takes
    events), its counts on /metrics."""
    from channels.googlechat.channel import GoogleChatChannel

    channel = GoogleChatChannel.from_settings(section)
    channel.mount(services.http)
    stats, metrics = channel.stats, services.metrics
    events = metrics.counter(
        "events_total", "Google Chat interaction events received, by type.", ("type",)
    )
    refused = metrics.counter(
        "refused_total",
        "Requests to the Google Chat endpoint refused: a missing or wrong bearer token.",
    )
    not_taken = metrics.counter(
        "not_taken_total",
        "Google Chat messages not taken (starting, draining, the journal failed): the "
        "sender was asked to send them again.",
    )
    retries = metrics.counter(
        "api_retries_total", "Chat API requests repeated after a transient failure."
    )
    tokens = metrics.counter(
        "access_tokens_total", "Access tokens obtained for the app's service account."
    )

    async def refresh() -> None:
        for kind in EVENT_TYPES:
            events.set_total(stats.events[kind], kind)
        others = sum(n for kind, n in stats.events.items() if kind not in EVENT_TYPES)
        events.set_total(others, "other")
        refused.set_total(stats.refused)
        not_taken.set_total(stats.not_taken)
        retries.set_total(stats.retries)
        tokens.set_total(channel.tokens.fetched)

    metrics.on_scrape(refresh)
    return channel


async def checks(section: GoogleChatSettings) -> list[Finding]:
    """The audience and the key set; the key accepted by Google (an access token); the
    app's spaces listed through the Chat API; Google's keys for the audience fetched."""
    missing = required_settings(
        "googlechat",
        [
            (
                "the authentication audience",
                "set channels.googlechat.audience to the project number or the endpoint URL "
                "(Chat API > Configuration > Connection settings > Authentication Audience)",
                section.audience,
            ),
            (
                "a service account key",
                f"set {PREFIX}SERVICE_ACCOUNT_KEY_FILE to the service account's JSON key "
                "(docs/googlechat.md, section 1)",
                section.resolved_key(),
            ),
        ],
    )
    if missing:
        return missing
    import anyio

    from channels.googlechat.channel import GOOGLECHAT_WEBHOOK_PATH, check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section)
    except Exception as exc:
        return [Finding("fail", f"googlechat credentials were not accepted: {exc}")]
    findings = [Finding("ok", f"googlechat: the service account {found.account} gets a token")]
    if found.spaces_problem:
        findings.append(
            Finding(
                "fail",
                "googlechat: the Chat API refused to list the app's spaces "
                f"({found.spaces_problem})",
                "enable the Google Chat API in the service account's project and configure "
                "the Chat app there (docs/googlechat.md, section 1)",
            )
        )
    else:
        where = ", ".join(s.display_name or s.name for s in found.spaces[:5]) or "none yet"
        findings.append(
            Finding("ok", f"googlechat: the app is in {len(found.spaces)} space(s): {where}")
        )
    if found.keys_problem:
        findings.append(
            Finding(
                "fail",
                f"googlechat: {found.keys_problem}; no request from Google Chat can be checked",
                "let the gateway reach www.googleapis.com (or fix chat_certs_url / "
                "google_certs_url)",
            )
        )
    audience = section.audience or ""
    if audience.startswith("http") and not audience.rstrip("/").endswith(GOOGLECHAT_WEBHOOK_PATH):
        findings.append(
            Finding(
                "warn",
                f"googlechat: the audience {audience} is a URL that does not end with "
                f"{GOOGLECHAT_WEBHOOK_PATH}, where the gateway takes Google Chat's events",
                f"set the app's HTTP endpoint URL to https://<your host>{GOOGLECHAT_WEBHOOK_PATH} "
                "and the same URL as the audience",
            )
        )
    return findings


SPEC = ChannelSpec(
    name="googlechat",
    settings=GoogleChatSettings,
    build=build,
    summary="a Google Chat app on an HTTP endpoint: direct messages, spaces and threads "
    "(a webhook on the gateway's port, replies through the Chat API)",
    docs="docs/googlechat.md",
    offers=Offers(groups=True, threads=True, edits=True, webhooks=True, media=True),
    requires=("jwt", "cryptography"),
    extra="googlechat",
    checks=checks,
    failpoints=("googlechat.before_ack",),
    people=PersonIds(
        r"[0-9]{1,40}",
        "a Google Chat user id is the number of its resource name users/{id} (the gateway "
        "logs it with a pairing request), e.g. googlechat:112233445566778899001",
        dm_keyed=False,
    ),
)
