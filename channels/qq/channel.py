"""The QQ channel: a QQ account through a OneBot v11 implementation (NapCat,
Lagrange.OneBot) over its forward WebSocket, on the gateway's own aiohttp, inside the
daemon's event loop.

Why no client library: aiocqhttp (NoneBot's, the usual Python OneBot v11 client) serves
HTTP and reverse WebSocket from its own Quart app and has no forward WebSocket client in
any release (nonebot/aiocqhttp#74 is an open pull request); nonebot-adapter-onebot runs
inside NoneBot2's driver, which owns the event loop and the connections' lifecycle. The
protocol is a small JSON one (an action with an echo, its answer, pushed events), and
the channel must own what a library would hide: when a connection is up (every new one
is followed by a read-back), and whether a reply that got no answer may have gone out
(then it is never sent again). Nothing is ever confirmed to OneBot: it has no
acknowledgement at all.

Connections: with the leader role "qq websocket" (one replica, or the only process)
the channel holds the universal connection (`/`), where events come; every process
opens an `/api` connection for its calls (replies, history, lookups).

Session keys and where replies go: see `channels.qq.translate`.

OneBot keeps nothing for a client that is away: an implementation pushes an event to
the connections open at that moment and drops it when there are none (NapCat's
`OB11WebSocketServerAdapter.isActive`). The delivery promise of docs/delivery.md is kept
anyway, by these rules (tested in tests/test_qq.py and the conformance kit):
- Journal, then move on: every message is submitted (journaled by the dispatcher,
  deduped by its message id within its conversation) one at a time, in the order it
  arrived, and only then is its conversation's read position (`channels.qq.positions`)
  moved past it. A message that was not taken stops its conversation: nothing after it
  is submitted until a read-back from the position brings it again, retried with backoff.
- Read back on every connection: after each connection to `/` (a start, a reconnect)
  the history of each conversation is read (`get_group_msg_history`,
  `get_friend_msg_history`: NapCat's and Lagrange.OneBot's, from go-cqhttp), newest
  page first, and what is not older than its position (less `positions.SLACK`) is
  submitted oldest first, before any newer live message: the conversations with a
  position (the most recently active first), then the bot's groups and friends
  (`get_group_list`, `get_friend_list`) from the watermark, so a friend's first message
  written while the gateway was down is found too. At most `backfill_max_messages` per
  conversation and `backfill_max_conversations` in all, nothing older than
  `backfill_max_age_seconds`. An implementation without history (retcode 1404) is
  reported once; then a message the journal did not take is held and submitted again in
  place, and what is written while no gateway is connected is lost (docs/qq.md says so).
- The positions are saved at most once per `Pacing.cursor_interval` and when the channel
  stops, in the storage mode's cursor store (with replicas: under the leader role). A
  conversation's first position (just before its first message) is saved before that
  message is submitted.
- A reply is never sent twice by the channel: OneBot has no idempotency key, so a send
  is repeated only when it certainly did not go out (no connection: `NotSent`), for up
  to `Pacing.retry_window`, then `send` raises `DeliveryFailed` and the dispatcher sends
  it again later, from the part that failed. A send that went out and got no answer, or
  that the implementation says timed out waiting for QQ, may have been delivered: it is
  logged and not sent again (`QQSendUncertain`). A send QQ refused (the bot muted in
  the group, QQ's risk control, a stranger it cannot write to) is logged by name and
  raises `DeliveryFailed`: the dispatcher tries again within its redelivery window.
- Nothing the model writes can notify anyone: text goes in text segments of the array
  format, never parsed for CQ codes; the only `at` the bot sends names the sender of
  the group message it answers (never `all`).

Replies are plain text (`channels.qq.format`) in messages of at most `max_message_chars`
characters; in a group the first one quotes the message it answers (a `reply` segment)
and @-mentions its sender. QQ cannot edit a sent message, so nothing is streamed, and
OneBot v11 has no typing indicator. Pictures people send become attachments (fetched
from QQ's download address when the turn starts); a reply's images go out as `image`
segments and other files as `file` segments, one message each, after its text.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from loguru import logger

from channels.qq import onebot
from channels.qq.format import qq_messages
from channels.qq.onebot import (
    BAD_REQUEST,
    NO_SUCH_ACTION,
    ActionFailed,
    NoAnswer,
    NotSent,
    OneBotSocket,
    Segment,
    TokenRefused,
    endpoint,
    open_socket,
    segments_of,
)
from channels.qq.positions import SLACK, Position, Positions
from channels.qq.settings import QQSettings
from channels.qq.translate import (
    CHANNEL,
    GROUP,
    Skip,
    conversation_of,
    mentions_self,
    quoted_id,
    target_of,
    translate_event,
)
from gateway.channel import DeliveryFailed, PartsSent, Submit
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

ENV_TOKEN = "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN"
#: Messages asked for per history request.
PAGE = 50
_SEEN = 10_000
#: A conversation silent this long (seconds) has its position dropped.
FORGET_AFTER = 90 * 86400.0
#: What NapCat and Lagrange.OneBot say when a history has no message to give.
_NOTHING_THERE = ("不存在", "no elements", "not found", "not exist")


class QQSetupError(Exception):
    """The channel cannot start (or `gateway doctor` cannot reach the implementation);
    says what to fix. Never carries the access token."""


class QQSendUncertain(Exception):
    """A part of a reply may have gone out (its request got no answer, or the
    implementation timed out waiting for QQ): it is not sent again."""


class QQRefused(Exception):
    """The implementation refused a reply for good (a bad request, an action it does not
    have): sending it again would not help."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to the implementation (seconds)."""

    retry_window: float = 20.0  # a reply waits this long for a connection, then DeliveryFailed
    retry_backoff: float = 0.25  # doubled per attempt
    retry_backoff_max: float = 4.0
    request_timeout: float = 30.0  # an API call's answer
    send_timeout: float = 90.0  # a send's answer (the implementation waits for QQ)
    lookup_timeout: float = 5.0  # who wrote a quoted message
    cursor_interval: float = 1.0  # positions are saved at most this often
    watermark_margin: float = 300.0  # messages still on their way; clocks apart
    retry_max: float = 60.0  # the longest wait before reading a stopped conversation again
    reconnect_max: float = 30.0  # the longest wait between connections
    heartbeat: float = 30.0  # WebSocket pings; no pong within half of it: reconnect
    stop_timeout: float = 10.0


