"""The Discord channel: discord.py's client inside the daemon's event loop (its async
`login` and `connect`, never `run`), the Gateway for messages in, the HTTP API out.

Where a conversation lives (the session key) and where its replies go:
- a DM: `discord:<dm channel id>`; a server's text channel: `discord:<channel id>`;
- a thread (or a forum post): `discord:<parent channel id>:thread:<thread id>`, answered
  in the thread. The parent is part of the key so that `allow_from` listing a channel
  lets its threads in, as a Slack channel's threads and a Telegram group's topics are,
  and an operator reading keys sees where a thread belongs.
In servers the bot answers a message that mentions it (its user, or its managed role)
or replies to one of its messages (`require_mention`, applied by the access gate);
DMs are answered always, once the sender passed the DM policy (pairing by default).

Discord confirms nothing and keeps nothing for an absent bot: the Gateway replays what
a dropped connection missed only to a RESUME of the same session. The delivery promise
of docs/delivery.md is kept anyway, by these rules (tested in tests/test_discord*.py,
and with SIGKILLs by the conformance kit, tests/conformance/test_discord_conformance.py):
- Journal, then move on: every message is submitted (journaled by the dispatcher,
  deduped by its message id, a snowflake) one at a time, in the order it arrived, and
  only then is its conversation's position (`gateway.journal.cursors`) moved past it. A message
  that was not taken (the journal failed) stops its conversation: nothing after it is
  submitted until a backfill from the position brings it again, retried with backoff.
- Backfill on every new session: after READY (a start, or a session Discord would not
  resume) each conversation is read back through the HTTP API from its position
  (`GET /channels/{id}/messages?after=`), oldest first, before any newer live message
  of it is taken: conversations with a position saved in the last
  `backfill_max_age_seconds`, and every server channel or active thread the bot can
  read whose last message is newer than the last moment everything had been read (the
  "*" position, kept while connected and caught up, less a margin). At most
  `backfill_max_messages` per conversation, nothing older than the age bound. After a
  RESUME (Discord replays what was missed itself) only conversations known to have
  newer messages than their position are read back. Backfilled messages go through the
  dispatcher like live ones: a stale one gets the offline notice, not an answer.
- The positions are saved at most once per `Pacing.cursor_interval` and when the
  channel stops; a position saved late only means reading back messages the journal's
  dedupe drops. A conversation's first position (just before its first message) is
  saved before that message is submitted: a DM is only found again through it.
  Nothing is confirmed to Discord (there is nothing to confirm).
- A DM from someone who never wrote to the bot before, sent while the gateway was
  down, cannot be found (Discord gives bots no list of their DM channels): it is
  answered when they write again. Edits are taken live only.
- A reply is never posted twice: each message carries a nonce made from the message it
  answers, its place in the reply and its text, with `enforce_nonce`, so Discord hands
  back the message it already made instead of making a second one (for a few minutes).
  A request that got no answer is therefore repeated; so is an edit. A replay after a
  crash that re-sends a reply within those minutes posts nothing new.
- Rate limits are discord.py's: it reads the X-RateLimit headers, waits before a
  bucket runs out, waits out a 429's `retry_after` (all requests wait on a global
  one), and gives up past `Pacing.rate_limit_wait`. When it gives up after five 429s
  in a row, the request is made again after the last 429's `Retry-After`. A request
  is never cancelled once started (see `_Client`): one cancelled while it waits out a
  global 429 would hold every later one forever.
- A reply that certainly did not reach Discord (`not_sent`: the connection refused
  past the channel's own attempts, a 5xx past discord.py's retries, a 429 longer than
  it waits) raises `gateway.channel.DeliveryFailed`: the dispatcher sends it again
  later and leaves its message unanswered meanwhile. A reply cut short after some of
  its messages went out goes on, when sent again, from the first that did not.
- Nothing the model writes can ping: every message is sent with `allowed_mentions`
  that parse nothing (only the person replied to is notified), and `@everyone`,
  `@here` and `<@...>` are defused in the text (`channels.discord.format`).

Replies quote the message they answer (a Discord reply), in messages of at most 2,000
characters; with `streaming` the first one is posted early and edited as the text
grows. "typing..." shows while a turn runs. Images, voice messages and files people
send become attachments (fetched when the turn starts); a reply's files go out after
its text. The REST base URL and the Gateway URL come from the settings: discord.py
reads them from `discord.http.Route.BASE` and `DiscordWebSocket.DEFAULT_GATEWAY`
(process-wide: one Discord bot per gateway process), and with `gateway_url` set a
RESUME goes there too instead of to READY's `resume_gateway_url`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import anyio
import anyio.abc
import discord
import discord.gateway
import discord.http
import yarl
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from loguru import logger

from channels.discord.format import DISCORD_LIMIT, discord_messages, split_discord
from channels.discord.settings import DiscordSettings
from channels.notices import NoticeCooldown
from channels.typing_indicators import TypingIndicators
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.media.errors import FileTooLarge
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

CHANNEL = "discord"
THREAD = "thread"
DEFAULT_API_URL = "https://discord.com/api/v10"
DEFAULT_GATEWAY_URL = "wss://gateway.discord.gg/"
ENV_TOKEN = "GATEWAY_CHANNELS__DISCORD__TOKEN"
DISCORD_EPOCH = 1420070400.0  # 2015-01-01, the zero of snowflake timestamps
#: The version of the read positions' document (one cursor per bot, see `Positions`).
POSITIONS_VERSION = 1
#: Discord's default upload limit per file.
UPLOAD_LIMIT = 10 * 1024 * 1024
NONCE_CHARS = 25
_SEEN_MESSAGES = 10_000
#: A conversation silent this long (seconds) has its position dropped.
FORGET_AFTER = 90 * 86400.0
_MENTION = re.compile(r"<(@[!&]?|#)(\d+)>")

#: Who a message may notify: nobody it names, only the person replied to.
NO_PINGS = discord.AllowedMentions(everyone=False, users=False, roles=False, replied_user=True)

_T = TypeVar("_T")


class DiscordSetupError(Exception):
    """The bot cannot start (or `gateway doctor` cannot reach it); says what to fix.
    Never carries the token."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to Discord (seconds)."""

    retry_attempts: int = 4  # per request that got no answer (safe: nonces)
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    rate_limit_wait: float = 30.0  # the longest 429 waited out (discord.py's minimum)
    typing_interval: float = 8.0  # Discord shows "typing" for 10 s
    typing_grace: float = 0.3  # no indicator for replies faster than this
    turn_limit: float = 600.0  # the longest a turn is shown as typing (or streaming)
    stream_interval: float = 1.0  # at most one streaming edit per this
    notice_cooldown: float = 60.0  # per conversation, for "not supported" notices
    cursor_interval: float = 1.0  # positions are saved at most this often
    watermark_margin: float = 300.0  # messages still on their way; clocks apart
    retry_max: float = 60.0  # the longest wait before reading a stopped conversation again
    guild_ready_timeout: float = 2.0  # discord.py's wait for the last GUILD_CREATE
    # Nothing heard from the Gateway this long (no event, no heartbeat ACK): the
    # connection is taken for a zombie, closed and resumed (discord.py's default).
    heartbeat_timeout: float = 60.0
    stop_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class Positions:
    """The bot's read positions, saved as one cursor (`gateway.journal.cursors`) named
    `discord:<bot id>`: each conversation's last settled message id with when it moved,
    and the watermark (a snowflake: the last moment, less a margin, at which everything
    the bot can read had been read; None before the first)."""

    watermark: int | None
    conversations: dict[int, tuple[int, float]]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": POSITIONS_VERSION,
                "watermark": str(self.watermark) if self.watermark is not None else None,
                "conversations": {
                    str(c): [str(p), round(t, 3)] for c, (p, t) in self.conversations.items()
                },
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str) -> Positions:
        """Raises ValueError for a document this version cannot read."""
        try:
            data = json.loads(raw)
            if data.get("version") != POSITIONS_VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            mark = data["watermark"]
            conversations = {
                int(c): (int(p), float(t)) for c, (p, t) in data["conversations"].items()
            }
            return cls(int(mark) if mark is not None else None, conversations)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------- inbound


