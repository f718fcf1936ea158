"""A fake Telegram Bot API server that speaks the real wire format, for tests.

The real python-telegram-bot (or any HTTP client) talks to it unchanged: it is an
aiohttp server on 127.0.0.1 with a random free port, serving ``/bot<TOKEN>/<method>``
(GET or POST; parameters in the query string, a form, a multipart body or JSON, nested
values JSON-encoded inside forms the way PTB sends them) and files under
``/file/bot<TOKEN>/<file_path>``. Answers are ``{"ok": true, "result": ...}`` or
``{"ok": false, "error_code": N, "description": "...", "parameters": {...}}`` with the
real HTTP status and the real wording.

PTB appends the token to its base URLs, so give it the *prefixes*::

    bot = telegram.Bot(fake.token, base_url=fake.api_url, base_file_url=fake.file_url)
    # fake.api_url == f"{fake.url}/bot", fake.file_url == f"{fake.url}/file/bot"
    app = (
        ApplicationBuilder().token(fake.token)
        .base_url(fake.api_url).base_file_url(fake.file_url).build()
    )

Methods: getMe, getUpdates, sendMessage, editMessageText, sendChatAction, getFile,
sendPhoto, sendDocument, setWebhook, deleteWebhook, getWebhookInfo, setMyCommands, getMyCommands and
deleteMyCommands (method names are case-insensitive, as on the real server); any other
method is a 404 "Not Found". Checked like the real server: the token (401), HTML parse
mode (`parse_html`, tdlib's wording: "Bad Request: can't parse entities: ..."), text
length (4096 UTF-16 code units), empty text, reply targets that do not exist, chat
actions, command names, edits that change nothing ("message is not modified"), and
getUpdates while a webhook is set or while another getUpdates is pending (409). Not
checked: MarkdownV2 (passed through verbatim), permissions, real rate limits (script
them with `fail_next`). Like a local Bot API server, webhooks may be plain http.

Files, as the Bot API handles them (https://core.telegram.org/bots/api#getfile,
#sendphoto, #senddocument): `user_message` can carry a photo, a voice note, an audio
file or a document, each registered with `add_file`; getFile describes a file and
``/file/bot<token>/<file_path>`` serves it, but a file over 20 MB gets the real
"Bad Request: file is too big" (bots may not download it). sendPhoto and
sendDocument take a multipart upload (or a file_id); a photo must be an image Pillow
can decode ("Bad Request: IMAGE_PROCESS_FAILED"), at most 10 MB and with width + height
at most 10000; a document at most 50 MB ("Request Entity Too Large", 413). The uploads'
bytes are kept: `sent_files` returns them with their message.

Scripting, in the current event loop::

    async with FakeTelegram(bot_username="gateway_bot") as fake:
        fake.push_update(fake.user_message(42, "hello"))  # private chat with user 42
        fake.push_update(
            fake.user_message(-1001234567890, "@gateway_bot hi", chat_type="supergroup",
                              message_thread_id=7, is_topic_message=True)
        )
        fake.fail_next("sendMessage", 429, retry_after=3)  # flood control, once
        ...
        await fake.wait_for_calls_async("sendMessage", 2)
        assert fake.sent_messages(42)[-1]["text"] == "echo: hello"

getUpdates keeps the Bot API's delivery contract, which the gateway's "never lost,
never stored twice" promise rests on (https://core.telegram.org/bots/api#getupdates,
"Getting updates"):

- "Incoming updates are stored on the server until the bot receives them": an update
  stays pending, and every getUpdates returns it again, until it is confirmed.
- offset: "Identifier of the first update to be returned. [...] An update is considered
  confirmed as soon as getUpdates is called with an offset higher than its update_id."
  Confirmation happens when the *call* arrives, before its answer, and a confirmed
  update is never returned again (not even to a call without offset: "By default,
  updates starting with the earliest unconfirmed update are returned"). A negative
  offset keeps the last ``-offset`` updates: "All previous updates will be forgotten."
- limit: "Limits the number of updates to be retrieved. Values between 1-100 are
  accepted. Defaults to 100." The fake clamps to that range.
- timeout: long polling; the call is held until an update arrives or the time is up.
- allowed_updates: the kinds of update to keep; "this parameter doesn't affect updates
  created before the call to getUpdates, so unwanted updates may be received for a short
  period of time." The filter is applied when an update is created (pushed), not when
  one is handed out.
- update_id: "Update identifiers start from a certain positive number and increase
  sequentially", also across a restart of the bot (and, with `state_path`, of the fake).
- "This method will not work if an outgoing webhook is set up" (409), and a second
  getUpdates terminates the pending one (409 "terminated by other getUpdates request").

Every getUpdates is kept in `polls` (when it arrived, its offset, the ids it confirmed,
the ids it returned, when it was answered) for diagnostics; `wait_for_confirmed` blocks
until a number of updates have been confirmed, and `on_confirm` (a callable) is called
in the serving thread the instant a call confirms updates: the moment a kill test aims
at, when updates become the bot's alone to keep.

``FakeTelegram(state_path=...)`` keeps what a real server keeps across a restart of
the server itself in a JSON file (replaced atomically on every change): pending
updates, the confirmed offset, the next update_id, per-chat message ids, chats and
messages, and the log of sent messages (`sent_messages`). A FakeTelegram started again
on the same path carries on from there.

For webhook mode, after the client's setWebhook, ``await fake.deliver_webhook(update)``
POSTs the update to the registered URL with the ``X-Telegram-Bot-Api-Secret-Token``
header.

``with FakeTelegram.in_thread() as fake:`` serves from a background thread instead; the
scripting methods, the call log and the waits are thread-safe, and the coroutine helpers
(`deliver_webhook`, `wait_for_calls_async`) work from any event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import io
import itertools
import json
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Any, Literal

import aiohttp
from aiohttp import web
from PIL import Image, UnidentifiedImageError

from tests.fakes._serving import LocalApiServer, at_least

DEFAULT_TOKEN = "123456789:AAFakeTelegramBotTokenForTests-0123456"
MAX_MESSAGE_LENGTH = 4096  # UTF-16 code units, after entity parsing
WEBHOOK_SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
MAX_UPDATES_PER_CALL = 100  # getUpdates' `limit`: 1-100, default 100
STATE_VERSION = 1

ChatType = Literal["private", "group", "supergroup", "channel"]
Update = dict[str, Any]
Message = dict[str, Any]

# Update kinds the server leaves out unless `allowed_updates` names them.
_OPT_IN_UPDATES = frozenset({"chat_member", "message_reaction", "message_reaction_count"})
_CHAT_ACTIONS = frozenset(
    [
        "typing",
        "upload_photo",
        "record_video",
        "upload_video",
        "record_voice",
        "upload_voice",
        "upload_document",
        "choose_sticker",
        "find_location",
        "record_video_note",
        "upload_video_note",
    ]
)
# Parameters that stay strings even when their text looks like JSON ("123", "true").
_STRING_PARAMS = frozenset(
    [
        "text",
        "caption",
        "parse_mode",
        "url",
        "secret_token",
        "action",
        "language_code",
        "ip_address",
        "inline_message_id",
        "business_connection_id",
        "file_id",
        "message_effect_id",
        "emoji",
        "title",
        "name",
        "description",
        "short_description",
    ]
)
_COMMAND_PATTERN = re.compile(r"^[a-z0-9_]{1,32}$")
_SECRET_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_TOKEN_PATTERN = re.compile(r"^\d+:[A-Za-z0-9_-]+$")
_FAKE_JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00fake-telegram-photo\xff\xd9"
#: The bytes of the files uploaded with the request being handled, by parameter name.
_UPLOADS: contextvars.ContextVar[dict[str, bytes]] = contextvars.ContextVar("uploads")
BOT_DOWNLOAD_LIMIT = 20 * 1024 * 1024  # getFile: "file is too big" above this
PHOTO_UPLOAD_LIMIT = 10 * 1024 * 1024
DOCUMENT_UPLOAD_LIMIT = 50 * 1024 * 1024

# Default descriptions per status, as the real server words them.
_ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden: bot was blocked by the user",
    404: "Not Found",
    409: "Conflict: terminated by other getUpdates request; make sure that only one bot "
    "instance is running",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_WEBHOOK_CONFLICT = (
    "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to "
    "delete the webhook first"
)
_NOT_MODIFIED = (
    "message is not modified: specified new message content and reply markup are exactly "
    "the same as a current content and reply markup of the message"
)


# -- text: UTF-16 lengths, HTML parse mode, automatic entities ---------------------------


def utf16_len(text: str) -> int:
    """The length of `text` in UTF-16 code units, the unit of Telegram's limits and
    entity offsets."""
    return len(text.encode("utf-16-le")) // 2


class EntityParseError(ValueError):
    """HTML that Telegram refuses; the message is tdlib's wording without the
    "Bad Request: can't parse entities: " prefix."""


_TAG_ENTITY = {
    "b": "bold",
    "strong": "bold",
    "i": "italic",
    "em": "italic",
    "u": "underline",
    "ins": "underline",
    "s": "strikethrough",
    "strike": "strikethrough",
    "del": "strikethrough",
    "span": "spoiler",
    "tg-spoiler": "spoiler",
    "code": "code",
    "pre": "pre",
    "blockquote": "blockquote",
    "a": "text_link",
    "tg-emoji": "custom_emoji",
}
_HTML_TAGS = frozenset(_TAG_ENTITY)
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"'}


@dataclass(slots=True)
class _OpenTag:
    name: str
    attributes: dict[str, str]
    start: int  # UTF-16 offset in the parsed text


def _decode_html_entity(text: str, i: int) -> tuple[str, int] | None:
    """The character `&...;` at `i` stands for and the index after it, or None when it is
    no entity Telegram knows (the `&` is then an ordinary character)."""
    end = text.find(";", i + 1)
    if end == -1 or end - i > 12:
        return None
    body = text[i + 1 : end]
    if body.startswith(("#x", "#X")):
        digits, base = body[2:], 16
    elif body.startswith("#"):
        digits, base = body[1:], 10
    else:
        char = _NAMED_ENTITIES.get(body)
        return (char, end + 1) if char is not None else None
    try:
        code = int(digits, base)
    except ValueError:
        return None
    if not 0 < code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        return None
    return chr(code), end + 1


def parse_html(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Parse Telegram's HTML subset into (plain text, MessageEntity dicts) the way the
    Bot API does, or raise `EntityParseError` with the message the real API gives.

    Supported: b/strong, i/em, u/ins, s/strike/del, span class="tg-spoiler",
    tg-spoiler, a href, code, pre (with an inner code class="language-x"), blockquote
    (optionally expandable), tg-emoji emoji-id, and the entities &lt; &gt; &amp; &quot;
    and &#N; / &#xN;. Offsets in errors are UTF-8 byte offsets into the input.
    """

    def byte_offset(index: int) -> int:
        return len(text[:index].encode("utf-8"))

    out: list[str] = []
    out_len = 0  # UTF-16 units emitted so far
    stack: list[_OpenTag] = []
    entities: list[dict[str, Any]] = []
    n = len(text)
    i = 0
    while i < n:
        char = text[i]
        if char == "&" and (decoded := _decode_html_entity(text, i)) is not None:
            out.append(decoded[0])
            out_len += utf16_len(decoded[0])
            i = decoded[1]
            continue
        if char != "<":
            out.append(char)
            out_len += utf16_len(char)
            i += 1
            continue
        begin = i
        i += 1
        if i < n and text[i] == "/":
            if not stack:
                raise EntityParseError(f"Unexpected end tag at byte offset {byte_offset(begin)}")
            j = i + 1
            while j < n and not text[j].isspace() and text[j] != ">":
                j += 1
            end_name = text[i + 1 : j].lower()
            while j < n and text[j].isspace():
                j += 1
            if j >= n or text[j] != ">":
                raise EntityParseError(f"Unclosed end tag at byte offset {byte_offset(begin)}")
            open_tag = stack.pop()
            if end_name and end_name != open_tag.name:
                raise EntityParseError(
                    f"Unmatched end tag at byte offset {byte_offset(begin)}, expected "
                    f'"</{open_tag.name}>", found "</{end_name}>"'
                )
            i = j + 1
            _close_entity(open_tag, out_len, entities)
            continue

        j = i
        while j < n and not text[j].isspace() and text[j] != ">":
            j += 1
        if j >= n:
            raise EntityParseError(f"Unclosed start tag at byte offset {byte_offset(begin)}")
        name = text[i:j].lower()
        if name not in _HTML_TAGS:
            raise EntityParseError(
                f'Unsupported start tag "{name}" at byte offset {byte_offset(begin)}'
            )
        attributes, i = _parse_attributes(text, j, name, byte_offset(begin), byte_offset)
        if name == "span" and attributes.get("class") != "tg-spoiler":
            raise EntityParseError(
                f'Tag "span" must have class "tg-spoiler" at byte offset {byte_offset(begin)}'
            )
        stack.append(_OpenTag(name, attributes, out_len))
    if stack:
        raise EntityParseError(f'Can\'t find end tag corresponding to start tag "{stack[-1].name}"')
    entities.sort(key=lambda e: (e["offset"], -e["length"]))
    return "".join(out), entities


