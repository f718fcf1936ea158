"""What signal-cli hands over, as the gateway's messages: one `receive` result (an
envelope, signal-cli's `JsonMessageEnvelope`) becomes an `InboundMessage`, a `Notice` to
answer without the model, or a `Skip`. Pure functions; no HTTP here.

Where a conversation lives (its session key):
- a person's DM: `signal:<their ACI uuid>` (their number when signal-cli knows no uuid);
- a group: `signal:group:<group id>` (the base64 id signal-cli writes).
A message's id is `<sender>:<timestamp>`: Signal names a message by its author and the
author's sent timestamp (what a quote, a reaction, a receipt and an edit point at).

In a group the message addresses the bot when it mentions the bot's number or uuid (the
mention is U+FFFC in the text, a range in `mentions`) or quotes one of the bot's messages.
The bot's mention is cut out of the text; other people's become `@<their number>`.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_QUOTED_SENDER,
    META_QUOTED_TEXT,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
)

CHANNEL = "signal"
GROUP_PREFIX = "group:"
MENTION_MARK = "\ufffc"
#: Text files Signal's apps send for a body over 2,000 bytes (signal-cli reads them into
#: the body itself).
LONG_TEXT = "text/x-signal-plain"


@dataclass(frozen=True, slots=True)
class Me:
    """The bot's own Signal identity: its number, and its uuid when known."""

    number: str
    uuid: str = ""

    def __contains__(self, who: object) -> bool:
        return bool(who) and who in (self.number, self.uuid)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a message goes: a person (uuid or number) or a group (its id)."""

    recipient: str | None = None
    group_id: str | None = None

    def params(self) -> dict[str, Any]:
        """signal-cli's parameters naming it."""
        if self.group_id is not None:
            return {"groupId": self.group_id}
        return {"recipient": [self.recipient]}


def parse_target(chat_id: str) -> Target:
    """A chat id (`<uuid>`, `+<number>`, `group:<id>`) as signal-cli's recipient."""
    if chat_id.startswith(GROUP_PREFIX):
        return Target(group_id=chat_id.removeprefix(GROUP_PREFIX))
    return Target(recipient=chat_id)


