"""The WhatsApp channel: the WhatsApp Business Cloud API, its webhook in on the gateway's
own HTTP port and the Graph API out over aiohttp.

Inbound: Meta POSTs every change of the business numbers to `POST /whatsapp/webhook`
(`WHATSAPP_WEBHOOK_PATH`); `GET` on the same path answers the subscription handshake
(`hub.mode=subscribe`, `hub.verify_token`, `hub.challenge`). `translate_payload` turns a
delivery into messages, status callbacks and notices (pure). A message's session key is
`whatsapp:<phone_number_id>:<wa_id>` (one business number serves many people; a person
with a username and no phone number in the webhook is keyed by their business-scoped
user id); its message id is the `wamid`, which a redelivery keeps.

Outbound: `send` converts the reply's Markdown to WhatsApp's formatting, splits it at
4,096 characters and POSTs each part to `/<phone_number_id>/messages`, the first part
quoting the person's message when they wrote again meanwhile (`quote_replies`); files go
up to `/<phone_number_id>/media` and out as an image or a document. A reply due outside
the 24-hour customer-service window (the person's last message is older) is not sent as
free text: the configured template goes instead, or the reply is kept as undeliverable.

Promises (tested in tests/test_whatsapp*.py and by the conformance kit, tests/conformance):
- Every POST is checked against `X-Hub-Signature-256` (HMAC-SHA256 of the raw body with
  the app secret, compared in constant time) before anything else is done with it: a
  missing or wrong signature is a 401 and nothing is read from the body.
- Journal before the 200: the webhook answers 200 only once every message of the
  delivery is in the journal (or settled: a duplicate, a refusal, a notice) and every
  status in the store; otherwise 503, and Meta delivers it all again (for up to 7 days).
  Messages are submitted in the delivery's order; a redelivered `wamid` is answered
  once (the dispatcher's journal dedupes it, across restarts and replicas).
- The window opens with the person's message, before it is submitted: a reply never
  sees an older window than the message it answers.
- A part is sent at most once: a request is repeated only when it certainly did not
  take effect (a throughput limit: 130429, 131056, 80007, 4; Meta's 131016 or an HTTP
  503; a connection that never opened), within `RetryPolicy`. A part still failing so
  when the reply's time runs out raises `DeliveryFailed`: the dispatcher sends the
  reply again later, and it goes on from that part. Whatever else did not certainly go
  out (the rest of a reply after a part that may have, or that Meta refused; a reply
  outside the window without a template; a part Meta later reports failed with 131047
  or 131026) is kept in the store as undeliverable, with the reason, and shown on the
  admin page; never dropped silently.
- Status callbacks (sent, delivered, read, failed) move the sent message's status on,
  never back; a `failed` one is logged with its code and reason and counted once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.notices import NoticeCooldown
from channels.whatsapp.format import markdown_to_whatsapp, plain_line, split_whatsapp
from channels.whatsapp.settings import WhatsAppSettings
from channels.whatsapp.store import HeldReply, SentMessage, WhatsAppStore
from gateway import failpoints
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from gateway.registry import Mount

#: Where the platform posts its events on the gateway's HTTP port.
WHATSAPP_WEBHOOK_PATH = "/whatsapp/webhook"

CHANNEL = "whatsapp"
SIGNATURE_HEADER = "X-Hub-Signature-256"
ENV_PREFIX = "GATEWAY_CHANNELS__WHATSAPP__"
#: The customer-service window: free text only this long after the person's message.
WINDOW_SECONDS = 24 * 3600.0
#: A reply this close to the window's end is treated as outside it (clock skew, and
#: the time the request takes): better a template than a 131047.
WINDOW_MARGIN = 60.0
#: The largest webhook body read (Meta's payloads stay far below it).
WEBHOOK_MAX_BYTES = 3 * 1024 * 1024
#: Meta's limits for media a business sends.
IMAGE_LIMIT = 5 * 1024 * 1024
CAPTION_LIMIT = 1024
TEMPLATE_PARAMETER_CHARS = 900

#: Metadata: the message the person's message replies to (its wamid).
META_CONTEXT = "whatsapp_context"
META_PHONE_NUMBER_ID = "whatsapp_phone_number_id"

_BSUID = re.compile(r"^[A-Z]{2}\.[A-Za-z0-9.]+$")
_URL = re.compile(r"https?://\S")

# Graph API error codes, by name (https://developers.facebook.com/docs/whatsapp/cloud-api/
# support/error-codes).
RE_ENGAGEMENT = 131047  # more than 24 hours since the person last wrote
UNDELIVERABLE = 131026  # not on WhatsApp, old app, terms not accepted, ...
THROUGHPUT = 130429  # the number's messages-per-second throughput
PAIR_RATE = 131056  # too many messages to one person in a short time
RATE_LIMIT_ISSUES = 80007  # the WhatsApp Business Account's rate limit
TOO_MANY_CALLS = 4  # the app's API call rate limit
SERVICE_UNAVAILABLE = 131016
_RATE_LIMITS = frozenset({THROUGHPUT, PAIR_RATE, RATE_LIMIT_ISSUES, TOO_MANY_CALLS})
_AUTH = frozenset({0, 10, 190})
FAILURE_NAMES = ("re_engagement", "undeliverable", "throughput", "other")
STATUSES = ("sent", "delivered", "read", "failed")


def failure_name(code: int | None) -> str:
    """The metrics label of an error code (`FAILURE_NAMES`)."""
    if code == RE_ENGAGEMENT:
        return "re_engagement"
    if code == UNDELIVERABLE:
        return "undeliverable"
    if code in _RATE_LIMITS:
        return "throughput"
    return "other"


class WhatsAppSetupError(Exception):
    """The Graph API refused the token or a number, or cannot be reached; says what to fix
    and never holds the token."""


# --------------------------------------------------------------------------- inbound


@dataclass(frozen=True, slots=True)
class Inbound:
    """A person's message: what to submit, and its platform time (the window's start)."""

    message: InboundMessage
    at: float


@dataclass(frozen=True, slots=True)
class Status:
    """A status callback for a message the business sent."""

    wamid: str
    status: str
    error_code: int | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer the person's message with `text` without the model (what it cannot read)."""

    chat: str
    wamid: str
    text: str
    at: float


