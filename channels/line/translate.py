"""LINE webhook events as the gateway's messages: pure functions, no HTTP here.

A webhook request holds a `destination` (the bot's user id) and `events`, in order
(Messaging API reference, "Webhook event objects"). What becomes of each event:

| event | becomes |
|---|---|
| `message` (text, image, audio, file, location, sticker) | an `Inbound` to submit |
| `message` (video) in a one-on-one chat | a `Notice`: the bot cannot watch it |
| anything in `mode: standby` (another channel answers) | skipped: never answered |
| follow, unfollow, join, leave, member joined or left, unsend, postback, ... | skipped |

The session key is `line:<userId>` in a one-on-one chat, `line:group:<groupId>` in a
group and `line:room:<roomId>` in a multi-person chat (`chat_key`). The message id is
LINE's message id, which a redelivered event keeps (as it keeps its `webhookEventId`).
What a reply needs travels with the message as its reply context (`ReplyContext`): the
event's single-use reply token, when the gateway received it, and the quote token that
lets the answer quote the person's message.
"""

from __future__ import annotations

import bisect
import mimetypes
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_TEXT,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "line"
GROUP, ROOM = "group", "room"
#: Metadata: the kind of LINE chat ("user", "group", "room").
META_SOURCE = "line_source"
#: Metadata: the LINE message the person's message quotes, if any.
META_QUOTED_ID = "line_quoted_message_id"


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """What a reply to a message needs: its reply token (single use, valid about a
    minute after the webhook), when the gateway received it, and its quote token."""

    reply_token: str = ""
    received_at: float = 0.0
    quote_token: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "reply_token": self.reply_token,
            "received_at": self.received_at,
            "quote_token": self.quote_token,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ReplyContext:
        data = metadata.get(META_REPLY_CONTEXT)
        if not isinstance(data, Mapping):
            return cls()
        try:
            received = float(data.get("received_at") or 0.0)
        except (TypeError, ValueError):
            received = 0.0
        return cls(str(data.get("reply_token") or ""), received, str(data.get("quote_token") or ""))


@dataclass(frozen=True, slots=True)
class Inbound:
    message: InboundMessage


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer the person with `text`, without the model (what it cannot read)."""

    chat: str
    text: str
    context: ReplyContext


@dataclass(frozen=True, slots=True)
class Skipped:
    reason: str


Item = Inbound | Notice | Skipped


def chat_key(source: Mapping[str, Any]) -> str | None:
    """The chat part of a session key for an event's `source`: the user id, or
    `group:<groupId>` / `room:<roomId>`; None for a source without its id."""
    kind = source.get("type")
    if kind == "user" and source.get("userId"):
        return str(source["userId"])
    if kind == GROUP and source.get("groupId"):
        return f"{GROUP}:{source['groupId']}"
    if kind == ROOM and source.get("roomId"):
        return f"{ROOM}:{source['roomId']}"
    return None


def push_target(chat: str) -> str:
    """The `to` of a push for a chat part of a session key."""
    kind, sep, rest = chat.partition(":")
    return rest if sep and kind in (GROUP, ROOM) else chat


def is_group_chat(chat: str) -> bool:
    return chat.startswith((f"{GROUP}:", f"{ROOM}:"))


def translate_request(
    payload: Mapping[str, Any],
    *,
    bot_user_id: str,
    received_at: float | None = None,
    sent_by_bot: Callable[[str], bool] = lambda _id: False,
) -> list[Item]:
    """Every event of one webhook request, in its order (see the module docstring).
    `sent_by_bot(message_id)` says whether a quoted message is one of the bot's."""
    at = time.time() if received_at is None else received_at
    events = payload.get("events")
    if not isinstance(events, list):
        return [Skipped("a request without an events array")]
    return [
        translate_event(e, bot_user_id=bot_user_id, received_at=at, sent_by_bot=sent_by_bot)
        if isinstance(e, Mapping)
        else Skipped("an event that is no object")
        for e in events
    ]


