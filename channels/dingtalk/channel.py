"""The DingTalk channel: DingTalk's stream mode (a WebSocket the robot opens) for messages
in; the message's session webhook, or the robot API, for markdown replies out; all over
the gateway's own aiohttp, inside the daemon's event loop.

Why not the `dingtalk-stream` library: tried, and it can ack a callback after its handler
returns, but not keep the rest of the promise as it is. Its handler must return a status
that it always writes back as an ack frame; leaving a callback unacked (so that DingTalk
pushes it again, when the journal did not take it) takes raising from the handler, which
it logs as an unknown error. Its `open_connection` and every reply helper
(`reply_markdown`, `get_access_token`) are blocking `requests` calls; the replies run on
the event loop that would be the daemon's. Its endpoint is a class constant, its reconnect
loop swallows every error (a refused secret never reaches `gateway run` or `gateway
doctor`), and it tells no request that never went out from one that may have. The
protocol is small (one POST for a ticket, JSON frames, an ack per frame), so the channel
speaks it itself.

Promises (tested in tests/test_dingtalk.py, tests/test_fake_dingtalk.py and the
conformance kit, tests/conformance):
- Journal before confirm. A callback's ack frame (`{"code": 200, "headers":
  {"messageId": ...}}`) is written only once `submit` returned a taken ticket; a callback
  that was not taken (the journal failed, the gateway drains) gets no ack, and DingTalk
  pushes it again. A callback this process already journaled is acked at once.
- A message is answered once however often DingTalk pushes it: its id is `msgId`, the
  same in every push, and the dispatcher's journal drops a message id it has.
- A reply goes to the person and conversation of the message it answers, and to no one
  else: its target (session webhook, conversation, userId) is the reply's own
  `META_REPLY_CONTEXT`, made from that message's callback; the channel keeps no "current
  webhook" a concurrent turn could overwrite (QwenPaw #2414). A context naming another
  conversation than the reply's is ignored.
- No reply part is posted twice by this process (QwenPaw #2421): a send that failed
  before DingTalk took a part goes on from that part when the gateway sends the reply
  again; a part that may have gone out (the request left, no answer came) is never
  repeated: `send` raises `PossiblySent`, which the dispatcher does not retry; a reply to
  a message that was posted whole is not posted again.
- Refusals by name: an expired session webhook (`sessionWebhookExpiredTime` past, or the
  webhook refuses) falls back to the robot API; a rate limit (HTTP 429, `Throttling*`,
  errcode 130101 / 410100, a flow-controlled userId) is waited out within
  `Pacing.retry_window`, then `DeliveryFailed`; a refused token is renewed and the
  request repeated (DingTalk did not carry it out).
- Nothing the model writes can notify anyone: a message notifies only through its `at`
  field, which names the sender of a group message and nobody else, never `isAtAll`.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote_plus

import aiohttp
import anyio
import anyio.abc
from loguru import logger

from channels.dingtalk.api import DingTalkApi, NoAnswer, Refused, Unreachable
from channels.dingtalk.format import split_parts, title_of, with_mention
from channels.dingtalk.settings import DingTalkSettings
from channels.dingtalk.translate import (
    BOT_MESSAGE_TOPIC,
    CHANNEL,
    ReplyContext,
    Skip,
    translate_callback,
)
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.messages import OutboundMessage

_REMEMBERED = 10_000


class DingTalkSetupError(Exception):
    """The app's credentials were refused, or DingTalk cannot be reached; says what to fix
    and never holds the Client Secret."""


class PossiblySent(Exception):
    """A reply part's request went out and no answer came: DingTalk may have posted it, so
    it is not sent again (the dispatcher logs this and does not retry)."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to DingTalk (seconds)."""

    retry_window: float = 50.0  # per part, under the dispatcher's cap on one delivery
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    webhook_margin: float = 60.0  # a session webhook this close to expiry is not used
    reconnect_min: float = 1.0
    reconnect_max: float = 30.0
    sent_memory: float = 3600.0  # how long a reply posted whole is remembered


@dataclass
class Stats:
    """Counts for /metrics (`channels.dingtalk.spec`)."""

    repushes: int = 0
    rate_limited: int = 0
    webhook_fallbacks: int = 0


