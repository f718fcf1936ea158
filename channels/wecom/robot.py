"""The WeCom intelligent robot (智能机器人) over its long connection: one WebSocket to
`ws_url`, subscribed with the robot's BotID and Secret, on which WeCom pushes the
messages people write to the robot and takes its replies ("智能机器人长连接").

Frames are JSON `{cmd, headers: {req_id}, body}`:

| cmd (direction) | what |
|---|---|
| `aibot_subscribe` (out) | the first frame, {bot_id, secret}; answered `{headers, errcode}` |
| `ping` (out) | every `Pacing.heartbeat` s; answered likewise |
| `aibot_msg_callback` (in) | a message: {msgid, chattype, chatid, from.userid, msgtype, text} |
| `aibot_event_callback` (in) | an event; `disconnected_event`: another connection took over |
| `aibot_respond_msg` (out) | a reply with the message's req_id: a finished `stream` |
| `aibot_send_msg` (out) | the robot's own message to a chat: `markdown` |

Every frame the channel sends is answered by a frame with its req_id and an `errcode`.

In a one-to-one chat the session key is `wecom:<userid>` (as in callback mode); in a
group `wecom:group:<chatid>`. WeCom pushes a group message to the robot only when it
@-mentions the robot, so every group message is addressed to it.

Promises (tested in tests/test_wecom_robot.py and by the conformance kit):
- One connection per robot: WeCom closes the older one (`disconnected_event`) when a new
  one subscribes, so robot mode runs on one gateway (the spec refuses it with replicas).
- Messages are submitted one at a time, in the order WeCom pushed them; the message id is
  WeCom's `msgid`, so a message pushed again is answered once.
- What WeCom does not promise, said out loud: the long connection has no receipt for a
  pushed message. A message pushed in the moment the gateway dies, before its journal
  commit, is lost, and WeCom keeps nothing for a robot whose connection is down: what
  people write meanwhile never reaches the gateway (docs/wecom.md, "Robot mode"). So
  the channel says `redelivers = False`: what is pushed while the gateway stops is
  journaled for its next start, and a busy gateway takes it past its queue bound.
- A reply goes with `aibot_respond_msg` and its message's req_id while the connection
  that pushed it is open, else (after a reconnect or a restart) with `aibot_send_msg` to
  the chat, naming the sender in a group (`<@userid>`). Its Markdown is split at 20,480
  bytes. No connection: `DeliveryFailed` (sent again later); an error answer: given up
  and logged; no answer within `Pacing.answer_timeout`: given up (it may have gone out).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import anyio.abc
from loguru import logger

from channels.wecom.channel import WeComRefused, WeComSetupError
from channels.wecom.format import split_bytes
from channels.wecom.settings import ENV, WeComSettings
from channels.wecom.translate import CHANNEL
from gateway.channel import DeliveryFailed, Submit
from gateway.config import ConfigError
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_SENT_AT,
    InboundMessage,
    OutboundMessage,
)

#: The most bytes of a stream reply's or a markdown message's content.
CONTENT_LIMIT_BYTES = 20480
GROUP_PREFIX = "group:"
#: The answer the channel gives itself for a frame whose connection closed unanswered.
CLOSED = "closed"
_LEADING_MENTION = re.compile(r"^\s*@\S+\s*")


@dataclass(frozen=True, slots=True)
class Pacing:
    heartbeat: float = 30.0
    answer_timeout: float = 10.0  # an answer frame for what the channel sent
    reconnect: float = 1.0  # doubled per failed attempt
    max_reconnect: float = 30.0


def split_content(text: str, limit: int = CONTENT_LIMIT_BYTES) -> list[str]:
    """Markdown as parts of at most `limit` bytes of UTF-8, cut on paragraph, line and
    word boundaries, in order."""
    return split_bytes(text, limit)


def translate_frame(body: dict[str, Any], *, req_id: str, connection: str) -> InboundMessage | None:
    """A pushed message as the gateway's message; None for what the robot does not read."""
    user = str((body.get("from") or {}).get("userid") or "")
    msgid = str(body.get("msgid") or "")
    kind = body.get("msgtype")
    if not user or not msgid or kind not in ("text", "voice"):
        return None
    text = str((body.get(kind) or {}).get("content") or "")
    group = body.get("chattype") == "group"
    if group and not body.get("chatid"):
        return None
    metadata: dict[str, Any] = {
        META_IS_GROUP: group,
        META_REPLY_CONTEXT: {"req_id": req_id, "connection": connection, "sender": user},
    }
    if body.get("create_time"):
        metadata[META_SENT_AT] = float(body["create_time"])
    if group:
        metadata[META_MENTIONED] = True  # WeCom pushes a group message only for an @-mention
        text = _LEADING_MENTION.sub("", text, count=1)
    chat = f"{GROUP_PREFIX}{body.get('chatid')}" if group else user
    return InboundMessage(
        channel=CHANNEL,
        chat_id=chat,
        text=text,
        sender_id=user,
        message_id=msgid,
        metadata=metadata,
    )


