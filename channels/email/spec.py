"""The email channel's declaration (`chat_gateway.channels` entry point `email`): light to
import; imapclient and aiosmtplib are imported only when the channel is built."""

from __future__ import annotations

from typing import Any

from channels.email.settings import EmailSettings
from gateway.access.rules import ChannelAccessPolicy
from gateway.config import ConfigError
from gateway.registry import ChannelServices, ChannelSpec, Finding, Offers

#: With replicas, one holds the IMAP connection (and its read mark); every replica sends.
WATCH_ROLE = "email watcher"
#: What became of a mail the channel read: journaled then flagged or moved, or skipped.
OUTCOMES = ("taken", "not_answered")


def build(section: EmailSettings, services: ChannelServices) -> Any:
    from channels.email.channel import EmailChannel

    channel = EmailChannel(section, lead=services.storage.lead(WATCH_ROLE))
    mail = services.metrics.counter(
        "mail_total",
        "Mail the email channel read, by outcome: taken (journaled, then flagged or "
        "moved), not_answered (machines, lists, bounces, unauthenticated, empty).",
        ("outcome",),
    )
    for outcome in OUTCOMES:
        mail.set_total(0, outcome)

    async def count_mail() -> None:
        mail.set_total(channel.taken, "taken")
        mail.set_total(channel.skipped, "not_answered")

    services.metrics.on_scrape(count_mail)
    return channel


def access(section: EmailSettings) -> ChannelAccessPolicy:
    """Addresses and whole domains, compared in lower case; a refusal is silent unless
    asked for (most refused mail is spam with a forged sender). Mail has no groups."""
    entries = [entry.strip().lower() for entry in section.allow_from]
    return ChannelAccessPolicy(
        dm_policy=section.dm_policy,
        allow_from=frozenset(e for e in entries if "@" in e[1:] or e == "*"),
        allow_domains=frozenset(e.lstrip("@") for e in entries if "@" not in e[1:] and e != "*"),
        group_policy="disabled",
        pairing_ttl=section.pairing_ttl_seconds,
        silent_refusals=not section.refusal_replies,
    )


async def checks(section: EmailSettings) -> list[Finding]:
    """The mailbox: IMAP login and its folders, SMTP login, and who may write."""
    import anyio

    from channels.email.channel import EmailSetupError, check_mailbox

    findings: list[Finding] = []
    try:
        with anyio.fail_after(40):
            found = await check_mailbox(section)
        findings.append(Finding("ok", f"email works: {found}"))
    except ConfigError as exc:
        findings.append(Finding("fail", f"email is enabled but incomplete: {exc}"))
    except (EmailSetupError, TimeoutError) as exc:
        findings.append(
            Finding(
                "fail",
                f"email: {exc}".replace("email: email: ", "email: "),
                "fix the [channels.email] settings or the password; docs/email.md",
            )
        )
    if section.dm_policy == "allowlist" and not section.allow_from:
        findings.append(
            Finding(
                "warn",
                "email answers nobody: dm_policy is allowlist and allow_from is empty",
                'list addresses or domains in channels.email.allow_from (e.g. ["example.com"])',
            )
        )
    if section.dm_policy != "allowlist" and not section.require_auth:
        findings.append(
            Finding(
                "warn",
                f"email answers unknown senders (dm_policy = {section.dm_policy!r}) without "
                "checking who sent the mail: a forged sender gets the reply",
                'set channels.email.require_auth = ["dmarc"] and authserv_id',
            )
        )
    return findings


SPEC = ChannelSpec(
    name="email",
    settings=EmailSettings,
    build=build,
    summary="one mailbox: mail in over IMAP (IDLE), replies over SMTP, threaded",
    docs="docs/email.md",
    offers=Offers(threads=True, catch_up=True, media=True),
    requires=("imapclient", "aiosmtplib"),
    extra="email",
    checks=checks,
    access=access,
    leader_roles=(WATCH_ROLE,),
    failpoints=("email.before_confirm",),
)