def _parse_attributes(
    text: str, i: int, tag: str, tag_offset: int, byte_offset: Callable[[int], int]
) -> tuple[dict[str, str], int]:
    """Read the attributes of a start tag from `i` up to its `>`; return them and the
    index after the `>`."""
    n = len(text)
    attributes: dict[str, str] = {}
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            raise EntityParseError(f'Unclosed start tag "{tag}" at byte offset {tag_offset}')
        if text[i] == ">":
            return attributes, i + 1
        name_begin = i
        while i < n and not text[i].isspace() and text[i] not in "=>":
            i += 1
        name = text[name_begin:i].lower()
        if not name:
            raise EntityParseError(
                f'Empty attribute name in the tag "{tag}" at byte offset {tag_offset}'
            )
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] != "=":
            if tag == "blockquote" and name == "expandable":
                attributes[name] = ""
                continue
            raise EntityParseError(
                "Expected equal sign in declaration of an attribute of the tag "
                f'"{tag}" at byte offset {tag_offset}'
            )
        i += 1
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            raise EntityParseError(f'Unclosed start tag "{tag}" at byte offset {tag_offset}')
        if text[i] in "'\"":
            quote = text[i]
            i += 1
            value: list[str] = []
            while i < n and text[i] != quote:
                if text[i] == "&" and (decoded := _decode_html_entity(text, i)) is not None:
                    value.append(decoded[0])
                    i = decoded[1]
                else:
                    value.append(text[i])
                    i += 1
            if i >= n:
                raise EntityParseError(f"Unclosed start tag at byte offset {tag_offset}")
            i += 1
            attributes[name] = "".join(value)
        else:
            token_begin = i
            while i < n and (text[i].isalnum() or text[i] in ".-"):
                i += 1
            if i >= n or not (text[i].isspace() or text[i] == ">"):
                raise EntityParseError(
                    f"Unexpected end of name token at byte offset {byte_offset(token_begin)}"
                )
            attributes[name] = text[token_begin:i].lower()


def _close_entity(tag: _OpenTag, end: int, entities: list[dict[str, Any]]) -> None:
    length = end - tag.start
    if length <= 0:
        return  # Telegram drops empty entities
    entity: dict[str, Any] = {"type": _TAG_ENTITY[tag.name], "offset": tag.start, "length": length}
    if tag.name == "a":
        href = tag.attributes.get("href", "")
        if not href:
            return
        entity["url"] = href
    elif tag.name == "tg-emoji":
        emoji_id = tag.attributes.get("emoji-id", "")
        if not emoji_id.isdigit():
            return
        entity["custom_emoji_id"] = emoji_id
    elif tag.name == "blockquote" and "expandable" in tag.attributes:
        entity["type"] = "expandable_blockquote"
    elif tag.name == "code":
        language = tag.attributes.get("class", "")
        if language.startswith("language-"):
            entity["_language"] = language[len("language-") :]
    elif tag.name == "pre":
        # <pre><code class="language-x">...</code></pre> is one pre entity with a language.
        for inner in entities:
            if (
                inner["type"] == "code"
                and inner["offset"] == tag.start
                and inner["length"] == length
            ):
                entities.remove(inner)
                if "_language" in inner:
                    entity["language"] = inner["_language"]
                break
    entities.append(entity)
    if tag.name == "pre":
        for other in entities:
            other.pop("_language", None)


