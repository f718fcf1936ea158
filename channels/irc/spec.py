"""The IRC channel's declaration (`chat_gateway.channels` entry point `irc`): light to
import; the adapter (no platform library: IRC is spoken over anyio's streams) is imported
only when the channel is built or checked."""

from __future__ import annotations

from typing import Any

from channels.irc.settings import IrcSettings
from gateway.access.rules import ChannelAccessPolicy
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    access_from_section,
    required_settings,
)

#: With replicas, one holds the nick's connection (a second connection would be a second
#: nick); the others hand it their replies.
CONNECTION_ROLE = "irc connection"


def build(section: IrcSettings, services: ChannelServices) -> Any:
    from channels.irc.channel import IrcChannel

    channel = IrcChannel(section)
    channel.lead = services.storage.lead(CONNECTION_ROLE)
    channel.replicas = services.replicas
    channel.relay = services.storage.relay(CONNECTION_ROLE)
    return channel


def access(section: IrcSettings) -> ChannelAccessPolicy:
    """The access policy, with `allow_from` as the channel's ids: a nick in lower case
    (as the server folds it), a channel as `<network>:<#channel>` (written `#channel`)."""
    policy = access_from_section(section)
    network = section.resolved_network()
    allowed = set()
    for entry in policy.allow_from:
        name = entry.strip()
        if name[:1] in "#&+!" and name:
            allowed.add(f"{network}:{name.lower()}")
        allowed.add(name if name == "*" else name.lower())
    from dataclasses import replace

    return replace(policy, allow_from=frozenset(allowed))


async def checks(section: IrcSettings) -> list[Finding]:
    """The server reached (TLS checked), the bot registered (SASL when set), and quit."""
    import anyio

    missing = required_settings(
        "irc", [("a server", "set GATEWAY_CHANNELS__IRC__HOST", section.host)]
    )
    if missing:
        return missing
    from channels.irc.channel import check_connection

    try:
        with anyio.fail_after(30):
            who = await check_connection(section)
    except Exception as exc:
        return [
            Finding(
                "fail",
                f"irc: cannot register on {section.host}:{section.resolved_port()}: {exc}",
                "check channels.irc.host, port and tls, and the network (docs/irc.md, "
                "Troubleshooting)",
            )
        ]
    findings = [Finding("ok", f"irc: registered as {who}")]
    if not section.channels:
        findings.append(
            Finding(
                "warn",
                "irc: no channels to join; the bot answers private messages only",
                'set channels.irc.channels = ["#yourchannel"]',
            )
        )
    return findings


SPEC = ChannelSpec(
    name="irc",
    settings=IrcSettings,
    build=build,
    summary="an IRC bot: channels (answered when addressed by nick) and private messages, "
    "over TLS, with SASL; what was said while away is read back only where the server has "
    "IRCv3 chathistory",
    docs="docs/irc.md",
    offers=Offers(groups=True),
    checks=checks,
    access=access,
    leader_roles=(CONNECTION_ROLE,),
    people=PersonIds(
        r"[a-z\[\]\\`_^{|}~][a-z0-9\[\]\\`_^{|}~-]{0,49}",
        "an IRC sender id is a nick in lower case, e.g. irc:alice",
        dm_keyed=False,
    ),
)