def split_message_id(message_id: str | None) -> tuple[str, int] | None:
    """(author, timestamp) of a message id `<author>:<timestamp>`."""
    if not message_id:
        return None
    author, _, stamp = message_id.rpartition(":")
    return (author, int(stamp)) if author and stamp.isdigit() else None


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer the sender with `text` without the model (what it cannot open)."""

    target: Target
    text: str


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this envelope (`reason` for the debug log)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Received:
    """A message to submit, and what the channel tells the sender once it is journaled:
    `receipt` (author, timestamp) for a read receipt and a "seen" reaction, when the
    message addresses the bot; `target` where typing shows."""

    message: InboundMessage
    target: Target
    receipt: tuple[str, int] | None


Translation = Received | Notice | Skip


def _utf16_positions(text: str) -> list[int]:
    positions = [0]
    for char in text:
        positions.append(positions[-1] + (2 if ord(char) > 0xFFFF else 1))
    return positions


def _mentions(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = data.get("mentions")
    return [m for m in found if isinstance(m, Mapping)] if isinstance(found, list) else []


def read_mentions(text: str, mentions: Sequence[Mapping[str, Any]], me: Me) -> tuple[str, bool]:
    """(the text with mentions spelled out, whether the bot is mentioned): the bot's
    mention is cut (with a comma or colon right after it), another person's becomes
    `@<number>` (their uuid when the number is hidden). Offsets are UTF-16 units."""
    positions = _utf16_positions(text)
    mentioned = False
    cuts: list[tuple[int, int, str]] = []
    for mention in mentions:
        try:
            start16, length16 = int(mention["start"]), int(mention["length"])
        except (KeyError, TypeError, ValueError):
            continue
        start = bisect.bisect_left(positions, start16)
        end = bisect.bisect_left(positions, start16 + length16)
        if start >= len(text) + 1 or end > len(text):
            continue
        who = {str(mention.get("uuid") or ""), str(mention.get("number") or "")}
        if who & {me.number, me.uuid} - {""}:
            mentioned = True
            while end < len(text) and text[end] in ",:":
                end += 1
            while end < len(text) and text[end] in " \t":
                end += 1
            cuts.append((start, end, ""))
        else:
            name = mention.get("number") or mention.get("uuid") or mention.get("name") or "someone"
            cuts.append((start, end, f"@{name}"))
    pieces: list[str] = []
    position = 0
    for start, end, replacement in sorted(cuts):
        if start < position:
            continue
        pieces.extend((text[position:start], replacement))
        position = end
    pieces.append(text[position:])
    spelled = "".join(pieces).strip()
    return (spelled or text.replace(MENTION_MARK, "").strip()), mentioned


def attachment_of(found: Mapping[str, Any]) -> Attachment | None:
    """An attachment signal-cli downloaded, as a file reference (`getAttachment` by id)."""
    attachment_id = found.get("id")
    mime = str(found.get("contentType") or "")
    if not attachment_id or mime == LONG_TEXT:
        return None
    if mime.startswith("image/"):
        kind, name = "image", "image"
    elif mime.startswith("audio/"):
        kind, name = "voice", "voice"
    else:
        kind, name = "document", "file"
    size = found.get("size")
    return Attachment(
        kind,
        str(attachment_id),
        str(found.get("filename") or name),
        mime,
        int(size) if isinstance(size, int | float) else None,
    )


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind} yet: I can read text, images, voice messages and "
        "documents. Please write what you'd like me to know."
    )


def _unsupported(data: Mapping[str, Any]) -> str | None:
    if data.get("sticker"):
        return "a sticker"
    if data.get("contacts"):
        return "a contact card"
    if data.get("pollCreate"):
        return "a poll"
    if data.get("viewOnce"):
        return "a view-once message"
    return None


def translate(item: Mapping[str, Any], me: Me) -> Translation:
    """One `receive` result (`{"envelope": ..., "account": ...}`, or a bare envelope)."""
    envelope = item.get("envelope", item)
    if not isinstance(envelope, Mapping):
        return Skip("no envelope")
    if item.get("exception") is not None and not envelope.get("dataMessage"):
        return Skip(f"signal-cli could not read it: {item['exception']}")
    sender = str(envelope.get("sourceUuid") or envelope.get("sourceNumber") or "")
    if not sender:
        return Skip("an envelope without a sender")
    if sender in me or envelope.get("sourceNumber") in me:
        return Skip("the bot's own message (another device of the account)")
    edit = envelope.get("editMessage")
    data = envelope.get("dataMessage")
    edited_of: int | None = None
    if isinstance(edit, Mapping) and isinstance(edit.get("dataMessage"), Mapping):
        data = edit["dataMessage"]
        edited_of = int(edit.get("targetSentTimestamp") or 0) or None
    if not isinstance(data, Mapping):
        kinds = [k for k in ("syncMessage", "receiptMessage", "typingMessage", "callMessage",
                             "storyMessage") if envelope.get(k)]  # fmt: skip
        return Skip(f"a {kinds[0] if kinds else 'content-less'} envelope")
    if data.get("reaction") or data.get("remoteDelete") or data.get("isExpirationUpdate"):
        return Skip("a reaction, a deletion or a timer change")
    group = data.get("groupInfo")
    group = group if isinstance(group, Mapping) else {}
    group_id = str(group.get("groupId") or "")
    if group_id and group.get("type") == "UPDATE" and not data.get("message"):
        return Skip("a group update")
    is_group = bool(group_id)
    target = Target(group_id=group_id) if is_group else Target(recipient=sender)
    timestamp = int(data.get("timestamp") or envelope.get("timestamp") or 0)
    quote = data.get("quote") if isinstance(data.get("quote"), Mapping) else None
    reply_to_bot = quote is not None and (
        str(quote.get("authorUuid") or "") in me or str(quote.get("authorNumber") or "") in me
    )
    raw = str(data.get("message") or "")
    text, mentioned = read_mentions(raw, _mentions(data), me)
    files = tuple(
        a
        for a in (attachment_of(f) for f in data.get("attachments") or () if isinstance(f, Mapping))
        if a is not None
    )
    addressed = not is_group or mentioned or reply_to_bot
    kind = _unsupported(data)
    if not text and not files:
        if kind is None:
            return Skip("an empty message")
        if is_group and not addressed:
            return Skip(f"{kind} in a group, not addressed to the bot")
        return Notice(target, unsupported_notice(kind))
    if kind is not None:
        text += f"\n\n[The user sent {kind}, which the assistant cannot see.]"
    post_id = f"{sender}:{edited_of or timestamp}"
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: reply_to_bot,
        META_SENT_AT: timestamp / 1000,
        META_POST_ID: post_id,
        # A reply quotes the message as the person first sent it (an edit's own
        # timestamp names nothing Signal's apps can find).
        META_REPLY_CONTEXT: {"quote": post_id},
    }
    name = str(envelope.get("sourceName") or "").strip()
    number = str(envelope.get("sourceNumber") or "")
    label = f"{name} ({number})" if name and number else name or number
    if label:
        metadata[META_SENDER_NAME] = label
    if is_group and quote is not None and quote.get("text"):
        author = str(quote.get("authorNumber") or quote.get("authorUuid") or "")
        metadata[META_QUOTED_SENDER] = "the assistant" if reply_to_bot else author
        metadata[META_QUOTED_TEXT] = str(quote["text"])
    message_id = f"{sender}:{timestamp}"
    if edited_of is not None:
        metadata[META_EDIT_OF] = post_id
    inbound = InboundMessage(
        channel=CHANNEL,
        chat_id=f"{GROUP_PREFIX}{group_id}" if is_group else sender,
        text=text,
        sender_id=sender,
        message_id=message_id,
        metadata=metadata,
        attachments=files,
    )
    return Received(inbound, target, (sender, timestamp) if addressed else None)
