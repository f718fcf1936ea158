"""The Telegram channel: a python-telegram-bot adapter, long polling or a webhook,
running inside the daemon's event loop.

Inbound: python-telegram-bot's `Bot` makes the requests, but the channel polls itself
(`_poll`) instead of using PTB's Updater, which confirms a fetched batch on its next
`getUpdates` while the updates still wait in memory. Every update goes through one
handler that turns a message into an `InboundMessage` (session key `telegram:<chat>`,
or `telegram:<chat>:topic:<thread>` in a forum topic; message id `<chat>:<message>`;
group metadata for the access policy, which the daemon applies) and submits it.
Outbound: `send` converts the reply's Markdown to Telegram HTML, splits it under the
length limit and sends the pieces in order (see `channels.telegram.format`).

Promises (each one tested in tests/test_telegram*.py and tests/test_kill_delivery.py):
- Journal before confirm: an update is confirmed to Telegram (the `getUpdates` offset
  moves past it, or the webhook answers 200) only once `submit` returned for it, when
  the message is in the gateway's journal (or settled: skipped, a notice, a refusal).
  A crash at any moment leaves every update either in the journal or with Telegram,
  which sends it again. Nothing is dropped at start (no `drop_pending_updates`); at a
  drain (`pause_intake`) polling stops and what Telegram holds stays there.
  Updates are submitted one at a time, in order.
- An update id seen twice in this process is handled once; a message delivered in two
  updates (or again after a restart) has one message id, which the dispatcher dedupes.
- A reply is never sent twice: a request is retried only when it certainly did not
  take effect (flood control, a connection that never opened, an error answer from the
  server) or when repeating it is harmless (edits, chat actions). A send that timed out
  after the request went out is logged as possibly lost instead (see `failure_kind`).
- A reply is not given up while Telegram is unreachable for less than
  `Pacing.retry_window` (a minute): a network outage delays it, never drops it.
- A 429 is waited out (every send to that chat waits) and retried, up to
  `Pacing.flood_wait_limit` seconds of waiting per request.
- HTML that Telegram refuses ("can't parse entities") is sent again as plain text.
- Photos, voice notes, audio and documents become the message's attachments (file
  references; the agent fetches them with `fetch_file` when the turn starts, see
  docs/media.md). Other content (stickers, videos, ...) gets a short notice in private
  chats (at most one per chat per `Pacing.notice_cooldown`); in groups only a sticker
  that replies to the bot gets one. In groups the text of the message replied to
  travels with the message (`META_QUOTED_TEXT`).
- An edited message is submitted like a new one (its own message id per edit) naming
  the message it changes (`META_EDIT_OF`); the agent re-runs the latest turn from it.
- A reply's files go out after its text: images with sendPhoto, others with
  sendDocument, each at most once (never retried after a request that went out).
- The webhook answers 403 without the right `X-Telegram-Bot-Api-Secret-Token`
  (compared in constant time), and 200 only once the update is journaled (503, which
  Telegram retries, when it could not be kept or the gateway is stopping).
"""

from __future__ import annotations

import bisect
import functools
import hmac
import re
import secrets
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar

import anyio
import anyio.abc
import httpx
from aiohttp import web
from loguru import logger
from telegram import (
    Bot,
    BotCommand,
    InputFile,
    Message,
    MessageEntity,
    ReplyParameters,
    Update,
)
from telegram.constants import ChatAction, ChatType, ParseMode
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from telegram.request import HTTPXRequest
from telegram.warnings import PTBDeprecationWarning

from channels.notices import NoticeCooldown
from channels.telegram.format import html_to_text, markdown_to_html, split_markdown
from channels.telegram.settings import TelegramSettings
from channels.typing_indicators import TypingIndicators
from gateway.agent.commands import COMMANDS
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_SENDER,
    META_QUOTED_TEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from gateway.registry import Mount

#: Where the platform posts its events on the gateway's HTTP port.
TELEGRAM_WEBHOOK_PATH = "/telegram/webhook"

CHANNEL = "telegram"
TOPIC = "topic"
#: The update kinds asked for; everything else never leaves Telegram's servers.
ALLOWED_UPDATES = ("message", "edited_message")
WEBHOOK_SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
DEFAULT_BASE_URL = "https://api.telegram.org/bot"  # PTB appends the token
DEFAULT_BASE_FILE_URL = "https://api.telegram.org/file/bot"
_SECRET_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,256}")
_SEEN_UPDATES = 10_000

#: Metadata keys this adapter adds besides the access ones.
META_CHAT_TYPE = "telegram_chat_type"
META_ATTACHMENT = "telegram_attachment"

_ATTACHMENTS = (
    ("photo", "a photo"),
    ("video", "a video"),
    ("animation", "a GIF"),
    ("document", "a file"),
    ("audio", "an audio file"),
    ("voice", "a voice message"),
    ("video_note", "a video message"),
    ("sticker", "a sticker"),
    ("location", "a location"),
    ("venue", "a venue"),
    ("contact", "a contact"),
    ("poll", "a poll"),
    ("dice", "a dice roll"),
)

_T = TypeVar("_T")


