"""The Signal channel's declaration (`chat_gateway.channels` entry point `signal`):
signal-cli's JSON-RPC daemon over the gateway's own HTTP client (aiohttp)."""

from __future__ import annotations

from typing import Any

from channels.signal.settings import SignalSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    required_settings,
)

#: With replicas, one receives: signal-cli serves one `receive` at a time, and what it
#: hands over is the receiver's alone. Every replica sends replies.
RECEIVE_ROLE = "signal receiver"


def build(section: SignalSettings, services: ChannelServices) -> Any:
    """The channel; its intake runs under the receiver role, its held messages in the
    role's cursor store (a workspace file, or PostgreSQL with replicas); counted on
    /metrics."""
    from channels.signal.channel import SignalChannel

    channel = SignalChannel(section, lead=services.storage.lead(RECEIVE_ROLE))
    cut = services.metrics.counter(
        "receive_cut_total",
        "Signal receive calls whose answer never reached the gateway: a message signal-cli "
        "took for one is lost (docs/signal.md, Delivery).",
    )
    held = services.metrics.gauge(
        "held_messages",
        "Signal messages signal-cli handed over that the gateway has not taken yet (held, "
        "submitted first).",
    )

    async def refresh() -> None:
        cut.set_total(channel.stats.receive_cut)
        held.set(channel.stats.held)

    services.metrics.on_scrape(refresh)
    return channel


async def checks(section: SignalSettings) -> list[Finding]:
    """The account set, and signal-cli answering for it."""
    missing = required_settings(
        "signal",
        [
            (
                "the bot's number",
                "set channels.signal.account (GATEWAY_CHANNELS__SIGNAL__ACCOUNT=+15551234567), "
                "the number signal-cli registered or linked (docs/signal.md)",
                section.account,
            )
        ],
    )
    if missing:
        return missing
    import anyio

    from channels.signal.channel import check_daemon

    try:
        with anyio.fail_after(30):
            found = await check_daemon(section)
    except Exception as exc:
        return [
            Finding(
                "fail",
                f"signal: {exc}".replace("signal: signal: ", "signal: "),
                f"start signal-cli's daemon for {section.account} at {section.url} "
                "(docs/signal.md, section 2)",
            )
        ]
    return [Finding("ok", found)]


SPEC = ChannelSpec(
    name="signal",
    settings=SignalSettings,
    build=build,
    summary="a Signal number through signal-cli's JSON-RPC daemon: DMs and groups",
    docs="docs/signal.md",
    offers=Offers(groups=True, catch_up=True, media=True),
    requires=(),
    extra="signal",
    checks=checks,
    leader_roles=(RECEIVE_ROLE,),
    people=PersonIds(
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "a Signal user id is the person's ACI uuid (see `gateway pairing list`), e.g. "
        "signal:5b1c7a5e-8a55-4f0e-9a8e-2f0e1c0b9a77",
    ),
)
