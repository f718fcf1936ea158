"""Messages that waited out a downtime: how old a message is, and the notice it gets.

After a restart the gateway takes in what arrived while it was down (the platform
delivers it late) and replays what a crash left unanswered. A full answer hours
later, to a question the person may have settled since, does more harm than good:
past `agent.offline_after_seconds` the person gets `offline_notice` instead, and the
message stays in the session (so nothing they said is lost).
"""

from __future__ import annotations

from gateway.messages import META_SENT_AT, InboundMessage

#: Channels whose messages are never "old": scheduled jobs have their own policy for a
#: run missed while the gateway was down (`gateway.schedules.schedule`).
_TIMELESS_CHANNELS = frozenset({"system"})


def message_age(inbound: InboundMessage, now: float) -> float:
    """Seconds since the person sent `inbound`: by the platform's clock when the
    channel gave it (`META_SENT_AT`), else since the gateway received it."""
    sent = inbound.received_at
    platform = inbound.metadata.get(META_SENT_AT)
    if isinstance(platform, int | float) and not isinstance(platform, bool) and platform > 0:
        sent = min(sent, float(platform))
    return max(0.0, now - sent)


def is_stale(inbound: InboundMessage, now: float, limit: float) -> bool:
    """True when `inbound` is too old for a full turn (`limit` 0: nothing is)."""
    if limit <= 0 or inbound.channel in _TIMELESS_CHANNELS:
        return False
    return message_age(inbound, now) > limit


def describe_age(seconds: float) -> str:
    """`seconds` as a person says it: "5 minutes", "3 hours", "2 days"."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return "moments"


def offline_notice(seconds: float) -> str:
    return (
        f"I was offline when you sent this ({describe_age(seconds)} ago), so I did not "
        "answer it then. Send it again if you still need an answer."
    )