@dataclass
class Stats:
    """What the channel counts (`gateway_qq_*` on /metrics)."""

    backfilled: int = 0  # messages read back through the history
    connections: int = 0  # event connections opened (the first, and every reconnect)
    refused: int = 0  # reply parts QQ refused


@dataclass(frozen=True, slots=True)
class _Live:
    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Sync:
    """A connection opened: read back what was missed."""


@dataclass(frozen=True, slots=True)
class _Retry:
    conversations: frozenset[str]


_Item = _Live | _Sync | _Retry


def sent_at(event: dict[str, Any]) -> int:
    """A message's time (Unix seconds; 0 when it has none)."""
    value = event.get("time")
    return int(value) if isinstance(value, int | float) else 0


def refusal_reason(exc: ActionFailed) -> str:
    """What a refused send most likely means, for the log line."""
    said = " ".join(exc.message.split())[:200] or f"retcode {exc.retcode}"
    return (
        f"QQ refused it ({said}): the bot may be muted in the group, "
        "held by QQ's risk control, or unable to write to this person"
    )


@dataclass
class _Cache:
    """A bounded map, oldest first out."""

    size: int = _SEEN
    items: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def get(self, key: str) -> str | None:
        return self.items.get(key)

    def put(self, key: str, value: str = "") -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self.items


