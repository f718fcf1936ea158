"""A fake Google Chat for tests: the Chat API a Chat app calls, the OAuth token endpoint its
service account uses, the keys Google publishes, and Google Chat's side of an HTTP-endpoint
app (the caller that POSTs signed interaction events to it), all on 127.0.0.1, written
from Google's documentation:

- "Verify requests from Google Chat" (developers.google.com/workspace/chat/
  verify-requests-from-chat): every request to the app's endpoint carries
  `Authorization: Bearer <JWT>` and `User-Agent: Google-Dynamite`. With the project
  number as the app's authentication audience the JWT is issued by
  chat@system.gserviceaccount.com for that number and signed by a key published at
  https://www.googleapis.com/service_accounts/v1/metadata/x509/chat@system.gserviceaccount.com
  (`CHAT_CERTS_PATH`); with the endpoint URL it is a Google ID token (issuer
  https://accounts.google.com, audience the URL, `email` chat@system.gserviceaccount.com,
  `email_verified` true) signed by a key of https://www.googleapis.com/oauth2/v1/certs
  (`OIDC_CERTS_PATH`). Both key sets are `{kid: PEM certificate}` with a
  `Cache-Control: max-age`; `rotate_keys` signs with a new key from then on, the old one
  still published.
- "Receive and respond to user interactions" and the `EventType` and `Event` reference:
  a `MESSAGE` event for every message in a direct message with the app, and in a space or
  group conversation only for a message that @mentions the app (a `USER_MENTION`
  annotation of the app, type BOT; `argumentText` is the text without it); a thread
  reply has `threadReply` true and its thread's `name`. `ADDED_TO_SPACE` when a person
  adds the app, with the message when they added it by mentioning it. The app answers
  the HTTP request within 30 seconds (`response_timeout`): a JSON body with `text` is
  posted as the app's message (in the same thread for a thread reply, else as a new
  thread), `{}` posts nothing. Google documents no retry and this fake makes none: an
  event not answered 200 in time is lost (`deliveries` records every attempt).
  Google does not say in what order it sends events; this fake sends a space's one at a
  time, in the order they were written (as a person writes them), spaces concurrently.
- The Chat API reference, `spaces.messages.create`, `.patch`, `.get`, `spaces.list`,
  `media.download`, `Message`, `Thread`: requests need the app's access token (else 401
  UNAUTHENTICATED); errors are `{"error": {"code", "message", "status"}}`. `create`:
  `text` non-empty and at most 32,000 bytes (`MAX_MESSAGE_BYTES`, "the maximum message
  size, including text and cards") else 400 INVALID_ARGUMENT; `messageReplyOption`
  unset starts a new thread whatever `thread` says, `REPLY_MESSAGE_FALLBACK_TO_NEW_THREAD`
  replies in `thread.name` (or the app's `thread.threadKey`) and starts a new thread when
  it is not found, `REPLY_MESSAGE_OR_FAIL` answers 404 NOT_FOUND then; `requestId`
  already used in the space returns the message made with it; `messageId` (`client-`,
  lower-case letters, digits and hyphens, at most 63 characters, else 400) names the
  message (`spaces/S/messages/client-...` for get and patch) and a second message with
  an id the space has answers 409 ALREADY_EXISTS. `patch` (`updateMask=text`) only the
  app's own messages (else 403 PERMISSION_DENIED). `<users/ID>` in the text mentions
  that person and `<users/all>` everyone ("Format messages"); they become
  `USER_MENTION` annotations. `markupSyntax` is recorded as given.
- "Usage limits": a space takes `writes_per_minute` writes (creates and patches) per 60
  seconds, shared by every app in it; past that, 429 RESOURCE_EXHAUSTED.
- "Using OAuth 2.0 for Server to Server Applications" (developers.google.com/identity/
  protocols/oauth2/service-account): the JWT bearer grant. `POST /token` with
  `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` and an `assertion` RS256-signed
  by the service account's key, `iss` its email, `scope`, `aud` the token endpoint, an
  hour at most between `iat` and `exp`; answers `{access_token, expires_in, token_type}`
  or 400 `{"error": "invalid_grant"|"invalid_scope"|"unsupported_grant_type",
  "error_description"}`. `revoke_key` makes the account's key invalid (a deleted key).

Scripting, in the running event loop or from a test thread (``FakeGoogleChat.in_thread()``)::

    with FakeGoogleChat.in_thread() as fake:
        fake.webhook_url = "http://127.0.0.1:8080/googlechat/events"
        alice = fake.add_user("Alice")
        dm = fake.dm_space(alice["name"])
        fake.user_message(dm["name"], alice["name"], "hello")          # delivered
        town = fake.create_space("Town", [alice["name"]])
        fake.user_message(town["name"], alice["name"], "hi all")        # not delivered
        fake.user_message(town["name"], alice["name"], "hi", mention=True)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import datetime
import itertools
import json
import re
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jwt
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from tests.fakes._serving import LocalApiServer, at_least, running_loop

CHAT_ISSUER = "chat@system.gserviceaccount.com"
CHAT_CERTS_PATH = f"/service_accounts/v1/metadata/x509/{CHAT_ISSUER}"
OIDC_CERTS_PATH = "/oauth2/v1/certs"
OIDC_ISSUER = "https://accounts.google.com"
TOKEN_PATH = "/token"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
CHAT_BOT_SCOPE = "https://www.googleapis.com/auth/chat.bot"
MAX_MESSAGE_BYTES = 32_000
RESPONSE_TIMEOUT = 30.0
WRITES_PER_MINUTE = 60
DEFAULT_PROJECT_NUMBER = "486950371853"
APP_NAME = "Kit Bot"
REPLY_OR_NEW_THREAD = "REPLY_MESSAGE_FALLBACK_TO_NEW_THREAD"
REPLY_OR_FAIL = "REPLY_MESSAGE_OR_FAIL"

Payload = dict[str, Any]

_CLIENT_ID = re.compile(r"client-[a-z0-9-]{1,56}")
_MENTION = re.compile(r"<(users/(?:all|\d+))>")
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def rfc3339(at: float) -> str:
    """Google's time format, with microseconds (`2024-05-01T10:00:00.123456Z`)."""
    moment = datetime.datetime.fromtimestamp(at, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def google_error(status: int, message: str) -> Payload:
    return {"error": {"code": status, "message": message, "status": _STATUS.get(status, "UNKNOWN")}}


class _ApiFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _random_id(length: int = 11) -> str:
    alphabet = string.ascii_letters + string.digits + "_-"
    return "".join(secrets.choice(alphabet) for _ in range(length))


def _numeric_id() -> str:
    return str(100_000_000_000_000_000_000 + secrets.randbelow(10**20))


class Signer:
    """RSA keys that sign tokens, each published as a self-signed certificate by kid."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.keys: dict[str, rsa.RSAPrivateKey] = {}
        self.certificates: dict[str, str] = {}
        self.current = ""
        self.rotate()

    def rotate(self) -> str:
        """A new key signs from now on; the old ones stay published. Its kid."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        kid = secrets.token_hex(20)
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.subject)])
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=14))
            .sign(key, hashes.SHA256())
        )
        self.keys[kid] = key
        self.certificates[kid] = certificate.public_bytes(serialization.Encoding.PEM).decode()
        self.current = kid
        return kid

    def sign(self, claims: Mapping[str, Any], kid: str | None = None) -> str:
        kid = kid or self.current
        return jwt.encode(dict(claims), self.keys[kid], algorithm="RS256", headers={"kid": kid})


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered request: `method` is ``"<HTTP method> <route>"`` (``POST messages``,
    ``PATCH message``, ``POST token``, ...)."""

    method: str
    path: str
    params: Mapping[str, str]
    body: Any
    status: int
    at: float


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event POSTed to the app: what it was, and how the app answered (a status, or
    a failure: `timeout`, a connection error, a status other than 200)."""

    number: int
    event: Payload
    sent_at: float
    answered_at: float
    status: int
    failure: str | None
    response: Any = None

    @property
    def delivered(self) -> bool:
        return self.failure is None

    @property
    def message_name(self) -> str:
        return str((self.event.get("message") or {}).get("name") or "")


