"""A fake Feishu / Lark open platform for tests: the IM API the gateway calls, and the event
pushes that call the gateway (the long connection, or HTTP callbacks), written from the
open platform's documentation and its official SDK.

Sources (open.feishu.cn/document; the same pages on open.larksuite.com for Lark):
- "Get tenant_access_token (self-built app)", `auth/v3/tenant_access_token/internal`:
  the token lasts `expire` seconds (7,200); a call with an expired or unknown one fails
  with code 99991663 ("Invalid access token for authorization").
- "Send message" (`POST /open-apis/im/v1/messages?receive_id_type=chat_id`), "Reply to a
  message" (`POST .../messages/:message_id/reply`, `reply_in_thread`) and "Edit a
  message" (`PUT .../messages/:message_id`, text and post only, 20 edits per message,
  only the sender's own): a request's `uuid` makes Feishu send at most one message per
  uuid within an hour (a repeat answers the message it made); a bot may send 5 messages
  a second to one chat, past that code 230020 ("the operation triggers the frequency
  limit"); a text message's content holds 150 KB, a post's 30 KB (code 230025 past it).
- "Message overview" (`message_id` om_..., `root_id`, `parent_id`, `thread_id` omt_... of
  a topic) and "Receive message" (`im.message.receive_v1`, in the version 2.0 envelope:
  `schema`, `header` {event_id, event_type, create_time, token, app_id, tenant_key},
  `event` {sender {sender_id {open_id, union_id, user_id}, sender_type}, message
  {message_id, root_id, parent_id, create_time, chat_id, thread_id, chat_type p2p|group,
  message_type, content (a JSON string), mentions [{key @_user_N, id {open_id...},
  name}]}}).
- "Upload image" (`POST /open-apis/im/v1/images`, image_type message), "Upload file"
  (`POST /open-apis/im/v1/files`), "Get resources in a message" (`GET .../messages/
  :message_id/resources/:file_key?type=image|file`), "Obtain bot information" (`GET
  /open-apis/bot/v3/info`), "Get a single user's info" (`GET /open-apis/contact/v3/users/
  :user_id`).
- "Receive events through the long connection": the app's SDK asks
  `POST /callback/ws/endpoint` (AppID, AppSecret) for a WebSocket URL and a ClientConfig
  (PingInterval, Reconnect*); events come as protobuf `pbbp2.Frame`s (lark-oapi's
  `ws/pb/pbbp2.proto`: method 0 control, 1 data; headers `type` ping|pong|event,
  `message_id`, `sum`, `seq`, `trace_id`); the client answers a data frame with the same
  frame carrying `{"code": 200}`. "The message must be processed within 3 seconds without
  an exception, or the timeout re-push is triggered"; pushes are in cluster mode: each
  event goes to one of the app's connections (at most 50), chosen at random.
- "Configure the callback address" / "Event subscription" (HTTP mode): the event is
  POSTed as `{"encrypt": base64(iv + AES-256-CBC(SHA-256(encrypt_key), event))}` with
  `X-Lark-Request-Timestamp`, `X-Lark-Request-Nonce` and `X-Lark-Signature` =
  hex SHA-256(timestamp + nonce + encrypt_key + body); the address is verified first with
  a `url_verification` request holding a `challenge` to echo. "The app must answer with
  HTTP 200 within 3 seconds, else Feishu considers the push failed and pushes it again
  after 15 seconds, 5 minutes, 1 hour and 6 hours, at most 4 times"; dedupe by event_id.
  The long connection's re-push follows the same schedule (peers saw the same msg_id again
  about 20 s later, then an hour and six hours later: QwenPaw #886).

Both modes share `deliver`: an event is pushed, and pushed again after each of
`retry_delays` (Feishu's `FEISHU_RETRY_DELAYS`; tests compress it) until it is
acknowledged (a `{"code": 200}` frame, or an HTTP 2xx, within `ack_timeout`); with no
connection open (the gateway down) an attempt fails at once. `fake.mode` says where the
app's events go ("websocket" or "webhook", the console's subscription mode). Every
attempt is logged in `deliveries`.

People and chats are the test's: `add_person`, `p2p_chat`, `group_chat`, and
`user_message` (a text message; `mention` the bot, `thread_of` a message to write in its
thread), `image_message`, `file_message`; each stores the message and returns the event
envelope (a fresh event_id) for `deliver`. `bot_messages()` lists what the bot sent,
edits applied. `fail_next(status, code)` scripts the next API answers.

``with FakeFeishu.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import time
import uuid as uuidlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tests.fakes._serving import LocalApiServer, at_least

DEFAULT_APP_ID = "cli_a5fake0000feishu"
DEFAULT_APP_SECRET = "fakeFeishuAppSecret0123456789abc"
DEFAULT_ENCRYPT_KEY = "fakeFeishuEncryptKey42"
DEFAULT_VERIFICATION_TOKEN = "fakeFeishuVerificationToken"
TENANT_KEY = "2ca1d211f64f6438"
BOT_NAME = "Gateway Bot"
#: Feishu's re-push after a failed push: 15 s, 5 min, 1 h, 6 h.
FEISHU_RETRY_DELAYS = (15.0, 300.0, 3600.0, 21600.0)
ACK_TIMEOUT = 3.0
TEXT_LIMIT = 150 * 1024
POST_LIMIT = 30 * 1024
EDIT_LIMIT = 20
CHAT_QPS = 5
UUID_WINDOW = 3600.0

#: Feishu's error codes the fake answers, by name.
TOKEN_INVALID = 99991663
RATE_LIMITED = 230020
CONTENT_TOO_LONG = 230025
INVALID_CONTENT = 230001
BOT_NOT_IN_CHAT = 230002
#: A message that cannot be edited any more (the fake's own code: Feishu's pages name
#: the limit, 20 edits, not the code).
NOT_EDITABLE = 230075
INVALID_PARAM = 99992402

Payload = dict[str, Any]

_AT_ALL = re.compile(r"<at\s+(?:user_)?id\s*=\s*\"?all\"?", re.IGNORECASE)
_AT_ID = re.compile(r"<at\s+(?:user_)?id\s*=\s*\"?(ou_[0-9a-f]+)\"?", re.IGNORECASE)


# --------------------------------------------------------------------------- the frame


def _frame_class() -> Any:
    """`pbbp2.Frame` built with the protobuf runtime from its .proto (independent of the
    channel's own codec)."""
    kinds = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="pbbp2.proto", package="pbbp2")
    file.syntax = "proto2"
    header = file.message_type.add(name="Header")
    header.field.add(name="key", number=1, type=kinds.TYPE_STRING, label=kinds.LABEL_REQUIRED)
    header.field.add(name="value", number=2, type=kinds.TYPE_STRING, label=kinds.LABEL_REQUIRED)
    frame = file.message_type.add(name="Frame")
    for name, number, kind, label in (
        ("SeqID", 1, kinds.TYPE_UINT64, kinds.LABEL_REQUIRED),
        ("LogID", 2, kinds.TYPE_UINT64, kinds.LABEL_REQUIRED),
        ("service", 3, kinds.TYPE_INT32, kinds.LABEL_REQUIRED),
        ("method", 4, kinds.TYPE_INT32, kinds.LABEL_REQUIRED),
        ("payload_encoding", 6, kinds.TYPE_STRING, kinds.LABEL_OPTIONAL),
        ("payload_type", 7, kinds.TYPE_STRING, kinds.LABEL_OPTIONAL),
        ("payload", 8, kinds.TYPE_BYTES, kinds.LABEL_OPTIONAL),
        ("LogIDNew", 9, kinds.TYPE_STRING, kinds.LABEL_OPTIONAL),
    ):
        frame.field.add(name=name, number=number, type=kind, label=label)
    frame.field.add(
        name="headers",
        number=5,
        type=kinds.TYPE_MESSAGE,
        label=kinds.LABEL_REPEATED,
        type_name=".pbbp2.Header",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("pbbp2.Frame"))


