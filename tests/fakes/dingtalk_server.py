"""A fake DingTalk open platform for tests: stream mode (the connection a robot opens and
the callbacks pushed on it), the app's access token, the robot API's sends and the
session webhooks, written from DingTalk's documentation and its official stream SDK.

Sources (open.dingtalk.com/document, open-dingtalk.github.io/developerpedia, and
open-dingtalk/dingtalk-stream-sdk-python):
- "Stream mode protocol": `POST /v1.0/gateway/connections/open` with `clientId`,
  `clientSecret` and `subscriptions` ([{type: CALLBACK, topic:
  /v1.0/im/bot/messages/get}]) answers an `endpoint` and a `ticket`; the client opens
  the WebSocket `endpoint?ticket=...` (a ticket is good for one connection). Frames are
  JSON text: {specVersion, type SYSTEM|EVENT|CALLBACK, headers {appId, connectionId,
  contentType, messageId, time, topic}, data (a JSON string)}. The client answers each
  frame with {code: 200, headers {contentType, messageId}, message: "OK", data}; a
  SYSTEM `ping` is answered with its own data; a SYSTEM `disconnect` tells the client to
  reconnect, and the server closes the connection soon after. A pushed frame that gets
  no ack is pushed again (with the same messageId; the SDK caches acks by it), to one of
  the app's open connections.
- "Receive messages" (robot callback data): msgId, conversationId, conversationType
  ("1" one-to-one, "2" group), senderId, senderStaffId, senderNick, chatbotUserId,
  isInAtList, atUsers, createAt (ms), sessionWebhook, sessionWebhookExpiredTime (ms),
  robotCode, msgtype, text {content}. In a group only messages that @ the robot reach it,
  with the @ cut from the text.
- "Reply through the session webhook": POST {msgtype markdown, markdown {title, text},
  at {atUserIds, isAtAll}} to the sessionWebhook until sessionWebhookExpiredTime; it
  answers {errcode, errmsg} (HTTP 200). A robot may post about 20 messages a minute to a
  conversation; past that errcode 130101 ("send too fast"). The code for an expired
  webhook is the fake's own (300001): DingTalk's pages name the expiry time, not a code.
- "Get the access token of an internal app" (`POST /v1.0/oauth2/accessToken` {appKey,
  appSecret} -> {accessToken, expireIn 7200}); the robot API (`POST
  /v1.0/robot/groupMessages/send` {robotCode, openConversationId, msgKey, msgParam},
  `POST /v1.0/robot/oToMessages/batchSend` {robotCode, userIds, msgKey, msgParam} ->
  {processQueryKey, invalidStaffIdList, flowControlledStaffIdList}) with the header
  `x-acs-dingtalk-access-token`; an expired or unknown token is HTTP 401 `{"code":
  "InvalidAuthentication"}`, too many calls HTTP 429 `{"code": "Throttling..."}`. Neither
  API takes a key that makes a repeated request idempotent.

`deliver(callback)` pushes a callback the way DingTalk does: pushed, and pushed again
after each of `retry_delays` until a frame acks it within `ack_timeout`; with no
connection open an attempt fails at once. Every attempt is logged in `deliveries`.

``with FakeDingTalk.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import random
import time
import uuid as uuidlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from tests.fakes._serving import LocalApiServer

DEFAULT_CLIENT_ID = "dingfakeclient0000"
DEFAULT_CLIENT_SECRET = "fakeDingTalkClientSecret0123456789"
BOT_MESSAGE_TOPIC = "/v1.0/im/bot/messages/get"
#: DingTalk does not publish its re-push schedule; tests set their own.
RETRY_DELAYS = (5.0, 30.0, 300.0)
ACK_TIMEOUT = 5.0
WEBHOOK_LIFETIME = 5400.0  # about 90 minutes, as peers observe
WEBHOOK_PER_MINUTE = 20
MARKDOWN_LIMIT = 5000
SEND_TOO_FAST = 130101
WEBHOOK_EXPIRED = 300001

Payload = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered request: ``method`` is ``"POST <path>"`` (``POST /webhook`` for a
    session webhook)."""

    method: str
    body: Mapping[str, Any]
    status: int
    code: str
    at: float


@dataclass(frozen=True, slots=True)
class Message:
    """A message in a conversation, as DingTalk stores it."""

    msg_id: str
    conversation_id: str
    sender: str  # a userId, or "bot"
    text: str
    at_users: tuple[str, ...] = ()
    at_all: bool = False
    via: str = ""  # "webhook" or "api" for the robot's
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    outcome: str  # "acked", or why not


