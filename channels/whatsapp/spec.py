"""The WhatsApp channel's declaration (`chat_gateway.channels` entry point `whatsapp`): the
WhatsApp Business Cloud API over the gateway's own HTTP client (aiohttp) and port."""

from __future__ import annotations

from typing import Any

from channels.whatsapp.settings import WhatsAppSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    remote_check,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__WHATSAPP__"


def build(section: WhatsAppSettings, services: ChannelServices) -> Any:
    """The channel, its webhook on the gateway's port (with replicas, every replica takes
    deliveries), its windows, statuses and held replies in the storage mode's store;
    counted on /metrics, held replies listed on the admin page."""
    from channels.whatsapp.channel import FAILURE_NAMES, STATUSES, WhatsAppChannel
    from channels.whatsapp.store import BACKENDS

    store = services.storage.open(BACKENDS)
    channel = WhatsAppChannel.from_settings(section, store)
    channel.mount(services.http)
    services.admin.undeliverable(store.held)
    metrics, stats = services.metrics, channel.stats
    statuses = metrics.counter(
        "statuses_total", "WhatsApp status callbacks that moved a sent message on, by status.",
        ("status",),
    )  # fmt: skip
    failures = metrics.counter(
        "failures_total",
        "WhatsApp messages that failed (refused when sent, or a failed status), by error.",
        ("error",),
    )
    templates = metrics.counter(
        "template_sends_total",
        "Replies outside WhatsApp's 24-hour window sent as the configured template.",
    )
    bad_signatures = metrics.counter(
        "bad_signatures_total",
        "WhatsApp webhook deliveries refused for a missing or wrong X-Hub-Signature-256.",
    )
    held = metrics.gauge(
        "held_replies",
        "WhatsApp replies kept as undeliverable (outside the window without a template, "
        "or refused); the admin page lists them.",
    )

    async def refresh() -> None:
        for status in STATUSES:
            statuses.set_total(stats.statuses[status], status)
        for name in FAILURE_NAMES:
            failures.set_total(stats.failures[name], name)
        templates.set_total(stats.templates)
        bad_signatures.set_total(stats.bad_signatures)
        held.set(await store.held_count())

    metrics.on_scrape(refresh)
    return channel


async def checks(section: WhatsAppSettings) -> list[Finding]:
    """The numbers, the webhook's verify token and app secret set, and the Graph API
    token valid for every number."""
    missing = required_settings(
        "whatsapp",
        [
            (
                "phone_number_ids",
                'set channels.whatsapp.phone_number_ids = ["<id>"] (WhatsApp Manager > API Setup)',
                section.phone_number_ids,
            ),
            (
                "the webhook's verify token",
                f"set {PREFIX}VERIFY_TOKEN to the token typed in the App Dashboard",
                section.verify_token and section.verify_token.get_secret_value(),
            ),
            (
                "the app secret",
                f"set {PREFIX}APP_SECRET (App Dashboard > App settings > Basic); every "
                "delivery is checked against it",
                section.app_secret and section.app_secret.get_secret_value(),
            ),
            (
                "an access token",
                f"set {PREFIX}ACCESS_TOKEN to a system user's token (docs/whatsapp.md)",
                section.resolved_token(),
            ),
        ],
    )
    if missing:
        return missing
    from channels.whatsapp.channel import check_credentials

    token = section.resolved_token() or ""
    return [await remote_check("whatsapp", check_credentials(section, token))]


SPEC = ChannelSpec(
    name="whatsapp",
    settings=WhatsAppSettings,
    build=build,
    summary="WhatsApp Business numbers through Meta's Cloud API (a webhook on the gateway's port)",
    docs="docs/whatsapp.md",
    offers=Offers(catch_up=True, webhooks=True, media=True),
    requires=(),
    extra=None,
    checks=checks,
    failpoints=("whatsapp.before_ack",),
)