class TelegramSetupError(Exception):
    """The bot cannot start (or `gateway doctor` cannot reach it); says what to fix.
    Never carries the token."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to Telegram (seconds)."""

    # Per request, how long failures that are safe to retry are retried: a reply rides
    # out a network outage (under the dispatcher's cap on one delivery, 120 s).
    retry_window: float = 60.0
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    # Total 429 waiting per request; under the dispatcher's cap on one delivery.
    flood_wait_limit: float = 50.0
    typing_interval: float = 4.0  # Telegram shows "typing" for about 5 s
    typing_grace: float = 0.3  # no indicator for replies (or refusals) faster than this
    turn_limit: float = 600.0  # the longest a turn is shown as typing (or streaming)
    stream_interval: float = 1.0  # at most one streaming edit per this
    notice_cooldown: float = 60.0  # per chat, for "not supported" notices
    stop_timeout: float = 10.0


# --------------------------------------------------------------------------- inbound


@dataclass(frozen=True, slots=True)
class Address:
    """Where a message goes: a chat, and a forum topic in it (None: the chat itself)."""

    chat_id: int | str
    thread_id: int | None = None

    @property
    def is_group(self) -> bool:
        return isinstance(self.chat_id, int) and self.chat_id < 0


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer `message_id` at `address` with `text` without asking the agent."""

    address: Address
    message_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this update (logged at debug level with `reason`)."""

    reason: str


Translation = InboundMessage | Notice | Skip


def parse_target(chat_id: str, thread_id: str | None = None) -> Address:
    """An `OutboundMessage`'s chat and thread as Telegram ids. `chat_id` may carry the
    topic itself (`-100123:topic:7`, as heartbeat targets do); `@name` stays a string."""
    chat, sep, rest = chat_id.partition(f":{TOPIC}:")
    if sep and thread_id is None:
        thread_id = rest
    chat_value: int | str = int(chat) if re.fullmatch(r"-?\d+", chat) else chat
    thread = int(thread_id) if thread_id and thread_id.isdigit() else None
    return Address(chat_value, thread)


def telegram_message_id(message_id: str | None) -> int | None:
    """The Telegram message id inside our `<chat>:<message>` id."""
    if not message_id:
        return None
    tail = message_id.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def is_reply_to_bot(message: Message, bot_id: int) -> bool:
    """Does `message` reply to one of the bot's messages? A message in a forum topic
    that replies to nothing else looks like a reply to the topic's first message;
    that is not a reply."""
    reply = message.reply_to_message
    if reply is None or reply.forum_topic_created is not None:
        return False
    if message.is_topic_message and reply.message_id == message.message_thread_id:
        return False
    return reply.from_user is not None and reply.from_user.id == bot_id


def _utf16_positions(text: str) -> list[int]:
    positions = [0]
    for char in text:
        positions.append(positions[-1] + (2 if ord(char) > 0xFFFF else 1))
    return positions


@dataclass(frozen=True, slots=True)
class Addressing:
    """What the entities of a text say about the bot, and the text without @mentions."""

    text: str
    mentioned: bool
    command_for_another_bot: bool


def read_addressing(
    text: str, entities: tuple[MessageEntity, ...], *, bot_id: int, bot_username: str
) -> Addressing:
    """Find mentions of the bot (`@username`, a text mention of its user, a
    `/command@username`) and cut the `@username` parts out of the text; a comma or
    colon right after a mention goes with it. A text of nothing but the mention is
    kept as it is."""
    positions = _utf16_positions(text)
    me = bot_username.lower()
    cuts: list[tuple[int, int]] = []
    mentioned = foreign = False
    for entity in entities:
        start = bisect.bisect_left(positions, entity.offset)
        end = bisect.bisect_left(positions, entity.offset + entity.length)
        piece = text[start:end]
        if entity.type == MessageEntity.MENTION and piece[1:].lower() == me:
            mentioned = True
            while end < len(text) and text[end] in ",:":
                end += 1
            while end < len(text) and text[end] in " \t":
                end += 1
            cuts.append((start, end))
        elif entity.type == MessageEntity.TEXT_MENTION and entity.user is not None:
            mentioned = mentioned or entity.user.id == bot_id
        elif entity.type == MessageEntity.BOT_COMMAND and "@" in piece:
            target = piece.split("@", 1)[1].lower()
            if target == me:
                mentioned = True
                cuts.append((start + piece.index("@"), end))
            elif start == 0:
                foreign = True
    kept = []
    position = 0
    for start, end in sorted(cuts):
        kept.append(text[position:start])
        position = max(position, end)
    kept.append(text[position:])
    stripped = "".join(kept).strip()
    return Addressing(stripped or text.strip(), mentioned, foreign)


def attachment_kind(message: Message) -> str | None:
    """What the message carries besides text ("a photo", "a sticker", ...), if anything."""
    for name, label in _ATTACHMENTS:
        if getattr(message, name, None):
            return label
    return "an attachment" if message.effective_attachment is not None else None


#: Telegram's own limits: the largest photo a bot may send, and a caption.
PHOTO_UPLOAD_LIMIT = 10 * 1024 * 1024
CAPTION_LIMIT = 1024


