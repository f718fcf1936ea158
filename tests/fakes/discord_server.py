"""A fake Discord (the HTTP API and the Gateway) that speaks the real wire protocol, for tests.

The real discord.py talks to it unchanged: an aiohttp server on 127.0.0.1 with a random
free port serves the HTTP API under ``/api/v10`` and the Gateway's WebSocket at ``/``
(and at ``/resume``, the `resume_gateway_url` its READY names). Point discord.py at it
the way the gateway's settings do::

    discord.http.Route.BASE = fake.api_url                       # f"{fake.url}/api/v10"
    discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(fake.gateway_url)

Written from Discord's developer documentation (discord/discord-api-docs:
developers/events/gateway.mdx, gateway-events.mdx, topics/opcodes-and-status-codes.mdx,
topics/rate-limits.mdx, resources/message.mdx, resources/channel.mdx, reference.mdx).
What it keeps, each checked by tests/test_fake_discord.py with a plain WebSocket and
HTTP client:

The Gateway
- Opening: HELLO (op 10, ``heartbeat_interval``) on connect; ``v`` must be 10 (else close
  4012), ``encoding`` json (etf: close 4002), ``compress=zlib-stream`` honoured (one zlib
  context per connection, every message ending in the ``Z_SYNC_FLUSH`` suffix
  ``00 00 ff ff``); zstd-stream is refused (close 4000: discord.py asks for it only when
  the zstandard package is installed).
- HEARTBEAT (op 1, ``d`` the last sequence) is answered with HEARTBEAT_ACK (op 11), also
  before identifying. A connection that sends none for 1.5 heartbeat intervals is closed
  (4000); its session stays resumable. `ack_heartbeats = False` makes a "zombie"
  connection (no ACKs) that a client must notice itself.
- IDENTIFY (op 2): a wrong token closes 4004, a second IDENTIFY 4005, unknown intent bits
  4013, a privileged intent (GUILD_MEMBERS 1<<1, GUILD_PRESENCES 1<<8, MESSAGE_CONTENT
  1<<15) the application has not enabled (`application_flags`) 4014; any other payload
  before it 4003. It answers READY (``s`` 1: ``v``, ``user``, ``guilds`` as unavailable,
  ``session_id``, ``resume_gateway_url``, ``application`` {id, flags}), then one
  GUILD_CREATE per guild (with the GUILDS intent).
- Dispatches (op 0) carry a sequence number ``s`` counting up per session. Events follow
  the intents: MESSAGE_CREATE/UPDATE in a guild need GUILD_MESSAGES (1<<9), in a DM
  DIRECT_MESSAGES (1<<12); without MESSAGE_CONTENT a message's ``content``,
  ``attachments``, ``embeds`` and ``components`` are empty, except in DMs, in messages
  that mention the bot, and in the bot's own messages. Guild and thread events
  (GUILD_CREATE, THREAD_CREATE) need GUILDS (1<<0). A MESSAGE_CREATE from the gateway
  has ``guild_id`` and the author's ``member`` in a guild; the HTTP API's message has not.
- RESUME (op 6) with the session id and the last sequence received replays every event
  after it, in order, then RESUMED. A session stays resumable `resume_window` seconds
  after its connection dropped (a close by the client with 1000 or 1001 ends it at
  once). A RESUME of an unknown, ended or expired session gets INVALID_SESSION (op 9)
  with ``d`` false; a sequence the session never reached closes 4007.
- Scripted: `reconnect` (op 7, then the server closes), `invalidate` (op 9, d true or
  false), `drop_connections` (the TCP connection cut without a close frame),
  `end_sessions` (nothing can be resumed any more). While no connection is open events
  are still numbered and kept for a RESUME; a session that expires loses them: only the
  HTTP API's history has them then.
- Sending more than 120 payloads in 60 s closes 4008; a payload over 4096 bytes or one
  that is not JSON closes 4002.

The HTTP API (``Authorization: Bot <token>``, else 401)
- GET /users/@me, /oauth2/applications/@me, /applications/@me, /gateway, /gateway/bot,
  /channels/{id}; POST /users/@me/channels (a DM).
- GET /channels/{id}/messages: ``limit`` 1-100 (default 50; else 400, code 50035),
  ``before``, ``after``, ``around`` (at most one), newest first. With ``after`` it is
  the `limit` messages right after that id (discord.py pages forward by the first, the
  newest, id of each page).
- GET /channels/{id}/messages/{id}: 404 code 10008 "Unknown Message" when there is none.
- POST /channels/{id}/messages, as JSON or ``multipart/form-data`` (``payload_json`` and
  ``files[n]``, each at most `file_size_limit`, 10 MiB: else 413 code 40005): content up
  to 2000 characters (else 400 code 50035), something to send (else 400 code 50006), a
  ``message_reference`` to a message of the channel (``fail_if_not_exists`` false: sent
  as a plain message), ``nonce`` up to 25 characters; with ``enforce_nonce`` the bot's
  message of the same nonce from the last `nonce_window` seconds is returned and nothing
  new is made. ``allowed_mentions`` decides who is pinged (`pings`): without it every
  ``<@id>``, ``<@&id>``, ``@everyone`` and ``@here`` of the content pings; the message's
  ``mentions``, ``mention_roles`` and ``mention_everyone`` say what did. The message is
  dispatched as MESSAGE_CREATE, also to the bot.
- PATCH /channels/{id}/messages/{id}: the bot's own messages only (403 code 50005), the
  same content limit and mention rules (an edit without ``allowed_mentions`` parses with
  the defaults); MESSAGE_UPDATE is dispatched.
- POST /channels/{id}/typing: 204. Attachments are served under ``/attachments/``.
- Rate limits: every limited route answers the X-RateLimit-Limit, -Remaining, -Reset,
  -Reset-After and -Bucket headers; creating and editing messages is limited per channel
  (`message_limit` per `message_window` seconds), everything together by the global
  limit (`global_limit` per second). Past a limit: 429 with a JSON body {message,
  retry_after, global}, ``Retry-After``, ``X-RateLimit-Scope`` (user, global) and, as
  Discord's 429s do, a ``Via`` header (discord.py reads a 429 without one as a
  Cloudflare ban). `fail_next` scripts a 429 (per route or global), a 5xx, or a
  connection cut after the request was carried out (`cut_after`).

Scripting, in the running event loop or from a test thread (``FakeDiscord.in_thread()``)::

    async with FakeDiscord() as fake:
        guild = fake.add_guild("Acme")
        general = fake.add_text_channel(guild, "general")
        alice = fake.add_user("alice")
        dm = fake.dm_channel(alice)
        fake.user_message(dm, alice, "hello")
        fake.user_message(general, alice, f"<@{fake.bot_id}> hi", mentions=[fake.bot_id])
        await fake.wait_for_bot_messages_async(2)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import itertools
import json
import re
import secrets
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tests.fakes._serving import LocalApiServer, at_least

DISCORD_EPOCH_MS = 1420070400000
API_VERSION = 10
DEFAULT_TOKEN = "MTA5ODc2NTQzMjEwOTg3NjU0.GfakeX.fake-discord-bot-token-for-tests-0123"
MESSAGE_LIMIT = 2000
NONCE_LIMIT = 25
FILE_SIZE_LIMIT = 10 * 1024 * 1024
REQUEST_SIZE_LIMIT = 25 * 1024 * 1024
MAX_PAYLOAD_BYTES = 4096
GATEWAY_SEND_LIMIT = (120, 60.0)
ZLIB_SUFFIX = b"\x00\x00\xff\xff"

# Gateway opcodes (topics/opcodes-and-status-codes.mdx).
OP_DISPATCH, OP_HEARTBEAT, OP_IDENTIFY, OP_PRESENCE, OP_VOICE_STATE = 0, 1, 2, 3, 4
OP_RESUME, OP_RECONNECT, OP_REQUEST_MEMBERS, OP_INVALID_SESSION = 6, 7, 8, 9
OP_HELLO, OP_HEARTBEAT_ACK = 10, 11

# Intents (events/gateway.mdx, "List of Intents").
GUILDS = 1 << 0
GUILD_MEMBERS = 1 << 1
GUILD_PRESENCES = 1 << 8
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGES = 1 << 12
MESSAGE_CONTENT = 1 << 15
PRIVILEGED = {GUILD_MEMBERS: 1 << 15, GUILD_PRESENCES: 1 << 13, MESSAGE_CONTENT: 1 << 19}
_ALL_INTENTS = sum(1 << bit for bit in (*range(0, 17), 20, 21, 24, 25))

# Application flags (resources/application.mdx): the privileged intents enabled on the
# Bot page (the *_LIMITED ones, for apps in under 100 servers).
GATEWAY_PRESENCE_LIMITED = 1 << 13
GATEWAY_GUILD_MEMBERS_LIMITED = 1 << 15
GATEWAY_MESSAGE_CONTENT = 1 << 18
GATEWAY_MESSAGE_CONTENT_LIMITED = 1 << 19

# Channel types (resources/channel.mdx).
GUILD_TEXT, DM, GUILD_ANNOUNCEMENT = 0, 1, 5
ANNOUNCEMENT_THREAD, PUBLIC_THREAD, PRIVATE_THREAD, GUILD_FORUM = 10, 11, 12, 15
THREAD_TYPES = frozenset({ANNOUNCEMENT_THREAD, PUBLIC_THREAD, PRIVATE_THREAD})

# Message types and flags (resources/message.mdx).
DEFAULT, REPLY, THREAD_STARTER_MESSAGE = 0, 19, 21
IS_VOICE_MESSAGE = 1 << 13

#: Permissions of @everyone in the fake's guilds: view, send, read history, attach,
#: send in threads, create threads (resources/permissions).
EVERYONE_PERMISSIONS = (1 << 10) | (1 << 11) | (1 << 16) | (1 << 15) | (1 << 38) | (1 << 35)

Payload = dict[str, Any]
_MENTION = re.compile(r"<@!?(\d+)>")
_ROLE_MENTION = re.compile(r"<@&(\d+)>")


def snowflake_time(snowflake: int) -> float:
    """Unix seconds a snowflake was made (reference.mdx, "Snowflakes")."""
    return ((snowflake >> 22) + DISCORD_EPOCH_MS) / 1000


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat()


class DiscordError(Exception):
    """An HTTP API error answer: status, code and message as Discord words them."""

    def __init__(
        self, status: int, code: int, message: str, errors: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.errors = errors

    def body(self) -> Payload:
        body: Payload = {"message": self.message, "code": self.code}
        if self.errors is not None:
            body["errors"] = dict(self.errors)
        return body


def _form_error(field_name: str, code: str, message: str) -> DiscordError:
    return DiscordError(
        400,
        50035,
        "Invalid Form Body",
        {field_name: {"_errors": [{"code": code, "message": message}]}},
    )


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP API request the fake answered (or cut)."""

    method: str  # e.g. "POST /channels/{channel_id}/messages"
    path: str
    status: int
    at: float
    body: Payload | None = None
    files: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class Scripted:
    """A failure `fail_next` queued for the next request to a route."""

    status: int
    retry_after: float = 0.0
    is_global: bool = False
    cut_after: bool = False  # carry the request out, then cut the connection


