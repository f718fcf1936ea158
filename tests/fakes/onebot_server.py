"""A fake OneBot v11 implementation (a QQ account served by NapCat) that speaks the real
wire protocol, for tests: an aiohttp server on 127.0.0.1 at a free port whose forward
WebSocket (`/`, `/api`, `/event`) the gateway's QQ channel reaches as it reaches NapCat.

Written from the OneBot v11 standard (github.com/botuniverse/onebot-11:
communication/ws.md for the forward WebSocket, its paths and retcodes;
communication/authorization.md for the access token; api/README.md for the answers'
status and retcode; api/public.md for send_private_msg, send_group_msg, send_msg,
get_msg, get_login_info, get_friend_list, get_group_list; event/message.md and
event/meta.md for message, lifecycle and heartbeat events; message/array.md,
message/string.md and message/segment.md for segments and CQ codes), and, where the
standard is silent, from NapCat's source (NapNeko/NapCatQQ, packages/napcat-onebot:
network/websocket-server.ts for authorization, paths, broadcast and heartbeats;
network/index.ts and index.ts for events dropped while no client is connected;
action/OneBotAction.ts for retcodes 1400 and 1200 and the answer's fields;
action/go-cqhttp/GetGroupMsgHistory.ts and GetFriendMsgHistory.ts for the history;
napcat-common/src/message-unique.ts for message ids; napcat-core/helper/event.ts for
how a send fails; api/msg.ts for the message event's fields). What it keeps, each
checked by tests/test_fake_onebot.py with a plain WebSocket client:

Connections and authorization
- The implementation is the server. A connection to `/api` (or `/api/`) carries API
  calls only; any other path (`/`, `/event`) gets API calls and every event, starting
  with a lifecycle `connect` meta event, then a `heartbeat` meta event every
  `heartbeat_interval` seconds.
- With an access token set, a connection must carry it (`Authorization: Bearer` or
  `?access_token=`, the query first); a wrong or missing one gets
  `{"status": "failed", "retcode": 1403, "message": "token验证失败"}` and is closed.

What OneBot keeps and confirms: nothing
- An event is written to the event connections open at that moment, each once, in the
  order made; with none open it is dropped (NapCat's `isActive`): a later connection
  gets nothing from before it. No client acknowledges anything.
- Every message is kept in its conversation's history (a group, or a private chat with
  one person, the bot's own messages included), which `get_group_msg_history` and
  `get_friend_msg_history` (go-cqhttp's, in NapCat and Lagrange.OneBot) read: `count`
  messages oldest first, the newest ones, or, with `message_seq` (NapCat) or `message_id`
  (Lagrange), the ones up to and including that message; none gives retcode 1200
  "消息…不存在". `history=False` plays an implementation without them (retcode 1404).
- `redeliver` writes a message's event again (what a second network adapter, or a
  client's reconnect racing the history, does): the same message reaches the bot twice.

Calls
- `{"action", "params", "echo"}`, answered `{"status", "retcode", "data", "message",
  "wording", "echo"}` with the request's echo: "ok" and 0; "failed" with 1400 for a
  request it cannot read (bad JSON, a missing parameter), 1404 for an action it does not
  have ("不支持的API"), 1200 for one that failed, with NapCat's message.
- `message` parameters take a CQ-code string (parsed unless `auto_escape`), a segment
  array (text segments are text, never parsed), or one segment. `at` with `qq = all`
  notifies everyone in a group (`pings_everyone`). A `reply` naming a message the
  implementation does not know is left out and the rest sent (NapCat's "回复消息不存在").
- A message id is NapCat's: the first 31 bits of the MD5 of the message's internal id,
  chat type and peer, the same in the event, the history and `get_msg`.
- Sending fails as NapCat's send does: to a group the bot is muted in, or to someone who
  is neither a friend nor reached through a group, retcode 1200 "EventChecker Failed"
  (QQ refused it: nothing was sent); a text longer than `max_text_chars` (QQ publishes
  no limit; 4,500 characters is this fake's assumption) likewise.

Scripting, in the running event loop or from a test thread (``FakeOneBot.in_thread()``)::

    with FakeOneBot.in_thread() as qq:
        qq.add_friend(20001, "Alice")
        qq.add_group(30001, "Town", {20001: "Alice"})
        qq.user_message(20001, "hello")                              # a private chat
        qq.user_message(20001, qq.mention("hi"), group_id=30001)     # @-mentions the bot
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes._serving import LocalApiServer

DEFAULT_TOKEN = "kit-onebot-token"
SELF_ID = 10001
MAX_TEXT_CHARS = 4500
APP_NAME = "NapCat.Onebot"
APP_VERSION = "4.8.0"

Payload = dict[str, Any]

_CQ = re.compile(r"\[CQ:([A-Za-z0-9_.\-]+)((?:,[^\]]*)?)\]")


def short_id(internal: int, chat_type: int, peer: int) -> int:
    """NapCat's message id (`MessageUnique.createUniqueMsgId`): the first four bytes of the
    MD5 of `<msgId>|<chatType>|<peerUid>`, its sign bit cleared."""
    digest = bytearray(hashlib.md5(f"{internal}|{chat_type}|{peer}".encode()).digest())
    digest[0] &= 0x7F
    return int.from_bytes(digest[:4], "big")


def _unescape(text: str) -> str:
    return (
        text.replace("&#91;", "[").replace("&#93;", "]").replace("&#44;", ",").replace("&amp;", "&")
    )


def _escape(text: str, *, in_code: bool = False) -> str:
    text = text.replace("&", "&amp;").replace("[", "&#91;").replace("]", "&#93;")
    return text.replace(",", "&#44;") if in_code else text


def parse_cq(message: str) -> list[Payload]:
    """A CQ-code string as segments (message/string.md)."""
    segments: list[Payload] = []
    position = 0
    for code in _CQ.finditer(message):
        if code.start() > position:
            segments.append(
                {"type": "text", "data": {"text": _unescape(message[position : code.start()])}}
            )
        data = {}
        for pair in code.group(2).split(",")[1:]:
            key, _, value = pair.partition("=")
            data[key] = _unescape(value)
        segments.append({"type": code.group(1), "data": data})
        position = code.end()
    if position < len(message):
        segments.append({"type": "text", "data": {"text": _unescape(message[position:])}})
    return segments


def to_cq(segments: list[Payload]) -> str:
    """Segments as a CQ-code string (`raw_message`)."""
    out = []
    for segment in segments:
        if segment["type"] == "text":
            out.append(_escape(str(segment["data"].get("text", ""))))
        else:
            params = "".join(
                f",{k}={_escape(str(v), in_code=True)}"
                for k, v in segment["data"].items()
                if k != "file" or not str(v).startswith("base64://")
            )
            out.append(f"[CQ:{segment['type']}{params}]")
    return "".join(out)


class Refused(Exception):
    """An answer of status "failed" with a retcode and NapCat's message."""

    def __init__(self, retcode: int, message: str) -> None:
        super().__init__(message)
        self.retcode, self.message = retcode, message


