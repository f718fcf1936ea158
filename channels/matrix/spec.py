"""The Matrix channel's declaration (`chat_gateway.channels` entry point `matrix`): light to
import; matrix-nio (with its crypto) is imported only when the channel is built."""

from __future__ import annotations

from typing import Any

from channels.matrix.settings import MatrixSettings
from gateway.registry import (
    ChannelServices,
    ChannelSpec,
    Finding,
    Offers,
    PersonIds,
    remote_check,
    required_settings,
)

#: With replicas, one holds the sync loop (Matrix allows one sync per device) and the
#: device's keys; the other replicas' replies to encrypted rooms go through it.
SYNC_ROLE = "matrix sync"


def build(section: MatrixSettings, services: ChannelServices) -> Any:
    from channels.matrix.channel import MatrixChannel

    channel = MatrixChannel(section, token=section.resolved_token() or "")
    channel.invite_check = services.access_check
    channel.lead = services.storage.lead(SYNC_ROLE)
    if section.encryption:
        channel.relay = services.storage.relay(SYNC_ROLE)
    return channel


async def checks(section: MatrixSettings) -> list[Finding]:
    """The account: settings present, the homeserver reachable, the token logged in as
    `user_id`."""
    missing = required_settings(
        "matrix",
        [
            (
                "its homeserver",
                "set channels.matrix.homeserver (e.g. https://matrix.example.org)",
                section.homeserver,
            ),
            (
                "its user_id",
                "set channels.matrix.user_id (e.g. @gateway:example.org)",
                section.user_id,
            ),
            (
                "its access token",
                "set GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN (docs/matrix.md)",
                section.resolved_token(),
            ),
        ],
    )
    if missing:
        return missing
    from channels.matrix.channel import check_credentials

    token = section.resolved_token() or ""
    return [await remote_check("matrix", check_credentials(section, token))]


SPEC = ChannelSpec(
    name="matrix",
    settings=MatrixSettings,
    build=build,
    summary="a Matrix account on any homeserver: DMs, rooms and threads, end-to-end encrypted",
    docs="docs/matrix.md",
    offers=Offers(groups=True, threads=True, edits=True, catch_up=True, media=True),
    requires=("nio",),
    extra="matrix",
    checks=checks,
    leader_roles=(SYNC_ROLE,),
    failpoints=("matrix.before_cursor", "matrix.after_cursor"),
    people=PersonIds(
        r"@[a-z0-9._=/+-]+:[A-Za-z0-9.-]+(:[0-9]{1,5})?",
        "a Matrix user id looks like matrix:@alice:example.org",
    ),
)
