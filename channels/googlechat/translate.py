"""One Google Chat interaction event as the gateway's `InboundMessage` (or nothing): which
events are taken, their session keys and their metadata. Pure functions.

Google Chat sends the app a `MESSAGE` event for every message in a direct message with
it, and in a space or group conversation only for a message that @mentions it or uses
one of its slash commands (developers.google.com/workspace/chat/api/reference/rest/v1/
EventType); chatter in a space never reaches the app. `ADDED_TO_SPACE` carries the
message too when someone added the app by mentioning it. Every other event (the app
removed, a card clicked) is answered and skipped.

Where a conversation lives (the session key), and where its replies go:
- a direct message, a space, a group conversation: `googlechat:<space id>`, answered at
  the space's top level;
- a reply in a thread (`threadReply`): `googlechat:<space id>:thread:<thread id>`,
  answered in the thread.
In a space the reply names its sender (`<users/ID>`), the one mention the app makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.messages import (
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

CHANNEL = "googlechat"
THREAD = "thread"
DIRECT = "DIRECT_MESSAGE"
#: Events that carry a message the app is asked about.
MESSAGE_EVENTS = frozenset({"MESSAGE", "ADDED_TO_SPACE"})


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to submit for this event (logged at debug level with `reason`)."""

    reason: str


def short_id(name: str, kind: str) -> str:
    """The last part of a resource name (`spaces/AAA` -> `AAA`, `users/123` -> `123`)."""
    prefix, sep, rest = name.partition("/")
    if not sep or prefix != kind or not rest:
        return ""
    return rest.rsplit("/", 1)[-1]


def is_direct(space: dict[str, Any]) -> bool:
    """A direct message: `spaceType` DIRECT_MESSAGE (or the older `type` DM)."""
    return space.get("spaceType") == DIRECT or space.get("type") == "DM"


def event_time(value: object) -> float:
    """An RFC 3339 time (`2024-05-01T10:00:00.123456Z`) as Unix seconds; 0 if unreadable."""
    if not isinstance(value, str) or not value:
        return 0.0
    text = value.replace("Z", "+00:00")
    if "." in text:  # Google writes up to nanoseconds; Python reads microseconds
        head, _, tail = text.partition(".")
        digits = "".join(c for c in tail if c.isdigit())
        zone = tail[len(digits) :]
        text = f"{head}.{digits[:6]}{zone}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return 0.0


def mentions_app(message: dict[str, Any]) -> bool:
    """Does the message address the app: a mention of an app (`USER_MENTION` of a user of
    type BOT: in a space Google sends the app only messages that mention it, so the one
    mentioned is this app), or one of its slash commands?"""
    if message.get("slashCommand"):
        return True
    for annotation in message.get("annotations") or ():
        if not isinstance(annotation, dict):
            continue
        if annotation.get("type") == "SLASH_COMMAND":
            return True
        if annotation.get("type") != "USER_MENTION":
            continue
        user = (annotation.get("userMention") or {}).get("user") or {}
        if isinstance(user, dict) and user.get("type") == "BOT":
            return True
    return False


def attachments_of(message: dict[str, Any]) -> tuple[tuple[Attachment, ...], list[str]]:
    """(files the agent can fetch, names of those it cannot): an uploaded file is fetched
    with the app's token (`media.download` of its `attachmentDataRef.resourceName`); a
    Google Drive file needs the Drive API, which the app is not given."""
    files: list[Attachment] = []
    drive: list[str] = []
    for item in message.get("attachment") or ():
        if not isinstance(item, dict):
            continue
        name = str(item.get("contentName") or "file")
        mime = str(item.get("contentType") or "").split(";")[0].strip()
        ref = (item.get("attachmentDataRef") or {}).get("resourceName")
        if item.get("source") == "DRIVE_FILE" or not ref:
            drive.append(name)
            continue
        if mime.startswith("image/"):
            kind = "image"
        elif mime.startswith("audio/"):
            kind = "voice"
        else:
            kind = "document"
        files.append(Attachment(kind, str(ref), name, mime))
    return tuple(files), drive


def translate_event(event: dict[str, Any]) -> InboundMessage | Skip:
    """The inbound message of one interaction event, or why there is none."""
    kind = str(event.get("type") or "")
    if kind not in MESSAGE_EVENTS:
        return Skip(f"a {kind or 'typeless'} event")
    message = event.get("message")
    if not isinstance(message, dict) or not message.get("name"):
        return Skip(f"a {kind} event without a message")
    space = message.get("space") or event.get("space") or {}
    if not isinstance(space, dict):
        space = {}
    space_id = short_id(str(space.get("name") or ""), "spaces")
    if not space_id:
        return Skip("a message without a space")
    sender = message.get("sender") or event.get("user") or {}
    if not isinstance(sender, dict):
        sender = {}
    if sender.get("type") == "BOT":
        return Skip("a message from an app")
    if message.get("deleteTime"):
        return Skip("a deleted message")
    direct = is_direct(space)
    addressed = mentions_app(message)
    raw = str(message.get("text") or "")
    argument = message.get("argumentText")
    # `argumentText` is the text without the app's mentions; for a slash command it lacks
    # the command's name too (`/vote yes` -> ` yes`), which the text keeps.
    use_argument = addressed and argument is not None and not message.get("slashCommand")
    text = (str(argument) if use_argument else raw).strip()
    files, drive = attachments_of(message)
    if drive:
        names = ", ".join(drive)
        text = (f"{text}\n\n" if text else "") + (
            f"[The user attached Google Drive file(s) the assistant cannot open: {names}]"
        )
    if not text and not files:
        return Skip("no text and nothing attached")
    thread_name = str((message.get("thread") or {}).get("name") or "")
    thread_id = short_id(thread_name, "spaces") if message.get("threadReply") else ""
    user_id = short_id(str(sender.get("name") or ""), "users")
    name = str(sender.get("displayName") or "")
    metadata: dict[str, Any] = {
        META_IS_GROUP: not direct,
        META_MENTIONED: addressed and not direct,
        META_REPLY_TO_BOT: False,
        META_SENT_AT: event_time(message.get("createTime") or event.get("eventTime")),
        META_POST_ID: str(message["name"]),
        "googlechat_space_type": str(space.get("spaceType") or space.get("type") or ""),
    }
    if name:
        metadata[META_SENDER_NAME] = name
    if thread_name:
        metadata["googlechat_thread"] = thread_name
    if not direct and user_id:
        # The reply names its sender (copied onto the reply, so a reply sent again after a
        # restart still has it).
        metadata[META_REPLY_CONTEXT] = {"mention": f"users/{user_id}"}
    return InboundMessage(
        channel=CHANNEL,
        chat_id=space_id,
        text=text,
        sender_id=user_id,
        message_id=str(message["name"]),
        thread_kind=THREAD if thread_id else None,
        thread_id=thread_id or None,
        metadata=metadata,
        attachments=files,
    )


def target_of(chat_id: str, thread_id: str | None = None) -> tuple[str, str | None]:
    """(space id, thread resource name or None) a reply goes to. `chat_id` may carry the
    thread itself (`<space>:thread:<thread>`, as heartbeat targets do)."""
    space, sep, rest = chat_id.partition(f":{THREAD}:")
    if sep and not thread_id:
        thread_id = rest
    space = space.removeprefix("spaces/")
    if not space or "/" in space:
        raise ValueError(f"googlechat: {chat_id!r} is not a space id")
    return space, f"spaces/{space}/threads/{thread_id}" if thread_id else None