def translate_event(
    event: Mapping[str, Any],
    *,
    bot_user_id: str,
    received_at: float,
    sent_by_bot: Callable[[str], bool] = lambda _id: False,
) -> Item:
    kind = event.get("type")
    if event.get("mode") == "standby":
        return Skipped(f"a {kind!r} event in standby mode (another channel answers it)")
    if kind != "message":
        return Skipped(f"a {kind!r} event")
    source = event.get("source")
    message = event.get("message")
    if not isinstance(source, Mapping) or not isinstance(message, Mapping):
        return Skipped("a message event without its source or message")
    chat = chat_key(source)
    message_id = message.get("id")
    if chat is None or not message_id:
        return Skipped("a message without its chat or its id")
    group = is_group_chat(chat)
    context = ReplyContext(
        str(event.get("replyToken") or ""), received_at, str(message.get("quoteToken") or "")
    )
    content = _content(message, bot_user_id)
    if content is None:
        return Skipped(f"a {message.get('type')!r} message")
    if isinstance(content, str):
        if group:
            return Skipped(f"{content} in a group")
        return Notice(chat, unsupported_notice(content), context)
    text, files, mentioned = content
    quoted = str(message.get("quotedMessageId") or "")
    try:
        sent_at = float(event.get("timestamp") or 0) / 1000 or received_at
    except (TypeError, ValueError):
        sent_at = received_at
    metadata: dict[str, Any] = {
        META_IS_GROUP: group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: bool(quoted) and sent_by_bot(quoted),
        META_SENT_AT: sent_at,
        META_SOURCE: str(source.get("type")),
        META_REPLY_CONTEXT: context.to_dict(),
    }
    if quoted:
        metadata[META_QUOTED_ID] = quoted
        if metadata[META_REPLY_TO_BOT]:
            metadata[META_QUOTED_TEXT] = "(a message of yours)"
    return Inbound(
        InboundMessage(
            channel=CHANNEL,
            chat_id=chat,
            text=text,
            sender_id=str(source.get("userId") or ""),
            message_id=str(message_id),
            metadata=metadata,
            attachments=files,
        )
    )


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind}: I can read text, images, voice messages and files. "
        "Please write what you'd like me to know."
    )


def _content(
    message: Mapping[str, Any], bot_user_id: str
) -> tuple[str, tuple[Attachment, ...], bool] | str | None:
    """(text, files, mentions the bot) of a message the agent can read; a str: what the
    person sent that it cannot (for a notice); None: nothing to answer."""
    kind = message.get("type")
    message_id = str(message.get("id"))
    if kind == "text":
        text, mentioned = without_mention(
            str(message.get("text") or ""), message.get("mention"), bot_user_id
        )
        return text, (), mentioned
    if kind == "image":
        return "", (_file("image", message, "image.jpg", "image/jpeg"),), False
    if kind == "audio":
        return "", (_file("voice", message, "audio.m4a", "audio/mp4"),), False
    if kind == "file":
        name = str(message.get("fileName") or "file")
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        what = (
            "image"
            if mime.startswith("image/")
            else "voice"
            if mime.startswith("audio/")
            else "document"
        )
        size = message.get("fileSize")
        return (
            "",
            (Attachment(what, message_id, name, mime, size if isinstance(size, int) else None),),
            False,
        )
    if kind == "location":
        where = ", ".join(str(message[k]) for k in ("title", "address") if message.get(k))
        spot = f"{message.get('latitude')}, {message.get('longitude')}"
        return f"[location: {where + ' ' if where else ''}({spot})]", (), False
    if kind == "sticker":
        words = str(message.get("text") or "") or ", ".join(
            str(k) for k in message.get("keywords") or () if k
        )
        return (f"[The user sent a sticker{': ' + words if words else ''}]", (), False)
    if kind == "video":
        return "a video"
    return None


def _file(kind: str, message: Mapping[str, Any], name: str, mime: str) -> Attachment:
    provider = message.get("contentProvider")
    url = None
    if isinstance(provider, Mapping) and provider.get("type") == "external":
        url = str(provider.get("originalContentUrl") or "") or None
    return Attachment(kind, str(message.get("id")), name, mime, None, url)


def without_mention(text: str, mention: Any, bot_user_id: str) -> tuple[str, bool]:
    """The text without the bot's mentions (`mention.mentionees` with `isSelf`, or the
    bot's user id), and whether there was one. A comma or colon right after a mention
    goes with it; a text of nothing but the mention is kept as it is."""
    mentionees = mention.get("mentionees") if isinstance(mention, Mapping) else None
    cuts: list[tuple[int, int]] = []
    for m in mentionees if isinstance(mentionees, list) else ():
        if not isinstance(m, Mapping) or m.get("type", "user") != "user":
            continue
        if not (m.get("isSelf") is True or (bot_user_id and m.get("userId") == bot_user_id)):
            continue
        try:
            start, length = int(m["index"]), int(m["length"])
        except (KeyError, TypeError, ValueError):
            continue
        cuts.append((start, start + length))
    if not cuts:
        return text, False
    # LINE counts the index in UTF-16 units (Java strings); map them to characters.
    positions = [0]
    for char in text:
        positions.append(positions[-1] + (2 if ord(char) > 0xFFFF else 1))
    kept: list[str] = []
    position = 0
    for start16, end16 in sorted(cuts):
        start = _char_index(positions, start16)
        end = _char_index(positions, end16)
        while end < len(text) and text[end] in ",:":
            end += 1
        while end < len(text) and text[end] in " \t":
            end += 1
        kept.append(text[position:start])
        position = max(position, end)
    kept.append(text[position:])
    stripped = "".join(kept).strip()
    return (stripped or text.strip()), True


def _char_index(positions: list[int], unit: int) -> int:
    return min(bisect.bisect_left(positions, unit), len(positions) - 1)
