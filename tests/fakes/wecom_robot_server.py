"""A fake WeCom intelligent robot long connection for tests, written from WeCom's
"智能机器人长连接" page and the frames of its official SDK (wecomteam/aibot-node-sdk):

- A WebSocket at `/`; the first frame must be `aibot_subscribe` with the robot's
  `bot_id` and `secret`, answered `{headers: {req_id}, errcode, errmsg}` (a wrong one:
  a non-zero errcode, and the socket is closed). One connection per robot: a new
  subscription sends the older one `aibot_event_callback` with `disconnected_event` and
  closes it.
- `ping` is answered with errcode 0 (`answer_pings = False`: not answered, as a
  connection that died without closing).
- A person's message is pushed as `aibot_msg_callback` {msgid, aibotid, chatid (groups),
  chattype single|group, from.userid, create_time, msgtype text, text.content} with a
  fresh req_id. In a group only a message that @-mentions the robot is pushed (its text
  begins with `@<robot name>`); other group messages reach nobody. Nothing is pushed
  without a connection, and nothing is kept for later: WeCom documents no receipt and no
  queue for the long connection, so the fake keeps none (`missed` lists them).
- `aibot_respond_msg` with the req_id of a message pushed on the same connection and a
  `stream` {id, finish, content} shows the content as a reply to that message (once per
  stream id: a finished stream is not shown again); `aibot_send_msg` {chatid, msgtype
  markdown} shows it in the chat (a user's id for a one-to-one chat). Content over 20,480
  bytes, an unknown req_id or chat: a non-zero errcode (the fake's own numbers, 40058).
  `<@userid>` in the content mentions that person.

``with FakeWeComRobot.in_thread() as fake:`` serves from a background thread.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web

from tests.fakes._serving import LocalServer, at_least

CONTENT_LIMIT = 20480
BOT_ID = "aibotfake0001"
BOT_SECRET = "fake-robot-secret-0123456789"
BOT_NAME = "GatewayBot"
INVALID = 40058
_MENTION = re.compile(r"<@([^>\s]+)>")


@dataclass(frozen=True, slots=True)
class Pushed:
    msgid: str
    chat: str  # the user's id (one-to-one) or the group's chatid
    user: str
    text: str
    req_id: str | None  # None: not pushed (no connection, or an unaddressed group message)
    connection: int


@dataclass(frozen=True, slots=True)
class RobotSent:
    chat: str
    text: str
    reply_to: str | None
    how: str  # "respond" or "send"
    mentions: frozenset[str]
    at: float


class FakeWeComRobot(LocalServer):
    """A scriptable robot long connection; see the module docstring."""

    _thread_name = "fake-wecom-robot"

    def __init__(self, *, bot_id: str = BOT_ID, secret: str = BOT_SECRET) -> None:
        super().__init__()
        self.bot_id = bot_id
        self.secret = secret
        self.name = BOT_NAME
        self._socket: web.WebSocketResponse | None = None
        self._connection = 0
        self.connections = 0
        self._req_ids: dict[str, tuple[int, str, str]] = {}  # req_id -> (conn, msgid, chat)
        self._streams: set[str] = set()
        self._pushed: list[Pushed] = []
        self._sent: list[RobotSent] = []
        self.frames: list[dict[str, Any]] = []
        self.answer_pings = True  # False: a connection that died without closing
        self._ids = itertools.count(int(time.time() * 1000) % 10**9)

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._serve)
        return app

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/"

    @property
    def connected(self) -> bool:
        return self._socket is not None and not self._socket.closed

    @property
    def sent(self) -> list[RobotSent]:
        with self._lock:
            return list(self._sent)

    @property
    def pushed(self) -> list[Pushed]:
        with self._lock:
            return list(self._pushed)

    @property
    def missed(self) -> list[Pushed]:
        return [p for p in self.pushed if p.req_id is None]

    async def wait_for_sent(self, count: int) -> list[RobotSent]:
        return await self._on_server_loop(self._until(at_least(count, lambda: self.sent)))

    async def wait_connected(self) -> None:
        await self._on_server_loop(self._until(lambda: self.connected or None))

    # -- people --------------------------------------------------------------------------

    def write(
        self, user: str, text: str, *, group: str | None = None, mention: bool = False
    ) -> Pushed:
        """A person writes (from any thread); pushed to the robot when it would be."""
        if group is not None and mention:
            text = f"@{self.name} {text}"
        msgid = f"msg{next(self._ids)}{secrets.token_hex(3)}"
        body: dict[str, Any] = {
            "msgid": msgid,
            "aibotid": self.bot_id,
            "chattype": "group" if group else "single",
            "from": {"userid": user},
            "create_time": int(time.time()),
            "msgtype": "text",
            "text": {"content": text},
        }
        if group:
            body["chatid"] = group
        addressed = group is None or mention
        return self._submit_threadsafe(self._push(body, addressed))

    def push_again(self, pushed: Pushed) -> Pushed:
        """The same message pushed again (same msgid), with a fresh req_id."""
        body: dict[str, Any] = {
            "msgid": pushed.msgid,
            "aibotid": self.bot_id,
            "chattype": "single" if pushed.chat == pushed.user else "group",
            "from": {"userid": pushed.user},
            "msgtype": "text",
            "text": {"content": pushed.text},
        }
        if pushed.chat != pushed.user:
            body["chatid"] = pushed.chat
        return self._submit_threadsafe(self._push(body, True))

    def _submit_threadsafe(self, coro: Any) -> Pushed:
        loop = self._loop
        if loop is None:
            raise RuntimeError("the fake robot is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("call write() from another thread, or await push()")
        result: Pushed = asyncio.run_coroutine_threadsafe(coro, loop).result(10)
        return result

    async def push(self, body: dict[str, Any], addressed: bool = True) -> Pushed:
        """`write`'s coroutine, for a caller on any loop."""
        return await self._on_server_loop(self._push(body, addressed))

    async def _push(self, body: dict[str, Any], addressed: bool) -> Pushed:
        socket = self._socket
        user = str(body["from"]["userid"])
        chat = str(body.get("chatid") or user)
        req_id = None
        if addressed and socket is not None and not socket.closed:
            req_id = f"cb_{secrets.token_hex(8)}"
            with self._lock:
                self._req_ids[req_id] = (self._connection, str(body["msgid"]), chat)
            frame = {"cmd": "aibot_msg_callback", "headers": {"req_id": req_id}, "body": body}
            try:
                await socket.send_str(json.dumps(frame))
            except ConnectionError:
                req_id = None
        text = str(body["text"]["content"])
        pushed = Pushed(str(body["msgid"]), chat, user, text, req_id, self._connection)
        with self._lock:
            self._pushed.append(pushed)
        self._notify()
        return pushed

    async def drop_connection(self) -> None:
        socket = self._socket
        if socket is not None:
            await self._on_server_loop(socket.close())

    # -- the socket ---------------------------------------------------------------------

    async def _serve(self, request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        subscribed = False
        async for message in socket:
            if message.type != WSMsgType.TEXT:
                break
            frame = json.loads(message.data)
            with self._lock:
                self.frames.append(frame)
            cmd = frame.get("cmd")
            req_id = str((frame.get("headers") or {}).get("req_id") or "")
            body = frame.get("body") or {}
            if not subscribed:
                ok = (
                    cmd == "aibot_subscribe"
                    and body.get("bot_id") == self.bot_id
                    and body.get("secret") == self.secret
                )
                await self._answer(socket, req_id, 0 if ok else 40001, "ok" if ok else "invalid")
                if not ok:
                    break
                subscribed = True
                await self._take_over(socket)
                continue
            if cmd == "ping":
                if self.answer_pings:
                    await self._answer(socket, req_id, 0, "ok")
            elif cmd == "aibot_respond_msg":
                await self._answer(socket, req_id, *self._respond(socket, req_id, body))
            elif cmd == "aibot_send_msg":
                await self._answer(socket, req_id, *self._send(body))
            else:
                await self._answer(socket, req_id, INVALID, f"unknown cmd {cmd}")
        if self._socket is socket:
            self._socket = None
        self._notify()
        return socket

    async def _take_over(self, socket: web.WebSocketResponse) -> None:
        old = self._socket
        self._socket = socket
        self._connection += 1
        self.connections += 1
        self._notify()
        if old is not None and not old.closed:
            event = {
                "cmd": "aibot_event_callback",
                "headers": {"req_id": f"ev_{secrets.token_hex(6)}"},
                "body": {"msgtype": "event", "event": {"eventtype": "disconnected_event"}},
            }
            try:
                await old.send_str(json.dumps(event))
            finally:
                await old.close()

    async def _answer(
        self, socket: web.WebSocketResponse, req_id: str, errcode: int, errmsg: str
    ) -> None:
        await socket.send_str(
            json.dumps({"headers": {"req_id": req_id}, "errcode": errcode, "errmsg": errmsg})
        )

    def _record(self, chat: str, text: str, reply_to: str | None, how: str) -> None:
        mentions = frozenset(_MENTION.findall(text))
        shown = _MENTION.sub(lambda m: f"@{m.group(1)}", text)
        with self._lock:
            self._sent.append(RobotSent(chat, shown, reply_to, how, mentions, time.time()))
        self._notify()

    def _respond(
        self, socket: web.WebSocketResponse, req_id: str, body: dict[str, Any]
    ) -> tuple[int, str]:
        with self._lock:
            found = self._req_ids.get(req_id)
        if found is None or found[0] != self._connection or socket is not self._socket:
            return INVALID, "invalid req_id"
        stream = body.get("stream") or {}
        content = str(stream.get("content") or "")
        if body.get("msgtype") != "stream" or not stream.get("id"):
            return INVALID, "invalid stream"
        if len(content.encode()) > CONTENT_LIMIT:
            return INVALID, "content exceed max length"
        if stream.get("finish") and stream["id"] not in self._streams:
            self._streams.add(str(stream["id"]))
            self._record(found[2], content, found[1], "respond")
        return 0, "ok"

    def _send(self, body: dict[str, Any]) -> tuple[int, str]:
        chat = str(body.get("chatid") or "")
        content = str((body.get("markdown") or {}).get("content") or "")
        if body.get("msgtype") != "markdown" or not chat or not content:
            return INVALID, "invalid markdown"
        if len(content.encode()) > CONTENT_LIMIT:
            return INVALID, "content exceed max length"
        self._record(chat, content, None, "send")
        return 0, "ok"
