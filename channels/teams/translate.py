"""One Bot Framework activity from Teams as the gateway's `InboundMessage` (or nothing): the
policy of which activities are taken, their session keys and their metadata. Pure.

Where a conversation lives (the session key) and where its replies go:

- a personal chat with the bot, `a:1xyz...`: `teams:a:1xyz...`;
- a group chat, `19:abc...@thread.v2`: `teams:19:abc...@thread.v2`;
- a post in a team's channel and its replies, `19:def...@thread.tacv2;messageid=1700`:
  `teams:19:def...@thread.tacv2:thread:1700`.

In a channel every post starts a thread (its reply chain), and Teams names it by the
channel's id with `;messageid=<the post's id>`: the key keeps the two apart (`chat_id` is
the channel, `thread_id` the post), so `;` and `=` never reach a key, and a reply goes back
to `<channel>;messageid=<post>`, into the same thread. A conversation id is Teams' own and
opaque; the file-name encoding makes any key safe on disk.

Mentions: in channels and group chats Teams hands the bot only messages that @mention it,
unless the app has the resource-specific consent to read them all (ChannelMessage.Read.
Group, ChatMessage.Read.Chat); either way a message addresses the bot when a `mention`
entity names the bot's own account (`recipient.id`), never by its text, which a person can
write anything into. The mention's text (`<at>Bot</at>`) is taken out of the message;
other people's mentions read as `@Name`.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "teams"
THREAD = "thread"
MESSAGE_ID_MARK = ";messageid="
#: The only Bot Framework channel this package serves.
TEAMS_CHANNEL_ID = "msteams"
FILE_DOWNLOAD_INFO = "application/vnd.microsoft.teams.file.download.info"

_AT = re.compile(r"<at(?:\s[^>]*)?>(.*?)</at>", re.IGNORECASE | re.DOTALL)
_IMAGE_TYPES = frozenset({"png", "jpg", "jpeg", "gif", "webp", "bmp", "heic"})
_AUDIO_TYPES = frozenset({"mp3", "m4a", "wav", "ogg", "oga", "opus", "aac", "weba"})


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this activity (logged at debug level with `reason`)."""

    reason: str


def split_conversation(conversation_id: str) -> tuple[str, str | None]:
    """(the conversation, the channel thread's post id or None) of a conversation id."""
    base, sep, post = conversation_id.partition(MESSAGE_ID_MARK)
    return base, (post or None) if sep else None


def join_conversation(chat_id: str, thread_id: str | None) -> str:
    """The conversation id a reply goes to: a channel thread's, or the chat's. `chat_id`
    may carry the thread itself (`<channel>:thread:<post>`, as a heartbeat target does)."""
    base, sep, rest = chat_id.partition(f":{THREAD}:")
    if sep and not thread_id:
        thread_id = rest
    if not base:
        raise ValueError(f"teams: {chat_id!r} is not a conversation id")
    return f"{base}{MESSAGE_ID_MARK}{thread_id}" if thread_id else base


def conversation_type(activity: Mapping[str, Any]) -> str:
    """`personal`, `groupChat` or `channel` (inferred when the activity does not say)."""
    conversation = activity.get("conversation") or {}
    kind = conversation.get("conversationType")
    if isinstance(kind, str) and kind:
        return kind
    if MESSAGE_ID_MARK in str(conversation.get("id") or ""):
        return "channel"
    if conversation.get("isGroup"):
        return "groupChat"
    return "personal"


def tenant_of(activity: Mapping[str, Any]) -> str:
    data = activity.get("channelData") or {}
    tenant = data.get("tenant") if isinstance(data, Mapping) else None
    if isinstance(tenant, Mapping) and tenant.get("id"):
        return str(tenant["id"])
    return str((activity.get("conversation") or {}).get("tenantId") or "")