def snowflake_time(snowflake: int) -> float:
    """Unix seconds a Discord id was made."""
    return (snowflake >> 22) / 1000 + DISCORD_EPOCH


def snowflake_at(unix_seconds: float) -> int:
    """The smallest id of an instant: `after=` it means "written since then"."""
    return max(0, int((unix_seconds - DISCORD_EPOCH) * 1000)) << 22


PlaceKind = Literal["dm", "guild", "thread"]


@dataclass(frozen=True, slots=True)
class Place:
    """Where a message was written: the channel its messages live in (a thread's own
    id), what kind of place that is, and a thread's parent channel."""

    channel_id: int
    kind: PlaceKind
    parent_id: int | None = None
    guild_id: int | None = None

    @property
    def chat_id(self) -> str:
        parent = self.parent_id if self.kind == "thread" else None
        return str(parent or self.channel_id)

    @property
    def thread_id(self) -> str | None:
        return str(self.channel_id) if self.kind == "thread" else None

    @property
    def is_group(self) -> bool:
        return self.kind != "dm"


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer message `message_id` in `place` with `text` without asking the agent."""

    place: Place
    message_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this message (logged at debug level with `reason`)."""

    reason: str


Translation = InboundMessage | Notice | Skip


def target_channel(chat_id: str, thread_id: str | None = None) -> int:
    """The channel a reply is posted to: the thread when there is one, else the chat.
    `chat_id` may carry the thread itself (`123:thread:456`, as heartbeat targets do)."""
    chat, sep, rest = chat_id.partition(f":{THREAD}:")
    if sep and thread_id is None:
        thread_id = rest
    where = thread_id if thread_id and thread_id.isdigit() else chat
    if not where.isdigit():
        raise ValueError(f"discord: {chat_id!r} is not a channel id")
    return int(where)


def discord_message_id(message_id: str | None) -> int | None:
    """The snowflake of our message id (`<id>`, or `<id>:edit:<time>` for an edit)."""
    if not message_id:
        return None
    head = message_id.split(":", 1)[0]
    return int(head) if head.isdigit() else None


def display_name(user: discord.abc.User) -> str:
    """How a person appears: their server nickname or global name, with @username."""
    shown = user.display_name
    return f"{shown} (@{user.name})" if shown and shown != user.name else f"@{user.name}"


def mentions_bot(message: discord.Message, bot_id: int, bot_roles: frozenset[int]) -> bool:
    """Does `message` mention the bot: its user, or its managed role (what a client
    inserts when someone picks the bot's role from the mention list)?"""
    if bot_id in message.raw_mentions:
        return True
    return bool(bot_roles.intersection(message.raw_role_mentions))


def replied_message(message: discord.Message) -> discord.Message | None:
    """The message `message` replies to, when Discord sent it along (a reply's
    `referenced_message`); None for no reply, or a deleted or unresolved one."""
    reference = message.reference
    if reference is None or message.type is not discord.MessageType.reply:
        return None
    resolved = reference.resolved
    return resolved if isinstance(resolved, discord.Message) else None


def readable_text(message: discord.Message, bot_id: int, bot_roles: frozenset[int]) -> str:
    """The message's text as a person reads it: the bot's own mentions cut out (with a
    comma or colon after them), other mentions as @name or #name when known."""
    names: dict[tuple[str, int], str] = {}
    for user in message.mentions:
        names[("@", user.id)] = f"@{user.display_name}"
    for role in message.role_mentions:
        names[("@&", role.id)] = f"@{role.name}"
    for channel in message.channel_mentions:
        names[("#", channel.id)] = f"#{channel.name}"

    def replace(match: re.Match[str]) -> str:
        kind, ident = match.group(1).replace("!", ""), int(match.group(2))
        if (kind == "@" and ident == bot_id) or (kind == "@&" and ident in bot_roles):
            return "\0"
        return names.get((kind, ident), match.group(0))

    text = _MENTION.sub(replace, message.content)
    if "\0" in text:
        stripped = re.sub(r"\0[,:]?[ \t]*", "", text).strip()
        return stripped or text.replace("\0", "").strip()
    return text.strip()


def readable_attachments(message: discord.Message, place: Place) -> tuple[Attachment, ...]:
    """The files of `message` the agent can read: images, audio (a voice message counts)
    and documents. `file_id` is `<channel>:<message>:<attachment>`, so a download link
    that expired can be asked for again."""
    voice = message.flags.voice
    found = []
    for item in message.attachments:
        mime = (item.content_type or "").split(";")[0].strip()
        if voice or mime.startswith("audio/"):
            kind = "voice"
        elif mime.startswith("image/"):
            kind = "image"
        else:
            kind = "document"
        name = item.filename or ("voice-message.ogg" if voice else "file")
        file_id = f"{place.channel_id}:{message.id}:{item.id}"
        found.append(Attachment(kind, file_id, name, mime or "", item.size, item.url))
    return tuple(found)


def unsupported_kind(message: discord.Message) -> str | None:
    """What the message carries that the agent cannot read, if anything."""
    if message.stickers:
        return "a sticker"
    if message.poll is not None:
        return "a poll"
    if message.embeds and not message.content.strip():
        return "an embed"
    return None


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind} yet: I can only read text, images, voice messages "
        "and files. Please write what you'd like me to know."
    )


