"""The QQ channel's declaration (`chat_gateway.channels` entry point `qq`): OneBot v11's
forward WebSocket over the gateway's own aiohttp, light to import."""

from __future__ import annotations

from typing import Any

from channels.qq.settings import QQSettings
from gateway.registry import ChannelServices, ChannelSpec, Finding, Offers, PersonIds

#: With replicas, one holds the event connection (`/`) and reads back what was missed;
#: every replica sends replies over an `/api` connection of its own.
WEBSOCKET_ROLE = "qq websocket"
ENV_TOKEN = "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN"


def build(section: QQSettings, services: ChannelServices) -> Any:
    """The channel, its event connection under the leader role, its counts on /metrics."""
    from channels.qq.channel import QQChannel

    channel = QQChannel(
        section,
        token=section.resolved_access_token(),
        lead=services.storage.lead(WEBSOCKET_ROLE),
        replicas=services.replicas,
    )
    stats = channel.stats
    backfilled = services.metrics.counter(
        "backfilled_total",
        "QQ messages read back through the OneBot implementation's history after a (re)connect.",
    )
    connections = services.metrics.counter(
        "connections_total",
        "Event connections to the OneBot implementation (the first, and every reconnect).",
    )
    refused = services.metrics.counter(
        "refused_total",
        "Reply messages QQ refused (a muted bot, risk control, a person it cannot write to).",
    )

    async def refresh() -> None:
        backfilled.set_total(stats.backfilled)
        connections.set_total(stats.connections)
        refused.set_total(stats.refused)

    services.metrics.on_scrape(refresh)
    return channel


async def checks(section: QQSettings) -> list[Finding]:
    """The implementation answering at `url` with the token; who the account is; which
    implementation it is; whether it has the message history the read-back needs."""
    import anyio

    from channels.qq.channel import QQSetupError, check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section, section.resolved_access_token())
    except QQSetupError as exc:
        refused = "access token" in str(exc)
        fix = (
            f"set {ENV_TOKEN} to the token of the implementation's WebSocket server"
            if refused
            else "start NapCat (or Lagrange.OneBot) with its WebSocket server on and the "
            "account logged in, and set channels.qq.url to it (docs/qq.md, steps 1 and 2)"
        )
        return [Finding("fail", str(exc), fix)]
    except Exception as exc:
        return [
            Finding(
                "fail",
                f"qq: the OneBot implementation did not answer in time ({type(exc).__name__})",
                "check that NapCat (or Lagrange.OneBot) runs and channels.qq.url reaches it",
            )
        ]
    findings = [Finding("ok", f"qq credentials work: {found.identity} on {found.implementation}")]
    if not section.resolved_access_token():
        findings.append(
            Finding(
                "warn",
                "qq: no access token is set; anyone who reaches the WebSocket server can "
                "use the account",
                f"set a Token on the implementation's WebSocket server and {ENV_TOKEN}",
            )
        )
    if found.history is False and section.read_back:
        findings.append(
            Finding(
                "warn",
                f"qq: {found.implementation} has no message history (get_friend_msg_history); "
                "messages written while the gateway is away are not read back",
                "use NapCat or Lagrange.OneBot, which have it (docs/qq.md, Delivery)",
            )
        )
    elif found.history:
        findings.append(Finding("ok", "qq: the message history answers (the read-back works)"))
    return findings


SPEC = ChannelSpec(
    name="qq",
    settings=QQSettings,
    build=build,
    summary="a QQ account through OneBot v11 (NapCat, Lagrange.OneBot): private chats and "
    "groups, with the read-back of what was written while the gateway was down",
    docs="docs/qq.md",
    offers=Offers(groups=True, catch_up=True, media=True),
    requires=(),
    extra="qq",
    checks=checks,
    leader_roles=(WEBSOCKET_ROLE,),
    people=PersonIds(
        r"[1-9][0-9]{4,11}",
        "a QQ id is the person's QQ number, e.g. qq:10001000",
        dm_keyed=False,
    ),
)