_AUTO_ENTITY_PATTERNS = (
    ("url", re.compile(r"https?://[^\s<>\"]+")),
    ("bot_command", re.compile(r"(?<![\w/])/[A-Za-z0-9_]{1,32}(?:@[A-Za-z0-9_]{3,32})?")),
    ("mention", re.compile(r"(?<![\w@/])@[A-Za-z0-9_]{3,32}")),
    ("hashtag", re.compile(r"(?<![\w#/])#[^\W\d][\w]*")),
)


def detect_entities(text: str) -> list[dict[str, Any]]:
    """The entities Telegram's server finds by itself in plain text: URLs, /commands,
    @mentions and #hashtags (offsets and lengths in UTF-16 code units)."""
    spans: list[tuple[int, int, str]] = []
    for kind, pattern in _AUTO_ENTITY_PATTERNS:
        for match in pattern.finditer(text):
            start, end = match.span()
            if any(start < s_end and s_start < end for s_start, s_end, _ in spans):
                continue
            spans.append((start, end, kind))
    spans.sort()
    return [
        {"type": kind, "offset": utf16_len(text[:start]), "length": utf16_len(text[start:end])}
        for start, end, kind in spans
    ]


# -- records ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered Bot API call. `method` is the canonical name (``sendMessage``);
    `params` are parsed as the server reads them (numbers, booleans and JSON values
    decoded); `response` is the JSON body sent back with HTTP `status`."""

    method: str
    params: Mapping[str, Any]
    timestamp: float
    status: int
    response: Mapping[str, Any]
    content_type: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.response.get("ok"))

    @property
    def result(self) -> Any:
        return self.response.get("result")

    @property
    def description(self) -> str | None:
        description = self.response.get("description")
        return description if isinstance(description, str) else None


@dataclass(frozen=True, slots=True)
class PollRecord:
    """One getUpdates call: when it arrived, its parameters, the update ids its offset
    confirmed on arrival, and, once answered, when and with which update ids
    (`outcome` "pending", "ok" or the error description)."""

    received_at: float
    offset: int
    limit: int
    timeout: int
    confirmed: tuple[int, ...]
    answered_at: float | None = None
    update_ids: tuple[int, ...] = ()
    outcome: str = "pending"


@dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """The answer of the bot's webhook to one `deliver_webhook` POST (status 0 when the
    connection failed; `body` then holds the error)."""

    url: str
    update_id: int
    status: int
    body: str


@dataclass(frozen=True, slots=True)
class _Fault:
    method: str  # canonical name, or "*" for any
    status: int
    description: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


class _ApiError(Exception):
    def __init__(
        self, status: int, description: str, parameters: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
        self.parameters = dict(parameters or {})


def _bad_request(description: str) -> _ApiError:
    return _ApiError(400, f"Bad Request: {description}")


Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class FakeTelegram(LocalApiServer[ApiCall]):
    """A scriptable Telegram Bot API server; see the module docstring for usage.

    Every pushed update is delivered by getUpdates until a later call's ``offset``
    passes its update_id, and never after that; message ids are per chat and shared by
    the users' and the bot's messages, as in real chats. With `state_path`, pending
    updates, ids and the sent-message log survive a restart of the fake.
    """

    _thread_name = "fake-telegram"

    def __init__(
        self,
        token: str = DEFAULT_TOKEN,
        *,
        bot_username: str = "gateway_bot",
        bot_first_name: str = "Gateway Bot",
        bot_id: int | None = None,
        first_update_id: int = 1,
        can_read_all_group_messages: bool = False,
        state_path: str | Path | None = None,
    ) -> None:
        """`bot_id` defaults to the numeric prefix of `token`, as on the real server.
        `state_path`: a JSON file to keep the server's state in; when it exists, the
        fake starts from it (and `first_update_id` is ignored)."""
        super().__init__()
        self.token = token
        prefix = token.split(":", 1)[0]
        self.bot_id = bot_id if bot_id is not None else int(prefix) if prefix.isdigit() else 1
        self.bot_username = bot_username
        self.bot_first_name = bot_first_name
        self.can_read_all_group_messages = can_read_all_group_messages
        self._updates: list[Update] = []
        self._next_update_id = first_update_id
        self._confirmed_below = 0  # every update_id below this was confirmed
        self._sent: list[Message] = []
        self._polls: list[PollRecord] = []
        self._confirmed_ids: list[int] = []
        self.state_path = Path(state_path) if state_path is not None else None
        #: Called with the confirmed ids, in the serving thread, the moment a getUpdates
        #: call confirms updates (before it is answered): a kill test's trigger.
        self.on_confirm: Callable[[tuple[int, ...]], None] | None = None
        self._allowed_updates: list[str] = []
        self._chats: dict[int, dict[str, Any]] = {}
        self._next_message_id: dict[int, int] = {}
        self._messages: dict[tuple[int, int], Message] = {}
        self._faults: list[_Fault] = []
        self._webhook: dict[str, Any] = {}
        self._webhook_error: tuple[int, str] | None = None
        self._commands: dict[tuple[str, str], list[dict[str, str]]] = {}
        self._files: dict[str, tuple[str, bytes]] = {}
        self._sent_files: list[tuple[Message, bytes]] = []
        self._file_ids = itertools.count(1)
        self._poll_generation = 0
        self._methods: dict[str, tuple[str, Handler]] = {
            name.lower(): (name, handler)
            for name, handler in {
                "getMe": self._get_me,
                "getUpdates": self._get_updates,
                "sendMessage": self._send_message,
                "editMessageText": self._edit_message_text,
                "sendChatAction": self._send_chat_action,
                "getFile": self._get_file,
                "sendPhoto": self._send_photo,
                "sendDocument": self._send_document,
                "setWebhook": self._set_webhook,
                "deleteWebhook": self._delete_webhook,
                "getWebhookInfo": self._get_webhook_info,
                "setMyCommands": self._set_my_commands,
                "getMyCommands": self._get_my_commands,
                "deleteMyCommands": self._delete_my_commands,
            }.items()
        }
        if self.state_path is not None and self.state_path.exists():
            self._load_state(self.state_path)

    # -- running ----------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        """PTB's ``base_url``: the prefix PTB appends the token to (``{url}/bot``)."""
        return f"{self.url}/bot"

    @property
    def file_url(self) -> str:
        """PTB's ``base_file_url`` (``{url}/file/bot``)."""
        return f"{self.url}/file/bot"

    @property
    def bot_user(self) -> dict[str, Any]:
        """The bot as a User object (the ``from`` of its messages)."""
        return {
            "id": self.bot_id,
            "is_bot": True,
            "first_name": self.bot_first_name,
            "username": self.bot_username,
        }

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._api)
        app.router.add_get("/file/bot{token}/{file_path:.+}", self._download)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    # -- scripting: updates -----------------------------------------------------------

    def push_update(self, update: Update) -> Update:
        """Queue an update for getUpdates (an update without ``update_id`` gets a fresh
        one). Returns the queued update. An update_id that was confirmed already is a
        ValueError: the real server never hands such an update out again."""
        with self._lock:
            if "update_id" not in update:
                update = {"update_id": self._new_update_id(), **update}
            update_id = int(update["update_id"])
            if update_id < self._confirmed_below:
                raise ValueError(
                    f"update {update_id} is below the confirmed offset {self._confirmed_below}"
                )
            self._next_update_id = max(self._next_update_id, update_id + 1)
            self._remember_messages(update)
            if self._wanted(update):
                self._queue_update(update)
            self._save_state()
        self._notify()
        return update

    def with_update_id(self, update: Update) -> Update:
        """`update` with a fresh ``update_id``, not queued: for a test that delivers
        webhooks itself (spread over several gateways, as a load balancer would)."""
        with self._lock:
            return {"update_id": self._new_update_id(), **update}

    def redeliver(self, update: Update) -> Update:
        """Hand out the same update (same update_id) again, as the server does with an
        update that was never confirmed. An update that was confirmed is never returned
        again, and a pending one is not queued twice: both are left as they are."""
        with self._lock:
            if int(update["update_id"]) >= self._confirmed_below:
                self._queue_update(update)
                self._save_state()
        self._notify()
        return update

    def _queue_update(self, update: Update) -> None:
        """Add `update` to the pending ones unless its id is pending already (with the
        lock held)."""
        update_id = int(update["update_id"])
        if any(int(u["update_id"]) == update_id for u in self._updates):
            return
        self._updates.append(copy.deepcopy(update))
        self._updates.sort(key=lambda u: int(u["update_id"]))

    @property
    def pending_updates(self) -> list[Update]:
        """Updates queued and not yet confirmed, in update_id order (a snapshot)."""
        with self._lock:
            return copy.deepcopy(self._updates)

    @property
    def confirmed_offset(self) -> int:
        """Every update_id below this has been confirmed (0: none yet)."""
        with self._lock:
            return self._confirmed_below

    @property
    def polls(self) -> list[PollRecord]:
        """Every getUpdates call so far, in the order they arrived (a snapshot; a call
        still held by long polling has outcome "pending")."""
        with self._lock:
            return list(self._polls)

    @property
    def confirmed_ids(self) -> list[int]:
        """The update ids confirmed (or forgotten by a negative offset) so far, in the
        order it happened."""
        with self._lock:
            return list(self._confirmed_ids)

    def wait_for_confirmed(self, count: int, timeout: float = 5.0) -> list[int]:
        """Block until at least `count` updates have been confirmed in total (thread
        mode); returns `confirmed_ids`. Confirmation happens when a getUpdates call with
        a higher offset *arrives*, so this returns right after the client learned of
        the updates and told the server it has them."""
        return self._wait_blocking(
            at_least(count, lambda: self.confirmed_ids),
            timeout,
            async_method="(none: use confirmed_ids)",
            describe_timeout=lambda: (
                f"{len(self.confirmed_ids)} of {count} updates confirmed after {timeout}s"
            ),
        )

    def user_message(
        self,
        chat_id: int,
        text: str = "",
        *,
        user_id: int | None = None,
        username: str | None = "alice",
        first_name: str = "Alice",
        chat_type: ChatType = "private",
        chat_title: str | None = None,
        message_thread_id: int | None = None,
        is_topic_message: bool = False,
        reply_to_message_id: int | None = None,
        reply_to_bot: bool = False,
        entities: Sequence[Mapping[str, Any]] | None = None,
        photo: bytes | bool = False,
        sticker: str | None = None,
        voice: bytes | None = None,
        audio: tuple[str, bytes] | None = None,
        document: tuple[str, str, bytes] | None = None,
        date: int | None = None,
    ) -> Update:
        """Build a realistic ``message`` update from a user, with a fresh update_id
        (push it with `push_update` or POST it with `deliver_webhook`).

        In a private chat the user id is the chat id. Entities default to what the server
        detects by itself (@mentions, /commands, URLs, #hashtags). ``photo`` makes it a
        photo message whose caption is `text` (bytes become the file getFile serves);
        ``sticker`` (its emoji) makes it a sticker message without text. ``voice``
        (OGG bytes) makes it a voice note, ``audio`` ((file name, bytes)) an audio file
        and ``document`` ((file name, MIME type, bytes)) a file, each captioned with
        `text` when given.
        ``is_topic_message`` puts it in forum topic `message_thread_id` (the chat becomes
        a forum) and, as on the real server, makes it reply to the topic's creation
        message unless it replies to something else. ``reply_to_bot`` replies to the
        bot's latest message in that chat (and topic).
        """
        if chat_type == "private":
            if user_id is not None and user_id != chat_id:
                raise ValueError("in a private chat the user id is the chat id")
            user_id = chat_id
        elif chat_id > 0:
            raise ValueError(f"{chat_type} chat ids are negative, e.g. -1001234567890")
        sender: dict[str, Any] = {
            "id": user_id if user_id is not None else 1001,
            "is_bot": False,
            "first_name": first_name,
        }
        if username:
            sender["username"] = username
        sender["language_code"] = "en"
        with self._lock:
            chat = self._chat(chat_id, chat_type, chat_title, sender, forum=is_topic_message)
            reply_to = self._reply_target_for_user(
                chat_id, message_thread_id, reply_to_message_id, reply_to_bot
            )
            threading_fields = self._thread_fields(
                chat, message_thread_id, is_topic_message, reply_to
            )
            message: Message = {
                "message_id": self._new_message_id(chat_id),
                "from": sender,
                "chat": dict(chat),
                "date": date if date is not None else int(time.time()),
                **threading_fields,
            }
            media = self._media_fields(voice, audio, document)
            if sticker is not None:
                message["sticker"] = self._sticker(sticker)
            elif photo is not False or media:
                if photo is not False:
                    message["photo"] = self._photo_sizes(
                        photo if isinstance(photo, bytes) else None
                    )
                message.update(media)
                if text:
                    message["caption"] = text
                    message["caption_entities"] = self._entities(text, entities)
            else:
                message["text"] = text
                if found := self._entities(text, entities):
                    message["entities"] = found
            for key in ("caption_entities", "entities"):
                if key in message and not message[key]:
                    del message[key]
            self._messages[(chat_id, message["message_id"])] = message
            update = {"update_id": self._new_update_id(), "message": copy.deepcopy(message)}
            self._save_state()
            return update

    def edited_message(self, update: Update, text: str) -> Update:
        """Build an ``edited_message`` update: the user edited the message of `update`
        (a ``message`` update) to `text`; same message_id, an ``edit_date``."""
        original = update.get("message") or update.get("edited_message")
        if not isinstance(original, dict):
            raise ValueError("edited_message() needs a message update")
        edited = copy.deepcopy(original)
        key = "caption" if "caption" in edited or "photo" in edited else "text"
        edited[key] = text
        entities = detect_entities(text)
        entities_key = "caption_entities" if key == "caption" else "entities"
        edited.pop(entities_key, None)
        if entities:
            edited[entities_key] = entities
        edited["edit_date"] = max(int(time.time()), int(edited["date"]) + 1)
        with self._lock:
            self._messages[(edited["chat"]["id"], edited["message_id"])] = edited
            update = {"update_id": self._new_update_id(), "edited_message": copy.deepcopy(edited)}
            self._save_state()
            return update

    def add_file(self, data: bytes, *, file_path: str | None = None) -> dict[str, Any]:
        """Register file content that getFile describes and ``/file/bot<token>/...``
        serves; returns the File object (file_id, file_unique_id, file_size, file_path)."""
        with self._lock:
            number = next(self._file_ids)
            path = file_path or f"documents/file_{number}.bin"
            file_id = f"AgACAgFake{number:06d}"
            self._files[file_id] = (path, data)
        return {
            "file_id": file_id,
            "file_unique_id": f"AQADFake{number:06d}",
            "file_size": len(data),
            "file_path": path,
        }

    def _media_fields(
        self,
        voice: bytes | None,
        audio: tuple[str, bytes] | None,
        document: tuple[str, str, bytes] | None,
    ) -> dict[str, Any]:
        """The voice/audio/document field of a user message (the lock is held)."""
        if voice is not None:
            file = self.add_file(voice, file_path=f"voice/file_{len(self._files)}.oga")
            del file["file_path"]
            return {"voice": {**file, "duration": 3, "mime_type": "audio/ogg"}}
        if audio is not None:
            name, data = audio
            file = self.add_file(data, file_path=f"music/file_{len(self._files)}.mp3")
            del file["file_path"]
            return {"audio": {**file, "duration": 3, "file_name": name, "mime_type": "audio/mpeg"}}
        if document is not None:
            name, mime, data = document
            suffix = name.rpartition(".")[2] or "bin"
            file = self.add_file(data, file_path=f"documents/file_{len(self._files)}.{suffix}")
            del file["file_path"]
            return {"document": {**file, "file_name": name, "mime_type": mime}}
        return {}

    def sent_files(self, chat_id: int | None = None) -> list[tuple[Message, bytes]]:
        """(message, uploaded bytes) of each successful sendPhoto and sendDocument."""
        with self._lock:
            return [
                (copy.deepcopy(m), data)
                for m, data in self._sent_files
                if chat_id is None or m["chat"]["id"] == chat_id
            ]

    # -- scripting: faults ------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        status: int = 429,
        *,
        retry_after: int | None = None,
        description: str | None = None,
        migrate_to_chat_id: int | None = None,
        count: int = 1,
    ) -> None:
        """Make the next `count` calls of `method` (``"*"``: any method) fail with
        `status`. A 429 carries ``parameters.retry_after`` (default 1) and the real
        "Too Many Requests: retry after N" description; `migrate_to_chat_id` adds that
        parameter (PTB raises ChatMigrated)."""
        canonical = "*" if method == "*" else self._canonical(method)
        parameters: dict[str, Any] = {}
        if status == 429:
            retry_after = 1 if retry_after is None else retry_after
            description = description or f"Too Many Requests: retry after {retry_after}"
        if retry_after is not None:
            parameters["retry_after"] = retry_after
        if migrate_to_chat_id is not None:
            parameters["migrate_to_chat_id"] = migrate_to_chat_id
            description = description or "Bad Request: group chat was upgraded to a supergroup chat"
        if description is None:
            description = _ERROR_DESCRIPTIONS.get(status, "Internal Server Error")
        fault = _Fault(canonical, status, description, parameters)
        with self._lock:
            self._faults.extend([fault] * count)

    def clear_faults(self) -> None:
        """Forget the faults `fail_next` queued that have not happened yet."""
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        """Forget queued updates, faults, the call and poll logs and the sent-message
        log (chats, messages and ids stay)."""
        with self._lock:
            self._updates.clear()
            self._faults.clear()
            self._calls.clear()
            self._sent.clear()
            self._polls.clear()
            self._confirmed_ids.clear()
            self._save_state()

    # -- the call log -----------------------------------------------------------------

    def sent_messages(self, chat_id: int | None = None) -> list[Message]:
        """The Message results of successful sendMessage and editMessageText calls, in
        order (an edit appears again, with its ``edit_date``); with `state_path`, also
        those sent before a restart of the fake."""
        with self._lock:
            return [
                copy.deepcopy(m)
                for m in self._sent
                if chat_id is None or m["chat"]["id"] == chat_id
            ]

    @property
    def webhook(self) -> dict[str, Any]:
        """The webhook the bot set, including its ``secret_token`` (empty when unset)."""
        with self._lock:
            return copy.deepcopy(self._webhook)

    def commands(
        self, scope_type: str = "default", language_code: str = ""
    ) -> list[dict[str, str]]:
        """The command list setMyCommands stored for a scope type and language."""
        with self._lock:
            return copy.deepcopy(self._commands.get((scope_type, language_code), []))

    # -- webhook delivery -------------------------------------------------------------

    async def deliver_webhook(
        self,
        update: Update,
        url: str | None = None,
        *,
        secret_token: str | EllipsisType | None = ...,
        http_timeout: float = 10.0,
    ) -> WebhookDelivery:
        """POST `update` as JSON to the webhook the bot set (or `url`), with the
        ``X-Telegram-Bot-Api-Secret-Token`` header when a secret is set. `secret_token`
        overrides the header (None: no header). A failed delivery is recorded as
        getWebhookInfo's ``last_error_message``, as the real server does."""
        with self._lock:
            target = url or self._webhook.get("url")
            secret = self._webhook.get("secret_token") if secret_token is ... else secret_token
        if not target:
            raise RuntimeError("no webhook is set: the bot must call setWebhook, or pass url=")
        headers = {"Content-Type": "application/json"}
        if secret:
            headers[WEBHOOK_SECRET_HEADER] = str(secret)
        body = json.dumps(update, ensure_ascii=False).encode()
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=http_timeout)) as session,
                session.post(target, data=body, headers=headers) as response,
            ):
                delivery = WebhookDelivery(
                    target, int(update["update_id"]), response.status, await response.text()
                )
                reason = response.reason or ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            delivery = WebhookDelivery(target, int(update["update_id"]), 0, repr(exc))
            reason = ""
        if not 200 <= delivery.status < 300:
            message = (
                f"Wrong response from the webhook: {delivery.status} {reason}".rstrip()
                if delivery.status
                else "Connection refused"
            )
            with self._lock:
                self._webhook_error = (int(time.time()), message)
        return delivery

    # -- HTTP handling ----------------------------------------------------------------

    def _canonical(self, method: str) -> str:
        known = self._methods.get(method.lower())
        return known[0] if known else method

    async def _not_found(self, request: web.Request) -> web.Response:
        description = (
            "Not Found (FakeTelegram serves /bot<token>/<method>: give PTB "
            f"base_url={self.api_url!r})"
        )
        return _response(404, {"ok": False, "error_code": 404, "description": description})

    async def _download(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _response(404, {"ok": False, "error_code": 404, "description": "Not Found"})
        path = request.match_info["file_path"]
        with self._lock:
            data = next((d for p, d in self._files.values() if p == path), None)
        if data is None:
            return _response(404, {"ok": False, "error_code": 404, "description": "Not Found"})
        return web.Response(body=data, content_type="application/octet-stream")

    async def _api(self, request: web.Request) -> web.Response:
        token = request.match_info["token"]
        name = request.match_info["method"]
        parse_error: str | None = None
        uploads: dict[str, bytes] = {}
        try:
            params = await _read_params(request, uploads)
        except ValueError as exc:
            params, parse_error = {}, str(exc)
        _UPLOADS.set(uploads)  # this request's own (each request runs in its own task)
        canonical = self._canonical(name)
        try:
            if token != self.token:
                if _TOKEN_PATTERN.match(token):
                    raise _ApiError(401, "Unauthorized")
                raise _ApiError(404, "Not Found")
            if parse_error is not None:
                raise _bad_request(parse_error)
            known = self._methods.get(name.lower())
            if known is None:
                raise _ApiError(404, "Not Found")
            self._raise_scripted_fault(canonical)
            result = await known[1](params)
            body: dict[str, Any] = {"ok": True, "result": result}
            if isinstance(result, _WithDescription):
                body = {"ok": True, "result": result.result, "description": result.description}
            status = 200
        except _ApiError as exc:
            status = exc.status
            body = {"ok": False, "error_code": exc.status, "description": exc.description}
            if exc.parameters:
                body["parameters"] = exc.parameters
        call = ApiCall(
            method=canonical,
            params=params,
            timestamp=time.time(),
            status=status,
            response=body,
            content_type=request.content_type if request.body_exists else "",
        )
        if canonical in ("sendMessage", "editMessageText") and call.ok:
            with self._lock:
                self._sent.append(copy.deepcopy(call.result))
                self._save_state()
        self._log_call(call)
        return _response(status, body)

    def _raise_scripted_fault(self, method: str) -> None:
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.method in ("*", method):
                    del self._faults[i]
                    raise _ApiError(fault.status, fault.description, fault.parameters)

    # -- methods ----------------------------------------------------------------------

    async def _get_me(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.bot_user,
            "can_join_groups": True,
            "can_read_all_group_messages": self.can_read_all_group_messages,
            "supports_inline_queries": False,
            "can_connect_to_business": False,
            "has_main_web_app": False,
        }

    async def _get_updates(self, params: dict[str, Any]) -> list[Update]:
        offset = _int_param(params, "offset", 0)
        limit = min(max(_int_param(params, "limit", MAX_UPDATES_PER_CALL), 1), 100)
        timeout = max(_int_param(params, "timeout", 0), 0)
        allowed = params.get("allowed_updates")
        with self._lock:
            if self._webhook.get("url"):
                raise _ApiError(409, _WEBHOOK_CONFLICT)
            if isinstance(allowed, list):
                self._allowed_updates = [str(kind) for kind in allowed]
            confirmed = self._confirm(offset)
            self._poll_generation += 1
            generation = self._poll_generation
            record = PollRecord(time.time(), offset, limit, timeout, confirmed)
            index = len(self._polls)
            self._polls.append(record)
            if confirmed:
                self._save_state()
            on_confirm = self.on_confirm
        if confirmed and on_confirm is not None:
            on_confirm(confirmed)
        self._notify()  # an older pending poll is now terminated; confirmations
        outcome = "cancelled"
        batch: list[Update] = []
        try:
            batch = await self._long_poll(generation, limit, timeout)
            outcome = "ok"
            return batch
        except _ApiError as exc:
            outcome = exc.description
            raise
        finally:
            with self._lock:
                if index < len(self._polls) and self._polls[index] is record:
                    self._polls[index] = dataclasses.replace(
                        record,
                        answered_at=time.time(),
                        update_ids=tuple(int(u["update_id"]) for u in batch),
                        outcome=outcome,
                    )

    def _confirm(self, offset: int) -> tuple[int, ...]:
        """Drop what `offset` confirms (or, negative, forgets) and return those ids; call
        with the lock held."""
        if offset > 0:
            below = offset
        elif offset < 0 and len(self._updates) > -offset:
            below = int(self._updates[offset]["update_id"])
        else:
            return ()
        dropped = tuple(int(u["update_id"]) for u in self._updates if int(u["update_id"]) < below)
        self._updates = [u for u in self._updates if int(u["update_id"]) >= below]
        self._confirmed_below = max(self._confirmed_below, below)
        self._confirmed_ids.extend(dropped)
        return dropped

    async def _long_poll(self, generation: int, limit: int, seconds: int) -> list[Update]:
        """Pending updates as soon as there are any, or [] after `seconds`."""
        assert self._closing is not None and self._loop is not None
        deadline = self._loop.time() + seconds
        while True:
            changed = self._changed
            with self._lock:
                if self._poll_generation != generation:
                    raise _ApiError(409, _ERROR_DESCRIPTIONS[409])
                if self._webhook.get("url"):
                    raise _ApiError(409, _WEBHOOK_CONFLICT)
                batch = self._deliverable(limit)
            remaining = deadline - self._loop.time()
            if batch or remaining <= 0 or self._closing.is_set():
                return batch
            assert changed is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _deliverable(self, limit: int) -> list[Update]:
        """The next pending updates (call with the lock held)."""
        return copy.deepcopy(self._updates[:limit])

    def _wanted(self, update: Update) -> bool:
        """Does the bot's current `allowed_updates` let a new update of this kind be
        stored? The filter applies when an update is created: "this parameter doesn't
        affect updates created before the call to getUpdates, so unwanted updates may be
        received for a short period of time" (getUpdates). Call with the lock held."""
        kind = next((k for k in update if k != "update_id"), "")
        allowed = self._allowed_updates
        return (kind in allowed) if allowed else (kind not in _OPT_IN_UPDATES)

    async def _send_message(self, params: dict[str, Any]) -> Message:
        with self._lock:
            chat = self._resolve_chat(params.get("chat_id"))
            text, entities = _message_text(params)
            thread_id = _optional_int(params, "message_thread_id")
            reply_to = self._reply_target(chat["id"], params)
            threading_fields = self._thread_fields(
                chat, thread_id, bool(chat.get("is_forum")), reply_to
            )
            message: Message = {
                "message_id": self._new_message_id(chat["id"]),
                "from": self.bot_user,
                "chat": dict(chat),
                "date": int(time.time()),
                **threading_fields,
            }
            message["text"] = text
            if entities:
                message["entities"] = entities
            markup = params.get("reply_markup")
            if isinstance(markup, dict) and "inline_keyboard" in markup:
                message["reply_markup"] = markup
            self._messages[(chat["id"], message["message_id"])] = message
            return copy.deepcopy(message)

    async def _edit_message_text(self, params: dict[str, Any]) -> Message:
        with self._lock:
            if params.get("inline_message_id") is not None:
                raise _bad_request("message to edit not found")
            chat = self._resolve_chat(params.get("chat_id"))
            message_id = _optional_int(params, "message_id")
            if message_id is None:
                raise _bad_request("message identifier is not specified")
            stored = self._messages.get((chat["id"], message_id))
            if stored is None:
                raise _bad_request("message to edit not found")
            if stored.get("from", {}).get("id") != self.bot_id:
                raise _bad_request("message can't be edited")
            text, entities = _message_text(params)
            markup = params.get("reply_markup")
            if (
                stored.get("text") == text
                and stored.get("entities", []) == entities
                and (markup is None or stored.get("reply_markup") == markup)
            ):
                raise _bad_request(_NOT_MODIFIED)
            edited = copy.deepcopy(stored)
            edited["text"] = text
            edited.pop("entities", None)
            if entities:
                edited["entities"] = entities
            if isinstance(markup, dict) and "inline_keyboard" in markup:
                edited["reply_markup"] = markup
            edited["edit_date"] = int(time.time())
            self._messages[(chat["id"], message_id)] = edited
            return copy.deepcopy(edited)

    async def _send_chat_action(self, params: dict[str, Any]) -> bool:
        with self._lock:
            self._resolve_chat(params.get("chat_id"))
        if params.get("action") not in _CHAT_ACTIONS:
            raise _bad_request("wrong parameter action in request")
        return True

    async def _get_file(self, params: dict[str, Any]) -> dict[str, Any]:
        file_id = str(params.get("file_id") or "")
        with self._lock:
            stored = self._files.get(file_id)
        if stored is None:
            raise _bad_request("invalid file_id")
        path, data = stored
        if len(data) > BOT_DOWNLOAD_LIMIT:
            raise _bad_request("file is too big")
        number = file_id.removeprefix("AgACAgFake")
        return {
            "file_id": file_id,
            "file_unique_id": f"AQADFake{number}",
            "file_size": len(data),
            "file_path": path,
        }

    def _upload(self, params: dict[str, Any], field_name: str) -> tuple[bytes, str, bool]:
        """(bytes, file name, fresh upload) of a file parameter: a multipart upload or
        the file_id of a file the server has."""
        value = params.get(field_name)
        if isinstance(value, dict) and "size" in value:
            data = _UPLOADS.get().get(field_name, b"")
            return data, str(value.get("filename") or field_name), True
        if isinstance(value, str) and value in self._files:
            path, data = self._files[value]
            return data, path.rpartition("/")[2], False
        raise _bad_request(f"there is no {field_name} in the request")

    def _file_message(self, params: dict[str, Any]) -> Message:
        chat = self._resolve_chat(params.get("chat_id"))
        thread_id = _optional_int(params, "message_thread_id")
        reply_to = self._reply_target(chat["id"], params)
        message: Message = {
            "message_id": self._new_message_id(chat["id"]),
            "from": self.bot_user,
            "chat": dict(chat),
            "date": int(time.time()),
            **self._thread_fields(chat, thread_id, bool(chat.get("is_forum")), reply_to),
        }
        caption = params.get("caption")
        if caption:
            message["caption"] = str(caption)
        return message

    async def _send_photo(self, params: dict[str, Any]) -> Message:
        with self._lock:
            data, _, _ = self._upload(params, "photo")
            if len(data) > PHOTO_UPLOAD_LIMIT:
                raise _ApiError(413, "Request Entity Too Large")
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except (UnidentifiedImageError, OSError, ValueError):
                raise _bad_request("IMAGE_PROCESS_FAILED") from None
            if image.width + image.height > 10_000:
                raise _bad_request("PHOTO_INVALID_DIMENSIONS")
            message = self._file_message(params)
            file = self.add_file(data, file_path=f"photos/file_{len(self._files)}.jpg")
            message["photo"] = [
                {
                    "file_id": file["file_id"],
                    "file_unique_id": file["file_unique_id"],
                    "file_size": len(data),
                    "width": image.width,
                    "height": image.height,
                }
            ]
            self._messages[(message["chat"]["id"], message["message_id"])] = message
            self._sent_files.append((copy.deepcopy(message), data))
            return copy.deepcopy(message)

    async def _send_document(self, params: dict[str, Any]) -> Message:
        with self._lock:
            data, name, _ = self._upload(params, "document")
            if len(data) > DOCUMENT_UPLOAD_LIMIT:
                raise _ApiError(413, "Request Entity Too Large")
            message = self._file_message(params)
            file = self.add_file(data, file_path=f"documents/file_{len(self._files)}")
            content_type = (
                params["document"].get("content_type")
                if isinstance(params.get("document"), dict)
                else None
            )
            message["document"] = {
                "file_id": file["file_id"],
                "file_unique_id": file["file_unique_id"],
                "file_size": len(data),
                "file_name": name,
                "mime_type": content_type or "application/octet-stream",
            }
            self._messages[(message["chat"]["id"], message["message_id"])] = message
            self._sent_files.append((copy.deepcopy(message), data))
            return copy.deepcopy(message)

    async def _set_webhook(self, params: dict[str, Any]) -> _WithDescription:
        url = str(params.get("url") or "")
        if not url:
            return await self._delete_webhook(params)
        if not url.startswith(("http://", "https://")):
            raise _bad_request("bad webhook: Failed to resolve host: Name or service not known")
        secret = params.get("secret_token")
        if secret is not None and not _SECRET_PATTERN.match(str(secret)):
            raise _bad_request("secret token contains unallowed characters")
        allowed = params.get("allowed_updates")
        with self._lock:
            if params.get("drop_pending_updates"):
                self._updates.clear()
                self._save_state()
            self._webhook = {
                "url": url,
                "secret_token": secret,
                "allowed_updates": allowed if isinstance(allowed, list) else None,
                "max_connections": _int_param(params, "max_connections", 40),
                "ip_address": params.get("ip_address"),
                "drop_pending_updates": bool(params.get("drop_pending_updates")),
                "has_custom_certificate": params.get("certificate") is not None,
            }
            self._webhook_error = None
        self._notify()
        return _WithDescription(True, "Webhook was set")

    async def _delete_webhook(self, params: dict[str, Any]) -> _WithDescription:
        with self._lock:
            if params.get("drop_pending_updates"):
                self._updates.clear()
                self._save_state()
            was_set = bool(self._webhook.get("url"))
            self._webhook = {}
            self._webhook_error = None
        return _WithDescription(
            True, "Webhook was deleted" if was_set else "Webhook is already deleted"
        )

    async def _get_webhook_info(self, params: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            info: dict[str, Any] = {
                "url": self._webhook.get("url", ""),
                "has_custom_certificate": bool(self._webhook.get("has_custom_certificate")),
                "pending_update_count": len(self._updates),
            }
            if self._webhook.get("url"):
                info["max_connections"] = self._webhook["max_connections"]
                if self._webhook.get("ip_address"):
                    info["ip_address"] = self._webhook["ip_address"]
                if self._webhook.get("allowed_updates") is not None:
                    info["allowed_updates"] = self._webhook["allowed_updates"]
            if self._webhook_error is not None:
                info["last_error_date"], info["last_error_message"] = self._webhook_error
            return info

    async def _set_my_commands(self, params: dict[str, Any]) -> bool:
        commands = params.get("commands")
        if not isinstance(commands, list):
            raise _bad_request("can't parse commands JSON object")
        stored = []
        for command in commands:
            name = command.get("command") if isinstance(command, dict) else None
            description = command.get("description") if isinstance(command, dict) else None
            if not isinstance(name, str) or not _COMMAND_PATTERN.match(name.lstrip("/")):
                raise _bad_request("BOT_COMMAND_INVALID")
            if not isinstance(description, str) or not 1 <= len(description) <= 256:
                raise _bad_request("command description is empty")
            stored.append({"command": name.lstrip("/"), "description": description})
        with self._lock:
            self._commands[_scope_key(params)] = stored
        return True

    async def _get_my_commands(self, params: dict[str, Any]) -> list[dict[str, str]]:
        with self._lock:
            return copy.deepcopy(self._commands.get(_scope_key(params), []))

    async def _delete_my_commands(self, params: dict[str, Any]) -> bool:
        with self._lock:
            self._commands.pop(_scope_key(params), None)
        return True

    # -- state across restarts (call with the lock held) ------------------------------

    def _save_state(self) -> None:
        """Write what the real server would still know after a restart of itself to
        `state_path`: a temporary file, then an atomic rename (readers never see half a
        file). Nothing when there is no `state_path`."""
        if self.state_path is None:
            return
        state = {
            "version": STATE_VERSION,
            "bot_id": self.bot_id,
            "next_update_id": self._next_update_id,
            "confirmed_below": self._confirmed_below,
            "allowed_updates": self._allowed_updates,
            "updates": self._updates,
            "next_message_id": {str(chat): n for chat, n in self._next_message_id.items()},
            "chats": list(self._chats.values()),
            "messages": [
                [chat, message_id, message]
                for (chat, message_id), message in self._messages.items()
            ],
            "sent": self._sent,
        }
        directory = self.state_path.parent
        directory.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{self.state_path.name}.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(state, file, ensure_ascii=False)
            os.replace(temporary, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _load_state(self, path: Path) -> None:
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{path}: not a FakeTelegram state file (version {STATE_VERSION})")
        if state.get("bot_id") != self.bot_id:
            raise ValueError(f"{path} belongs to bot {state.get('bot_id')}, not {self.bot_id}")
        self._next_update_id = int(state["next_update_id"])
        self._confirmed_below = int(state["confirmed_below"])
        self._allowed_updates = [str(kind) for kind in state["allowed_updates"]]
        self._updates = list(state["updates"])
        self._next_message_id = {int(chat): int(n) for chat, n in state["next_message_id"].items()}
        self._chats = {int(chat["id"]): chat for chat in state["chats"]}
        self._messages = {
            (int(chat), int(message_id)): message for chat, message_id, message in state["messages"]
        }
        self._sent = list(state["sent"])

    # -- chats and messages (call with the lock held) ---------------------------------

    def _chat(
        self,
        chat_id: int,
        chat_type: ChatType,
        title: str | None,
        user: Mapping[str, Any],
        *,
        forum: bool = False,
    ) -> dict[str, Any]:
        chat = self._chats.get(chat_id)
        if chat is None:
            chat = {"id": chat_id, "type": chat_type}
            if chat_type == "private":
                chat["first_name"] = user.get("first_name", "")
                if user.get("username"):
                    chat["username"] = user["username"]
            else:
                chat["title"] = title or f"Test {chat_type} {abs(chat_id)}"
            self._chats[chat_id] = chat
        if forum and chat["type"] == "supergroup":
            chat["is_forum"] = True
        return chat

    def _resolve_chat(self, raw: Any) -> dict[str, Any]:
        if raw is None or raw == "":
            raise _bad_request("chat_id is empty")
        if isinstance(raw, str) and raw.startswith("@"):
            for known in self._chats.values():
                if known.get("username") == raw[1:]:
                    return known
            raise _bad_request("chat not found")
        try:
            chat_id = int(raw)
        except (TypeError, ValueError):
            raise _bad_request("chat not found") from None
        chat = self._chats.get(chat_id)
        if chat is None:
            # A chat the fake has not seen yet: private for positive ids, else a group.
            if chat_id > 0:
                chat = {"id": chat_id, "type": "private", "first_name": f"User {chat_id}"}
            elif str(chat_id).startswith("-100"):
                chat = {"id": chat_id, "type": "supergroup", "title": f"Chat {chat_id}"}
            else:
                chat = {"id": chat_id, "type": "group", "title": f"Chat {chat_id}"}
            self._chats[chat_id] = chat
        return chat

    def _new_update_id(self) -> int:
        update_id = self._next_update_id
        self._next_update_id += 1
        return update_id

    def _new_message_id(self, chat_id: int) -> int:
        message_id = self._next_message_id.get(chat_id, 1)
        self._next_message_id[chat_id] = message_id + 1
        return message_id

    def _remember_messages(self, update: Update) -> None:
        """Learn the chats and messages of an update built by hand."""
        for key in ("message", "edited_message", "channel_post", "edited_channel_post"):
            message = update.get(key)
            if not isinstance(message, dict) or not isinstance(message.get("chat"), dict):
                continue
            chat = message["chat"]
            with contextlib.suppress(KeyError, TypeError, ValueError):
                chat_id, message_id = int(chat["id"]), int(message["message_id"])
                self._chats.setdefault(chat_id, dict(chat))
                self._messages.setdefault((chat_id, message_id), copy.deepcopy(message))
                following = max(self._next_message_id.get(chat_id, 1), message_id + 1)
                self._next_message_id[chat_id] = following

    def _reply_target_for_user(
        self,
        chat_id: int,
        thread_id: int | None,
        reply_to_message_id: int | None,
        reply_to_bot: bool,
    ) -> Message | None:
        if reply_to_message_id is not None:
            target = self._messages.get((chat_id, reply_to_message_id))
            if target is None:
                raise ValueError(f"chat {chat_id} has no message {reply_to_message_id}")
            return target
        if not reply_to_bot:
            return None
        for (chat, _), message in reversed(self._messages.items()):
            if (
                chat == chat_id
                and message.get("from", {}).get("id") == self.bot_id
                and (thread_id is None or message.get("message_thread_id") == thread_id)
            ):
                return message
        raise ValueError(f"the bot has sent nothing to chat {chat_id} to reply to")

    def _reply_target(self, chat_id: int, params: Mapping[str, Any]) -> Message | None:
        reply = params.get("reply_parameters")
        if isinstance(reply, dict):
            target_chat = reply.get("chat_id", chat_id)
            message_id = reply.get("message_id")
            allow_missing = bool(reply.get("allow_sending_without_reply"))
        elif params.get("reply_to_message_id") is not None:
            target_chat = chat_id
            message_id = params.get("reply_to_message_id")
            allow_missing = bool(params.get("allow_sending_without_reply"))
        else:
            return None
        try:
            target = self._messages.get((int(str(target_chat)), int(str(message_id))))
        except ValueError:
            target = None
        if target is None and not allow_missing:
            raise _bad_request("message to be replied not found")
        return target

    def _thread_fields(
        self,
        chat: Mapping[str, Any],
        thread_id: int | None,
        is_topic: bool,
        reply_to: Message | None,
    ) -> dict[str, Any]:
        """The thread fields and ``reply_to_message`` of a new message. In a forum topic a
        message that replies to nothing else replies to the topic's creation message.
        Call before taking the new message's id: the topic may need creating first."""
        fields: dict[str, Any] = {}
        if thread_id is not None:
            fields["message_thread_id"] = thread_id
            if is_topic and chat.get("is_forum"):
                fields["is_topic_message"] = True
                if reply_to is None:
                    reply_to = self._topic_root(chat, thread_id)
        if reply_to is not None:
            shallow = copy.deepcopy(reply_to)
            shallow.pop("reply_to_message", None)  # one level only, like the real API
            fields["reply_to_message"] = shallow
        return fields

    def _topic_root(self, chat: Mapping[str, Any], thread_id: int) -> Message:
        key = (int(chat["id"]), thread_id)
        root = self._messages.get(key)
        if root is None:
            root = {
                "message_id": thread_id,
                "from": {"id": 1001, "is_bot": False, "first_name": "Alice"},
                "chat": dict(chat),
                "date": int(time.time()) - 60,
                "message_thread_id": thread_id,
                "is_topic_message": True,
                "forum_topic_created": {"name": f"Topic {thread_id}", "icon_color": 7322096},
            }
            self._messages[key] = root
            following = max(self._next_message_id.get(key[0], 1), thread_id + 1)
            self._next_message_id[key[0]] = following
        return root

    def _entities(
        self, text: str, entities: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]:
        return [dict(e) for e in entities] if entities is not None else detect_entities(text)

    def _photo_sizes(self, data: bytes | None) -> list[dict[str, Any]]:
        file = self.add_file(data or _FAKE_JPEG, file_path=f"photos/file_{len(self._files)}.jpg")
        return [
            {
                "file_id": file["file_id"],
                "file_unique_id": f"{file['file_unique_id']}s",
                "file_size": file["file_size"],
                "width": 90,
                "height": 67,
            },
            {
                "file_id": file["file_id"],
                "file_unique_id": file["file_unique_id"],
                "file_size": file["file_size"],
                "width": 1280,
                "height": 960,
            },
        ]

    def _sticker(self, emoji: str) -> dict[str, Any]:
        file = self.add_file(b"RIFF-fake-webp", file_path=f"stickers/file_{len(self._files)}.webp")
        return {
            "file_id": file["file_id"],
            "file_unique_id": file["file_unique_id"],
            "type": "regular",
            "width": 512,
            "height": 512,
            "is_animated": False,
            "is_video": False,
            "emoji": emoji,
            "set_name": "FakeStickers",
            "file_size": file["file_size"],
        }


@dataclass(frozen=True, slots=True)
class _WithDescription:
    """A successful result that also carries a ``description`` (setWebhook's)."""

    result: Any
    description: str


def _message_text(params: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The text and entities a sendMessage/editMessageText call results in, or the
    real API's 400 for empty, too long or unparsable text."""
    raw = params.get("text")
    text = raw if isinstance(raw, str) else "" if raw is None else str(raw)
    explicit = params.get("entities")
    if isinstance(explicit, list):
        entities = sorted(
            (dict(e) for e in explicit if isinstance(e, dict)),
            key=lambda e: (e.get("offset", 0), -e.get("length", 0)),
        )
    elif str(params.get("parse_mode") or "").lower() == "html":
        try:
            text, entities = parse_html(text)
        except EntityParseError as exc:
            raise _bad_request(f"can't parse entities: {exc}") from None
    elif params.get("parse_mode"):
        entities = []  # Markdown/MarkdownV2 are not emulated: the text passes through
    else:
        entities = detect_entities(text)
    if not text.strip():
        raise _bad_request("message text is empty")
    if utf16_len(text) > MAX_MESSAGE_LENGTH:
        raise _bad_request("message is too long")
    return text, entities


def _scope_key(params: Mapping[str, Any]) -> tuple[str, str]:
    scope = params.get("scope")
    scope_type = scope.get("type", "default") if isinstance(scope, dict) else "default"
    return str(scope_type), str(params.get("language_code") or "")


def _int_param(params: Mapping[str, Any], name: str, default: int) -> int:
    value = _optional_int(params, name)
    return default if value is None else value


def _optional_int(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _bad_request(f"invalid {name} specified") from None


def _coerce(name: str, value: Any) -> Any:
    """Decode a parameter the way the Bot API reads it: nested objects, numbers and
    booleans arrive JSON-encoded in forms; text parameters stay strings."""
    if isinstance(value, str) and name not in _STRING_PARAMS:
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


async def _read_params(
    request: web.Request, uploads: dict[str, bytes] | None = None
) -> dict[str, Any]:
    """The call's parameters from the query string and a JSON, form or multipart body;
    the bytes of uploaded files go into `uploads` by parameter name."""
    params: dict[str, Any] = dict(request.query)
    uploads = {} if uploads is None else uploads
    if request.can_read_body:
        if request.content_type == "application/json":
            try:
                body = await request.json()
            except ValueError:
                raise ValueError("can't parse JSON object") from None
            if not isinstance(body, dict):
                raise ValueError("can't parse JSON object")
            params.update(body)
        else:
            form = await request.post()
            for key, value in form.items():
                if isinstance(value, web.FileField):
                    data = value.file.read()
                    params[key] = {
                        "filename": value.filename,
                        "content_type": value.content_type,
                        "size": len(data),
                    }
                    uploads[key] = data
                else:
                    params[key] = value
    return {key: _coerce(key, value) for key, value in params.items()}


def _response(status: int, body: Mapping[str, Any]) -> web.Response:
    return web.json_response(dict(body), status=status)
