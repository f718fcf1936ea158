"""DingTalk robot callbacks (topic `/v1.0/im/bot/messages/get`) as `InboundMessage`s.
Pure functions.

A callback's data (DingTalk's "receive messages" page; the `dingtalk-stream` SDK's
`ChatbotMessage`): `msgId`, `conversationId` (`cid...`; a group's is the
openConversationId the robot API takes), `conversationType` ("1" one-to-one, "2" group),
`senderStaffId` (the person's userId in the organization), `senderId`, `senderNick`,
`chatbotUserId`, `isInAtList`, `createAt` (ms), `sessionWebhook`,
`sessionWebhookExpiredTime` (ms), `msgtype` and `text.content`. In a group DingTalk hands
the robot only the messages that @ it, with the @ already cut from the text.

Session keys: `dingtalk:<conversationId>`, one per one-to-one chat and per group. The
message id is `msgId`: the same in every push of a message, so the gateway answers it
once. The reply context (`META_REPLY_CONTEXT`) carries everything a reply needs to reach
this message's sender and no one else: the session webhook and its expiry, the
conversation, and the sender's userId. It travels with the message, never through the
channel's memory, so concurrent turns cannot swap their targets (QwenPaw #2414).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_SENDER_NAME,
    META_SENT_AT,
    InboundMessage,
)

CHANNEL = "dingtalk"
#: The callback topic of a robot's messages.
BOT_MESSAGE_TOPIC = "/v1.0/im/bot/messages/get"
GROUP = "2"


@dataclass(frozen=True, slots=True)
class Skip:
    """A callback that holds nothing for the gateway, and why."""

    reason: str


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """Where a reply to one message goes (`META_REPLY_CONTEXT`, as a plain dict)."""

    conversation: str
    group: bool
    staff_id: str
    nick: str
    webhook: str
    expires_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation,
            "group": self.group,
            "staff_id": self.staff_id,
            "nick": self.nick,
            "webhook": self.webhook,
            "expires_ms": self.expires_ms,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], chat_id: str) -> ReplyContext | None:
        """The context a reply carries, if it is one of this channel's and names the
        reply's own conversation (anything else is ignored, never trusted)."""
        raw = metadata.get(META_REPLY_CONTEXT)
        if not isinstance(raw, Mapping) or raw.get("conversation") != chat_id:
            return None
        try:
            return cls(
                conversation=str(raw["conversation"]),
                group=bool(raw.get("group")),
                staff_id=str(raw.get("staff_id") or ""),
                nick=str(raw.get("nick") or ""),
                webhook=str(raw.get("webhook") or ""),
                expires_ms=int(raw.get("expires_ms") or 0),
            )
        except (KeyError, TypeError, ValueError):
            return None


def _text_of(data: Mapping[str, Any]) -> str | None:
    kind = data.get("msgtype")
    if kind == "text":
        text = data.get("text")
        content = text.get("content") if isinstance(text, Mapping) else None
        return content.strip() if isinstance(content, str) else None
    if kind == "richText":
        content = data.get("content")
        items = content.get("richText") if isinstance(content, Mapping) else None
        if isinstance(items, list):
            words = [str(i["text"]) for i in items if isinstance(i, Mapping) and "text" in i]
            return "".join(words).strip() or None
    return None


def translate_callback(data: Mapping[str, Any]) -> InboundMessage | Skip:
    """One robot callback's data as the gateway's message, or why it holds none."""
    message_id = data.get("msgId")
    conversation = data.get("conversationId")
    if not isinstance(message_id, str) or not message_id:
        return Skip("no msgId")
    if not isinstance(conversation, str) or not conversation:
        return Skip("no conversationId")
    sender = str(data.get("senderStaffId") or data.get("senderId") or "")
    if not sender:
        return Skip("no sender")
    if sender == data.get("chatbotUserId"):
        return Skip("the robot's own message")
    text = _text_of(data)
    if text is None:
        return Skip(f"a {data.get('msgtype')} message (only text is read)")
    group = str(data.get("conversationType")) == GROUP
    nick = str(data.get("senderNick") or sender)
    metadata: dict[str, Any] = {META_SENDER_NAME: nick}
    created = data.get("createAt")
    if isinstance(created, int | float) and created > 0:
        metadata[META_SENT_AT] = float(created) / 1000.0
    if group:
        metadata[META_IS_GROUP] = True
        # DingTalk hands a robot only the group messages that @ it.
        metadata[META_MENTIONED] = bool(data.get("isInAtList", True))
    expires = data.get("sessionWebhookExpiredTime")
    metadata[META_REPLY_CONTEXT] = ReplyContext(
        conversation=conversation,
        group=group,
        staff_id=str(data.get("senderStaffId") or ""),
        nick=nick,
        webhook=str(data.get("sessionWebhook") or ""),
        expires_ms=int(expires)
        if isinstance(expires, int | float | str) and str(expires).isdigit()
        else 0,
    ).to_dict()
    return InboundMessage(
        channel=CHANNEL,
        chat_id=conversation,
        text=text,
        sender_id=sender,
        message_id=message_id,
        metadata=metadata,
    )