def translate_message(
    message: discord.Message,
    place: Place,
    *,
    bot_id: int,
    bot_roles: frozenset[int] = frozenset(),
    edited: bool = False,
) -> Translation:
    """The inbound message (or notice, or nothing) for one Discord message. Pure: the
    policy of which messages are taken, their keys and their metadata lives here."""
    author = message.author
    if author.id == bot_id:
        return Skip("the bot's own message")
    if message.webhook_id is not None or author.bot:
        return Skip("a message from a bot or a webhook")
    if message.type not in (discord.MessageType.default, discord.MessageType.reply):
        return Skip(f"a system message ({message.type.name})")
    is_group = place.is_group
    replied = replied_message(message)
    reply_to_bot = replied is not None and replied.author.id == bot_id
    mentioned = mentions_bot(message, bot_id, bot_roles)
    addressed = not is_group or mentioned or reply_to_bot
    text = readable_text(message, bot_id, bot_roles)
    files = readable_attachments(message, place)
    kind = None if files else unsupported_kind(message)
    if not text and not files:
        if kind is None:
            return Skip("no text and nothing attached")
        if not addressed:
            return Skip(f"{kind} in a server, not addressed to the bot")
        return Notice(place, message.id, unsupported_notice(kind))
    if not addressed and is_group and not text:
        return Skip("a file in a server, not addressed to the bot")
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: reply_to_bot,
        META_SENDER_NAME: display_name(author),
        META_SENT_AT: message.created_at.timestamp(),
        "discord_channel_kind": place.kind,
    }
    if place.guild_id is not None:
        metadata["discord_guild"] = str(place.guild_id)
    if replied is not None and is_group:
        quoted = readable_text(replied, bot_id, bot_roles)
        if quoted:
            metadata[META_QUOTED_SENDER] = replied.author.display_name
            metadata[META_QUOTED_TEXT] = quoted
    message_id = str(message.id)
    if edited:
        # An edit is a message of its own (its id differs per edit, for dedupe) that
        # names the message it changes; the core decides whether it re-runs a turn.
        when = message.edited_at or message.created_at
        metadata[META_EDIT_OF] = message_id
        metadata[META_SENT_AT] = when.timestamp()
        message_id = f"{message.id}:edit:{int(when.timestamp() * 1000)}"
    return InboundMessage(
        channel=CHANNEL,
        chat_id=place.chat_id,
        text=text,
        sender_id=str(author.id),
        message_id=message_id,
        thread_kind=THREAD if place.kind == "thread" else None,
        thread_id=place.thread_id,
        metadata=metadata,
        attachments=files,
    )


def reply_nonce(reply_to: str | None, part: str, text: str) -> str | None:
    """The nonce of one message of a reply: the same for the same text in the same
    place of the reply to the same message (so a repeat is recognized by Discord),
    different otherwise; None (discord.py makes a random one) for a reply to nothing."""
    if not reply_to:
        return None
    digest = hashlib.blake2b(f"{reply_to}\0{part}\0{text}".encode(), digest_size=12)
    return digest.hexdigest()[: NONCE_CHARS - 1]


# --------------------------------------------------------------------------- setup


def use_endpoints(settings: DiscordSettings) -> None:
    """Point discord.py at the configured HTTP API and Gateway (process-wide: it reads
    both from class attributes, not from `/gateway/bot`)."""
    discord.http.Route.BASE = (settings.api_url or DEFAULT_API_URL).rstrip("/")
    gateway = yarl.URL(settings.gateway_url or DEFAULT_GATEWAY_URL)
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = gateway


def intents_for(settings: DiscordSettings) -> discord.Intents:
    """What the bot asks the Gateway for: servers (channels, threads), messages in
    servers and DMs, and their content (privileged) unless `message_content` is off."""
    intents = discord.Intents.none()
    intents.guilds = True
    intents.guild_messages = True
    intents.dm_messages = True
    intents.message_content = settings.message_content
    return intents


async def log_in(client: discord.Client, token: str) -> discord.ClientUser:
    """Log `client` in through the HTTP API (what the channel and `gateway doctor` both
    do first); the bot's user. Raises DiscordSetupError saying what to fix, never
    carrying the token."""
    where = discord.http.Route.BASE
    try:
        await client.login(token)
    except discord.LoginFailure:
        raise DiscordSetupError(
            f"discord: {where} refused the bot token; copy it again from the Developer "
            f"Portal (Bot > Reset Token) into {ENV_TOKEN}"
        ) from None
    except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise DiscordSetupError(
            f"discord: cannot reach the HTTP API at {where} ({type(exc).__name__}: {exc});"
            " check the network or channels.discord.api_url"
        ) from None
    user = client.user
    assert user is not None
    return user


