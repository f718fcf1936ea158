"""Messages that cross the boundary between channel adapters and the core."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.sessions.keys import encode_key

#: Metadata of a merged (collect mode) message: the platform ids of the messages it holds.
MERGED_IDS_KEY = "merged_message_ids"

#: Metadata of a reply that is the session's stored answer to its message: a replay
#: after a crash finds it there (`gateway.agent.turns`), so it needs no outbox record.
META_IN_SESSION = "in_session"

#: Metadata of a message the dispatcher replays after a crash: its turn may have begun
#: (the user's entry may be in the session already).
META_REPLAYED = "replayed"
#: Metadata of the reply to a replayed message (`META_REPLAYED`): the id of its session
#: entry. Messages that joined one turn (the steer mode) share it, so the replay sends
#: that reply once for them all (`gateway.dispatch`).
META_REPLY_ENTRY = "reply_entry"
#: Metadata of a message the shared mode's router hands over for the first time, under
#: a session lease this replica has held since its previous turn of the session: no
#: turn of it can have begun, and no other replica wrote to the session meanwhile, so
#: the session as cached here is current (`gateway.dispatch.router`).
META_SESSION_CURRENT = "session_current"
#: Metadata of a message whose sender waits for the reply on its HTTP request
#: (`/api/chat`): in the shared mode its reply is handed to the replica holding that
#: request, wherever the turn ran (`gateway.dispatch.router`).
META_REPLY_WANTED = "reply_wanted"
#: Metadata of a stateless call of the OpenAI-compatible API: its session is thrown
#: away after the turn, so nothing of it reaches memory (no consolidation).
META_EPHEMERAL = "ephemeral"
#: Metadata of an OpenAI-compatible API message whose client reads the reply as it is
#: written: the id of the stream its text deltas go to (`gateway.http.door`).
META_API_STREAM = "api_stream"

#: Metadata naming the platform message as the person sees it (Telegram `chat:message_id`,
#: Slack `channel:ts`) where the message id is something else (Slack's event id) or an
#: edit's own id: an edit finds the message it changes by it.
META_POST_ID = "post_id"
#: Metadata of an edited message: the `post_id` (or message id) of the message it changes.
META_EDIT_OF = "edit_of"
#: Metadata of a message the gateway itself made (a scheduled run over its conversation's
#: daily budget) that is answered with this text, without a turn: both are stored in the
#: session, and the answer is delivered like any reply.
META_NOTICE = "notice"
#: Metadata of an inbound message: what its platform needs to answer it in place (email:
#: the subject and the References chain), opaque to the core. `reply_for` copies it onto
#: the reply, so a reply sent from the outbox after a restart still has it.
META_REPLY_CONTEXT = "reply_context"
#: Metadata: when the person sent the message, by the platform's clock (Unix seconds);
#: `received_at` is when the gateway got it, which after downtime can be much later.
META_SENT_AT = "sent_at"


def build_session_key(channel: str, chat_id: str, *, thread: tuple[str, str] | None = None) -> str:
    """The one place a session key is built: `channel:chat_id[:kind:thread_id]`.

    Parts are opaque strings; a colon inside a part is kept as it is (the file-name
    encoding makes any key safe on disk), so keys stay readable for operators.
    """
    if not channel or not chat_id:
        raise ValueError("a session key needs a channel and a chat id")
    key = f"{channel}:{chat_id}"
    if thread is not None:
        kind, thread_id = thread
        key = f"{key}:{kind}:{thread_id}"
    return key


#: The terminal's channel, and its session when none is named.
TERMINAL_CHANNEL = "cli"
DEFAULT_TERMINAL_SESSION = f"{TERMINAL_CHANNEL}:direct"


def session_key_from_name(name: str | None) -> str:
    """The session key a person means by `name`, wherever they type one (`chat
    --session`, `sessions show`, `memory show`, `channels.cli.session`, ...).

    A name without a colon is a terminal session (`work` -> `cli:work`); a full key
    (`telegram:123`, `cli:work`) is used as given; no name is `cli:direct`. Raises
    SessionKeyError (a ValueError) for a key that cannot be stored.
    """
    if not name:
        return DEFAULT_TERMINAL_SESSION
    key = name if ":" in name else build_session_key(TERMINAL_CHANNEL, name)
    encode_key(key)
    return key


#: Metadata of a message in a group or channel: the text of the message it replies to
#: (a Telegram reply, a Slack thread's parent), and who wrote that one.
META_QUOTED_TEXT = "quoted_text"
META_QUOTED_SENDER = "quoted_sender"


@dataclass(frozen=True, slots=True)
class Attachment:
    """A file a person sent with a message, as the platform refers to it: never its
    bytes (the journal keeps the reference; the agent fetches the file at turn time).

    `kind` is "image", "voice" (a voice note or audio clip to transcribe) or
    "document"; anything else is "other". `file_id` is the platform's id for it;
    `url` is where it can be downloaded when the platform says so up front (Slack's
    url_private_download).
    """

    kind: str
    file_id: str
    name: str = ""
    mime_type: str = ""
    size: int | None = None
    url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "file_id": self.file_id,
            "name": self.name,
            "mime_type": self.mime_type,
            "size": self.size,
            "url": self.url,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attachment:
        size = data.get("size")
        return cls(
            kind=str(data.get("kind") or "other"),
            file_id=str(data.get("file_id") or ""),
            name=str(data.get("name") or ""),
            mime_type=str(data.get("mime_type") or ""),
            size=int(size) if isinstance(size, int | float) else None,
            url=data.get("url") or None,
        )


@dataclass(frozen=True, slots=True)
class OutboundFile:
    """A file or image that goes out with a reply (a tool's result, a long code block).
    The bytes travel with the reply, so an outbox record can send it again."""

    name: str
    data: bytes
    mime_type: str = "application/octet-stream"
    caption: str = ""

    @property
    def is_image(self) -> bool:
        return self.mime_type.startswith("image/")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "data": base64.b64encode(self.data).decode("ascii"),
            "mime_type": self.mime_type,
            "caption": self.caption,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutboundFile:
        return cls(
            name=str(data["name"]),
            data=base64.b64decode(str(data.get("data") or "")),
            mime_type=str(data.get("mime_type") or "application/octet-stream"),
            caption=str(data.get("caption") or ""),
        )


#: What joins a subagent's session key to its parent's: `<parent key>:sub:<id>`.
SUBAGENT_MARK = ":sub:"


def subagent_session_key(parent: str, sub_id: str) -> str:
    """The session of a subagent `parent` spawned: `<parent>:sub:<id>`."""
    return f"{parent}{SUBAGENT_MARK}{sub_id}"


def subagent_depth(key: str) -> int:
    """How many subagents deep `key` is (0: a conversation's own session)."""
    return key.count(SUBAGENT_MARK)


def root_session_key(key: str) -> str:
    """The conversation a (sub)agent session belongs to: `key` up to its first `:sub:`."""
    return key.split(SUBAGENT_MARK, 1)[0]


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """A message from a person (or a scheduled job) on its way to the agent.

    `session_key` is decided here, at the edge: the core never learns which platform
    a message came from beyond the key itself.
    """

    channel: str
    chat_id: str
    text: str
    sender_id: str = ""
    message_id: str | None = None
    thread_kind: str | None = None
    thread_id: str | None = None
    session_key_override: str | None = None
    received_at: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)
    attachments: tuple[Attachment, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The message as JSON-ready data (for the inbound journal)."""
        data: dict[str, Any] = {
            "channel": self.channel,
            "chat_id": self.chat_id,
            "text": self.text,
            "sender_id": self.sender_id,
            "message_id": self.message_id,
            "thread_kind": self.thread_kind,
            "thread_id": self.thread_id,
            "session_key_override": self.session_key_override,
            "received_at": self.received_at,
            "metadata": self.metadata,
        }
        if self.attachments:
            data["attachments"] = [a.to_dict() for a in self.attachments]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InboundMessage:
        return cls(
            channel=str(data["channel"]),
            chat_id=str(data["chat_id"]),
            text=str(data["text"]),
            sender_id=str(data.get("sender_id") or ""),
            message_id=data.get("message_id"),
            thread_kind=data.get("thread_kind"),
            thread_id=data.get("thread_id"),
            session_key_override=data.get("session_key_override"),
            received_at=float(data.get("received_at") or time.time()),
            metadata=dict(data.get("metadata") or {}),
            attachments=tuple(
                Attachment.from_dict(a)
                for a in data.get("attachments") or ()
                if isinstance(a, dict)
            ),
        )

    @property
    def session_key(self) -> str:
        if self.session_key_override:
            return self.session_key_override
        thread = (
            (self.thread_kind, self.thread_id)
            if self.thread_kind is not None and self.thread_id is not None
            else None
        )
        return build_session_key(self.channel, self.chat_id, thread=thread)


@dataclass(frozen=True, slots=True)
class OutboundMessage:
    """The agent's reply, addressed back to where the inbound message came from."""

    channel: str
    chat_id: str
    text: str
    session_key: str
    reply_to: str | None = None
    thread_id: str | None = None
    is_error: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    files: tuple[OutboundFile, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The reply as JSON-ready data (for the outbox)."""
        data: dict[str, Any] = {
            "channel": self.channel,
            "chat_id": self.chat_id,
            "text": self.text,
            "session_key": self.session_key,
            "reply_to": self.reply_to,
            "thread_id": self.thread_id,
            "is_error": self.is_error,
            "metadata": self.metadata,
        }
        if self.files:
            data["files"] = [f.to_dict() for f in self.files]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutboundMessage:
        return cls(
            channel=str(data["channel"]),
            chat_id=str(data["chat_id"]),
            text=str(data["text"]),
            session_key=str(data["session_key"]),
            reply_to=data.get("reply_to"),
            thread_id=data.get("thread_id"),
            is_error=bool(data.get("is_error")),
            metadata=dict(data.get("metadata") or {}),
            files=tuple(
                OutboundFile.from_dict(f) for f in data.get("files") or () if isinstance(f, dict)
            ),
        )


def reply_for(
    inbound: InboundMessage,
    text: str,
    *,
    is_error: bool = False,
    metadata: dict[str, Any] | None = None,
    files: tuple[OutboundFile, ...] = (),
) -> OutboundMessage:
    """A reply addressed back to where `inbound` came from: same chat, thread, session
    (and the platform's reply context, `META_REPLY_CONTEXT`, when the message has one)."""
    context = inbound.metadata.get(META_REPLY_CONTEXT)
    if context is not None:
        metadata = {META_REPLY_CONTEXT: context, **(metadata or {})}
    return OutboundMessage(
        channel=inbound.channel,
        chat_id=inbound.chat_id,
        text=text,
        session_key=inbound.session_key,
        reply_to=inbound.message_id,
        thread_id=inbound.thread_id,
        is_error=is_error,
        metadata=metadata or {},
        files=files,
    )


#: True when the message comes from a group chat / channel rather than a DM.
META_IS_GROUP = "is_group"

#: True when the bot was @-mentioned in the message.
META_MENTIONED = "mentioned"

#: True when the message replies to one of the bot's messages.
META_REPLY_TO_BOT = "reply_to_bot"

#: The sender's display name, shown to the operator when approving (optional).
META_SENDER_NAME = "sender_name"
