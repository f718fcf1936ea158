"""The Mattermost channel: the WebSocket event stream for posts in, the REST API v4 for
replies out, both over the gateway's own aiohttp, inside the daemon's event loop.

Why no client library: the channel needs a dozen REST calls and one WebSocket, and it
must tell a request that never went out from one that may have (to send a reply again, or
not), set `pending_post_id` on every post, and own the WebSocket's reconnects (each one
is followed by a read-back). mattermostdriver (last release January 2022) makes blocking
`requests` calls and runs its own reconnect loop that swallows failures;
mattermostautodriver (maintained, generated from the OpenAPI file) brings httpx and
websockets and the same kind of loop, for 400 endpoints of which the channel uses ten.
aiohttp is already the gateway's, and nothing a library holds in memory can ever be
confirmed to Mattermost (Mattermost confirms nothing: there is nothing to acknowledge).

Session keys and where replies go: see `channels.mattermost.translate`.

Mattermost keeps nothing for an absent bot: the WebSocket sends what happens while it is
open, no more. The delivery promise of docs/delivery.md is kept anyway, by these rules
(tested in tests/test_mattermost*.py and the conformance kit):
- Journal, then move on: every post is submitted (journaled by the dispatcher, deduped by
  its post id) one at a time, in the order it arrived, and only then is its channel's
  read position (`channels.mattermost.positions`) moved past it. A post that was not
  taken (the journal failed, a lookup it needs failed) stops its channel: nothing after
  it is submitted until a read-back from the position brings it again, retried with
  backoff.
- Read back on every connection: after each WebSocket `hello` (a start, a reconnect) the
  bot's channels are listed (`GET /users/{bot}/teams/{team}/channels`, direct and group
  messages included), and every channel whose `last_post_at` is past its position is
  read back through the REST API, oldest first, before any newer live post of it is
  taken: channels with a position saved in the last `backfill_max_age_seconds`, and
  channels without one that had posts since the watermark (the last moment, less a
  margin, at which everything had been read: a DM from someone new, written while the
  gateway was down, is found so). At most `backfill_max_messages` posts per channel and
  `backfill_max_channels` channels, nothing older than the age bound. Read-back posts go
  through the dispatcher like live ones: a stale one gets the offline notice, not an
  answer.
- The positions are saved at most once per `Pacing.cursor_interval` and when the
  channel stops, in the storage mode's cursor store (with replicas: under the leader
  role "mattermost websocket", which one replica holds, with the WebSocket). A position
  saved late only means reading back posts the journal's dedupe drops. A channel's first
  position (just before its first post) is saved before that post is submitted.
- Edits are taken live only (`post_edited`): an edit is a message of its own, naming the
  post it changes.
- A reply is never posted twice: each post carries a `pending_post_id` made from the
  message it answers, its place in the reply and its text, and Mattermost hands back the
  post it already made for a `pending_post_id` it saw in the last 30 seconds. A request
  that got no answer is repeated within 25 seconds of the first attempt, never after.
- A reply is not given up while Mattermost is unreachable, answers 5xx or rate limits
  (429, its `Retry-After` waited out) for less than `Pacing.retry_window`: then `send`
  raises `DeliveryFailed` and the dispatcher sends it again later, from the post that
  failed (the posts that went out are not sent again).
- Nothing the model writes can notify anyone: every `@` that starts a mention is
  defused (`channels.mattermost.format`); a reply in a channel starts with its sender's
  mention, the only one the bot makes.

Replies are Mattermost Markdown in posts of at most `max_post_chars` characters (16,383
by default); with `streaming` the first one is posted early and edited as the text grows.
"typing..." shows while a turn runs. Files people attach become attachments (fetched with
the bot's token when the turn starts); a reply's files are uploaded and posted after its
text, one post per file.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from loguru import logger

from channels.mattermost.api import (
    Endpoints,
    MattermostApi,
    MattermostError,
    NoAnswer,
    Unreachable,
)
from channels.mattermost.format import mattermost_posts, mention_line, mentions_user
from channels.mattermost.positions import Position, Positions
from channels.mattermost.settings import MattermostSettings
from channels.mattermost.translate import (
    CHANNEL,
    DIRECT,
    Sender,
    Skip,
    target_of,
    translate_post,
)
from channels.typing_indicators import TypingIndicators
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_REPLY_CONTEXT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)

ENV_TOKEN = "GATEWAY_CHANNELS__MATTERMOST__TOKEN"
#: Posts read per request of a read-back (the API's maximum).
PAGE = 200
#: How long Mattermost remembers a `pending_post_id` (`pendingPostIDsCacheTTL`).
PENDING_POST_TTL = 30.0
_SEEN_POSTS = 10_000
_CACHED = 10_000
#: A channel silent this long (seconds) has its position dropped.
FORGET_AFTER = 90 * 86400.0

_T = TypeVar("_T")


class MattermostSetupError(Exception):
    """The bot cannot start (or `gateway doctor` cannot reach it); says what to fix.
    Never carries the token."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to Mattermost (seconds)."""

    retry_window: float = 60.0  # a reply rides out an outage this long, then DeliveryFailed
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    #: A request that got no answer is repeated only this soon after its first attempt
    #: (Mattermost forgets a `pending_post_id` after 30 s).
    idempotent_for: float = 25.0
    rate_limit_wait: float = 60.0  # the longest a request waits out 429s in all
    request_timeout: float = 30.0
    typing_interval: float = 5.0  # Mattermost shows "typing" for about 5 s
    typing_grace: float = 0.3  # no indicator for replies faster than this
    turn_limit: float = 600.0  # the longest a turn is shown as typing (or streaming)
    stream_interval: float = 1.0  # at most one streaming edit per this
    cursor_interval: float = 1.0  # positions are saved at most this often
    watermark_margin: float = 300.0  # posts still on their way; clocks apart
    retry_max: float = 60.0  # the longest wait before reading a stopped channel again
    reconnect_max: float = 30.0  # the longest wait between WebSocket connections
    hello_timeout: float = 30.0  # a connection that says no hello by then is dropped
    heartbeat: float = 30.0  # WebSocket pings; no pong within half of it: reconnect
    stop_timeout: float = 10.0