@dataclass(frozen=True, slots=True)
class Delivery:
    """One callback's pushes so far."""

    number: int
    message_id: str  # the frame's headers.messageId, the same in every push
    data: Mapping[str, Any]
    attempts: tuple[Attempt, ...] = ()
    finished: bool = False

    @property
    def delivered(self) -> bool:
        return any(a.outcome == "acked" for a in self.attempts)


@dataclass
class _Connection:
    ws: web.WebSocketResponse
    connection_id: str
    pending: dict[str, asyncio.Future[int]] = dataclasses.field(default_factory=dict)


class _Refused(Exception):
    def __init__(self, status: int, code: str, msg: str) -> None:
        super().__init__(msg)
        self.status, self.code, self.msg = status, code, msg


class FakeDingTalk(LocalApiServer[ApiCall]):
    """A scriptable DingTalk open platform; see the module docstring."""

    _thread_name = "fake-dingtalk"

    def __init__(
        self,
        *,
        client_id: str = DEFAULT_CLIENT_ID,
        client_secret: str = DEFAULT_CLIENT_SECRET,
        retry_delays: Sequence[float] = RETRY_DELAYS,
        ack_timeout: float = ACK_TIMEOUT,
        token_expire: int = 7200,
        webhook_lifetime: float = WEBHOOK_LIFETIME,
        webhook_per_minute: int = WEBHOOK_PER_MINUTE,
    ) -> None:
        super().__init__()
        self.client_id = client_id
        self.client_secret = client_secret
        self.retry_delays = tuple(retry_delays)
        self.ack_timeout = ack_timeout
        self.token_expire = token_expire
        self.webhook_lifetime = webhook_lifetime
        self.webhook_per_minute = webhook_per_minute
        self.bot_user_id = "$:LWCP_v1:$bot" + client_id
        #: The address people's callbacks name for session webhooks and the endpoint
        #: (a proxy in front of the fake); None = the fake's own.
        self.public_url: str | None = None
        self._ids = itertools.count(1)
        self._tokens: dict[str, float] = {}
        self._tickets: set[str] = set()
        self._webhooks: dict[str, tuple[str, float, str]] = {}  # id -> (conv, expires, kind)
        self._webhook_posts: dict[str, list[float]] = {}  # by conversation
        self._groups: dict[str, str] = {}  # openConversationId -> title
        self._dms: dict[str, str] = {}  # userId -> conversationId
        self._people: dict[str, str] = {}  # userId -> nick
        self._messages: list[Message] = []
        self._faults: list[tuple[int, str]] = []
        self._deliveries: list[Delivery] = []
        self._connections: list[_Connection] = []
        self._tasks: set[asyncio.Future[Any]] = set()
        self.refusals = 0

    def _next(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}{uuidlib.uuid4().hex[:16]}"

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1.0/oauth2/accessToken", self._token)
        app.router.add_post("/v1.0/gateway/connections/open", self._open)
        app.router.add_get("/connect", self._socket)
        app.router.add_post("/robot/sendBySession", self._webhook)
        app.router.add_post("/v1.0/robot/{kind}/{action}", self._robot)
        return app

    def _root(self) -> str:
        return (self.public_url or self.url).rstrip("/")

    # -- scripting --------------------------------------------------------------------

    def fail_next(self, status: int, code: str, count: int = 1) -> None:
        """The next `count` robot API sends fail with HTTP `status` and DingTalk `code`
        (e.g. 429 and "Throttling.Api", 503 and "ServiceUnavailable")."""
        with self._lock:
            self._faults.extend([(status, code)] * count)

    def clear_faults(self) -> None:
        """Drop the failures `fail_next` scripted and not yet answered."""
        with self._lock:
            self._faults.clear()

    def expire_tokens(self) -> None:
        """Every token handed out so far expires now."""
        with self._lock:
            self._tokens = dict.fromkeys(self._tokens, 0.0)

    def expire_webhooks(self) -> None:
        """Every session webhook handed out so far expires now."""
        with self._lock:
            self._webhooks = {k: (c, 0.0, kind) for k, (c, _, kind) in self._webhooks.items()}

    def add_person(self, nick: str) -> str:
        """A person of the organization; returns their userId (staffId)."""
        user = f"user{next(self._ids):04d}"
        with self._lock:
            self._people[user] = nick
        return user

    def dm(self, user: str) -> str:
        """The one-to-one conversation of `user` and the robot."""
        with self._lock:
            if user not in self._dms:
                self._dms[user] = self._next("cidDM")
            return self._dms[user]

    def group(self, title: str) -> str:
        """A group the robot is in; returns its openConversationId."""
        conversation = self._next("cidGROUP")
        with self._lock:
            self._groups[conversation] = title
        return conversation

    def user_message(
        self, conversation: str, user: str, text: str, *, mention: bool = True
    ) -> Payload | None:
        """`user` writes `text` in `conversation`: the message is stored, and its
        callback's data returned, or None for a group message that does not @ the robot
        (DingTalk hands the robot none)."""
        return self.write(conversation, user, text, mention=mention)[1]

    def write(
        self, conversation: str, user: str, text: str, *, mention: bool = True
    ) -> tuple[str, Payload | None]:
        """`user_message`, with the message's msgId."""
        group = conversation in self._groups
        msg_id = self._next("msg")
        now = time.time()
        with self._lock:
            self._messages.append(
                Message(
                    msg_id, conversation, user, text, ("bot",) if group and mention else (), at=now
                )
            )
            webhook = self._next("wh")
            self._webhooks[webhook] = (
                conversation,
                now + self.webhook_lifetime,
                "group" if group else "dm",
            )
            nick = self._people.get(user, user)
        self._notify()
        if group and not mention:
            return msg_id, None
        data: Payload = {
            "conversationId": conversation,
            "chatbotCorpId": "dingcorpfake",
            "chatbotUserId": self.bot_user_id,
            "msgId": msg_id,
            "senderNick": nick,
            "isAdmin": False,
            "senderStaffId": user,
            "sessionWebhookExpiredTime": int((now + self.webhook_lifetime) * 1000),
            "createAt": int(now * 1000),
            "senderCorpId": "dingcorpfake",
            "conversationType": "2" if group else "1",
            "senderId": f"$:LWCP_v1:${user}",
            "sessionWebhook": f"{self._root()}/robot/sendBySession?session={webhook}",
            "robotCode": self.client_id,
            "msgtype": "text",
            "text": {"content": f" {text}" if group else text},
        }
        if group:
            data["conversationTitle"] = self._groups[conversation]
            data["isInAtList"] = True
            data["atUsers"] = [{"dingtalkId": self.bot_user_id}]
        return msg_id, data

    def bot_messages(self) -> list[Message]:
        with self._lock:
            return [m for m in self._messages if m.sender == "bot"]

    def wait_for_bot_messages(self, count: int, timeout: float = 10.0) -> list[Message]:
        return self._wait_blocking(
            lambda: found if len(found := self.bot_messages()) >= count else None,
            timeout,
            async_method="wait_for_bot_messages_async",
            describe_timeout=lambda: f"{len(self.bot_messages())} of {count} bot messages",
        )

    async def wait_for_bot_messages_async(self, count: int) -> list[Message]:
        return await self._on_server_loop(
            self._until(lambda: found if len(found := self.bot_messages()) >= count else None)
        )

    # -- pushes -----------------------------------------------------------------------

    async def deliver(self, data: Mapping[str, Any]) -> Delivery:
        """Push a robot callback the way DingTalk does (see the module docstring); returns
        the finished delivery. Runs in the caller's event loop (any loop)."""
        message_id = uuidlib.uuid4().hex
        with self._lock:
            number = len(self._deliveries)
            self._deliveries.append(Delivery(number, message_id, data))
        self._notify()
        try:
            for attempt in itertools.count():
                sent_at = time.time()
                outcome = await self._on_server_loop(self._push(message_id, data))
                self._update(number, Attempt(sent_at, outcome))
                if outcome == "acked" or attempt >= len(self.retry_delays):
                    break
                await asyncio.sleep(self.retry_delays[attempt])
        finally:
            self._update(number, None)
        return self.deliveries[number]

    def deliver_soon(self, data: Mapping[str, Any]) -> concurrent.futures.Future[Delivery]:
        """Start `deliver` in the fake's own loop, from any thread."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeDingTalk is not running")

        async def tracked() -> Delivery:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                return await self.deliver(data)
            finally:
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(tracked(), loop)

    async def _push(self, message_id: str, data: Mapping[str, Any]) -> str:
        with self._lock:
            open_ = [c for c in self._connections if not c.ws.closed]
        if not open_:
            return "no connection open"
        connection = random.choice(open_)  # one of the app's connections
        frame = {
            "specVersion": "1.0",
            "type": "CALLBACK",
            "headers": {
                "appId": self.client_id,
                "connectionId": connection.connection_id,
                "contentType": "application/json",
                "messageId": message_id,
                "time": str(int(time.time() * 1000)),
                "topic": BOT_MESSAGE_TOPIC,
            },
            "data": json.dumps(data, ensure_ascii=False),
        }
        answered: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        connection.pending[message_id] = answered
        try:
            await connection.ws.send_str(json.dumps(frame, ensure_ascii=False))
            async with asyncio.timeout(self.ack_timeout):
                code = await answered
        except TimeoutError:
            return "no ack in time"
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            return f"connection failed: {exc!r}"
        finally:
            connection.pending.pop(message_id, None)
        return "acked" if code == 200 else f"acked with code {code}"

    async def system(self, topic: str) -> list[Payload]:
        """Send a SYSTEM frame (`ping`, `disconnect`) on every connection; the acks that
        came back within `ack_timeout` (a `disconnect` is then closed by the server)."""

        async def send() -> list[Payload]:
            with self._lock:
                connections = [c for c in self._connections if not c.ws.closed]
            acks = []
            for connection in connections:
                message_id = uuidlib.uuid4().hex
                waiting: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                if topic != "disconnect":
                    connection.pending[message_id] = waiting
                data = json.dumps({"opaque": message_id})
                frame = {
                    "specVersion": "1.0",
                    "type": "SYSTEM",
                    "headers": {
                        "messageId": message_id,
                        "topic": topic,
                        "contentType": "application/json",
                    },
                    "data": data,
                }
                await connection.ws.send_str(json.dumps(frame))
                if topic == "disconnect":
                    await asyncio.sleep(0.2)
                    await connection.ws.close()
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.ack_timeout):
                        acks.append(await waiting)
                connection.pending.pop(message_id, None)
            return acks

        return await self._on_server_loop(send())

    def _update(self, number: int, attempt: Attempt | None) -> None:
        with self._lock:
            delivery = self._deliveries[number]
            if attempt is None:
                delivery = dataclasses.replace(delivery, finished=True)
            else:
                delivery = dataclasses.replace(delivery, attempts=(*delivery.attempts, attempt))
            self._deliveries[number] = delivery
        self._notify()

    @property
    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(1 for c in self._connections if not c.ws.closed)

    def wait_for_connections(self, count: int = 1, timeout: float = 10.0) -> int:
        return self._wait_blocking(
            lambda: self.connections if self.connections >= count else None,
            timeout,
            async_method="deliver",
            describe_timeout=lambda: f"{self.connections} of {count} connections in {timeout}s",
        )

    async def stop(self) -> None:
        pending = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(Exception):
                await connection.ws.close()
        await super().stop()

    # -- the stream connection --------------------------------------------------------

    async def _open(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        if body.get("clientId") != self.client_id or body.get("clientSecret") != self.client_secret:
            self.refusals += 1
            return web.json_response(
                {"code": "InvalidClient", "message": "clientId or clientSecret is invalid"},
                status=401,
            )
        topics = [s.get("topic") for s in body.get("subscriptions") or () if isinstance(s, Mapping)]
        if BOT_MESSAGE_TOPIC not in topics:
            return web.json_response(
                {"code": "InvalidSubscription", "message": "no subscription"}, status=400
            )
        ticket = uuidlib.uuid4().hex
        with self._lock:
            self._tickets.add(ticket)
        root = self._root().replace("http://", "ws://", 1)
        return web.json_response({"endpoint": f"{root}/connect", "ticket": ticket})

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        with self._lock:
            known = ticket in self._tickets
            self._tickets.discard(ticket)
        if not known:
            return web.json_response({"code": "InvalidTicket", "message": "ticket"}, status=401)
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        connection = _Connection(ws, self._next("conn"))
        with self._lock:
            self._connections.append(connection)
        self._notify()
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    continue
                try:
                    ack = json.loads(message.data)
                    message_id = str(ack["headers"]["messageId"])
                except (ValueError, KeyError, TypeError):
                    continue
                waiting = connection.pending.get(message_id)
                if waiting is not None and not waiting.done():
                    if isinstance(waiting, asyncio.Future) and ack.get("data", "").startswith(
                        '{"opaque"'
                    ):
                        waiting.set_result(ack)
                    else:
                        waiting.set_result(int(ack.get("code") or 0))
        finally:
            with self._lock:
                self._connections.remove(connection)
            for waiting in connection.pending.values():
                if not waiting.done():
                    waiting.set_exception(ConnectionError("the connection closed"))
            self._notify()
        return ws

    # -- the token and the sends ------------------------------------------------------

    async def _token(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        if body.get("appKey") != self.client_id or body.get("appSecret") != self.client_secret:
            self.refusals += 1
            self._log_call(
                ApiCall(
                    "POST /v1.0/oauth2/accessToken", {}, 400, "invalidClientSecret", time.time()
                )
            )
            return web.json_response(
                {"code": "invalidClientSecret", "message": "appSecret is invalid"}, status=400
            )
        token = uuidlib.uuid4().hex
        with self._lock:
            self._tokens[token] = time.monotonic() + self.token_expire
        self._log_call(ApiCall("POST /v1.0/oauth2/accessToken", {}, 200, "", time.time()))
        return web.json_response({"accessToken": token, "expireIn": self.token_expire})

    def _post(
        self, conversation: str, text: str, at_users: Sequence[str], at_all: bool, via: str
    ) -> Message:
        if len(text) > MARKDOWN_LIMIT:
            raise _Refused(400, "param.textTooLong", "the text is too long")
        message = Message(
            self._next("bot"), conversation, "bot", text, tuple(at_users), at_all, via, time.time()
        )
        with self._lock:
            self._messages.append(message)
        self._notify()
        return message

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        session = request.query.get("session", "")
        now = time.time()
        with self._lock:
            found = self._webhooks.get(session)
            # The pace is the robot's in a conversation, whichever webhook posts.
            posts = self._webhook_posts.setdefault(found[0] if found else session, [])
            posts[:] = [t for t in posts if t > now - 60]
            busy = len(posts) >= self.webhook_per_minute
            if found is not None and found[1] > now and not busy:
                posts.append(now)
        try:
            if found is None:
                raise _Refused(200, "300001", "session webhook not found")
            conversation, expires, _ = found
            if expires <= now:
                raise _Refused(200, str(WEBHOOK_EXPIRED), "session webhook expired")
            if busy:
                raise _Refused(200, str(SEND_TOO_FAST), "send too fast, exceed 20 times per minute")
            kind = body.get("msgtype")
            content = body.get(kind) if isinstance(kind, str) else None
            if kind not in ("text", "markdown") or not isinstance(content, Mapping):
                raise _Refused(200, "40035", "invalid msgtype")
            text = str(content.get("text") if kind == "markdown" else content.get("content") or "")
            at = body.get("at") if isinstance(body.get("at"), Mapping) else {}
            assert isinstance(at, Mapping)
            self._post(
                conversation,
                text,
                list(at.get("atUserIds") or ()),
                bool(at.get("isAtAll")),
                "webhook",
            )
        except _Refused as exc:
            self._log_call(ApiCall("POST /webhook", body, 200, exc.code, now))
            return web.json_response({"errcode": int(exc.code), "errmsg": exc.msg})
        self._log_call(ApiCall("POST /webhook", body, 200, "0", now))
        return web.json_response({"errcode": 0, "errmsg": "ok"})

    async def _robot(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        method = f"POST {request.path}"
        try:
            token = request.headers.get("x-acs-dingtalk-access-token", "")
            with self._lock:
                until = self._tokens.get(token)
            if until is None or until <= time.monotonic():
                raise _Refused(401, "InvalidAuthentication", "不合法的access_token")
            with self._lock:
                fault = self._faults.pop(0) if self._faults else None
            if fault is not None:
                raise _Refused(*fault, "scripted failure")
            if body.get("robotCode") != self.client_id:
                raise _Refused(400, "resource.not.found", "robot not found")
            if body.get("msgKey") != "sampleMarkdown":
                raise _Refused(400, "invalidParameter.msgKey", "unsupported msgKey")
            param = json.loads(str(body.get("msgParam") or "{}"))
            text = str(param.get("text") or "")
            kind = request.match_info["kind"], request.match_info["action"]
            if kind == ("groupMessages", "send"):
                conversation = str(body.get("openConversationId") or "")
                if conversation not in self._groups:
                    raise _Refused(400, "resource.not.found", "conversation not found")
                self._post(conversation, text, (), False, "api")
                answer: Payload = {"processQueryKey": self._next("pqk")}
            elif kind == ("oToMessages", "batchSend"):
                users = [str(u) for u in body.get("userIds") or ()]
                invalid = [u for u in users if u not in self._people]
                for user in users:
                    if user not in invalid:
                        self._post(self.dm(user), text, (), False, "api")
                answer = {
                    "processQueryKey": self._next("pqk"),
                    "invalidStaffIdList": invalid,
                    "flowControlledStaffIdList": [],
                }
            else:
                raise _Refused(404, "NotFound", "no such API")
        except _Refused as exc:
            self._log_call(ApiCall(method, body, exc.status, exc.code, time.time()))
            headers = {"Retry-After": "1"} if exc.status == 429 else None
            return web.json_response(
                {"code": exc.code, "message": exc.msg, "requestid": uuidlib.uuid4().hex},
                status=exc.status,
                headers=headers,
            )
        self._log_call(ApiCall(method, body, 200, "", time.time()))
        return web.json_response(answer)


async def _json(request: web.Request) -> Payload:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