@dataclass
class _Space:
    resource: Payload
    members: set[str] = field(default_factory=set)  # user resource names
    app_member: bool = True
    messages: list[str] = field(default_factory=list)  # message names, in order
    threads: set[str] = field(default_factory=set)  # thread names
    thread_keys: dict[str, str] = field(default_factory=dict)  # the app's key -> thread


class FakeGoogleChat(LocalApiServer[ApiCall]):
    """A scriptable Google Chat; see the module docstring."""

    _thread_name = "fake-googlechat"

    def __init__(
        self,
        *,
        project_number: str = DEFAULT_PROJECT_NUMBER,
        app_name: str = APP_NAME,
        audience: str | None = None,
        token_lifetime: float = 3600.0,
        writes_per_minute: int = WRITES_PER_MINUTE,
        response_timeout: float = RESPONSE_TIMEOUT,
        cert_max_age: int = 21_600,
    ) -> None:
        super().__init__()
        self.project_number = project_number
        #: The app's authentication audience: the project number (the default) or its
        #: endpoint URL, which decides the form of the bearer tokens (module docstring).
        self.audience = audience or project_number
        self.app_user: Payload = {
            "name": f"users/{_numeric_id()}",
            "displayName": app_name,
            "type": "BOT",
        }
        self.token_lifetime = token_lifetime
        self.writes_per_minute = writes_per_minute
        self.response_timeout = response_timeout
        self.cert_max_age = cert_max_age
        self.chat_signer = Signer(CHAT_ISSUER)
        self.oidc_signer = Signer("accounts.google.com")
        self._account_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.client_email = "kit-bot@kit-project-123.iam.gserviceaccount.com"
        self.private_key_id = secrets.token_hex(20)
        self._key_revoked = False
        self._token_uris: set[str] = set()
        self._tokens: dict[str, tuple[float, str]] = {}  # access token -> (expires, scope)
        self.users: dict[str, Payload] = {}
        self._spaces: dict[str, _Space] = {}
        self._dms: dict[str, str] = {}  # user name -> DM space name
        self.messages: dict[str, Payload] = {}
        self._made: dict[str, float] = {}  # message name -> when it was made
        self._events: dict[str, Payload] = {}  # message name -> the event that carried it
        self._client_ids: dict[tuple[str, str], str] = {}
        self._request_ids: dict[tuple[str, str], str] = {}
        self._writes: dict[str, list[float]] = {}
        self._faults: list[tuple[int, str, bool]] = []  # (status, message, after doing it)
        self.media: dict[str, tuple[bytes, str]] = {}
        self.markup: dict[str, str] = {}  # message name -> markupSyntax it was sent with
        self.webhook_url: str | None = None
        self.cert_fetches = 0
        self._deliveries: list[Delivery] = []
        self._numbers = itertools.count()
        self._queues: dict[str, asyncio.Queue[Payload]] = {}
        self._pending = 0
        self._tasks: set[asyncio.Future[Any]] = set()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post(TOKEN_PATH, self._token)
        app.router.add_get(CHAT_CERTS_PATH, self._chat_certs)
        app.router.add_get(OIDC_CERTS_PATH, self._oidc_certs)
        app.router.add_route("*", "/v1/{tail:.*}", self._api)
        return app

    async def stop(self) -> None:
        pending = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await super().stop()

    # -- the service account ----------------------------------------------------------

    def service_account_info(self, token_uri: str | None = None) -> Payload:
        """The app's service account key file (as the console makes it), whose token
        endpoint is this fake's (`token_uri`: another address that reaches it, a proxy)."""
        uri = token_uri or f"{self.url}{TOKEN_PATH}"
        with self._lock:
            self._token_uris.add(uri)
        pem = self._account_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        return {
            "type": "service_account",
            "project_id": "kit-project-123",
            "private_key_id": self.private_key_id,
            "private_key": pem,
            "client_email": self.client_email,
            "client_id": _numeric_id(),
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": uri,
            "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
            "universe_domain": "googleapis.com",
        }

    def revoke_key(self) -> None:
        """The account's key is deleted: the token endpoint refuses its assertions."""
        with self._lock:
            self._key_revoked = True

    def expire_tokens(self) -> None:
        """Every access token given out so far stops working (401 from the API)."""
        with self._lock:
            self._tokens.clear()

    async def _token(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        status, answer = 200, {}
        try:
            answer = self._grant(
                str(form.get("grant_type") or ""), str(form.get("assertion") or "")
            )
        except _ApiFailure as exc:
            status = exc.status
            kind, _, description = exc.message.partition(": ")
            answer = {"error": kind, "error_description": description}
        self._log_call(ApiCall("POST token", request.path, {}, dict(form), status, time.time()))
        return web.json_response(answer, status=status)

    def _grant(self, grant_type: str, assertion: str) -> Payload:
        if grant_type != JWT_BEARER:
            raise _ApiFailure(400, f"unsupported_grant_type: Invalid grant_type: {grant_type}")
        try:
            claims = jwt.decode(
                assertion,
                self._account_key.public_key(),
                algorithms=["RS256"],
                options={"verify_aud": False, "verify_exp": False, "verify_iat": False},
            )
        except jwt.PyJWTError:
            raise _ApiFailure(400, "invalid_grant: Invalid JWT Signature.") from None
        with self._lock:
            revoked, uris = self._key_revoked, set(self._token_uris)
        if revoked:
            raise _ApiFailure(400, "invalid_grant: Invalid JWT Signature.")
        if claims.get("iss") != self.client_email:
            raise _ApiFailure(400, "invalid_grant: Invalid email or User ID")
        if claims.get("aud") not in uris:
            raise _ApiFailure(400, "invalid_grant: Invalid JWT: Token must be for this endpoint.")
        now = time.time()
        iat, exp = float(claims.get("iat") or 0), float(claims.get("exp") or 0)
        if not (iat - 60 <= now <= exp + 60) or exp - iat > 3600:
            raise _ApiFailure(
                400,
                "invalid_grant: Invalid JWT: Token must be a short-lived token (60 minutes) "
                "and in a reasonable timeframe. Check your iat and exp values in the JWT claim.",
            )
        scope = str(claims.get("scope") or "")
        if not scope:
            raise _ApiFailure(
                400, "invalid_scope: Invalid OAuth scope or ID token audience provided."
            )
        token = f"ya29.{secrets.token_urlsafe(48)}"
        with self._lock:
            self._tokens[token] = (now + self.token_lifetime, scope)
        return {
            "access_token": token,
            "expires_in": int(self.token_lifetime),
            "token_type": "Bearer",
        }

    # -- Google's keys ----------------------------------------------------------------

    async def _chat_certs(self, request: web.Request) -> web.StreamResponse:
        return self._certs(self.chat_signer)

    async def _oidc_certs(self, request: web.Request) -> web.StreamResponse:
        return self._certs(self.oidc_signer)

    def _certs(self, signer: Signer) -> web.StreamResponse:
        with self._lock:
            self.cert_fetches += 1
            body = dict(signer.certificates)
        headers = {"Cache-Control": f"public, max-age={self.cert_max_age}, must-revalidate"}
        return web.json_response(body, headers=headers)

    def rotate_keys(self) -> None:
        """Google signs with new keys from now on (the old ones stay published)."""
        with self._lock:
            self.chat_signer.rotate()
            self.oidc_signer.rotate()

    def event_token(self, url: str, *, lifetime: float = 3600.0) -> str:
        """The bearer token of a request to `url`, in the audience's form."""
        now = int(time.time())
        if self.audience.isdigit():
            claims = {
                "iss": CHAT_ISSUER,
                "aud": self.audience,
                "iat": now,
                "exp": now + int(lifetime),
            }
            return self.chat_signer.sign(claims)
        claims = {
            "iss": OIDC_ISSUER,
            "aud": self.audience,
            "azp": "113377899221003448877",
            "sub": "113377899221003448877",
            "email": CHAT_ISSUER,
            "email_verified": True,
            "iat": now,
            "exp": now + int(lifetime),
        }
        return self.oidc_signer.sign(claims)

    def forged_token(self, how: str) -> str:
        """A bearer token Google Chat would never send: `unknown_key` (signed by a key
        Google does not publish), `wrong_audience`, `expired`, `wrong_issuer`, or
        `unverified_email` (an ID token of another account)."""
        now = int(time.time())
        if how == "unknown_key":
            stranger = Signer("someone")
            return stranger.sign(
                {"iss": CHAT_ISSUER, "aud": self.audience, "iat": now, "exp": now + 3600}
            )
        if how == "unverified_email":
            claims = {
                "iss": OIDC_ISSUER,
                "aud": self.audience,
                "email": "someone@example.com",
                "email_verified": True,
                "iat": now,
                "exp": now + 3600,
            }
            return self.oidc_signer.sign(claims)
        signer = self.chat_signer if self.audience.isdigit() else self.oidc_signer
        issuer = CHAT_ISSUER if self.audience.isdigit() else OIDC_ISSUER
        claims = {"iss": issuer, "aud": self.audience, "email": CHAT_ISSUER, "email_verified": True}
        claims |= {"iat": now, "exp": now + 3600}
        if how == "wrong_audience":
            claims["aud"] = (
                "999999999999" if self.audience.isdigit() else "https://elsewhere.example/x"
            )
        elif how == "expired":
            claims["iat"], claims["exp"] = now - 7200, now - 3600
        elif how == "wrong_issuer":
            claims["iss"] = "someone@example.iam.gserviceaccount.com"
        else:
            raise ValueError(f"no such forgery: {how}")
        return signer.sign(claims)

    # -- people and spaces ------------------------------------------------------------

    def add_user(self, display_name: str, *, email: str | None = None) -> Payload:
        """A person of the organization."""
        user = {
            "name": f"users/{_numeric_id()}",
            "displayName": display_name,
            "email": email or f"{display_name.lower().replace(' ', '.')}@example.com",
            "avatarUrl": "https://lh3.googleusercontent.com/a/default-user",
            "type": "HUMAN",
            "domainId": "c0kk1d3",
        }
        with self._lock:
            self.users[user["name"]] = user
        return dict(user)

    def dm_space(self, user: str) -> Payload:
        """The direct message between `user` and the app (made on first use)."""
        with self._lock:
            known = self._dms.get(user)
            if known is not None:
                return dict(self._spaces[known].resource)
            name = f"spaces/{_random_id()}"
            resource = {
                "name": name,
                "type": "DM",
                "spaceType": "DIRECT_MESSAGE",
                "singleUserBotDm": True,
                "spaceThreadingState": "THREADED_MESSAGES",
                "spaceHistoryState": "HISTORY_ON",
            }
            self._spaces[name] = _Space(resource, {user})
            self._dms[user] = name
            return dict(resource)

    def create_space(self, display_name: str, members: list[str], *, app: bool = True) -> Payload:
        """A named space of `members` (user names), with the app in it unless `app` is
        False."""
        name = f"spaces/{_random_id()}"
        resource = {
            "name": name,
            "type": "ROOM",
            "spaceType": "SPACE",
            "displayName": display_name,
            "singleUserBotDm": False,
            "spaceThreadingState": "THREADED_MESSAGES",
            "spaceHistoryState": "HISTORY_ON",
        }
        with self._lock:
            self._spaces[name] = _Space(resource, set(members), app_member=app)
        return dict(resource)

    def add_app(self, space: str, by: str, *, text: str | None = None) -> Payload:
        """`by` adds the app to `space` (by mentioning it in `text`, when given): the
        ADDED_TO_SPACE event, which carries that message."""
        with self._lock:
            self._spaces[space].app_member = True
        message = self._make_message(space, by, text, mention=True) if text is not None else None
        event = self._event("ADDED_TO_SPACE", space, by, message)
        self._enqueue(space, event)
        return event

    def remove_app(self, space: str, by: str) -> None:
        with self._lock:
            self._spaces[space].app_member = False
        self._enqueue(space, self._event("REMOVED_FROM_SPACE", space, by, None))

    def add_media(self, data: bytes, mime_type: str, name: str) -> Payload:
        """A file a person uploads: the `attachment` entry of their message."""
        resource = f"ClxDeGxhcHJvZHV{secrets.token_urlsafe(24)}"
        with self._lock:
            self.media[resource] = (data, mime_type)
        return {
            "name": f"spaces/x/messages/y/attachments/{secrets.token_urlsafe(8)}",
            "contentName": name,
            "contentType": mime_type,
            "attachmentDataRef": {"resourceName": resource},
            "source": "UPLOADED_CONTENT",
        }

    def user_message(
        self,
        space: str,
        user: str,
        text: str,
        *,
        mention: bool = False,
        thread: str | None = None,
        attachments: list[Payload] | None = None,
    ) -> Payload:
        """`user` writes `text` in `space` (in `thread`, a thread's name, when given),
        mentioning the app first when `mention`. Google Chat sends the app the MESSAGE
        event when the space is a direct message with it, or the message mentions it;
        the message (as the event carries it) is returned either way."""
        message = self._make_message(space, user, text, mention=mention, thread=thread)
        if attachments:
            message["attachment"] = copy.deepcopy(attachments)
            with self._lock:
                self.messages[message["name"]]["attachment"] = copy.deepcopy(attachments)
        with self._lock:
            place = self._spaces[space]
            told = place.app_member and (place.resource["spaceType"] == "DIRECT_MESSAGE" or mention)
        if told:
            event = self._event("MESSAGE", space, user, message)
            with self._lock:
                self._events[message["name"]] = event
            self._enqueue(space, event)
        return message

    def forged_event(self, text: str) -> Payload:
        """A MESSAGE event of a direct message no one wrote (for a forged request)."""
        space = {"name": f"spaces/{_random_id()}", "type": "DM", "spaceType": "DIRECT_MESSAGE"}
        user = {"name": f"users/{_numeric_id()}", "displayName": "Forger", "type": "HUMAN"}
        thread = f"{space['name']}/threads/{_random_id()}"
        message = {
            "name": f"{space['name']}/messages/{_random_id()}",
            "sender": user,
            "createTime": rfc3339(time.time()),
            "text": text,
            "argumentText": text,
            "thread": {"name": thread},
            "space": space,
            "threadReply": False,
        }
        return {
            "type": "MESSAGE",
            "eventTime": rfc3339(time.time()),
            "space": space,
            "user": user,
            "message": message,
        }

    def deliver_soon(
        self, event: Payload, *, token: str | None = None
    ) -> concurrent.futures.Future[Delivery]:
        """Start `deliver` in the fake's own loop, from any thread."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeGoogleChat is not running")
        return asyncio.run_coroutine_threadsafe(self.deliver(event, token=token), loop)

    def redeliver(self, message_name: str) -> None:
        """Send the event that carried a message once more (what a proxy's retry, or a
        second delivery, would do)."""
        with self._lock:
            event = self._events[message_name]
        self._enqueue(str(event["space"]["name"]), copy.deepcopy(event))

    def _make_message(
        self,
        space: str,
        user: str,
        text: str,
        *,
        mention: bool,
        thread: str | None = None,
    ) -> Payload:
        with self._lock:
            place = self._spaces[space]
            sender = dict(self.users[user])
            if thread is not None and thread not in place.threads:
                raise ValueError(f"{thread} is not a thread of {space}")
            thread_name = thread or f"{space}/threads/{_random_id()}"
            thread_id = thread_name.rsplit("/", 1)[-1]
            message_id = f"{thread_id}.{_random_id() if thread else thread_id}"
            name = f"{space}/messages/{message_id}"
            body = text
            annotations: list[Payload] = []
            if mention:
                label = f"@{self.app_user['displayName']}"
                body = f"{label} {text}"
                annotations.append(
                    {
                        "type": "USER_MENTION",
                        "startIndex": 0,
                        "length": len(label),
                        "userMention": {"user": dict(self.app_user), "type": "MENTION"},
                    }
                )
            now = time.time()
            message: Payload = {
                "name": name,
                "sender": sender,
                "createTime": rfc3339(now),
                "text": body,
                "formattedText": body,
                "thread": {"name": thread_name},
                "space": {"name": space},
                "argumentText": f" {text}" if mention else body,
                "threadReply": thread is not None,
            }
            if annotations:
                message["annotations"] = annotations
            place.threads.add(thread_name)
            place.messages.append(name)
            self.messages[name] = copy.deepcopy(message)
            self._made[name] = now
        self._notify()
        return message

    def _event(self, kind: str, space: str, user: str, message: Payload | None) -> Payload:
        with self._lock:
            resource = dict(self._spaces[space].resource)
            sender = dict(self.users[user])
        event: Payload = {
            "type": kind,
            "eventTime": rfc3339(time.time()),
            "space": resource,
            "user": sender,
            "common": {"userLocale": "en", "hostApp": "CHAT", "timeZone": {"id": "UTC"}},
        }
        if message is not None:
            full = copy.deepcopy(message)
            full["space"] = dict(resource)
            event["message"] = full
            event["configCompleteRedirectUrl"] = (
                f"https://chat.google.com/api/bot_config_complete?token={secrets.token_urlsafe(16)}"
            )
        return event

    # -- what happened ----------------------------------------------------------------

    def space(self, name: str) -> Payload:
        with self._lock:
            return dict(self._spaces[name].resource)

    def messages_in(self, space: str) -> list[Payload]:
        with self._lock:
            return [copy.deepcopy(self.messages[n]) for n in self._spaces[space].messages]

    def app_messages(self) -> list[Payload]:
        """Every message the app made (the API's and its synchronous answers), in the
        order they were made, as they are now (an edited one shows its last text)."""
        with self._lock:
            return [
                copy.deepcopy(m)
                for place in self._spaces.values()
                for name in place.messages
                if (m := self.messages[name])["sender"]["name"] == self.app_user["name"]
            ]

    def app_texts(self) -> list[tuple[float, str]]:
        """(when it was made, Unix seconds; its text) of every message the app made: a
        cheap `app_messages` for a benchmark that polls."""
        with self._lock:
            return [
                (self._made[name], str(m["text"]))
                for place in self._spaces.values()
                for name in place.messages
                if (m := self.messages[name])["sender"]["name"] == self.app_user["name"]
            ]

    @property
    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    def wait_for_deliveries(self, count: int, timeout: float = 10.0) -> list[Delivery]:
        """Block until `count` events were POSTed to the app (answered or not)."""
        return self._wait_blocking(
            at_least(count, lambda: self.deliveries),
            timeout,
            async_method="delivered",
            describe_timeout=lambda: f"{len(self.deliveries)} of {count} deliveries in {timeout}s",
        )

    async def delivered(self, count: int) -> list[Delivery]:
        """Wait (any loop) until `count` events were POSTed; bound it with a timeout."""
        return await self._on_server_loop(self._until(at_least(count, lambda: self.deliveries)))

    async def app_posted(self, count: int) -> list[Payload]:
        """Wait (any loop) until the app made `count` messages."""
        return await self._on_server_loop(self._until(at_least(count, self.app_messages)))

    def idle(self) -> bool:
        """No event waits to be delivered."""
        with self._lock:
            return self._pending == 0

    # -- delivering events --------------------------------------------------------------

    def _enqueue(self, space: str, event: Payload) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeGoogleChat is not running")
        with self._lock:
            self._pending += 1
        if running_loop() is loop:
            self._put(space, event)
        else:
            loop.call_soon_threadsafe(self._put, space, event)

    def _put(self, space: str, event: Payload) -> None:
        queue = self._queues.get(space)
        if queue is None:
            queue = self._queues[space] = asyncio.Queue()
            task = asyncio.ensure_future(self._deliver_in_order(queue))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        queue.put_nowait(event)

    async def _deliver_in_order(self, queue: asyncio.Queue[Payload]) -> None:
        while True:
            event = await queue.get()
            try:
                await self.deliver(event)
            finally:
                with self._lock:
                    self._pending -= 1
                self._notify()

    async def deliver(self, event: Payload, *, token: str | None = None) -> Delivery:
        """POST `event` to `webhook_url` once, as Google Chat does (signed, answered
        within `response_timeout` or failed; never retried); a `text` in the answer is
        posted as the app's message. Runs in the caller's loop (any loop)."""
        url = self.webhook_url
        sent = time.time()
        status, failure, response = 0, None, None
        if url is None:
            failure = "no endpoint configured"
        else:
            headers = {
                "Authorization": f"Bearer {token or self.event_token(url)}",
                "Content-Type": "application/json",
                "User-Agent": "Google-Dynamite",
            }
            connector = aiohttp.TCPConnector(force_close=True)
            try:
                async with (
                    aiohttp.ClientSession(connector=connector) as session,
                    asyncio.timeout(self.response_timeout),
                    session.post(url, data=json.dumps(event).encode(), headers=headers) as answer,
                ):
                    status = answer.status
                    raw = await answer.read()
                if status != 200:
                    failure = f"HTTP {status}"
                else:
                    try:
                        response = json.loads(raw) if raw else {}
                    except ValueError:
                        failure = "an answer that is not JSON"
            except TimeoutError:
                failure = "timeout"
            except aiohttp.ClientError as exc:
                failure = type(exc).__name__
        if failure is None and isinstance(response, dict) and response.get("text"):
            self._synchronous_reply(event, str(response["text"]))
        with self._lock:
            delivery = Delivery(
                next(self._numbers),
                copy.deepcopy(event),
                sent,
                time.time(),
                status,
                failure,
                response,
            )
            self._deliveries.append(delivery)
        self._notify()
        return delivery

    def _synchronous_reply(self, event: Payload, text: str) -> None:
        message = event.get("message") or {}
        space = str((event.get("space") or {}).get("name") or "")
        thread = (
            str((message.get("thread") or {}).get("name") or "")
            if message.get("threadReply")
            else None
        )
        try:
            self._create(
                space,
                {"text": text},
                {"messageReplyOption": REPLY_OR_NEW_THREAD} if thread else {},
                thread,
            )
        except _ApiFailure:
            pass

    # -- the Chat API -------------------------------------------------------------------

    def fail_next(self, status: int, count: int = 1, *, after: bool = False) -> None:
        """The next `count` API requests (not token requests) answer `status`; with
        `after` each is carried out first (a lost answer)."""
        with self._lock:
            self._faults.extend([(status, f"scripted {status}", after)] * count)

    def heal(self) -> None:
        """Drop the scripted failures not used yet."""
        with self._lock:
            self._faults.clear()

    async def _api(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        params = dict(request.query)
        body: Any = None
        route = self._route_name(request.method, tail)
        after = False
        fault: tuple[int, str, bool] | None = None
        try:
            self._check_token(request)
            with self._lock:
                fault = self._faults.pop(0) if self._faults else None
            if fault is not None and not fault[2]:
                raise _ApiFailure(fault[0], fault[1])
            after = fault is not None
            if request.method in ("POST", "PATCH"):
                raw = await request.read()
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    raise _ApiFailure(400, "Invalid JSON payload received.") from None
            answer, raw_answer = self._route(request.method, tail, params, body)
            if after and fault is not None:
                raise _ApiFailure(fault[0], fault[1])
            status = 200
        except _ApiFailure as exc:
            status, answer, raw_answer = exc.status, google_error(exc.status, exc.message), None
        self._log_call(ApiCall(route, request.path, params, body, status, time.time()))
        if raw_answer is not None:
            data, mime = raw_answer
            return web.Response(body=data, content_type=mime.split(";")[0])
        return web.json_response(answer, status=status)

    def _check_token(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        with self._lock:
            found = self._tokens.get(token) if scheme == "Bearer" else None
        if found is None or found[0] < time.time():
            raise _ApiFailure(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access "
                "token, login cookie or other valid authentication credential.",
            )
        if CHAT_BOT_SCOPE not in found[1].split():
            raise _ApiFailure(403, "Request had insufficient authentication scopes.")

    @staticmethod
    def _route_name(method: str, tail: str) -> str:
        """The name a request is logged under (`ApiCall.method`)."""
        parts = tail.split("/")
        if tail == "spaces":
            return f"{method} spaces"
        if parts[0] == "media":
            return f"{method} media"
        if len(parts) == 3 and parts[0] == "spaces" and parts[2] == "messages":
            return f"{method} messages"
        if len(parts) == 4 and parts[0] == "spaces" and parts[2] == "messages":
            return f"{method} message"
        return f"{method} {tail}"

    def _route(
        self, method: str, tail: str, params: Mapping[str, str], body: Any
    ) -> tuple[Payload, tuple[bytes, str] | None]:
        route = self._route_name(method, tail)
        parts = tail.split("/")
        if route == "GET spaces":
            return self._list_spaces(), None
        if route == "GET media":
            return self._download("/".join(parts[1:]), params)
        if route in ("POST messages", "PATCH message") and not isinstance(body, dict):
            raise _ApiFailure(400, "Invalid JSON payload received.")
        if route == "POST messages":
            return self._create(f"spaces/{parts[1]}", body, params, None), None
        if route == "GET message":
            return self._get(tail), None
        if route == "PATCH message":
            return self._patch(tail, body, params), None
        raise _ApiFailure(404, f"Method not found: {method} /v1/{tail}")

    def _space_of(self, space: str) -> _Space:
        place = self._spaces.get(space)
        if place is None or not place.app_member:
            raise _ApiFailure(404, f"Space not found: {space}")
        return place

    def _count_write(self, space: str) -> None:
        now = time.time()
        recent = [t for t in self._writes.get(space, []) if t > now - 60.0]
        if len(recent) >= self.writes_per_minute:
            raise _ApiFailure(
                429,
                "Quota exceeded for quota metric 'Write requests' and limit 'Write requests "
                "per minute per space' of service 'chat.googleapis.com'.",
            )
        recent.append(now)
        self._writes[space] = recent

    @staticmethod
    def _check_text(text: object) -> str:
        if not isinstance(text, str) or not text:
            raise _ApiFailure(400, "Message cannot be empty. Discarding empty message.")
        if len(text.encode("utf-8")) > MAX_MESSAGE_BYTES:
            raise _ApiFailure(400, f"Message text is longer than {MAX_MESSAGE_BYTES} bytes.")
        return text

    def _mentions(self, text: str) -> list[Payload]:
        found = []
        for match in _MENTION.finditer(text):
            name = match.group(1)
            user = self.users.get(name, {"name": name, "displayName": "all", "type": "HUMAN"})
            found.append(
                {
                    "type": "USER_MENTION",
                    "startIndex": match.start(),
                    "length": match.end() - match.start(),
                    "userMention": {"user": dict(user), "type": "MENTION"},
                }
            )
        return found

    def _create(
        self, space: str, body: Payload, params: Mapping[str, str], thread_hint: str | None
    ) -> Payload:
        with self._lock:
            place = self._space_of(space)
            request_id = params.get("requestId")
            if request_id and (space, request_id) in self._request_ids:
                return copy.deepcopy(self.messages[self._request_ids[(space, request_id)]])
            client_id = params.get("messageId")
            if client_id is not None:
                if len(client_id) > 63 or not _CLIENT_ID.fullmatch(client_id):
                    raise _ApiFailure(
                        400,
                        "Invalid message id: a custom id starts with client-, holds lower-case "
                        "letters, digits and hyphens, and has at most 63 characters.",
                    )
                if (space, client_id) in self._client_ids:
                    raise _ApiFailure(
                        409, f"Message with id {client_id} already exists in {space}."
                    )
            text = self._check_text(body.get("text"))
            thread = self._thread_for(place, space, body, params, thread_hint)
            self._count_write(space)
            thread_name, reply = thread
            thread_id = thread_name.rsplit("/", 1)[-1]
            message_id = f"{thread_id}.{_random_id() if reply else thread_id}"
            name = f"{space}/messages/{message_id}"
            message: Payload = {
                "name": name,
                "sender": {"name": self.app_user["name"], "type": "BOT"},
                "createTime": rfc3339(time.time()),
                "text": text,
                "formattedText": text,
                "thread": {"name": thread_name},
                "space": {"name": space},
                "argumentText": text,
                "threadReply": reply,
            }
            key = (body.get("thread") or {}).get("threadKey") or params.get("threadKey")
            if key:
                message["thread"]["threadKey"] = key
            mentions = self._mentions(text)
            if mentions:
                message["annotations"] = mentions
            if client_id is not None:
                message["clientAssignedMessageId"] = client_id
                self._client_ids[(space, client_id)] = name
            if request_id:
                self._request_ids[(space, request_id)] = name
            if body.get("markupSyntax"):
                self.markup[name] = str(body["markupSyntax"])
            place.threads.add(thread_name)
            place.messages.append(name)
            self.messages[name] = copy.deepcopy(message)
            self._made[name] = time.time()
        self._notify()
        return message

    def _thread_for(
        self,
        place: _Space,
        space: str,
        body: Payload,
        params: Mapping[str, str],
        hint: str | None,
    ) -> tuple[str, bool]:
        """(thread name, whether the message is a reply in it)."""
        option = params.get("messageReplyOption", "MESSAGE_REPLY_OPTION_UNSPECIFIED")
        wanted = body.get("thread") or {}
        name = hint or str(wanted.get("name") or "")
        key = str(wanted.get("threadKey") or params.get("threadKey") or "")
        if option not in (REPLY_OR_NEW_THREAD, REPLY_OR_FAIL):
            return f"{space}/threads/{_random_id()}", False
        if name:
            if name in place.threads:
                return name, True
            if option == REPLY_OR_FAIL:
                raise _ApiFailure(404, f"Thread not found: {name}")
            return f"{space}/threads/{_random_id()}", False
        if key:
            known = place.thread_keys.get(key)
            if known is not None:
                return known, True
            fresh = f"{space}/threads/{_random_id()}"
            place.thread_keys[key] = fresh
            return fresh, False
        return f"{space}/threads/{_random_id()}", False

    def _resolve(self, name: str) -> str:
        space, _, last = name.rpartition("/messages/")
        if last.startswith("client-"):
            found = self._client_ids.get((space, last))
            if found is None:
                raise _ApiFailure(404, f"Message not found: {name}")
            return found
        if name not in self.messages:
            raise _ApiFailure(404, f"Message not found: {name}")
        return name

    def _get(self, name: str) -> Payload:
        with self._lock:
            self._space_of(name.split("/messages/")[0])
            return copy.deepcopy(self.messages[self._resolve(name)])

    def _patch(self, name: str, body: Payload, params: Mapping[str, str]) -> Payload:
        mask = {m.strip() for m in params.get("updateMask", "").split(",") if m.strip()}
        if "text" not in mask and "*" not in mask:
            raise _ApiFailure(400, "updateMask must name the fields to update (text).")
        space = name.split("/messages/")[0]
        with self._lock:
            self._space_of(space)
            try:
                real = self._resolve(name)
            except _ApiFailure:
                if params.get("allowMissing") == "true" and "/messages/client-" in name:
                    return self._create(space, body, {"messageId": name.rsplit("/", 1)[-1]}, None)
                raise
            message = self.messages[real]
            if message["sender"]["name"] != self.app_user["name"]:
                raise _ApiFailure(
                    403, "The caller does not have permission: not the app's message."
                )
            text = self._check_text(body.get("text"))
            self._count_write(space)
            message["text"] = message["formattedText"] = message["argumentText"] = text
            message["lastUpdateTime"] = rfc3339(time.time())
            mentions = self._mentions(text)
            if mentions:
                message["annotations"] = mentions
            else:
                message.pop("annotations", None)
            if body.get("markupSyntax"):
                self.markup[real] = str(body["markupSyntax"])
            answer = copy.deepcopy(message)
        self._notify()
        return answer

    def _list_spaces(self) -> Payload:
        with self._lock:
            return {
                "spaces": [
                    dict(place.resource) for place in self._spaces.values() if place.app_member
                ]
            }

    def _download(
        self, resource: str, params: Mapping[str, str]
    ) -> tuple[Payload, tuple[bytes, str] | None]:
        with self._lock:
            found = self.media.get(resource)
        if found is None:
            raise _ApiFailure(404, f"Media not found: {resource}")
        if params.get("alt") != "media":
            return {"resourceName": resource}, None
        return {}, found


def mentions_of(message: Payload) -> tuple[set[str], bool]:
    """(user ids a message mentions, whether it mentions everyone: `<users/all>`)."""
    people: set[str] = set()
    everyone = False
    for annotation in message.get("annotations") or ():
        if annotation.get("type") != "USER_MENTION":
            continue
        name = str(((annotation.get("userMention") or {}).get("user") or {}).get("name") or "")
        if name == "users/all":
            everyone = True
        elif name.startswith("users/"):
            people.add(name.removeprefix("users/"))
    return people, everyone