@dataclass(frozen=True, slots=True)
class Call:
    """One API call the fake answered (or left unanswered: `status` "cut")."""

    method: str
    params: Payload
    status: str
    retcode: int
    at: float
    path: str


@dataclass
class Record:
    """One message as QQ holds it."""

    internal: int  # QQ's own id of the message (NapCat's `msgId`)
    message_id: int
    kind: str  # "private" or "group"
    peer: int  # the group, or the other person of a private chat
    sender: int
    time: int
    segments: list[Payload]
    temp_group: int | None = None  # a temporary chat opened from this group
    pings_everyone: bool = False
    files: dict[str, bytes] = field(default_factory=dict)
    #: When the fake made it (its own clock, to the microsecond: QQ's `time` is seconds).
    made_at: float = field(default_factory=time.time)

    @property
    def conversation(self) -> str:
        return f"{self.kind}:{self.peer}"


@dataclass
class _Fault:
    action: str
    retcode: int = 1200
    message: str = ""
    cut: bool = False  # carry it out, then drop the connection without an answer
    silent: bool = False  # carry it out and never answer


@dataclass
class _Conn:
    ws: web.WebSocketResponse
    events: bool
    path: str
    transport: Any
    queue: asyncio.Queue[Payload] = field(default_factory=asyncio.Queue)