@dataclass
class Stats:
    """What the channel counts (`gateway_mattermost_*` on /metrics)."""

    backfilled: int = 0  # posts read back through the REST API
    connections: int = 0  # WebSocket connections that said hello
    edits: int = 0  # edits taken


# --------------------------------------------------------------------------- intake items


@dataclass(frozen=True, slots=True)
class _Live:
    post: dict[str, Any]
    channel_type: str | None = None
    edited: bool = False


@dataclass(frozen=True, slots=True)
class _Sync:
    """A connection said hello: read back what was missed."""


@dataclass(frozen=True, slots=True)
class _Retry:
    channels: frozenset[str]


_Item = _Live | _Sync | _Retry


@dataclass(frozen=True, slots=True)
class Place:
    """What the bot knows of a channel: its type and team, and its newest post."""

    type: str
    team_id: str = ""
    last_post_at: int = 0


@dataclass
class _Stream:
    """A reply shown while it is written: one post, edited as text arrives."""

    reply_to: str | None
    channel_id: str
    root_id: str
    mention: str
    next_edit: float
    text: str = ""
    shown: str = ""
    post_id: str | None = None
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


def pending_post_id(bot_id: str, reply_to: str | None, part: str, text: str) -> str:
    """The `pending_post_id` of one post of a reply: the same for the same text in the
    same place of the reply to the same message (so Mattermost recognizes a repeat),
    different otherwise; random for a reply to nothing."""
    if not reply_to:
        return f"{bot_id}:{secrets.token_hex(12)}"
    digest = hashlib.blake2b(f"{reply_to}\0{part}\0{text}".encode(), digest_size=12)
    return f"{bot_id}:{digest.hexdigest()}"


def certainly_not_sent(exc: BaseException) -> bool:
    """A failure after which the request certainly did not take effect, and may later:
    no connection, a server error, a rate limit not waited out."""
    if isinstance(exc, Unreachable):
        return True
    return isinstance(exc, MattermostError) and (exc.status >= 500 or exc.status == 429)