class WeComRobotChannel:
    """The robot adapter (Channel protocol); see the module docstring."""

    name = CHANNEL
    #: A push has no receipt: the dispatcher keeps what comes while the gateway stops.
    redelivers = False

    def __init__(
        self, settings: WeComSettings, *, bot_secret: str, pacing: Pacing | None = None
    ) -> None:
        for value, what in ((settings.bot_id, "BOT_ID"), (bot_secret, "BOT_SECRET")):
            if not value:
                raise ConfigError(
                    f"channels.wecom: robot mode needs {ENV}{what}; see docs/wecom.md"
                )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self._secret = bot_secret
        self._submit: Submit | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        #: This connection's id, unique across processes (a reply context names it).
        self._connection = ""
        self._waiting: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._ids = itertools.count(1)
        self.sent = 0
        self.refused = 0
        self.connections = 0

    @classmethod
    def from_settings(cls, settings: WeComSettings) -> WeComRobotChannel:
        return cls(settings, bot_secret=settings.resolved_bot_secret() or "")

    def _req_id(self, cmd: str) -> str:
        return f"{cmd}_{next(self._ids)}_{secrets.token_hex(4)}"

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold the long connection until cancelled, connecting again after a drop; live
        (`task_status.started`) once subscribed, or once the first attempt failed for the
        network. Raises WeComSetupError when WeCom refuses the BotID or Secret."""
        self._submit = submit
        started = [False]

        def live() -> None:
            if not started[0]:
                started[0] = True
                task_status.started()

        try:
            await self._connect_loop(live)
        finally:
            self._submit = None

    async def _connect_loop(self, live: Callable[[], None]) -> None:
        delay = self.pacing.reconnect
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self._session(session, live)
                    delay = self.pacing.reconnect
                except WeComSetupError:
                    raise
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    logger.warning(
                        "wecom: the robot's connection failed ({}); again in {:g}s", exc, delay
                    )
                live()
                await anyio.sleep(delay)
                delay = min(delay * 2, self.pacing.max_reconnect)

    async def _session(self, session: aiohttp.ClientSession, live: Callable[[], None]) -> None:
        """One connection: subscribe, then read frames until it closes."""
        async with session.ws_connect(self.settings.ws_url, heartbeat=None, autoping=True) as ws:
            await self._subscribe(ws)
            self._connection = secrets.token_hex(8)
            self.connections += 1
            connection = self._connection
            self._ws = ws
            logger.info("wecom: robot {} is live on its long connection", self.settings.bot_id)
            live()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._heartbeat, ws)
                    await self._read(ws, connection)
                    tg.cancel_scope.cancel()
            finally:
                if self._ws is ws:
                    self._ws = None
                for done in list(self._waiting.values()):
                    done({"errcode": CLOSED, "errmsg": "connection closed"})

    async def _subscribe(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The connection's first frame; WeComSetupError when WeCom refuses it."""
        req_id = self._req_id("aibot_subscribe")
        body = {"bot_id": self.settings.bot_id, "secret": self._secret}
        await ws.send_str(
            json.dumps({"cmd": "aibot_subscribe", "headers": {"req_id": req_id}, "body": body})
        )
        with anyio.fail_after(self.pacing.answer_timeout):
            answer = await ws.receive_json()
        if int(answer.get("errcode", -1)) != 0:
            raise WeComSetupError(
                f"wecom: WeCom refused the robot's BotID or Secret (errcode "
                f"{answer.get('errcode')} {str(answer.get('errmsg') or '')[:100]}); set "
                f"{ENV}BOT_ID and {ENV}BOT_SECRET to the robot's"
            )

    async def _heartbeat(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """A ping every `Pacing.heartbeat` s; one unanswered within `answer_timeout` closes
        the connection (a dead one would otherwise wait for TCP), and it is made again."""
        while True:
            await anyio.sleep(self.pacing.heartbeat)
            req_id = self._req_id("ping")
            answered = anyio.Event()
            self._waiting[req_id] = _setter(answered)
            try:
                await ws.send_str(json.dumps({"cmd": "ping", "headers": {"req_id": req_id}}))
                with anyio.move_on_after(self.pacing.answer_timeout):
                    await answered.wait()
            finally:
                self._waiting.pop(req_id, None)
            if not answered.is_set():
                logger.warning("wecom: the robot's connection answers no ping; connecting again")
                await ws.close()
                return

    async def _read(self, ws: aiohttp.ClientWebSocketResponse, connection: str) -> None:
        async for frame in ws:
            if frame.type != aiohttp.WSMsgType.TEXT:
                break
            try:
                data = json.loads(frame.data)
            except ValueError:
                continue
            cmd = data.get("cmd")
            req_id = str((data.get("headers") or {}).get("req_id") or "")
            body = data.get("body") or {}
            if cmd == "aibot_msg_callback":
                await self._take(body, req_id, connection)
            elif cmd == "aibot_event_callback":
                event = str(
                    (body.get("event") or {}).get("eventtype") or body.get("eventtype") or ""
                )
                if event == "disconnected_event":
                    logger.warning(
                        "wecom: another connection of robot {} took over; this one closes",
                        self.settings.bot_id,
                    )
            elif not cmd and req_id in self._waiting:
                self._waiting.pop(req_id)(data)

    async def _take(self, body: dict[str, Any], req_id: str, connection: str) -> None:
        message = translate_frame(body, req_id=req_id, connection=connection)
        submit = self._submit
        if message is None or submit is None:
            return
        with logger.contextualize(session=message.session_key):
            ticket = await submit(message)
            if not ticket.taken:
                # Nothing confirms a push: a message the journal could not take is lost.
                logger.error(
                    "wecom: message {} not kept (the journal refused it)", message.message_id
                )

    # ----------------------------------------------------------------- replies

    async def _call(self, cmd: str, req_id: str, body: dict[str, Any]) -> dict[str, Any]:
        ws = self._ws
        if ws is None or ws.closed:
            raise DeliveryFailed("wecom: the robot's long connection is not open")
        answered: list[dict[str, Any]] = []
        event = anyio.Event()

        def done(data: dict[str, Any]) -> None:
            answered.append(data)
            event.set()

        self._waiting[req_id] = done
        try:
            await ws.send_str(json.dumps({"cmd": cmd, "headers": {"req_id": req_id}, "body": body}))
        except (aiohttp.ClientError, ConnectionError) as exc:
            self._waiting.pop(req_id, None)
            raise DeliveryFailed(f"wecom: not sent ({exc})") from None
        with anyio.move_on_after(self.pacing.answer_timeout):
            await event.wait()
        self._waiting.pop(req_id, None)
        if not answered or answered[0].get("errcode") == CLOSED:
            raise WeComRefused(f"wecom: no answer to {cmd} (it may have gone out)")
        return answered[0]

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply; see the module docstring."""
        context = message.metadata.get(META_REPLY_CONTEXT) or {}
        group = message.chat_id.startswith(GROUP_PREFIX)
        sender = str(context.get("sender") or "")
        parts = split_content(message.text)
        with logger.contextualize(session=message.session_key):
            for number, part in enumerate(parts):
                answer: dict[str, Any] | None = None
                if context.get("connection") == self._connection and context.get("req_id"):
                    stream = {"id": self._req_id("stream"), "finish": True, "content": part}
                    body = {"msgtype": "stream", "stream": stream}
                    answer = await self._call("aibot_respond_msg", str(context["req_id"]), body)
                    if int(answer.get("errcode", -1)) != 0:
                        logger.info(
                            "wecom: the reply by req_id was refused ({}); sending it", answer
                        )
                        answer = None
                if answer is None:
                    chat = message.chat_id.removeprefix(GROUP_PREFIX)
                    named = group and sender and number == 0
                    content = f"<@{sender}> {part}" if named else part
                    body = {"chatid": chat, "msgtype": "markdown", "markdown": {"content": content}}
                    answer = await self._call(
                        "aibot_send_msg", self._req_id("aibot_send_msg"), body
                    )
                if int(answer.get("errcode", -1)) != 0:
                    self.refused += 1
                    raise WeComRefused(
                        f"wecom: WeCom refused the reply (errcode {answer.get('errcode')} "
                        f"{str(answer.get('errmsg') or '')[:100]})"
                    )
                self.sent += 1


def _setter(event: anyio.Event) -> Callable[[dict[str, Any]], None]:
    def done(_: dict[str, Any]) -> None:
        event.set()

    return done


async def check_robot(settings: WeComSettings) -> str:
    """`gateway doctor`: the robot's long connection subscribed. Raises WeComSetupError
    saying what to fix."""
    robot = WeComRobotChannel.from_settings(settings)
    try:
        async with aiohttp.ClientSession() as session:
            with anyio.fail_after(15):
                async with session.ws_connect(settings.ws_url, heartbeat=None) as ws:
                    await robot._subscribe(ws)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise WeComSetupError(
            f"wecom: cannot reach the robot's long connection at {settings.ws_url} ({exc})"
        ) from None
    return f"robot {settings.bot_id}: its long connection was subscribed"
