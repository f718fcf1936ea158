"""Access control at the edge: who may talk to the bot on each channel, and DM pairing.

The policy is one pure function, `decide(msg, policy, pairing, now)`, over a snapshot of
the pairing state. `AccessGate.check` feeds it from a `PairingStore` (a JSON file in the
workspace shared by the daemon and the operator's `gateway pairing ...` commands) and
records the pairing requests it issues.

Promises:
- Under `dm_policy = "pairing"` nothing a stranger writes reaches the LLM until an
  operator approved their code; the code is re-sent, not re-minted, while pending,
  and one code is sent to a sender at most once per `pairing_resend_interval`
  (`AccessGate`): messages in between are ignored without a reply.
- Pending requests are bounded per channel: expired ones go first, then new ones are
  refused with a message saying so.
- The pairing file is replaced atomically (temp + fsync + rename, mode 0600) under a
  file lock, so the daemon and the CLI can both write it; a damaged file is moved
  aside and reported, never overwritten.

Adapters set the metadata keys below on `InboundMessage.metadata`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio.to_thread
from loguru import logger

from gateway.access.protocol import (
    EMPTY_STATE,
    PairingBackend,
    PairingState,
    PendingRequest,
    new_pairing_code,
    pairing_reply,
)
from gateway.access.rules import ChannelAccessPolicy
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    InboundMessage,
)
from gateway.plumbing.postgres import StorageError

PAIRING_FULL_TEXT = (
    "Too many people are waiting for approval right now. Please try again in an hour."
)

UNAVAILABLE_TEXT = "I can't check who may talk to me right now. Please try again later."


@dataclass(frozen=True, slots=True)
class Allow:
    """Hand the message to the dispatcher."""


@dataclass(frozen=True, slots=True)
class Ignore:
    """Drop the message without a reply (group chatter, unknown channel); log `reason`."""

    reason: str


@dataclass(frozen=True, slots=True)
class Deny:
    """Do not answer with the LLM; send `reply` to the sender instead."""

    reply: str
    reason: str


@dataclass(frozen=True, slots=True)
class Challenge:
    """Send `reply` (which holds `code`) to the sender; `request` is to be recorded
    when `is_new`."""

    code: str
    reply: str
    request: PendingRequest
    is_new: bool


Decision = Allow | Ignore | Deny | Challenge

ALLOW = Allow()


def decide(
    msg: InboundMessage,
    policy: ChannelAccessPolicy,
    pairing: PairingState,
    now: float,
    *,
    mint: Callable[[], str] = new_pairing_code,
) -> Decision:
    """The access decision for one inbound message. Pure apart from `mint`, which
    is called only when a new pairing code is needed."""
    if msg.metadata.get(META_IS_GROUP):
        return _decide_group(msg, policy, pairing)
    if policy.dm_policy == "open" or policy.lists(msg):
        return ALLOW
    if not msg.sender_id:
        return Ignore("a direct message without a sender id")
    if policy.dm_policy == "allowlist":
        if policy.silent_refusals:
            return Ignore("sender not in allow_from (refused without a reply)")
        return Deny(
            "This assistant is private. Ask its operator to add your id "
            f"({msg.sender_id}) to the allow list.",
            reason="sender not in allow_from",
        )
    if pairing.is_approved(msg.channel, msg.sender_id):
        return ALLOW
    pending = pairing.pending_for(msg.channel, msg.sender_id, now)
    if pending is not None:
        return Challenge(pending.code, pairing_reply(pending, now), pending, is_new=False)
    live = pairing.live_pending(msg.channel, now)
    if len(live) >= policy.max_pending:
        return Deny(PAIRING_FULL_TEXT, reason=f"{len(live)} pairing requests pending")
    taken = {r.code for r in live}
    code = mint()
    while code in taken:
        code = mint()
    request = PendingRequest(
        channel=msg.channel,
        sender_id=msg.sender_id,
        code=code,
        created_at=now,
        expires_at=now + policy.pairing_ttl,
        chat_id=msg.chat_id,
        label=str(msg.metadata.get(META_SENDER_NAME) or "")[:100],
    )
    return Challenge(code, pairing_reply(request, now), request, is_new=True)


def screen_group(msg: InboundMessage, policy: ChannelAccessPolicy) -> Ignore | None:
    """`Ignore` for a group message the bot never answers whoever sent it (groups off,
    or not addressed to the bot where a mention is required), else None. Pure and cheap:
    judged before the message takes a place in its conversation's queue."""
    if policy.group_policy == "disabled":
        return Ignore("groups are disabled on this channel")
    addressed = msg.metadata.get(META_MENTIONED) or msg.metadata.get(META_REPLY_TO_BOT)
    if policy.require_mention and not addressed:
        return Ignore("group message not addressed to the bot")
    return None


def _decide_group(
    msg: InboundMessage, policy: ChannelAccessPolicy, pairing: PairingState
) -> Decision:
    if (ignored := screen_group(msg, policy)) is not None:
        return ignored
    if policy.group_policy == "open" or policy.lists(msg):
        return ALLOW
    if msg.sender_id and pairing.is_approved(msg.channel, msg.sender_id):
        return ALLOW
    return Ignore("group and sender not in allow_from")


