"""A fake WhatsApp Business Cloud API for tests: the Graph API the gateway calls, and the
webhook sender that calls the gateway, written from Meta's Cloud API documentation.

The gateway's real HTTP client talks to it unchanged: point `channels.whatsapp.api_url` at
`fake.url` (any `/vNN.N/` version prefix is served). Graph API (Cloud API reference,
"Messages", "Media", "Typing indicators", "Error codes"):

- every request needs ``Authorization: Bearer <token>``; a missing or wrong one is HTTP 401
  with Graph's error object, code 190 (``OAuthException``);
- ``GET /<phone_number_id>`` describes a business number (``display_phone_number``,
  ``verified_name``, ``quality_rating``); another id is HTTP 400, code 100 subcode 33;
- ``POST /<phone_number_id>/messages`` sends a message (``messaging_product:
  "whatsapp"``, ``to`` a wa_id or ``recipient`` a business-scoped user id, ``type`` text,
  image, document, audio or template, ``context.message_id`` to quote) and answers
  ``{"messaging_product", "contacts": [{"input", "wa_id"}], "messages": [{"id":
  "wamid..."}]}``; with ``status: "read"`` and a ``message_id`` it marks a message the
  person sent read (``typing_indicator: {"type": "text"}`` also shows typing) and answers
  ``{"success": true}``;
- ``POST /<phone_number_id>/media`` (multipart: ``file``, ``type``, ``messaging_product``)
  stores a file and answers ``{"id"}``; ``GET /<media_id>`` answers its ``url``,
  ``mime_type``, ``sha256`` and ``file_size``; the URL serves the bytes only with the
  bearer token (401 without).

Errors are Graph's: HTTP 400 (404 for a template that does not exist) with ``{"error":
{"message": "(#<code>) <title>", "type", "code", "error_data": {"messaging_product",
"details"}, "error_subcode"?, "fbtrace_id"}}``. By name:

- 100 a parameter is missing or wrong (a text body over 4,096 characters, no
  ``messaging_product``, an unknown type);
- 130429 *Rate limit hit*: more than `throughput` messages a second from one number;
- 131047 *Re-engagement message*: free-form (non-template) message when more than 24 hours
  passed since the person last wrote to that number (or they never did). As on the real
  service the send is accepted and the failure comes as a ``failed`` status; with
  ``window_errors="sync"`` it is the request's error instead;
- 131026 *Message undeliverable*: to a wa_id in `unreachable`, as a ``failed`` status;
- 132001 / 132000: a template that is not approved in that language / a parameter count
  that does not match it;
- ``fail_next(code, count)`` scripts the next answers (e.g. 131016, HTTP 503).

Webhooks (``deliver``): a delivery is one ``whatsapp_business_account`` payload POSTed to
`webhook_url`, signed ``X-Hub-Signature-256: sha256=<HMAC-SHA256 of the body with the app
secret>``. A 2xx within `ack_timeout` seconds delivers it; anything else (another status,
no answer in time, no connection) is retried with the same body and signature after each
of `retry_delays` (Meta: exponential backoff for up to 7 days, `META_RETRY_DELAYS`; tests
compress it), and every attempt is logged in `deliveries`. After each accepted message
the fake delivers its statuses the same way (``sent``, then ``delivered``; ``read`` once
`read_by` says so), or ``failed`` with Meta's error object. The person's window runs from
the ``timestamp`` of the newest message built for them (`text_message` & co., which may
be dated in the past), as on the real service, where it starts when they write, not when
the webhook gets through.

``with FakeWhatsApp.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import hashlib
import hmac
import itertools
import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from tests.fakes._serving import LocalApiServer, at_least

DEFAULT_TOKEN = "EAAG-fake-whatsapp-system-user-token"
DEFAULT_APP_SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
DEFAULT_VERIFY_TOKEN = "fake-verify-token"
PHONE_NUMBER_ID = "106540352242922"
DISPLAY_NUMBER = "15550783881"
WABA_ID = "102290129340398"
TEXT_LIMIT = 4096
WINDOW_SECONDS = 24 * 3600.0
#: Meta retries a delivery with exponential backoff for up to 7 days.
META_RETRY_DELAYS: tuple[float, ...] = tuple(
    itertools.takewhile(lambda d: d < 7 * 24 * 3600, (60.0 * 2**n for n in itertools.count()))
)
META_ACK_TIMEOUT = 10.0

Payload = dict[str, Any]

_VERSION = re.compile(r"^v\d+\.\d+$")
_ERRORS: dict[int, tuple[str, str, int]] = {
    # code: (title, details, HTTP status)
    100: ("Invalid parameter", "", 400),
    190: ("Invalid OAuth access token - Cannot parse access token", "", 401),
    130429: ("Rate limit hit", "Cloud API message throughput has been reached.", 400),
    131016: ("Service unavailable", "A service is temporarily unavailable.", 503),
    131026: (
        "Message undeliverable",
        "Message failed to send because the recipient is not a WhatsApp user or has not "
        "accepted the terms.",
        400,
    ),
    131047: (
        "Re-engagement message",
        "Message failed to send because more than 24 hours have passed since the customer "
        "last replied to this number.",
        400,
    ),
    132000: (
        "Number of parameters does not match the expected number of params",
        "",
        400,
    ),
    132001: ("Template name does not exist in the translation", "", 404),
}


def sign(app_secret: str, body: bytes) -> str:
    """Meta's ``X-Hub-Signature-256`` value for `body`."""
    return "sha256=" + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()


