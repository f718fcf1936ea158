"""A Feishu event as the gateway's `InboundMessage` (pure functions).

Feishu delivers a person's message as an `im.message.receive_v1` event in the version 2.0
envelope (`schema`, `header`: `event_id`, `event_type`, `create_time`, `token`, `app_id`,
`tenant_key`; `event`: `sender`, `message`). Where a conversation lives:

- a chat (`chat_type` p2p or group): `feishu:<chat_id>`;
- a thread (a topic) in it, when the message has a `thread_id`:
  `feishu:<chat_id>:thread:<thread_id>`.

The message id is the message's own `message_id` (`om_...`), which every re-push of its
event keeps, so the gateway's journal answers it once. In a group, the message addresses
the bot when its `mentions` name the bot's open_id (`META_MENTIONED`) or it replies to a
message the bot sent (`META_REPLY_TO_BOT`); the core screens the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from channels.feishu.format import post_text
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "feishu"
THREAD = "thread"
MESSAGE_EVENT = "im.message.receive_v1"

#: Metadata: the chat's type as Feishu names it (p2p, group), and the message replied to.
META_CHAT_TYPE = "feishu_chat_type"
META_PARENT_ID = "feishu_parent_id"

#: Message types the gateway reads, and how it names the rest to the model.
_UNREADABLE = {
    "sticker": "a sticker",
    "media": "a video",
    "share_chat": "a group card",
    "share_user": "a contact card",
    "interactive": "a message card",
    "location": "a location",
    "merge_forward": "forwarded messages",
    "todo": "a task",
    "vote": "a poll",
    "hongbao": "a red packet",
    "share_calendar_event": "a calendar event",
    "calendar": "a calendar event",
    "video_chat": "a video call",
}


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this event (logged at debug level with `reason`)."""

    reason: str


def event_type(envelope: Mapping[str, Any]) -> str:
    """The event's type: version 2.0's `header.event_type` (version 1.0's `event.type`)."""
    header = envelope.get("header")
    if isinstance(header, Mapping) and header.get("event_type"):
        return str(header["event_type"])
    event = envelope.get("event")
    return str(event.get("type") or "") if isinstance(event, Mapping) else ""


def event_id(envelope: Mapping[str, Any]) -> str:
    """The event's id (`header.event_id`; version 1.0's `uuid`), which a re-push keeps."""
    header = envelope.get("header")
    if isinstance(header, Mapping) and header.get("event_id"):
        return str(header["event_id"])
    return str(envelope.get("uuid") or "")


def event_token(envelope: Mapping[str, Any]) -> str:
    """The Verification Token the event carries (`header.token`, or `token`)."""
    header = envelope.get("header")
    if isinstance(header, Mapping) and header.get("token"):
        return str(header["token"])
    return str(envelope.get("token") or "")


def _content(message: Mapping[str, Any]) -> Any:
    raw = message.get("content")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, Mapping) else {}


def _mention_ids(mention: Mapping[str, Any]) -> set[str]:
    ident = mention.get("id")
    if isinstance(ident, Mapping):
        return {str(v) for v in ident.values() if v}
    return {str(ident)} if ident else set()


def _resolve_mentions(
    text: str, mentions: list[Mapping[str, Any]], bot_open_id: str
) -> tuple[str, bool]:
    """The text with each mention placeholder (`@_user_1`) resolved: the bot's removed,
    another person's as `@Name`; and whether the bot was mentioned."""
    mentioned = False
    for mention in sorted(mentions, key=lambda m: -len(str(m.get("key") or ""))):
        key = str(mention.get("key") or "")
        if not key:
            continue
        if bot_open_id and bot_open_id in _mention_ids(mention):
            mentioned = True
            text = text.replace(key + " ", "").replace(key, "")
        else:
            text = text.replace(key, f"@{mention.get('name') or 'someone'}")
    return text.strip(), mentioned


def attachment_id(message_id: str, kind: str, key: str) -> str:
    """An attachment's `file_id`: what the resources API needs to download it."""
    return f"{message_id}:{kind}:{key}"