async def check_credentials(settings: DingTalkSettings, client_secret: str) -> str:
    """`gateway doctor`: the app's token is granted. Raises what `remote_check` reports."""
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        api = DingTalkApi(settings.base_url(), settings.client_id, client_secret, session)
        try:
            await api.token()
        except Refused as exc:
            raise DingTalkSetupError(
                f"DingTalk refused the Client ID and Secret ({exc}); check "
                "channels.dingtalk.client_id and GATEWAY_CHANNELS__DINGTALK__CLIENT_SECRET"
            ) from None
        except (Unreachable, NoAnswer) as exc:
            raise DingTalkSetupError(f"cannot reach {api.base_url} ({exc})") from None
    return f"the app {settings.client_id} has a token"


def ack_frame(message_id: str, data: str | None = None) -> str:
    """The frame that confirms a pushed frame to DingTalk."""
    body = json.dumps({"response": None}) if data is None else data
    return json.dumps(
        {
            "code": 200,
            "headers": {"contentType": "application/json", "messageId": message_id},
            "message": "OK",
            "data": body,
        }
    )


class DingTalkChannel:
    """The DingTalk adapter; see the module docstring for what it promises."""

    name = CHANNEL

    def __init__(
        self, settings: DingTalkSettings, *, client_secret: str, pacing: Pacing | None = None
    ) -> None:
        if not settings.client_id or not client_secret:
            raise ConfigError(
                "channels.dingtalk: set channels.dingtalk.client_id and "
                "GATEWAY_CHANNELS__DINGTALK__CLIENT_SECRET (the app's Credentials & Basic Info)"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.stats = Stats()
        self._secret = client_secret
        self._api: DingTalkApi | None = None
        self._submit: Submit | None = None
        self._paused = False
        #: Callbacks (msgId) this process journaled: a re-push is acked at once.
        self._taken: OrderedDict[str, None] = OrderedDict()
        #: Replies a failure cut short, by (session, reply_to, text): the parts posted.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED)
        #: Replies to a message posted whole, by (session, reply_to, text): when.
        self._posted: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        #: One-to-one conversations' people, for a message without a reply context.
        self._dm_people: OrderedDict[str, str] = OrderedDict()
        self.live = anyio.Event()  # set once callbacks flow (for tests and probes)

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Receive callbacks until cancelled. Raises DingTalkSetupError when the
        credentials are refused (the daemon restarts the channel)."""
        self._paused = False
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=10)
        # A send on a pooled connection the server already closed fails after it was
        # written, which reads as "may have gone out" and is never repeated: keep idle
        # connections shorter than any server's idle timeout.
        connector = aiohttp.TCPConnector(keepalive_timeout=10)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self._api = DingTalkApi(
                self.settings.base_url(), self.settings.client_id, self._secret, session
            )
            try:
                await self._stream(submit, task_status)
            finally:
                self._submit = None
                self._api = None
                self.live = anyio.Event()

    def pause_intake(self) -> None:
        """Take no more callbacks (the daemon is draining): they are left unacked, and
        DingTalk pushes them again to the next start. Replies still go out."""
        self._paused = True

    def _require_api(self) -> DingTalkApi:
        if self._api is None:
            raise DeliveryFailed("dingtalk: the channel is not running")
        return self._api

    async def _stream(self, submit: Submit, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Hold the stream connection, reconnecting with backoff when it drops. Every
        replica may hold one: DingTalk pushes each callback to one of an app's
        connections."""
        api = self._require_api()
        started = False
        delay = self.pacing.reconnect_min
        while True:
            url = ""
            try:
                endpoint, ticket = await api.open_connection([BOT_MESSAGE_TOPIC])
                url = f"{endpoint}?ticket={quote_plus(ticket)}"
            except Refused as exc:
                if not started and not exc.server_side and not exc.rate_limited:
                    raise DingTalkSetupError(
                        f"dingtalk: the stream connection was refused ({exc}); check "
                        "channels.dingtalk.client_id, GATEWAY_CHANNELS__DINGTALK__CLIENT_SECRET "
                        "and that the robot's message receiving mode is Stream"
                    ) from None
                logger.warning("dingtalk: no stream connection ({}); retrying", exc)
            except (Unreachable, NoAnswer) as exc:
                logger.warning("dingtalk: no stream connection ({}); retrying", exc)
            if url:
                try:
                    async with api.session.ws_connect(
                        url, autoping=True, heartbeat=30.0, max_msg_size=4 * 1024 * 1024
                    ) as socket:
                        self._submit = submit
                        delay = self.pacing.reconnect_min
                        if not started:
                            logger.info("dingtalk: the app {} is live", self.settings.client_id)
                            self.live.set()
                            task_status.started()
                            started = True
                        await self._serve(socket)
                    logger.warning("dingtalk: the stream connection closed; reconnecting")
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    logger.warning(
                        "dingtalk: the stream connection failed ({!r}); reconnecting", exc
                    )
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.pacing.reconnect_max)

    async def _serve(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        async for message in socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR):
                    break
                continue
            try:
                frame = json.loads(message.data)
            except ValueError:
                logger.warning("dingtalk: an unreadable frame skipped")
                continue
            if not isinstance(frame, Mapping):
                continue
            if await self._on_frame(socket, frame) == "disconnect":
                break

    async def _on_frame(
        self, socket: aiohttp.ClientWebSocketResponse, frame: Mapping[str, Any]
    ) -> str:
        headers = frame.get("headers") if isinstance(frame.get("headers"), Mapping) else {}
        assert isinstance(headers, Mapping)
        message_id = str(headers.get("messageId") or "")
        kind, topic = frame.get("type"), headers.get("topic")
        raw = frame.get("data")
        if kind == "SYSTEM":
            if topic == "ping":
                await self._write(
                    socket, ack_frame(message_id, raw if isinstance(raw, str) else None)
                )
                return ""
            if topic == "disconnect":
                logger.info("dingtalk: DingTalk asks to reconnect")
                return "disconnect"
            return ""
        if kind == "CALLBACK" and topic == BOT_MESSAGE_TOPIC:
            try:
                data = json.loads(raw) if isinstance(raw, str) else raw
            except ValueError:
                data = None
            if not isinstance(data, Mapping):
                logger.warning("dingtalk: a callback that is no JSON object; acked and skipped")
            elif not await self._take(data):
                return ""  # no ack: DingTalk pushes it again
        # Anything else (an event, another topic) is acked: it holds nothing to keep.
        await self._write(socket, ack_frame(message_id))
        return ""

    @staticmethod
    async def _write(socket: aiohttp.ClientWebSocketResponse, text: str) -> None:
        try:
            await socket.send_str(text)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            logger.warning("dingtalk: an ack was not sent ({}); the frame comes again", exc)

    # ----------------------------------------------------------------- inbound

    async def _take(self, data: Mapping[str, Any]) -> bool:
        """Translate and submit one callback. True when DingTalk may forget it: it is in
        the journal, or settled (skipped, a re-push of one already journaled here)."""
        if self._submit is None or self._paused:
            return False
        msg_id = str(data.get("msgId") or "")
        if msg_id and msg_id in self._taken:
            self.stats.repushes += 1
            logger.debug("dingtalk: message {} pushed again; acked", msg_id)
            return True
        result = translate_callback(data)
        if isinstance(result, Skip):
            logger.debug("dingtalk: callback {} skipped: {}", msg_id, result.reason)
            return True
        ticket = await self._submit(result)
        if not ticket.taken:
            return False
        _remember(self._taken, msg_id, None)
        context = ReplyContext.from_metadata(result.metadata, result.chat_id)
        if context is not None and not context.group and context.staff_id:
            _remember(self._dm_people, context.conversation, context.staff_id)
        return True

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply as markdown parts, in order. Raises DeliveryFailed when a part
        did not go out and may later (a reply sent again goes on from that part),
        PossiblySent when a part may have gone out, any other error when it never will."""
        context = ReplyContext.from_metadata(message.metadata, message.chat_id)
        parts = split_parts(message.text, self.settings.part_chars - _reserve(context))
        with logger.contextualize(session=message.session_key):
            if not parts:
                logger.warning("dingtalk: empty reply not sent")
                return
            whole = (message.session_key, message.reply_to or "", message.text)
            if message.reply_to and whole in self._posted:
                logger.info("dingtalk: a reply posted whole before is not posted again")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            for index in range(done, len(parts)):
                try:
                    await self._post(message.chat_id, context, parts[index])
                except (DeliveryFailed, PossiblySent) as exc:
                    posted = index + 1 if isinstance(exc, PossiblySent) else index
                    self._sent_parts.keep(reply, posted)
                    if isinstance(exc, DeliveryFailed):
                        raise DeliveryFailed(str(exc), sent=index) from exc
                    raise
            if message.reply_to:
                self._forget_old_posts()
                _remember(self._posted, whole, time.monotonic())

    def _forget_old_posts(self) -> None:
        cutoff = time.monotonic() - self.pacing.sent_memory
        while self._posted and next(iter(self._posted.values())) < cutoff:
            self._posted.popitem(last=False)

    async def _post(self, chat_id: str, context: ReplyContext | None, part: str) -> None:
        """Post one part: through the session webhook while it is valid, else (or when it
        refuses) through the robot API."""
        if (
            context is not None
            and self.settings.session_webhook
            and context.webhook
            and time.time() * 1000 < context.expires_ms - self.pacing.webhook_margin * 1000
        ):
            body: dict[str, Any] = {
                "msgtype": "markdown",
                "markdown": {
                    "title": title_of(part),
                    "text": with_mention(part, context.staff_id) if context.group else part,
                },
                "at": {
                    "atUserIds": [context.staff_id] if context.group and context.staff_id else [],
                    "isAtAll": False,
                },
            }
            api = self._require_api()
            try:
                await self._patiently(lambda: api.webhook_send(context.webhook, body))
                return
            except Refused as exc:
                self.stats.webhook_fallbacks += 1
                logger.info("dingtalk: the session webhook refused ({}); the robot API posts", exc)
        elif context is not None and context.webhook and self.settings.session_webhook:
            self.stats.webhook_fallbacks += 1
            logger.info("dingtalk: the session webhook expired; the robot API posts")
        await self._robot_post(chat_id, context, part)

    async def _robot_post(self, chat_id: str, context: ReplyContext | None, part: str) -> None:
        api = self._require_api()
        robot = self.settings.resolved_robot_code()
        group = context.group if context is not None else chat_id not in self._dm_people
        if group:
            name = context.nick if context is not None else ""
            text = f"{name}: {part}" if name else part  # the robot API cannot @ anyone
            markdown = {"title": title_of(part), "text": text}
            await self._patiently(lambda: api.robot_send(robot, markdown, group=chat_id))
            return
        user = (context.staff_id if context is not None else "") or self._dm_people.get(chat_id, "")
        if not user:
            raise Refused(0, "NoUserId", f"no userId known for {chat_id}; the reply cannot go out")
        markdown = {"title": title_of(part), "text": part}
        await self._patiently(lambda: api.robot_send(robot, markdown, user=user))

    async def _patiently(self, call: Any) -> Any:
        """Repeat `call` while it certainly did not go out (no connection, a 5xx, a rate
        limit, a refused token), within `retry_window`; then DeliveryFailed. A request
        with no answer raises PossiblySent; any other refusal is raised as it is."""
        deadline = time.monotonic() + self.pacing.retry_window
        backoff = self.pacing.retry_backoff
        renewed = False
        while True:
            try:
                return await call()
            except NoAnswer as exc:
                raise PossiblySent(f"dingtalk: no answer to a send ({exc}); not repeated") from None
            except Unreachable as exc:
                why = f"DingTalk unreachable ({exc})"
                wait = backoff
            except Refused as exc:
                if exc.token_refused and not renewed and self._api is not None:
                    self._api.forget_token()
                    renewed = True
                    logger.info("dingtalk: the access token was refused ({}); renewed", exc)
                    continue
                if exc.rate_limited:
                    self.stats.rate_limited += 1
                    why = f"rate limited ({exc})"
                    wait = exc.retry_after if exc.retry_after is not None else backoff
                elif exc.server_side:
                    why = str(exc)
                    wait = backoff
                else:
                    raise
            if time.monotonic() + wait > deadline:
                raise DeliveryFailed(f"dingtalk: {why}")
            logger.debug("dingtalk: {}; again in {:.1f}s", why, wait)
            await anyio.sleep(wait)
            backoff = min(backoff * 2, self.pacing.retry_backoff_max)


def _reserve(context: ReplyContext | None) -> int:
    """Characters a group part keeps free for the sender's name (`@userId ` or `Nick: `)."""
    if context is None or not context.group:
        return 0
    return max(len(context.staff_id), len(context.nick)) + 2


def _remember(store: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > _REMEMBERED:
        store.popitem(last=False)