def readable_attachments(message: Message) -> tuple[Attachment, ...]:
    """The files of `message` the agent can read: a photo (its largest size), a voice
    note or audio file, a document (an image or audio sent as a file counts as one)."""
    if message.photo:
        best = message.photo[-1]
        return (Attachment("image", best.file_id, "photo.jpg", "image/jpeg", best.file_size),)
    if message.voice is not None:
        voice = message.voice
        mime = voice.mime_type or "audio/ogg"
        return (Attachment("voice", voice.file_id, "voice.ogg", mime, voice.file_size),)
    if message.audio is not None:
        audio = message.audio
        name = audio.file_name or "audio.mp3"
        mime = audio.mime_type or "audio/mpeg"
        return (Attachment("voice", audio.file_id, name, mime, audio.file_size),)
    if message.document is not None:
        doc = message.document
        mime = doc.mime_type or ""
        kind = (
            "image"
            if mime.startswith("image/")
            else "voice"
            if mime.startswith("audio/")
            else "document"
        )
        return (Attachment(kind, doc.file_id, doc.file_name or "file", mime, doc.file_size),)
    return ()


def quoted_message(message: Message) -> tuple[str, str] | None:
    """(who wrote it, its text) of the message `message` replies to; None when it replies
    to nothing (a forum topic's first message does not count) or to a textless one."""
    reply = message.reply_to_message
    if reply is None or reply.forum_topic_created is not None:
        return None
    if message.is_topic_message and reply.message_id == message.message_thread_id:
        return None
    text = reply.text if reply.text is not None else reply.caption
    if not text or not text.strip():
        return None
    if reply.sender_chat is not None:
        who = reply.sender_chat.title or ""
    else:
        who = reply.from_user.full_name if reply.from_user is not None else ""
    return who, text


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind} yet: I can only read text. "
        "Please write what you'd like me to know."
    )


def translate_message(
    message: Message, *, bot_id: int, bot_username: str, edited: bool = False
) -> Translation:
    """The inbound message (or notice, or nothing) for one Telegram message."""
    chat = message.chat
    is_group = chat.type != ChatType.PRIVATE
    topic = message.message_thread_id if message.is_topic_message else None
    address = Address(chat.id, topic)
    user = message.from_user
    if message.is_automatic_forward:
        return Skip("a channel post forwarded into its discussion group")
    if user is not None and user.is_bot and message.sender_chat is None:
        return Skip("a message from a bot")
    raw = message.text if message.text is not None else message.caption
    files = readable_attachments(message)
    kind = None if files else attachment_kind(message)
    reply_to_bot = is_reply_to_bot(message, bot_id)
    if files and (raw is None or not raw.strip()):
        if is_group and not reply_to_bot:
            return Skip("a file in a group, not addressed to the bot")
        raw = ""
    if raw is None or (not raw.strip() and not files):
        if kind is None:
            return Skip("a service message")
        if is_group and not reply_to_bot:
            return Skip(f"{kind} in a group, not addressed to the bot")
        return Notice(address, message.message_id, unsupported_notice(kind))
    entities = message.entities if message.text is not None else message.caption_entities
    addressing = read_addressing(raw, entities, bot_id=bot_id, bot_username=bot_username)
    if addressing.command_for_another_bot:
        return Skip("a command for another bot")
    text = addressing.text
    quote = quoted_message(message) if is_group else None
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: addressing.mentioned,
        META_REPLY_TO_BOT: reply_to_bot,
        META_CHAT_TYPE: str(chat.type),
    }
    if kind is not None:
        metadata[META_ATTACHMENT] = kind
        text += f"\n\n[The user attached {kind}, which the assistant cannot see.]"
    if quote is not None:
        metadata[META_QUOTED_SENDER], metadata[META_QUOTED_TEXT] = quote
    if message.sender_chat is not None:
        sender_id = str(message.sender_chat.id)
        metadata[META_SENDER_NAME] = message.sender_chat.title or ""
    elif user is not None:
        sender_id = str(user.id)
        name = user.full_name
        metadata[META_SENDER_NAME] = f"{name} (@{user.username})" if user.username else name
    else:
        sender_id = ""
    post_id = f"{chat.id}:{message.message_id}"
    message_id = post_id
    sent = message.date
    if edited:
        # An edit is a message of its own (its id differs per edit, for dedupe) that
        # names the message it changes; the core decides whether it re-runs a turn.
        metadata[META_EDIT_OF] = post_id
        when = message.edit_date or message.date
        message_id = f"{post_id}:edit:{int(when.timestamp())}"
        sent = when
    metadata[META_SENT_AT] = sent.timestamp()
    return InboundMessage(
        channel=CHANNEL,
        chat_id=str(chat.id),
        text=text,
        sender_id=sender_id,
        message_id=message_id,
        thread_kind=TOPIC if topic is not None else None,
        thread_id=str(topic) if topic is not None else None,
        metadata=metadata,
        attachments=files,
    )


def translate_update(update: Update, *, bot_id: int, bot_username: str) -> Translation:
    if update.message is not None:
        return translate_message(update.message, bot_id=bot_id, bot_username=bot_username)
    if update.edited_message is not None:
        return translate_message(
            update.edited_message, bot_id=bot_id, bot_username=bot_username, edited=True
        )
    return Skip("an update kind this channel does not handle")