class AccessGate:
    """The access check a channel adapter runs before `Dispatcher.submit`.

    `trusted` channels (the terminal, scheduled jobs, an authenticated API) are let
    through as they are. Other channels without a policy are closed (every message
    ignored, with a warning), so a channel added without thinking about access never
    answers strangers.

    A stranger who keeps writing gets their pending code again at most once per the
    policy's `pairing_resend_interval`; messages in between become `Ignore` (the
    dispatcher counts them as ignored). Which code went to whom when is kept in memory:
    a restart may send a code once more, never more often.
    """

    def __init__(
        self,
        policies: Mapping[str, ChannelAccessPolicy],
        store: PairingBackend,
        *,
        trusted: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policies = dict(policies)
        self.store = store
        self.trusted = trusted
        self._clock = clock
        # (channel, sender id) -> (the code last sent to them, when)
        self._codes_sent: dict[tuple[str, str], tuple[str, float]] = {}

    def screen(self, msg: InboundMessage) -> Ignore | None:
        """`Ignore` for a group message `check` would ignore whatever the pairing state
        says (chatter not addressed to the bot, groups off), else None: `check` decides.
        No I/O and no log line: a busy room's chatter costs a dict lookup, never a place
        in a conversation's queue."""
        if not msg.metadata.get(META_IS_GROUP) or msg.channel in self.trusted:
            return None
        policy = self.policies.get(msg.channel)
        return screen_group(msg, policy) if policy is not None else None

    async def check(self, msg: InboundMessage) -> Decision:
        if msg.channel in self.trusted:
            return ALLOW
        policy = self.policies.get(msg.channel)
        if policy is None:
            logger.warning("no access policy for channel {!r}: message ignored", msg.channel)
            return Ignore(f"no access policy for channel {msg.channel!r}")
        if policy.dm_policy != "pairing" or policy.lists(msg):
            # The pairing file cannot change this decision: no I/O.
            decision = decide(msg, policy, EMPTY_STATE, self._clock())
        else:
            decision = await anyio.to_thread.run_sync(self._check_with_pairing, msg, policy)
            if isinstance(decision, Challenge):
                decision = self._throttled(msg, decision, policy.pairing_resend_interval)
        if not isinstance(decision, Allow):
            with logger.contextualize(session=msg.session_key):
                logger.info("access: {} ({})", type(decision).__name__.lower(), _reason(decision))
        return decision

    def _throttled(self, msg: InboundMessage, challenge: Challenge, interval: float) -> Decision:
        """`challenge`, or `Ignore` when its code went to this sender less than
        `interval` seconds ago. Runs on the loop: check and record are one step."""
        now = self._clock()
        sender = (msg.channel, msg.sender_id)
        sent = self._codes_sent.get(sender)
        if sent is not None and sent[0] == challenge.code and now - sent[1] < interval:
            return Ignore(f"pairing code sent {now - sent[1]:.0f}s ago; not re-sent yet")
        # Forget senders whose code could not be held back any more (bounds the dict).
        longest = max(p.pairing_resend_interval for p in self.policies.values())
        for key, (_, when) in list(self._codes_sent.items()):
            if now - when >= longest:
                del self._codes_sent[key]
        self._codes_sent[sender] = (challenge.code, now)
        return challenge

    def _check_with_pairing(self, msg: InboundMessage, policy: ChannelAccessPolicy) -> Decision:
        now = self._clock()
        try:
            decision = decide(msg, policy, self.store.state(), now)
            if not (isinstance(decision, Challenge) and decision.is_new):
                return decision
            recorded = self.store.add_pending(decision.request, max_pending=policy.max_pending)
        except OSError as exc:
            # Fail closed: without the pairing file nobody unlisted gets through.
            logger.error("pairing file {} unusable: {}", self.store.where, exc)
            return Deny(UNAVAILABLE_TEXT, reason=f"pairing file unusable ({exc.strerror})")
        except StorageError as exc:  # PostgreSQL down: closed too
            logger.error("pairing state in {} unusable: {}", self.store.where, exc)
            return Deny(UNAVAILABLE_TEXT, reason=f"pairing state unusable ({exc})")
        if recorded is None:
            return Deny(PAIRING_FULL_TEXT, reason="pairing requests full")
        if recorded is not decision.request:  # another message of theirs got there first
            return Challenge(recorded.code, pairing_reply(recorded, now), recorded, is_new=False)
        # The code itself stays out of the log: it is the sender's to hand over.
        logger.info(
            "pairing requested on {} by sender {}; `gateway pairing list` shows it",
            msg.channel,
            msg.sender_id,
        )
        return decision


def _reason(decision: Decision) -> str:
    if isinstance(decision, Ignore | Deny):
        return decision.reason
    if isinstance(decision, Challenge):
        return "pairing code re-sent" if not decision.is_new else "pairing code issued"
    return "allowed"