PbFrame = _frame_class()


def frame_headers(frame: Any) -> dict[str, str]:
    return {h.key: h.value for h in frame.headers}


def make_frame(method: int, service: int, headers: Mapping[str, str], payload: bytes = b"") -> Any:
    frame = PbFrame(SeqID=0, LogID=0, service=service, method=method)
    for key, value in headers.items():
        frame.headers.add(key=key, value=value)
    if payload:
        frame.payload = payload
    return frame


# --------------------------------------------------------------------------- callbacks


def encrypt(plaintext: bytes, encrypt_key: str, iv: bytes | None = None) -> str:
    """An event as Feishu encrypts it for a callback."""
    key = hashlib.sha256(encrypt_key.encode()).digest()
    iv = iv or os.urandom(16)
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return base64.b64encode(iv + encryptor.update(padded) + encryptor.finalize()).decode()


def sign(timestamp: str, nonce: str, encrypt_key: str, body: bytes) -> str:
    return hashlib.sha256((timestamp + nonce + encrypt_key).encode() + body).hexdigest()


# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered API request: ``method`` is ``"<HTTP method> <path pattern>"``."""

    method: str
    path: str
    body: Mapping[str, Any]
    status: int
    code: int
    response: Mapping[str, Any]
    at: float


@dataclass(slots=True)
class Message:
    """A message in a chat, as Feishu stores it."""

    message_id: str
    chat_id: str
    sender: str  # an open_id, or "bot"
    msg_type: str
    content: str  # a JSON string
    create_time: float
    root_id: str = ""
    parent_id: str = ""
    thread_id: str = ""
    uuid: str = ""
    edits: int = 0
    mentions: tuple[str, ...] = ()

    def item(self) -> Payload:
        """The message as the API answers it."""
        return {
            "message_id": self.message_id,
            "root_id": self.root_id,
            "parent_id": self.parent_id,
            "thread_id": self.thread_id,
            "msg_type": self.msg_type,
            "create_time": str(int(self.create_time * 1000)),
            "update_time": str(int(self.create_time * 1000)),
            "deleted": False,
            "updated": self.edits > 0,
            "chat_id": self.chat_id,
            "sender": {
                "id": DEFAULT_APP_ID if self.sender == "bot" else self.sender,
                "id_type": "app_id" if self.sender == "bot" else "open_id",
                "sender_type": "app" if self.sender == "bot" else "user",
                "tenant_key": TENANT_KEY,
            },
            "body": {"content": self.content},
        }


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    answered_at: float
    outcome: str  # "acked", or why not


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event's pushes so far."""

    number: int
    event_id: str
    envelope: Mapping[str, Any]
    attempts: tuple[Attempt, ...] = ()
    finished: bool = False

    @property
    def delivered(self) -> bool:
        return any(a.outcome == "acked" for a in self.attempts)