@dataclass(frozen=True, slots=True)
class Skipped:
    reason: str


Item = Inbound | Status | Notice | Skipped


def chat_id(phone_number_id: str, user: str) -> str:
    """The chat part of a session key: `<phone_number_id>:<wa_id>`."""
    return f"{phone_number_id}:{user}"


def parse_chat(chat: str, default_number: str | None = None) -> tuple[str, str]:
    """(phone_number_id, person) of a chat id; `<wa_id>` alone (a heartbeat target) is
    sent from `default_number`."""
    number, sep, user = chat.partition(":")
    if sep:
        return number, user
    if default_number is None:
        raise ValueError(f"whatsapp: {chat!r} names no business number (<phone_number_id>:<wa_id>)")
    return default_number, chat


def recipient(user: str) -> dict[str, str]:
    """The request field naming the person: `to` (a phone number's wa_id) or `recipient`
    (a business-scoped user id, for people whose number WhatsApp does not share)."""
    return {"recipient": user} if _BSUID.match(user) else {"to": user}


def _error_text(error: Mapping[str, Any]) -> tuple[int | None, str]:
    code = error.get("code")
    title = str(error.get("title") or error.get("message") or "")
    data = error.get("error_data")
    details = str(data.get("details") or "") if isinstance(data, Mapping) else ""
    text = f"{code} {title}".strip()
    if details and details != title:
        text += f": {details}"
    return (int(code) if isinstance(code, int | str) and str(code).isdigit() else None), text


def _attachment(kind: str, media: Mapping[str, Any], name: str) -> Attachment | None:
    media_id = media.get("id")
    if not isinstance(media_id, str) or not media_id:
        return None
    mime = str(media.get("mime_type") or "")
    return Attachment(kind, media_id, name, mime.split(";")[0].strip(), None)


def _content(message: Mapping[str, Any]) -> tuple[str, tuple[Attachment, ...]] | str | None:
    """(text, files) of a message the agent can read; a str: what the person sent that
    it cannot (for a notice); None: nothing to answer."""
    kind = message.get("type")
    body = message.get(kind) if isinstance(kind, str) else None
    part: Mapping[str, Any] = body if isinstance(body, Mapping) else {}
    if kind == "text":
        return str(part.get("body") or ""), ()
    if kind == "image":
        found = _attachment("image", part, "image.jpg")
        return str(part.get("caption") or ""), (found,) if found else ()
    if kind == "audio":
        name = "voice.ogg" if part.get("voice") else "audio"
        found = _attachment("voice", part, name)
        return "", (found,) if found else ()
    if kind == "document":
        mime = str(part.get("mime_type") or "")
        kind_of = (
            "image"
            if mime.startswith("image/")
            else "voice"
            if mime.startswith("audio/")
            else "document"
        )
        found = _attachment(kind_of, part, str(part.get("filename") or "document"))
        return str(part.get("caption") or ""), (found,) if found else ()
    if kind == "interactive":
        reply = part.get(str(part.get("type") or ""))
        if isinstance(reply, Mapping) and reply.get("title"):
            return str(reply["title"]), ()
        return None
    if kind == "button":
        return (str(part.get("text") or ""), ()) if part.get("text") else None
    if kind == "location":
        where = ", ".join(str(part[k]) for k in ("name", "address") if part.get(k))
        spot = f"{part.get('latitude')}, {part.get('longitude')}"
        return f"[location: {where + ' ' if where else ''}({spot})]", ()
    if kind == "contacts":
        cards = []
        for contact in message.get("contacts") or ():
            if not isinstance(contact, Mapping):
                continue
            names = contact.get("name")
            label = str(names.get("formatted_name") or "") if isinstance(names, Mapping) else ""
            phones = [
                str(p.get("phone")) for p in contact.get("phones") or () if isinstance(p, Mapping)
            ]
            cards.append(" ".join([label, *phones]).strip())
        return f"[contact card: {'; '.join(cards)}]", ()
    if kind == "video":
        if part.get("caption"):
            caption = str(part["caption"])
            return f"{caption}\n\n[The user attached a video, which the assistant cannot see.]", ()
        return "a video"
    if kind == "sticker":
        return "a sticker"
    return None  # reactions, system messages, unsupported types