class QQChannel:
    """The QQ adapter; see the module docstring for what it promises."""

    name = CHANNEL

    def __init__(
        self,
        settings: QQSettings,
        *,
        token: str | None,
        lead: Lead,
        replicas: bool = False,
        pacing: Pacing | None = None,
    ) -> None:
        try:
            self._event_url = endpoint(settings.url, "/")
            self._api_url = endpoint(settings.url, "/api")
        except ValueError as exc:
            raise ConfigError(
                f"channels.qq.url: {exc}; set it to the OneBot implementation's WebSocket "
                "server, e.g. ws://127.0.0.1:3001"
            ) from None
        self.settings = settings
        self.pacing = pacing or Pacing()
        #: Runs the event connection and the read positions: at once (one process), or
        #: once this replica holds the "qq websocket" role.
        self.lead = lead
        self.replicas = replicas
        self.stats = Stats()
        self.self_id = ""
        self._token = token
        self._session: aiohttp.ClientSession | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._api: OneBotSocket | None = None
        self._api_lock = anyio.Lock()
        self._store: CursorStore | None = None
        self._submit: Submit | None = None
        self._inbox: MemoryObjectSendStream[_Item] | None = None
        self._paused = False
        self._connected = False
        self._syncing = False
        self._history: bool | None = None  # None: not asked yet; False: the implementation has none
        self._positions = Positions()
        self._dirty = False
        self._blocked: dict[str, float] = {}  # conversation -> when to read it again
        self._backoff: dict[str, float] = {}
        self._seen = _Cache()
        self._authors = _Cache()  # "<conversation>/<message id>" -> who wrote it
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_SEEN)
        self.live = anyio.Event()  # set once connected and read back (tests, probes)

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Log in (`get_login_info` over `/api`), then hold the event connection until
        cancelled (in the shared mode once this replica holds it). Raises QQSetupError
        when the implementation cannot be reached or refuses the token (the daemon
        restarts the channel)."""
        self._submit = submit
        self._paused = False
        async with aiohttp.ClientSession() as session:
            self._session = session
            failure: BaseException | None = None
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        await self._log_in()
                        if self.replicas:
                            task_status.started()
                            await self.lead(self._hold)
                        else:
                            started = task_status.started
                            await self.lead(lambda store: self._hold(store, started))
                    except Exception as exc:
                        failure = exc
                    finally:
                        tg.cancel_scope.cancel()
            finally:
                self._session = None
                self._api = None
                self._tg = None
                self.live = anyio.Event()
        while isinstance(failure, ExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        if failure is not None:
            raise failure

    def pause_intake(self) -> None:
        """Take no more messages (the daemon is draining): what arrives is left unread,
        its conversation's position stays before it, and the next start reads it back.
        Replies still go out until the channel stops."""
        self._paused = True

    async def _log_in(self) -> None:
        """Who the account is (`get_login_info`). Raises QQSetupError saying what to fix."""
        try:
            me = await self._call("get_login_info", wait=self.pacing.request_timeout)
        except TokenRefused:
            raise QQSetupError(_token_refused(self.settings.url)) from None
        except (NotSent, NoAnswer) as exc:
            raise QQSetupError(
                f"qq: cannot reach the OneBot implementation at {self._api_url} ({exc}); start "
                "NapCat (or Lagrange.OneBot) with its WebSocket server on, or fix channels.qq.url"
            ) from None
        except ActionFailed as exc:
            raise QQSetupError(
                f"qq: get_login_info failed: {exc}; is the account logged in?"
            ) from None
        if not isinstance(me, dict) or not str(me.get("user_id") or "").isdigit():
            raise QQSetupError("qq: get_login_info gave no QQ number; is the account logged in?")
        self.self_id = str(me["user_id"])
        logger.info("qq: logged in as {} ({})", me.get("nickname") or "?", self.self_id)

    async def _hold(self, store: CursorStore, on_live: Callable[[], None] | None = None) -> None:
        """The event connection and the intake behind it, with the positions in `store`,
        until cancelled. `on_live` is called once the first connection is up and read back."""
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
        """Hold the event connection, opening a new one (after a pause that doubles up to
        `reconnect_max`) whenever it ends; a refused token ends the channel."""
        delay = 0.5
        while True:
            began = time.monotonic()
            try:
                await self._one_connection()
                logger.warning("qq: the event connection closed; reconnecting")
            except TokenRefused:
                raise QQSetupError(_token_refused(self.settings.url)) from None
            except (NotSent, aiohttp.ClientError, OSError, TimeoutError) as exc:
                logger.warning(
                    "qq: event connection to {} failed ({}); reconnecting", self._event_url, exc
                )
            finally:
                self._connected = False
            if time.monotonic() - began > 60:
                delay = 0.5  # it was up a while: this is a new outage
            await anyio.sleep(delay)
            delay = min(delay * 2, self.pacing.reconnect_max)

    async def _one_connection(self) -> None:
        """One connection to `/`: its events queued for the intake, a read-back first."""
        assert self._session is not None
        ws = await open_socket(
            self._session, self._event_url, self._token, heartbeat=self.pacing.heartbeat
        )
        socket = OneBotSocket(ws, on_event=self._on_event, name="qq-event")
        self._connected = True
        self.stats.connections += 1
        self._queue(_Sync())
        try:
            await socket.serve()
        finally:
            await socket.close()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("post_type") in ("message", "message_sent"):
            self._queue(_Live(event))

    def _queue(self, item: _Item) -> None:
        if self._inbox is not None:
            self._inbox.send_nowait(item)

    # ----------------------------------------------------------------- calls

    async def _api_socket(self) -> OneBotSocket:
        """The open `/api` connection, opened now when there is none."""
        socket = self._api
        if socket is not None and not socket.closed:
            return socket
        async with self._api_lock:
            socket = self._api
            if socket is not None and not socket.closed:
                return socket
            if self._session is None or self._tg is None:
                raise NotSent("the QQ channel is not running")
            ws = await open_socket(
                self._session, self._api_url, self._token, heartbeat=self.pacing.heartbeat
            )
            socket = OneBotSocket(ws, name="qq-api")
            self._api = socket
            self._tg.start_soon(self._serve_api, socket)
            return socket

    async def _serve_api(self, socket: OneBotSocket) -> None:
        try:
            await socket.serve()
        except TokenRefused:
            logger.error("{}", _token_refused(self.settings.url))
        except Exception as exc:  # the next call opens a new connection
            logger.debug("qq: the API connection ended: {!r}", exc)

    async def _call(self, action: str, params: dict[str, Any] | None = None, *, wait: float) -> Any:
        socket = await self._api_socket()
        return await socket.call(action, params, wait=wait)

    # ----------------------------------------------------------------- intake

    async def _intake(self, receive: MemoryObjectReceiveStream[_Item]) -> None:
        """Take what the connection delivered, one message at a time, in order; a
        read-back runs in that order too, so it stays ahead of the newer live messages."""
        async with receive:
            async for item in receive:
                if self._paused:
                    continue  # left unread: the next start reads it back
                try:
                    if isinstance(item, _Sync):
                        await self._sync()
                    elif isinstance(item, _Retry):
                        await self._read_back(only=item.conversations)
                    else:
                        await self._take(item.event)
                except Exception:
                    logger.exception("qq: taking in messages failed")
                    if isinstance(item, _Live):
                        conversation = conversation_of(item.event, self.self_id)
                        if conversation:
                            self._block(conversation, sent_at(item.event))
                    elif isinstance(item, _Sync):
                        self._sync_later()

    async def _sync(self) -> None:
        self._syncing = True
        try:
            if self.settings.read_back and self._history is None:
                await self._probe_history()
            if self.settings.read_back and self._history is not False:
                await self._read_back()
        except (NotSent, NoAnswer, ActionFailed, TokenRefused) as exc:
            logger.warning("qq: the read-back after a connection failed ({}); retrying", exc)
            self._sync_later()
            return
        finally:
            self._syncing = False
        if not self.live.is_set():
            logger.info("qq: connected to the OneBot implementation's event stream")
        self.live.set()

    def _sync_later(self) -> None:
        """Read every conversation back again soon (the listing itself failed)."""
        self._blocked["*"] = time.monotonic() + self.pacing.retry_backoff_max

    async def _take(self, event: dict[str, Any], conversation: str | None = None) -> bool:
        """Translate and submit one message; move its conversation's position past it
        once it is settled. False when it was not taken: its conversation stops until a
        read-back brings it again."""
        conversation = conversation or conversation_of(event, self.self_id)
        message_id = event.get("message_id")
        if conversation is None or message_id is None:
            return True
        key = f"{conversation}/{message_id}"
        if conversation in self._blocked:
            return False  # read back, in order, when the conversation is retried
        if key in self._seen:
            return True  # settled already (read back, then delivered live too)
        author = str(event.get("user_id") or "")
        if author:
            self._authors.put(key, author)
        when = sent_at(event)
        result = await self._translate(event, conversation)
        if isinstance(result, Skip):
            logger.debug("qq: message {} skipped: {}", key, result.reason)
        elif self._submit is not None:
            with logger.contextualize(session=result.session_key):
                if not await self._known(conversation, when):
                    return False
                ticket = await self._submit(result)
                if not ticket.taken and not await self._hold_until_taken(result):
                    logger.warning(
                        "qq: message {} not taken; its conversation waits and is read back "
                        "from there",
                        key,
                    )
                    self._block(conversation, when)
                    return False
        self._seen.put(key)
        self._settled(conversation, when)
        return True

    async def _hold_until_taken(self, message: InboundMessage) -> bool:
        """Without a history to read it back from, a message the journal did not take is
        submitted again in place, with backoff, while the intake waits; False when there
        is a history (the read-back brings it again) or the gateway is draining."""
        if self.settings.read_back and self._history is not False:
            return False
        delay = self.pacing.retry_backoff
        while not self._paused and self._submit is not None:
            await anyio.sleep(delay)
            delay = min(delay * 2, self.pacing.retry_max)
            if (await self._submit(message)).taken:
                return True
        return False

    async def _translate(self, event: dict[str, Any], conversation: str) -> InboundMessage | Skip:
        """`translate_event` with, in a group, the author of a quoted message looked up
        (when the bot is not @-mentioned already)."""
        author = None
        if event.get("message_type") == GROUP and str(event.get("user_id")) != self.self_id:
            segments = segments_of(event.get("message"))
            quoted = quoted_id(segments)
            if quoted and not mentions_self(segments, self.self_id):
                author = await self._author_of(conversation, quoted)
        return translate_event(event, self_id=self.self_id, quoted_author=author)

    async def _author_of(self, conversation: str, message_id: str) -> str | None:
        """Who wrote a message (known, or `get_msg`); None when it cannot be told."""
        key = f"{conversation}/{message_id}"
        known = self._authors.get(key)
        if known is not None:
            return known
        try:
            found = await self._call(
                "get_msg", {"message_id": _number(message_id)}, wait=self.pacing.lookup_timeout
            )
        except (NotSent, NoAnswer, ActionFailed, TokenRefused) as exc:
            logger.debug("qq: who wrote message {} is unknown ({})", key, exc)
            return None
        if not isinstance(found, dict):
            return None
        sender = found.get("sender") or {}
        author = str(found.get("user_id") or sender.get("user_id") or "")
        if author:
            self._authors.put(key, author)
        return author or None

    # ----------------------------------------------------------------- positions

    async def _known(self, conversation: str, when: int) -> bool:
        """Before a conversation's first message is submitted, its position (just before
        the message) is saved: a crash right after the journal must not leave the
        conversation without one. False (it stops, retried) when it could not be saved."""
        if conversation in self._positions.conversations:
            return True
        self._positions.conversations[conversation] = Position.before(when, time.time())
        self._dirty = True
        try:
            await self._save_positions()
        except Exception as exc:
            logger.warning("qq: a new conversation's position not saved ({})", exc)
            self._block(conversation, when)
            return False
        return True

    def _settled(self, conversation: str, when: int) -> None:
        position = self._positions.conversations.get(conversation)
        if position is None:
            position = self._positions.conversations[conversation] = Position.before(when, 0.0)
        if position.settle(when, time.time()):
            self._dirty = True

    def _block(self, conversation: str, when: int) -> None:
        """Stop a conversation at a message that could not be settled; it is read back
        from its position (just before the message when it has none) after a backoff."""
        if conversation not in self._positions.conversations:
            self._positions.conversations[conversation] = Position.before(when, time.time())
            self._dirty = True
        delay = min(self._backoff.get(conversation, 0.5) * 2, self.pacing.retry_max)
        self._backoff[conversation] = delay
        self._blocked[conversation] = time.monotonic() + delay

    @property
    def cursor_name(self) -> str:
        """The name of this account's read positions in the cursor store."""
        return f"{CHANNEL}:{self.self_id}"

    async def _load_positions(self) -> None:
        """The positions as last saved (a damaged document is reported and the channel
        starts as on a first run); conversations silent past `FORGET_AFTER` dropped."""
        assert self._store is not None
        self._positions = Positions()
        raw = await self._store.load(self.cursor_name)
        if raw is None:
            return
        try:
            positions = Positions.from_json(raw)
        except ValueError as exc:
            logger.error(
                "qq: the saved read positions are unreadable ({}); starting as on a first run",
                exc,
            )
            return
        horizon = time.time() - FORGET_AFTER
        positions.conversations = {
            c: p
            for c, p in positions.conversations.items()
            if p.updated >= horizon or p.updated == 0
        }
        self._positions = positions

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
                mark = int(time.time() - self.pacing.watermark_margin)
                if self._positions.watermark is None or mark > self._positions.watermark:
                    self._positions.watermark = mark
                    self._dirty = True
            now = time.monotonic()
            due = frozenset(c for c, at in self._blocked.items() if at <= now)
            if due and self._inbox is not None:
                for conversation in due:
                    self._blocked[conversation] = math.inf  # queued; not queued again
                if "*" in due:
                    self._blocked.pop("*", None)
                    self._inbox.send_nowait(_Sync())
                rest = due - {"*"}
                if rest:
                    self._inbox.send_nowait(_Retry(rest))
            try:
                await self._save_positions()
            except Exception as exc:  # kept in memory; tried again next round
                logger.warning("qq: read positions not saved ({}); retrying", exc)

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

    async def _read_back(self, *, only: frozenset[str] | None = None) -> None:
        """Read back, oldest first, what each conversation got since its position (see
        the module docstring for which conversations, and how far back)."""
        horizon = int(time.time() - self.settings.backfill_max_age_seconds)
        targets: dict[str, int] = {}
        if only is not None:
            for conversation in sorted(only):
                self._blocked.pop(conversation, None)
                position = self._positions.conversations.get(conversation)
                if position is not None:
                    targets[conversation] = max(position.read_from, horizon)
        else:
            known = sorted(self._positions.conversations.items(), key=lambda item: -item[1].updated)
            for conversation, position in known:
                targets[conversation] = max(position.read_from, horizon)
            if self._positions.watermark is not None:
                since = max(self._positions.watermark, horizon)
                for conversation in await self._listed():
                    targets.setdefault(conversation, since)
            limit = self.settings.backfill_max_conversations
            if len(targets) > limit:
                logger.warning(
                    "qq: {} conversations to read back; the last {} (least recently active) "
                    "are not",
                    len(targets),
                    len(targets) - limit,
                )
                targets = dict(list(targets.items())[:limit])
        total = 0
        for conversation, since in targets.items():
            if self._history is False:
                break
            total += await self._read_back_one(conversation, since)
        if total:
            logger.info("qq: read back {} message(s) written while away", total)

    async def _listed(self) -> list[str]:
        """The account's groups and friends, as conversations."""
        groups = await self._call("get_group_list", wait=self.pacing.request_timeout)
        friends = await self._call("get_friend_list", wait=self.pacing.request_timeout)
        found = [
            f"group:{g['group_id']}"
            for g in groups or ()
            if isinstance(g, dict) and g.get("group_id")
        ]
        found += [
            f"private:{f['user_id']}"
            for f in friends or ()
            if isinstance(f, dict) and f.get("user_id")
        ]
        return found

    async def _read_back_one(self, conversation: str, since: int) -> int:
        """One conversation read back from `since`; the number of messages read."""
        try:
            events = await self._history_of(conversation, since)
        except ActionFailed as exc:
            if exc.retcode == NO_SUCH_ACTION:
                self._no_history(exc)
                return 0
            self._retry_conversation(conversation, since, exc)
            return 0
        except (NotSent, NoAnswer, TokenRefused) as exc:
            self._retry_conversation(conversation, since, exc)
            return 0
        self._history = True
        count = 0
        for event in events:
            count += 1
            self.stats.backfilled += 1
            if not await self._take(event, conversation):
                return count  # stopped: read back from there later
        self._backoff.pop(conversation, None)
        return count

    async def _probe_history(self) -> None:
        """Whether the implementation has a message history: any answer to
        `get_friend_msg_history` but 1404 (asking for the account's own chat, which has
        none, is answered 1200 by one that has it)."""
        try:
            await self._call(
                "get_friend_msg_history",
                {"user_id": _number(self.self_id), "count": 1},
                wait=self.pacing.request_timeout,
            )
        except ActionFailed as exc:
            if exc.retcode == NO_SUCH_ACTION:
                self._no_history(exc)
                return
        self._history = True

    def _no_history(self, exc: ActionFailed) -> None:
        if self._history is not False:
            logger.error(
                "qq: the OneBot implementation has no message history ({}); messages written "
                "while the gateway is away are not read back (docs/qq.md, Delivery)",
                exc.action,
            )
        self._history = False

    def _retry_conversation(self, conversation: str, since: int, exc: Exception) -> None:
        logger.warning(
            "qq: reading back {} failed ({}: {}); retrying later",
            conversation,
            type(exc).__name__,
            exc,
        )
        self._positions.conversations.setdefault(conversation, Position(since + SLACK))
        delay = min(self._backoff.get(conversation, 0.5) * 2, self.pacing.retry_max)
        self._backoff[conversation] = delay
        self._blocked[conversation] = time.monotonic() + delay

    async def _history_of(self, conversation: str, since: int) -> list[dict[str, Any]]:
        """The messages of `conversation` from `since` (Unix seconds), oldest first, at most
        `backfill_max_messages`: pages of the history, newest first, until one reaches
        back past `since`."""
        kind, number = target_of(conversation)
        action = "get_group_msg_history" if kind == GROUP else "get_friend_msg_history"
        key = "group_id" if kind == GROUP else "user_id"
        limit = self.settings.backfill_max_messages
        pages: list[list[dict[str, Any]]] = []
        seen: set[str] = set()
        anchor: int | str | None = None
        while True:
            params: dict[str, Any] = {key: int(number), "count": PAGE}
            if anchor is not None:
                # NapCat names the newest message wanted `message_seq`, Lagrange `message_id`.
                params["message_seq"] = anchor
                params["message_id"] = anchor
            try:
                data = await self._call(action, params, wait=self.pacing.request_timeout)
            except ActionFailed as exc:
                if exc.retcode not in (BAD_REQUEST, NO_SUCH_ACTION) and _nothing_there(exc):
                    break  # no (older) messages
                raise
            batch = [
                m
                for m in (data or {}).get("messages") or ()
                if isinstance(m, dict) and m.get("message_id") is not None
            ]
            fresh = [m for m in batch if str(m["message_id"]) not in seen]
            seen.update(str(m["message_id"]) for m in fresh)
            pages.append(fresh)
            if len(batch) < PAGE or not fresh or len(seen) >= limit + PAGE:
                break
            if min(sent_at(m) for m in batch) < since:
                break
            anchor = _number(str(batch[0]["message_id"]))  # the oldest of the page
        found = [m for page in reversed(pages) for m in page if sent_at(m) >= since]
        if len(found) > limit:
            logger.warning(
                "qq: {} had more than {} messages while the bot was away; the later ones are "
                "read back at the next connection",
                conversation,
                limit,
            )
            found = found[:limit]
        return found

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: plain text in messages of at most `max_message_chars`, the
        first quoting the message it answers and @-mentioning its sender in a group, in
        order, then its files. Raises DeliveryFailed when a part certainly did not go
        out and may later (a reply sent again goes on from there); QQSendUncertain when
        one may have gone out; QQRefused when it never will. No part after a failed one
        is sent (it would read out of context)."""
        kind, number = target_of(message.chat_id)
        context = message.metadata.get(META_REPLY_CONTEXT)
        context = context if isinstance(context, dict) else {}
        sender = str(context.get("user_id") or "")
        mention = kind == GROUP and self.settings.at_sender and sender.isdigit()
        texts = qq_messages(message.text, self.settings.max_message_chars, mention=mention)
        with logger.contextualize(session=message.session_key):
            if not texts and not message.files:
                logger.warning("qq: empty reply not sent")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            parts: list[tuple[str, list[Segment]]] = []
            for index, body in enumerate(texts):
                segments: list[Segment] = []
                if index == 0 and kind == GROUP and _is_id(message.reply_to):
                    segments.append(onebot.reply(str(message.reply_to)))
                if index == 0 and mention:
                    segments += [onebot.at(sender), onebot.text(" ")]
                parts.append((f"part {index}", [*segments, onebot.text(body)]))
            for file in message.files:
                parts.append((f"file {file.name}", [_file_segment(file)]))
            try:
                for index, (what, segments) in enumerate(parts):
                    if index < done:
                        continue
                    await self._send_part(kind, number, segments, context, what)
                    done = index + 1
            except (DeliveryFailed, NotSent, TokenRefused) as exc:
                self._sent_parts.keep(reply, done)
                if isinstance(exc, DeliveryFailed):
                    raise DeliveryFailed(str(exc), sent=done) from exc
                raise DeliveryFailed(f"qq: {exc}", sent=done) from exc

    async def _send_part(
        self,
        kind: str,
        number: str,
        segments: list[Segment],
        context: dict[str, Any],
        what: str,
    ) -> None:
        """Send one message, at most once: repeated only while no connection can be made
        (for `retry_window`). Raises NotSent when the window ran out, DeliveryFailed when
        QQ refused it, QQSendUncertain when it may have gone out, QQRefused when the
        implementation will never take it."""
        params: dict[str, Any] = {"message": segments}
        if kind == GROUP:
            action = "send_group_msg"
            params["group_id"] = int(number)
        else:
            action = "send_private_msg"
            params["user_id"] = int(number)
            if str(context.get("group_id") or "").isdigit():
                params["group_id"] = int(context["group_id"])  # a temporary chat
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                data = await self._call(action, params, wait=self.pacing.send_timeout)
                break
            except NotSent as exc:
                attempt += 1
                if time.monotonic() - started >= self.pacing.retry_window:
                    raise
                delay = min(
                    self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
                )
                logger.warning(
                    "qq: {} to {} not sent ({}); retry {} in {:g}s",
                    what,
                    number,
                    exc,
                    attempt,
                    delay,
                )
                await anyio.sleep(delay)
            except NoAnswer as exc:
                logger.error(
                    "qq: {} to {} got no answer; it may have arrived, so it is not sent again: {}",
                    what,
                    number,
                    exc,
                )
                raise QQSendUncertain(f"qq: {exc}") from None
            except ActionFailed as exc:
                if exc.retcode in (BAD_REQUEST, NO_SUCH_ACTION):
                    raise QQRefused(
                        f"qq: the OneBot implementation refused {what}: {exc}"
                    ) from None
                if "timeout" in exc.message.lower():
                    logger.error(
                        "qq: {} to {}: the implementation timed out waiting for QQ; it may still "
                        "arrive, so it is not sent again ({})",
                        what,
                        number,
                        exc,
                    )
                    raise QQSendUncertain(f"qq: {exc}") from None
                self.stats.refused += 1
                logger.warning("qq: {} to {}: {}", what, number, refusal_reason(exc))
                raise DeliveryFailed(f"qq: {refusal_reason(exc)}") from None
        if isinstance(data, dict) and data.get("message_id") is not None:
            conversation = f"{kind}:{number}"
            self._authors.put(f"{conversation}/{data['message_id']}", self.self_id)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: from the download address QQ gave with it, at most
        `max_bytes`."""
        if attachment.size is not None and attachment.size > max_bytes:
            raise MediaError(
                f"it is {attachment.size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        if not attachment.url:
            raise MediaError("QQ gave no download address for this file")
        return await download_capped(attachment.url, max_bytes)


def _file_segment(file: OutboundFile) -> Segment:
    if file.is_image:
        return onebot.image(file.data)
    return onebot.file(file.name, file.data)


def _is_id(message_id: str | None) -> bool:
    """Whether `message_id` is a OneBot message id (a number; Lagrange's may be negative)."""
    return bool(message_id) and str(message_id).lstrip("-").isdigit()


def _number(message_id: str) -> int | str:
    """A message id as OneBot's numbers are sent (an implementation's own ids that are
    no numbers as they are)."""
    return int(message_id) if message_id.lstrip("-").isdigit() else message_id


def _nothing_there(exc: ActionFailed) -> bool:
    said = exc.message.lower()
    return any(words in said for words in _NOTHING_THERE)


def _token_refused(url: str) -> str:
    return (
        f"qq: the OneBot implementation at {url} refused the access token; set "
        f"{ENV_TOKEN} to the Token of its WebSocket server (NapCat: WebUI > Network "
        "Configuration > your WebSocket server > Token)"
    )


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True, slots=True)
class QQCheck:
    """What `gateway doctor` learned: who the account is, which implementation serves
    it, and whether it has the message history the read-back needs (None: unknown)."""

    identity: str
    implementation: str
    history: bool | None