@dataclass
class _Connection:
    ws: web.WebSocketResponse
    service: int
    pending: dict[str, asyncio.Future[int]] = dataclasses.field(default_factory=dict)


class _Refused(Exception):
    def __init__(self, status: int, code: int, msg: str) -> None:
        super().__init__(msg)
        self.status, self.code, self.msg = status, code, msg


class FakeFeishu(LocalApiServer[ApiCall]):
    """A scriptable Feishu open platform; see the module docstring."""

    _thread_name = "fake-feishu"

    def __init__(
        self,
        *,
        app_id: str = DEFAULT_APP_ID,
        app_secret: str = DEFAULT_APP_SECRET,
        encrypt_key: str = DEFAULT_ENCRYPT_KEY,
        verification_token: str = DEFAULT_VERIFICATION_TOKEN,
        mode: str = "websocket",
        retry_delays: Sequence[float] = FEISHU_RETRY_DELAYS,
        ack_timeout: float = ACK_TIMEOUT,
        token_expire: int = 7200,
        chat_qps: int = CHAT_QPS,
        ping_interval: int = 120,
    ) -> None:
        super().__init__()
        self.app_id = app_id
        self.app_secret = app_secret
        self.encrypt_key = encrypt_key
        self.verification_token = verification_token
        self.mode = mode
        self.retry_delays = tuple(retry_delays)
        self.ack_timeout = ack_timeout
        self.token_expire = token_expire
        self.chat_qps = chat_qps
        self.ping_interval = ping_interval
        self.webhook_url: str | None = None
        #: Split a pushed event's payload over this many frames (`sum`, `seq`).
        self.frame_parts = 1
        self.bot_open_id = "ou_" + hashlib.md5(app_id.encode()).hexdigest()
        self.clock_offset = 0.0
        self._ids = itertools.count(1)
        self._tokens: dict[str, float] = {}
        self._people: dict[str, str] = {}  # open_id -> name
        self._chats: dict[str, tuple[str, set[str]]] = {}  # chat_id -> (type, members)
        self._messages: dict[str, Message] = {}
        self._order: list[str] = []  # message ids, oldest first
        self._uuids: dict[str, tuple[str, float]] = {}
        self._sends: dict[str, list[float]] = {}
        self._resources: dict[str, tuple[str, bytes, str]] = {}  # key -> (kind, data, name)
        self._faults: list[tuple[int, int]] = []
        self._deliveries: list[Delivery] = []
        self._connections: list[_Connection] = []
        self._tickets: set[str] = set()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.endpoint_refusals = 0

    def now(self) -> float:
        return time.time() + self.clock_offset

    def _next(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}{uuidlib.uuid4().hex[:24]}"

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/callback/ws/endpoint", self._endpoint)
        app.router.add_get("/ws", self._socket)
        app.router.add_route("*", "/open-apis/{tail:.*}", self._api)
        return app

    # -- scripting --------------------------------------------------------------------

    def fail_next(
        self, status: int, code: int, count: int = 1, *, after: int = 0, clear: bool = False
    ) -> None:
        """After `after` more sends (create, reply) go through, the next `count` fail
        with HTTP `status` and Feishu `code` (e.g. 503 and 1, or 429 and 99991400);
        `clear` first drops what was scripted before."""
        with self._lock:
            if clear:
                self._faults.clear()
            self._faults.extend([(0, 0)] * after + [(status, code)] * count)

    def expire_tokens(self) -> None:
        """Every token handed out so far expires now."""
        with self._lock:
            self._tokens = dict.fromkeys(self._tokens, 0.0)

    # -- people and chats -------------------------------------------------------------

    def add_person(self, name: str) -> str:
        open_id = "ou_" + hashlib.md5(f"{self.app_id}:{name}".encode()).hexdigest()
        with self._lock:
            self._people[open_id] = name
        return open_id

    def p2p_chat(self, open_id: str) -> str:
        """The direct chat between a person and the bot (made on first use)."""
        chat_id = "oc_" + hashlib.md5(f"p2p:{open_id}".encode()).hexdigest()
        with self._lock:
            self._chats.setdefault(chat_id, ("p2p", {open_id, self.bot_open_id}))
        return chat_id

    def group_chat(self, name: str, members: Sequence[str], *, with_bot: bool = True) -> str:
        chat_id = "oc_" + hashlib.md5(f"group:{name}".encode()).hexdigest()
        people = set(members) | ({self.bot_open_id} if with_bot else set())
        with self._lock:
            _, known = self._chats.setdefault(chat_id, ("group", set()))
            known.update(people)
        return chat_id

    def join(self, chat_id: str, open_id: str) -> None:
        with self._lock:
            self._chats[chat_id][1].add(open_id)

    # -- messages from people ---------------------------------------------------------

    def _store(self, message: Message) -> None:
        with self._lock:
            self._messages[message.message_id] = message
            self._order.append(message.message_id)
        self._notify()

    def _thread_of(self, root: Message) -> str:
        with self._lock:
            if not root.thread_id:
                root.thread_id = self._next("omt_")
            return root.thread_id

    def _envelope(self, message: Message, mentions: list[Payload]) -> Payload:
        with self._lock:
            chat_type = self._chats[message.chat_id][0]
        body: Payload = {
            "message_id": message.message_id,
            "root_id": message.root_id,
            "parent_id": message.parent_id,
            "create_time": str(int(message.create_time * 1000)),
            "update_time": str(int(message.create_time * 1000)),
            "chat_id": message.chat_id,
            "chat_type": chat_type,
            "message_type": message.msg_type,
            "content": message.content,
            "user_agent": "Mozilla/5.0 Lark/7.30.0",
        }
        if message.thread_id:
            body["thread_id"] = message.thread_id
        if mentions:
            body["mentions"] = mentions
        return {
            "schema": "2.0",
            "header": {
                "event_id": uuidlib.uuid4().hex,
                "event_type": "im.message.receive_v1",
                "create_time": str(int(self.now() * 1000)),
                "token": self.verification_token,
                "app_id": self.app_id,
                "tenant_key": TENANT_KEY,
            },
            "event": {
                "sender": {
                    "sender_id": {
                        "union_id": "on_" + message.sender[3:],
                        "user_id": message.sender[3:11],
                        "open_id": message.sender,
                    },
                    "sender_type": "user",
                    "tenant_key": TENANT_KEY,
                },
                "message": body,
            },
        }

    def _mention(self, number: int, open_id: str) -> Payload:
        with self._lock:
            name = BOT_NAME if open_id == self.bot_open_id else self._people.get(open_id, "")
        return {
            "key": f"@_user_{number}",
            "id": {
                "union_id": "on_" + open_id[3:],
                "user_id": open_id[3:11],
                "open_id": open_id,
            },
            "name": name,
            "tenant_key": TENANT_KEY,
        }

    def _user_message(
        self,
        chat_id: str,
        sender: str,
        msg_type: str,
        content: Payload,
        *,
        mentions: Sequence[str] = (),
        reply_to: str | None = None,
        thread_of: str | None = None,
        sent_at: float | None = None,
    ) -> Payload:
        with self._lock:
            if chat_id not in self._chats or sender not in self._chats[chat_id][1]:
                raise ValueError(f"{sender} is not in chat {chat_id}")
        message = Message(
            self._next("om_"),
            chat_id,
            sender,
            msg_type,
            json.dumps(content, ensure_ascii=False),
            sent_at if sent_at is not None else self.now(),
            mentions=tuple(mentions),
        )
        parent_id = thread_of or reply_to
        if parent_id:
            with self._lock:
                parent = self._messages[parent_id]
            message.parent_id = parent_id
            message.root_id = parent.root_id or parent_id
            if thread_of:
                message.thread_id = self._thread_of(parent)
                message.root_id = parent_id
            elif parent.thread_id:
                message.thread_id = parent.thread_id
        self._store(message)
        return self._envelope(
            message, [self._mention(n, who) for n, who in enumerate(mentions, start=1)]
        )

    def user_message(
        self,
        chat_id: str,
        sender: str,
        text: str,
        *,
        mention: Sequence[str] = (),
        reply_to: str | None = None,
        thread_of: str | None = None,
        sent_at: float | None = None,
    ) -> Payload:
        """A person's text message (`mention`: open_ids it @-mentions, placed before the
        text as Feishu's `@_user_N` keys): stored, and its event envelope returned."""
        keys = " ".join(f"@_user_{n}" for n in range(1, len(mention) + 1))
        content = {"text": f"{keys} {text}" if keys else text}
        return self._user_message(
            chat_id,
            sender,
            "text",
            content,
            mentions=mention,
            reply_to=reply_to,
            thread_of=thread_of,
            sent_at=sent_at,
        )

    def post_message(self, chat_id: str, sender: str, post: Payload, **options: Any) -> Payload:
        """A rich-text message (`post`: {"title", "content": [[elements]]})."""
        return self._user_message(chat_id, sender, "post", post, **options)

    def image_message(self, chat_id: str, sender: str, data: bytes) -> Payload:
        key = self._next("img_v3_")
        envelope = self._user_message(chat_id, sender, "image", {"image_key": key})
        with self._lock:
            self._resources[key] = (
                "image",
                data,
                envelope["event"]["message"]["message_id"],
            )
        return envelope

    def file_message(self, chat_id: str, sender: str, data: bytes, name: str) -> Payload:
        key = self._next("file_v3_")
        envelope = self._user_message(chat_id, sender, "file", {"file_key": key, "file_name": name})
        with self._lock:
            self._resources[key] = ("file", data, envelope["event"]["message"]["message_id"])
        return envelope

    # -- what the bot sent ------------------------------------------------------------

    def bot_messages(self) -> list[Message]:
        """Every message the bot sent, in the order Feishu took them (edits applied)."""
        with self._lock:
            return [
                dataclasses.replace(self._messages[m])
                for m in self._order
                if self._messages[m].sender == "bot"
            ]

    def message(self, message_id: str) -> Message:
        with self._lock:
            return dataclasses.replace(self._messages[message_id])

    @staticmethod
    def rendered(message: Message) -> str:
        """A message's text as a reader sees it (a post's `md` and text elements)."""
        try:
            content = json.loads(message.content)
        except ValueError:
            return message.content
        if message.msg_type == "text":
            return str(content.get("text") or "")
        if message.msg_type == "post":
            body = content.get("zh_cn") or content.get("en_us") or content
            lines = []
            for paragraph in body.get("content") or ():
                lines.append("".join(str(e.get("text") or "") for e in paragraph))
            return "\n".join(lines)
        return f"[{message.msg_type}]"

    @staticmethod
    def notifies(message: Message) -> tuple[frozenset[str], bool]:
        """(open_ids the message notifies, whether it notifies everyone): `<at>` tags in
        a text or an `md` element, `at` elements of a post."""
        try:
            content = json.loads(message.content)
        except ValueError:
            return frozenset(), False
        texts: list[str] = []
        ids: set[str] = set()
        everyone = False
        if message.msg_type == "text":
            texts.append(str(content.get("text") or ""))
        elif message.msg_type == "post":
            body = content.get("zh_cn") or content.get("en_us") or content
            for paragraph in body.get("content") or ():
                for element in paragraph:
                    if element.get("tag") == "at":
                        if element.get("user_id") == "all":
                            everyone = True
                        else:
                            ids.add(str(element.get("user_id")))
                    elif element.get("tag") == "md":
                        texts.append(str(element.get("text") or ""))
        for text in texts:
            everyone = everyone or bool(_AT_ALL.search(text))
            ids.update(_AT_ID.findall(text))
        return frozenset(ids), everyone

    # -- pushes -----------------------------------------------------------------------

    async def deliver(self, envelope: Mapping[str, Any]) -> Delivery:
        """Push an event the way Feishu does (see the module docstring); returns the
        finished delivery. Runs in the caller's event loop (any loop)."""
        with self._lock:
            number = len(self._deliveries)
            event_id = str(envelope["header"]["event_id"])
            self._deliveries.append(Delivery(number, event_id, envelope))
        self._notify()
        try:
            for attempt in itertools.count():
                sent_at = time.time()
                outcome = await self._push(envelope)
                self._update(number, Attempt(sent_at, time.time(), outcome))
                if outcome == "acked" or attempt >= len(self.retry_delays):
                    break
                await asyncio.sleep(self.retry_delays[attempt])
        finally:
            self._update(number, None)
        return self.deliveries[number]

    def deliver_soon(self, envelope: Mapping[str, Any]) -> concurrent.futures.Future[Delivery]:
        """Start `deliver` in the fake's own loop, from any thread."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeFeishu is not running")

        async def tracked() -> Delivery:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                return await self.deliver(envelope)
            finally:
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(tracked(), loop)

    async def _push(self, envelope: Mapping[str, Any]) -> str:
        if self.mode == "webhook":
            return await self._post_callback(envelope)
        return await self._on_server_loop(self._push_frame(envelope))

    async def _push_frame(self, envelope: Mapping[str, Any]) -> str:
        with self._lock:
            open_ = [c for c in self._connections if not c.ws.closed]
        if not open_:
            return "no connection open"
        connection = random.choice(open_)  # cluster mode: one of the app's connections
        frame_id = uuidlib.uuid4().hex
        payload = json.dumps(envelope, ensure_ascii=False).encode()
        size = -(-len(payload) // self.frame_parts)
        pieces = [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]
        answered: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        connection.pending[frame_id] = answered
        try:
            for seq, piece in enumerate(pieces):
                headers = {
                    "type": "event",
                    "message_id": frame_id,
                    "sum": str(len(pieces)),
                    "seq": str(seq),
                    "trace_id": uuidlib.uuid4().hex[:16],
                }
                frame = make_frame(1, connection.service, headers, piece)
                await connection.ws.send_bytes(frame.SerializeToString())
            async with asyncio.timeout(self.ack_timeout):
                code = await answered
        except TimeoutError:
            return "no answer within 3 s"
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            return f"connection failed: {exc!r}"
        finally:
            connection.pending.pop(frame_id, None)
        return "acked" if code == 200 else f"answered code {code}"

    def callback_request(
        self, envelope: Mapping[str, Any], *, encrypt_key: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """A callback's body and headers: encrypted and signed (with `encrypt_key`)."""
        key = self.encrypt_key if encrypt_key is None else encrypt_key
        plain = json.dumps(envelope, ensure_ascii=False).encode()
        body = json.dumps({"encrypt": encrypt(plain, key)}).encode()
        timestamp, nonce = str(int(self.now())), uuidlib.uuid4().hex[:16]
        return body, {
            "Content-Type": "application/json; charset=utf-8",
            "User-Agent": "Go-http-client/1.1",
            "X-Lark-Request-Timestamp": timestamp,
            "X-Lark-Request-Nonce": nonce,
            "X-Lark-Signature": sign(timestamp, nonce, key, body),
        }

    async def post_callback(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> tuple[int, str]:
        """POST a callback once; (status, body) of the answer."""
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=dict(headers)) as response,
        ):
            return response.status, await response.text()

    async def url_verification(self, url: str) -> tuple[int, str, str]:
        """Feishu's check of a callback address: a challenge to echo (encrypted, unsigned);
        (status, answer, the challenge sent)."""
        challenge = uuidlib.uuid4().hex
        envelope = {
            "challenge": challenge,
            "token": self.verification_token,
            "type": "url_verification",
        }
        plain = json.dumps(envelope).encode()
        body = json.dumps({"encrypt": encrypt(plain, self.encrypt_key)}).encode()
        status, text = await self.post_callback(url, body, {"Content-Type": "application/json"})
        return status, text, challenge

    async def _post_callback(self, envelope: Mapping[str, Any]) -> str:
        if self.webhook_url is None:
            return "no callback address set"
        body, headers = self.callback_request(envelope)
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                asyncio.timeout(self.ack_timeout),
                session.post(self.webhook_url, data=body, headers=headers) as response,
            ):
                await response.read()
                status = response.status
        except TimeoutError:
            return "no answer within 3 s"
        except aiohttp.ClientError as exc:
            return f"connection failed: {type(exc).__name__}"
        return "acked" if status == 200 else f"HTTP {status}"

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
        """Long connections open now."""
        with self._lock:
            return sum(1 for c in self._connections if not c.ws.closed)

    def wait_for_connections(self, count: int = 1, timeout: float = 10.0) -> int:
        return self._wait_blocking(
            lambda: self.connections if self.connections >= count else None,
            timeout,
            async_method="deliver",
            describe_timeout=lambda: f"{self.connections} of {count} connections in {timeout}s",
        )

    async def drop_connections(self) -> None:
        """Close every long connection (as Feishu does when it moves a client)."""

        async def close() -> None:
            with self._lock:
                connections = list(self._connections)
            for connection in connections:
                await connection.ws.close()

        await self._on_server_loop(close())

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

    # -- the long connection ----------------------------------------------------------

    async def _endpoint(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        if body.get("AppID") != self.app_id or body.get("AppSecret") != self.app_secret:
            self.endpoint_refusals += 1
            return web.json_response({"code": 514, "msg": "invalid app_id or app_secret"})
        ticket = uuidlib.uuid4().hex
        with self._lock:
            self._tickets.add(ticket)
        port = request.url.port
        url = (
            f"ws://127.0.0.1:{port}/ws?device_id={next(self._ids)}"
            f"&service_id={1000 + next(self._ids)}&ticket={ticket}"
        )
        config = {
            "ReconnectCount": -1,
            "ReconnectInterval": 120,
            "ReconnectNonce": 30,
            "PingInterval": self.ping_interval,
        }
        return web.json_response(
            {"code": 0, "msg": "ok", "data": {"URL": url, "ClientConfig": config}}
        )

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        with self._lock:
            known = ticket in self._tickets
            self._tickets.discard(ticket)
        if not known:
            return web.Response(
                status=403,
                headers={"handshake-status": "403", "handshake-msg": "invalid ticket"},
            )
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        connection = _Connection(ws, int(request.query.get("service_id", "0")))
        with self._lock:
            self._connections.append(connection)
        self._notify()
        try:
            async for message in ws:
                if message.type != WSMsgType.BINARY:
                    continue
                frame = PbFrame()
                frame.ParseFromString(message.data)
                headers = frame_headers(frame)
                if frame.method == 0 and headers.get("type") == "ping":
                    config = json.dumps({"PingInterval": self.ping_interval}).encode()
                    pong = make_frame(0, connection.service, {"type": "pong"}, config)
                    await ws.send_bytes(pong.SerializeToString())
                elif frame.method == 1:
                    waiting = connection.pending.get(headers.get("message_id", ""))
                    try:
                        code = int(json.loads(frame.payload or b"{}").get("code", 0))
                    except (ValueError, AttributeError):
                        code = 0
                    if waiting is not None and not waiting.done():
                        waiting.set_result(code)
        finally:
            with self._lock:
                self._connections.remove(connection)
            for waiting in connection.pending.values():
                if not waiting.done():
                    waiting.set_exception(ConnectionError("the connection closed"))
            self._notify()
        return ws

    # -- the open APIs ----------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        pattern = f"{request.method} /{tail}"
        body: Payload = {}
        try:
            if request.method == "POST" and tail == "auth/v3/tenant_access_token/internal":
                body = await request.json()
                answer = self._token(body)
                status = 200
                self._log_call(ApiCall(pattern, request.path, {}, status, 0, answer, time.time()))
                return web.json_response(answer)
            self._check_token(request)
            answer, pattern, body = await self._route(request, tail)
            if isinstance(answer, web.StreamResponse):
                self._log_call(ApiCall(pattern, request.path, body, 200, 0, {}, time.time()))
                return answer
            status, code = 200, 0
            answer = {"code": 0, "msg": "success", **answer}
        except _Refused as exc:
            status, code = exc.status, exc.code
            answer = {"code": exc.code, "msg": exc.msg}
        self._log_call(ApiCall(pattern, request.path, body, status, code, answer, time.time()))
        headers = {"x-ogw-ratelimit-reset": "1"} if code == RATE_LIMITED else None
        return web.json_response(answer, status=status, headers=headers)

    def _token(self, body: Mapping[str, Any]) -> Payload:
        if body.get("app_id") != self.app_id or body.get("app_secret") != self.app_secret:
            raise _Refused(400, 10014, "app secret invalid")
        token = "t-" + uuidlib.uuid4().hex
        with self._lock:
            self._tokens[token] = time.monotonic() + self.token_expire
        return {"code": 0, "msg": "ok", "tenant_access_token": token, "expire": self.token_expire}

    def _check_token(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip()
        with self._lock:
            until = self._tokens.get(token)
        if until is None or until <= time.monotonic():
            raise _Refused(400, TOKEN_INVALID, "Invalid access token for authorization.")

    async def _route(self, request: web.Request, tail: str) -> tuple[Any, str, Payload]:
        parts = tail.split("/")
        method = request.method
        if method == "GET" and tail == "bot/v3/info":
            bot = {
                "activate_status": 2,
                "app_name": BOT_NAME,
                "avatar_url": "",
                "ip_white_list": [],
                "open_id": self.bot_open_id,
            }
            return {"bot": bot}, "GET /bot/v3/info", {}
        if method == "POST" and tail == "im/v1/messages":
            body = await request.json()
            if request.query.get("receive_id_type") != "chat_id":
                raise _Refused(400, INVALID_PARAM, "receive_id_type must be chat_id here")
            sent = self._send(str(body.get("receive_id") or ""), body, parent=None)
            return {"data": sent.item()}, "POST /im/v1/messages", body
        if method == "POST" and len(parts) == 5 and parts[:3] == ["im", "v1", "messages"]:
            if parts[4] != "reply":
                raise _Refused(404, INVALID_PARAM, "not found")
            body = await request.json()
            with self._lock:
                parent = self._messages.get(parts[3])
            if parent is None:
                raise _Refused(400, 230011, "The message was withdrawn or does not exist.")
            sent = self._send(parent.chat_id, body, parent=parent)
            return {"data": sent.item()}, "POST /im/v1/messages/reply", body
        if method == "PUT" and len(parts) == 4 and parts[:3] == ["im", "v1", "messages"]:
            body = await request.json()
            edited = self._edit(parts[3], body)
            return {"data": edited.item()}, "PUT /im/v1/messages", body
        if method == "POST" and tail in ("im/v1/images", "im/v1/files"):
            form = await request.post()
            return self._upload(tail.rsplit("/", 1)[1], form), f"POST /{tail}", {}
        if method == "GET" and len(parts) == 6 and parts[4] == "resources":
            return (
                self._resource(parts[3], parts[5], request.query.get("type", "")),
                ("GET /im/v1/messages/resources"),
                {},
            )
        if method == "GET" and len(parts) == 4 and parts[:3] == ["contact", "v3", "users"]:
            with self._lock:
                name = self._people.get(parts[3])
            if name is None:
                raise _Refused(400, 41050, "no user authority error")
            return (
                {"data": {"user": {"open_id": parts[3], "name": name}}},
                ("GET /contact/v3/users"),
                {},
            )
        raise _Refused(404, 404, f"404 page not found: {method} /open-apis/{tail}")

    def _check_content(self, msg_type: str, raw: Any) -> None:
        if not isinstance(raw, str):
            raise _Refused(400, INVALID_CONTENT, "content must be a JSON string")
        try:
            content = json.loads(raw)
        except ValueError:
            raise _Refused(400, INVALID_CONTENT, "content is not valid JSON") from None
        limit = TEXT_LIMIT if msg_type == "text" else POST_LIMIT
        if len(raw.encode()) > limit:
            raise _Refused(400, CONTENT_TOO_LONG, "The message content is too long.")
        if msg_type == "text" and not isinstance(content.get("text"), str):
            raise _Refused(400, INVALID_CONTENT, "text content needs a text")
        if msg_type == "post":
            body = content.get("zh_cn") or content.get("en_us")
            paragraphs = body.get("content") if isinstance(body, dict) else None
            if not isinstance(paragraphs, list) or not all(isinstance(p, list) for p in paragraphs):
                raise _Refused(400, INVALID_CONTENT, "post content needs content paragraphs")
        if msg_type == "image" and str(content.get("image_key") or "") not in self._resources:
            raise _Refused(400, INVALID_CONTENT, "unknown image_key")
        if msg_type == "file" and str(content.get("file_key") or "") not in self._resources:
            raise _Refused(400, INVALID_CONTENT, "unknown file_key")
        if msg_type not in ("text", "post", "image", "file", "interactive"):
            raise _Refused(400, INVALID_CONTENT, f"unsupported msg_type {msg_type}")

    def _send(self, chat_id: str, body: Mapping[str, Any], *, parent: Message | None) -> Message:
        msg_type = str(body.get("msg_type") or "")
        uuid = str(body.get("uuid") or "")
        now = time.time()
        with self._lock:
            if uuid and uuid in self._uuids and now - self._uuids[uuid][1] < UUID_WINDOW:
                return dataclasses.replace(self._messages[self._uuids[uuid][0]])
            if self._faults:
                status, code = self._faults.pop(0)
                if status:
                    raise _Refused(status, code, "scripted failure")
            chat = self._chats.get(chat_id)
            if chat is None or self.bot_open_id not in chat[1]:
                raise _Refused(400, BOT_NOT_IN_CHAT, "Bot is not in the chat.")
            recent = [t for t in self._sends.get(chat_id, ()) if t > now - 1.0]
            if len(recent) >= self.chat_qps:
                self._sends[chat_id] = recent
                raise _Refused(400, RATE_LIMITED, "The operation triggers the frequency limit.")
            recent.append(now)
            self._sends[chat_id] = recent
        self._check_content(msg_type, body.get("content"))
        message = Message(
            self._next("om_"), chat_id, "bot", msg_type, str(body["content"]), self.now(), uuid=uuid
        )
        if parent is not None:
            message.parent_id = parent.message_id
            message.root_id = parent.root_id or parent.message_id
            if parent.thread_id:
                message.thread_id = parent.thread_id
            elif body.get("reply_in_thread"):
                message.thread_id = self._thread_of(parent)
        with self._lock:
            if uuid:
                self._uuids[uuid] = (message.message_id, now)
        self._store(message)
        return dataclasses.replace(message)

    def _edit(self, message_id: str, body: Mapping[str, Any]) -> Message:
        msg_type = str(body.get("msg_type") or "")
        with self._lock:
            message = self._messages.get(message_id)
        if message is None:
            raise _Refused(400, 230011, "The message was withdrawn or does not exist.")
        if message.sender != "bot" or message.msg_type not in ("text", "post"):
            raise _Refused(400, NOT_EDITABLE, "Only your own text or post messages can be edited.")
        if msg_type not in ("text", "post"):
            raise _Refused(400, INVALID_CONTENT, "edit to text or post only")
        if message.edits >= EDIT_LIMIT:
            raise _Refused(400, NOT_EDITABLE, "The message has been edited 20 times.")
        self._check_content(msg_type, body.get("content"))
        with self._lock:
            message.msg_type, message.content = msg_type, str(body["content"])
            message.edits += 1
        self._notify()
        return dataclasses.replace(message)

    def _upload(self, kind: str, form: Mapping[str, Any]) -> Payload:
        field = "image" if kind == "images" else "file"
        upload = form.get(field)
        if not isinstance(upload, web.FileField):
            raise _Refused(400, INVALID_PARAM, f"the {field} field is required")
        data = upload.file.read()
        if kind == "images":
            if form.get("image_type") != "message":
                raise _Refused(400, INVALID_PARAM, "image_type must be message")
            if len(data) > 10 * 1024 * 1024:
                raise _Refused(400, 234006, "The image is larger than 10 MB.")
            key = self._next("img_v3_")
            with self._lock:
                self._resources[key] = ("image", data, str(upload.filename))
            return {"data": {"image_key": key}}
        if not form.get("file_type") or not form.get("file_name"):
            raise _Refused(400, INVALID_PARAM, "file_type and file_name are required")
        if len(data) > 30 * 1024 * 1024:
            raise _Refused(400, 234006, "The file is larger than 30 MB.")
        key = self._next("file_v3_")
        with self._lock:
            self._resources[key] = ("file", data, str(form.get("file_name")))
        return {"data": {"file_key": key}}

    def uploaded(self, key: str) -> bytes:
        with self._lock:
            return self._resources[key][1]

    def _resource(self, message_id: str, key: str, kind: str) -> web.Response:
        with self._lock:
            found = self._resources.get(key)
        if found is None or found[2] != message_id or found[0] != kind:
            raise _Refused(400, 234003, "File not in msg.")
        return web.Response(body=found[1], content_type="application/octet-stream")

    # -- waiting ----------------------------------------------------------------------

    def wait_for_bot_messages(self, count: int, timeout: float = 10.0) -> list[Message]:
        return self._wait_blocking(
            at_least(count, self.bot_messages),
            timeout,
            async_method="wait_for_bot_messages_async",
            describe_timeout=lambda: f"{len(self.bot_messages())} of {count} bot messages",
        )

    async def wait_for_bot_messages_async(self, count: int) -> list[Message]:
        return await self._on_server_loop(self._until(at_least(count, self.bot_messages)))
