"""The example channel's declaration (`chat_gateway.channels` entry point `example`).

Imported whenever the gateway reads its configuration, so it stays light: the settings
model and the gateway's registry, nothing else. The adapter (and the HTTP client it uses)
is imported when the channel is built or checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.config import ConfigError
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)

from gateway_channel_example.settings import ExampleSettings

if TYPE_CHECKING:
    from gateway_channel_example.channel import ExampleChannel

#: With replicas, one holds the long poll: Example Chat ends an older GET /updates.
POLL_ROLE = "example poller"


def build(section: ExampleSettings, services: ChannelServices) -> ExampleChannel:
    from gateway_channel_example.channel import ExampleChannel

    token = section.resolved_token()
    if not token:
        raise ConfigError(
            "channels.example.token: set GATEWAY_CHANNELS__EXAMPLE__TOKEN (or token_file)"
        )
    kind = ExampleChannel
    if section.defect is not None:  # the kit's negative controls only
        from gateway_channel_example.defects import DEFECTS

        kind = DEFECTS[section.defect]
    channel = kind(section, token=token)
    channel.mount(services.http)
    if section.mode == "polling":
        channel.poll_leader = services.storage.leader(POLL_ROLE)
    return channel


async def checks(section: ExampleSettings) -> list[Finding]:
    """`gateway doctor`'s lines: the settings it needs, then whether Example Chat takes
    the token."""
    wanted: list[tuple[str, str, object]] = [
        ("a bot token", "set GATEWAY_CHANNELS__EXAMPLE__TOKEN", section.resolved_token())
    ]
    if section.mode == "webhook":
        wanted.append(
            (
                "webhook_url and a webhook secret",
                "set channels.example.webhook_url and GATEWAY_CHANNELS__EXAMPLE__WEBHOOK_SECRET",
                section.webhook_url and section.resolved_webhook_secret(),
            )
        )
    missing = required_settings("example", wanted)
    if missing:
        return missing
    from gateway_channel_example.channel import who_am_i

    return [await remote_check("example", who_am_i(section))]


SPEC = ChannelSpec(
    name="example",
    settings=ExampleSettings,
    build=build,
    summary="an Example Chat bot: DMs and groups (long polling or a signed webhook)",
    docs="docs/channel-sdk.md",
    offers=Offers(groups=True, catch_up=True, webhooks=True),
    checks=checks,
    leader_roles=(POLL_ROLE,),
    people=PersonIds(r"[a-z0-9_]{1,32}", "an Example Chat id is a handle, e.g. example:ann"),
)