def translate_payload(
    payload: Mapping[str, Any], *, phone_number_ids: frozenset[str] | set[str]
) -> list[Item]:
    """Everything one webhook delivery holds, in its order: messages to submit, status
    callbacks, notices for what cannot be read, and what is skipped (with why). Pure."""
    items: list[Item] = []
    if payload.get("object") != "whatsapp_business_account":
        return [Skipped(f"object {payload.get('object')!r} is not whatsapp_business_account")]
    for entry in payload.get("entry") or ():
        if not isinstance(entry, Mapping):
            continue
        for change in entry.get("changes") or ():
            if not isinstance(change, Mapping) or change.get("field") != "messages":
                field_name = change.get("field") if isinstance(change, Mapping) else None
                items.append(Skipped(f"a {field_name!r} change"))
                continue
            value = change.get("value")
            if isinstance(value, Mapping):
                items.extend(_value_items(value, phone_number_ids))
    return items


def _value_items(value: Mapping[str, Any], numbers: frozenset[str] | set[str]) -> list[Item]:
    metadata = value.get("metadata")
    number = str(metadata.get("phone_number_id") or "") if isinstance(metadata, Mapping) else ""
    if number not in numbers:
        return [Skipped(f"a change for phone number id {number!r}, not one of this gateway's")]
    items: list[Item] = []
    for error in value.get("errors") or ():
        if isinstance(error, Mapping):
            items.append(Skipped(f"an error Meta reported: {_error_text(error)[1]}"))
    names: dict[str, str] = {}
    for contact in value.get("contacts") or ():
        if not isinstance(contact, Mapping):
            continue
        profile = contact.get("profile")
        name = str(profile.get("name") or "") if isinstance(profile, Mapping) else ""
        for key in ("wa_id", "user_id"):
            if contact.get(key):
                names[str(contact[key])] = name
    for message in value.get("messages") or ():
        if isinstance(message, Mapping):
            items.append(_message_item(message, number, names))
    for status in value.get("statuses") or ():
        if not isinstance(status, Mapping) or not status.get("id"):
            continue
        code, text = None, ""
        for error in status.get("errors") or ():
            if isinstance(error, Mapping):
                code, text = _error_text(error)
                break
        items.append(Status(str(status["id"]), str(status.get("status") or ""), code, text))
    return items


def _message_item(message: Mapping[str, Any], number: str, names: Mapping[str, str]) -> Item:
    wamid = message.get("id")
    user = message.get("from") or message.get("from_user_id")
    if not isinstance(wamid, str) or not wamid or not isinstance(user, str) or not user:
        return Skipped("a message without an id or a sender")
    try:
        at = float(message.get("timestamp") or 0) or time.time()
    except (TypeError, ValueError):
        at = time.time()
    chat = chat_id(number, user)
    content = _content(message)
    if content is None:
        return Skipped(f"a {message.get('type')!r} message")
    if isinstance(content, str):
        return Notice(chat, wamid, unsupported_notice(content), at)
    text, files = content
    if not text.strip() and not files:
        return Skipped("an empty message")
    metadata: dict[str, Any] = {
        META_IS_GROUP: False,
        META_MENTIONED: False,
        META_REPLY_TO_BOT: False,
        META_SENT_AT: at,
        META_POST_ID: wamid,
        META_PHONE_NUMBER_ID: number,
    }
    name = names.get(user) or names.get(str(message.get("from_user_id") or ""))
    if name:
        metadata[META_SENDER_NAME] = name
    context = message.get("context")
    if isinstance(context, Mapping) and context.get("id"):
        metadata[META_CONTEXT] = str(context["id"])
    inbound = InboundMessage(
        channel=CHANNEL,
        chat_id=chat,
        text=text,
        sender_id=user,
        message_id=wamid,
        metadata=metadata,
        attachments=files,
    )
    return Inbound(inbound, at)


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind} yet: I can read text, images, voice messages and "
        "documents. Please write what you'd like me to know."
    )


def signature_ok(app_secret: str, body: bytes, header: str) -> bool:
    """Is `header` (``sha256=<hex>``) the HMAC-SHA256 of `body` with `app_secret`?
    Compared in constant time."""
    expected = "sha256=" + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(header.strip().encode("utf-8", "replace"), expected.encode())


# --------------------------------------------------------------------------- Graph API

Kind = Literal["rate_limited", "not_done", "maybe_done", "final"]


class GraphError(Exception):
    """An error answer of the Graph API, or a request that got none."""

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        http_status: int = 0,
        kind: Kind = "final",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.kind: Kind = kind

    @classmethod
    def from_answer(cls, status: int, body: Any) -> GraphError:
        error = body.get("error") if isinstance(body, Mapping) else None
        if not isinstance(error, Mapping):
            return cls(f"HTTP {status}", http_status=status, kind=_status_kind(status))
        code, text = _error_text(
            {
                "code": error.get("code"),
                "title": error.get("message"),
                "error_data": error.get("error_data"),
            }
        )
        kind: Kind
        if code in _RATE_LIMITS:
            kind = "rate_limited"
        elif code == SERVICE_UNAVAILABLE:
            kind = "not_done"
        else:
            kind = _status_kind(status) if status >= 500 else "final"
        return cls(f"{text} (HTTP {status})", code=code, http_status=status, kind=kind)