def graph_error(code: int, details: str = "", *, subcode: int | None = None) -> Payload:
    title, default_details, _ = _ERRORS.get(code, ("Something went wrong", "", 500))
    error: Payload = {
        "message": f"(#{code}) {title}",
        "type": "OAuthException",
        "code": code,
        "error_data": {"messaging_product": "whatsapp", "details": details or default_details},
        "fbtrace_id": uuid.uuid4().hex[:22],
    }
    if subcode is not None:
        error["error_subcode"] = subcode
    return {"error": error}


def status_error(code: int) -> Payload:
    """The error object of a ``failed`` status (the webhook's shape)."""
    title, details, _ = _ERRORS.get(code, ("Something went wrong", "", 500))
    return {
        "code": code,
        "title": title,
        "message": title,
        "error_data": {"details": details},
        "href": "https://developers.facebook.com/docs/whatsapp/cloud-api/support/error-codes/",
    }


class _GraphFailure(Exception):
    def __init__(self, code: int, details: str = "", *, status: int | None = None) -> None:
        super().__init__(code)
        self.code = code
        self.details = details
        self.status = status if status is not None else _ERRORS.get(code, ("", "", 400))[2]


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered Graph API request: ``method`` is ``"<HTTP method> <path pattern>"``
    (``POST /messages``, ``GET /media``, ...)."""

    method: str
    path: str
    body: Mapping[str, Any]
    status: int
    response: Mapping[str, Any]
    at: float


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    answered_at: float
    status: int  # 0: no HTTP answer
    failure: str | None  # None: delivered (a 2xx in time)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One webhook payload's delivery so far: every attempt, whether it got through."""

    number: int
    payload: Mapping[str, Any]
    started_at: float
    attempts: tuple[Attempt, ...] = ()
    finished: bool = False

    @property
    def delivered(self) -> bool:
        return any(a.failure is None for a in self.attempts)

    @property
    def delivered_at(self) -> float | None:
        return next((a.answered_at for a in self.attempts if a.failure is None), None)

    @property
    def in_progress(self) -> bool:
        return not self.finished

    @property
    def messages(self) -> list[Payload]:
        return [m for v in _values(self.payload) for m in v.get("messages") or ()]

    @property
    def statuses(self) -> list[Payload]:
        return [s for v in _values(self.payload) for s in v.get("statuses") or ()]


def _values(payload: Mapping[str, Any]) -> list[Payload]:
    return [c["value"] for e in payload.get("entry") or () for c in e.get("changes") or ()]