async def check_credentials(settings: QQSettings, token: str | None) -> QQCheck:
    """`gateway doctor`: `/api` with the token, `get_login_info`, `get_version_info`,
    and whether `get_friend_msg_history` exists (any answer but 1404). Raises
    QQSetupError saying what to fix."""
    try:
        url = endpoint(settings.url, "/api")
    except ValueError as exc:
        raise QQSetupError(f"qq: channels.qq.url: {exc}") from None
    async with aiohttp.ClientSession() as session:
        try:
            ws = await open_socket(session, url, token, heartbeat=None)
        except TokenRefused:
            raise QQSetupError(_token_refused(settings.url)) from None
        except NotSent as exc:
            raise QQSetupError(f"qq: cannot reach the OneBot implementation: {exc}") from None
        socket = OneBotSocket(ws, name="qq-doctor")
        found: QQCheck | None = None
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve_quietly, socket)
            try:
                found = await _ask(socket, settings)
            except Exception as exc:
                failure = exc
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await socket.close()
    if failure is not None:
        raise failure
    assert found is not None
    return found


async def _ask(socket: OneBotSocket, settings: QQSettings) -> QQCheck:
    try:
        me = await socket.call("get_login_info", wait=10)
    except TokenRefused:
        raise QQSetupError(_token_refused(settings.url)) from None
    except (NoAnswer, NotSent) as exc:
        raise QQSetupError(f"qq: the OneBot implementation did not answer ({exc})") from None
    except ActionFailed as exc:
        raise QQSetupError(
            f"qq: get_login_info failed ({exc}); is the account logged in?"
        ) from None
    me = me if isinstance(me, dict) else {}
    identity = f"{me.get('nickname') or '?'} ({me.get('user_id') or '?'})"
    implementation = "an unknown OneBot v11 implementation"
    try:
        version = await socket.call("get_version_info", wait=10)
        if isinstance(version, dict) and version.get("app_name"):
            implementation = f"{version['app_name']} {version.get('app_version') or ''}".strip()
    except (ActionFailed, NoAnswer, NotSent, TokenRefused):
        pass
    history: bool | None = None
    try:
        await socket.call(
            "get_friend_msg_history",
            {"user_id": _number(str(me.get("user_id") or 0)), "count": 1},
            wait=10,
        )
        history = True
    except ActionFailed as exc:
        history = exc.retcode != NO_SUCH_ACTION
    except (NoAnswer, NotSent, TokenRefused):
        history = None
    return QQCheck(identity, implementation, history)


async def _serve_quietly(socket: OneBotSocket) -> None:
    try:
        await socket.serve()
    except Exception as exc:
        logger.debug("qq: doctor's connection ended: {!r}", exc)