def parse_attachment_id(file_id: str) -> tuple[str, str, str]:
    """(message_id, resource type `image` or `file`, key) of an attachment's file_id."""
    message_id, kind, key = file_id.split(":", 2)
    return message_id, kind, key


def translate_event(
    envelope: Mapping[str, Any],
    *,
    bot_open_id: str,
    sent_by_bot: Callable[[str], bool] = lambda _message_id: False,
) -> InboundMessage | Skip:
    """The inbound message of one event, or why there is none."""
    kind = event_type(envelope)
    if kind != MESSAGE_EVENT:
        return Skip(f"an event of type {kind or 'unknown'}")
    event = envelope.get("event")
    if not isinstance(event, Mapping):
        return Skip("an event without a body")
    message, sender = event.get("message"), event.get("sender")
    if not isinstance(message, Mapping) or not isinstance(sender, Mapping):
        return Skip("a message event without a message or a sender")
    message_id, chat_id = str(message.get("message_id") or ""), str(message.get("chat_id") or "")
    if not message_id or not chat_id:
        return Skip("a message without an id or a chat")
    if sender.get("sender_type") not in (None, "user"):
        return Skip(f"a message from a {sender.get('sender_type')}")
    ids = sender.get("sender_id") if isinstance(sender.get("sender_id"), Mapping) else {}
    assert isinstance(ids, Mapping)
    sender_id = str(ids.get("open_id") or ids.get("user_id") or ids.get("union_id") or "")
    if bot_open_id and sender_id == bot_open_id:
        return Skip("the bot's own message")

    chat_type = str(message.get("chat_type") or "")
    is_group = chat_type != "p2p"
    msg_type = str(message.get("message_type") or message.get("msg_type") or "")
    content = _content(message)
    mentions = [m for m in message.get("mentions") or () if isinstance(m, Mapping)]
    files: list[Attachment] = []
    raw = ""
    if msg_type == "text":
        raw = str(content.get("text") or "")
    elif msg_type == "post":
        raw, images = post_text(content)
        files = [
            Attachment("image", attachment_id(message_id, "image", key), "image.png", "image/png")
            for key in images
        ]
    elif msg_type == "image" and content.get("image_key"):
        key = str(content["image_key"])
        found = attachment_id(message_id, "image", key)
        files = [Attachment("image", found, "image.png", "image/png")]
    elif msg_type in ("file", "audio") and content.get("file_key"):
        key = str(content["file_key"])
        name = str(content.get("file_name") or ("voice.opus" if msg_type == "audio" else "file"))
        mime = "audio/opus" if msg_type == "audio" else ""
        attached = "voice" if msg_type == "audio" else "document"
        files = [Attachment(attached, attachment_id(message_id, "file", key), name, mime)]
    text, mentioned = _resolve_mentions(raw, mentions, bot_open_id)
    if msg_type not in ("text", "post", "image", "file", "audio"):
        what = _UNREADABLE.get(msg_type, "a message of a kind I cannot read")
        text = f"[The user sent {what}, which the assistant cannot see.]"
    if not text and not files:
        return Skip("an empty message")

    parent = str(message.get("parent_id") or "")
    thread = str(message.get("thread_id") or "") or None
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: bool(parent) and sent_by_bot(parent),
        META_SENDER_NAME: sender_id,
        META_CHAT_TYPE: chat_type,
        META_POST_ID: message_id,
    }
    if parent:
        metadata[META_PARENT_ID] = parent
    created = message.get("create_time")
    try:
        metadata[META_SENT_AT] = int(str(created)) / 1000
    except (TypeError, ValueError):
        pass
    return InboundMessage(
        channel=CHANNEL,
        chat_id=chat_id,
        text=text,
        sender_id=sender_id,
        message_id=message_id,
        thread_kind=THREAD if thread else None,
        thread_id=thread,
        metadata=metadata,
        attachments=tuple(files),
    )
