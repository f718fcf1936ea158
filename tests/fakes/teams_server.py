"""A fake Microsoft Teams for tests: the token issuer, the Bot Connector and the channel
that delivers activities to the bot, on 127.0.0.1, written from Microsoft's documentation.

The gateway's real client talks to it unchanged: point `channels.teams.openid_metadata_url`
at `fake.openid_metadata_url` and `channels.teams.token_url` at `fake.token_url`; replies go
to the `serviceUrl` the fake puts in each activity (`fake.service_url`).

Sources:
- "Authenticate requests from the Bot Connector service to your bot" and "... from your bot
  to the Bot Connector service" (Bot Framework REST API, learn.microsoft.com/azure/bot-
  service/rest-api/bot-framework-rest-connector-authentication): the OpenID metadata
  (`issuer`, `jwks_uri`, `id_token_signing_alg_values_supported: ["RS256"]`), the keys in
  JWK form with an extra `endorsements` list of channel ids, the inbound JWT (RS256, `kid`
  naming a listed key, `iss` https://api.botframework.com, `aud` the App ID, `exp`/`nbf`,
  a `serviceurl` claim equal to the activity's `serviceUrl`), and the client-credentials
  request (`grant_type=client_credentials`, `client_id`, `client_secret`, `scope=https://
  api.botframework.com/.default`) answered `{"token_type": "Bearer", "expires_in",
  "ext_expires_in", "access_token"}`. Refused credentials are answered as Microsoft Entra
  ID answers them: HTTP 400/401 `{"error": "invalid_client" | "unauthorized_client" |
  "invalid_scope", "error_description": "AADSTS...: ..."}`.
- Bot Framework REST API reference, "Conversations": `POST /v3/conversations/{id}/
  activities` (send), `POST .../activities/{activityId}` (reply), `PUT .../activities/
  {activityId}` (update), each answered with a `ResourceResponse` `{"id"}`; the ids are
  percent-encoded in the path (a channel thread's `;messageid=` too). Every call needs the
  bot's token (401 otherwise, the connector's `{"message": "Authorization has been denied
  for this request."}`).
- Teams, "Messages in bot conversations" (status codes from bot conversational APIs):
  400 BadArgument, 403 BotNotInConversationRoster, 404 ConversationNotFound and
  ActivityNotFoundInConversation, 412 PreconditionFailed, 413 MessageSizeTooBig, 429
  Throttled with `Retry-After`, 502/503/504; `fail_next` scripts them. "Format your bot
  messages": a message holds at most 100 KB of JSON counted in UTF-16, else 413.
- Teams, "Channel and group chat conversations with a bot" and "Conversation basics":
  `conversationType` personal, groupChat or channel; a channel post's conversation id
  carries `;messageid=<the post>` (its reply chain); a mention is an entity
  `{"type": "mention", "mentioned": {"id", "name"}, "text": "<at>Name</at>"}` whose text
  must appear in the message's text, else it is ignored; the bot gets a channel's or
  group chat's messages only when @mentioned, unless the app has the resource-specific
  consent to read them all (`rsc=True`, as the kit's team has).
- Teams, "Messages in bot conversations" (update message): an edit comes as a
  `messageUpdate` activity with `channelData.eventType: "editMessage"`, the message's id
  and a new timestamp.

Delivery, as Teams does it (observed, not documented by Microsoft; maintainers' threads:
MicrosoftDocs/msteams-docs#6084 "if the bot activity takes more than 15 seconds, Teams
will send retry request", #4592, #1571): each activity is POSTed to `bot_url` with its
token; a 2xx within `ack_timeout` (15 s) delivers it; anything else (another status, no
connection, no answer in time) is tried again after `retry_delay`, `retries` times (one),
and then dropped: Teams keeps nothing for a bot, and no API gives a bot what it missed.
The fake delivers one conversation's activities one at a time, in the order they were
written (a retry holds back that conversation's later ones); every attempt is logged in
`deliveries`.

``with FakeTeams.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import itertools
import json
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import aiohttp
import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.fakes._serving import LocalServer

APP_ID = "5b0f3c2e-7a1d-4e8f-9c6b-2d4a1e0f9b37"
APP_PASSWORD = "fake~teams~client~secret~0123456789"
TENANT_ID = "72f988bf-86f1-41af-91ab-2d7cd011db47"
BOT_NAME = "Kit Bot"
ISSUER = "https://api.botframework.com"
SCOPE = "https://api.botframework.com/.default"
#: Teams waits this long for the bot's answer to an activity.
ACK_TIMEOUT = 15.0
#: A Teams message holds at most this much JSON, counted in UTF-16 ("Format your bot
#: messages").
MESSAGE_LIMIT = 100 * 1024

Payload = dict[str, Any]


def _b64(number: int) -> str:
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def utf16_size(text: str) -> int:
    return len(text.encode("utf-16-le"))


@dataclass
class SigningKey:
    """One key of the fake issuer: its private half signs, its public half is listed."""

    kid: str
    private: rsa.RSAPrivateKey
    endorsements: list[str]

    def jwk(self) -> Payload:
        numbers = self.private.public_key().public_numbers()
        return {
            "kty": "RSA",
            "use": "sig",
            "kid": self.kid,
            "x5t": self.kid,
            "n": _b64(numbers.n),
            "e": _b64(numbers.e),
            "endorsements": list(self.endorsements),
        }


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    answered_at: float
    status: int  # 0: no HTTP answer
    failure: str | None  # None: delivered (a 2xx in time)


@dataclass
class Delivery:
    """One activity's delivery so far: every attempt, and how it ended."""

    number: int
    activity: Payload
    attempts: list[Attempt] = field(default_factory=list)
    finished: bool = False
    #: Set when it finished (a future of the server's loop).
    done: asyncio.Future[Delivery] | None = field(default=None, repr=False, compare=False)

    @property
    def delivered(self) -> bool:
        return any(a.failure is None for a in self.attempts)

    @property
    def dropped(self) -> bool:
        return self.finished and not self.delivered


