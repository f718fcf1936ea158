"""The Feishu / Lark channel's declaration (`chat_gateway.channels` entry point `feishu`): the
open platform's long connection or event callbacks, and its IM API, over the gateway's own
aiohttp (channels/feishu/channel.py says why not lark-oapi); `cryptography` opens the
encrypted callbacks."""

from __future__ import annotations

from typing import Any

from channels.feishu.settings import FeishuSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)

PREFIX = "GATEWAY_CHANNELS__FEISHU__"


def build(section: FeishuSettings, services: ChannelServices) -> Any:
    """The channel, its callback route in webhook mode, its counts on /metrics. No leader
    role: Feishu pushes each event to one of an app's connections (up to 50), so every
    replica holds its own long connection, and in webhook mode every replica takes POSTs."""
    from channels.feishu.channel import FeishuChannel

    channel = FeishuChannel(section, app_secret=section.resolved_secret() or "")
    channel.mount(services.http)
    metrics, stats = services.metrics, channel.stats
    repushes = metrics.counter(
        "repushes_total",
        "Feishu events pushed again after this process had journaled them (answered at once).",
    )
    rate_limited = metrics.counter(
        "rate_limited_total", "Feishu API requests refused for a rate limit and waited out."
    )
    bad_signatures = metrics.counter(
        "bad_signatures_total",
        "Feishu callbacks refused: no or a wrong X-Lark-Signature, Encrypt Key or token.",
    )

    async def refresh() -> None:
        repushes.set_total(stats.repushes)
        rate_limited.set_total(stats.rate_limited)
        bad_signatures.set_total(stats.bad_signatures)

    metrics.on_scrape(refresh)
    return channel


async def checks(section: FeishuSettings) -> list[Finding]:
    """The app's id and secret set (and the callback's keys in webhook mode), and the
    credentials accepted by the open platform, with a bot."""
    wanted: list[tuple[str, str, object]] = [
        (
            "an App ID",
            "set channels.feishu.app_id (Credentials & Basic Info in the developer console)",
            section.app_id,
        ),
        ("an App Secret", f"set {PREFIX}APP_SECRET", section.resolved_secret()),
    ]
    if section.mode == "webhook":
        wanted += [
            (
                "an Encrypt Key",
                f"set {PREFIX}ENCRYPT_KEY (Events & Callbacks > Encryption Strategy)",
                section.encrypt_key and section.encrypt_key.get_secret_value(),
            ),
            (
                "a Verification Token",
                f"set {PREFIX}VERIFICATION_TOKEN (Events & Callbacks > Encryption Strategy)",
                section.verification_token and section.verification_token.get_secret_value(),
            ),
        ]
    missing = required_settings("feishu", wanted)
    if missing:
        return missing
    from channels.feishu.channel import check_credentials

    return [
        await remote_check("feishu", check_credentials(section, section.resolved_secret() or ""))
    ]


SPEC = ChannelSpec(
    name="feishu",
    settings=FeishuSettings,
    build=build,
    summary="a Feishu / Lark bot: direct chats, groups and threads (long connection or callbacks)",
    docs="docs/feishu.md",
    offers=Offers(groups=True, threads=True, edits=False, catch_up=True, webhooks=True, media=True),
    requires=("cryptography",),
    extra="feishu",
    checks=checks,
    people=PersonIds(
        r"ou_[0-9a-f]{16,64}",
        "a Feishu id is the person's open_id in the app, e.g. "
        "feishu:ou_7d8a6e6df7621556ce0d21922b676706",
        dm_keyed=False,
    ),
)
