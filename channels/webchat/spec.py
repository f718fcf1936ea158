"""The web chat's declaration (`chat_gateway.channels` entry point `web`): a chat page and a
widget served on the gateway's own port, nothing to install, light to import."""

from __future__ import annotations

from typing import Any

from channels.webchat.settings import WebChatSettings, origin_problem
from gateway.access.rules import ChannelAccessPolicy
from gateway.registry import ChannelServices, ChannelSpec, Finding, Offers, PersonIds

#: A password shorter than this is easy to guess past the login's rate limit.
SHORT_PASSWORD = 12


def build(section: WebChatSettings, services: ChannelServices) -> Any:
    """The channel, its log in the storage mode's store, its routes on the HTTP port, its
    counts on /metrics."""
    from channels.webchat.channel import WebChatChannel
    from channels.webchat.store import BACKENDS

    channel = WebChatChannel(
        section, store=services.storage.open(BACKENDS), replicas=services.replicas
    )
    channel.mount(services.http)
    metrics = services.metrics
    messages = metrics.counter("messages_total", "Messages visitors sent that the web chat took.")
    replies = metrics.counter("replies_total", "Replies written into visitors' conversation logs.")
    visitors = metrics.counter("new_visitors_total", "Browsers that became new visitors.")
    limited = metrics.counter(
        "rate_limited_total", "Requests refused by the web chat's rate limits (429)."
    )
    streams = metrics.gauge("streams", "Chat pages reading their log now (this replica).")

    async def refresh() -> None:
        messages.set_total(channel.messages)
        replies.set_total(channel.replies)
        visitors.set_total(channel.new_visitors)
        limited.set_total(channel.rates.refused)
        streams.set(channel.streams)

    metrics.on_scrape(refresh)
    return channel


def access(section: WebChatSettings) -> ChannelAccessPolicy:
    """Visitors are the senders; there are no groups."""
    return ChannelAccessPolicy(
        dm_policy=section.dm_policy,
        allow_from=frozenset(section.allow_from),
        group_policy="disabled",
        pairing_ttl=section.pairing_ttl_seconds,
    )


async def checks(section: WebChatSettings) -> list[Finding]:
    """Who may talk, the password's length, the widget's sites, the limits."""
    findings: list[Finding] = []
    password = section.resolved_password()
    if password is not None:
        who = f"whoever knows the password, as web:{section.owner}"
        if len(password) < SHORT_PASSWORD:
            findings.append(
                Finding(
                    "warn",
                    f"web: the password is {len(password)} characters long",
                    f"use at least {SHORT_PASSWORD} (a random token: python3 -c "
                    "'import secrets; print(secrets.token_urlsafe(24))')",
                )
            )
    else:
        who = {
            "open": "every visitor",
            "allowlist": f"the {len(section.allow_from)} visitor id(s) of allow_from",
            "pairing": "visitors an operator approved (`gateway pairing approve web CODE`)",
        }[section.dm_policy]
    findings.append(Finding("ok", f"web: the chat is at /webchat/ on the HTTP port, for {who}"))
    if password is None and section.dm_policy == "open":
        unbounded = [
            name
            for name, value in (
                ("visitor_messages_per_minute", section.visitor_messages_per_minute),
                ("address_messages_per_minute", section.address_messages_per_minute),
                ("address_new_visitors_per_hour", section.address_new_visitors_per_hour),
            )
            if value == 0
        ]
        if unbounded:
            findings.append(
                Finding(
                    "warn",
                    f"web: open to everyone with no bound on {', '.join(unbounded)}",
                    "set those limits: every message costs a model call",
                )
            )
    for origin in section.allowed_origins:
        problem = origin_problem(origin)
        if problem is not None:
            findings.append(Finding("fail", f"web: allowed_origins: {problem}"))
    if section.allowed_origins:
        findings.append(
            Finding(
                "ok", f"web: the widget may be embedded by {', '.join(section.allowed_origins)}"
            )
        )
    return findings


SPEC = ChannelSpec(
    name="web",
    settings=WebChatSettings,
    build=build,
    summary="a chat page on the gateway's port and a widget for other sites: visitors by "
    "cookie, a password, or pairing; replies streamed and kept for pages that were away",
    docs="docs/webchat.md",
    offers=Offers(edits=True, catch_up=True, media=True),
    checks=checks,
    access=access,
    people=PersonIds(
        r"[A-Za-z0-9_-]{1,64}",
        "a web chat visitor id is shown at the foot of the chat page, e.g. "
        "web:Ab3dEf5hIj7lMn9pQr1tUv",
    ),
)