@dataclass
class Connection:
    """One WebSocket connection to the Gateway."""

    number: int
    path: str
    compress: bool
    opened_at: float
    ws: web.WebSocketResponse | None = None
    transport: asyncio.BaseTransport | None = None
    session: Session | None = None
    outbox: deque[str] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    close_code: int | None = None  # set: close with it once the outbox is sent
    cut: bool = False  # set: drop the TCP connection without a close frame
    closed: bool = False
    last_heartbeat: float = 0.0
    heartbeats: int = 0
    received: list[Payload] = field(default_factory=list)
    sent_ops: list[tuple[int, str | None]] = field(default_factory=list)
    identified: bool = False
    resumed: bool = False
    closed_by: str = ""  # "client <code>", "server <code>", "cut"


@dataclass
class Session:
    """A Gateway session: its sequence numbers and the events kept for a RESUME."""

    session_id: str
    intents: int
    seq: int = 0
    events: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=5000))
    connection: Connection | None = None
    ended: bool = False
    expires_at: float | None = None  # set while no connection is open

    def resumable(self, now: float) -> bool:
        return not self.ended and (self.expires_at is None or now < self.expires_at)


class FakeDiscord(LocalApiServer[Call]):
    """See the module docstring."""

    _thread_name = "fake-discord"

    def __init__(
        self,
        *,
        token: str = DEFAULT_TOKEN,
        bot_name: str = "gateway",
        application_flags: int = GATEWAY_MESSAGE_CONTENT_LIMITED,
        heartbeat_interval_ms: int = 41250,
        resume_window: float = 120.0,
        nonce_window: float = 180.0,
        message_limit: int = 5,
        message_window: float = 5.0,
        global_limit: int = 50,
        file_size_limit: int = FILE_SIZE_LIMIT,
    ) -> None:
        super().__init__()
        self.token = token
        self.application_flags = application_flags
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.resume_window = resume_window
        self.nonce_window = nonce_window
        self.message_limit = message_limit
        self.message_window = message_window
        self.global_limit = global_limit
        self.file_size_limit = file_size_limit
        self.ack_heartbeats = True
        self._ids = itertools.count(1)
        self._last_snowflake = 0
        self.bot_id = self._snowflake()
        self.application_id = self.bot_id
        self.users: dict[int, Payload] = {}
        self.bot = self._user_payload(self.bot_id, bot_name, bot=True)
        self.users[self.bot_id] = self.bot
        self.guilds: dict[int, Payload] = {}
        self.channels: dict[int, Payload] = {}
        self.messages: dict[int, list[Payload]] = {}  # channel -> oldest first
        self._files: dict[str, tuple[bytes, str]] = {}  # attachment path -> (bytes, mime)
        self.sessions: dict[str, Session] = {}
        self.connections: list[Connection] = []
        self._numbers = itertools.count(1)
        self._scripted: dict[str, deque[Scripted]] = {}
        self._windows: dict[str, tuple[float, int]] = {}  # bucket key -> (window start, used)
        self._global_window: tuple[float, int] = (0.0, 0)
        self.rate_limited: list[Call] = []  # every 429 the fake gave
        self._nonces: dict[tuple[int, str], tuple[float, Payload]] = {}
        self.pings: dict[int, Payload] = {}  # message id -> what it pinged
        #: Messages sent again with a nonce already used (enforce_nonce): none was made.
        self.nonce_repeats = 0

    # -- ids and payloads -------------------------------------------------------------

    def _snowflake(self) -> int:
        """A new snowflake: time since the Discord epoch in its top bits, always larger
        than the one before (reference.mdx, "Snowflakes")."""
        with self._lock:
            stamp = (int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22
            value = max(stamp | (next(self._ids) & 0xFFF), self._last_snowflake + 1)
            self._last_snowflake = value
            return value

    def snowflake_at(self, unix_seconds: float) -> int:
        """The smallest snowflake of an instant (what `after=` of that time means)."""
        return (int(unix_seconds * 1000) - DISCORD_EPOCH_MS) << 22

    @staticmethod
    def _user_payload(user_id: int, name: str, *, bot: bool = False) -> Payload:
        user: Payload = {
            "id": str(user_id),
            "username": name,
            "discriminator": "0",
            "global_name": None if bot else name.title(),
            "avatar": None,
        }
        if bot:
            user["bot"] = True
        return user

    @property
    def api_url(self) -> str:
        """What discord.http.Route.BASE is set to."""
        return f"{self.url}/api/v{API_VERSION}"

    @property
    def gateway_url(self) -> str:
        """The Gateway's URL (what DiscordWebSocket.DEFAULT_GATEWAY is set to)."""
        return self.url.replace("http://", "ws://") + "/"

    @property
    def resume_gateway_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/resume"

    # -- the world: users, guilds, channels -------------------------------------------

    def add_user(self, name: str, *, bot: bool = False) -> int:
        user_id = self._snowflake()
        with self._lock:
            self.users[user_id] = self._user_payload(user_id, name, bot=bot)
        return user_id

    def add_guild(self, name: str = "Guild", *, members: Iterable[int] = ()) -> int:
        members = list(members)
        guild_id = self._snowflake()
        everyone = {
            "id": str(guild_id),
            "name": "@everyone",
            "permissions": str(EVERYONE_PERMISSIONS),
            "position": 0,
            "color": 0,
            "hoist": False,
            "managed": False,
            "mentionable": False,
            "flags": 0,
        }
        bot_role_id = self._snowflake()
        bot_role = {
            "id": str(bot_role_id),
            "name": self.bot["username"],
            "permissions": str(EVERYONE_PERMISSIONS),
            "position": 1,
            "color": 0,
            "hoist": False,
            "managed": True,
            "mentionable": False,
            "flags": 0,
            "tags": {"bot_id": str(self.bot_id)},
        }
        with self._lock:
            self.guilds[guild_id] = {
                "id": str(guild_id),
                "name": name,
                "owner_id": str(next(iter(members), self.bot_id)),
                "roles": [everyone, bot_role],
                "members": {self.bot_id: [str(bot_role_id)], **{m: [] for m in members}},
                "joined_at": iso(time.time()),
            }
        return guild_id

    def bot_role(self, guild_id: int) -> int:
        """The bot's managed role in a guild (what `<@&id>` of the bot mentions)."""
        return int(self.guilds[guild_id]["roles"][1]["id"])

    def add_text_channel(self, guild_id: int, name: str = "general") -> int:
        channel_id = self._snowflake()
        with self._lock:
            position = sum(1 for c in self.channels.values() if c.get("guild_id") == str(guild_id))
            self.channels[channel_id] = {
                "id": str(channel_id),
                "type": GUILD_TEXT,
                "guild_id": str(guild_id),
                "name": name,
                "position": position,
                "permission_overwrites": [],
                "nsfw": False,
                "parent_id": None,
                "topic": None,
                "last_message_id": None,
                "rate_limit_per_user": 0,
            }
            self.messages[channel_id] = []
        return channel_id

    def add_thread(
        self, parent_id: int, name: str = "thread", *, kind: int = PUBLIC_THREAD, owner: int = 0
    ) -> int:
        """A thread in `parent_id` (THREAD_CREATE to sessions with the GUILDS intent)."""
        if kind not in THREAD_TYPES:
            raise ValueError(f"thread type must be one of {sorted(THREAD_TYPES)}")
        thread_id = self._snowflake()
        parent = self.channels[parent_id]
        with self._lock:
            thread = {
                "id": str(thread_id),
                "type": kind,
                "guild_id": parent["guild_id"],
                "parent_id": str(parent_id),
                "owner_id": str(owner or self.bot_id),
                "name": name,
                "last_message_id": None,
                "message_count": 0,
                "member_count": 1,
                "rate_limit_per_user": 0,
                "flags": 0,
                "thread_metadata": {
                    "archived": False,
                    "auto_archive_duration": 1440,
                    "archive_timestamp": iso(time.time()),
                    "locked": False,
                },
            }
            self.channels[thread_id] = thread
            self.messages[thread_id] = []
        self._dispatch_all(
            "THREAD_CREATE", {**thread, "newly_created": True}, needs=GUILDS, guild=True
        )
        return thread_id

    def dm_channel(self, user_id: int) -> int:
        """The DM channel between the bot and `user_id` (made on first use)."""
        with self._lock:
            for channel_id, channel in self.channels.items():
                if channel["type"] == DM and channel["recipients"][0]["id"] == str(user_id):
                    return channel_id
        channel_id = self._snowflake()
        with self._lock:
            self.channels[channel_id] = {
                "id": str(channel_id),
                "type": DM,
                "last_message_id": None,
                "recipients": [self.users[user_id]],
                "flags": 0,
            }
            self.messages[channel_id] = []
        return channel_id

    def add_attachment(
        self, filename: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> Payload:
        """An attachment object (as in a message) whose file the fake serves."""
        attachment_id = self._snowflake()
        path = f"/attachments/{attachment_id}/{filename}"
        with self._lock:
            self._files[path] = (data, content_type)
        return {
            "id": str(attachment_id),
            "filename": filename,
            "size": len(data),
            "url": f"{self.url}{path}",
            "proxy_url": f"{self.url}{path}",
            "content_type": content_type,
        }

    # -- people writing ---------------------------------------------------------------

    def user_message(
        self,
        channel_id: int,
        author_id: int,
        content: str = "",
        *,
        mentions: Sequence[int] = (),
        mention_roles: Sequence[int] = (),
        reply_to: int | None = None,
        attachments: Sequence[Payload] = (),
        flags: int = 0,
        sticker: str | None = None,
        kind: int | None = None,
    ) -> Payload:
        """Someone writes in a channel: the message is stored (the HTTP API's history
        has it) and dispatched as MESSAGE_CREATE to every session whose intents take it.
        `mentions`: user ids it mentions (as a client sets them for `<@id>` in the text,
        and for the author of the message replied to). Returns the stored message."""
        message = self._make_message(
            channel_id,
            self.users[author_id],
            content,
            mentions=mentions,
            mention_roles=mention_roles,
            reply_to=reply_to,
            attachments=attachments,
            flags=flags,
            sticker=sticker,
            kind=kind,
        )
        self._store_and_dispatch(channel_id, message)
        return message

    def edit_user_message(self, channel_id: int, message_id: int, content: str) -> Payload:
        """Someone edits their message: MESSAGE_UPDATE with the whole message."""
        with self._lock:
            message = self._find(channel_id, message_id)
            if message is None:
                raise KeyError(message_id)
            message["content"] = content
            message["edited_timestamp"] = iso(time.time())
            updated = dict(message)
        self._dispatch_message("MESSAGE_UPDATE", channel_id, updated)
        return updated

    def _make_message(
        self,
        channel_id: int,
        author: Payload,
        content: str,
        *,
        mentions: Sequence[int] = (),
        mention_roles: Sequence[int] = (),
        reply_to: int | None = None,
        attachments: Sequence[Payload] = (),
        flags: int = 0,
        sticker: str | None = None,
        kind: int | None = None,
        nonce: str | None = None,
    ) -> Payload:
        message_id = self._snowflake()
        with self._lock:
            if channel_id not in self.channels:
                raise KeyError(f"no channel {channel_id}")
            message: Payload = {
                "id": str(message_id),
                "channel_id": str(channel_id),
                "author": author,
                "content": content,
                "timestamp": iso(snowflake_time(message_id)),
                "edited_timestamp": None,
                "tts": False,
                "mention_everyone": False,
                "mentions": [self.users[u] for u in mentions if u in self.users],
                "mention_roles": [str(r) for r in mention_roles],
                "attachments": list(attachments),
                "embeds": [],
                "pinned": False,
                "type": DEFAULT if kind is None else kind,
                "flags": flags,
                "components": [],
            }
            if nonce is not None:
                message["nonce"] = nonce
            if sticker is not None:
                message["sticker_items"] = [
                    {"id": str(self._snowflake()), "name": sticker, "format_type": 1}
                ]
            if reply_to is not None:
                referenced = self._find(channel_id, reply_to)
                message["type"] = REPLY if kind is None else kind
                message["message_reference"] = {
                    "type": 0,
                    "message_id": str(reply_to),
                    "channel_id": str(channel_id),
                    **self._guild_field(channel_id),
                }
                message["referenced_message"] = (
                    _without_reference(referenced) if referenced is not None else None
                )
        return message

    def _guild_field(self, channel_id: int) -> Payload:
        guild = self.channels[channel_id].get("guild_id")
        return {"guild_id": guild} if guild else {}

    def _find(self, channel_id: int, message_id: int) -> Payload | None:
        for message in self.messages.get(channel_id, ()):
            if int(message["id"]) == message_id:
                return message
        return None

    def _store_and_dispatch(self, channel_id: int, message: Payload) -> None:
        with self._lock:
            self.messages[channel_id].append(message)
            channel = self.channels[channel_id]
            channel["last_message_id"] = message["id"]
            if channel["type"] in THREAD_TYPES:
                channel["message_count"] += 1
        self._dispatch_message("MESSAGE_CREATE", channel_id, message)
        self._notify()

    # -- reading what happened --------------------------------------------------------

    def bot_messages(self, channel_id: int | None = None) -> list[Payload]:
        """Messages the bot made (oldest first), in one channel or all."""
        with self._lock:
            channels = [channel_id] if channel_id is not None else list(self.messages)
            found = [
                m
                for c in channels
                for m in self.messages.get(c, ())
                if m["author"]["id"] == str(self.bot_id)
            ]
        return sorted(found, key=lambda m: int(m["id"]))

    def wait_for_bot_messages(
        self, count: int, channel_id: int | None = None, timeout: float = 10.0
    ) -> list[Payload]:
        """Block until the bot made at least `count` messages (thread mode)."""
        return self._wait_blocking(
            at_least(count, lambda: self.bot_messages(channel_id)),
            timeout,
            async_method="wait_for_bot_messages_async",
            describe_timeout=lambda: (
                f"{len(self.bot_messages(channel_id))} of {count} bot messages after {timeout}s"
            ),
        )

    async def wait_for_bot_messages_async(
        self, count: int, channel_id: int | None = None
    ) -> list[Payload]:
        """Wait (any event loop) until the bot made at least `count` messages."""
        return await self._on_server_loop(
            self._until(at_least(count, lambda: self.bot_messages(channel_id)))
        )

    def identified_connections(self) -> list[Connection]:
        """Connections that identified or resumed, oldest first."""
        with self._lock:
            return [c for c in self.connections if c.identified or c.resumed]

    def open_connections(self) -> list[Connection]:
        with self._lock:
            return [c for c in self.connections if not c.closed and c.session is not None]

    async def wait_for_connections_async(self, count: int) -> list[Connection]:
        """Wait until `count` connections have identified or resumed in all."""
        return await self._on_server_loop(self._until(at_least(count, self.identified_connections)))

    def wait_for_connections(self, count: int, timeout: float = 20.0) -> list[Connection]:
        return self._wait_blocking(
            at_least(count, self.identified_connections),
            timeout,
            async_method="wait_for_connections_async",
            describe_timeout=lambda: (
                f"{len(self.identified_connections())} of {count} identified connections"
            ),
        )

    # -- scripting the Gateway --------------------------------------------------------

    def reconnect(self) -> None:
        """RECONNECT (op 7) on every open connection; the server closes them a moment
        later (with 4000, resumable), as Discord does."""
        for conn in self.open_connections():
            self._send_op(conn, OP_RECONNECT, None)
            self._close(conn, 4000, delay=0.2)

    def invalidate(self, *, resumable: bool) -> None:
        """INVALID_SESSION (op 9) on every open connection; with `resumable` False their
        sessions end (a RESUME of them is refused)."""
        for conn in self.open_connections():
            with self._lock:
                if not resumable and conn.session is not None:
                    conn.session.ended = True
            self._send_op(conn, OP_INVALID_SESSION, resumable)

    def drop_connections(self) -> None:
        """Cut every connection without a close frame; the sessions stay resumable."""
        for conn in self.open_connections():
            with self._lock:
                conn.cut = True
            self._wake(conn)

    def end_sessions(self) -> None:
        """Every session ends: a RESUME of any of them is refused from now on."""
        with self._lock:
            for session in self.sessions.values():
                session.ended = True

    # -- scripting the HTTP API -------------------------------------------------------

    def fail_next(
        self,
        route: str,
        status: int = 429,
        *,
        retry_after: float = 1.0,
        is_global: bool = False,
        cut_after: bool = False,
        times: int = 1,
    ) -> None:
        """The next `times` requests to `route` ("POST /channels/{channel_id}/messages")
        fail: 429 (per route, or the global limit), a 5xx, or with `cut_after` the
        request is carried out and the connection cut before the answer."""
        with self._lock:
            queue = self._scripted.setdefault(route, deque())
            for _ in range(times):
                queue.append(Scripted(status, retry_after, is_global, cut_after))

    # -- the Gateway ------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=REQUEST_SIZE_LIMIT + 1024 * 1024)
        app.router.add_get("/", self._gateway)
        app.router.add_get("/resume", self._gateway)
        app.router.add_get("/attachments/{id}/{name}", self._attachment)
        app.router.add_route("*", "/api/v{version}/{tail:.*}", self._api)
        return app

    async def _gateway(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(autoping=True, max_msg_size=0)
        await ws.prepare(request)
        query = request.query
        conn = Connection(
            number=next(self._numbers),
            path=request.path,
            compress=query.get("compress") == "zlib-stream",
            opened_at=time.time(),
            ws=ws,
            transport=request.transport,
        )
        conn.last_heartbeat = time.monotonic()
        with self._lock:
            self.connections.append(conn)
        self._notify()
        writer = asyncio.create_task(self._writer(conn))
        watchdog = asyncio.create_task(self._watchdog(conn))
        try:
            if query.get("v") != str(API_VERSION):
                self._close(conn, 4012)
            elif query.get("encoding", "json") != "json":
                self._close(conn, 4002)
            elif query.get("compress") not in (None, "zlib-stream"):
                self._close(conn, 4000)
            else:
                self._send_op(conn, OP_HELLO, {"heartbeat_interval": self.heartbeat_interval_ms})
                await self._reader(conn, ws)
        finally:
            watchdog.cancel()
            with self._lock:
                conn.closed = True  # the writer sends what is queued, then stops
            self._wake(conn)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(writer, 2.0)
            writer.cancel()
            self._connection_ended(conn)
        return ws

    async def _reader(self, conn: Connection, ws: web.WebSocketResponse) -> None:
        sent: deque[float] = deque()
        async for frame in ws:
            if frame.type is not aiohttp.WSMsgType.TEXT and frame.type is not (
                aiohttp.WSMsgType.BINARY
            ):
                break
            now = time.monotonic()
            sent.append(now)
            while sent and sent[0] < now - GATEWAY_SEND_LIMIT[1]:
                sent.popleft()
            if len(sent) > GATEWAY_SEND_LIMIT[0]:
                self._close(conn, 4008)
                return
            data = frame.data
            raw = data if isinstance(data, str) else data.decode("utf-8", "replace")
            if len(raw.encode("utf-8")) > MAX_PAYLOAD_BYTES:
                self._close(conn, 4002)
                return
            try:
                payload = json.loads(raw)
                op = payload["op"]
            except (ValueError, TypeError, KeyError):
                self._close(conn, 4002)
                return
            with self._lock:
                conn.received.append(payload)
            self._notify()
            if not self._handle_op(conn, op, payload.get("d")):
                return
        with self._lock:
            if not conn.closed_by:
                code = ws.close_code
                conn.closed_by = f"client {code}"
                if code in (1000, 1001) and conn.session is not None:
                    conn.session.ended = True  # gateway.mdx: closing with 1000/1001 ends it

    def _handle_op(self, conn: Connection, op: int, data: Any) -> bool:
        """One payload from the client; False once the connection is being closed."""
        if op == OP_HEARTBEAT:
            with self._lock:
                conn.last_heartbeat = time.monotonic()
                conn.heartbeats += 1
            if self.ack_heartbeats:
                self._send_op(conn, OP_HEARTBEAT_ACK, None)
            return True
        if op == OP_IDENTIFY:
            return self._identify(conn, data)
        if op == OP_RESUME:
            return self._resume(conn, data)
        if conn.session is None:
            self._close(conn, 4003)
            return False
        if op in (OP_PRESENCE, OP_VOICE_STATE, OP_REQUEST_MEMBERS):
            return True
        self._close(conn, 4001)
        return False

    def _identify(self, conn: Connection, data: Any) -> bool:
        if conn.session is not None:
            self._close(conn, 4005)
            return False
        if not isinstance(data, dict) or data.get("token") != self.token:
            self._close(conn, 4004)
            return False
        intents = data.get("intents")
        if not isinstance(intents, int) or intents & ~_ALL_INTENTS or intents < 0:
            self._close(conn, 4013)
            return False
        for intent, flag in PRIVILEGED.items():
            enabled = self.application_flags & (flag | flag >> 1)
            if intents & intent and not enabled:
                self._close(conn, 4014)
                return False
        session = Session(secrets.token_hex(16), intents)
        with self._lock:
            self.sessions[session.session_id] = session
            session.connection = conn
            conn.session = session
            conn.identified = True
            guild_ids = list(self.guilds)
        ready = {
            "v": API_VERSION,
            "user": {**self.bot, "verified": True, "mfa_enabled": False, "flags": 0},
            "guilds": [{"id": str(g), "unavailable": True} for g in guild_ids],
            "session_id": session.session_id,
            "resume_gateway_url": self.resume_gateway_url,
            "application": {"id": str(self.application_id), "flags": self.application_flags},
            "private_channels": [],
            "relationships": [],
        }
        self._dispatch(session, "READY", ready)
        if intents & GUILDS:
            for guild_id in guild_ids:
                self._dispatch(session, "GUILD_CREATE", self._guild_create(guild_id))
        self._notify()
        return True

    def _resume(self, conn: Connection, data: Any) -> bool:
        if conn.session is not None:
            self._close(conn, 4005)
            return False
        if not isinstance(data, dict) or data.get("token") != self.token:
            self._close(conn, 4004)
            return False
        now = time.monotonic()
        with self._lock:
            session = self.sessions.get(str(data.get("session_id")))
            resumable = session is not None and session.resumable(now)
            seq = data.get("seq")
        if session is None or not resumable:
            self._send_op(conn, OP_INVALID_SESSION, False)
            return True
        if not isinstance(seq, int) or seq > session.seq:
            self._close(conn, 4007)
            return False
        with self._lock:
            old = session.connection
            if old is not None and not old.closed:
                old.close_code, old.closed_by = 4000, "server 4000 (resumed elsewhere)"
            session.connection = conn
            session.expires_at = None
            conn.session = session
            conn.resumed = True
            missed = [frame for number, frame in session.events if number > seq]
            if session.events and seq < session.events[0][0] - 1:
                missed = []  # beyond what is kept: Discord would refuse too
                session.ended = True
            conn.outbox.extend(missed)
        if session.ended:
            self._send_op(conn, OP_INVALID_SESSION, False)
            return True
        self._wake(conn)
        self._dispatch(session, "RESUMED", {})
        self._notify()
        return True

    def _connection_ended(self, conn: Connection) -> None:
        with self._lock:
            conn.closed = True
            session = conn.session
            if session is not None and session.connection is conn:
                session.connection = None
                session.expires_at = time.monotonic() + self.resume_window
        self._notify()

    async def _writer(self, conn: Connection) -> None:
        """Send the connection's outbox in order; close or cut it when asked."""
        ws = conn.ws
        assert ws is not None
        deflater = zlib.compressobj() if conn.compress else None
        while True:
            await conn.wake.wait()
            conn.wake.clear()
            while True:
                with self._lock:
                    frame = conn.outbox.popleft() if conn.outbox else None
                    cut, close_code = conn.cut, conn.close_code
                if frame is None:
                    break
                if cut:
                    break
                try:
                    if deflater is not None:
                        data = deflater.compress(frame.encode()) + deflater.flush(zlib.Z_SYNC_FLUSH)
                        await ws.send_bytes(data)
                    else:
                        await ws.send_str(frame)
                except (ConnectionError, RuntimeError):
                    return
            if cut:
                with self._lock:
                    conn.closed_by = "cut"
                if conn.transport is not None:
                    conn.transport.abort()
                return
            if close_code is not None:
                with self._lock:
                    conn.closed_by = conn.closed_by or f"server {close_code}"
                with contextlib.suppress(Exception):
                    await ws.close(code=close_code)
                return
            if conn.closed:
                return

    async def _watchdog(self, conn: Connection) -> None:
        """Close a connection whose client stopped heartbeating (resumable)."""
        limit = self.heartbeat_interval_ms / 1000 * 1.5
        while True:
            await asyncio.sleep(min(limit / 4, 1.0))
            with self._lock:
                silent = time.monotonic() - conn.last_heartbeat
            if silent > limit:
                self._close(conn, 4000)
                return

    def _wake(self, conn: Connection) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(conn.wake.set)

    def _close(self, conn: Connection, code: int, *, delay: float = 0.0) -> None:
        def close() -> None:
            with self._lock:
                if conn.close_code is None:
                    conn.close_code = code
            self._wake(conn)

        if delay and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._loop.call_later(delay, close))  # type: ignore[union-attr]
        else:
            close()

    def _send_op(self, conn: Connection, op: int, data: Any) -> None:
        frame = json.dumps({"op": op, "d": data, "s": None, "t": None})
        with self._lock:
            conn.outbox.append(frame)
            conn.sent_ops.append((op, None))
        self._wake(conn)

    def _dispatch(self, session: Session, event: str, data: Payload) -> None:
        """One event to a session: numbered, kept for a RESUME, sent if connected."""
        with self._lock:
            session.seq += 1
            frame = json.dumps({"op": OP_DISPATCH, "d": data, "s": session.seq, "t": event})
            session.events.append((session.seq, frame))
            conn = session.connection
            if conn is not None and not conn.closed:
                conn.outbox.append(frame)
                conn.sent_ops.append((OP_DISPATCH, event))
        if conn is not None:
            self._wake(conn)

    def _live_sessions(self) -> list[Session]:
        now = time.monotonic()
        with self._lock:
            return [s for s in self.sessions.values() if s.resumable(now)]

    def _dispatch_all(self, event: str, data: Payload, *, needs: int, guild: bool) -> None:
        for session in self._live_sessions():
            if session.intents & needs:
                self._dispatch(session, event, data)

    def _dispatch_message(self, event: str, channel_id: int, message: Payload) -> None:
        channel = self.channels[channel_id]
        guild_id = channel.get("guild_id")
        needs = GUILD_MESSAGES if guild_id else DIRECT_MESSAGES
        author_id = int(message["author"]["id"])
        mentioned = any(int(u["id"]) == self.bot_id for u in message.get("mentions", ()))
        for session in self._live_sessions():
            if not session.intents & needs:
                continue
            data = dict(message)
            if guild_id:
                data["guild_id"] = guild_id
                members = self.guilds[int(guild_id)]["members"]
                data["member"] = {
                    "roles": members.get(author_id, []),
                    "joined_at": self.guilds[int(guild_id)]["joined_at"],
                    "deaf": False,
                    "mute": False,
                    "flags": 0,
                }
            private = not guild_id or mentioned or author_id == self.bot_id
            if not session.intents & MESSAGE_CONTENT and not private:
                data.update(content="", attachments=[], embeds=[], components=[])
            self._dispatch(session, event, data)

    def _guild_create(self, guild_id: int) -> Payload:
        with self._lock:
            guild = self.guilds[guild_id]
            channels = [
                dict(c)
                for c in self.channels.values()
                if c.get("guild_id") == str(guild_id) and c["type"] not in THREAD_TYPES
            ]
            threads = [
                dict(c)
                for c in self.channels.values()
                if c.get("guild_id") == str(guild_id) and c["type"] in THREAD_TYPES
            ]
            members = [
                {
                    "user": self.users[user_id],
                    "roles": roles,
                    "joined_at": guild["joined_at"],
                    "deaf": False,
                    "mute": False,
                    "flags": 0,
                }
                for user_id, roles in guild["members"].items()
                if user_id == self.bot_id
            ]
            return {
                "id": guild["id"],
                "name": guild["name"],
                "owner_id": guild["owner_id"],
                "roles": guild["roles"],
                "emojis": [],
                "stickers": [],
                "features": [],
                "joined_at": guild["joined_at"],
                "large": False,
                "unavailable": False,
                "member_count": len(guild["members"]),
                "members": members,
                "channels": channels,
                "threads": threads,
                "voice_states": [],
                "presences": [],
                "stage_instances": [],
                "guild_scheduled_events": [],
                "soundboard_sounds": [],
            }

    # -- the HTTP API -----------------------------------------------------------------

    async def _attachment(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            found = self._files.get(request.path)
        if found is None:
            return web.Response(status=404, text="Not Found")
        data, mime = found
        return web.Response(body=data, headers={"Content-Type": mime})

    _ROUTES: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
        (method, re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>\\d+)", path) + "$"), path)
        for method, path in (
            ("GET", "/users/@me"),
            ("GET", "/oauth2/applications/@me"),
            ("GET", "/applications/@me"),
            ("GET", "/gateway"),
            ("GET", "/gateway/bot"),
            ("POST", "/users/@me/channels"),
            ("GET", "/channels/{channel_id}"),
            ("GET", "/channels/{channel_id}/messages"),
            ("POST", "/channels/{channel_id}/messages"),
            ("GET", "/channels/{channel_id}/messages/{message_id}"),
            ("PATCH", "/channels/{channel_id}/messages/{message_id}"),
            ("POST", "/channels/{channel_id}/typing"),
        )
    )

    async def _api(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        started = time.time()
        if request.match_info["version"] != str(API_VERSION):
            return self._error_response(request, path, DiscordError(404, 0, "404: Not Found"))
        for method, pattern, template in self._ROUTES:
            found = pattern.match(path)
            if found is not None and request.method == method:
                route = f"{method} {template}"
                break
        else:
            return self._error_response(request, path, DiscordError(404, 0, "404: Not Found"))
        params = {k: int(v) for k, v in found.groupdict().items()}
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return self._error_response(
                request, path, DiscordError(401, 0, "401: Unauthorized"), route
            )
        bucket = self._bucket(route, params)
        limited = self._rate_limit(route, bucket)
        if limited is not None:
            return limited(request, path)
        with self._lock:
            queue = self._scripted.get(route)
            script = queue.popleft() if queue else None
        if script is not None and script.status == 429 and not script.cut_after:
            return self._too_many(request, path, route, script.retry_after, script.is_global)
        body, files = await self._read_body(request)
        if script is not None and not script.cut_after:
            failure = DiscordError(script.status, 0, f"{script.status}: Server Error")
            return self._error_response(request, path, failure, route)
        try:
            status, answer = self._handle(route, params, request.query, body, files)
        except DiscordError as exc:
            return self._error_response(request, path, exc, route, body)
        self._log_call(Call(route, path, status, started, body, files))
        if script is not None and script.cut_after and request.transport is not None:
            request.transport.abort()  # carried out, and no answer ever comes
            return web.Response(status=500)
        headers = self._limit_headers(bucket)
        if status == 204:
            return web.Response(status=204, headers=headers)
        return _json_response(answer, status=status, headers=headers)

    async def _read_body(
        self, request: web.Request
    ) -> tuple[Payload | None, tuple[tuple[str, bytes], ...]]:
        if not request.can_read_body:
            return None, ()
        if request.content_type == "multipart/form-data":
            body: Payload = {}
            files: list[tuple[str, bytes]] = []
            reader = await request.multipart()
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, aiohttp.BodyPartReader):
                    continue
                if part.name == "payload_json":
                    body.update(json.loads(await part.text()))
                elif part.name and part.name.startswith("files["):
                    files.append((part.filename or "file", bytes(await part.read())))
                elif part.name:
                    body[part.name] = await part.text()
            return body, tuple(files)
        raw = await request.read()
        if not raw:
            return None, ()
        try:
            data = json.loads(raw)
        except ValueError:
            raise web.HTTPBadRequest(text='{"message": "400: Bad Request", "code": 0}') from None
        return (data if isinstance(data, dict) else None), ()

    def _handle(
        self,
        route: str,
        params: Mapping[str, int],
        query: Mapping[str, str],
        body: Payload | None,
        files: tuple[tuple[str, bytes], ...],
    ) -> tuple[int, Any]:
        if route == "GET /users/@me":
            return 200, {**self.bot, "verified": True, "mfa_enabled": False, "flags": 0}
        if route in ("GET /oauth2/applications/@me", "GET /applications/@me"):
            return 200, self._application()
        if route == "GET /gateway":
            return 200, {"url": self.gateway_url.rstrip("/")}
        if route == "GET /gateway/bot":
            return 200, {
                "url": self.gateway_url.rstrip("/"),
                "shards": 1,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": 999,
                    "reset_after": 14400000,
                    "max_concurrency": 1,
                },
            }
        if route == "POST /users/@me/channels":
            recipient = int((body or {}).get("recipient_id") or 0)
            if recipient not in self.users:
                raise _form_error("recipient_id", "NUMBER_TYPE_COERCE", "Unknown user")
            return 200, self.channels[self.dm_channel(recipient)]
        channel = self._channel(params["channel_id"])
        channel_id = int(channel["id"])
        if route == "GET /channels/{channel_id}":
            return 200, channel
        if route == "GET /channels/{channel_id}/messages":
            return 200, self._history(channel_id, query)
        if route == "GET /channels/{channel_id}/messages/{message_id}":
            with self._lock:
                found = self._find(channel_id, params["message_id"])
            if found is None:
                raise DiscordError(404, 10008, "Unknown Message")
            return 200, found
        if route == "POST /channels/{channel_id}/typing":
            return 204, None
        if route == "POST /channels/{channel_id}/messages":
            return 200, self._create_message(channel_id, body or {}, files)
        if route == "PATCH /channels/{channel_id}/messages/{message_id}":
            return 200, self._edit_message(channel_id, params["message_id"], body or {})
        raise DiscordError(404, 0, "404: Not Found")

    def _application(self) -> Payload:
        return {
            "id": str(self.application_id),
            "name": self.bot["username"],
            "icon": None,
            "description": "",
            "bot_public": True,
            "bot_require_code_grant": False,
            "owner": self._user_payload(self.application_id + 1, "owner"),
            "team": None,
            "verify_key": "0" * 64,
            "flags": self.application_flags,
            "summary": "",
            "rpc_origins": [],
            "interactions_endpoint_url": None,
            "bot": self.bot,
        }

    def _channel(self, channel_id: int) -> Payload:
        with self._lock:
            channel = self.channels.get(channel_id)
            if channel is None:
                raise DiscordError(404, 10003, "Unknown Channel")
            return dict(channel)

    def _history(self, channel_id: int, query: Mapping[str, str]) -> list[Payload]:
        try:
            limit = int(query.get("limit", "50"))
        except ValueError:
            raise _form_error("limit", "NUMBER_TYPE_COERCE", "Value is not int.") from None
        if not 1 <= limit <= 100:
            raise _form_error(
                "limit", "NUMBER_TYPE_MAX", "Int value should be less than or equal to 100."
            )
        given = [k for k in ("before", "after", "around") if k in query]
        if len(given) > 1:
            raise _form_error("around", "BASE_TYPE_BAD_COMBO", "Only one of before, after, around")
        with self._lock:
            messages = list(self.messages.get(channel_id, ()))
        if "after" in query:
            after = int(query["after"])
            page = [m for m in messages if int(m["id"]) > after][:limit]
        elif "before" in query:
            before = int(query["before"])
            page = [m for m in messages if int(m["id"]) < before][-limit:]
        elif "around" in query:
            around = int(query["around"])
            older = [m for m in messages if int(m["id"]) < around]
            newer = [m for m in messages if int(m["id"]) >= around]
            page = (older[-(limit // 2) :] if limit > 1 else []) + newer[: limit - limit // 2]
        else:
            page = messages[-limit:]
        return [dict(m) for m in reversed(page)]

    def _mentions(self, channel: Payload, content: str, allowed: Any) -> Payload:
        """Who a message pings (resources/message.mdx, "Allowed Mentions Object")."""
        users = [int(u) for u in _MENTION.findall(content)]
        roles = [int(r) for r in _ROLE_MENTION.findall(content)]
        everyone = "@everyone" in content or "@here" in content
        if allowed is None:
            parse = {"users", "roles", "everyone"}
            allowed_users: set[int] = set()
            allowed_roles: set[int] = set()
        elif isinstance(allowed, dict):
            parse = set(allowed.get("parse") or ())
            both = [kind for kind in ("users", "roles") if kind in allowed and kind in parse]
            if both:
                raise _form_error(
                    "allowed_mentions",
                    "MESSAGE_ALLOWED_MENTIONS_PARSE_EXCLUSIVE",
                    'parse:["users"] and users: [ids...] are mutually exclusive.',
                )
            allowed_users = {int(u) for u in allowed.get("users") or ()}
            allowed_roles = {int(r) for r in allowed.get("roles") or ()}
        else:
            raise _form_error("allowed_mentions", "MODEL_TYPE_CONVERT", "Must be an object.")
        pinged_users = [u for u in users if "users" in parse or u in allowed_users]
        pinged_roles = [r for r in roles if "roles" in parse or r in allowed_roles]
        return {
            "users": pinged_users,
            "roles": pinged_roles if channel.get("guild_id") else [],
            "everyone": everyone and "everyone" in parse and bool(channel.get("guild_id")),
            "replied_user": (
                bool(allowed.get("replied_user")) if isinstance(allowed, dict) else True
            ),
        }

    def _create_message(
        self, channel_id: int, body: Payload, files: tuple[tuple[str, bytes], ...]
    ) -> Payload:
        channel = self.channels[channel_id]
        content = body.get("content") or ""
        if not isinstance(content, str):
            raise _form_error("content", "BASE_TYPE_STRING", "Must be a string.")
        if len(content) > MESSAGE_LIMIT:
            raise _form_error("content", "BASE_TYPE_MAX_LENGTH", "Must be 2000 or fewer in length.")
        if (
            not content.strip()
            and not files
            and not body.get("embeds")
            and not body.get("sticker_ids")
        ):
            raise DiscordError(400, 50006, "Cannot send an empty message")
        for _name, data in files:
            if len(data) > self.file_size_limit:
                raise DiscordError(413, 40005, "Request entity too large")
        nonce = body.get("nonce")
        if nonce is not None and len(str(nonce)) > NONCE_LIMIT:
            raise _form_error("nonce", "BASE_TYPE_MAX_LENGTH", "Must be 25 or fewer in length.")
        now = time.monotonic()
        if nonce is not None and body.get("enforce_nonce"):
            with self._lock:
                earlier = self._nonces.get((channel_id, str(nonce)))
            if earlier is not None and now - earlier[0] < self.nonce_window:
                with self._lock:
                    self.nonce_repeats += 1
                return earlier[1]
        reply_to: int | None = None
        reference = body.get("message_reference")
        if isinstance(reference, dict) and reference.get("message_id"):
            wanted = int(reference["message_id"])
            with self._lock:
                exists = self._find(channel_id, wanted) is not None
            if exists:
                reply_to = wanted
            elif reference.get("fail_if_not_exists", True):
                raise _form_error("message_reference", "REPLIES_UNKNOWN_MESSAGE", "Unknown message")
        pings = self._mentions(channel, content, body.get("allowed_mentions"))
        attachments = [self.add_attachment(name, data, _guess_mime(name)) for name, data in files]
        described = body.get("attachments") or []
        for attachment, meta in zip(attachments, described, strict=False):
            if isinstance(meta, dict) and meta.get("description"):
                attachment["description"] = meta["description"]
        message = self._make_message(
            channel_id,
            self.bot,
            content,
            reply_to=reply_to,
            attachments=attachments,
            nonce=str(nonce) if nonce is not None else None,
        )
        if reply_to is not None and pings["replied_user"]:
            replied = self._find(channel_id, reply_to)
            if replied is not None:
                pings["users"] = [*pings["users"], int(replied["author"]["id"])]
        message["mentions"] = [self.users[u] for u in pings["users"] if u in self.users]
        message["mention_roles"] = [str(r) for r in pings["roles"]]
        message["mention_everyone"] = pings["everyone"]
        with self._lock:
            self.pings[int(message["id"])] = {
                **pings,
                "allowed_mentions": body.get("allowed_mentions"),
            }
            if nonce is not None:
                self._nonces[(channel_id, str(nonce))] = (now, message)
        self._store_and_dispatch(channel_id, message)
        return message

    def _edit_message(self, channel_id: int, message_id: int, body: Payload) -> Payload:
        channel = self.channels[channel_id]
        with self._lock:
            message = self._find(channel_id, message_id)
        if message is None:
            raise DiscordError(404, 10008, "Unknown Message")
        if message["author"]["id"] != str(self.bot_id):
            raise DiscordError(403, 50005, "Cannot edit a message authored by another user")
        content = body.get("content")
        if content is not None:
            if len(content) > MESSAGE_LIMIT:
                raise _form_error(
                    "content", "BASE_TYPE_MAX_LENGTH", "Must be 2000 or fewer in length."
                )
            pings = self._mentions(channel, content, body.get("allowed_mentions"))
            with self._lock:
                message["content"] = content
                message["edited_timestamp"] = iso(time.time())
                message["mentions"] = [self.users[u] for u in pings["users"] if u in self.users]
                message["mention_roles"] = [str(r) for r in pings["roles"]]
                message["mention_everyone"] = pings["everyone"]
                self.pings[message_id] = {**pings, "allowed_mentions": body.get("allowed_mentions")}
        updated = dict(message)
        self._dispatch_message("MESSAGE_UPDATE", channel_id, updated)
        self._notify()
        return updated

    # -- rate limits ------------------------------------------------------------------

    def _bucket(self, route: str, params: Mapping[str, int]) -> str | None:
        """The per-route limit a request counts against (its top-level resource is part
        of it), or None for routes without one here."""
        if route in (
            "POST /channels/{channel_id}/messages",
            "PATCH /channels/{channel_id}/messages/{message_id}",
        ):
            return f"{route.split()[0]}:messages:{params['channel_id']}"
        return None

    def _rate_limit(
        self, route: str, bucket: str | None
    ) -> Callable[[web.Request, str], web.StreamResponse] | None:
        now = time.monotonic()
        with self._lock:
            start, used = self._global_window
            if now - start >= 1.0:
                start, used = now, 0
            if used >= self.global_limit:
                wait = 1.0 - (now - start)
                return lambda request, path: self._too_many(request, path, route, wait, True)
            self._global_window = (start, used + 1)
            if bucket is None:
                return None
            start, used = self._windows.get(bucket, (now, 0))
            if now - start >= self.message_window:
                start, used = now, 0
            if used >= self.message_limit:
                wait = self.message_window - (now - start)
                headers = self._limit_headers(bucket)
                return lambda request, path: self._too_many(
                    request, path, route, wait, False, headers
                )
            self._windows[bucket] = (start, used + 1)
        return None

    def _limit_headers(self, bucket: str | None) -> dict[str, str]:
        if bucket is None:
            return {}
        now = time.monotonic()
        with self._lock:
            start, used = self._windows.get(bucket, (now, 0))
        reset_after = max(0.0, self.message_window - (now - start))
        return {
            "X-RateLimit-Limit": str(self.message_limit),
            "X-RateLimit-Remaining": str(max(0, self.message_limit - used)),
            "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
            "X-RateLimit-Reset-After": f"{reset_after:.3f}",
            "X-RateLimit-Bucket": hashlib.sha1(bucket.split(":")[0].encode()).hexdigest()[:16],
        }

    def _too_many(
        self,
        request: web.Request,
        path: str,
        route: str,
        retry_after: float,
        is_global: bool,
        headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        retry_after = round(max(retry_after, 0.001), 3)
        answer = dict(headers or {})
        answer.update(
            {
                "Retry-After": str(max(1, int(retry_after + 0.999))),
                "X-RateLimit-Scope": "global" if is_global else "user",
                "Via": "1.1 google",
            }
        )
        if is_global:
            answer["X-RateLimit-Global"] = "true"
        body = {
            "message": "You are being rate limited.",
            "retry_after": retry_after,
            "global": is_global,
        }
        record = {"retry_after": retry_after, "global": is_global}
        call = Call(route, path, 429, time.time(), record)
        with self._lock:
            self.rate_limited.append(call)
        self._log_call(call)
        return _json_response(body, status=429, headers=answer)

    def _error_response(
        self,
        request: web.Request,
        path: str,
        error: DiscordError,
        route: str = "",
        body: Payload | None = None,
    ) -> web.StreamResponse:
        route = route or f"{request.method} {path}"
        self._log_call(Call(route, path, error.status, time.time(), body))
        return _json_response(error.body(), status=error.status)

    # -- helpers for tests ------------------------------------------------------------

    def calls_to_route(self, route: str) -> list[Call]:
        return [c for c in self.calls if c.method == route]


def _json_response(
    body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """JSON as Discord sends it: ``Content-Type: application/json`` exactly, with no
    charset (discord.py parses a body as JSON only then)."""
    return web.Response(
        body=json.dumps(body).encode(),
        status=status,
        headers={**(headers or {}), "Content-Type": "application/json"},
    )


def _without_reference(message: Payload) -> Payload:
    """A referenced message as Discord nests it (no further `referenced_message`)."""
    return {k: v for k, v in message.items() if k != "referenced_message"}


def _guess_mime(name: str) -> str:
    lowered = name.lower()
    for ending, mime in (
        (".png", "image/png"),
        (".jpg", "image/jpeg"),
        (".jpeg", "image/jpeg"),
        (".gif", "image/gif"),
        (".ogg", "audio/ogg"),
        (".mp3", "audio/mpeg"),
        (".txt", "text/plain; charset=utf-8"),
        (".pdf", "application/pdf"),
    ):
        if lowered.endswith(ending):
            return mime
    return "application/octet-stream"


def zlib_stream_decoder() -> Callable[[bytes], str | None]:
    """For tests: a zlib-stream reader as the docs describe it (events/gateway.mdx,
    "Transport Compression Example"); None until a message ends in the suffix."""
    buffer = bytearray()
    inflator = zlib.decompressobj()

    def feed(data: bytes) -> str | None:
        buffer.extend(data)
        if len(data) < 4 or data[-4:] != ZLIB_SUFFIX:
            return None
        text = inflator.decompress(bytes(buffer)).decode("utf-8")
        buffer.clear()
        return text

    return feed


__all__ = [
    "DEFAULT_TOKEN",
    "DIRECT_MESSAGES",
    "GUILDS",
    "GUILD_MESSAGES",
    "IS_VOICE_MESSAGE",
    "MESSAGE_CONTENT",
    "Call",
    "Connection",
    "FakeDiscord",
    "snowflake_time",
    "zlib_stream_decoder",
]