# --------------------------------------------------------------------------- failures

FailureKind = Literal["retry", "ambiguous", "final"]
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def failure_kind(exc: TelegramError) -> FailureKind:
    """Whether a failed request may be repeated.

    "retry": it certainly did not take effect (flood control; the connection never
    opened; the server answered with an error, e.g. a 5xx). "ambiguous": the request
    went out and no answer came back (read or write timeout, dropped connection), so
    Telegram may have acted on it. "final": repeating cannot help (bad request,
    blocked by the user, invalid token, the chat moved).
    """
    if isinstance(exc, RetryAfter):
        return "retry"
    if isinstance(exc, BadRequest | Forbidden | InvalidToken | Conflict | ChatMigrated):
        return "final"
    if isinstance(exc, NetworkError):
        cause = exc.__cause__
        if isinstance(cause, _NOT_SENT):
            return "retry"
        if isinstance(cause, httpx.HTTPError):
            return "ambiguous"
        return "retry"  # the server answered, with an error
    return "final"


def retry_after_seconds(exc: RetryAfter) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PTBDeprecationWarning)
        value = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def is_parse_error(exc: TelegramError) -> bool:
    return "can't parse entities" in exc.message.lower()


def _not_modified(exc: TelegramError) -> bool:
    return "message is not modified" in exc.message.lower()


# --------------------------------------------------------------------------- channel


@dataclass
class _Stream:
    """A reply shown while it is written: one message, edited as text arrives."""

    reply_to: str | None
    address: Address
    quote: int | None
    next_edit: float
    text: str = ""
    shown: str = ""
    message_id: int | None = None
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


