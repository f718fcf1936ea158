"""One Mattermost post as the gateway's `InboundMessage` (or nothing): the policy of which
posts are taken, their session keys and their metadata. Pure functions.

Where a conversation lives (the session key), and where its replies go:
- a channel (public `O`, private `P`, a group message `G`) or a direct message (`D`):
  `mattermost:<channel_id>`, answered in the channel;
- a thread (a post with a `root_id`): `mattermost:<channel_id>:thread:<root_id>`,
  answered in the thread.
In channels and group messages the bot answers a post that mentions it (`@botname`) or
that replies in a thread the bot started (`require_mention`, applied by the access gate);
direct messages are answered always, once the sender passed the DM policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from channels.mattermost.format import mentions_user, strip_mention
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "mattermost"
THREAD = "thread"
#: Channel types (`model.ChannelType*`): open, private, direct, group.
DIRECT = "D"
GROUP_TYPES = frozenset({"O", "P", "G"})


@dataclass(frozen=True, slots=True)
class Sender:
    """Who wrote a post: their user id, username and the name people see."""

    user_id: str
    username: str = ""
    display: str = ""

    @property
    def shown(self) -> str:
        if self.display and self.username and self.display != self.username:
            return f"{self.display} (@{self.username})"
        return f"@{self.username}" if self.username else self.user_id

    @classmethod
    def from_user(cls, user: dict[str, Any]) -> Sender:
        first, last = str(user.get("first_name") or ""), str(user.get("last_name") or "")
        full = f"{first} {last}".strip()
        display = str(user.get("nickname") or "") or full
        return cls(str(user.get("id") or ""), str(user.get("username") or ""), display)


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this post (logged at debug level with `reason`)."""

    reason: str


def is_from_a_bot(post: dict[str, Any]) -> bool:
    """A post an integration made: a bot account's, a webhook's, a plugin's."""
    props = post.get("props") or {}
    return any(
        str(props.get(k, "")).lower() == "true" for k in ("from_bot", "from_webhook")
    ) or bool(props.get("from_plugin"))


def attachments_of(post: dict[str, Any]) -> tuple[Attachment, ...]:
    """The files of a post (from its `metadata.files`), as references the agent fetches
    at turn time (`GET /files/{id}`, with the bot's token)."""
    infos = (post.get("metadata") or {}).get("files") or []
    found = []
    for info in infos:
        if not isinstance(info, dict) or not info.get("id"):
            continue
        mime = str(info.get("mime_type") or "").split(";")[0].strip()
        if mime.startswith("image/"):
            kind = "image"
        elif mime.startswith("audio/"):
            kind = "voice"
        else:
            kind = "document"
        size = info.get("size")
        found.append(
            Attachment(
                kind,
                str(info["id"]),
                str(info.get("name") or "file"),
                mime,
                int(size) if isinstance(size, int | float) else None,
            )
        )
    return tuple(found)


def translate_post(
    post: dict[str, Any],
    channel_type: str,
    *,
    bot_id: str,
    bot_username: str,
    sender: Sender,
    root_author: str | None = None,
    edited: bool = False,
    team_id: str = "",
) -> InboundMessage | Skip:
    """The inbound message for one post, or why there is none."""
    if post.get("user_id") == bot_id:
        return Skip("the bot's own post")
    if post.get("type"):
        return Skip(f"a system message ({post.get('type')})")
    if is_from_a_bot(post):
        return Skip("a post from a bot, a webhook or a plugin")
    if post.get("delete_at"):
        return Skip("a deleted post")
    message = str(post.get("message") or "")
    files = attachments_of(post)
    if not message.strip() and not files:
        return Skip("no text and nothing attached")
    is_group = channel_type != DIRECT
    mentioned = mentions_user(message, bot_username)
    root_id = str(post.get("root_id") or "")
    reply_to_bot = bool(root_id) and root_author == bot_id
    text = strip_mention(message, bot_username) if mentioned else message.strip()
    post_id = str(post["id"])
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: reply_to_bot,
        META_SENDER_NAME: sender.shown,
        META_SENT_AT: int(post.get("create_at") or 0) / 1000,
        "mattermost_channel_type": channel_type,
    }
    if team_id:
        metadata["mattermost_team"] = team_id
    if is_group and sender.username:
        # The reply names its sender (Mattermost posts have no quote of what they answer);
        # copied onto the reply, so a reply sent again after a restart still has it.
        metadata[META_REPLY_CONTEXT] = {"mention": sender.username}
    message_id = post_id
    if edited:
        # An edit is a message of its own (its id differs per edit, for dedupe) that names
        # the post it changes; the core decides whether it re-runs a turn.
        edit_at = int(post.get("edit_at") or post.get("update_at") or 0)
        metadata[META_EDIT_OF] = post_id
        metadata[META_SENT_AT] = edit_at / 1000
        message_id = f"{post_id}:edit:{edit_at}"
    return InboundMessage(
        channel=CHANNEL,
        chat_id=str(post.get("channel_id") or ""),
        text=text,
        sender_id=sender.user_id or str(post.get("user_id") or ""),
        message_id=message_id,
        thread_kind=THREAD if root_id else None,
        thread_id=root_id or None,
        metadata=metadata,
        attachments=files,
    )


def target_of(chat_id: str, thread_id: str | None = None) -> tuple[str, str]:
    """(channel id, root id or "") a reply goes to: the thread when there is one.
    `chat_id` may carry the thread itself (`<channel>:thread:<root>`, as heartbeat
    targets do)."""
    channel, sep, rest = chat_id.partition(f":{THREAD}:")
    if sep and not thread_id:
        thread_id = rest
    if not channel:
        raise ValueError(f"mattermost: {chat_id!r} is not a channel id")
    return channel, thread_id or ""
