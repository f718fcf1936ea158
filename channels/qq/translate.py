"""One OneBot v11 message event as the gateway's `InboundMessage` (or why there is none):
which messages are taken, their session keys and their metadata. Pure functions.

Where a conversation lives (the session key), and where its replies go:
- a private chat (a friend's, or a temporary chat someone opened from a group):
  `qq:private:<user_id>`, answered with `send_private_msg` (through the group for a
  temporary chat);
- a group: `qq:group:<group_id>`, answered with `send_group_msg`.
QQ has no threads. In a group the bot answers a message that @-mentions it (an `at`
segment naming its own QQ number; `at all` does not count) or that quotes one of its
messages (a `reply` segment); the core screens the rest (`require_mention`). Private
chats are answered always, once the sender passed the DM policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from channels.qq.onebot import Segment, segments_of
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "qq"
PRIVATE = "private"
GROUP = "group"
#: Metadata: the id of the message a message quotes (its `reply` segment).
META_QUOTES = "qq_quotes"


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this event (logged at debug level with `reason`)."""

    reason: str


def conversation_of(event: dict[str, Any], self_id: str) -> str | None:
    """The chat id of the conversation a message event belongs to (`private:<user>`,
    `group:<group>`), the bot's own messages included; None for anything else."""
    kind = event.get("message_type")
    if kind == GROUP and event.get("group_id") is not None:
        return f"{GROUP}:{event['group_id']}"
    if kind == PRIVATE:
        author = str(event.get("user_id") or "")
        peer = event.get("target_id") if author == self_id else author
        return f"{PRIVATE}:{peer}" if peer else None
    return None


def target_of(chat_id: str) -> tuple[str, str]:
    """("private" or "group", its number) of a chat id; ValueError for another."""
    kind, _, number = chat_id.partition(":")
    if kind not in (PRIVATE, GROUP) or not number.isdigit():
        raise ValueError(f"qq: {chat_id!r} is not private:<QQ number> or group:<group number>")
    return kind, number


def quoted_id(segments: list[Segment]) -> str | None:
    """The id of the message a message quotes (its first `reply` segment), if any."""
    for segment in segments:
        if segment["type"] == "reply" and segment["data"].get("id") not in (None, ""):
            return str(segment["data"]["id"])
    return None


def mentions_self(segments: list[Segment], self_id: str) -> bool:
    """Whether an `at` segment names the bot (`at all` does not)."""
    return any(
        segment["type"] == "at" and str(segment["data"].get("qq") or "") == self_id
        for segment in segments
    )


def sender_name(event: dict[str, Any]) -> str:
    """Who wrote it, as people see them: a group card, else the nickname, else the number."""
    sender = event.get("sender") or {}
    for key in ("card", "nickname", "remark"):
        value = str(sender.get(key) or "").strip()
        if value:
            return value
    return str(event.get("user_id") or "")


def read_segments(
    segments: list[Segment], self_id: str
) -> tuple[str, bool, tuple[Attachment, ...]]:
    """(the text the model reads, whether an `at` names the bot, the attachments): the
    bot's own mention is cut out, other mentions read `@name`."""
    parts: list[str] = []
    files: list[Attachment] = []
    for segment in segments:
        kind, data = segment["type"], segment["data"]
        if kind == "text":
            parts.append(str(data.get("text") or ""))
        elif kind == "at":
            qq = str(data.get("qq") or "")
            if qq == self_id:
                continue
            if qq == "all":
                parts.append("@all")
            else:
                parts.append(f"@{data.get('name') or qq}")
        elif kind == "face":
            parts.append("[face]")
        elif kind in ("image", "record", "video", "file"):
            found = attachment_of(kind, data)
            if found is not None:
                files.append(found)
    text = "".join(parts).strip()
    return text, mentions_self(segments, self_id), tuple(files)


_KINDS = {"image": "image", "record": "voice", "file": "document", "video": "other"}


def attachment_of(kind: str, data: dict[str, Any]) -> Attachment | None:
    """A media segment as a reference the agent fetches at turn time (its `url`, QQ's
    download address, when the implementation gives one)."""
    url = str(data.get("url") or "") or None
    name = str(data.get("name") or data.get("file") or kind)
    file_id = str(data.get("file_id") or data.get("file") or url or "")
    if not file_id:
        return None
    size = data.get("file_size") or data.get("size")
    try:
        size_bytes = int(size) if size not in (None, "") else None
    except (TypeError, ValueError):
        size_bytes = None
    mime = _image_mime(name) if kind == "image" else ""
    return Attachment(_KINDS[kind], file_id, name, mime, size_bytes, url)


def _image_mime(name: str) -> str:
    lower = name.lower()
    for suffix, mime in ((".png", "image/png"), (".gif", "image/gif"), (".webp", "image/webp")):
        if lower.endswith(suffix):
            return mime
    return "image/jpeg"  # QQ's own pictures, named by their hash


def translate_event(
    event: dict[str, Any], *, self_id: str, quoted_author: str | None = None
) -> InboundMessage | Skip:
    """The inbound message for one message event, or why there is none. `quoted_author`
    is the QQ number of whoever wrote the message this one quotes (the channel looks it
    up), to tell a reply to the bot."""
    if event.get("post_type") != "message":
        return Skip(f"not a message ({event.get('post_type')})")
    user_id = str(event.get("user_id") or "")
    if user_id == self_id:
        return Skip("the bot's own message")
    kind = event.get("message_type")
    if kind not in (PRIVATE, GROUP):
        return Skip(f"a {kind} message")
    if kind == GROUP and event.get("sub_type") in ("anonymous", "notice"):
        return Skip(f"an {event.get('sub_type')} group message")
    if event.get("message_id") is None or not user_id:
        return Skip("a message without an id or a sender")
    segments = segments_of(event.get("message"))
    text, mentioned, files = read_segments(segments, self_id)
    if not text and not files:
        return Skip("no text and nothing attached")
    quoted = quoted_id(segments)
    chat_id = conversation_of(event, self_id)
    if chat_id is None:
        return Skip("a message of no conversation")
    is_group = kind == GROUP
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: bool(quoted) and quoted_author == self_id,
        META_SENDER_NAME: sender_name(event),
    }
    sent_at = event.get("time")
    if isinstance(sent_at, int | float) and sent_at > 0:
        metadata[META_SENT_AT] = float(sent_at)
    if quoted:
        metadata[META_QUOTES] = quoted
    if is_group:
        # Copied onto the reply (a reply sent again after a restart still has it): who to
        # @-mention.
        metadata[META_REPLY_CONTEXT] = {"user_id": user_id}
    elif event.get("sub_type") == "group" and event.get("group_id"):
        # A temporary chat opened from a group: the reply goes back through that group.
        metadata[META_REPLY_CONTEXT] = {"group_id": str(event["group_id"])}
    return InboundMessage(
        channel=CHANNEL,
        chat_id=chat_id,
        text=text,
        sender_id=user_id,
        message_id=str(event["message_id"]),
        metadata=metadata,
        attachments=files,
    )