class MattermostChannel:
    """The Mattermost adapter; see the module docstring for what it promises."""

    name = CHANNEL

    def __init__(
        self,
        settings: MattermostSettings,
        *,
        token: str,
        lead: Lead,
        replicas: bool = False,
        pacing: Pacing | None = None,
    ) -> None:
        if not token:
            raise ConfigError(
                f"channels.mattermost.token: set {ENV_TOKEN} (System Console > Integrations > "
                "Bot Accounts > Create Token) or channels.mattermost.token_file"
            )
        if not settings.url:
            raise ConfigError(
                "channels.mattermost.url: set it to your Mattermost server's address, "
                "e.g. https://chat.example.com"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        #: Runs the WebSocket and the read positions: at once (one process), or once this
        #: replica holds the "mattermost websocket" role.
        self.lead = lead
        #: Several replicas share the bot: each sends replies; one holds the WebSocket.
        self.replicas = replicas
        self.endpoints = Endpoints(settings.url)
        self.stats = Stats()
        self._token = token
        self._api: MattermostApi | None = None
        self._store: CursorStore | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._inbox: MemoryObjectSendStream[_Item] | None = None
        self._paused = False
        self._connected = False
        self._syncing = False
        self._bot_id = ""
        self._bot_username = ""
        self._positions = Positions()
        self._dirty = False
        self._places: dict[str, Place] = {}
        self._senders: OrderedDict[str, Sender] = OrderedDict()
        self._roots: OrderedDict[str, str] = OrderedDict()  # root post id -> its author
        self._blocked: dict[str, float] = {}  # channel -> when to read it again
        self._backoff: dict[str, float] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._edits_seen: OrderedDict[str, None] = OrderedDict()
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_SEEN_POSTS)
        self._typing = TypingIndicators[tuple[str, str]](self._send_typing)
        self._streams: dict[str, _Stream] = {}
        self.live = anyio.Event()  # set once connected and read back (tests, probes)

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Log in (the REST API), then hold the WebSocket until cancelled (in the shared
        mode once this replica holds it). Raises MattermostSetupError when the token is
        refused (the daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        timeout = aiohttp.ClientTimeout(total=self.pacing.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            api = MattermostApi(self.endpoints, self._token, session)
            failure: Exception | None = None
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        me = await log_in(api)
                        self._bot_id, self._bot_username = str(me["id"]), str(me["username"])
                        self._api = api
                        logger.info(
                            "mattermost: logged in as @{} ({})", self._bot_username, self._bot_id
                        )
                        if self.replicas:
                            task_status.started()
                            await self.lead(self._hold)
                        else:
                            started = task_status.started
                            await self.lead(lambda store: self._hold(store, started))
                    except Exception as exc:
                        failure = exc
                    finally:
                        tg.cancel_scope.cancel()  # typing indicators, streaming edits
            finally:
                self._api = None
                self._tg = None
                self.live = anyio.Event()
        while isinstance(failure, ExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        if failure is not None:
            raise failure

    def pause_intake(self) -> None:
        """Take no more posts (the daemon is draining): what arrives is left unread, its
        channel's position stays before it, and the next start reads it back. Replies
        still go out until the channel stops."""
        self._paused = True

    async def _hold(self, store: CursorStore, on_live: Callable[[], None] | None = None) -> None:
        """The WebSocket and the intake behind it, with the positions in `store`, until
        cancelled. `on_live` is called once the first connection is up and read back."""
        self._store = store
        await self._load_positions()
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._inbox = send
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._intake, receive)
                tg.start_soon(self._keep_positions)
                if on_live is not None:
                    tg.start_soon(self._report_live, on_live)
                await self._connect_forever()
        finally:
            self._inbox = None
            self._connected = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.pacing.stop_timeout):
                await self._save_positions()
            self._store = None

    async def _report_live(self, on_live: Callable[[], None]) -> None:
        await self.live.wait()
        on_live()

    async def _connect_forever(self) -> None:
        """Hold a WebSocket connection, opening a new one (after a pause that doubles
        up to `reconnect_max`) whenever it ends; a refused token ends the channel."""
        delay = 0.5
        while True:
            began = time.monotonic()
            said_hello = False
            try:
                said_hello = await self._one_connection()
                logger.warning("mattermost: the WebSocket connection ended; reconnecting")
            except MattermostSetupError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                logger.warning(
                    "mattermost: WebSocket at {} failed ({}: {}); reconnecting",
                    self.endpoints.websocket,
                    type(exc).__name__,
                    exc,
                )
            finally:
                self._connected = False
            if not said_hello:
                # The server closes a connection whose token it refuses without a word:
                # ask the REST API whether the token still works (a refused one ends the
                # channel with what to fix; the daemon restarts it with backoff).
                await self._token_still_works()
            if time.monotonic() - began > 60:
                delay = 0.5  # it was up a while: this is a new outage
            await anyio.sleep(delay)
            delay = min(delay * 2, self.pacing.reconnect_max)

    async def _token_still_works(self) -> None:
        """Raise MattermostSetupError when the REST API refuses the token (401); any
        other outcome (it works, the server is unreachable) leaves the reconnects going."""
        try:
            with anyio.move_on_after(self.pacing.request_timeout):
                await self._require_api().me()
        except MattermostError as exc:
            if exc.status == 401:
                raise MattermostSetupError(_token_refused(self.endpoints.url)) from None
        except (Unreachable, NoAnswer):
            pass

    async def _one_connection(self) -> bool:
        """One WebSocket connection: authenticated by the documented challenge, then its
        events queued for the intake, until it closes; whether it said hello."""
        api = self._require_api()
        async with api.session.ws_connect(
            self.endpoints.websocket,
            heartbeat=self.pacing.heartbeat,
            timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
        ) as ws:
            await ws.send_json(
                {"seq": 1, "action": "authentication_challenge", "data": {"token": self._token}}
            )
            hello = False
            deadline = time.monotonic() + self.pacing.hello_timeout
            while True:
                wait = None if hello else max(0.1, deadline - time.monotonic())
                try:
                    frame = await ws.receive(timeout=wait)
                except TimeoutError:
                    raise TimeoutError("no hello from the WebSocket") from None
                if frame.type in (
                    aiohttp.WSMsgType.CLOSE,
                    aiohttp.WSMsgType.CLOSED,
                    aiohttp.WSMsgType.ERROR,
                ):
                    return hello
                if frame.type is not aiohttp.WSMsgType.TEXT:
                    continue
                event = json.loads(frame.data)
                if not isinstance(event, dict):
                    continue
                if event.get("seq_reply") == 1 and event.get("status") != "OK":
                    raise MattermostSetupError(_token_refused(self.endpoints.url))
                kind = event.get("event")
                if kind == "hello":
                    hello = True
                    self._connected = True
                    self.stats.connections += 1
                    self._queue(_Sync())
                elif hello and kind in ("posted", "post_edited"):
                    self._on_post_event(kind, event.get("data") or {})

    def _on_post_event(self, kind: str, data: dict[str, Any]) -> None:
        raw = data.get("post")
        try:
            post = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            logger.warning("mattermost: a {} event with an unreadable post", kind)
            return
        if not isinstance(post, dict) or not post.get("id"):
            return
        channel_type = data.get("channel_type")
        if kind == "posted":
            self._queue(_Live(post, str(channel_type) if channel_type else None))
        elif int(post.get("edit_at") or 0) > 0:  # not a reaction, a pin, an unfurl
            self._queue(_Live(post, None, edited=True))

    def _queue(self, item: _Item) -> None:
        if self._inbox is not None:
            self._inbox.send_nowait(item)

    # ----------------------------------------------------------------- intake

    async def _intake(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        """Take what the WebSocket delivered, one post at a time, in order; a read-back
        runs in that order too, so it stays ahead of the newer live posts."""
        async with receive:
            async for item in receive:
                if self._paused:
                    continue  # left unread: the next start reads it back
                try:
                    if isinstance(item, _Sync):
                        await self._sync()
                    elif isinstance(item, _Retry):
                        await self._backfill(only=item.channels)
                    else:
                        await self._take(item.post, item.channel_type, edited=item.edited)
                except Exception:
                    logger.exception("mattermost: taking in posts failed")
                    if isinstance(item, _Live) and not item.edited:
                        self._block(str(item.post.get("channel_id") or ""), item.post)
                    elif isinstance(item, _Sync):
                        self._sync_later()

    async def _sync(self) -> None:
        self._syncing = True
        try:
            await self._backfill()
        except (Unreachable, NoAnswer, MattermostError) as exc:
            logger.warning(
                "mattermost: the read-back after a connection failed ({}); retrying", exc
            )
            self._sync_later()
            return
        finally:
            self._syncing = False
        if not self.live.is_set():
            logger.info("mattermost: connected to the WebSocket")
        self.live.set()

    def _sync_later(self) -> None:
        """Read every channel back again soon (the listing itself failed)."""
        self._blocked["*"] = time.monotonic() + self.pacing.retry_backoff_max

    def _first_sighting(self, post_id: str) -> bool:
        if post_id in self._seen:
            return False
        self._seen[post_id] = None
        if len(self._seen) > _SEEN_POSTS:
            self._seen.popitem(last=False)
        return True

    async def _take(
        self, post: dict[str, Any], channel_type: str | None, *, edited: bool = False
    ) -> bool:
        """Translate and submit one post; move its channel's position past it once it is
        settled. False when it was not taken: its channel stops until a read-back brings
        it again."""
        channel = str(post.get("channel_id") or "")
        post_id = str(post.get("id") or "")
        if not channel or not post_id:
            return True
        if channel in self._blocked:
            return False  # read back, in order, when the channel is retried
        if edited:
            edit_key = f"{post_id}:{post.get('edit_at')}"
            if edit_key in self._edits_seen:
                return True
        elif post_id in self._seen:
            return True  # settled already (read back, then delivered live too)
        result: InboundMessage | Skip
        if post.get("user_id") == self._bot_id:
            result = Skip("the bot's own post")
        else:
            try:
                result = await self._translate(post, channel_type, edited=edited)
            except (Unreachable, NoAnswer, MattermostError) as exc:
                logger.warning("mattermost: post {} not looked up ({}); retrying", post_id, exc)
                if not edited:
                    self._block(channel, post)
                return False
        if isinstance(result, Skip):
            logger.debug("mattermost: post {} skipped: {}", post_id, result.reason)
        elif self._submit is not None:
            with logger.contextualize(session=result.session_key):
                if not edited and not await self._known(channel, post):
                    return False
                ticket = await self._submit(result)
                if not ticket.taken:
                    logger.warning(
                        "mattermost: post {} not taken; its channel waits and is read back "
                        "from there",
                        post_id,
                    )
                    if not edited:
                        self._block(channel, post)
                    return False
            if edited:
                self.stats.edits += 1
            where = target_of(result.chat_id, result.thread_id)
            self._spawn(self._typing_while_pending, ticket, where)
        if edited:
            self._edits_seen[f"{post_id}:{post.get('edit_at')}"] = None
            if len(self._edits_seen) > _SEEN_POSTS:
                self._edits_seen.popitem(last=False)
        else:
            self._first_sighting(post_id)
            self._settled(channel, post)
        return True

    async def _translate(
        self, post: dict[str, Any], channel_type: str | None, *, edited: bool
    ) -> InboundMessage | Skip:
        """`translate_post` with what it needs looked up (cached): the channel's type, the
        sender, and in a group the author of a thread's root post."""
        place = await self._place_of(str(post["channel_id"]), channel_type)
        if place is None:
            return Skip("a channel the bot cannot see")
        sender = await self._sender_of(str(post.get("user_id") or ""))
        root_id = str(post.get("root_id") or "")
        root_author = None
        message = str(post.get("message") or "")
        if root_id and place.type != DIRECT and not mentions_user(message, self._bot_username):
            root_author = await self._root_author(root_id)
        return translate_post(
            post,
            place.type,
            bot_id=self._bot_id,
            bot_username=self._bot_username,
            sender=sender,
            root_author=root_author,
            edited=edited,
            team_id=place.team_id,
        )

    async def _place_of(self, channel_id: str, channel_type: str | None) -> Place | None:
        known = self._places.get(channel_id)
        if known is not None:
            return known
        if channel_type:
            place = Place(channel_type)
        else:
            try:
                info = await self._require_api().channel(channel_id)
            except MattermostError as exc:
                if exc.status in (403, 404):
                    return None
                raise
            place = Place(str(info.get("type") or "O"), str(info.get("team_id") or ""))
        self._places[channel_id] = place
        return place

    async def _sender_of(self, user_id: str) -> Sender:
        known = self._senders.get(user_id)
        if known is not None:
            return known
        try:
            sender = Sender.from_user(await self._require_api().user(user_id))
        except MattermostError as exc:
            if exc.status not in (403, 404):
                raise
            sender = Sender(user_id)
        self._senders[user_id] = sender
        if len(self._senders) > _CACHED:
            self._senders.popitem(last=False)
        return sender

    async def _root_author(self, root_id: str) -> str | None:
        known = self._roots.get(root_id)
        if known is not None:
            return known
        try:
            author = str((await self._require_api().post(root_id)).get("user_id") or "")
        except MattermostError as exc:
            if exc.status not in (403, 404):
                raise
            return None
        self._remember_root(root_id, author)
        return author

    def _remember_root(self, root_id: str, author: str) -> None:
        self._roots[root_id] = author
        if len(self._roots) > _CACHED:
            self._roots.popitem(last=False)

    # ----------------------------------------------------------------- positions

    async def _known(self, channel: str, post: dict[str, Any]) -> bool:
        """Before a channel's first post is submitted, its position (just before the
        post) is saved: a crash right after the journal must not leave the channel
        without one. False (the channel stops, retried) when it could not be saved."""
        if channel in self._positions.channels:
            return True
        self._positions.channels[channel] = Position.before(_create_at(post), time.time())
        self._dirty = True
        try:
            await self._save_positions()
        except Exception as exc:
            logger.warning("mattermost: a new channel's position not saved ({})", exc)
            self._block(channel, post)
            return False
        return True

    def _settled(self, channel: str, post: dict[str, Any]) -> None:
        position = self._positions.channels.get(channel)
        if position is None:
            position = self._positions.channels[channel] = Position.before(_create_at(post), 0.0)
        if position.settle(str(post["id"]), _create_at(post), time.time()):
            self._dirty = True

    def _block(self, channel: str, post: dict[str, Any]) -> None:
        """Stop a channel at a post that could not be settled; it is read back from its
        position (just before the post when it has none) after a backoff."""
        if not channel:
            return
        if channel not in self._positions.channels:
            self._positions.channels[channel] = Position.before(_create_at(post), time.time())
            self._dirty = True
        delay = min(self._backoff.get(channel, 0.5) * 2, self.pacing.retry_max)
        self._backoff[channel] = delay
        self._blocked[channel] = time.monotonic() + delay

    @property
    def cursor_name(self) -> str:
        """The name of this bot's read positions in the cursor store."""
        return f"{CHANNEL}:{self._bot_id}"

    async def _load_positions(self) -> None:
        """The positions as last saved (a damaged document is reported and the channel
        starts as on a first run); channels silent past `FORGET_AFTER` dropped."""
        assert self._store is not None
        self._positions = Positions()
        raw = await self._store.load(self.cursor_name)
        if raw is None:
            return
        try:
            positions = Positions.from_json(raw)
        except ValueError as exc:
            logger.error(
                "mattermost: the saved read positions are unreadable ({}); starting as on a "
                "first run",
                exc,
            )
            return
        horizon = time.time() - FORGET_AFTER
        positions.channels = {
            c: p for c, p in positions.channels.items() if p.updated >= horizon or p.updated == 0
        }
        self._positions = positions

    async def _keep_positions(self) -> None:
        """Save moved positions every `cursor_interval`; move the watermark while
        connected and caught up; queue a read-back of stopped channels when due."""
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
                mark = int((time.time() - self.pacing.watermark_margin) * 1000)
                if self._positions.watermark is None or mark > self._positions.watermark:
                    self._positions.watermark = mark
                    self._dirty = True
            now = time.monotonic()
            due = frozenset(c for c, at in self._blocked.items() if at <= now)
            if due and self._inbox is not None:
                for channel in due:
                    self._blocked[channel] = math.inf  # queued; not queued again
                if "*" in due:
                    self._blocked.pop("*", None)
                    self._inbox.send_nowait(_Sync())
                rest = due - {"*"}
                if rest:
                    self._inbox.send_nowait(_Retry(rest))
            try:
                await self._save_positions()
            except Exception as exc:  # kept in memory; tried again next round
                logger.warning("mattermost: read positions not saved ({}); retrying", exc)

    async def _save_positions(self) -> None:
        store = self._store
        if not self._dirty or store is None:
            return
        self._dirty = False
        try:
            await store.save(self.cursor_name, self._positions.to_json())
        except BaseException:
            self._dirty = True
            raise

    # ----------------------------------------------------------------- read-back

    async def _channels(self) -> dict[str, Place]:
        """The bot's channels in all its teams (direct and group messages included)."""
        api = self._require_api()
        found: dict[str, Place] = {}
        for team in await api.teams(self._bot_id):
            team_id = str(team.get("id") or "")
            for channel in await api.team_channels(self._bot_id, team_id):
                if channel.get("delete_at"):
                    continue
                kind = str(channel.get("type") or "O")
                found[str(channel["id"])] = Place(
                    kind,
                    str(channel.get("team_id") or ""),
                    int(channel.get("last_post_at") or 0),
                )
        return found

    async def _backfill(self, *, only: frozenset[str] | None = None) -> None:
        """Read back, oldest first, what each channel got after its position (see the
        module docstring for which channels, and how far back)."""
        horizon = int((time.time() - self.settings.backfill_max_age_seconds) * 1000)
        targets: dict[str, Position] = {}
        if only is not None:
            for channel in only:
                self._blocked.pop(channel, None)
                position = self._positions.channels.get(channel)
                if position is not None:
                    targets[channel] = position
        else:
            channels = await self._channels()
            for channel_id, place in channels.items():
                known = self._places.get(channel_id)
                self._places[channel_id] = Place(
                    place.type, place.team_id or (known.team_id if known else "")
                )
            candidates: list[tuple[int, str, Position]] = []
            for channel_id, place in channels.items():
                position = self._positions.channels.get(channel_id)
                if position is not None:
                    if place.last_post_at > position.last_at:
                        candidates.append((place.last_post_at, channel_id, position))
                elif self._positions.watermark is not None:
                    since = max(self._positions.watermark, horizon)
                    if place.last_post_at > since:
                        candidates.append((place.last_post_at, channel_id, Position(since - 1)))
            candidates.sort(reverse=True)
            if len(candidates) > self.settings.backfill_max_channels:
                logger.warning(
                    "mattermost: {} channels to read back; the {} least recently active are not",
                    len(candidates),
                    len(candidates) - self.settings.backfill_max_channels,
                )
            for _, channel_id, position in candidates[: self.settings.backfill_max_channels]:
                targets[channel_id] = position
        total = 0
        for channel_id, position in sorted(targets.items()):
            total += await self._backfill_one(channel_id, position, horizon)
        if total:
            logger.info(
                "mattermost: read back {} post(s) of {} channel(s) written while away",
                total,
                len(targets),
            )

    async def _backfill_one(self, channel: str, position: Position, horizon: int) -> int:
        """One channel read back from `position`; the number of posts read."""
        try:
            posts = await self._read_since(channel, position, horizon)
        except MattermostError as exc:
            if exc.status in (403, 404):
                logger.warning(
                    "mattermost: cannot read channel {} ({}); it is not read back", channel, exc
                )
                self._positions.channels.pop(channel, None)
                self._dirty = True
                return 0
            self._retry_channel(channel, position, exc)
            return 0
        except (Unreachable, NoAnswer) as exc:
            self._retry_channel(channel, position, exc)
            return 0
        count = 0
        for post in posts:
            count += 1
            self.stats.backfilled += 1
            if not await self._take(post, None):
                return count  # stopped: read back from there later
        self._backoff.pop(channel, None)
        return count

    def _retry_channel(self, channel: str, position: Position, exc: Exception) -> None:
        logger.warning(
            "mattermost: reading back channel {} failed ({}: {}); retrying later",
            channel,
            type(exc).__name__,
            exc,
        )
        self._positions.channels.setdefault(channel, position)
        delay = min(self._backoff.get(channel, 0.5) * 2, self.pacing.retry_max)
        self._backoff[channel] = delay
        self._blocked[channel] = time.monotonic() + delay

    async def _read_since(
        self, channel: str, position: Position, horizon: int
    ) -> list[dict[str, Any]]:
        """The posts of `channel` still to take from `position`, oldest first, at most
        `backfill_max_messages`, none older than `horizon` (ms)."""
        api = self._require_api()
        limit = self.settings.backfill_max_messages
        found: list[dict[str, Any]] = []
        if position.anchor:
            page = 0
            while len(found) < limit:
                batch = await api.channel_posts(
                    channel, after=position.anchor, page=page, per_page=PAGE
                )
                found.extend(batch)
                if len(batch) < PAGE:
                    break
                page += 1
        if not position.anchor or not found:
            # No anchor (or it is gone): by time, the newest pages first, down to it.
            floor = max(position.last_at, horizon)
            pages: list[list[dict[str, Any]]] = []
            page = 0
            while sum(len(p) for p in pages) < limit + PAGE:
                batch = await api.channel_posts(channel, page=page, per_page=PAGE)
                pages.append(batch)
                if len(batch) < PAGE or (batch and _create_at(batch[0]) < floor):
                    break
                page += 1
            unique: dict[str, dict[str, Any]] = {}
            for batch in reversed(pages):  # oldest page first
                for post in batch:
                    unique.setdefault(str(post.get("id")), post)
            found = sorted(unique.values(), key=_create_at)
        wanted = [
            post
            for post in found
            if _create_at(post) >= horizon
            and position.is_new(str(post.get("id")), _create_at(post))
        ]
        if len(wanted) > limit:
            logger.warning(
                "mattermost: channel {} had more than {} posts while the bot was away; the "
                "later ones are not answered",
                channel,
                limit,
            )
            wanted = wanted[:limit]
        return wanted

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    def _require_api(self) -> MattermostApi:
        api = self._api
        if api is None:
            raise MattermostSetupError("mattermost: the channel is not running")
        return api

    # ----------------------------------------------------------------- typing

    async def _typing_while_pending(self, ticket: Ticket, where: tuple[str, str]) -> None:
        """Show "typing" in the channel (or thread) until the ticket's reply is ready."""
        await self._typing.while_pending(
            ticket,
            where,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_interval,
            limit=self.pacing.turn_limit,
        )

    async def _send_typing(self, where: tuple[str, str]) -> None:
        api = self._api
        if api is None:
            return
        try:
            await api.typing(self._bot_id, where[0], where[1])
        except (Unreachable, NoAnswer, MattermostError) as exc:
            logger.debug("mattermost: typing indicator failed: {}", exc)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Mattermost Markdown in posts of at most `max_post_chars`, the
        first naming the sender in a group, in order, then its files. Raises
        DeliveryFailed when a post certainly did not go out and may later (a reply sent
        again goes on from there); any other error when it never will or may have gone
        out. No post after a failed one is sent (it would read out of context)."""
        channel, root = target_of(message.chat_id, message.thread_id)
        context = message.metadata.get(META_REPLY_CONTEXT)
        mention = ""
        if isinstance(context, dict):
            mention = mention_line(str(context.get("mention") or ""))
        pieces = mattermost_posts(message.text, self.settings.max_post_chars, mention=mention)
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not pieces and not message.files:
                logger.warning("mattermost: empty reply not sent")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            first = 0
            shown = stream.post_id if stream is not None else None
            try:
                if (
                    pieces
                    and shown is not None
                    and done == 0
                    and await self._edit(shown, pieces[0])
                ):
                    first = done = 1
                for index in range(max(first, done), len(pieces)):
                    await self._post(
                        channel, root, pieces[index], message.reply_to, f"part {index}"
                    )
                    done = index + 1
                for number, file in enumerate(message.files, start=len(pieces)):
                    if number < done:
                        continue
                    await self._post_file(channel, root, file, message.reply_to, number)
                    done = number + 1
            except (Unreachable, MattermostError, MattermostSetupError) as exc:
                if not (isinstance(exc, MattermostSetupError) or certainly_not_sent(exc)):
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"mattermost: {exc}", sent=done) from exc

    async def _post(
        self, channel: str, root: str, text: str, reply_to: str | None, part: str
    ) -> dict[str, Any]:
        """Create one post (in thread `root` when given), at most once."""
        api = self._require_api()
        pending = pending_post_id(self._bot_id, reply_to, part, text)
        created: dict[str, Any] = await self._call(
            "create a post",
            channel,
            lambda: api.create_post(channel, text, root_id=root, pending_post_id=pending),
            idempotent_for=self.pacing.idempotent_for,
        )
        if not root and created.get("id"):
            self._remember_root(str(created["id"]), self._bot_id)
        return created

    async def _post_file(
        self, channel: str, root: str, file: OutboundFile, reply_to: str | None, index: int
    ) -> None:
        """One file of a reply, after its text, in a post of its own (with its caption),
        at most once. An upload is repeated freely: a file no post names is never shown."""
        api = self._require_api()
        file_id: str = await self._call(
            "upload a file",
            channel,
            lambda: api.upload(channel, file.name, file.data, file.mime_type),
            idempotent_for=math.inf,
        )
        caption = mattermost_posts(file.caption, self.settings.max_post_chars)
        text = caption[0] if caption else ""
        digest = hashlib.blake2b(file.data, digest_size=8).hexdigest()
        pending = pending_post_id(self._bot_id, reply_to, f"file {index} {digest}", text)
        await self._call(
            "post a file",
            channel,
            lambda: api.create_post(
                channel, text, root_id=root, pending_post_id=pending, file_ids=[file_id]
            ),
            idempotent_for=self.pacing.idempotent_for,
        )

    async def _edit(self, post_id: str, text: str) -> bool:
        """Replace a streamed post's text; False when it cannot be edited (the caller
        posts a new one instead)."""
        api = self._require_api()
        try:
            await self._call(
                "edit a post",
                post_id,
                lambda: api.patch_post(post_id, text),
                idempotent_for=math.inf,
            )
            return True
        except MattermostError as exc:
            if exc.status >= 500 or exc.status == 429:
                raise
            logger.warning("mattermost: streamed post {} not edited: {}", post_id, exc)
            return False

    async def _call(
        self, what: str, where: str, request: Callable[[], Awaitable[_T]], *, idempotent_for: float
    ) -> _T:
        """Make one REST request, repeating it while that is safe and may help: after a
        failure that certainly did not take effect (no connection, 5xx, a 429 waited
        out) for up to `retry_window`, and after no answer only within `idempotent_for`
        seconds of the first attempt."""
        started = time.monotonic()
        attempt = 0
        waited = 0.0
        while True:
            try:
                return await request()
            except MattermostError as exc:
                if exc.status == 429 and exc.retry_after is not None:
                    waited += exc.retry_after
                    if waited > self.pacing.rate_limit_wait:
                        raise
                    logger.warning(
                        "mattermost: {} in {} rate limited; again in {:g}s",
                        what,
                        where,
                        exc.retry_after,
                    )
                    await anyio.sleep(exc.retry_after)
                    continue
                if exc.status < 500:
                    raise
                failure: Exception = exc
            except Unreachable as exc:
                failure = exc
            except NoAnswer as exc:
                if time.monotonic() - started > idempotent_for:
                    logger.error(
                        "mattermost: {} in {} got no answer, too late to repeat safely (it may "
                        "have arrived; repeating could post it twice): {}",
                        what,
                        where,
                        exc,
                    )
                    raise
                failure = exc
            attempt += 1
            if time.monotonic() - started >= self.pacing.retry_window:
                raise failure
            delay = min(
                self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
            )
            logger.warning(
                "mattermost: {} in {} failed ({}); retry {} in {:g}s",
                what,
                where,
                failure,
                attempt,
                delay,
            )
            await anyio.sleep(delay)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone attached: `GET /files/{id}` with the bot's token, at most
        `max_bytes`."""
        if attachment.size is not None and attachment.size > max_bytes:
            raise MediaError(
                f"it is {attachment.size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        api = self._api
        if api is None:
            raise MediaError("the Mattermost channel is not running")
        return await download_capped(api.file_url(attachment.file_id), max_bytes, headers=api.auth)

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` is posted as the reply, edited at most once per
        interval; `send` with the whole reply then edits it a last time (and posts what
        does not fit). Does nothing unless `channels.mattermost.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            self._forget_stale_streams(now)
            channel, root = target_of(inbound.chat_id, inbound.thread_id)
            context = inbound.metadata.get(META_REPLY_CONTEXT)
            name = str(context.get("mention") or "") if isinstance(context, dict) else ""
            stream = _Stream(
                reply_to=inbound.message_id,
                channel_id=channel,
                root_id=root,
                mention=mention_line(name),
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
            pieces = mattermost_posts(
                stream.text, self.settings.max_post_chars, mention=stream.mention
            )
            if stream.closed or not pieces or pieces[0] == stream.shown:
                return
            api = self._require_api()
            if stream.post_id is None:
                pending = pending_post_id(self._bot_id, stream.reply_to, "preview", "")
                created = await api.create_post(
                    stream.channel_id, pieces[0], root_id=stream.root_id, pending_post_id=pending
                )
                stream.post_id = str(created["id"])
            else:
                await api.patch_post(stream.post_id, pieces[0])
            stream.shown = pieces[0]
        except (Unreachable, NoAnswer, MattermostError, MattermostSetupError) as exc:
            logger.debug("mattermost: streaming update skipped: {}", exc)
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


def _create_at(post: dict[str, Any]) -> int:
    return int(post.get("create_at") or 0)


def _token_refused(url: str) -> str:
    return (
        f"mattermost: {url} refused the bot's access token; create a new one (Integrations > "
        f"Bot Accounts > Create New Token) and set {ENV_TOKEN}, and check that System Console "
        "> Integrations > Integration Management > Enable Personal Access Tokens is on"
    )


async def log_in(api: MattermostApi) -> dict[str, Any]:
    """Who the token is (`GET /users/me`), what the channel and `gateway doctor` both do
    first. Raises MattermostSetupError saying what to fix, never carrying the token."""
    try:
        return await api.me()
    except MattermostError as exc:
        if exc.status == 401:
            raise MattermostSetupError(_token_refused(api.endpoints.url)) from None
        raise MattermostSetupError(
            f"mattermost: {api.endpoints.url} answered {exc}; check channels.mattermost.url"
        ) from None
    except (Unreachable, NoAnswer) as exc:
        raise MattermostSetupError(
            f"mattermost: cannot reach the REST API at {api.endpoints.api} ({exc}); check the "
            "network or channels.mattermost.url"
        ) from None


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True, slots=True)
class MattermostCheck:
    """What `gateway doctor` learned: who the token is (and whether it is a bot account),
    the teams the bot is in, the server's longest post, and whether the WebSocket
    answers with a hello (its problem, or "")."""

    identity: str
    is_bot: bool
    teams: tuple[str, ...]
    max_post_size: int | None
    websocket_problem: str


async def check_credentials(settings: MattermostSettings, token: str) -> MattermostCheck:
    """`gateway doctor`: the token (`GET /users/me`), the bot's teams, the server's
    MaxPostSize (`GET /config/client`), and a WebSocket connection authenticated until
    its hello. Raises MattermostSetupError saying what to fix."""
    if not token or not settings.url:
        raise MattermostSetupError(f"mattermost: set channels.mattermost.url and {ENV_TOKEN}")
    endpoints = Endpoints(settings.url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        api = MattermostApi(endpoints, token, session)
        me = await log_in(api)
        identity = f"@{me.get('username')} ({me.get('id')})"
        try:
            teams = tuple(str(t.get("name") or t.get("id")) for t in await api.teams(str(me["id"])))
        except (Unreachable, NoAnswer, MattermostError):
            teams = ()
        size: int | None = None
        try:
            raw = (await api.client_config()).get("MaxPostSize")
            size = int(raw) if raw not in (None, "") else None
        except (Unreachable, NoAnswer, MattermostError, ValueError, TypeError):
            size = None
        problem = await _websocket_problem(session, endpoints, token)
    return MattermostCheck(identity, bool(me.get("is_bot")), teams, size, problem)


async def _websocket_problem(
    session: aiohttp.ClientSession, endpoints: Endpoints, token: str
) -> str:
    """Open the WebSocket, authenticate, wait for its hello; "" when it came."""
    try:
        async with session.ws_connect(endpoints.websocket) as ws:
            await ws.send_json(
                {"seq": 1, "action": "authentication_challenge", "data": {"token": token}}
            )
            with anyio.fail_after(10):
                while True:
                    frame = await ws.receive()
                    if frame.type is not aiohttp.WSMsgType.TEXT:
                        return f"the WebSocket at {endpoints.websocket} closed before its hello"
                    event = json.loads(frame.data)
                    if event.get("seq_reply") == 1 and event.get("status") != "OK":
                        return "the WebSocket refused the token"
                    if event.get("event") == "hello":
                        await ws.close()
                        return ""
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        return f"cannot open the WebSocket at {endpoints.websocket} ({type(exc).__name__}: {exc})"