@dataclass(slots=True)
class Sent:
    """A message the business sent through the fake, and its status there."""

    wamid: str
    phone_number_id: str
    to: str
    type: str
    request: Payload
    at: float
    status: str = "accepted"
    error_code: int | None = None

    @property
    def text(self) -> str:
        return str((self.request.get("text") or {}).get("body") or "")

    @property
    def context(self) -> str | None:
        context = self.request.get("context")
        return str(context.get("message_id")) if isinstance(context, Mapping) else None


class FakeWhatsApp(LocalApiServer[ApiCall]):
    """A scriptable WhatsApp Cloud API; see the module docstring."""

    _thread_name = "fake-whatsapp"

    def __init__(
        self,
        *,
        token: str = DEFAULT_TOKEN,
        app_secret: str = DEFAULT_APP_SECRET,
        verify_token: str = DEFAULT_VERIFY_TOKEN,
        phone_number_id: str = PHONE_NUMBER_ID,
        throughput: float = 80.0,
        window_errors: str = "async",
        retry_delays: Sequence[float] = META_RETRY_DELAYS,
        ack_timeout: float = META_ACK_TIMEOUT,
        status_delay: float = 0.05,
    ) -> None:
        super().__init__()
        self.token = token
        self.app_secret = app_secret
        self.verify_token = verify_token
        self.phone_number_id = phone_number_id
        self.numbers: dict[str, Payload] = {
            phone_number_id: {
                "display_phone_number": DISPLAY_NUMBER,
                "verified_name": "Fake Business",
                "quality_rating": "GREEN",
                "id": phone_number_id,
            }
        }
        self.throughput = throughput
        self.window_errors = window_errors
        self.retry_delays = tuple(retry_delays)
        self.ack_timeout = ack_timeout
        self.status_delay = status_delay
        self.webhook_url: str | None = None
        #: wa_ids whose messages fail with 131026 (not on WhatsApp, old app, ...).
        self.unreachable: set[str] = set()
        #: Approved templates: (name, language) -> number of body parameters.
        self.templates: dict[tuple[str, str], int] = {}
        #: Whether the person reads what they get (a ``read`` status follows delivery).
        self.read_by: set[str] = set()
        self.clock_offset = 0.0
        self._last_inbound: dict[tuple[str, str], float] = {}
        self._inbound_ids: dict[str, tuple[str, str]] = {}  # wamid -> (number, wa_id)
        self._sent: list[Sent] = []
        self._reads: list[Payload] = []
        self._media: dict[str, tuple[bytes, str]] = {}
        self._faults: list[tuple[int, int | None]] = []  # (code, HTTP status)
        self._sends_at: list[float] = []
        self._deliveries: list[Delivery] = []
        self._tasks: set[asyncio.Future[Any]] = set()  # statuses due, deliveries retrying

    def now(self) -> float:
        return time.time() + self.clock_offset

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/media-download/{media_id}", self._download)
        app.router.add_route("*", "/{version}/{tail:.*}", self._graph)
        return app

    # -- scripting --------------------------------------------------------------------

    def fail_next(self, code: int, count: int = 1, *, status: int | None = None) -> None:
        """The next `count` send requests fail with Graph error `code` (HTTP `status`,
        default the code's own, e.g. 503 for 131016)."""
        with self._lock:
            self._faults.extend([(code, status)] * count)

    def add_media(self, data: bytes, mime_type: str) -> str:
        """A file a person sends: its media id (for `image_message` and the like)."""
        media_id = str(1_000_000_000_000 + len(self._media))
        with self._lock:
            self._media[media_id] = (data, mime_type)
        return media_id

    def media(self, media_id: str) -> tuple[bytes, str]:
        with self._lock:
            return self._media[media_id]

    # -- what the business sent -------------------------------------------------------

    @property
    def sent(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)

    def texts_to(self, wa_id: str) -> list[str]:
        return [s.text for s in self.sent if s.to == wa_id and s.type == "text"]

    @property
    def reads(self) -> list[Payload]:
        """Every accepted read receipt (with its typing indicator, if any)."""
        with self._lock:
            return list(self._reads)

    # -- messages from people ---------------------------------------------------------

    def _inbound(
        self,
        wa_id: str,
        kind: str,
        content: Payload,
        *,
        name: str,
        sent_at: float | None,
        context: str | None,
        number: str | None,
    ) -> Payload:
        number = number or self.phone_number_id
        at = sent_at if sent_at is not None else self.now()
        wamid = "wamid." + base64.b64encode(uuid.uuid4().bytes + wa_id.encode()).decode()
        message: Payload = {"from": wa_id, "id": wamid, "timestamp": str(int(at)), "type": kind}
        message[kind] = content
        if context is not None:
            message["context"] = {
                "from": self.numbers[number]["display_phone_number"],
                "id": context,
            }
        with self._lock:
            key = (number, wa_id)
            self._last_inbound[key] = max(self._last_inbound.get(key, 0.0), at)
            self._inbound_ids[wamid] = key
        value = {
            "messaging_product": "whatsapp",
            "metadata": {
                "display_phone_number": self.numbers.get(number, {}).get(
                    "display_phone_number", DISPLAY_NUMBER
                ),
                "phone_number_id": number,
            },
            "contacts": [{"profile": {"name": name}, "wa_id": wa_id}],
            "messages": [message],
        }
        return self._envelope(value)

    def _envelope(self, value: Payload) -> Payload:
        return {
            "object": "whatsapp_business_account",
            "entry": [{"id": WABA_ID, "changes": [{"value": value, "field": "messages"}]}],
        }

    def text_message(
        self,
        wa_id: str,
        text: str,
        *,
        name: str = "Test User",
        sent_at: float | None = None,
        context: str | None = None,
        number: str | None = None,
    ) -> Payload:
        """A person's text message as a webhook payload (it opens their window)."""
        return self._inbound(
            wa_id,
            "text",
            {"body": text},
            name=name,
            sent_at=sent_at,
            context=context,
            number=number,
        )

    def media_message(
        self,
        wa_id: str,
        kind: str,
        media_id: str,
        *,
        caption: str | None = None,
        filename: str | None = None,
        voice: bool = False,
        name: str = "Test User",
        sent_at: float | None = None,
    ) -> Payload:
        """An image, audio (a voice note with `voice`) or document message."""
        data, mime = self.media(media_id)
        content: Payload = {
            "mime_type": mime,
            "sha256": base64.b64encode(hashlib.sha256(data).digest()).decode(),
            "id": media_id,
        }
        if caption is not None:
            content["caption"] = caption
        if filename is not None:
            content["filename"] = filename
        if kind == "audio":
            content["voice"] = voice
        return self._inbound(
            wa_id, kind, content, name=name, sent_at=sent_at, context=None, number=None
        )

    def other_message(self, wa_id: str, kind: str, content: Payload, **options: Any) -> Payload:
        """A message of any other type (sticker, video, location, interactive, ...)."""
        return self._inbound(
            wa_id,
            kind,
            content,
            name=options.get("name", "Test User"),
            sent_at=options.get("sent_at"),
            context=None,
            number=options.get("number"),
        )

    @staticmethod
    def batch(*payloads: Payload) -> Payload:
        """Several payloads' messages and statuses in one delivery (Meta batches)."""
        values = [v for p in payloads for v in _values(p)]
        first = dict(values[0])
        for key in ("contacts", "messages", "statuses"):
            merged = [item for v in values for item in v.get(key) or ()]
            if merged:
                first[key] = merged
        return {
            "object": "whatsapp_business_account",
            "entry": [{"id": WABA_ID, "changes": [{"value": first, "field": "messages"}]}],
        }

    def status_payload(
        self, wamid: str, status: str, *, error: int | None = None, number: str | None = None
    ) -> Payload:
        """A status callback for a message the business sent."""
        with self._lock:
            sent = next((s for s in self._sent if s.wamid == wamid), None)
        number = number or (sent.phone_number_id if sent else self.phone_number_id)
        item: Payload = {
            "id": wamid,
            "status": status,
            "timestamp": str(int(self.now())),
            "recipient_id": sent.to if sent else "",
        }
        if status in ("sent", "delivered"):
            item["conversation"] = {"id": uuid.uuid4().hex, "origin": {"type": "service"}}
            item["pricing"] = {"billable": True, "pricing_model": "PMP", "category": "service"}
        if error is not None:
            item["errors"] = [status_error(error)]
        return self._envelope(
            {
                "messaging_product": "whatsapp",
                "metadata": {"display_phone_number": DISPLAY_NUMBER, "phone_number_id": number},
                "statuses": [item],
            }
        )

    # -- webhook deliveries -----------------------------------------------------------

    def signed(
        self, payload: Mapping[str, Any] | bytes, secret: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return body, {
            "Content-Type": "application/json",
            "User-Agent": "facebookexternalua",
            "X-Hub-Signature-256": sign(secret or self.app_secret, body),
        }

    async def post(
        self,
        url: str,
        payload: Mapping[str, Any] | bytes,
        *,
        secret: str | None = None,
        signature: str | None = None,
    ) -> tuple[int, str]:
        """POST a payload once, signed (with `secret`, or the header `signature` as given);
        (status, body) of the answer."""
        body, headers = self.signed(payload, secret)
        if signature is not None:
            headers["X-Hub-Signature-256"] = signature
            if not signature:
                del headers["X-Hub-Signature-256"]
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=headers) as r,
        ):
            return r.status, await r.text()

    async def handshake(
        self, url: str, verify_token: str, challenge: str = "1158201444"
    ) -> tuple[int, str]:
        """Meta's subscription check: GET with hub.mode, hub.verify_token, hub.challenge."""
        query = {
            "hub.mode": "subscribe",
            "hub.verify_token": verify_token,
            "hub.challenge": challenge,
        }
        async with aiohttp.ClientSession() as session, session.get(url, params=query) as r:
            return r.status, await r.text()

    async def deliver(self, payload: Mapping[str, Any], url: str | None = None) -> Delivery:
        """Deliver `payload` to the webhook the way Meta does (see the module docstring);
        returns the finished delivery. Runs in the caller's event loop (any loop)."""
        target = url or self.webhook_url
        if target is None:
            raise RuntimeError("FakeWhatsApp.webhook_url is not set")
        with self._lock:
            number = len(self._deliveries)
            self._deliveries.append(Delivery(number, payload, time.time()))
        self._notify()
        body, headers = self.signed(payload)
        task = asyncio.current_task()
        if task is not None and asyncio.get_running_loop() is self._loop:
            self._tasks.add(task)  # cancelled by `stop`, not left to the loop's close
        try:
            for attempt_number in itertools.count():
                attempt = await self._attempt(target, body, headers)
                self._update(number, attempt)
                if attempt.failure is None or attempt_number >= len(self.retry_delays):
                    break
                await asyncio.sleep(self.retry_delays[attempt_number])
        finally:
            self._update(number, None)
            if task is not None:
                self._tasks.discard(task)
        return self.deliveries[number]

    def deliver_soon(
        self, payload: Mapping[str, Any], url: str | None = None
    ) -> concurrent.futures.Future[Delivery]:
        """Start `deliver` in the fake's own loop, from any thread."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeWhatsApp is not running")
        return asyncio.run_coroutine_threadsafe(self.deliver(payload, url), loop)

    async def _attempt(self, url: str, body: bytes, headers: Mapping[str, str]) -> Attempt:
        sent_at = time.time()
        status, failure = 0, None
        # A fresh connection per attempt, as from Meta's many senders.
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

    def wait_for_deliveries(self, count: int, timeout: float = 10.0) -> list[Delivery]:
        """Block until `count` deliveries got through (thread mode)."""
        return self._wait_blocking(
            at_least(count, lambda: [d for d in self.deliveries if d.delivered]),
            timeout,
            async_method="deliver",
            describe_timeout=lambda: f"fewer than {count} deliveries got through in {timeout}s",
        )

    async def wait_for_sent(self, count: int) -> list[Sent]:
        """Wait (any loop) until the business sent at least `count` messages; bound it
        with ``anyio.fail_after``."""
        return await self._on_server_loop(self._until(at_least(count, lambda: self.sent)))

    async def stop(self) -> None:
        """Stop serving; deliveries still retrying and statuses still due are cancelled."""
        pending = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await super().stop()

    # -- the Graph API ----------------------------------------------------------------

    async def _graph(self, request: web.Request) -> web.StreamResponse:
        version, tail = request.match_info["version"], request.match_info["tail"]
        parts = [p for p in tail.split("/") if p]
        body: Payload = {}
        pattern = f"{request.method} /{'/'.join(parts)}"
        try:
            if not _VERSION.match(version):
                raise _GraphFailure(100, f"unknown version {version}")
            self._check_token(request)
            if request.method == "GET" and len(parts) == 1:
                pattern = "GET /number" if parts[0] in self.numbers else "GET /media"
                answer = self._get_object(request, parts[0])
            elif request.method == "POST" and len(parts) == 2 and parts[1] == "messages":
                pattern = "POST /messages"
                body = await request.json()
                answer = self._post_messages(parts[0], body)
            elif request.method == "POST" and len(parts) == 2 and parts[1] == "media":
                pattern = "POST /media"
                answer, body = await self._upload(parts[0], request)
            else:
                raise _GraphFailure(100, f"Unsupported request {request.method} /{tail}")
            status = 200
        except _GraphFailure as exc:
            status, answer = exc.status, graph_error(exc.code, exc.details)
        self._log_call(ApiCall(pattern, request.path, body, status, answer, time.time()))
        return web.json_response(answer, status=status)

    def _check_token(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        if auth != f"Bearer {self.token}":
            raise _GraphFailure(190)

    def _get_object(self, request: web.Request, object_id: str) -> Payload:
        if object_id in self.numbers:
            return dict(self.numbers[object_id])
        with self._lock:
            media = self._media.get(object_id)
        if media is None:
            raise _GraphFailure(
                100, f"Unsupported get request. Object with ID '{object_id}' does not exist"
            )
        data, mime = media
        return {
            "url": f"{self.url}/media-download/{object_id}",
            "mime_type": mime,
            "sha256": hashlib.sha256(data).hexdigest(),
            "file_size": len(data),
            "id": object_id,
            "messaging_product": "whatsapp",
        }

    async def _download(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return web.json_response(graph_error(190), status=401)
        with self._lock:
            media = self._media.get(request.match_info["media_id"])
        if media is None:
            return web.json_response(graph_error(100), status=404)
        return web.Response(body=media[0], content_type=media[1].split(";")[0])

    async def _upload(self, number: str, request: web.Request) -> tuple[Payload, Payload]:
        if number not in self.numbers:
            raise _GraphFailure(100, f"Object with ID '{number}' does not exist")
        form = await request.post()
        if form.get("messaging_product") != "whatsapp":
            raise _GraphFailure(100, "The parameter messaging_product is required.")
        file = form.get("file")
        if not isinstance(file, web.FileField):
            raise _GraphFailure(100, "The parameter file is required.")
        data = file.file.read()
        mime = str(form.get("type") or file.content_type)
        media_id = self.add_media(data, mime)
        return {"id": media_id}, {"type": mime, "filename": file.filename, "size": len(data)}

    def _post_messages(self, number: str, body: Payload) -> Payload:
        if number not in self.numbers:
            raise _GraphFailure(100, f"Object with ID '{number}' does not exist")
        if body.get("messaging_product") != "whatsapp":
            raise _GraphFailure(100, "The parameter messaging_product is required.")
        if body.get("status") == "read":
            return self._read(number, body)
        with self._lock:
            if self._faults:
                code, status = self._faults.pop(0)
                raise _GraphFailure(code, status=status)
            now = time.time()
            self._sends_at = [t for t in self._sends_at if t > now - 1.0]
            if len(self._sends_at) >= self.throughput:
                raise _GraphFailure(130429)
            self._sends_at.append(now)
        to = body.get("to") or body.get("recipient")
        if not isinstance(to, str) or not to:
            raise _GraphFailure(100, "The parameter to is required.")
        kind = body.get("type", "text")
        content = body.get(kind)
        if kind not in ("text", "image", "document", "audio", "template") or not isinstance(
            content, Mapping
        ):
            raise _GraphFailure(100, f"Param {kind} is required")
        if kind == "text":
            text = content.get("body")
            if not isinstance(text, str) or not text:
                raise _GraphFailure(100, "The parameter text['body'] is required.")
            if len(text) > TEXT_LIMIT:
                raise _GraphFailure(
                    100, f"Param text['body'] must be at most {TEXT_LIMIT} characters long."
                )
        if kind in ("image", "document", "audio"):
            with self._lock:
                if str(content.get("id")) not in self._media:
                    raise _GraphFailure(100, f"Param {kind}['id'] is not a valid media id")
        if kind == "template":
            self._check_template(content)
        window_closed = kind != "template" and not self.window_open(to, number)
        if window_closed and self.window_errors == "sync":
            raise _GraphFailure(131047)
        wamid = "wamid." + base64.b64encode(uuid.uuid4().bytes).decode()
        sent = Sent(wamid, number, to, kind, dict(body), time.time())
        with self._lock:
            self._sent.append(sent)
        self._notify()
        failure = 131047 if window_closed else 131026 if to in self.unreachable else None
        self._after_send(sent, failure)
        answer: Payload = {
            "messaging_product": "whatsapp",
            "contacts": [{"input": to, "wa_id": to}],
            "messages": [{"id": wamid}],
        }
        if kind == "template":
            answer["messages"][0]["message_status"] = "accepted"
        return answer

    def window_open(self, wa_id: str, number: str | None = None) -> bool:
        """Is the person's 24-hour customer-service window with `number` open now?"""
        with self._lock:
            last = self._last_inbound.get((number or self.phone_number_id, wa_id))
        return last is not None and self.now() - last < WINDOW_SECONDS

    def _check_template(self, content: Mapping[str, Any]) -> None:
        language = content.get("language")
        code = language.get("code") if isinstance(language, Mapping) else None
        expected = self.templates.get((str(content.get("name")), str(code)))
        if expected is None:
            raise _GraphFailure(132001)
        given = sum(
            len(c.get("parameters") or ())
            for c in content.get("components") or ()
            if isinstance(c, Mapping) and c.get("type") == "body"
        )
        if given != expected:
            raise _GraphFailure(132000)

    def _read(self, number: str, body: Payload) -> Payload:
        wamid = body.get("message_id")
        with self._lock:
            found = self._inbound_ids.get(str(wamid))
        if found is None or found[0] != number:
            raise _GraphFailure(100, f"Invalid message_id {wamid}")
        with self._lock:
            self._reads.append(dict(body))
        self._notify()
        return {"success": True}

    def _after_send(self, sent: Sent, failure: int | None) -> None:
        """Deliver the message's statuses to the webhook, in order, each after the last
        got through (or gave up)."""
        if self.webhook_url is None:
            return
        steps: list[tuple[str, int | None]]
        if failure is not None:
            steps = [("failed", failure)]
        else:
            steps = [("sent", None), ("delivered", None)]
            if sent.to in self.read_by:
                steps.append(("read", None))

        async def statuses() -> None:
            for status, code in steps:
                await asyncio.sleep(self.status_delay)
                with self._lock:
                    sent.status, sent.error_code = status, code
                await self.deliver(self.status_payload(sent.wamid, status, error=code))

        task = asyncio.ensure_future(statuses())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