def mentions_of(activity: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(account id, name, text in the message) of each `mention` entity."""
    found = []
    for entity in activity.get("entities") or ():
        if not isinstance(entity, Mapping) or str(entity.get("type") or "").lower() != "mention":
            continue
        who = entity.get("mentioned")
        if not isinstance(who, Mapping) or not who.get("id"):
            continue
        found.append((str(who["id"]), str(who.get("name") or ""), str(entity.get("text") or "")))
    return found


def readable_text(text: str, bot_mentions: list[str]) -> str:
    """The message's text without the bot's mentions; other `<at>Name</at>` as `@Name`,
    HTML entities decoded."""
    for mention in bot_mentions:
        if mention:
            text = text.replace(mention, " ")

    def other(match: re.Match[str]) -> str:
        name = match.group(1).strip()
        return f"@{name.removeprefix('@')}" if name else ""

    text = _AT.sub(other, text)
    return html.unescape(text).replace("\u00a0", " ").strip()


def _kind(name: str, mime: str = "") -> str:
    extension = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if mime.startswith("image/") or extension in _IMAGE_TYPES:
        return "image"
    if mime.startswith("audio/") or extension in _AUDIO_TYPES:
        return "voice"
    return "document"


def attachments_of(activity: Mapping[str, Any]) -> tuple[Attachment, ...]:
    """Files a person sent: a file in a personal chat (Teams' `file.download.info`, with
    a short-lived download URL) and pasted images (a `contentUrl` on the connector,
    fetched with the bot's token). Cards and the HTML copy of the text are not files."""
    found = []
    for item in activity.get("attachments") or ():
        if not isinstance(item, Mapping):
            continue
        content_type = str(item.get("contentType") or "")
        name = str(item.get("name") or "")
        if content_type == FILE_DOWNLOAD_INFO:
            content = item.get("content")
            if not isinstance(content, Mapping) or not content.get("downloadUrl"):
                continue
            file_type = str(content.get("fileType") or "")
            if not name:
                name = f"file.{file_type}" if file_type else "file"
            found.append(
                Attachment(
                    _kind(name),
                    str(content.get("uniqueId") or name),
                    name,
                    "",
                    None,
                    str(content["downloadUrl"]),
                )
            )
        elif content_type.startswith("image/") and item.get("contentUrl"):
            url = str(item["contentUrl"])
            found.append(
                Attachment("image", url, name or "image", content_type.split(";")[0], None, url)
            )
    return tuple(found)


def _sent_at(activity: Mapping[str, Any]) -> float | None:
    stamp = activity.get("timestamp")
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        # Teams writes up to 7 fractional digits; fromisoformat takes 6.
        trimmed = re.sub(r"(\.\d{6})\d+", r"\1", stamp.replace("Z", "+00:00"))
        return datetime.fromisoformat(trimmed).timestamp()
    except ValueError:
        return None


def translate_activity(activity: Mapping[str, Any]) -> InboundMessage | Skip:
    """The inbound message for one activity, or why there is none. Takes `message`
    activities and edits (`messageUpdate` with `editMessage`); an edit is a message of its
    own that names the message it changes (`META_EDIT_OF`)."""
    kind = activity.get("type")
    data = activity.get("channelData") or {}
    event = str(data.get("eventType") or "") if isinstance(data, Mapping) else ""
    edited = kind == "messageUpdate" and event == "editMessage"
    if kind != "message" and not edited:
        return Skip(f"a {kind!r} activity{f' ({event})' if event else ''}")
    if activity.get("channelId") != TEAMS_CHANNEL_ID:
        return Skip(f"an activity from channel {activity.get('channelId')!r}, not Teams")
    conversation = activity.get("conversation") or {}
    conversation_id = str(conversation.get("id") or "")
    activity_id = str(activity.get("id") or "")
    sender = activity.get("from") or {}
    bot = activity.get("recipient") or {}
    if not conversation_id or not activity_id or not sender.get("id"):
        return Skip("an activity without a conversation, an id or a sender")
    if sender.get("id") == bot.get("id") or str(sender.get("role") or "") == "bot":
        return Skip("the bot's own message")
    chat, post = split_conversation(conversation_id)
    scope = conversation_type(activity)
    is_group = scope != "personal"
    bot_id = str(bot.get("id") or "")
    mentions = mentions_of(activity)
    bot_mentions = [text for who, _, text in mentions if who == bot_id]
    text = readable_text(str(activity.get("text") or ""), bot_mentions)
    files = attachments_of(activity)
    if not text and not files:
        return Skip("no text and nothing attached")
    name = str(sender.get("name") or "")
    sender_id = str(sender.get("aadObjectId") or sender["id"])
    post_id = f"{chat}:{activity_id}"
    context: dict[str, Any] = {
        "service_url": str(activity.get("serviceUrl") or ""),
        "conversation": conversation_id,
        "activity": activity_id,
    }
    if tenant := tenant_of(activity):
        context["tenant"] = tenant
    if is_group:
        # A reply in a group names its sender: Teams shows no quote of what it answers.
        context["sender"] = {"id": str(sender["id"]), "name": name}
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: bool(bot_mentions),
        META_REPLY_TO_BOT: False,  # Teams hands over no reply to the bot without a mention
        META_POST_ID: post_id,
        META_REPLY_CONTEXT: context,
        "teams_conversation_type": scope,
    }
    if name:
        metadata[META_SENDER_NAME] = name
    sent_at = _sent_at(activity)
    if sent_at is not None:
        metadata[META_SENT_AT] = sent_at
    message_id = post_id
    if edited:
        metadata[META_EDIT_OF] = post_id
        stamp = (
            str(activity.get("timestamp") or "")
            or hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        )
        message_id = f"{post_id}:edit:{stamp}"
    return InboundMessage(
        channel=CHANNEL,
        chat_id=chat,
        text=text,
        sender_id=sender_id,
        message_id=message_id,
        thread_kind=THREAD if post else None,
        thread_id=post,
        metadata=metadata,
        attachments=files,
    )
