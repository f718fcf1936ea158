"""A fake LINE Platform for tests: the Messaging API the gateway calls, and the webhook
sender that calls the gateway, written from LINE's own documentation:

- Messaging API reference (developers.line.biz/en/reference/messaging-api/): "Send reply
  message", "Send push message", "Display a loading animation", "Get content", "Get bot
  info", "Get profile", "Get group chat member profile", "Get the target limit for sending
  messages this month", "Get number of messages sent this month", "Status codes", "Error
  responses", "Text message", "Webhook event objects" (message, text with `mention`,
  `quoteToken`, `quotedMessageId`; source user, group, room; `webhookEventId`,
  `deliveryContext.isRedelivery`), "Signature validation";
- LINE's OpenAPI definitions of the same (github.com/line/line-openapi: messaging-api.yml,
  webhook.yml);
- "Receive messages (webhook)" (developers.line.biz/en/docs/messaging-api/receiving-
  messages/): the `x-line-signature` header, webhook redelivery;
- "Retry failed API requests" (.../docs/messaging-api/retrying-api-request/);
- "Handle HTTP status code 429 errors" (.../docs/messaging-api/handling-http-429-errors/)
  and the FAQ's "You have reached your monthly limit." while a delivery is in progress.

What it keeps (tests/test_fake_line.py checks each):

- Every request needs ``Authorization: Bearer <token>``: else 401 ``{"message":
  "Authentication failed..."}``.
- A reply token is issued with each message event, is single use, and is refused after
  `reply_token_ttl` seconds (LINE: use it within one minute of the webhook): 400
  ``{"message": "Invalid reply token"}``. Replies are free: no quota, no retry key (a
  request to another API than push, multicast, narrowcast or broadcast with
  ``X-Line-Retry-Key`` is a 400).
- A push (``to`` a user, group or room that exists) counts against the month's quota,
  once per recipient (every member of a group; the number of message objects does not
  matter). Past `quota` it is 429 ``{"message": "You have reached your monthly
  limit."}``, and nothing is sent. More than `push_rate` pushes a second is 429 ``{"message":
  "The API rate limit has been exceeded. Try again later."}``. A 429 is never processed.
- ``X-Line-Retry-Key`` (a UUID) makes a push execute once: the same key again, within 24
  hours of the accepted one, is 409 ``{"message": "The retry key is already accepted",
  "sentMessages": [...]}`` with ``x-line-accepted-request-id``, and shows nothing; a key
  that is no UUID is a 400. A push refused (4xx other than 409, 5xx) did not accept its
  key: the same key may go again.
- A request carries 1 to 5 message objects; a text message holds 1 to 5,000 characters;
  a ``quoteToken`` must be one the fake issued for a message of that chat.
- The loading animation (``POST /v2/bot/chat/loading/start``) is for a user's one-on-one
  chat only, for 5 to 60 seconds in steps of 5: else 400. It answers 202.
- ``fail_next(status, message, count)`` scripts the next reply or push answers (a 500
  that was processed all the same, with ``processed=True``).

Webhooks (``deliver``): a request ``{"destination": <bot user id>, "events": [...]}``
POSTed to `webhook_url` with ``x-line-signature`` = base64 of the HMAC-SHA256 of the body
with the channel secret. A 2xx within `ack_timeout` delivers it. Otherwise, with
`redelivery` on (the console's "Webhook redelivery"), the same events are sent again
after each of `retry_delays` (LINE does not publish its schedule) with
``deliveryContext.isRedelivery: true`` and their `webhookEventId`, message id and reply
token unchanged; with it off (LINE's default) a failed request is never sent again.

``with FakeLine.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import copy
import dataclasses
import hashlib
import hmac
import itertools
import json
import re
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from tests.fakes._serving import LocalApiServer, at_least

DEFAULT_TOKEN = "fake-line-channel-access-token"
DEFAULT_SECRET = "8c570fa6dd201bb328f1c1eac23a96d8"
TEXT_LIMIT = 5000
MESSAGES_LIMIT = 5
REPLY_TOKEN_TTL = 60.0
RETRY_KEY_TTL = 24 * 3600.0
INVALID_REPLY_TOKEN = "Invalid reply token"
MONTHLY_LIMIT = "You have reached your monthly limit."
RATE_LIMITED = "The API rate limit has been exceeded. Try again later."
RETRY_KEY_ACCEPTED = "The retry key is already accepted"
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)

Payload = dict[str, Any]


def line_id(prefix: str) -> str:
    """A user (U), group (C) or room (R) id: the prefix and 32 hex digits."""
    return prefix + secrets.token_hex(16)


def sign(channel_secret: str, body: bytes) -> str:
    """LINE's ``x-line-signature`` for `body`."""
    digest = hmac.new(channel_secret.encode(), body, hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


class _Failure(Exception):
    def __init__(self, status: int, message: str, details: Sequence[Payload] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.body: Payload = {"message": message}
        if details:
            self.body["details"] = list(details)
        self.headers: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered request: ``method`` is ``"<HTTP method> <what>"`` (``POST reply``,
    ``POST push``, ``POST loading``, ``GET content``, ...)."""

    method: str
    path: str
    body: Mapping[str, Any]
    status: int
    response: Mapping[str, Any]
    headers: Mapping[str, str]
    at: float


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    answered_at: float
    status: int  # 0: no HTTP answer
    failure: str | None  # None: delivered (a 2xx in time)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One webhook request's delivery so far: every attempt, whether it got through."""

    number: int
    payload: Mapping[str, Any]
    started_at: float
    attempts: tuple[Attempt, ...] = ()
    finished: bool = False

    @property
    def delivered(self) -> bool:
        return any(a.failure is None for a in self.attempts)


@dataclass(frozen=True, slots=True)
class Sent:
    """A message the bot sent, as a reader sees it."""

    id: str
    chat: str  # the user, group or room id it went to
    text: str
    how: str  # "reply" or "push"
    quoted: str | None  # the message id its quote token named
    at: float
    retry_key: str | None = None
    quote_token: str = ""
    mentions: frozenset[str] = frozenset()  # user ids a textV2 mention notifies
    pings_everyone: bool = False  # a textV2 `{"type": "all"}` mention notifies everyone


@dataclass(slots=True)
class _Token:
    chat: str
    issued: float
    used: bool = False


class FakeLine(LocalApiServer[ApiCall]):
    """A scriptable LINE Platform; see the module docstring."""

    _thread_name = "fake-line"

    def __init__(
        self,
        *,
        token: str = DEFAULT_TOKEN,
        channel_secret: str = DEFAULT_SECRET,
        quota: int | None = None,
        push_rate: float = 2000.0,
        reply_token_ttl: float = REPLY_TOKEN_TTL,
        redelivery: bool = True,
        retry_delays: Sequence[float] = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0),
        ack_timeout: float = 2.0,
    ) -> None:
        super().__init__()
        self.token = token
        self.channel_secret = channel_secret
        self.bot_user_id = line_id("U")
        self.basic_id = "@123abcde"
        self.display_name = "Fake Bot"
        self.quota = quota
        self.push_rate = push_rate
        self.reply_token_ttl = reply_token_ttl
        self.redelivery = redelivery
        self.retry_delays = tuple(retry_delays)
        self.ack_timeout = ack_timeout
        self.webhook_url: str | None = None
        self.clock_offset = 0.0
        self.names: dict[str, str] = {}  # user id -> display name
        self.groups: dict[str, set[str]] = {}  # group or room id -> members
        self.usage = 0  # push messages counted this month
        self.reserved = 0  # counted for a delivery in progress (the FAQ's case)
        self._tokens: dict[str, _Token] = {}
        self._quote_tokens: dict[str, tuple[str, str]] = {}  # token -> (chat, message id)
        self._retry_keys: dict[str, tuple[float, str, list[Payload]]] = {}
        self._sent: list[Sent] = []
        self._loading: list[Payload] = []
        self._content: dict[str, tuple[bytes, str]] = {}
        self._faults: list[tuple[int, str, bool, str | None]] = []
        self._pushes_at: list[float] = []
        self._deliveries: list[Delivery] = []
        self._tasks: set[asyncio.Future[Any]] = set()
        self._ids = itertools.count(int(time.time() * 1000) % 10**9 * 10**6)

    def now(self) -> float:
        return time.time() + self.clock_offset

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/v2/bot/{tail:.*}", self._api)
        return app

    # -- scripting --------------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        message: str,
        count: int = 1,
        *,
        processed: bool = False,
        only: str | None = None,
    ) -> None:
        """The next `count` reply or push requests (`only`: "reply" or "push" ones) are
        answered `status` with `message`; `processed`: the request took effect all the
        same (a 5xx after it was sent)."""
        with self._lock:
            self._faults.extend([(status, message, processed, only)] * count)

    def heal(self) -> None:
        """Forget the failures `fail_next` scripted and did not answer yet."""
        with self._lock:
            self._faults.clear()

    def add_user(self, name: str) -> str:
        user = line_id("U")
        with self._lock:
            self.names[user] = name
        return user

    def add_group(self, members: Sequence[str], *, room: bool = False) -> str:
        group = line_id("R" if room else "C")
        with self._lock:
            self.groups[group] = set(members)
        return group

    def add_content(self, data: bytes, content_type: str) -> str:
        """A file a person sends: the message id its event carries."""
        message_id = self._message_id()
        with self._lock:
            self._content[message_id] = (data, content_type)
        return message_id

    # -- what the bot sent ----------------------------------------------------------

    @property
    def sent(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)

    def texts_to(self, chat: str) -> list[str]:
        return [s.text for s in self.sent if s.chat == chat]

    @property
    def loading(self) -> list[Payload]:
        with self._lock:
            return list(self._loading)

    # -- people's messages ------------------------------------------------------------

    def _message_id(self) -> str:
        return str(next(self._ids))

    def message_event(
        self,
        user: str,
        message: Payload,
        *,
        group: str | None = None,
        mention: bool = False,
        quote: str | None = None,
    ) -> Payload:
        """A webhook request with one message event from `user` (in `group`, a group or
        room id, or their one-on-one chat). `mention` @-mentions the bot at the start of
        a text; `quote` quotes an earlier message (its id)."""
        message = dict(message)
        message.setdefault("id", self._message_id())
        kind = "room" if group and group.startswith("R") else "group" if group else "user"
        source: Payload = {"type": kind, "userId": user}
        if group:
            source["groupId" if kind == "group" else "roomId"] = group
        chat = group or user
        with self._lock:
            self.names.setdefault(user, f"User {user[-4:]}")
            if group:
                self.groups.setdefault(group, set()).add(user)
        if message.get("type") in ("text", "image", "video", "sticker"):
            quote_token = "q" + secrets.token_urlsafe(24)
            message["quoteToken"] = quote_token
            with self._lock:
                self._quote_tokens[quote_token] = (chat, str(message["id"]))
        if mention and message.get("type") == "text":
            label = f"@{self.display_name}"
            message["text"] = f"{label} {message['text']}"
            message["mention"] = {
                "mentionees": [
                    {
                        "index": 0,
                        "length": len(label),
                        "type": "user",
                        "userId": self.bot_user_id,
                        "isSelf": True,
                    }
                ]
            }
        if quote is not None:
            message["quotedMessageId"] = quote
        reply_token = secrets.token_hex(16)
        with self._lock:
            self._tokens[reply_token] = _Token(chat, self.now())
        event = {
            "type": "message",
            "message": message,
            "webhookEventId": _ulid(self.now()),
            "deliveryContext": {"isRedelivery": False},
            "timestamp": int(self.now() * 1000),
            "source": source,
            "replyToken": reply_token,
            "mode": "active",
        }
        return {"destination": self.bot_user_id, "events": [event]}

    def text_message(self, user: str, text: str, **kwargs: Any) -> Payload:
        return self.message_event(user, {"type": "text", "text": text}, **kwargs)

    # -- webhook deliveries -----------------------------------------------------------

    def signed(
        self, payload: Mapping[str, Any] | bytes, secret: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return body, {
            "Content-Type": "application/json; charset=utf-8",
            "User-Agent": "LineBotWebhook/2.0",
            "x-line-signature": sign(secret or self.channel_secret, body),
        }

    async def post(
        self, url: str, payload: Mapping[str, Any] | bytes, *, secret: str | None = None
    ) -> tuple[int, str]:
        """POST a request once, signed with `secret` (default the channel's)."""
        body, headers = self.signed(payload, secret)
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=headers) as r,
        ):
            return r.status, await r.text()

    async def deliver(self, payload: Mapping[str, Any], url: str | None = None) -> Delivery:
        """Deliver `payload` the way LINE does (see the module docstring); returns the
        finished delivery. Runs in the caller's event loop (any loop)."""
        target = url or self.webhook_url
        if target is None:
            raise RuntimeError("FakeLine.webhook_url is not set")
        with self._lock:
            number = len(self._deliveries)
            self._deliveries.append(Delivery(number, payload, time.time()))
        self._notify()
        task = asyncio.current_task()
        if task is not None and asyncio.get_running_loop() is self._loop:
            self._tasks.add(task)
        current: Payload = copy.deepcopy(dict(payload))
        try:
            for attempt_number in itertools.count():
                attempt = await self._attempt(target, current)
                self._update(number, attempt)
                if attempt.failure is None or not self.redelivery:
                    break
                if attempt_number >= len(self.retry_delays):
                    break
                await asyncio.sleep(self.retry_delays[attempt_number])
                for event in current.get("events") or ():
                    event["deliveryContext"] = {"isRedelivery": True}
        finally:
            self._update(number, None)
            if task is not None:
                self._tasks.discard(task)
        return self.deliveries[number]

    def deliver_soon(self, payload: Mapping[str, Any]) -> concurrent.futures.Future[Delivery]:
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeLine is not running")
        return asyncio.run_coroutine_threadsafe(self.deliver(payload), loop)

    async def _attempt(self, url: str, payload: Mapping[str, Any]) -> Attempt:
        body, headers = self.signed(payload)
        sent_at = time.time()
        status, failure = 0, None
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                asyncio.timeout(self.ack_timeout),
                session.post(url, data=body, headers=headers) as response,
            ):
                status = response.status
                await response.read()
            failure = None if 200 <= status < 300 else f"HTTP {status}"
        except TimeoutError:
            failure = "timeout"
        except aiohttp.ClientError as exc:
            failure = type(exc).__name__
        return Attempt(sent_at, time.time(), status, failure)

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

    async def wait_for_sent(self, count: int) -> list[Sent]:
        """Wait (any loop) until the bot sent at least `count` messages."""
        return await self._on_server_loop(self._until(at_least(count, lambda: self.sent)))

    async def stop(self) -> None:
        pending = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await super().stop()

    # -- the Messaging API ------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"].strip("/")
        body: Payload = {}
        what = f"{request.method} {tail}"
        headers: dict[str, str] = {"x-line-request-id": str(uuid.uuid4())}
        try:
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                raise _Failure(
                    401,
                    "Authentication failed. Confirm that the access token in the "
                    "authorization header is valid.",
                )
            key = request.headers.get("X-Line-Retry-Key")
            if request.method == "POST":
                try:
                    body = await request.json()
                except ValueError:
                    raise _Failure(400, "The request body could not be parsed as JSON") from None
            if key is not None and tail != "message/push":
                raise _Failure(400, "The retry key header isn't supported by this API")
            status, answer = 200, {}
            if request.method == "GET" and tail == "info":
                what = "GET info"
                answer = {
                    "userId": self.bot_user_id,
                    "basicId": self.basic_id,
                    "displayName": self.display_name,
                    "chatMode": "bot",
                    "markAsReadMode": "auto",
                }
            elif request.method == "POST" and tail == "message/reply":
                what = "POST reply"
                answer = self._reply(body)
            elif request.method == "POST" and tail == "message/push":
                what = "POST push"
                answer = self._push(body, key, headers)
            elif request.method == "POST" and tail == "chat/loading/start":
                what = "POST loading"
                status, answer = 202, self._loading_start(body)
            elif request.method == "GET" and tail == "message/quota":
                what = "GET quota"
                answer = (
                    {"type": "limited", "value": self.quota}
                    if self.quota is not None
                    else {"type": "none"}
                )
            elif request.method == "GET" and tail == "message/quota/consumption":
                what = "GET consumption"
                answer = {"totalUsage": self.usage}
            elif (
                request.method == "GET"
                and tail.startswith("message/")
                and tail.endswith("/content")
            ):
                what = "GET content"
                return self._content_of(tail.split("/")[1])
            elif request.method == "GET" and (
                found := re.fullmatch(r"profile/(U[0-9a-f]{32})", tail)
            ):
                what = "GET profile"
                answer = self._profile(found.group(1))
            elif request.method == "GET" and (
                found := re.fullmatch(
                    r"(group|room)/([CR][0-9a-f]{32})/member/(U[0-9a-f]{32})", tail
                )
            ):
                what = "GET member"
                if found.group(3) not in self.groups.get(found.group(2), ()):
                    raise _Failure(404, "Not found")
                answer = self._profile(found.group(3))
            else:
                raise _Failure(404, "Not found")
        except _Failure as exc:
            status, answer = exc.status, exc.body
            headers.update(exc.headers)
        self._log_call(ApiCall(what, request.path, body, status, answer, headers, time.time()))
        return web.json_response(answer, status=status, headers=headers)

    def _profile(self, user: str) -> Payload:
        with self._lock:
            name = self.names.get(user)
        if name is None:
            raise _Failure(404, "Not found")
        return {"userId": user, "displayName": name, "language": "en"}

    def _content_of(self, message_id: str) -> web.StreamResponse:
        with self._lock:
            found = self._content.get(message_id)
        if found is None:
            return web.json_response({"message": "Not found"}, status=404)
        return web.Response(body=found[0], content_type=found[1])

    def _check_messages(self, body: Payload, chat: str) -> list[Payload]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not 1 <= len(messages) <= MESSAGES_LIMIT:
            raise _Failure(
                400,
                "The request body has 1 error(s)",
                [
                    {
                        "message": f"Size must be between 1 and {MESSAGES_LIMIT}",
                        "property": "messages",
                    }
                ],
            )
        for n, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("type") not in ("text", "textV2"):
                raise _Failure(
                    400,
                    "The request body has 1 error(s)",
                    [{"message": "unsupported", "property": f"messages[{n}].type"}],
                )
            text = message.get("text")
            if not isinstance(text, str) or not 1 <= len(text) <= TEXT_LIMIT:
                raise _Failure(
                    400,
                    "The request body has 1 error(s)",
                    [
                        {
                            "message": f"Length must be between 1 and {TEXT_LIMIT}",
                            "property": f"messages[{n}].text",
                        }
                    ],
                )
            quote = message.get("quoteToken")
            if quote is not None:
                with self._lock:
                    quoted = self._quote_tokens.get(str(quote))
                if quoted is None or quoted[0] != chat:
                    raise _Failure(
                        400,
                        "The request body has 1 error(s)",
                        [
                            {
                                "message": "Invalid quote token",
                                "property": f"messages[{n}].quoteToken",
                            }
                        ],
                    )
        return messages

    def _scripted(self, api: str) -> tuple[int, str, bool] | None:
        with self._lock:
            for n, (status, message, processed, only) in enumerate(self._faults):
                if only in (None, api):
                    del self._faults[n]
                    return status, message, processed
        return None

    def _record(
        self, chat: str, messages: list[Payload], how: str, key: str | None
    ) -> list[Payload]:
        sent_messages = []
        with self._lock:
            for message in messages:
                message_id = self._message_id()
                quoted = self._quote_tokens.get(str(message.get("quoteToken") or ""))
                quote_token = "q" + secrets.token_urlsafe(24)
                self._quote_tokens[quote_token] = (chat, message_id)
                shown, mentions, everyone = _rendered(message, self.names)
                self._sent.append(
                    Sent(
                        message_id,
                        chat,
                        shown,
                        how,
                        quoted[1] if quoted else None,
                        self.now(),
                        key,
                        quote_token,
                        frozenset(mentions),
                        everyone,
                    )
                )
                sent_messages.append({"id": message_id, "quoteToken": quote_token})
        self._notify()
        return sent_messages

    def _reply(self, body: Payload) -> Payload:
        token = str(body.get("replyToken") or "")
        with self._lock:
            found = self._tokens.get(token)
            valid = (
                found is not None
                and not found.used
                and self.now() - found.issued < self.reply_token_ttl
            )
        if not valid or found is None:
            raise _Failure(400, INVALID_REPLY_TOKEN)
        messages = self._check_messages(body, found.chat)
        fault = self._scripted("reply")
        if fault is not None and not fault[2]:
            raise _Failure(fault[0], fault[1])
        with self._lock:
            found.used = True
        sent = self._record(found.chat, messages, "reply", None)
        if fault is not None:
            raise _Failure(fault[0], fault[1])
        return {"sentMessages": sent}

    def _push(self, body: Payload, key: str | None, headers: dict[str, str]) -> Payload:
        now = self.now()
        if key is not None:
            if not _UUID.match(key):
                raise _Failure(400, "The value of the X-Line-Retry-Key header is invalid")
            with self._lock:
                accepted = self._retry_keys.get(key)
            if accepted is not None and now - accepted[0] < RETRY_KEY_TTL:
                failure = _Failure(409, RETRY_KEY_ACCEPTED)
                failure.body["sentMessages"] = accepted[2]
                failure.headers["x-line-accepted-request-id"] = accepted[1]
                raise failure
        to = str(body.get("to") or "")
        with self._lock:
            members = self.groups.get(to)
            known = to in self.names or members is not None
        if not known:
            raise _Failure(
                400, "The property, 'to', in the request body is invalid (line: -, column: -)"
            )
        messages = self._check_messages(body, to)
        with self._lock:
            self._pushes_at = [t for t in self._pushes_at if t > now - 1.0]
            if len(self._pushes_at) >= self.push_rate:
                raise _Failure(429, RATE_LIMITED)
            self._pushes_at.append(now)
            recipients = len(members) if members is not None else 1
            if self.quota is not None and self.usage + self.reserved + recipients > self.quota:
                raise _Failure(429, MONTHLY_LIMIT)
        fault = self._scripted("push")
        if fault is not None and not fault[2]:
            raise _Failure(fault[0], fault[1])
        with self._lock:
            self.usage += recipients
        sent = self._record(to, messages, "push", key)
        if key is not None:
            with self._lock:
                self._retry_keys[key] = (now, headers["x-line-request-id"], sent)
        if fault is not None:
            raise _Failure(fault[0], fault[1])
        return {"sentMessages": sent}

    def _loading_start(self, body: Payload) -> Payload:
        chat = str(body.get("chatId") or "")
        seconds = body.get("loadingSeconds", 20)
        with self._lock:
            known = chat in self.names
        if not known or not isinstance(seconds, int) or not 5 <= seconds <= 60 or seconds % 5:
            raise _Failure(
                400, "An invalid chat ID is specified, or the loadingSeconds value is invalid."
            )
        with self._lock:
            self._loading.append(dict(body))
        self._notify()
        return {}