class TelegramChannel:
    """The Telegram adapter; see the module docstring for what it promises.

    Build it from `settings.channels.telegram` and the resolved token, add it to the
    daemon, and in webhook mode `mount` it on the daemon's HTTP server before running.
    """

    name = CHANNEL

    def __init__(
        self, settings: TelegramSettings, *, token: str, pacing: Pacing | None = None
    ) -> None:
        if not token:
            raise ConfigError(
                "channels.telegram.token: set GATEWAY_CHANNELS__TELEGRAM__TOKEN (the token "
                "@BotFather gave you) or channels.telegram.token_file"
            )
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_SEEN_UPDATES)
        #: Shared mode (`gateway.journal.pg_cursors.run_as_leader`): runs the poll loop once this
        #: replica is the one that polls; None polls at once.
        self.poll_leader: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]] | None = None
        if settings.mode == "webhook" and not settings.webhook_url:
            raise ConfigError(
                "channels.telegram.webhook_url: webhook mode needs the public HTTPS URL of "
                f"this gateway's {TELEGRAM_WEBHOOK_PATH} (GATEWAY_CHANNELS__TELEGRAM__"
                'WEBHOOK_URL), or use mode = "polling"'
            )
        secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
        if secret and not _SECRET_PATTERN.fullmatch(secret):
            raise ConfigError(
                "channels.telegram.webhook_secret: use 1-256 characters from A-Z, a-z, 0-9, "
                "_ and - (Telegram refuses others)"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self._token = token
        # Without a configured secret each process makes its own; it sets the webhook
        # at start, so Telegram always sends the current one.
        self._secret = secret or secrets.token_urlsafe(32)
        self._client: Bot | None = None  # while running: the Bot API client
        self._offset: int | None = None  # the next getUpdates offset (see `_poll`)
        self._confirmed: int | None = None  # the offset Telegram was last sent
        self._paused = False
        self._poll_scope: anyio.CancelScope | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._bot_id = 0
        self._bot_username = ""
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._flood_until: dict[int | str, float] = {}
        self._notices = NoticeCooldown()
        self._typing = TypingIndicators[Address](self._chat_action)
        self._streams: dict[str, _Stream] = {}
        self.live = anyio.Event()  # set once updates flow (for tests and probes)

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> bool:
        """Webhook mode: route `POST /telegram/webhook` to this channel (before the
        server runs). Polling mode mounts nothing. Returns whether it mounted."""
        if self.settings.mode != "webhook":
            return False
        http.mount("POST", TELEGRAM_WEBHOOK_PATH, self._webhook)
        return True

    def _build_bot(self) -> Bot:
        # One connection for getUpdates, a pool for replies (python-telegram-bot's
        # ApplicationBuilder defaults, without its Updater: see `_poll`).
        return Bot(
            self._token,
            base_url=self.settings.base_url or DEFAULT_BASE_URL,
            base_file_url=self.settings.base_file_url or DEFAULT_BASE_FILE_URL,
            request=HTTPXRequest(connection_pool_size=256),
            get_updates_request=HTTPXRequest(connection_pool_size=1),
        )

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Receive updates until cancelled. Raises TelegramSetupError when the token is
        refused or the webhook cannot be set (the daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        bot = self._build_bot()
        failure: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                try:
                    await self._serve(bot, task_status)
                except Exception as exc:
                    failure = exc  # raised below as itself, not inside an exception group
                finally:
                    tg.cancel_scope.cancel()  # typing indicators, streaming edits
        finally:
            self._tg = None
            self.live = anyio.Event()
        if failure is not None:
            raise failure

    def pause_intake(self) -> None:
        """Take no more updates (the daemon is draining): polling stops, leaving what
        Telegram holds unconfirmed for the next start; the webhook answers 503, which
        Telegram retries. Replies still go out until the channel stops."""
        self._paused = True
        if self._poll_scope is not None:
            self._poll_scope.cancel()

    async def _serve(self, bot: Bot, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await bot.initialize()  # getMe
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await bot.shutdown()
            if isinstance(exc, InvalidToken):  # its message holds the token: not shown
                raise self._token_refused() from None
            raise
        try:
            self._bot_id, self._bot_username = bot.id, bot.username
            self._client = bot
            await self._start_receiving(bot)
            await self._advertise_commands(bot)
            logger.info(
                "telegram: @{} is live ({})",
                self._bot_username,
                "webhook" if self.settings.mode == "webhook" else "long polling",
            )
            self.live.set()
            task_status.started()
            if self.settings.mode == "polling":
                if self.poll_leader is None:
                    await self._poll(bot)
                else:
                    # Several replicas: one polls (Telegram allows one getUpdates
                    # consumer per bot), the others stand by to take over.
                    await self.poll_leader(lambda: self._poll(bot))
            await anyio.sleep_forever()
        finally:
            self._client = None  # the webhook answers 503 from now on: Telegram retries later
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.pacing.stop_timeout):
                await self._stop(bot)

    def _token_refused(self) -> TelegramSetupError:
        return TelegramSetupError(
            f"telegram: {api_server(self.settings)} refused the bot token; check "
            "GATEWAY_CHANNELS__TELEGRAM__TOKEN (from @BotFather)"
        )

    async def _start_receiving(self, bot: Bot) -> None:
        if self.settings.mode == "webhook":
            url = self.settings.webhook_url or ""
            try:
                await bot.set_webhook(
                    url=url,
                    secret_token=self._secret,
                    allowed_updates=list(ALLOWED_UPDATES),
                    drop_pending_updates=False,
                )
            except TelegramError as exc:
                raise TelegramSetupError(
                    f"telegram: setWebhook to {url} failed ({exc}); check "
                    "channels.telegram.webhook_url (a public HTTPS URL reaching "
                    f"{TELEGRAM_WEBHOOK_PATH})"
                ) from None
            return
        try:
            # getUpdates is refused while a webhook is set; pending updates are kept.
            await bot.delete_webhook(drop_pending_updates=False)
        except TelegramError as exc:
            logger.warning("telegram: deleteWebhook failed ({}); polling anyway", exc)

    async def _advertise_commands(self, bot: Bot) -> None:
        """Fill the "/" menu in Telegram with the commands the gateway understands."""
        try:
            await bot.set_my_commands(
                [BotCommand(name, text[:256]) for name, text in COMMANDS.items()]
            )
        except TelegramError as exc:
            logger.warning("telegram: could not set the command menu: {}", exc)

    async def _poll(self, bot: Bot) -> None:
        """Long polling that confirms only what the journal holds.

        Telegram keeps an update until a `getUpdates` call asks for an `offset` past its
        id. This loop owns that offset: it moves past an update only once `submit` has
        returned for it (the message is journaled, or settled), so a crash at any moment
        leaves every update either in our journal or still with Telegram. Updates are
        submitted one at a time, in order; one that is not taken (the journal failed)
        stops the batch, and it is fetched again after a pause.
        """
        failures = 0
        while not self._paused:
            with anyio.CancelScope() as scope:
                self._poll_scope = scope
                try:
                    updates = await bot.get_updates(
                        offset=self._offset,
                        limit=100,
                        timeout=self.settings.poll_timeout,
                        allowed_updates=list(ALLOWED_UPDATES),
                    )
                    failures = 0
                except InvalidToken:
                    raise self._token_refused() from None
                except TelegramError as exc:
                    failures += 1
                    self._on_polling_error(exc)
                    updates = ()
                finally:
                    self._poll_scope = None
            if scope.cancelled_caught:
                return  # paused: whatever that call fetched stays unconfirmed
            self._confirmed = self._offset
            for update in updates:
                if self._paused:
                    return
                if not await self._take_update(update):
                    failures += 1
                    break
                self._offset = update.update_id + 1
            if failures:
                delay = self.pacing.retry_backoff * 2 ** min(failures - 1, 10)
                await anyio.sleep(min(delay, self.pacing.retry_backoff_max))

    async def _stop(self, bot: Bot) -> None:
        try:
            offset = self._offset
            if self.settings.mode == "polling" and offset not in (None, self._confirmed):
                # Confirm what the journal holds, so the next start is not sent it
                # again (it would only be dropped as a duplicate).
                await bot.get_updates(offset=offset, limit=1, timeout=0)
                self._confirmed = offset
        except TelegramError as exc:
            logger.debug("telegram: last confirmation skipped: {}", exc)
        finally:
            await bot.shutdown()

    def _on_polling_error(self, exc: TelegramError) -> None:
        if isinstance(exc, Conflict):
            logger.error(
                "telegram: another process is polling with this bot token (or a webhook "
                "is set); stop it, or use one gateway per bot"
            )
        else:
            logger.warning("telegram: fetching updates failed ({}); retrying", exc)

    # ----------------------------------------------------------------- inbound

    def _first_sighting(self, update_id: int) -> bool:
        if update_id in self._seen:
            return False
        self._seen[update_id] = None
        if len(self._seen) > _SEEN_UPDATES:
            self._seen.popitem(last=False)
        return True

    async def _take_update(self, update: Update) -> bool:
        """Translate and submit one update. True when Telegram may forget it: it is in
        the journal, or settled (skipped, a notice, a duplicate, refused with a reply)."""
        if not self._first_sighting(update.update_id):
            logger.debug("telegram: update {} seen before; dropped", update.update_id)
            return True
        result = translate_update(update, bot_id=self._bot_id, bot_username=self._bot_username)
        if isinstance(result, Skip):
            logger.debug("telegram: update {} skipped: {}", update.update_id, result.reason)
        elif isinstance(result, Notice):
            self._spawn(self._send_notice, result)
        elif self._submit is not None:
            ticket = await self._submit(result)
            if not ticket.taken:
                self._seen.pop(update.update_id, None)  # taken when it comes again
                return False
            where = parse_target(result.chat_id, result.thread_id)
            self._spawn(self._typing_while_pending, ticket, where)
        return True

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One update from Telegram: 200 only once it is journaled (or settled), so an
        update Telegram considers delivered is never lost; 503 otherwise, and Telegram
        sends it again."""
        given = request.headers.get(WEBHOOK_SECRET_HEADER, "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._secret.encode()):
            return json_error(403, f"wrong or missing {WEBHOOK_SECRET_HEADER} header")
        bot = self._client
        if bot is None or self._paused:
            return json_error(
                503, "the Telegram channel is not taking updates", {"Retry-After": "5"}
            )
        try:
            data = await request.json()
            update = Update.de_json(data, bot) if isinstance(data, dict) else None
        except (ValueError, TypeError, KeyError):
            update = None
        if update is None:
            return json_error(400, "the body is not a Telegram update")
        if self._client is not bot or self._paused:  # stopped while the body was read
            return json_error(503, "the Telegram channel is stopping", {"Retry-After": "5"})
        if not await self._take_update(update):
            return json_error(
                503, "the gateway could not keep the update; send it again", {"Retry-After": "5"}
            )
        return web.json_response({"ok": True})

    async def _send_notice(self, notice: Notice) -> None:
        chat = notice.address.chat_id
        if not self._notices.allow(chat, self.pacing.notice_cooldown):
            return
        quote = notice.message_id if notice.address.is_group else None
        try:
            await self._send_piece(notice.address, notice.text, quote)
        except TelegramError as exc:
            logger.warning("telegram: a notice to chat {} was not sent: {}", chat, exc)

    # ----------------------------------------------------------------- typing

    async def _typing_while_pending(self, ticket: Ticket, where: Address) -> None:
        """Show "typing" in `where` until the ticket's reply is ready (then it is sent)."""
        await self._typing.while_pending(
            ticket,
            where,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_interval,
            limit=self.pacing.turn_limit,
        )

    async def _chat_action(self, where: Address) -> None:
        bot = self._client
        if bot is None or self._flood_until.get(where.chat_id, 0.0) > time.monotonic():
            return
        try:
            await bot.send_chat_action(
                where.chat_id, ChatAction.TYPING, message_thread_id=where.thread_id
            )
        except RetryAfter as exc:
            self._note_flood(where.chat_id, retry_after_seconds(exc))
        except TelegramError as exc:
            logger.debug("telegram: typing indicator failed: {}", exc)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Markdown as HTML, split under the length limit, in order.
        Raises the Telegram error when a piece cannot be delivered, and sends none of
        the pieces after it (they would read out of context)."""
        where = parse_target(message.chat_id, message.thread_id)
        reply_to = telegram_message_id(message.reply_to)
        quote = reply_to if where.is_group else None
        pieces = split_markdown(message.text)
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not pieces and message.files:
                for file in message.files:
                    await self._send_file(where, file)
                return
            if not pieces:
                logger.warning("telegram: empty reply not sent")
                return
            first = 0
            if stream is not None and stream.message_id is not None:
                if await self._edit_piece(where, stream.message_id, pieces[0]):
                    first = 1
                quote = None
            # A reply sent again after a failure goes on where the failure stopped it.
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            parts = len(pieces)
            try:
                for index, piece in enumerate(pieces):
                    if index < max(first, done):
                        continue
                    await self._send_piece(where, piece, quote if index == first else None)
                    done = index + 1
                for number, file in enumerate(message.files, start=parts):
                    if number < done:
                        continue
                    await self._send_file(where, file)
                    done = number + 1
            except (TelegramError, TelegramSetupError) as exc:
                retry = isinstance(exc, TelegramSetupError) or failure_kind(exc) == "retry"
                if not retry:
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"telegram: {exc!r}", sent=done) from exc

    async def _send_file(self, where: Address, file: OutboundFile) -> Message:
        """One file of a reply: an image as a photo (sendPhoto) when Telegram takes it
        as one, anything else as a document (sendDocument)."""
        bot = self._bot()
        upload = InputFile(file.data, filename=file.name)
        caption = file.caption[:CAPTION_LIMIT] or None
        if file.is_image and len(file.data) <= PHOTO_UPLOAD_LIMIT:
            photo = functools.partial(
                bot.send_photo,
                where.chat_id,
                upload,
                caption=caption,
                message_thread_id=where.thread_id,
            )
            return await self.call_api("sendPhoto", where.chat_id, photo, idempotent=False)
        document = functools.partial(
            bot.send_document,
            where.chat_id,
            upload,
            caption=caption,
            message_thread_id=where.thread_id,
        )
        return await self.call_api("sendDocument", where.chat_id, document, idempotent=False)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: getFile, then a download of at most `max_bytes` (the
        download URL holds the token, so it never reaches a log line or an error)."""
        bot = self._bot()
        limit = max_bytes  # a self-hosted Bot API server allows more than Telegram's 20 MB
        get = functools.partial(bot.get_file, attachment.file_id)
        try:
            file = await self.call_api("getFile", "getFile", get, idempotent=True)
        except BadRequest as exc:
            if "too big" in str(exc).lower():
                raise MediaError("Telegram lets bots download files of up to 20 MB only") from None
            raise MediaError("Telegram no longer has the file") from None
        except TelegramError as exc:
            logger.warning("telegram: getFile failed: {}", type(exc).__name__)
            raise MediaError("Telegram did not hand over the file; please send it again") from None
        if file.file_size is not None and file.file_size > limit:
            raise MediaError(
                f"it is {file.file_size / 2**20:.1f} MB; the limit is {limit / 2**20:.0f} MB"
            )
        if not file.file_path:
            raise MediaError("Telegram gave no download address for the file")
        return await download_capped(file.file_path, limit)

    async def _send_piece(self, where: Address, markdown: str, quote: int | None) -> Message:
        """Send one piece as HTML; as plain text when Telegram refuses the HTML."""
        bot = self._bot()
        reply = ReplyParameters(quote, allow_sending_without_reply=True) if quote else None
        send = functools.partial(
            bot.send_message,
            where.chat_id,
            message_thread_id=where.thread_id,
            reply_parameters=reply,
        )
        markup = markdown_to_html(markdown)
        if html_to_text(markup).strip():
            try:
                as_html = functools.partial(send, text=markup, parse_mode=ParseMode.HTML)
                return await self.call_api("sendMessage", where.chat_id, as_html, idempotent=False)
            except BadRequest as exc:
                if not is_parse_error(exc):
                    raise
                logger.warning("telegram refused the HTML ({}); sending plain text", exc)
        as_plain = functools.partial(send, text=markdown)
        return await self.call_api("sendMessage", where.chat_id, as_plain, idempotent=False)

    async def _edit_piece(self, where: Address, message_id: int, markdown: str) -> bool:
        """Replace a streamed message's text; False when it cannot be edited any more
        (the caller sends a new message instead)."""
        bot = self._bot()
        markup = markdown_to_html(markdown)
        attempts: list[tuple[str, str | None]] = [(markdown, None)]
        if html_to_text(markup).strip():
            attempts.insert(0, (markup, ParseMode.HTML))
        for text, mode in attempts:
            edit = functools.partial(
                bot.edit_message_text,
                text,
                chat_id=where.chat_id,
                message_id=message_id,
                parse_mode=mode,
            )
            try:
                await self.call_api("editMessageText", where.chat_id, edit, idempotent=True)
                return True
            except BadRequest as exc:
                if _not_modified(exc):
                    return True
                if mode is not None and is_parse_error(exc):
                    logger.warning("telegram refused the HTML ({}); sending plain text", exc)
                    continue
                logger.warning("telegram: streamed message {} not edited: {}", message_id, exc)
                return False
        return False

    def _bot(self) -> Bot:
        bot = self._client
        if bot is None:
            raise TelegramSetupError("telegram: the channel is not running; reply not sent")
        return bot

    def _note_flood(self, chat: int | str, seconds: float) -> None:
        until = time.monotonic() + seconds
        self._flood_until[chat] = max(self._flood_until.get(chat, 0.0), until)

    async def call_api(
        self,
        method: str,
        chat: int | str,
        request: Callable[[], Awaitable[_T]],
        *,
        idempotent: bool,
    ) -> _T:
        """Make one Bot API request, repeating it only when that is safe (see
        `failure_kind`); every request to a chat under flood control waits first."""
        attempt = 0
        flood_waited = 0.0
        started = time.monotonic()
        while True:
            pause = self._flood_until.get(chat, 0.0) - time.monotonic()
            if pause > 0:
                await anyio.sleep(pause)
            try:
                return await request()
            except RetryAfter as exc:
                seconds = retry_after_seconds(exc)
                flood_waited += seconds
                if flood_waited > self.pacing.flood_wait_limit:
                    logger.error(
                        "telegram: {} to chat {} still under flood control after {:g}s; giving up",
                        method,
                        chat,
                        flood_waited,
                    )
                    raise
                logger.warning(
                    "telegram: flood control on {} to chat {}: waiting {:g}s", method, chat, seconds
                )
                self._note_flood(chat, seconds)
            except TelegramError as exc:
                kind = failure_kind(exc)
                attempt += 1
                if kind == "ambiguous" and not idempotent:
                    logger.error(
                        "telegram: {} to chat {} timed out after the request went out; not "
                        "repeated (it may have arrived; repeating could send it twice): {!r}",
                        method,
                        chat,
                        exc,
                    )
                    raise
                if kind == "final" or time.monotonic() - started >= self.pacing.retry_window:
                    raise
                delay = min(
                    self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
                )
                logger.warning(
                    "telegram: {} to chat {} failed ({!r}); retry {} in {:g}s",
                    method,
                    chat,
                    exc,
                    attempt,
                    delay,
                )
                await anyio.sleep(delay)

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` becomes a message, edited at most once per interval;
        `send` with the whole reply then edits it a last time (and sends what does not
        fit in it). Does nothing unless `channels.telegram.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            self._forget_stale_streams(now)
            where = parse_target(inbound.chat_id, inbound.thread_id)
            message_id = telegram_message_id(inbound.message_id)
            stream = _Stream(
                reply_to=inbound.message_id,
                address=where,
                quote=message_id if where.is_group else None,
                next_edit=now + self.pacing.stream_interval,
            )
            stream.idle.set()
            self._streams[key] = stream
        stream.text += delta
        if stream.flushing or now < stream.next_edit or self._tg is None:
            return
        stream.flushing = True
        stream.idle = anyio.Event()
        self._tg.start_soon(self._flush_stream, stream)

    def _forget_stale_streams(self, now: float) -> None:
        for key, stream in list(self._streams.items()):
            if now - stream.started > self.pacing.turn_limit:
                del self._streams[key]

    async def _flush_stream(self, stream: _Stream) -> None:
        """One streaming update: a single attempt, best effort (the final `send`
        corrects whatever is shown)."""
        try:
            pieces = split_markdown(stream.text)
            if stream.closed or not pieces or pieces[0] == stream.shown:
                return
            preview = pieces[0]
            bot = self._bot()
            markup = markdown_to_html(preview)
            if not html_to_text(markup).strip():
                return
            if stream.message_id is None:
                reply = (
                    ReplyParameters(stream.quote, allow_sending_without_reply=True)
                    if stream.quote
                    else None
                )
                sent = await bot.send_message(
                    stream.address.chat_id,
                    markup,
                    parse_mode=ParseMode.HTML,
                    message_thread_id=stream.address.thread_id,
                    reply_parameters=reply,
                )
                stream.message_id = sent.message_id
            else:
                await bot.edit_message_text(
                    markup,
                    chat_id=stream.address.chat_id,
                    message_id=stream.message_id,
                    parse_mode=ParseMode.HTML,
                )
            stream.shown = preview
        except RetryAfter as exc:
            self._note_flood(stream.address.chat_id, retry_after_seconds(exc))
            stream.next_edit = time.monotonic() + retry_after_seconds(exc)
        except (TelegramError, TelegramSetupError) as exc:
            logger.debug("telegram: streaming update skipped: {}", exc)
        finally:
            stream.next_edit = max(stream.next_edit, time.monotonic() + self.pacing.stream_interval)
            stream.flushing = False
            stream.idle.set()

    async def _finish_stream(self, message: OutboundMessage) -> _Stream | None:
        """The stream showing this reply, once no edit of it is in flight."""
        stream = self._streams.get(message.session_key)
        if stream is None or stream.reply_to != message.reply_to:
            return None
        del self._streams[message.session_key]
        stream.closed = True
        with anyio.move_on_after(self.pacing.stop_timeout):
            await stream.idle.wait()
        return stream


def api_server(settings: TelegramSettings) -> str:
    """The Bot API server, for messages (never with the token, which PTB appends)."""
    return settings.base_url or DEFAULT_BASE_URL


# --------------------------------------------------------------------------- doctor


async def check_credentials(settings: TelegramSettings, token: str) -> str:
    """`gateway doctor`: ask the Bot API who the token belongs to. Returns
    "@username (id)"; raises TelegramSetupError saying what to fix."""
    if not token:
        raise TelegramSetupError(
            "telegram: no bot token; set GATEWAY_CHANNELS__TELEGRAM__TOKEN (from @BotFather)"
        )
    bot = Bot(
        token,
        base_url=settings.base_url or DEFAULT_BASE_URL,
        base_file_url=settings.base_file_url or DEFAULT_BASE_FILE_URL,
    )
    server = api_server(settings)
    try:
        async with bot:
            user = bot.bot
    except InvalidToken:
        raise TelegramSetupError(
            f"telegram: {server} refused the bot token; copy it again from @BotFather "
            "into GATEWAY_CHANNELS__TELEGRAM__TOKEN"
        ) from None
    except TelegramError as exc:
        raise TelegramSetupError(
            f"telegram: cannot reach the Bot API at {server} ({exc}); check the network "
            "or channels.telegram.base_url"
        ) from None
    return f"@{user.username} ({user.id})"