def _status_kind(status: int) -> Kind:
    # A 503 is Meta saying it did not take the request; any other 5xx may have acted.
    if status == 503:
        return "not_done"
    return "maybe_done" if status >= 500 else "final"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard one request tries: rate limits and failures that certainly did not take
    effect back off from `backoff` seconds, doubling up to `max_backoff`, for at most
    `attempts` tries, and nothing waits past `reply_deadline` seconds after `send` began
    (under the dispatcher's 60 s cap on one delivery)."""

    attempts: int = 5
    backoff: float = 1.0
    max_backoff: float = 8.0
    reply_deadline: float = 50.0
    typing_grace: float = 0.5  # no typing indicator for replies faster than this
    typing_refresh: float = 20.0  # WhatsApp drops the indicator after 25 s
    typing_limit: float = 120.0  # the longest the indicator is kept up
    notice_cooldown: float = 60.0  # per chat, for "cannot open" notices


class GraphApi:
    """The Graph API over one aiohttp session: JSON requests with the bearer token."""

    def __init__(self, base_url: str, version: str, token: str, timeout: float = 20.0) -> None:
        self.root = f"{base_url.rstrip('/')}/{version.strip('/')}"
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        form: aiohttp.FormData | None = None,
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """One request; the JSON answer, or GraphError (its `kind` says whether it may
        be repeated). Error texts never hold the token."""
        url = f"{self.root}/{path.lstrip('/')}"
        try:
            async with self._http().request(
                method, url, json=json_body, data=form, params=params, headers=self.auth
            ) as response:
                try:
                    body = await response.json(content_type=None)
                except ValueError:
                    body = None
                if response.status != 200:
                    raise GraphError.from_answer(response.status, body)
                return body if isinstance(body, dict) else {}
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing sent
            raise GraphError(f"cannot connect ({exc.os_error})", kind="not_done") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GraphError(f"{type(exc).__name__} {exc}".strip(), kind="maybe_done") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def check_credentials(settings: WhatsAppSettings, token: str) -> str:
    """`gateway doctor`: ask the Graph API about each configured number with the token.
    Returns a line per number; raises WhatsAppSetupError saying what to fix."""
    if not token:
        raise WhatsAppSetupError(f"whatsapp: no access token; set {ENV_PREFIX}ACCESS_TOKEN")
    graph = GraphApi(settings.api_url, settings.api_version, token, timeout=10)
    found = []
    try:
        for number in settings.phone_number_ids:
            try:
                info = await graph.request(
                    "GET",
                    number,
                    params={"fields": "display_phone_number,verified_name,quality_rating"},
                )
            except GraphError as exc:
                raise WhatsAppSetupError(_setup_hint(exc, number, graph.root)) from None
            found.append(
                f"{info.get('display_phone_number') or number} "
                f"({info.get('verified_name') or 'no verified name'}, "
                f"quality {info.get('quality_rating') or 'unknown'}, id {number})"
            )
    finally:
        await graph.aclose()
    return "WhatsApp: " + "; ".join(found)


def _setup_hint(exc: GraphError, number: str, root: str) -> str:
    if exc.code in _AUTH or exc.http_status == 401:
        return (
            f"whatsapp: the Graph API refused the access token ({exc}); set "
            f"{ENV_PREFIX}ACCESS_TOKEN to a system user's token with "
            "whatsapp_business_messaging (a temporary token expires after 24 hours)"
        )
    if exc.http_status in (400, 404):
        return (
            f"whatsapp: phone number id {number} was refused ({exc}); copy it from "
            "WhatsApp Manager > API Setup into channels.whatsapp.phone_number_ids"
        )
    return f"whatsapp: cannot reach the Graph API at {root} ({exc}); check the network or api_url"


# --------------------------------------------------------------------------- channel


@dataclass
class WhatsAppStats:
    """What the channel counted since start (mirrored into /metrics)."""

    statuses: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    templates: int = 0
    bad_signatures: int = 0


@dataclass(frozen=True, slots=True)
class _Failure:
    """Why a message did not certainly go out, the Graph API's code if any, and whether
    it certainly did not and may later (the API unreachable or busy)."""

    reason: str
    code: int | None = None
    later: bool = False


#: Replies cut short by a failure, remembered until they are sent again.
_CUT_SHORT = 1_000


@dataclass(frozen=True, slots=True)
class _Reply:
    """One reply on its way: where it goes, and the id its parts share."""

    chat: str
    number: str
    user: str
    session_key: str
    reply_id: str


class WhatsAppChannel:
    """The WhatsApp adapter (Channel protocol); see the module docstring."""

    name = CHANNEL

    def __init__(
        self,
        settings: WhatsAppSettings,
        *,
        store: WhatsAppStore,
        token: str,
        app_secret: str,
        verify_token: str,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for value, name in (
            (token, "ACCESS_TOKEN"),
            (app_secret, "APP_SECRET"),
            (verify_token, "VERIFY_TOKEN"),
        ):
            if not value:
                raise ConfigError(
                    f"channels.whatsapp: set {ENV_PREFIX}{name} (or {name.lower()}_file); "
                    "see docs/whatsapp.md"
                )
        if not settings.phone_number_ids:
            raise ConfigError(
                "channels.whatsapp.phone_number_ids: name the business numbers' phone number "
                'ids (WhatsApp Manager > API Setup), e.g. ["106540352242922"]'
            )
        self.settings = settings
        self.store = store
        self.retry = retry or RetryPolicy()
        self.graph = GraphApi(settings.api_url, settings.api_version, token)
        self.numbers = frozenset(settings.phone_number_ids)
        self.stats = WhatsAppStats()
        self._token = token
        self._app_secret = app_secret
        self._verify_token = verify_token
        self._clock = clock
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._mounted = False
        self._notices = NoticeCooldown()
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_CUT_SHORT)

    @classmethod
    def from_settings(cls, settings: WhatsAppSettings, store: WhatsAppStore) -> WhatsAppChannel:
        def secret(value: Any) -> str:
            return str(value.get_secret_value()) if value is not None else ""

        return cls(
            settings,
            store=store,
            token=secret(settings.access_token),
            app_secret=secret(settings.app_secret),
            verify_token=secret(settings.verify_token),
        )

    @property
    def live(self) -> bool:
        return self._submit is not None

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> bool:
        """Route Meta's webhook (`GET` handshake, `POST` deliveries) on the daemon's
        server to this channel; call before the server runs."""
        http.mount("GET", WHATSAPP_WEBHOOK_PATH, self._handshake, require_ready=False)
        http.mount("POST", WHATSAPP_WEBHOOK_PATH, self._webhook)
        self._mounted = True
        return True

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Check the token against each number, then take webhook deliveries until
        cancelled. Raises WhatsAppSetupError when the Graph API refuses the token."""
        if not self._mounted:
            raise RuntimeError("whatsapp: mount(daemon.http) was never called")
        numbers = await self._check_numbers()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._submit = submit
                self._paused = False
                logger.info("whatsapp: {}; webhook at GET/POST {}", numbers, WHATSAPP_WEBHOOK_PATH)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._submit = None
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.graph.aclose()
                await self.store.aclose()  # reopened on next use (a restart, a late send)

    async def _check_numbers(self) -> str:
        found = []
        for number in sorted(self.numbers):
            try:
                info = await self.graph.request(
                    "GET", number, params={"fields": "display_phone_number,verified_name"}
                )
            except GraphError as exc:
                raise WhatsAppSetupError(_setup_hint(exc, number, self.graph.root)) from None
            found.append(f"{info.get('display_phone_number') or number} ({number})")
        return "serving " + ", ".join(found)

    def pause_intake(self) -> None:
        """Take no more deliveries (the daemon is draining): the webhook answers 503 and
        Meta delivers them again, to the next start."""
        self._paused = True

    # ----------------------------------------------------------------- webhook

    async def _handshake(self, request: web.Request) -> web.StreamResponse:
        """The subscription handshake: echo `hub.challenge` when `hub.mode` is subscribe
        and `hub.verify_token` is ours (constant time); 403 otherwise."""
        query = request.query
        given = query.get("hub.verify_token", "").encode("utf-8", "replace")
        challenge = query.get("hub.challenge", "")
        if (
            query.get("hub.mode") == "subscribe"
            and hmac.compare_digest(given, self._verify_token.encode())
            and challenge
        ):
            logger.info("whatsapp: webhook verified by Meta")
            return web.Response(text=challenge)
        logger.warning("whatsapp: a webhook handshake with a wrong verify token was refused")
        return json_error(
            403,
            f"wrong hub.verify_token; it must equal {ENV_PREFIX}VERIFY_TOKEN "
            "(App Dashboard > WhatsApp > Configuration)",
        )

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One delivery from Meta; see the module docstring for what each answer means."""
        body = await _read_capped(request, WEBHOOK_MAX_BYTES)
        if body is None:
            return json_error(413, f"the body is over {WEBHOOK_MAX_BYTES} bytes")
        if not signature_ok(self._app_secret, body, request.headers.get(SIGNATURE_HEADER, "")):
            self.stats.bad_signatures += 1
            logger.warning(
                "whatsapp: refused a webhook delivery without a valid {} (from {}); if Meta "
                "sent it, {}APP_SECRET is not the app's secret",
                SIGNATURE_HEADER,
                request.remote or "-",
                ENV_PREFIX,
            )
            return json_error(401, f"missing or wrong {SIGNATURE_HEADER}")
        submit = self._submit
        if submit is None or self._paused:
            return json_error(
                503, "the WhatsApp channel is not taking deliveries", {"Retry-After": "5"}
            )
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            logger.error("whatsapp: a signed delivery whose body is not a JSON object; ignored")
            return json_error(400, "the body is not a JSON object")
        for item in translate_payload(payload, phone_number_ids=self.numbers):
            try:
                taken = await self._take(item, submit)
            except Exception as exc:  # the store failed: Meta must send it all again
                logger.error("whatsapp: a delivery could not be kept ({!r}); answering 503", exc)
                taken = False
            if not taken:
                return json_error(
                    503,
                    "the gateway could not keep the delivery; send it again",
                    {"Retry-After": "5"},
                )
        return web.Response(text="ok")

    async def _take(self, item: Item, submit: Submit) -> bool:
        """Keep one item of a delivery; False when Meta must deliver it again."""
        if isinstance(item, Inbound):
            message = item.message
            with logger.contextualize(session=message.session_key):
                await self.store.note_inbound(message.chat_id, message.message_id or "", item.at)
                ticket = await submit(message)
                if not ticket.taken:
                    return False
                # A kill here leaves the message journaled and Meta without its 200.
                await failpoints.reach("whatsapp.before_ack", message.session_key)
                if self.settings.read_receipts and str(getattr(ticket, "status", "")) in (
                    "accepted",
                    "",
                ):
                    self._spawn(self._read_and_typing, ticket, message)
            return True
        if isinstance(item, Status):
            await self._apply_status(item)
        elif isinstance(item, Notice):
            await self.store.note_inbound(item.chat, item.wamid, item.at)
            self._spawn(self._send_notice, item)
        else:
            logger.debug("whatsapp: skipped {}", item.reason)
        return True

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- statuses

    async def _apply_status(self, item: Status) -> None:
        row = await self.store.update_status(item.wamid, item.status, item.error_code, item.error)
        if row is None:
            return  # not a step forward: a repeat, out of order, or a status we don't track
        self.stats.statuses[item.status] += 1
        if item.status != "failed":
            return
        name = failure_name(item.error_code)
        self.stats.failures[name] += 1
        with logger.contextualize(session=row.session_key or "-"):
            logger.error(
                "whatsapp: message {} to {} failed: {}",
                item.wamid,
                row.chat or "(not recorded yet)",
                item.error or "no reason given",
            )
            if row.recorded:
                # Before the 200 the part is kept; a template goes later, not delaying it.
                await self._failed_later(row, template_later=True)

    async def _failed_later(self, row: SentMessage, *, template_later: bool = False) -> None:
        """A message Meta accepted and later reported failed: keep what it said."""
        reply = _Reply(row.chat, *parse_chat(row.chat), row.session_key, row.reply_id)
        text = row.body or f"[{row.kind}]"
        reason = f"WhatsApp reported it failed: {row.error}"
        try_template = row.error_code == RE_ENGAGEMENT and row.kind != "template"
        await self._keep(
            reply, [text], row.part, reason, try_template=try_template, later=template_later
        )

    # ----------------------------------------------------------------- read receipts

    async def _read_and_typing(self, ticket: Ticket, message: InboundMessage) -> None:
        """Mark the person's message read; while its reply takes longer than
        `typing_grace`, show the typing indicator (refreshed before WhatsApp drops it)."""
        number, _ = parse_chat(message.chat_id)
        wamid = message.message_id or ""
        policy = self.retry
        with anyio.move_on_after(policy.typing_grace):
            await ticket.reply()
            await self._mark_read(number, wamid, typing=False)
            return
        with anyio.move_on_after(policy.typing_limit):
            while True:
                await self._mark_read(number, wamid, typing=True)
                with anyio.move_on_after(policy.typing_refresh):
                    await ticket.reply()
                    return

    async def _mark_read(self, number: str, wamid: str, *, typing: bool) -> None:
        body: dict[str, Any] = {
            "messaging_product": "whatsapp",
            "status": "read",
            "message_id": wamid,
        }
        if typing:
            body["typing_indicator"] = {"type": "text"}
        try:
            await self.graph.request("POST", f"{number}/messages", json_body=body)
        except GraphError as exc:
            logger.debug("whatsapp: read receipt for {} not sent: {}", wamid, exc)

    async def _send_notice(self, notice: Notice) -> None:
        if not self._notices.allow(notice.chat, self.retry.notice_cooldown):
            return
        number, user = parse_chat(notice.chat)
        payload = _text_payload(user, notice.text, context=notice.wamid)
        try:
            await self.graph.request("POST", f"{number}/messages", json_body=payload)
        except GraphError as exc:
            logger.warning("whatsapp: a notice to {} was not sent: {}", notice.chat, exc)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: its URL from `GET /<media id>`, then a download of at most
        `max_bytes` with the token (the URL is valid for minutes; it never reaches a log)."""
        try:
            info = await self.graph.request("GET", attachment.file_id)
        except GraphError as exc:
            logger.warning("whatsapp: media {} not found: {}", attachment.file_id, exc)
            raise MediaError("WhatsApp no longer has the file; please send it again") from None
        size = info.get("file_size")
        if isinstance(size, int) and size > max_bytes:
            raise MediaError(
                f"it is {size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        url = info.get("url")
        if not isinstance(url, str) or not url:
            raise MediaError("WhatsApp gave no download address for the file")
        return await download_capped(url, max_bytes, headers=self.graph.auth)

    # ----------------------------------------------------------------- replies

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply in its parts, inside the window; outside it the template, or
        the reply kept as undeliverable (see the module docstring). Raises
        `DeliveryFailed` when a part certainly did not go out and may later, and goes on
        from that part when the reply comes again; never raises for what the platform
        refused: that is logged and kept."""
        number, user = parse_chat(message.chat_id, min(self.numbers))
        reply = _Reply(chat_id(number, user), number, user, message.session_key, uuid.uuid4().hex)
        parts = split_whatsapp(markdown_to_whatsapp(message.text))
        deadline = time.monotonic() + self.retry.reply_deadline
        # A reply sent again after a failure goes on where the failure stopped it.
        again = (message.session_key, message.reply_to, message.text)
        done = self._sent_parts.take(again, 0)
        with logger.contextualize(session=message.session_key):
            if not parts and not message.files:
                logger.warning("whatsapp: empty reply not sent")
                return
            last = await self.store.last_inbound(reply.chat)
            now = self._clock()
            if last is None or now - last.at > WINDOW_SECONDS - WINDOW_MARGIN:
                since = (
                    f"the person last wrote {(now - last.at) / 3600:.1f} hours ago"
                    if last is not None
                    else "the person has not written to this number"
                )
                await self._keep(
                    reply,
                    _with_files(parts[done:], message.files),
                    done,
                    f"outside the 24-hour customer-service window ({since})",
                    try_template=True,
                )
                return
            quote = _quote(self.settings.quote_replies, message.reply_to, last.message_id)
            for index, part in enumerate(parts):
                if index < done:
                    continue
                payload = _text_payload(user, part, context=quote if index == 0 else None)
                sent = await self._send_part(reply, index, "text", part, payload, deadline)
                if not isinstance(sent, _Failure):
                    continue
                if sent.later:
                    raise self._cut_short(again, index, len(parts) + len(message.files), sent)
                await self._keep(
                    reply,
                    _with_files(parts[index:], message.files),
                    index,
                    sent.reason,
                    try_template=sent.code == RE_ENGAGEMENT,
                )
                return
            for number_of, file in enumerate(message.files, start=len(parts)):
                if number_of < done:
                    continue
                failed = await self._send_file(reply, number_of, file, deadline)
                if failed is not None and failed.later:
                    total = len(parts) + len(message.files)
                    raise self._cut_short(again, number_of, total, failed)

    def _cut_short(
        self, again: tuple[str, str | None, str], index: int, total: int, failure: _Failure
    ) -> DeliveryFailed:
        """Remember that the first `index` parts of a reply went out, for when it comes
        again; the `DeliveryFailed` to raise."""
        self._sent_parts.keep(again, index)
        return DeliveryFailed(
            f"whatsapp: part {index + 1} of {total} not sent ({failure.reason}); it is sent "
            "again later",
            sent=index,
        )

    async def _send_part(
        self,
        reply: _Reply,
        part: int,
        kind: str,
        body: str,
        payload: Mapping[str, Any],
        deadline: float,
    ) -> str | _Failure:
        """POST one message (retried only when that is safe) and record it: its wamid, or
        why it did not certainly go out."""
        failures = 0
        while True:
            try:
                answer = await self.graph.request(
                    "POST", f"{reply.number}/messages", json_body=payload
                )
                break
            except GraphError as exc:
                failure = exc
            failures += 1
            delay = min(self.retry.backoff * 2 ** (failures - 1), self.retry.max_backoff)
            retry = failure.kind in ("rate_limited", "not_done") and failures < self.retry.attempts
            if retry and time.monotonic() + delay <= deadline:
                logger.warning(
                    "whatsapp: sending to {} failed ({}); retrying in {:g}s",
                    reply.chat,
                    failure,
                    delay,
                )
                await anyio.sleep(delay)
                continue
            return self._failure(failure)
        messages = answer.get("messages")
        wamid = (
            str(messages[0].get("id") or "")
            if isinstance(messages, list) and messages and isinstance(messages[0], Mapping)
            else ""
        )
        if not wamid:
            logger.warning("whatsapp: Meta accepted a message to {} without its id", reply.chat)
            return "?"
        sent = SentMessage(
            wamid,
            reply.chat,
            reply.session_key,
            kind,
            body,
            reply.reply_id,
            part,
            self._clock(),
        )
        try:
            stored = await self.store.record_sent(sent)
        except Exception as exc:
            logger.error("whatsapp: message {} went out but was not recorded: {!r}", wamid, exc)
            return wamid
        if stored.status == "failed":  # its failure came before we recorded it
            await self._failed_later(stored)
        return wamid

    def _failure(self, failure: GraphError) -> _Failure:
        """Why a request did not certainly go out, by the error's name; counted."""
        self.stats.failures[failure_name(failure.code)] += 1
        if failure.kind == "maybe_done":
            reason = (
                f"sending failed after the request went out ({failure}); it may or may not "
                "have arrived, so it is not sent again"
            )
        elif failure.code == RE_ENGAGEMENT:
            reason = f"outside the 24-hour customer-service window ({failure})"
        elif failure.code == UNDELIVERABLE:
            reason = f"WhatsApp cannot deliver to this person ({failure})"
        elif failure.code in _AUTH or failure.http_status == 401:
            reason = (
                f"the Graph API refused the access token ({failure}); fix {ENV_PREFIX}ACCESS_TOKEN"
            )
        elif failure.kind == "rate_limited":
            reason = f"still rate limited when the reply's time ran out ({failure})"
        elif failure.kind == "not_done":
            reason = f"the Graph API did not take it ({failure})"
        else:
            reason = f"WhatsApp refused it ({failure})"
        later = failure.kind in ("rate_limited", "not_done")
        return _Failure(reason, failure.code, later)

    async def _send_file(
        self, reply: _Reply, part: int, file: OutboundFile, deadline: float
    ) -> _Failure | None:
        """Upload one file of a reply and send it as an image (up to 5 MB) or a document;
        an upload is tried once (one that failed may have landed, unless it certainly did
        not: then the failure says it may go later). None when it went out."""
        as_image = file.is_image and len(file.data) <= IMAGE_LIMIT
        form = aiohttp.FormData()
        form.add_field("messaging_product", "whatsapp")
        form.add_field("type", file.mime_type)
        form.add_field("file", file.data, filename=file.name, content_type=file.mime_type)
        try:
            uploaded = await self.graph.request("POST", f"{reply.number}/media", form=form)
        except GraphError as exc:
            logger.error("whatsapp: file {} not uploaded for {}: {}", file.name, reply.chat, exc)
            return _Failure(str(exc), exc.code, exc.kind in ("rate_limited", "not_done"))
        media: dict[str, Any] = {"id": str(uploaded.get("id") or "")}
        if file.caption:
            media["caption"] = file.caption[:CAPTION_LIMIT]
        kind = "image" if as_image else "document"
        if not as_image:
            media["filename"] = file.name
        payload = {
            "messaging_product": "whatsapp",
            "recipient_type": "individual",
            **recipient(reply.user),
            "type": kind,
            kind: media,
        }
        sent = await self._send_part(
            reply, part, kind, file.caption or file.name, payload, deadline
        )
        if isinstance(sent, _Failure):
            logger.error("whatsapp: file {} not sent to {}: {}", file.name, reply.chat, sent.reason)
            return sent
        return None

    # ----------------------------------------------------------------- undeliverable

    async def _keep(
        self,
        reply: _Reply,
        texts: list[str],
        first: int,
        reason: str,
        *,
        try_template: bool,
        later: bool = False,
    ) -> None:
        """Keep what could not be delivered, with why (the admin page lists it); then, if
        a template is configured and the window is the reason, send the template once
        per reply instead (`later`: in the background)."""
        now = self._clock()
        try:
            for offset, text in enumerate(texts):
                await self.store.hold(
                    HeldReply(
                        reply.reply_id,
                        first + offset,
                        reply.chat,
                        reply.session_key,
                        text,
                        reason,
                        now,
                    )
                )
        except Exception as exc:
            logger.error(
                "whatsapp: a reply to {} could not be delivered ({}) nor kept ({!r}); it is lost",
                reply.chat,
                reason,
                exc,
            )
            return
        template = self.settings.template
        if not (template and try_template):
            logger.error(
                "whatsapp: reply to {} kept as undeliverable: {}{}; the admin page lists it",
                reply.chat,
                reason,
                ""
                if template or not try_template
                else " and no template is set (channels.whatsapp.template)",
            )
            return
        if later:
            self._spawn(self._template_instead, reply, texts, reason)
        else:
            await self._template_instead(reply, texts, reason)

    async def _template_instead(self, reply: _Reply, texts: list[str], reason: str) -> None:
        """Send the configured template for a kept reply, once per reply; the reply is
        held again when the template fails."""
        template = self.settings.template
        if not await self.store.claim_template(reply.reply_id):
            return  # another part of this reply already sent (or is sending) it
        why = await self._send_template(reply, "\n".join(texts))
        if why is None:
            self.stats.templates += 1
            logger.info(
                "whatsapp: reply to {} sent as template {} ({})", reply.chat, template, reason
            )
            return
        await self.store.release_template(reply.reply_id, f"template {template}: {why}")
        logger.error(
            "whatsapp: reply to {} kept as undeliverable: {}, and template {} failed: {}",
            reply.chat,
            reason,
            template,
            why,
        )

    async def _send_template(self, reply: _Reply, text: str) -> str | None:
        """Send the configured template to the person; None, or why it failed."""
        settings = self.settings
        template: dict[str, Any] = {
            "name": settings.template,
            "language": {"code": settings.template_language},
        }
        parameter = (
            plain_line(text, TEMPLATE_PARAMETER_CHARS) if settings.template_parameter else ""
        )
        if parameter:
            template["components"] = [
                {"type": "body", "parameters": [{"type": "text", "text": parameter}]}
            ]
        payload = {
            "messaging_product": "whatsapp",
            "recipient_type": "individual",
            **recipient(reply.user),
            "type": "template",
            "template": template,
        }
        deadline = time.monotonic() + self.retry.reply_deadline
        sent = await self._send_part(reply, -1, "template", parameter, payload, deadline)
        return sent.reason if isinstance(sent, _Failure) else None


# --------------------------------------------------------------------------- helpers


def _text_payload(user: str, text: str, *, context: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        **recipient(user),
        "type": "text",
        "text": {"body": text, "preview_url": bool(_URL.search(text))},
    }
    if context:
        payload["context"] = {"message_id": context}
    return payload


def _quote(mode: str, reply_to: str | None, newest: str) -> str | None:
    """The wamid the reply quotes: the person's message, when it is one (not a scheduled
    run's id) and, in auto mode, when they wrote again since."""
    if not reply_to or not reply_to.startswith("wamid.") or mode == "never":
        return None
    if mode == "always" or reply_to != newest:
        return reply_to
    return None


def _with_files(texts: list[str], files: tuple[OutboundFile, ...]) -> list[str]:
    if not files:
        return texts
    names = ", ".join(f.name for f in files)
    return [*texts, f"[{len(files)} file(s) not sent: {names}]"]


async def _read_capped(request: web.Request, limit: int) -> bytes | None:
    """The raw body (the signature covers its exact bytes), or None past `limit`."""
    if request.content_length is not None and request.content_length > limit:
        return None
    data = bytearray()
    while chunk := await request.content.read(65536):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)