@dataclass
class Conversation:
    """A conversation the bot is in: `personal`, `groupChat` or `channel` (whose posts
    each start a thread: conversation id `<id>;messageid=<post>`)."""

    id: str
    kind: str
    members: list[str] = field(default_factory=list)
    #: The bot reads every message, not only mentions (resource-specific consent).
    rsc: bool = False
    team_id: str = ""
    name: str = ""


@dataclass
class BotMessage:
    """A message the bot posted, as Teams holds it now (updates applied)."""

    id: str
    conversation: str  # as posted: a channel thread's id with ;messageid=
    text: str
    entities: list[Payload]
    reply_to: str | None
    attachments: list[Payload]
    at: float
    updates: int = 0


@dataclass(frozen=True, slots=True)
class ApiCall:
    method: str
    path: str
    status: int
    at: float
    body: Mapping[str, Any]


class _Failure(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class FakeTeams(LocalServer):
    """The issuer, the connector and Teams' delivery of activities (see the module
    docstring). `bot_url` is where activities go (the gateway's messaging endpoint)."""

    _thread_name = "fake-teams"

    def __init__(
        self,
        *,
        app_id: str = APP_ID,
        app_password: str = APP_PASSWORD,
        tenant_id: str = TENANT_ID,
        bot_name: str = BOT_NAME,
        ack_timeout: float = ACK_TIMEOUT,
        retries: int = 1,
        retry_delay: float = 1.0,
        token_lifetime: float = 3599.0,
    ) -> None:
        super().__init__()
        self.app_id = app_id
        self.app_password = app_password
        self.tenant_id = tenant_id
        self.bot_id = f"28:{app_id}"
        self.bot_name = bot_name
        self.ack_timeout = ack_timeout
        self.retries = retries
        self.retry_delay = retry_delay
        self.token_lifetime = token_lifetime
        self.bot_url: str | None = None
        #: The root the gateway reaches the fake at (a proxy's, to cut it off); its own
        #: address by default. Activities carry their service URL under it.
        self.public_url: str | None = None
        self.keys = [SigningKey("fake-teams-key-1", _new_key(), ["msteams", "webchat"])]
        self.people: dict[str, Payload] = {}  # account id -> {id, name, aadObjectId}
        self.conversations: dict[str, Conversation] = {}
        self.activities: dict[tuple[str, str], Payload] = {}  # (conversation, id) -> activity
        self.bot_messages: list[BotMessage] = []
        self._tokens: dict[str, float] = {}  # access token -> expiry
        self._ids = itertools.count(int(time.time() * 1000))
        self._deliveries: list[Delivery] = []
        self._queues: dict[str, asyncio.Queue[Delivery]] = {}
        self._workers: list[asyncio.Task[None]] = []
        self._scripted: list[_Failure | None] = []
        self._calls: list[ApiCall] = []
        self._attachments: dict[str, tuple[bytes, str]] = {}
        self._session: aiohttp.ClientSession | None = None
        self.token_requests = 0

    # -- addresses ----------------------------------------------------------------

    @property
    def root(self) -> str:
        return self.public_url or self.url

    @property
    def openid_metadata_url(self) -> str:
        return f"{self.root}/v1/.well-known/openidconfiguration"

    @property
    def token_url(self) -> str:
        return f"{self.root}/botframework.com/oauth2/v2.0/token"

    @property
    def service_url(self) -> str:
        return f"{self.root}/amer/"

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_get("/v1/.well-known/openidconfiguration", self._metadata)
        app.router.add_get("/v1/.well-known/keys", self._jwks)
        app.router.add_post("/{tenant}/oauth2/v2.0/token", self._token)
        app.router.add_post("/amer/v3/conversations/{conversation}/activities", self._send)
        app.router.add_post(
            "/amer/v3/conversations/{conversation}/activities/{activity}", self._send
        )
        app.router.add_put(
            "/amer/v3/conversations/{conversation}/activities/{activity}", self._update
        )
        app.router.add_get("/amer/v3/attachments/{attachment}/views/original", self._attachment)
        return app

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        await super().stop()

    # -- the issuer ---------------------------------------------------------------

    async def _metadata(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "issuer": ISSUER,
                "authorization_endpoint": "https://invalid.botframework.com",
                "jwks_uri": f"{self.root}/v1/.well-known/keys",
                "id_token_signing_alg_values_supported": ["RS256"],
                "token_endpoint_auth_methods_supported": ["private_key_jwt"],
            }
        )

    async def _jwks(self, request: web.Request) -> web.Response:
        return web.json_response({"keys": [key.jwk() for key in self.keys]})

    async def _token(self, request: web.Request) -> web.Response:
        """The client-credentials flow, as Microsoft Entra ID answers it."""
        form = await request.post()
        with self._lock:
            self.token_requests += 1
        if form.get("grant_type") != "client_credentials":
            return _entra_error(400, "unsupported_grant_type", "AADSTS70003: grant type")
        if form.get("client_id") != self.app_id:
            return _entra_error(
                400,
                "unauthorized_client",
                f"AADSTS700016: Application with identifier '{form.get('client_id')}' was not "
                "found in the directory.",
            )
        if form.get("client_secret") != self.app_password:
            return _entra_error(
                401,
                "invalid_client",
                "AADSTS7000215: Invalid client secret provided. Ensure the secret being sent "
                "in the request is the client secret value, not the client secret ID.",
            )
        if form.get("scope") != SCOPE:
            return _entra_error(
                400, "invalid_scope", "AADSTS70011: The provided value for scope is not valid."
            )
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = time.time() + self.token_lifetime
        lifetime = int(self.token_lifetime)
        return web.json_response(
            {
                "token_type": "Bearer",
                "expires_in": lifetime,
                "ext_expires_in": lifetime,
                "access_token": token,
            }
        )

    def expire_tokens(self) -> None:
        """Every access token issued so far expires now (the connector refuses them)."""
        with self._lock:
            self._tokens = {token: 0.0 for token in self._tokens}

    def sign(
        self,
        activity: Mapping[str, Any],
        *,
        key: SigningKey | None = None,
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """The JWT the Bot Connector sends with `activity` (`claims` override its own)."""
        key = key or self.keys[0]
        now = int(time.time())
        payload = {
            "serviceurl": activity.get("serviceUrl"),
            "nbf": now - 5,
            "exp": now + 3600,
            "iss": ISSUER,
            "aud": self.app_id,
        } | dict(claims or {})
        return jwt.encode(
            payload, key.private, algorithm="RS256", headers={"kid": key.kid, "x5t": key.kid}
        )

    # -- people and conversations -------------------------------------------------

    def add_person(self, name: str) -> Payload:
        account = {
            "id": f"29:1{secrets.token_urlsafe(40)}",
            "name": name,
            "aadObjectId": str(uuid.uuid4()),
        }
        with self._lock:
            self.people[account["id"]] = account
        return account

    def personal_chat(self, person: Payload) -> Conversation:
        conversation = Conversation(
            f"a:1{secrets.token_urlsafe(60)}", "personal", [person["id"], self.bot_id]
        )
        with self._lock:
            self.conversations[conversation.id] = conversation
        return conversation

    def group_chat(self, members: Sequence[Payload], *, rsc: bool = False) -> Conversation:
        conversation = Conversation(
            f"19:{uuid.uuid4().hex}@thread.v2",
            "groupChat",
            [m["id"] for m in members] + [self.bot_id],
            rsc=rsc,
        )
        with self._lock:
            self.conversations[conversation.id] = conversation
        return conversation

    def team_channel(
        self, members: Sequence[Payload], *, name: str = "General", rsc: bool = False
    ) -> Conversation:
        channel_id = f"19:{uuid.uuid4().hex}@thread.tacv2"
        conversation = Conversation(
            channel_id,
            "channel",
            [m["id"] for m in members] + [self.bot_id],
            rsc=rsc,
            team_id=channel_id,
            name=name,
        )
        with self._lock:
            self.conversations[conversation.id] = conversation
        return conversation

    def _next_id(self) -> str:
        return str(next(self._ids))

    def message(
        self,
        person: Payload,
        conversation: Conversation,
        text: str,
        *,
        mention_bot: bool = False,
        thread: str | None = None,
        attachments: Sequence[Payload] = (),
    ) -> Payload:
        """The activity Teams makes of `person` writing `text` (with the bot's mention at
        its start when `mention_bot`) in `conversation`; in a channel a new post, or a
        reply in the thread of post `thread`. Recorded; not delivered (`deliver`)."""
        activity_id = self._next_id()
        entities: list[Payload] = []
        if mention_bot:
            mention = f"<at>{self.bot_name}</at>"
            text = f"{mention} {text}"
            entities.append(
                {
                    "type": "mention",
                    "text": mention,
                    "mentioned": {"id": self.bot_id, "name": self.bot_name},
                }
            )
        entities.append({"type": "clientInfo", "locale": "en-US", "platform": "Web"})
        conversation_id = conversation.id
        if conversation.kind == "channel":
            conversation_id = f"{conversation.id};messageid={thread or activity_id}"
        now = datetime.now(UTC)
        activity: Payload = {
            "type": "message",
            "id": activity_id,
            "timestamp": now.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "localTimestamp": now.isoformat(timespec="microseconds"),
            "serviceUrl": self.service_url,
            "channelId": "msteams",
            "from": dict(person),
            "conversation": {
                "conversationType": conversation.kind,
                "tenantId": self.tenant_id,
                "id": conversation_id,
                **({"isGroup": True} if conversation.kind != "personal" else {}),
            },
            "recipient": {"id": self.bot_id, "name": self.bot_name},
            "textFormat": "plain",
            "text": text,
            "attachments": list(attachments),
            "entities": entities,
            "channelData": self._channel_data(conversation),
            "locale": "en-US",
        }
        with self._lock:
            self.activities[(conversation_id, activity_id)] = activity
        return activity

    def _channel_data(self, conversation: Conversation) -> Payload:
        data: Payload = {"tenant": {"id": self.tenant_id}}
        if conversation.kind == "channel":
            data["team"] = {"id": conversation.team_id}
            data["channel"] = {"id": conversation.id}
        return data

    def edit(self, activity: Mapping[str, Any], text: str) -> Payload:
        """The `messageUpdate` activity Teams sends when the author edits `activity`."""
        now = datetime.now(UTC)
        edited = json.loads(json.dumps(activity))
        edited["type"] = "messageUpdate"
        edited["timestamp"] = now.isoformat(timespec="microseconds").replace("+00:00", "Z")
        mention = f"<at>{self.bot_name}</at>"
        keeps_mention = str(activity.get("text") or "").startswith(mention)
        edited["text"] = f"{mention} {text}" if keeps_mention else text
        edited["channelData"] = {**edited.get("channelData", {}), "eventType": "editMessage"}
        return edited

    def reaches_bot(self, activity: Mapping[str, Any]) -> bool:
        """Whether Teams hands this activity to the bot at all: everything in a personal
        chat; in a channel or group chat a message that @mentions the bot, or any message
        where the app may read them all (`rsc`)."""
        conversation_id = str(activity["conversation"]["id"]).split(";messageid=")[0]
        conversation = self.conversations.get(conversation_id)
        if conversation is None or conversation.kind == "personal" or conversation.rsc:
            return True
        return any(
            e.get("type") == "mention" and (e.get("mentioned") or {}).get("id") == self.bot_id
            for e in activity.get("entities") or ()
        )

    def add_attachment(self, data: bytes, content_type: str) -> str:
        """A pasted image on the connector; its `contentUrl` (served with the bot's token)."""
        attachment_id = uuid.uuid4().hex
        with self._lock:
            self._attachments[attachment_id] = (data, content_type)
        return f"{self.service_url}v3/attachments/{attachment_id}/views/original"

    # -- delivery ------------------------------------------------------------------

    async def deliver(self, activity: Mapping[str, Any]) -> Delivery:
        """Hand `activity` to the bot as Teams does (see the module docstring), after the
        activities of its conversation handed over before it; the finished delivery."""
        return await self._on_server_loop(self._deliver(dict(activity)))

    def deliver_soon(self, activity: Mapping[str, Any]) -> concurrent.futures.Future[Delivery]:
        """`deliver` from any thread without waiting for it."""
        loop = self._loop
        assert loop is not None, "the fake is not running"
        return asyncio.run_coroutine_threadsafe(self._deliver(dict(activity)), loop)

    async def _deliver(self, activity: Payload) -> Delivery:
        with self._lock:
            delivery = Delivery(len(self._deliveries) + 1, activity)
            self._deliveries.append(delivery)
        done: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        delivery.done = done
        queue = self._queue_of(str(activity["conversation"]["id"]).split(";messageid=")[0])
        queue.put_nowait(delivery)
        return await done

    def _queue_of(self, conversation: str) -> asyncio.Queue[Delivery]:
        queue = self._queues.get(conversation)
        if queue is None:
            queue = self._queues[conversation] = asyncio.Queue()
            self._workers.append(asyncio.get_running_loop().create_task(self._work(queue)))
        return queue

    async def _work(self, queue: asyncio.Queue[Delivery]) -> None:
        while True:
            delivery = await queue.get()
            try:
                for attempt in range(self.retries + 1):
                    if attempt:
                        await asyncio.sleep(self.retry_delay)
                    if await self._attempt(delivery):
                        break
            finally:
                delivery.finished = True
                self._notify()
                if delivery.done is not None and not delivery.done.done():
                    delivery.done.set_result(delivery)

    async def _attempt(self, delivery: Delivery) -> bool:
        sent = time.time()
        status, failure = 0, "no bot_url"
        url = self.bot_url
        if url:
            token = self.sign(delivery.activity)
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession()
            try:
                async with asyncio.timeout(self.ack_timeout):
                    async with self._session.post(
                        url, json=delivery.activity, headers={"Authorization": f"Bearer {token}"}
                    ) as answer:
                        status = answer.status
                        await answer.read()
                failure = None if 200 <= status < 300 else f"HTTP {status}"
            except TimeoutError:
                failure = f"no answer within {self.ack_timeout:g}s"
            except aiohttp.ClientError as exc:
                failure = type(exc).__name__
        with self._lock:
            delivery.attempts.append(Attempt(sent, time.time(), status, failure))
        self._notify()
        return failure is None

    @property
    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    def wait_delivered(self, count: int, timeout: float = 10.0) -> list[Delivery]:
        """Block until at least `count` deliveries have finished (thread mode)."""
        return self._wait_blocking(
            lambda: d if len(d := [x for x in self.deliveries if x.finished]) >= count else None,
            timeout,
            async_method="deliver",
            describe_timeout=lambda: f"{len(self.deliveries)} deliveries, not {count} finished",
        )

    # -- the connector -------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        count: int = 1,
        *,
        code: str = "",
        retry_after: float | None = None,
        after: int = 0,
    ) -> None:
        """The next `count` connector calls (sends and updates) fail with `status`, once
        `after` more calls went through."""
        codes = {
            412: "PreconditionFailed",
            413: "MessageSizeTooBig",
            429: "Throttled",
            500: "ServiceError",
            502: "ServiceError",
            403: "BotNotInConversationRoster",
        }
        with self._lock:
            self._scripted.extend([None] * after)
            for _ in range(count):
                self._scripted.append(
                    _Failure(status, code or codes.get(status, ""), "scripted", retry_after)
                )

    @property
    def calls(self) -> list[ApiCall]:
        with self._lock:
            return list(self._calls)

    def _log(self, request: web.Request, status: int, body: Mapping[str, Any]) -> None:
        with self._lock:
            self._calls.append(ApiCall(request.method, request.path, status, time.time(), body))
        self._notify()

    def _authorize(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        with self._lock:
            expiry = self._tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if expiry is None or expiry < time.time():
            raise _Failure(401, "", "Authorization has been denied for this request.")

    def _conversation(self, raw: str) -> tuple[Conversation, str | None]:
        conversation_id = unquote(raw)
        base, _, post = conversation_id.partition(";messageid=")
        found = self.conversations.get(base)
        if found is None:
            raise _Failure(404, "ConversationNotFound", "Conversation not found.")
        if (
            post
            and (conversation_id, post) not in self.activities
            and not any(m.id == post for m in self.bot_messages)
        ):
            raise _Failure(404, "ConversationNotFound", "Conversation not found.")
        return found, post or None

    def _scripted_failure(self) -> None:
        with self._lock:
            failure = self._scripted.pop(0) if self._scripted else None
        if failure is not None:
            raise failure

    async def _body(self, request: web.Request) -> Payload:
        try:
            body = await request.json()
        except ValueError:
            raise _Failure(400, "BadArgument", "The request body is not JSON.") from None
        if not isinstance(body, dict):
            raise _Failure(400, "BadArgument", "The request body is not an activity.")
        return body

    async def _send(self, request: web.Request) -> web.Response:
        body: Payload = {}
        try:
            self._authorize(request)
            body = await self._body(request)
            self._conversation(request.match_info["conversation"])
            self._scripted_failure()
            reply_to = request.match_info.get("activity")
            posted_to = unquote(request.match_info["conversation"])
            if reply_to is not None and not self._known_activity(posted_to, unquote(reply_to)):
                raise _Failure(404, "ActivityNotFoundInConversation", "The activity was not found.")
            kind = body.get("type")
            if kind == "typing":
                self._log(request, 200, body)
                return web.json_response({}, status=200)
            if kind != "message":
                raise _Failure(400, "BadArgument", f"Unknown activity type {kind!r}.")
            self._check_size(body)
            message = BotMessage(
                self._next_id(),
                posted_to,
                str(body.get("text") or ""),
                [e for e in body.get("entities") or () if isinstance(e, dict)],
                unquote(reply_to) if reply_to else None,
                [a for a in body.get("attachments") or () if isinstance(a, dict)],
                time.time(),
            )
            with self._lock:
                self.bot_messages.append(message)
            self._log(request, 201, body)
            return web.json_response({"id": message.id}, status=201)
        except _Failure as failure:
            self._log(request, failure.status, body)
            return _connector_error(failure)

    def _known_activity(self, conversation: str, activity_id: str) -> bool:
        base = conversation.split(";messageid=")[0]
        with self._lock:
            if any(
                c.split(";messageid=")[0] == base and a == activity_id for c, a in self.activities
            ):
                return True
            return any(m.id == activity_id for m in self.bot_messages)

    def _check_size(self, body: Mapping[str, Any]) -> None:
        if utf16_size(json.dumps(body, ensure_ascii=False)) > MESSAGE_LIMIT:
            raise _Failure(413, "MessageSizeTooBig", "Message size too large.")

    async def _update(self, request: web.Request) -> web.Response:
        body: Payload = {}
        try:
            self._authorize(request)
            body = await self._body(request)
            self._conversation(request.match_info["conversation"])
            self._scripted_failure()
            self._check_size(body)
            activity_id = unquote(request.match_info["activity"])
            with self._lock:
                found = next((m for m in self.bot_messages if m.id == activity_id), None)
                if found is None:
                    raise _Failure(
                        404, "ActivityNotFoundInConversation", "The activity was not found."
                    )
                found.text = str(body.get("text") or "")
                found.entities = [e for e in body.get("entities") or () if isinstance(e, dict)]
                found.updates += 1
            self._log(request, 200, body)
            return web.json_response({"id": activity_id}, status=200)
        except _Failure as failure:
            self._log(request, failure.status, body)
            return _connector_error(failure)

    async def _attachment(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorize(request)
        except _Failure as failure:
            return _connector_error(failure)
        found = self._attachments.get(request.match_info["attachment"])
        if found is None:
            return web.json_response({"error": {"code": "NotFound"}}, status=404)
        data, content_type = found
        return web.Response(body=data, content_type=content_type)

    # -- what the bot posted ---------------------------------------------------------

    def posts(self) -> list[BotMessage]:
        """The bot's messages, in the order Teams got them (updates applied)."""
        with self._lock:
            return list(self.bot_messages)

    def mentioned(self, message: BotMessage) -> tuple[set[str], bool]:
        """(the accounts a message notifies, whether it notifies everyone in its place):
        a mention entity counts only when its text is in the message's text; naming the
        conversation, team or channel itself notifies everyone there."""
        people: set[str] = set()
        everyone = False
        base = message.conversation.split(";messageid=")[0]
        conversation = self.conversations.get(base)
        whole = {base}
        if conversation is not None and conversation.team_id:
            whole.add(conversation.team_id)
        for entity in message.entities:
            if entity.get("type") != "mention" or str(entity.get("text") or "") not in message.text:
                continue
            who = str((entity.get("mentioned") or {}).get("id") or "")
            if who in whole:
                everyone = True
            elif who:
                people.add(who)
        return people, everyone


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def new_signing_key(kid: str, endorsements: Sequence[str]) -> SigningKey:
    """A key of the issuer's kind, for tests (listed once added to `fake.keys`)."""
    return SigningKey(kid, _new_key(), list(endorsements))


def _entra_error(status: int, error: str, description: str) -> web.Response:
    return web.json_response(
        {
            "error": error,
            "error_description": f"{description}\r\nTrace ID: {uuid.uuid4()}",
            "error_codes": [int(description.split(":")[0].removeprefix("AADSTS") or 0)],
            "timestamp": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
        },
        status=status,
    )


def _connector_error(failure: _Failure) -> web.Response:
    headers = {"Retry-After": f"{failure.retry_after:g}"} if failure.retry_after else None
    if failure.status == 401:
        return web.json_response({"message": failure.message}, status=401, headers=headers)
    return web.json_response(
        {"error": {"code": failure.code, "message": failure.message}},
        status=failure.status,
        headers=headers,
    )
