"""WeCom callbacks as the gateway's messages: pure functions, no HTTP here.

A POST to the callback URL carries `<xml><ToUserName/><AgentID/><Encrypt/></xml>`; the
`Encrypt` opens (`channels.wecom.crypto`) to one message or event of the app, in XML
("接收消息与事件"):

| what the XML is | becomes |
|---|---|
| `MsgType` text, with a `MsgId` | an `Inbound` to submit |
| image, voice, video, file, location, link | a `Notice`: the bot reads text only |
| `MsgType` event (enter_agent, subscribe, a menu click, ...) | skipped: nothing to answer |
| another app's message (`AgentID` not the channel's) | skipped |

A self-built app's messages come from one member in the one-to-one chat with the app,
so the session key is `wecom:<UserID>` (`FromUserName`). The message id is WeCom's
`MsgId`, which a retried callback keeps ("关于重试的消息排重, 有msgid的消息推荐使用msgid
排重"): the gateway's journal answers it once.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

from gateway.messages import META_SENT_AT, InboundMessage

CHANNEL = "wecom"
#: Metadata: WeCom's MsgType of the message ("text", ...).
META_MSG_TYPE = "wecom_msg_type"
MEDIA_TYPES = frozenset({"image", "voice", "video", "file", "location", "link"})


@dataclass(frozen=True, slots=True)
class Inbound:
    message: InboundMessage


@dataclass(frozen=True, slots=True)
class Notice:
    """A message the bot cannot read: a short text goes back to its sender (not a turn)."""

    user: str
    text: str


@dataclass(frozen=True, slots=True)
class Skip:
    reason: str


Item = Inbound | Notice | Skip


class BadXml(ValueError):
    """A body or a decrypted message that is not WeCom's XML."""


def parse_fields(xml: bytes | str) -> dict[str, str]:
    """The top-level fields of WeCom's flat XML (`<xml><Name>value</Name>...</xml>`)."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise BadXml(f"not XML ({exc})") from None
    if root.tag != "xml":
        raise BadXml(f"the root is <{root.tag}>, not <xml>")
    return {child.tag: (child.text or "").strip() for child in root}


def translate_message(fields: dict[str, str], *, agent_id: int, received_at: float) -> Item:
    """One decrypted callback message as what the channel does with it."""
    kind = fields.get("MsgType", "")
    if agent_id and fields.get("AgentID") and fields["AgentID"] != str(agent_id):
        return Skip(f"a message of app {fields['AgentID']}, not {agent_id}")
    user = fields.get("FromUserName", "")
    if not user:
        return Skip(f"a {kind or 'message'} without a sender")
    if kind == "event":
        return Skip(f"event {fields.get('Event') or '?'}")
    if kind in MEDIA_TYPES:
        return Notice(user, "This bot reads text only for now; please write your message.")
    if kind != "text":
        return Skip(f"MsgType {kind!r}")
    msg_id = fields.get("MsgId", "")
    if not msg_id:
        return Skip("a text without a MsgId")
    metadata: dict[str, object] = {META_MSG_TYPE: kind}
    try:
        metadata[META_SENT_AT] = float(fields.get("CreateTime") or "")
    except ValueError:
        pass
    return Inbound(
        InboundMessage(
            channel=CHANNEL,
            chat_id=user,
            text=fields.get("Content", ""),
            sender_id=user,
            message_id=msg_id,
            received_at=received_at,
            metadata=metadata,
        )
    )