class FakeOneBot(LocalApiServer[Call]):
    """A QQ account behind NapCat's OneBot v11 forward WebSocket (see the module docstring)."""

    _thread_name = "fake-onebot"

    def __init__(
        self,
        *,
        self_id: int = SELF_ID,
        nickname: str = "kit-bot",
        access_token: str | None = DEFAULT_TOKEN,
        max_text_chars: int = MAX_TEXT_CHARS,
        heartbeat_interval: float = 30.0,
        history: bool = True,
        message_format: str = "array",
    ) -> None:
        super().__init__()
        self.self_id = self_id
        self.nickname = nickname
        self.access_token = access_token
        self.max_text_chars = max_text_chars
        self.heartbeat_interval = heartbeat_interval
        self.history = history
        self.message_format = message_format
        self.names: dict[int, str] = {self_id: nickname}
        self.friends: set[int] = set()
        self.groups: dict[int, Payload] = {}
        self.muted: set[int] = set()
        self.records: dict[int, Record] = {}  # by message id
        self.conversations: dict[str, list[Record]] = {}
        self.bot_sent: list[Record] = []
        self.events_sent: list[tuple[str, Payload]] = []  # (path, event)
        self.downloads: dict[str, bytes] = {}
        self._internal = itertools.count(7_300_000_000_000_000_001)
        self._conns: list[_Conn] = []
        self._faults: list[_Fault] = []
        self._clock: int | None = None
        self._heartbeats: asyncio.Task[None] | None = None

    # -- the world ---------------------------------------------------------------------

    def now(self) -> int:
        """QQ's clock (Unix seconds); `freeze_clock` holds it, so messages share a second."""
        return self._clock if self._clock is not None else int(time.time())

    def freeze_clock(self, at: int | None) -> None:
        self._clock = at

    def add_friend(self, user_id: int, nickname: str) -> None:
        with self._lock:
            self.names[user_id] = nickname
            self.friends.add(user_id)

    def add_group(self, group_id: int, name: str, members: dict[int, str]) -> None:
        with self._lock:
            self.names.update(members)
            self.groups[group_id] = {"name": name, "members": {self.self_id, *members}}

    def mute(self, group_id: int, muted: bool = True) -> None:
        """The bot muted in a group (its sends there fail), or not."""
        with self._lock:
            (self.muted.add if muted else self.muted.discard)(group_id)

    def mention(self, text: str, who: int | None = None) -> list[Payload]:
        """Segments of a message that @-mentions `who` (the bot by default), as a QQ
        client makes them: the `at`, then the text after a space."""
        return [
            {"type": "at", "data": {"qq": str(who or self.self_id)}},
            {"type": "text", "data": {"text": f" {text}"}},
        ]

    def quote(self, message_id: int, text: str) -> list[Payload]:
        """Segments of a message that quotes message `message_id`."""
        return [
            {"type": "reply", "data": {"id": str(message_id)}},
            {"type": "text", "data": {"text": text}},
        ]

    def image_segment(self, data: bytes, name: str = "pic.png") -> Payload:
        """An image a person sends: QQ gives its download address."""
        key = hashlib.sha1(data).hexdigest()
        with self._lock:
            self.downloads[key] = data
        return {
            "type": "image",
            "data": {
                "file": name,
                "url": f"{self.url}/download/{key}",
                "file_size": str(len(data)),
            },
        }

    def user_message(
        self,
        user_id: int,
        message: str | list[Payload],
        *,
        group_id: int | None = None,
        temp_group: int | None = None,
    ) -> Record:
        """`user_id` writes `message` (plain text, or segments) in their private chat with
        the bot, or in group `group_id`: kept in the history, pushed to the event
        connections open now."""
        segments = (
            [{"type": "text", "data": {"text": message}}] if isinstance(message, str) else message
        )
        with self._lock:
            if group_id is not None:
                group = self.groups.get(group_id)
                if group is None or user_id not in group["members"]:
                    raise ValueError(f"{user_id} is not in group {group_id}")
                record = self._save("group", group_id, user_id, segments)
            else:
                reachable = user_id in self.friends or (
                    temp_group is not None
                    and user_id in self.groups.get(temp_group, {}).get("members", ())
                )
                if not reachable:
                    raise ValueError(f"{user_id} is neither a friend nor in group {temp_group}")
                record = self._save("private", user_id, user_id, segments, temp_group=temp_group)
            self._push(self.event_of(record))
        self._notify()
        return record

    def redeliver(self, message_id: int) -> None:
        """Write a message's event again to the event connections open now."""
        with self._lock:
            self._push(self.event_of(self.records[message_id]))
        self._notify()

    def bot_messages(self) -> list[Record]:
        with self._lock:
            return list(self.bot_sent)

    def fail_next(
        self,
        action: str,
        *,
        retcode: int = 1200,
        message: str = "",
        cut: bool = False,
        silent: bool = False,
        times: int = 1,
    ) -> None:
        """The next `times` calls of `action` fail: answered "failed" with `retcode`, or
        (`cut`) carried out and their connection dropped before the answer, or (`silent`)
        carried out and never answered."""
        with self._lock:
            self._faults.extend(_Fault(action, retcode, message, cut, silent) for _ in range(times))

    def drop_connections(self) -> None:
        """Cut every WebSocket without a close frame (the process went away)."""
        loop = self._loop
        if loop is None:
            return

        def drop() -> None:
            for conn in list(self._conns):
                if isinstance(conn.transport, asyncio.Transport):
                    conn.transport.abort()

        loop.call_soon_threadsafe(drop)

    @property
    def event_connections(self) -> int:
        with self._lock:
            return sum(1 for conn in self._conns if conn.events)

    # -- messages ------------------------------------------------------------------------

    def _save(
        self,
        kind: str,
        peer: int,
        sender: int,
        segments: list[Payload],
        *,
        temp_group: int | None = None,
    ) -> Record:
        internal = next(self._internal)
        chat_type = 2 if kind == "group" else (100 if temp_group else 1)
        message_id = short_id(internal, chat_type, peer)
        everyone = kind == "group" and any(
            s["type"] == "at" and str(s["data"].get("qq")) == "all" for s in segments
        )
        record = Record(
            internal, message_id, kind, peer, sender, self.now(), segments, temp_group, everyone
        )
        self.records[message_id] = record
        self.conversations.setdefault(record.conversation, []).append(record)
        return record

    def event_of(self, record: Record) -> Payload:
        """The message as NapCat reports it (`OB11Message`, api/msg.ts)."""
        own = record.sender == self.self_id
        sender: Payload = {"user_id": record.sender, "nickname": self.names.get(record.sender, "")}
        event: Payload = {
            "self_id": self.self_id,
            "user_id": record.sender,
            "time": record.time,
            "message_id": record.message_id,
            "message_seq": record.message_id,
            "real_id": record.message_id,
            "real_seq": str(record.internal % 100000),
            "message_type": record.kind,
            "sender": sender,
            "raw_message": to_cq(record.segments),
            "font": 14,
            "message_format": self.message_format,
            "post_type": "message_sent" if own else "message",
        }
        if self.message_format == "string":
            event["message"] = to_cq(record.segments)
        else:
            event["message"] = [dict(s, data=dict(s["data"])) for s in record.segments]
        if record.kind == "group":
            event["sub_type"] = "normal"
            event["group_id"] = record.peer
            event["group_name"] = self.groups.get(record.peer, {}).get("name", "")
            sender["card"] = ""
            sender["role"] = "member"
        else:
            event["sub_type"] = "group" if record.temp_group else "friend"
            event["target_id"] = record.peer
            if record.temp_group:
                event["group_id"] = record.temp_group
                event["temp_source"] = 0
        return event

    def _push(self, event: Payload) -> None:
        """Write `event` to every event connection open now (under the lock)."""
        loop = self._loop
        for conn in self._conns:
            if not conn.events:
                continue
            self.events_sent.append((conn.path, event))
            if loop is not None:
                loop.call_soon_threadsafe(conn.queue.put_nowait, event)

    # -- serving -------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/download/{key}", self._download)
        app.router.add_get("/{path:.*}", self._websocket)
        app.on_startup.append(self._start_heartbeats)
        app.on_cleanup.append(self._stop_heartbeats)
        return app

    async def _download(self, request: web.Request) -> web.Response:
        with self._lock:
            data = self.downloads.get(request.match_info["key"])
        if data is None:
            return web.Response(status=404)
        return web.Response(body=data, content_type="image/png")

    async def _start_heartbeats(self, app: web.Application) -> None:
        self._heartbeats = asyncio.ensure_future(self._beat())

    async def _stop_heartbeats(self, app: web.Application) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            beat = {
                "time": self.now(),
                "self_id": self.self_id,
                "post_type": "meta_event",
                "meta_event_type": "heartbeat",
                "status": {"online": True, "good": True},
                "interval": int(self.heartbeat_interval * 1000),
            }
            with self._lock:
                for conn in self._conns:
                    if conn.events:
                        conn.queue.put_nowait(beat)

    def _authorized(self, request: web.Request) -> bool:
        if not self.access_token:
            return True
        query = request.query.get("access_token", "")
        header = request.headers.get("Authorization", "").split("Bearer ")[-1]
        return (query or header) == self.access_token

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return web.Response(status=426, text="a WebSocket server")
        ws = web.WebSocketResponse(autoping=True, max_msg_size=64 * 1024 * 1024)
        await ws.prepare(request)
        path = request.path
        if not self._authorized(request):
            await ws.send_str(json.dumps(_answer(None, "failed", 1403, "token验证失败", None)))
            await ws.close()
            return ws
        conn = _Conn(
            ws, events=path not in ("/api", "/api/"), path=path, transport=request.transport
        )
        writer = asyncio.ensure_future(self._write(conn))
        with self._lock:
            self._conns.append(conn)
            if conn.events:
                conn.queue.put_nowait(
                    {
                        "time": self.now(),
                        "self_id": self.self_id,
                        "post_type": "meta_event",
                        "meta_event_type": "lifecycle",
                        "sub_type": "connect",
                    }
                )
        self._notify()
        try:
            async for frame in ws:
                if frame.type.name != "TEXT":
                    continue
                await self._handle(conn, frame.data)
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            self._notify()
        return ws

    async def _write(self, conn: _Conn) -> None:
        while True:
            payload = await conn.queue.get()
            if conn.ws.closed:
                return
            try:
                await conn.ws.send_str(json.dumps(payload, ensure_ascii=False))
            except (ConnectionError, RuntimeError):
                return

    async def _handle(self, conn: _Conn, raw: str) -> None:
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            conn.queue.put_nowait(
                _answer(None, "failed", 1400, "json解析失败,请检查数据格式", None)
            )
            return
        action = str(request.get("action") or "")
        params = request.get("params") if isinstance(request.get("params"), dict) else {}
        echo = request.get("echo")
        fault = self._take_fault(action)
        status, retcode = "ok", 0
        try:
            if fault is not None and not (fault.cut or fault.silent):
                raise Refused(fault.retcode, fault.message or "发生错误")
            data = self._carry_out(action, params)
            answer = _answer(data, "ok", 0, "", echo)
        except Refused as exc:
            status, retcode = "failed", exc.retcode
            answer = _answer(None, "failed", exc.retcode, exc.message, echo)
        if fault is not None and fault.cut:
            self._log_call(Call(action, params, "cut", retcode, time.time(), conn.path))
            if isinstance(conn.transport, asyncio.Transport):
                conn.transport.abort()
            return
        if fault is not None and fault.silent:
            self._log_call(Call(action, params, "silent", retcode, time.time(), conn.path))
            return
        self._log_call(Call(action, params, status, retcode, time.time(), conn.path))
        conn.queue.put_nowait(answer)

    def _take_fault(self, action: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.action == action:
                    self._faults.remove(fault)
                    return fault
        return None

    # -- actions ---------------------------------------------------------------------------

    def _carry_out(self, action: str, params: Payload) -> Any:
        handler = {
            "get_login_info": lambda p: {"user_id": self.self_id, "nickname": self.nickname},
            "get_version_info": lambda p: {
                "app_name": APP_NAME,
                "protocol_version": "v11",
                "app_version": APP_VERSION,
            },
            "get_status": lambda p: {"online": True, "good": True},
            "get_friend_list": self._friend_list,
            "get_group_list": self._group_list,
            "send_private_msg": lambda p: self._send(p, "private"),
            "send_group_msg": lambda p: self._send(p, "group"),
            "send_msg": lambda p: self._send(p, None),
            "get_msg": self._get_msg,
        }.get(action)
        if self.history:
            handler = handler or {
                "get_group_msg_history": lambda p: self._history(p, "group"),
                "get_friend_msg_history": lambda p: self._history(p, "private"),
            }.get(action)
        if handler is None:
            raise Refused(1404, f"不支持的API {action}")
        with self._lock:
            return handler(params)

    def _friend_list(self, params: Payload) -> list[Payload]:
        return [
            {"user_id": uid, "nickname": self.names.get(uid, ""), "remark": ""}
            for uid in sorted(self.friends)
        ]

    def _group_list(self, params: Payload) -> list[Payload]:
        return [
            {
                "group_id": gid,
                "group_name": group["name"],
                "member_count": len(group["members"]),
                "max_member_count": 500,
            }
            for gid, group in sorted(self.groups.items())
        ]

    def _get_msg(self, params: Payload) -> Payload:
        record = self.records.get(_integer(params, "message_id"))
        if record is None:
            raise Refused(1200, "消息不存在")
        event = self.event_of(record)
        event.pop("post_type", None)
        return event

    def _history(self, params: Payload, kind: str) -> Payload:
        peer = _integer(params, "group_id" if kind == "group" else "user_id")
        count = _integer(params, "count", default=20)
        anchor = params.get("message_seq") or params.get("message_id")
        messages = self.conversations.get(f"{kind}:{peer}", [])
        if anchor not in (None, "", 0, "0"):
            try:
                wanted = int(anchor)
            except (TypeError, ValueError):
                raise Refused(1400, "message_seq: Expected number") from None
            at = next((i for i, r in enumerate(messages) if r.message_id == wanted), None)
            messages = [] if at is None else messages[: at + 1]
        chosen = messages[-count:] if count > 0 else []
        if not chosen:
            raise Refused(1200, f"消息{anchor}不存在")
        return {"messages": [self.event_of(r) for r in chosen]}

    def _send(self, params: Payload, kind: str | None) -> Payload:
        if kind is None:
            kind = str(
                params.get("message_type") or ("group" if params.get("group_id") else "private")
            )
        if "message" not in params:
            raise Refused(1400, "Key: message, Message: Required property")
        segments = self._segments(params.get("message"), bool(params.get("auto_escape")))
        if not segments:
            raise Refused(1200, "消息体无法解析, 请检查是否发送了不支持的消息类型")
        text = sum(len(str(s["data"].get("text", ""))) for s in segments if s["type"] == "text")
        if text > self.max_text_chars:
            raise Refused(1200, _checker_failed("the message is too long"))
        temp_group = None
        if kind == "group":
            peer = _integer(params, "group_id")
            if peer not in self.groups:
                raise Refused(1200, "群不存在")
            if peer in self.muted:
                raise Refused(1200, _checker_failed("the bot is muted in this group"))
        else:
            peer = _integer(params, "user_id")
            group = params.get("group_id")
            if group not in (None, ""):
                temp_group = int(group)
                if self.self_id not in self.groups.get(temp_group, {}).get("members", ()):
                    raise Refused(1200, "无法获取用户信息")
            elif peer not in self.friends:
                raise Refused(1200, _checker_failed("not a friend"))
        files: dict[str, bytes] = {}
        for segment in segments:
            source = str(segment["data"].get("file") or "")
            if segment["type"] in ("image", "file", "record", "video") and source.startswith(
                "base64://"
            ):
                try:
                    files[segment["type"]] = base64.b64decode(
                        source[len("base64://") :], validate=True
                    )
                except ValueError:
                    raise Refused(1200, "文件处理失败: invalid base64") from None
        record = self._save(kind, peer, self.self_id, segments, temp_group=temp_group)
        record.files = files
        self.bot_sent.append(record)
        self._notify()
        return {"message_id": record.message_id}

    def _segments(self, message: Any, auto_escape: bool) -> list[Payload]:
        if isinstance(message, str):
            return (
                [{"type": "text", "data": {"text": message}}] if auto_escape else parse_cq(message)
            )
        if isinstance(message, dict):
            message = [message]
        if not isinstance(message, list):
            raise Refused(1400, "message: Expected union value")
        found = []
        for item in message:
            if not isinstance(item, dict) or not isinstance(item.get("type"), str):
                raise Refused(1400, "message: Expected union value")
            data = item.get("data") if isinstance(item.get("data"), dict) else {}
            if item["type"] == "at":
                qq = str(data.get("qq", ""))
                if not (qq.isdigit() or qq == "all"):
                    raise Refused(1400, "at: qq must be a QQ number or all")
            if item["type"] == "reply" and _known_id(data.get("id"), self.records) is None:
                continue  # NapCat: "回复消息不存在", the quote left out, the rest sent
            found.append({"type": item["type"], "data": dict(data)})
        return found


def _answer(data: Any, status: str, retcode: int, message: str, echo: Any) -> Payload:
    """An answer as NapCat words it (`OB11Response`)."""
    return {
        "status": status,
        "retcode": retcode,
        "data": data,
        "message": message,
        "wording": message,
        "echo": echo,
        "stream": "normal-action",
    }


def _checker_failed(why: str) -> str:
    """NapCat's message when QQ refused a send at once (`callNormalEventV2`'s checker)."""
    return (
        "EventChecker Failed: NTEvent serviceAndMethod:NodeIKernelMsgService/sendMsg "
        f"ListenerName:NodeIKernelMsgListener/onMsgInfoListUpdate EventRet:\n"
        f'{{"result": 1, "errMsg": "{why}"}}\n'
    )


def _known_id(value: Any, records: dict[int, Record]) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number in records else None


def _integer(params: Payload, name: str, *, default: int | None = None) -> int:
    value = params.get(name, default)
    if value is None:
        raise Refused(1400, f"Key: {name}, Message: Required property")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise Refused(1400, f"Key: {name}, Message: Expected number") from None