def _rendered(message: Mapping[str, Any], names: Mapping[str, str]) -> tuple[str, list[str], bool]:
    """A text message as a reader sees it, and whom it notifies: only a textV2 message's
    `{key}` substitutions of type mention notify anyone (a user, or `all`); an "@All"
    typed in a text message is text."""
    text = str(message.get("text") or "")
    if message.get("type") != "textV2":
        return text, [], False
    mentions: list[str] = []
    everyone = False
    substitution = message.get("substitution") or {}

    def place(match: re.Match[str]) -> str:
        nonlocal everyone
        found = substitution.get(match.group(1)) if isinstance(substitution, Mapping) else None
        if not isinstance(found, Mapping) or found.get("type") != "mention":
            return match.group(0)
        target = found.get("mentionee") or {}
        if target.get("type") == "all":
            everyone = True
            return "@All"
        user = str(target.get("userId") or "")
        mentions.append(user)
        return f"@{names.get(user, user)}"

    return re.sub(r"\{([A-Za-z0-9_]{1,20})\}", place, text), mentions, everyone


def _ulid(at: float) -> str:
    """A ULID-shaped id (26 Crockford base32 characters, time first), as webhookEventId."""
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    value = (int(at * 1000) << 80) | secrets.randbits(80)
    return "".join(alphabet[(value >> (5 * i)) & 31] for i in reversed(range(26)))