class _ToLoguru(logging.Handler):
    """discord.py logs through the standard library: its warnings and errors (rate
    limits waited out, a connection it could not resume) go to the gateway's own log,
    with its format and redaction, instead of bare lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(exception=record.exc_info).log(level, "discord.py: {}", record.getMessage())


_library_log = logging.getLogger("discord")
_library_log.addHandler(_ToLoguru())
_library_log.setLevel(logging.WARNING)
_library_log.propagate = False
# discord.py warns at every client that voice is unavailable: the bot has no voice.
logging.getLogger("discord.client").setLevel(logging.ERROR)


class _Client(discord.Client):
    """discord.py's client; every event it dispatches is also handed to `on_event`, in
    the order the Gateway delivered them (before any handler task runs).

    Every HTTP API request, once started, runs to its end even when its caller is
    cancelled (a typing indicator stopped, a delivery timed out): the caller stops
    waiting, the request goes on. discord.py closes its global rate-limit lock when a
    request gets a global 429 and opens it again only in that same request, after
    sleeping out `retry_after`; a request cancelled in that sleep leaves the lock shut
    for the client's life, and every later request (every reply) waits on it forever
    (discord.py 2.7.1; its fork disnake fixed the same code in DisnakeDev/disnake#1585).
    """

    def __init__(self, on_event: Callable[[str, tuple[Any, ...]], None], **options: Any) -> None:
        super().__init__(**options)
        self._on_event = on_event
        self._requests: set[asyncio.Task[Any]] = set()
        request = self.http.request

        @functools.wraps(request)
        async def run_to_the_end(route: discord.http.Route, **kwargs: Any) -> Any:
            task = asyncio.ensure_future(request(route, **kwargs))
            self._requests.add(task)
            task.add_done_callback(_settle_request)
            task.add_done_callback(self._requests.discard)
            return await asyncio.shield(task)

        self.http.request = run_to_the_end  # type: ignore[method-assign]

    def dispatch(self, event: str, /, *args: Any, **kwargs: Any) -> None:
        super().dispatch(event, *args, **kwargs)
        self._on_event(event, args)

    async def close(self) -> None:
        """Close the connections; requests still running (nobody waits for them any
        more, and this client is not used again) are cancelled."""
        await super().close()
        for task in list(self._requests):
            task.cancel()


def _retry_after(exc: discord.HTTPException) -> float:
    """Seconds a 429 said to wait (``Retry-After``; a second if it said nothing)."""
    try:
        return max(0.05, float(exc.response.headers.get("Retry-After", "1")))
    except (AttributeError, ValueError):
        return 1.0


def not_sent(exc: BaseException) -> bool:
    """Whether a failed request certainly did not post anything and may succeed later:
    the connection was never made (refused, unreachable), Discord answered 5xx (after
    discord.py's own retries), a 429 asked to wait longer than the channel waits
    (`RateLimited`), or the channel is not running now. A timeout or a connection
    dropped mid-request may have posted it; a 4xx never will."""
    return isinstance(
        exc,
        aiohttp.ClientConnectorError
        | discord.DiscordServerError
        | discord.RateLimited
        | DiscordSetupError,
    )


def _settle_request(task: asyncio.Task[Any]) -> None:
    """Read the outcome of a request whose caller stopped waiting (else asyncio logs
    "exception was never retrieved")."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("discord: a request nobody waited for ended: {!r}", task.exception())


# --------------------------------------------------------------------------- channel


@dataclass(frozen=True, slots=True)
class _Live:
    message: discord.Message
    edited: bool = False


@dataclass(frozen=True, slots=True)
class _Sync:
    """A session began (READY: `full`) or resumed: read back what was missed."""

    full: bool
    guilds: anyio.Event | None = None


@dataclass(frozen=True, slots=True)
class _Retry:
    conversations: frozenset[int]


_Item = _Live | _Sync | _Retry


@dataclass
class _Stream:
    """A reply shown while it is written: one message, edited as text arrives."""

    reply_to: str | None
    target: int
    next_edit: float
    text: str = ""
    shown: str = ""
    message_id: int | None = None
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


class DiscordChannel:
    """The Discord adapter; see the module docstring for what it promises.

    Build it from `settings.channels.discord`, the resolved token and the store of read
    positions (`gateway.journal.cursors`), and add it to the daemon.
    """

    name = CHANNEL

    def __init__(
        self,
        settings: DiscordSettings,
        *,
        token: str,
        lead: Lead,
        replicas: bool = False,
        pacing: Pacing | None = None,
    ) -> None:
        if not token:
            raise ConfigError(
                f"channels.discord.token: set {ENV_TOKEN} (Developer Portal > your app > "
                "Bot > Reset Token) or channels.discord.token_file"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        #: Runs the Gateway connection with the store of read positions: at once (one
        #: process, `gateway.journal.cursors.run_with`), or once this replica holds the "discord
        #: gateway" role (`gateway.journal.pg_cursors.lead_as`), its positions written on the
        #: connection that holds it.
        self.lead = lead
        #: Several replicas share the bot: every one logs in for the HTTP API (replies,
        #: typing, files) and is ready then; one holds the Gateway connection.
        self.replicas = replicas
        self._store: CursorStore | None = None
        self._token = token
        self._client: _Client | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._inbox: MemoryObjectSendStream[_Item] | None = None
        self._paused = False
        self._connected = False
        self._syncing = False
        self._guilds_ready: anyio.Event | None = None
        self._bot_id = 0
        self._places: dict[int, Place] = {}
        self._positions: dict[int, int] = {}  # conversation -> last settled message id
        self._updated: dict[int, float] = {}  # conversation -> when its position moved
        self._dirty = False
        self._watermark: int | None = None
        self._blocked: dict[int, float] = {}  # conversation -> when to read it again
        self._backoff: dict[int, float] = {}
        self._newest: dict[int, int] = {}  # conversation -> newest id seen live
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._notices = NoticeCooldown()
        self._typing = TypingIndicators[int](self._send_typing)
        self._streams: dict[str, _Stream] = {}
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_SEEN_MESSAGES)
        self.backfilled = 0  # messages read back through the HTTP API (tests, logs)
        self.live = anyio.Event()  # set once a session is up and read back (tests, probes)

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Log in (the HTTP API), then hold the Gateway connection until cancelled (in
        the shared mode once this replica is its holder). Raises DiscordSetupError when
        the token or the intents are refused (the daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        use_endpoints(self.settings)
        client = _Client(
            self._on_event,
            intents=intents_for(self.settings),
            max_messages=None,
            chunk_guilds_at_startup=False,
            member_cache_flags=discord.MemberCacheFlags.none(),
            allowed_mentions=NO_PINGS,
            max_ratelimit_timeout=max(30.0, self.pacing.rate_limit_wait),
            guild_ready_timeout=self.pacing.guild_ready_timeout,
            heartbeat_timeout=self.pacing.heartbeat_timeout,
        )
        failure: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                try:
                    await self._login(client)
                    self._client = client
                    if self.replicas:
                        # One replica holds the Gateway connection (Discord would send
                        # every event to each), the others stand by; every one sends
                        # replies.
                        task_status.started()
                        await self.lead(lambda store: self._hold_gateway(client, store))
                    else:
                        # Live (ready) once the session is up and what was written
                        # while away has been read back.
                        await self.lead(
                            lambda store: self._hold_gateway(client, store, task_status.started)
                        )
                except Exception as exc:
                    failure = exc  # raised below as itself, not inside an exception group
                finally:
                    tg.cancel_scope.cancel()  # typing indicators, streaming edits
        finally:
            self._client = None
            self._tg = None
            self.live = anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.pacing.stop_timeout):
                await client.close()
        while isinstance(failure, ExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        if failure is not None:
            raise failure

    async def _login(self, client: _Client) -> None:
        user = await log_in(client, self._token)
        self._bot_id = user.id
        logger.info("discord: logged in as @{} ({})", user.name, user.id)

    def pause_intake(self) -> None:
        """Take no more messages (the daemon is draining): what arrives is left unread,
        its conversation's position stays before it, and the next start reads it back.
        Replies still go out until the channel stops."""
        self._paused = True

    async def _hold_gateway(
        self, client: _Client, store: CursorStore, on_live: Callable[[], None] | None = None
    ) -> None:
        """The Gateway connection and the intake behind it: positions loaded from
        `store`, messages taken in order, positions saved; until the connection ends or
        is cancelled. `on_live` is called once the first session is up and read back."""
        self._store = store
        await self._load_positions()
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._inbox = send
        failure: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._intake, receive)
                tg.start_soon(self._keep_positions)
                if on_live is not None:
                    tg.start_soon(self._report_live, on_live)
                try:
                    await client.connect(reconnect=True)
                except Exception as exc:
                    failure = self._connection_failure(exc)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._inbox = None
            self._connected = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.pacing.stop_timeout):
                await self._save_positions()
            self._store = None
        if failure is not None:
            raise failure
        logger.warning("discord: the Gateway connection ended")

    async def _report_live(self, on_live: Callable[[], None]) -> None:
        await self.live.wait()
        on_live()

    def _connection_failure(self, exc: Exception) -> Exception:
        if isinstance(exc, discord.PrivilegedIntentsRequired):
            return DiscordSetupError(
                "discord: the Gateway refused the Message Content intent; enable it on the "
                "Developer Portal (your app > Bot > Privileged Gateway Intents > Message "
                "Content Intent), or set channels.discord.message_content = false"
            )
        if isinstance(exc, discord.ConnectionClosed):
            if exc.code == 4004:
                return DiscordSetupError(
                    f"discord: the Gateway refused the bot token; check {ENV_TOKEN}"
                )
            return DiscordSetupError(
                f"discord: the Gateway closed the connection ({exc.code}: {exc.reason}); "
                "reconnecting"
            )
        if isinstance(exc, discord.GatewayNotFound | aiohttp.ClientError | OSError):
            gateway = discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY
            return DiscordSetupError(
                f"discord: cannot reach the Gateway at {gateway} ({type(exc).__name__}: {exc});"
                " check the network or channels.discord.gateway_url"
            )
        return exc

    def _on_event(self, event: str, args: tuple[Any, ...]) -> None:
        """discord.py's events, on the loop, in Gateway order: queued for `_intake`."""
        inbox = self._inbox
        if event == "connect":
            # READY: a new session. Discord sent nothing of what happened before it.
            self._connected = True
            client = self._client
            if self.settings.gateway_url and client is not None and client.ws is not None:
                client.ws.gateway = yarl.URL(self.settings.gateway_url)  # resumes go there
            self._guilds_ready = anyio.Event()
            if inbox is not None:
                inbox.send_nowait(_Sync(full=True, guilds=self._guilds_ready))
        elif event == "ready":
            if self._guilds_ready is not None:
                self._guilds_ready.set()
        elif event == "resumed":
            self._connected = True
            if inbox is not None:
                inbox.send_nowait(_Sync(full=False))
        elif event == "disconnect":
            self._connected = False
        elif event == "message" and inbox is not None:
            message = args[0]
            self._newest[message.channel.id] = max(
                self._newest.get(message.channel.id, 0), message.id
            )
            inbox.send_nowait(_Live(message))
        elif event == "raw_message_edit" and inbox is not None:
            edit = args[0]
            if edit.data.get("edited_timestamp"):  # not an embed being unfurled
                inbox.send_nowait(_Live(edit.message, edited=True))

    # ----------------------------------------------------------------- intake

    async def _intake(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        """Take what the Gateway delivered, one message at a time, in order; a backfill
        runs in that order too, so it stays ahead of the newer live messages."""
        async with receive:
            async for item in receive:
                if self._paused:
                    continue  # left unread: the next start reads it back
                try:
                    if isinstance(item, _Sync):
                        await self._sync(item)
                    elif isinstance(item, _Retry):
                        await self._backfill(only=item.conversations)
                    else:
                        await self._take(item.message, edited=item.edited)
                except Exception:
                    logger.exception("discord: taking in messages failed")
                    if isinstance(item, _Live) and not item.edited:
                        # Not settled: nothing after it in its conversation may be.
                        self._block(item.message.channel.id, start=item.message.id - 1)

    async def _sync(self, item: _Sync) -> None:
        if item.guilds is not None:
            # The channels and threads of the servers come in GUILD_CREATE events
            # right after READY (which lists the servers as unavailable until then);
            # discord.py says "ready" only a while after the last one.
            with anyio.move_on_after(self.pacing.guild_ready_timeout + 10):
                # Polled: a GUILD_CREATE during READY's stream dispatches no event.
                while not item.guilds.is_set() and self._guilds_pending():  # noqa: ASYNC110
                    await anyio.sleep(0.02)
        self._syncing = True
        try:
            await self._backfill(full=item.full)
        finally:
            self._syncing = False
        if not self.live.is_set():
            logger.info(
                "discord: connected to the Gateway{}", " (resumed)" if not item.full else ""
            )
        self.live.set()

    def _guilds_pending(self) -> bool:
        client = self._client
        return client is not None and any(guild.unavailable for guild in client.guilds)

    def _first_sighting(self, message_id: int) -> bool:
        if message_id in self._seen:
            return False
        self._seen[message_id] = None
        if len(self._seen) > _SEEN_MESSAGES:
            self._seen.popitem(last=False)
        return True

    async def _take(self, message: discord.Message, *, edited: bool = False) -> bool:
        """Translate and submit one message; move its conversation's position past it
        once it is settled. False when it was not taken: its conversation stops until a
        backfill brings it again."""
        conversation = message.channel.id
        if conversation in self._blocked:
            return False  # read back, in order, when the conversation is retried
        if not edited and (
            message.id <= self._positions.get(conversation, 0) or message.id in self._seen
        ):
            return True  # settled already (read back, then delivered live too)
        try:
            place = await self._place_of(message.channel)
        except (discord.Forbidden, discord.NotFound):
            place = None  # a channel the bot may not see
        except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            logger.warning("discord: channel {} not looked up ({}); retrying", conversation, exc)
            self._block(conversation, start=message.id - 1)
            return False
        if place is None:
            result: Translation = Skip("not a channel the bot answers in")
        else:
            result = translate_message(
                message,
                place,
                bot_id=self._bot_id,
                bot_roles=self._bot_roles(message),
                edited=edited,
            )
        if isinstance(result, Skip):
            logger.debug("discord: message {} skipped: {}", message.id, result.reason)
        elif isinstance(result, Notice):
            self._spawn(self._send_notice, result)
        elif self._submit is not None:
            with logger.contextualize(session=result.session_key):
                if not edited and not await self._known(conversation, message.id):
                    return False
                ticket = await self._submit(result)
                if not ticket.taken:
                    logger.warning(
                        "discord: message {} not taken; its conversation waits and is read "
                        "back from there",
                        message.id,
                    )
                    self._block(conversation, start=message.id - 1)
                    return False
            where = target_channel(result.chat_id, result.thread_id)
            self._spawn(self._typing_while_pending, ticket, where)
        if not edited:
            self._first_sighting(message.id)
            self._settled(conversation, message.id)
        return True

    def _bot_roles(self, message: discord.Message) -> frozenset[int]:
        guild = message.guild
        role = guild.self_role if guild is not None else None
        return frozenset({role.id}) if role is not None else frozenset()

    async def _place_of(self, channel: Any) -> Place | None:
        """What kind of place a channel is (from discord.py's cache, else asked once
        through the HTTP API); None for one the bot does not answer in (group DMs)."""
        known = self._places.get(channel.id)
        if known is not None:
            return known
        place: Place | None = None
        if isinstance(channel, discord.Thread):
            place = Place(channel.id, "thread", channel.parent_id, channel.guild.id)
        elif isinstance(channel, discord.DMChannel):
            place = Place(channel.id, "dm")
        elif isinstance(channel, discord.abc.GuildChannel):
            place = Place(channel.id, "guild", guild_id=channel.guild.id)
        elif isinstance(channel, discord.PartialMessageable) and self._client is not None:
            cached = self._client.get_channel(channel.id)
            if cached is not None and not isinstance(cached, discord.PartialMessageable):
                return await self._place_of(cached)
            if channel.type is discord.ChannelType.private:
                place = Place(channel.id, "dm")
            else:
                fetched = await self._client.fetch_channel(channel.id)
                if not isinstance(fetched, discord.PartialMessageable):
                    return await self._place_of(fetched)
        if place is not None:
            self._places[channel.id] = place
        return place

    # ----------------------------------------------------------------- positions

    async def _known(self, conversation: int, message_id: int) -> bool:
        """Before a conversation's first message is submitted, its position (just before
        the message) is saved: a DM is found again after a crash only through it, and
        a crash right after the journal must not leave the conversation unknown. False
        (the conversation stops, retried) when it could not be saved."""
        if conversation in self._positions:
            return True
        self._positions[conversation] = message_id - 1
        self._updated[conversation] = time.time()
        self._dirty = True
        try:
            await self._save_positions()
        except Exception as exc:
            logger.warning("discord: a new conversation's position not saved ({})", exc)
            self._block(conversation, start=message_id - 1)
            return False
        return True

    def _settled(self, conversation: int, message_id: int) -> None:
        if message_id > self._positions.get(conversation, 0):
            self._positions[conversation] = message_id
            self._updated[conversation] = time.time()
            self._dirty = True

    def _block(self, conversation: int, *, start: int) -> None:
        """Stop a conversation at a message that could not be settled; it is read back
        from there (from `start` when it has no position yet) after a backoff."""
        if conversation not in self._positions:
            self._settled(conversation, start)
        delay = min(self._backoff.get(conversation, 0.5) * 2, self.pacing.retry_max)
        self._backoff[conversation] = delay
        self._blocked[conversation] = time.monotonic() + delay

    @property
    def cursor_name(self) -> str:
        """The name of this bot's read positions in the cursor store."""
        return f"{CHANNEL}:{self._bot_id}"

    async def _load_positions(self) -> None:
        """The positions as last saved (a damaged document is reported and the channel
        starts as on a first run); conversations silent past `FORGET_AFTER` dropped."""
        assert self._store is not None
        self._positions.clear()
        self._updated.clear()
        self._watermark = None
        raw = await self._store.load(self.cursor_name)
        if raw is None:
            return
        try:
            positions = Positions.from_json(raw)
        except ValueError as exc:
            logger.error(
                "discord: the saved read positions are unreadable ({}); starting as on a first run",
                exc,
            )
            return
        horizon = time.time() - FORGET_AFTER
        self._watermark = positions.watermark
        for conversation, (position, updated) in positions.conversations.items():
            if updated >= horizon:
                self._positions[conversation] = position
                self._updated[conversation] = updated

    async def _keep_positions(self) -> None:
        """Save moved positions every `cursor_interval`; move the watermark while
        connected and caught up; queue a read-back of stopped conversations when due."""
        while True:
            await anyio.sleep(self.pacing.cursor_interval)
            caught_up = (
                self._connected
                and self.live.is_set()
                and not self._syncing
                and not self._blocked
                and self._inbox is not None
                and self._inbox.statistics().current_buffer_used == 0
            )
            if caught_up:
                mark = snowflake_at(time.time() - self.pacing.watermark_margin)
                if self._watermark is None or mark > self._watermark:
                    self._watermark = mark
                    self._dirty = True
            due = frozenset(c for c, at in self._blocked.items() if at <= time.monotonic())
            if due and self._inbox is not None:
                for conversation in due:
                    self._blocked[conversation] = math.inf  # queued; not queued again
                self._inbox.send_nowait(_Retry(due))
            try:
                await self._save_positions()
            except Exception as exc:  # kept in memory; tried again next round
                logger.warning("discord: read positions not saved ({}); retrying", exc)

    async def _save_positions(self) -> None:
        """Save every position (one document, see `Positions`) when one moved."""
        store = self._store
        if not self._dirty or store is None:
            return
        self._dirty = False
        document = Positions(
            self._watermark,
            {c: (p, self._updated.get(c, 0.0)) for c, p in self._positions.items()},
        )
        try:
            await store.save(self.cursor_name, document.to_json())
        except BaseException:
            self._dirty = True
            raise

    # ----------------------------------------------------------------- backfill

    async def _backfill(self, *, full: bool = False, only: frozenset[int] | None = None) -> None:
        """Read back, oldest first, what each conversation got after its position (see
        the module docstring for which conversations, and how far back)."""
        client = self._client
        if client is None:
            return
        horizon = snowflake_at(time.time() - self.settings.backfill_max_age_seconds)
        targets: dict[int, int] = {}
        if only is not None:
            for conversation in only:
                self._blocked.pop(conversation, None)
                targets[conversation] = max(self._positions.get(conversation, 0), horizon)
        else:
            recent_first = sorted(self._positions, key=lambda c: -self._updated.get(c, 0.0))
            for conversation in recent_first:
                position = self._positions[conversation]
                newest = self._last_message_id(conversation, live_too=not full)
                if not full and (newest is None or newest <= position):
                    continue  # after a RESUME: only where something newer is known
                if newest is not None and newest <= position:
                    continue  # nothing new there
                if len(targets) >= self.settings.backfill_max_conversations:
                    logger.warning(
                        "discord: more than {} conversations to read back; the least "
                        "recently active ones are not",
                        self.settings.backfill_max_conversations,
                    )
                    break
                targets[conversation] = max(position, horizon)
            if full and self._watermark is not None:
                since = max(self._watermark, horizon)
                for channel in self._readable_channels():
                    newest = channel.last_message_id
                    if (
                        channel.id not in targets
                        and channel.id not in self._positions
                        and (newest is not None and newest > since)
                    ):
                        targets[channel.id] = since
        if not targets:
            return
        total = 0
        for conversation, after in sorted(targets.items()):
            total += await self._backfill_one(client, conversation, after)
        if total:
            logger.info(
                "discord: read back {} message(s) of {} conversation(s) written while away",
                total,
                len(targets),
            )

    def _last_message_id(self, conversation: int, *, live_too: bool) -> int | None:
        """The newest message id known for a conversation without asking Discord: from
        the servers' channels as the session's GUILD_CREATEs described them, and with
        `live_too` from the messages this process saw (after a RESUME, whose replay
        brought the rest); None when unknown (a DM: it has to be asked)."""
        client = self._client
        channel = client.get_channel(conversation) if client is not None else None
        known = getattr(channel, "last_message_id", None) if channel is not None else None
        seen = self._newest.get(conversation) if live_too else None
        values = [v for v in (known, seen) if v is not None]
        return max(values) if values else None

    def _readable_channels(self) -> list[Any]:
        """The server channels and active threads whose history the bot may read."""
        client = self._client
        if client is None:
            return []
        found: list[Any] = []
        for guild in client.guilds:
            me = guild.me
            channels: list[discord.TextChannel | discord.Thread] = [
                *guild.text_channels,
                *guild.threads,
            ]
            for channel in channels:
                if me is not None:
                    allowed = channel.permissions_for(me)
                    if not (allowed.view_channel and allowed.read_message_history):
                        continue
                found.append(channel)
        return found

    async def _backfill_one(self, client: _Client, conversation: int, after: int) -> int:
        """One conversation read back from `after`; the number of messages read."""
        count = 0
        channel = client.get_partial_messageable(conversation)
        try:
            async for message in channel.history(
                after=discord.Object(after),
                limit=self.settings.backfill_max_messages,
                oldest_first=True,
            ):
                count += 1
                self.backfilled += 1
                if not await self._take(message):
                    return count  # stopped: read back from here later
        except (discord.Forbidden, discord.NotFound) as exc:
            logger.warning(
                "discord: cannot read the history of channel {} ({}); it is not read back",
                conversation,
                exc.text or exc.status,
            )
            self._positions.pop(conversation, None)
            self._dirty = True
            return count
        except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as exc:
            logger.warning(
                "discord: reading back channel {} failed ({}: {}); retrying later",
                conversation,
                type(exc).__name__,
                exc,
            )
            self._block(conversation, start=after)
            return count
        if count >= self.settings.backfill_max_messages:
            logger.warning(
                "discord: channel {} had more than {} messages while the bot was away; "
                "the later ones are not answered",
                conversation,
                self.settings.backfill_max_messages,
            )
        self._backoff.pop(conversation, None)
        return count

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- typing, notices

    async def _typing_while_pending(self, ticket: Ticket, channel_id: int) -> None:
        """Show "typing" in the channel until the ticket's reply is ready."""
        await self._typing.while_pending(
            ticket,
            channel_id,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_interval,
            limit=self.pacing.turn_limit,
        )

    async def _send_typing(self, channel_id: int) -> None:
        client = self._client
        if client is not None:
            try:
                await client.http.send_typing(channel_id)
            except (discord.HTTPException, aiohttp.ClientError, OSError) as exc:
                logger.debug("discord: typing indicator failed: {}", exc)

    async def _send_notice(self, notice: Notice) -> None:
        where = notice.place.channel_id
        if not self._notices.allow(where, self.pacing.notice_cooldown):
            return
        try:
            await self._post(where, notice.text, str(notice.message_id), "notice")
        except (discord.HTTPException, aiohttp.ClientError, OSError, DiscordSetupError) as exc:
            logger.warning("discord: a notice to channel {} was not sent: {}", where, exc)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Discord Markdown in messages of at most 2,000 characters, the
        first one a reply to the message it answers, in order, then its files. Raises
        when a message cannot be delivered, and sends none after it (they would read
        out of context): `DeliveryFailed` when it certainly did not reach Discord and
        may later (`not_sent`); the same reply sent again goes on from that part."""
        target = target_channel(message.chat_id, message.thread_id)
        pieces = discord_messages(message.text)
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not pieces and not message.files:
                logger.warning("discord: empty reply not sent")
                return
            first = 0
            shown = stream.message_id if stream is not None else None
            if pieces and shown is not None and await self._edit(target, shown, pieces[0]):
                first = 1
            reply = (message.session_key, message.reply_to, message.text)
            done = max(first, self._sent_parts.take(reply, 0))
            try:
                for index in range(done, len(pieces)):
                    reply_to = message.reply_to if index == 0 else None
                    await self._post(
                        target,
                        pieces[index],
                        reply_to,
                        f"part {index}",
                        nonce_of=message.reply_to,
                    )
                    done = index + 1
                for index, file in enumerate(message.files):
                    if len(pieces) + index < done:
                        continue
                    await self._post_file(target, file, message.reply_to, index)
                    done = len(pieces) + index + 1
            except Exception as exc:
                if not not_sent(exc):
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"discord: {exc!r}", sent=done) from exc

    async def _post(
        self,
        channel_id: int,
        text: str,
        reply_to: str | None,
        part: str,
        *,
        nonce_of: str | None = None,
    ) -> discord.Message:
        """Post one message (a reply to `reply_to` when given), at most once."""
        channel = self._messageable(channel_id)
        reference_id = discord_message_id(reply_to)
        reference = (
            discord.MessageReference(
                message_id=reference_id, channel_id=channel_id, fail_if_not_exists=False
            )
            if reference_id is not None
            else None
        )
        nonce = reply_nonce(nonce_of or reply_to, part, text)
        send = functools.partial(
            channel.send,
            text,
            reference=reference,  # type: ignore[arg-type]
            allowed_mentions=NO_PINGS,
            nonce=nonce,  # type: ignore[arg-type]
        )
        return await self._call("create message", channel_id, send)

    async def _post_file(
        self, channel_id: int, file: OutboundFile, reply_to: str | None, index: int
    ) -> None:
        """One file of a reply, after its text, at most once (a nonce, as for text)."""
        if len(file.data) > UPLOAD_LIMIT:
            logger.error(
                "discord: file {} not sent: {:.1f} MB is over Discord's 10 MB upload limit",
                file.name,
                len(file.data) / 2**20,
            )
            return
        channel = self._messageable(channel_id)
        caption = split_discord(file.caption, DISCORD_LIMIT)[0] if file.caption.strip() else ""
        digest = hashlib.blake2b(file.data, digest_size=8).hexdigest()
        nonce = reply_nonce(reply_to, f"file {index} {file.name} {digest}", caption)

        async def upload() -> discord.Message:
            attached = discord.File(io.BytesIO(file.data), filename=file.name)
            return await channel.send(
                caption or None,
                file=attached,
                allowed_mentions=NO_PINGS,
                nonce=nonce,  # type: ignore[arg-type]
            )

        await self._call("upload a file", channel_id, upload)

    async def _edit(self, channel_id: int, message_id: int, text: str) -> bool:
        """Replace a streamed message's text; False when it cannot be edited (the
        caller posts a new message instead)."""
        message = self._messageable(channel_id).get_partial_message(message_id)
        edit = functools.partial(message.edit, content=text, allowed_mentions=NO_PINGS)
        try:
            await self._call("edit message", channel_id, edit)
            return True
        except (discord.HTTPException, aiohttp.ClientError, OSError) as exc:
            logger.warning("discord: streamed message {} not edited: {}", message_id, exc)
            return False

    def _messageable(self, channel_id: int) -> discord.PartialMessageable:
        client = self._client
        if client is None:
            raise DiscordSetupError("discord: the channel is not running; reply not sent")
        return client.get_partial_messageable(channel_id)

    async def _call(self, what: str, channel_id: int, request: Callable[[], Awaitable[_T]]) -> _T:
        """Make one HTTP API request. discord.py waits out rate limits and repeats a
        5xx; this repeats a request that got no answer at all (a dropped connection,
        a timeout), and one discord.py gave up on after five 429s in a row (many
        requests waking at once from the global limit, each getting the next 429),
        after the 429's `Retry-After`. Repeating is safe: messages carry nonces, edits
        and typing repeat harmlessly. What bounds the waiting is the caller's deadline
        (the dispatcher's `deliver_timeout_seconds` for a reply)."""
        attempt = 0
        reached: BaseException | None = None
        while True:
            try:
                return await request()
            except discord.HTTPException as exc:
                if exc.status != 429:
                    raise
                delay = _retry_after(exc)
                logger.warning(
                    "discord: {} in channel {} still rate limited after discord.py's"
                    " retries; again in {:g}s",
                    what,
                    channel_id,
                    delay,
                )
                await anyio.sleep(delay)
            except discord.RateLimited as exc:
                logger.error(
                    "discord: {} in channel {} rate limited for {:.0f}s, longer than we wait;"
                    " given up for now",
                    what,
                    channel_id,
                    exc.retry_after,
                )
                raise
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                attempt += 1
                if not not_sent(exc):
                    reached = exc  # it may have reached Discord
                if attempt >= self.pacing.retry_attempts:
                    if reached is not None and reached is not exc:
                        # The caller learns the worst: a request that may have gone out.
                        raise reached from exc
                    raise
                delay = min(
                    self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
                )
                logger.warning(
                    "discord: {} in channel {} got no answer ({}: {}); retry {} in {:g}s",
                    what,
                    channel_id,
                    type(exc).__name__,
                    exc,
                    attempt,
                    delay,
                )
                await anyio.sleep(delay)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: its CDN link (no token needed), at most `max_bytes`;
        when the link expired (Discord signs them for a day), the message is read
        again for a fresh one."""
        if attachment.size is not None and attachment.size > max_bytes:
            raise MediaError(
                f"it is {attachment.size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        url = attachment.url
        if url:
            try:
                return await download_capped(url, max_bytes)
            except FileTooLarge:
                raise  # a fresh link would bring the same bytes
            except MediaError:
                pass  # most likely an expired link: ask for a fresh one
        fresh = await self._fresh_url(attachment)
        if fresh is None:
            raise MediaError("Discord no longer has the file")
        return await download_capped(fresh, max_bytes)

    async def _fresh_url(self, attachment: Attachment) -> str | None:
        parts = attachment.file_id.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or self._client is None:
            return None
        channel_id, message_id, attachment_id = (int(p) for p in parts)
        try:
            message = await self._messageable(channel_id).fetch_message(message_id)
        except (discord.HTTPException, aiohttp.ClientError, OSError):
            return None
        for item in message.attachments:
            if item.id == attachment_id:
                return item.url
        return None

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` is posted as the reply, edited at most once per
        interval; `send` with the whole reply then edits it a last time (and posts what
        does not fit). Does nothing unless `channels.discord.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            self._forget_stale_streams(now)
            stream = _Stream(
                reply_to=inbound.message_id,
                target=target_channel(inbound.chat_id, inbound.thread_id),
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
            pieces = discord_messages(stream.text)
            if stream.closed or not pieces or pieces[0] == stream.shown:
                return
            preview = pieces[0]
            if stream.message_id is None:
                sent = await self._post(stream.target, preview, stream.reply_to, "preview")
                stream.message_id = sent.id
            else:
                message = self._messageable(stream.target).get_partial_message(stream.message_id)
                await message.edit(content=preview, allowed_mentions=NO_PINGS)
            stream.shown = preview
        except (discord.HTTPException, aiohttp.ClientError, OSError, DiscordSetupError) as exc:
            logger.debug("discord: streaming update skipped: {}", exc)
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


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True, slots=True)
class DiscordCheck:
    """What `gateway doctor` learned: who the token is, whether the Message Content
    intent is enabled for the app, and whether the Gateway answers (its problem, or
    "")."""

    identity: str
    message_content_enabled: bool
    gateway_problem: str


async def check_credentials(settings: DiscordSettings, token: str) -> DiscordCheck:
    """`gateway doctor`: log in through the HTTP API (the token), read the app's flags
    (the privileged intents enabled on the Bot page), and open the Gateway until its
    HELLO (no IDENTIFY: nothing counts against the daily limit). Raises
    DiscordSetupError saying what to fix."""
    if not token:
        raise DiscordSetupError(f"discord: no bot token; set {ENV_TOKEN}")
    use_endpoints(settings)
    client = discord.Client(intents=intents_for(settings))
    try:
        user = await log_in(client, token)
        flags = client.application_flags
        content = bool(flags.gateway_message_content or flags.gateway_message_content_limited)
        identity = f"@{user.name} ({user.id})"
    finally:
        await client.close()
    return DiscordCheck(identity, content, await _gateway_problem())


async def _gateway_problem() -> str:
    """Open the Gateway and wait for its HELLO; "" when it came, else what went wrong."""
    from discord.http import INTERNAL_API_VERSION

    gateway = discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY
    url = gateway.with_query(v=INTERNAL_API_VERSION, encoding="json")
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.ws_connect(str(url)) as ws,
        ):
            frame = await ws.receive(timeout=10)
            if frame.type is not aiohttp.WSMsgType.TEXT or '"op":10' not in frame.data.replace(
                " ", ""
            ):
                return f"the Gateway at {gateway} did not say HELLO"
            await ws.close(code=1000)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return f"cannot open the Gateway at {gateway} ({type(exc).__name__}: {exc})"
    return ""
