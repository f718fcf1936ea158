"""A fake Slack (Web API, Socket Mode and signed Events API requests) for tests.

The real slack-sdk and slack-bolt talk to it unchanged: it is an aiohttp server on
127.0.0.1 with a random free port that serves the Web API under ``/api/<method>`` and a
Socket Mode websocket under ``/socket``. Point the clients at it like this (slack-sdk
joins method names onto the base URL with ``urljoin``, so it needs the trailing slash;
slack-sdk 3.47 appends one when it is missing, other clients may not)::

    client = AsyncWebClient(token=fake.bot_token, base_url=fake.api_url)  # {url}/api/
    app = AsyncApp(client=client, signing_secret=fake.signing_secret)  # not token= too
    handler = AsyncSocketModeHandler(app, fake.app_token)  # inside a running loop
    await handler.connect_async()  # apps.connections.open on app.client, then the socket

Web API methods: auth.test, chat.postMessage, chat.update, apps.connections.open,
conversations.info, conversations.replies, users.info, files.info,
files.getUploadURLExternal and files.completeUploadExternal; anything else answers
``unknown_method``. Errors are
Slack's: HTTP 200 with ``{"ok": false, "error": ...}`` (``not_authed``, ``invalid_auth``,
``not_allowed_token_type`` - the bot token ``xoxb-`` for the Web API, the app-level
token ``xapp-`` only for apps.connections.open - ``channel_not_found``, ``no_text``,
``msg_too_long`` beyond 40,000 characters, ``invalid_blocks``, ``message_not_found``,
``cant_update_message``) and, scripted with `fail_next`, HTTP 429 with a ``Retry-After``
header and ``ratelimited``. Message timestamps look like ``"1712345678.000100"`` and
increase strictly. Channel ids must look like Slack's (C..., G..., D...).

Socket Mode: each apps.connections.open returns a single-use
``ws://127.0.0.1:PORT/socket?ticket=...&app_id=...`` URL; on connect the fake sends a
``hello``. ``await fake.socket_event(payload)`` sends an ``events_api`` envelope to the
newest connection and `acks` records each ``{"envelope_id": ...}`` answer with its
latency; ``fake.redeliver(envelope)`` resends the same payload (same event_id) the way
Slack retries, and ``fake.socket_disconnect("refresh_requested")`` asks clients to
reconnect::

    async with FakeSlack() as fake:
        ...  # start the bolt app and its AsyncSocketModeHandler
        await fake.wait_for_socket()
        envelope = await fake.socket_event(fake.app_mention("C0GENERAL1", "U0ALICE001", "hi"))
        ack = await fake.wait_for_ack(envelope["envelope_id"])
        [reply] = await fake.wait_for_calls_async("chat.postMessage")

Events over HTTP: ``await fake.post_event(url, payload)`` POSTs a payload once, signed
the way Slack signs (``X-Slack-Signature: v0=HMAC-SHA256(secret, "v0:{ts}:{body}")``,
``X-Slack-Request-Timestamp``, optional ``X-Slack-Retry-Num``/``-Reason``); it can sign
badly or with a stale timestamp. ``fake.url_verification(url)`` sends the challenge.

``await fake.deliver_event(url, payload)`` delivers an event the way the Events API
does, retries included (``fake.deliver_event_soon(...)`` starts one from any thread),
and records every attempt in `event_deliveries`. Slack's rules (the Events API docs,
https://api.slack.com/apis/events-api#retries, "Responding to events" and "Error
handling / graceful retries"):

- The app acknowledges an event with an HTTP 2xx within 3 seconds; anything else is a
  failed delivery, reported on the retry as ``X-Slack-Retry-Reason``: ``http_timeout``
  (no answer within 3 s: Slack does not wait for a late one, and a late 2xx does not
  count), ``http_error`` (a non-2xx status), ``connection_failed`` (no connection),
  ``too_many_redirects`` (Slack follows at most 2), ``ssl_error`` and ``unknown_error``
  (here: a connection that closed before any answer).
- A failed event is retried up to 3 times, "nearly immediately", after 1 minute and
  after 5 minutes, with ``X-Slack-Retry-Num: 1``, ``2``, ``3`` and the same payload, so
  the same ``event_id``; each attempt is signed afresh.
- An error answer with ``X-Slack-No-Retry: 1`` turns the retries of that event off.

`retry_delays` (default `SLACK_RETRY_DELAYS`, the real 0/60/300 s) and `ack_timeout`
(default 3 s) are parameters so that tests can compress the schedule, e.g. to
``(0.5, 2, 5)``: long enough for the retries to span a restart of the app.

Event builders (`app_mention`, `channel_message`, `dm_message`, `bot_message`,
`message_changed`, `edited_mention`, `event_callback`) return full ``event_callback``
payloads, each with a fresh event_id.

Files (https://api.slack.com/types/file, files.info, the upload flow
files.getUploadURLExternal -> POST the bytes to ``upload_url`` ->
files.completeUploadExternal, which slack-sdk's ``files_upload_v2`` follows):
``fake.add_file(data, name, mimetype)`` makes a file object whose ``url_private`` and
``url_private_download`` serve the bytes only with ``Authorization: Bearer <bot
token>``; without it the answer is Slack's sign-in page (HTTP 200, text/html), as on
the real service. `app_mention` and `dm_message` take ``files=[...]`` (such a message
has ``subtype: file_share`` outside app mentions). Uploads must announce their exact
``length``; completed ones are listed by `uploaded_files` (bytes, channel, thread).
``add_user(user_id, display_name)`` names a user for users.info.

``with FakeSlack.in_thread() as fake:`` serves from a background thread; the scripting
methods and logs are thread-safe, and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import hashlib
import hmac
import itertools
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from tests.fakes._serving import LocalApiServer, at_least

DEFAULT_BOT_TOKEN = "xoxb-1000000001-2000000002-FakeSlackBotTokenForTests"
DEFAULT_APP_TOKEN = "xapp-1-A0FAKEAPP01-3000000003-fakeslackapptokenfortests"
DEFAULT_SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
MAX_TEXT_LENGTH = 40_000
MAX_BLOCKS = 50

Payload = dict[str, Any]

_CHANNEL_ID = re.compile(r"^[CGDZ][A-Z0-9]{2,}$")
_USER_ID = re.compile(r"^[UWB][A-Z0-9]{2,}$")
_TS = re.compile(r"^\d{10}\.\d{6}$")
_JSON_PARAMS = ("blocks", "attachments", "metadata")

#: When the Events API retries a failed delivery: nearly immediately, after one minute
#: and after five minutes (X-Slack-Retry-Num 1, 2 and 3).
SLACK_RETRY_DELAYS: tuple[float, ...] = (0.0, 60.0, 300.0)
#: How long Slack waits for the 2xx that acknowledges an event.
SLACK_ACK_TIMEOUT = 3.0
#: How many HTTP redirects Slack follows before it gives up on an attempt.
SLACK_MAX_REDIRECTS = 2

RetryReason = Literal[
    "http_timeout",
    "http_error",
    "connection_failed",
    "too_many_redirects",
    "ssl_error",
    "unknown_error",
]


def sign_request(signing_secret: str, timestamp: str | int, body: bytes | str) -> str:
    """Slack's request signature: ``v0=`` + hex HMAC-SHA256 of ``v0:{timestamp}:{body}``."""
    raw = body.encode() if isinstance(body, str) else body
    base = b"v0:" + str(timestamp).encode() + b":" + raw
    return "v0=" + hmac.new(signing_secret.encode(), base, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One answered Web API call: the method, its parameters (query, form and JSON body
    merged, JSON-valued form fields decoded; the token is in `token`), the HTTP status
    and the JSON answer."""

    method: str
    params: Mapping[str, Any]
    token: str | None
    timestamp: float
    status: int
    response: Mapping[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.response.get("ok"))

    @property
    def error(self) -> str | None:
        error = self.response.get("error")
        return error if isinstance(error, str) else None


@dataclass(frozen=True, slots=True)
class Ack:
    """A Socket Mode acknowledgement: the envelope it answers, its optional response
    ``payload``, and how long after sending the envelope it came (None for an envelope
    the fake never sent)."""

    envelope_id: str
    payload: Mapping[str, Any] | None
    latency: float | None
    received_at: float
    connection: int


@dataclass(frozen=True, slots=True)
class HttpDelivery:
    """What the app's HTTP endpoint answered to `post_event` / `url_verification`."""

    status: int
    body: str
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class DeliveryAttempt:
    """One POST of an event to the app: `retry_num` 0 is the first delivery; `failure`
    is None when the app acknowledged it (a 2xx in time), else the reason the next
    attempt carries in ``X-Slack-Retry-Reason``. `status` is 0 when no HTTP answer came;
    `no_retry` is set when the answer asked Slack not to retry."""

    retry_num: int
    sent_at: float
    answered_at: float
    status: int
    failure: RetryReason | None
    detail: str = ""
    no_retry: bool = False

    @property
    def acked(self) -> bool:
        return self.failure is None


@dataclass(frozen=True, slots=True)
class EventDelivery:
    """An event's delivery by the Events API so far: every attempt, and whether Slack
    considers it acknowledged (`acked`), is still trying (`in_progress`) or gave up."""

    number: int  # in the order deliveries were started, from 0
    event_id: str
    url: str
    payload: Mapping[str, Any]
    started_at: float
    attempts: tuple[DeliveryAttempt, ...] = ()
    finished: bool = False

    @property
    def acked(self) -> bool:
        return any(a.acked for a in self.attempts)

    @property
    def acked_at(self) -> float | None:
        return next((a.answered_at for a in self.attempts if a.acked), None)

    @property
    def gave_up(self) -> bool:
        """Every attempt failed (or the app said no more): Slack drops the event."""
        return self.finished and not self.acked

    @property
    def in_progress(self) -> bool:
        return not self.finished


@dataclass(frozen=True, slots=True)
class _Fault:
    method: str  # or "*"
    error: str
    status: int
    retry_after: int | None


@dataclass(slots=True)
class _Socket:
    number: int
    ws: web.WebSocketResponse


class _SlackError(Exception):
    def __init__(self, error: str, status: int = 200, headers: Mapping[str, str] | None = None):
        super().__init__(error)
        self.error = error
        self.status = status
        self.headers = dict(headers or {})


TokenKind = Literal["bot", "app"]
Handler = Callable[[dict[str, Any]], Awaitable[Payload]]


class FakeSlack(LocalApiServer[ApiCall]):
    """A scriptable Slack; see the module docstring for usage.

    Every envelope the fake sends is logged in `envelopes` and every ack in `acks`; a
    retried event keeps its event_id and gets a new envelope_id, as Slack does.
    """

    _thread_name = "fake-slack"

    def __init__(
        self,
        *,
        bot_token: str = DEFAULT_BOT_TOKEN,
        app_token: str = DEFAULT_APP_TOKEN,
        signing_secret: str = DEFAULT_SIGNING_SECRET,
        verification_token: str = "FakeVerificationToken0001",
        team_id: str = "T0FAKETEAM1",
        team_name: str = "Fake Workspace",
        team_domain: str = "fake-workspace",
        bot_user_id: str = "U0FAKEBOT01",
        bot_id: str = "B0FAKEBOT01",
        bot_name: str = "gateway",
        app_id: str = "A0FAKEAPP01",
    ) -> None:
        super().__init__()
        self.bot_token = bot_token
        self.app_token = app_token
        self.signing_secret = signing_secret
        self.verification_token = verification_token
        self.team_id = team_id
        self.team_name = team_name
        self.team_domain = team_domain
        self.bot_user_id = bot_user_id
        self.bot_id = bot_id
        self.bot_name = bot_name
        self.app_id = app_id
        #: The port apps.connections.open names in its socket URL: a proxy in front of
        #: the fake (None: the fake's own).
        self.socket_port: int | None = None
        self._faults: list[_Fault] = []
        self._messages: dict[tuple[str, str], Payload] = {}
        self._users: dict[str, str] = {bot_user_id: bot_name}
        self._last_ts_micros = 0
        self._event_numbers = itertools.count(1)
        self._tickets: set[str] = set()
        self._sockets: list[_Socket] = []
        self._socket_numbers = itertools.count(1)
        self._hellos = 0
        self._envelopes: list[Payload] = []
        self._sent_at: dict[str, float] = {}
        self._acks: list[Ack] = []
        self._deliveries: list[EventDelivery] = []
        self._methods: dict[str, tuple[TokenKind, Handler]] = {
            "auth.test": ("bot", self._auth_test),
            "chat.postMessage": ("bot", self._post_message),
            "chat.update": ("bot", self._update_message),
            "apps.connections.open": ("app", self._connections_open),
            "conversations.info": ("bot", self._conversations_info),
            "users.info": ("bot", self._users_info),
            "conversations.replies": ("bot", self._conversations_replies),
            "files.info": ("bot", self._files_info),
            "files.getUploadURLExternal": ("bot", self._get_upload_url),
            "files.completeUploadExternal": ("bot", self._complete_upload),
        }
        self._files: dict[str, tuple[Payload, bytes]] = {}
        self._file_numbers = itertools.count(1)
        self._pending_uploads: dict[str, Payload] = {}
        self._uploaded: list[Payload] = []

    # -- running ----------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        """slack-sdk's ``base_url``, with the trailing slash it needs: ``{url}/api/``."""
        return f"{self.url}/api/"

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        app.router.add_get("/socket", self._socket)
        app.router.add_get("/files-pri/{team_file}/{name}", self._file_download)
        app.router.add_get("/files-pri/{team_file}/download/{name}", self._file_download)
        app.router.add_post("/upload/v1/{file_id}", self._file_upload)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    async def stop(self) -> None:
        """Close open sockets (code 1001) and stop serving."""
        with self._lock:
            sockets = list(self._sockets)
        for socket in sockets:
            with contextlib.suppress(Exception):
                await socket.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
        await super().stop()

    # -- scripting --------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        error: str = "ratelimited",
        *,
        status: int | None = None,
        retry_after: int | None = None,
        count: int = 1,
    ) -> None:
        """Make the next `count` calls of `method` (``"*"``: any) fail with `error`.
        ``ratelimited`` is HTTP 429 with ``Retry-After`` (default 1 s); other errors are
        HTTP 200 unless `status` says otherwise (e.g. 500 for ``internal_error``)."""
        if status is None:
            status = 429 if error == "ratelimited" else 200
        if status == 429 and retry_after is None:
            retry_after = 1
        with self._lock:
            self._faults.extend([_Fault(method, error, status, retry_after)] * count)

    def reset(self) -> None:
        """Forget faults and the call, envelope and ack logs (messages stay)."""
        with self._lock:
            self._faults.clear()
            self._calls.clear()
            self._envelopes.clear()
            self._acks.clear()

    # -- event builders ---------------------------------------------------------------

    def event_callback(self, event: Mapping[str, Any]) -> Payload:
        """Wrap an inner event in an Events API ``event_callback`` with a fresh
        event_id, the way Slack delivers it over HTTP and inside Socket Mode envelopes."""
        return {
            "token": self.verification_token,
            "team_id": self.team_id,
            "context_team_id": self.team_id,
            "context_enterprise_id": None,
            "api_app_id": self.app_id,
            "event": copy.deepcopy(dict(event)),
            "type": "event_callback",
            "event_id": f"Ev0FAKE{next(self._event_numbers):05d}",
            "event_time": int(time.time()),
            "authorizations": [
                {
                    "enterprise_id": None,
                    "team_id": self.team_id,
                    "user_id": self.bot_user_id,
                    "is_bot": True,
                    "is_enterprise_install": False,
                }
            ],
            "is_ext_shared_channel": False,
            "event_context": f"4-{uuid.uuid4().hex}",
        }

    def app_mention(
        self,
        channel: str,
        user: str,
        text: str,
        *,
        ts: str | None = None,
        thread_ts: str | None = None,
        files: Sequence[Payload] = (),
    ) -> Payload:
        """An ``app_mention`` event callback; the text gets the bot's ``<@U...>`` mention
        in front unless it already has one."""
        mention = f"<@{self.bot_user_id}>"
        if mention not in text:
            text = f"{mention} {text}"
        event = self._user_event("app_mention", channel, user, text, ts, thread_ts, None)
        if files:
            event["files"] = copy.deepcopy(list(files))
        return self.event_callback(event)

    def channel_message(
        self,
        channel: str,
        user: str,
        text: str,
        *,
        ts: str | None = None,
        thread_ts: str | None = None,
    ) -> Payload:
        """A ``message`` event callback from a user in a channel (``G...``: private)."""
        channel_type = "group" if channel.startswith("G") else "channel"
        return self.event_callback(
            self._user_event("message", channel, user, text, ts, thread_ts, channel_type)
        )

    def dm_message(
        self,
        user: str,
        text: str,
        *,
        channel: str | None = None,
        ts: str | None = None,
        thread_ts: str | None = None,
        files: Sequence[Payload] = (),
    ) -> Payload:
        """A ``message`` event callback in the user's direct-message channel with the
        bot (``channel_type: im``; the channel defaults to ``D`` + the user id's rest).
        With `files` it is a ``file_share`` message carrying them."""
        dm = channel or f"D{user[1:]}"
        event = self._user_event("message", dm, user, text, ts, thread_ts, "im")
        if files:
            event.update(subtype="file_share", files=copy.deepcopy(list(files)), upload=True)
        return self.event_callback(event)

    # -- files ------------------------------------------------------------------------

    def add_user(self, user: str, display_name: str) -> None:
        """Name a user (users.info's display_name)."""
        with self._lock:
            self._users[user] = display_name

    def add_file(
        self, data: bytes, name: str, mimetype: str, *, user: str = "U0ALICE001"
    ) -> Payload:
        """A file someone uploaded: its file object, as events and files.info show it."""
        number = next(self._file_numbers)
        file_id = f"F0FAKE{number:05d}"
        base = f"{self.url}/files-pri/{self.team_id}-{file_id}"
        file: Payload = {
            "id": file_id,
            "created": int(time.time()),
            "timestamp": int(time.time()),
            "name": name,
            "title": name,
            "mimetype": mimetype,
            "filetype": name.rpartition(".")[2].lower() or "binary",
            "user": user,
            "size": len(data),
            "mode": "hosted",
            "is_external": False,
            "url_private": f"{base}/{name}",
            "url_private_download": f"{base}/download/{name}",
        }
        with self._lock:
            self._files[file_id] = (file, data)
        return copy.deepcopy(file)

    def uploaded_files(self) -> list[Payload]:
        """Every completed upload: id, filename, title, data (bytes), channel, thread_ts,
        initial_comment."""
        with self._lock:
            return copy.deepcopy(self._uploaded)

    async def _file_download(self, request: web.Request) -> web.StreamResponse:
        team_file = request.match_info["team_file"]
        auth = request.headers.get("Authorization", "")
        with self._lock:
            stored = self._files.get(team_file.removeprefix(f"{self.team_id}-"))
        if auth != f"Bearer {self.bot_token}":
            # Slack answers an unauthenticated download with its sign-in page.
            page = (
                "<!DOCTYPE html><html><head><title>Slack</title></head><body>Sign in</body></html>"
            )
            return web.Response(text=page, content_type="text/html")
        if stored is None:
            return web.Response(status=404, text="file not found")
        file, data = stored
        return web.Response(body=data, content_type=str(file["mimetype"]))

    async def _file_upload(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        data = await request.read()
        with self._lock:
            pending = self._pending_uploads.get(file_id)
            if pending is None:
                return web.Response(status=404, text="unknown upload")
            if len(data) != pending["length"]:
                return web.Response(status=400, text="length mismatch")
            pending["data"] = data
        return web.Response(text=f"OK - {len(data)}")

    async def _files_info(self, params: dict[str, Any]) -> Payload:
        with self._lock:
            stored = self._files.get(str(params.get("file") or ""))
        if stored is None:
            raise _SlackError("file_not_found")
        return {"file": copy.deepcopy(stored[0])}

    async def _get_upload_url(self, params: dict[str, Any]) -> Payload:
        filename = str(params.get("filename") or "")
        try:
            length = int(params.get("length") or 0)
        except (TypeError, ValueError):
            length = 0
        if not filename or length < 1:
            raise _SlackError("invalid_arguments")
        file_id = f"F0UPLD{next(self._file_numbers):05d}"
        with self._lock:
            self._pending_uploads[file_id] = {"filename": filename, "length": length}
        return {"upload_url": f"{self.url}/upload/v1/{file_id}", "file_id": file_id}

    async def _complete_upload(self, params: dict[str, Any]) -> Payload:
        files = params.get("files")
        if isinstance(files, str):
            try:
                files = json.loads(files)
            except ValueError:
                files = None
        if not isinstance(files, list) or not files:
            raise _SlackError("invalid_arguments")
        channel = params.get("channel_id")
        if channel is not None and not _CHANNEL_ID.match(str(channel)):
            raise _SlackError("channel_not_found")
        thread_ts = params.get("thread_ts")
        if thread_ts is not None and not _TS.match(str(thread_ts)):
            raise _SlackError("invalid_thread_ts")
        done = []
        with self._lock:
            for item in files:
                file_id = str(item.get("id") if isinstance(item, dict) else "")
                pending = self._pending_uploads.get(file_id)
                if pending is None or "data" not in pending:
                    raise _SlackError("file_upload_not_completed" if pending else "file_not_found")
            for item in files:
                pending = self._pending_uploads.pop(str(item["id"]))
                title = str(item.get("title") or pending["filename"])
                self._uploaded.append(
                    {
                        "id": item["id"],
                        "filename": pending["filename"],
                        "title": title,
                        "data": pending["data"],
                        "channel": channel,
                        "thread_ts": thread_ts,
                        "initial_comment": params.get("initial_comment"),
                    }
                )
                done.append({"id": item["id"], "title": title, "name": pending["filename"]})
        return {"files": done}

    async def _conversations_replies(self, params: dict[str, Any]) -> Payload:
        channel = _channel_param(params)
        ts = str(params.get("ts") or "")
        oldest = float(params.get("oldest") or 0)
        with self._lock:
            parent = self._messages.get((channel, ts))
            if parent is None:
                raise _SlackError("thread_not_found")
            replies = sorted(
                (
                    m
                    for (c, t), m in self._messages.items()
                    if c == channel and m.get("thread_ts") == ts and t != ts and float(t) > oldest
                ),
                key=lambda m: float(m["ts"]),
            )
            messages = [copy.deepcopy(parent), *(copy.deepcopy(m) for m in replies)]
        limit = int(params.get("limit") or 1000)
        return {"messages": messages[:limit], "has_more": len(messages) > limit}

    def message_changed(self, body: Payload, text: str) -> Payload:
        """A ``message_changed`` event callback: the user edited the message of `body`
        (a ``message`` callback) to `text`, as Slack sends it (a hidden message event
        at the edit's ts, the new ``message`` with ``edited``, and ``previous_message``;
        no ``user`` at the top level)."""
        original = body["event"]
        channel, ts = original["channel"], original["ts"]
        with self._lock:
            previous = copy.deepcopy(self._messages.get((channel, ts), original))
        edit_ts = self._new_ts()
        message = {
            key: value
            for key, value in previous.items()
            if key not in ("channel", "event_ts", "channel_type")
        }
        message.update(text=text, edited={"user": previous["user"], "ts": edit_ts})
        with self._lock:
            self._messages[(channel, ts)] = {**previous, "text": text, "edited": message["edited"]}
        event: Payload = {
            "type": "message",
            "subtype": "message_changed",
            "hidden": True,
            "channel": channel,
            "ts": edit_ts,
            "event_ts": edit_ts,
            "message": message,
            "previous_message": {
                key: value
                for key, value in previous.items()
                if key not in ("channel", "event_ts", "channel_type")
            },
        }
        if "channel_type" in original:
            event["channel_type"] = original["channel_type"]
        return self.event_callback(event)

    def edited_mention(self, body: Payload, text: str) -> Payload:
        """The ``app_mention`` event callback Slack sends again when the author edits a
        message that mentions the bot (`body`, an `app_mention` callback) to `text`: the
        same ``ts``, the new text (the mention kept), ``edited``, and a fresh event_id.
        Slack also sends a ``message_changed``, but only to apps subscribed to the
        channel's messages (``message.channels``)."""
        original = body["event"]
        channel, ts = original["channel"], original["ts"]
        mention = f"<@{self.bot_user_id}>"
        if mention not in text:
            text = f"{mention} {text}"
        with self._lock:
            stored: Payload = copy.deepcopy(self._messages.get((channel, ts)) or original)
        edited = {"user": stored["user"], "ts": self._new_ts()}
        stored.update(text=text, edited=edited)
        with self._lock:
            self._messages[(channel, ts)] = stored
        event = {**copy.deepcopy(original), "text": text, "edited": edited}
        if stored.get("thread_ts"):
            event["thread_ts"] = stored["thread_ts"]
        return self.event_callback(event)

    def bot_message(
        self,
        channel: str,
        text: str,
        *,
        bot_id: str | None = None,
        username: str = "otherbot",
        ts: str | None = None,
        thread_ts: str | None = None,
    ) -> Payload:
        """A ``message`` event callback posted by a bot. By default it is this app's own
        bot (``bot_id`` and ``user`` of the bot, as Slack echoes the bot's own posts), which
        bolt's self-event filter drops; another `bot_id` gives a ``bot_message``."""
        own = bot_id is None or bot_id == self.bot_id
        ts = ts or self._new_ts()
        event: Payload = {
            "type": "message",
            "text": text,
            "ts": ts,
            "bot_id": bot_id or self.bot_id,
            "channel": channel,
            "event_ts": ts,
            "channel_type": _channel_type(channel),
        }
        if own:
            event.update(user=self.bot_user_id, app_id=self.app_id, team=self.team_id)
        else:
            event.update(subtype="bot_message", username=username)
        if thread_ts:
            event["thread_ts"] = thread_ts
        with self._lock:
            self._messages[(channel, event["ts"])] = event
        return self.event_callback(event)

    def _user_event(
        self,
        kind: str,
        channel: str,
        user: str,
        text: str,
        ts: str | None,
        thread_ts: str | None,
        channel_type: str | None,
    ) -> Payload:
        ts = ts or self._new_ts()
        event: Payload = {
            "type": kind,
            "user": user,
            "text": text,
            "ts": ts,
            "client_msg_id": str(uuid.uuid4()),
            "team": self.team_id,
            "channel": channel,
            "event_ts": ts,
        }
        if channel_type is not None:
            event["channel_type"] = channel_type
        with self._lock:
            if thread_ts:
                event["thread_ts"] = thread_ts
                parent = self._messages.get((channel, thread_ts))
                if parent is not None and parent.get("user"):
                    event["parent_user_id"] = parent["user"]
            self._messages[(channel, ts)] = event
            self._users.setdefault(user, user.lower())
        return event

    def _new_ts(self) -> str:
        """A message timestamp like ``1712345678.000100``, strictly increasing."""
        with self._lock:
            micros = max(int(time.time() * 1_000_000), self._last_ts_micros + 1)
            self._last_ts_micros = micros
        return f"{micros // 1_000_000}.{micros % 1_000_000:06d}"

    # -- Socket Mode ------------------------------------------------------------------

    async def socket_event(
        self,
        payload: Mapping[str, Any],
        *,
        retry_num: int = 0,
        retry_reason: str | None = None,
        accepts_response_payload: bool = False,
        envelope_type: str = "events_api",
        connect_timeout: float = 5.0,
        connection: int | None = None,
    ) -> Payload:
        """Send `payload` over the newest Socket Mode connection (or the open one numbered
        `connection`, see `socket_numbers`) in an envelope and return the envelope. With
        several connections open, Slack sends each envelope to one of them, and a retry
        may go to another: a test picks the connection to play that. An ``events_api``
        payload may be a full event callback (from the builders) or a bare inner event,
        which gets wrapped with a fresh event_id; other envelope types (``slash_commands``,
        ``interactive``) send the payload as is. Waits up to `connect_timeout` seconds for
        a client to be connected."""
        body = copy.deepcopy(dict(payload))
        if envelope_type == "events_api" and body.get("type") != "event_callback":
            body = self.event_callback(body)
        envelope: Payload = {
            "envelope_id": str(uuid.uuid4()),
            "payload": body,
            "type": envelope_type,
            "accepts_response_payload": accepts_response_payload,
        }
        if envelope_type == "events_api":
            # Slack sends these on first deliveries too: 0 and "".
            envelope["retry_attempt"] = retry_num
            envelope["retry_reason"] = retry_reason or ""
        await self._on_server_loop(self._send_envelope(envelope, connect_timeout, connection))
        return envelope

    async def redeliver(
        self,
        envelope_or_payload: Mapping[str, Any],
        *,
        retry_num: int = 1,
        retry_reason: str = "timeout",
        connection: int | None = None,
    ) -> Payload:
        """Resend an event the way Slack retries an unacknowledged one: the same payload
        and event_id in a new envelope with ``retry_attempt``/``retry_reason`` set."""
        if "envelope_id" in envelope_or_payload:
            payload = envelope_or_payload["payload"]
            envelope_type = str(envelope_or_payload.get("type", "events_api"))
        else:
            payload, envelope_type = envelope_or_payload, "events_api"
        return await self.socket_event(
            payload,
            retry_num=retry_num,
            retry_reason=retry_reason,
            envelope_type=envelope_type,
            connection=connection,
        )

    async def socket_disconnect(
        self, reason: str = "refresh_requested", *, close: bool = False
    ) -> None:
        """Send ``{"type": "disconnect", "reason": ...}`` on every open connection (Slack's
        reasons: ``warning``, ``refresh_requested``, ``link_disabled``); the client is
        expected to open a new connection. ``close=True`` also closes them afterwards."""
        await self._on_server_loop(self._disconnect(reason, close))

    async def wait_for_socket(self, connections: int = 1) -> int:
        """Wait until `connections` sockets in total have been greeted with ``hello``
        (reconnections count). Bound it with ``asyncio.timeout(...)``."""
        return await self._on_server_loop(
            self._until(lambda: self._hellos if self._hellos >= connections else None)
        )

    async def wait_for_ack(self, envelope_id: str) -> Ack:
        """Wait until the envelope is acknowledged. Bound it with ``asyncio.timeout``."""

        def acked() -> Ack | None:
            with self._lock:
                return next((a for a in self._acks if a.envelope_id == envelope_id), None)

        return await self._on_server_loop(self._until(acked))

    @property
    def acks(self) -> list[Ack]:
        with self._lock:
            return list(self._acks)

    @property
    def envelopes(self) -> list[Payload]:
        """Every envelope sent, oldest first (a snapshot)."""
        with self._lock:
            return copy.deepcopy(self._envelopes)

    @property
    def open_sockets(self) -> int:
        with self._lock:
            return len(self._sockets)

    @property
    def socket_numbers(self) -> list[int]:
        """The numbers of the open Socket Mode connections, oldest first (acks carry them)."""
        with self._lock:
            return [socket.number for socket in self._sockets]

    async def _send_envelope(
        self, envelope: Payload, connect_timeout: float, connection: int | None = None
    ) -> None:
        def newest() -> _Socket | None:
            with self._lock:
                if connection is not None:
                    return next((s for s in self._sockets if s.number == connection), None)
                return self._sockets[-1] if self._sockets else None

        try:
            async with asyncio.timeout(connect_timeout):
                socket = await self._until(newest)
        except TimeoutError:
            which = "no Socket Mode client" if connection is None else f"no connection {connection}"
            raise RuntimeError(f"{which} connected within {connect_timeout}s") from None
        with self._lock:
            self._envelopes.append(copy.deepcopy(envelope))
            self._sent_at[envelope["envelope_id"]] = time.monotonic()
        await socket.ws.send_str(json.dumps(envelope))

    async def _disconnect(self, reason: str, close: bool) -> None:
        with self._lock:
            sockets = list(self._sockets)
        message = {"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake"}}
        for socket in sockets:
            with contextlib.suppress(ConnectionError):
                await socket.ws.send_str(json.dumps(message))
            if close:
                await socket.ws.close(code=WSCloseCode.GOING_AWAY, message=reason.encode())

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        with self._lock:
            valid = ticket in self._tickets
            self._tickets.discard(ticket)  # single use, like Slack's
        if not valid:
            return web.Response(status=401, text="invalid or already used ticket")
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        with self._lock:
            socket = _Socket(next(self._socket_numbers), ws)
            self._sockets.append(socket)
            self._hellos += 1
            connections = len(self._sockets)
        await ws.send_str(
            json.dumps(
                {
                    "type": "hello",
                    "num_connections": connections,
                    "debug_info": {
                        "host": "applink-fake",
                        "build_number": 1,
                        "approximate_connection_time": 18060,
                    },
                    "connection_info": {"app_id": self.app_id},
                }
            )
        )
        self._notify()
        try:
            async for message in ws:
                if message.type == WSMsgType.TEXT:
                    self._record_ack(message.data, socket.number)
        finally:
            with self._lock:
                if socket in self._sockets:
                    self._sockets.remove(socket)
            self._notify()
        return ws

    def _record_ack(self, data: str, connection: int) -> None:
        try:
            message = json.loads(data)
        except ValueError:
            return
        if not isinstance(message, dict) or not isinstance(message.get("envelope_id"), str):
            return
        envelope_id = message["envelope_id"]
        payload = message.get("payload")
        with self._lock:
            sent_at = self._sent_at.get(envelope_id)
            self._acks.append(
                Ack(
                    envelope_id=envelope_id,
                    payload=payload if isinstance(payload, dict) else None,
                    latency=None if sent_at is None else time.monotonic() - sent_at,
                    received_at=time.time(),
                    connection=connection,
                )
            )
        self._notify()

    # -- Events API over HTTP ---------------------------------------------------------

    async def post_event(
        self,
        url: str,
        payload: Mapping[str, Any] | bytes,
        signing_secret: str | None = None,
        *,
        timestamp: int | float | None = None,
        bad_signature: bool = False,
        retry_num: int | None = None,
        retry_reason: str | None = None,
    ) -> HttpDelivery:
        """POST `payload` to the app's Events API endpoint once, the way Slack does: JSON
        body, ``X-Slack-Request-Timestamp`` (now, or `timestamp` to make it stale) and
        ``X-Slack-Signature`` (made with a wrong secret when `bad_signature`), plus
        ``X-Slack-Retry-Num``/``X-Slack-Retry-Reason`` (default ``http_timeout``) when
        `retry_num` is given. A `payload` given as bytes is sent as it is (signed like
        any other body), to play a malformed request. See `deliver_event` for a delivery
        with Slack's retries."""
        body, headers = self._signed_event(
            payload, signing_secret, timestamp, bad_signature, retry_num, retry_reason
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=headers) as response,
        ):
            return HttpDelivery(response.status, await response.text(), dict(response.headers))

    def _signed_event(
        self,
        payload: Mapping[str, Any] | bytes,
        signing_secret: str | None = None,
        timestamp: int | float | None = None,
        bad_signature: bool = False,
        retry_num: int | None = None,
        retry_reason: str | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        stamp = str(int(timestamp if timestamp is not None else time.time()))
        secret = signing_secret or self.signing_secret
        if bad_signature:
            secret = secret + "-wrong"
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)",
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": sign_request(secret, stamp, body),
        }
        if retry_num is not None:
            headers["X-Slack-Retry-Num"] = str(retry_num)
            headers["X-Slack-Retry-Reason"] = retry_reason or "http_timeout"
        return body, headers

    async def deliver_event(
        self,
        url: str,
        payload: Mapping[str, Any],
        *,
        retry_delays: Sequence[float] = SLACK_RETRY_DELAYS,
        ack_timeout: float = SLACK_ACK_TIMEOUT,
        signing_secret: str | None = None,
    ) -> EventDelivery:
        """Deliver an event callback to the app's endpoint the way the Events API does
        (see the module docstring): POST it, signed; a 2xx within `ack_timeout` seconds
        acknowledges it; after a failure wait ``retry_delays[n]`` and send retry n + 1
        (same payload, ``X-Slack-Retry-Num``/``-Reason``), up to ``len(retry_delays)``
        retries, unless the answer carried ``X-Slack-No-Retry: 1``. Every attempt is
        recorded in `event_deliveries` as it happens; returns the finished delivery.
        Runs in the caller's event loop (any loop)."""
        with self._lock:
            number = len(self._deliveries)
            self._deliveries.append(
                EventDelivery(number, str(payload.get("event_id", "")), url, payload, time.time())
            )
        self._notify()
        retry_num = 0
        reason: RetryReason | None = None
        try:
            while True:
                attempt = await self._attempt_delivery(
                    url, payload, retry_num, reason, ack_timeout, signing_secret
                )
                self._update_delivery(number, attempt)
                if attempt.failure is None or attempt.no_retry or retry_num >= len(retry_delays):
                    break
                await asyncio.sleep(retry_delays[retry_num])
                retry_num += 1
                reason = attempt.failure
        finally:
            self._update_delivery(number, None)
        return self.event_deliveries[number]

    def deliver_event_soon(
        self,
        url: str,
        payload: Mapping[str, Any],
        *,
        retry_delays: Sequence[float] = SLACK_RETRY_DELAYS,
        ack_timeout: float = SLACK_ACK_TIMEOUT,
    ) -> concurrent.futures.Future[EventDelivery]:
        """Start `deliver_event` in the fake's own event loop, from any thread (for sync
        tests against ``in_thread``); the future resolves when the delivery is done."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeSlack is not running")
        return asyncio.run_coroutine_threadsafe(
            self.deliver_event(url, payload, retry_delays=retry_delays, ack_timeout=ack_timeout),
            loop,
        )

    def socket_event_soon(self, payload: Mapping[str, Any]) -> concurrent.futures.Future[Payload]:
        """Start `socket_event` in the fake's own event loop, from any thread (for sync
        tests against ``in_thread``); the future resolves to the envelope once sent."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeSlack is not running")
        return asyncio.run_coroutine_threadsafe(self.socket_event(payload), loop)

    @property
    def event_deliveries(self) -> list[EventDelivery]:
        """Every `deliver_event` so far, in the order they started (a snapshot)."""
        with self._lock:
            return list(self._deliveries)

    def acked_deliveries(self) -> list[EventDelivery]:
        """The deliveries the app has acknowledged, in the order they started."""
        return [d for d in self.event_deliveries if d.acked]

    def wait_for_event_acks(self, count: int, timeout: float = 5.0) -> list[EventDelivery]:
        """Block until at least `count` deliveries were acknowledged (thread mode)."""
        return self._wait_blocking(
            at_least(count, self.acked_deliveries),
            timeout,
            async_method="deliver_event",
            describe_timeout=lambda: (
                f"{len(self.acked_deliveries())} of {count} events acked after {timeout}s"
            ),
        )

    async def _attempt_delivery(
        self,
        url: str,
        payload: Mapping[str, Any],
        retry_num: int,
        reason: RetryReason | None,
        ack_timeout: float,
        signing_secret: str | None,
    ) -> DeliveryAttempt:
        body, headers = self._signed_event(
            payload,
            signing_secret,
            retry_num=retry_num or None,
            retry_reason=reason,
        )
        sent_at = time.time()
        status = 0
        failure: RetryReason | None
        detail = ""
        no_retry = False
        # A fresh connection per attempt, as from Slack's many senders.
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                asyncio.timeout(ack_timeout),
                session.post(
                    url, data=body, headers=headers, max_redirects=SLACK_MAX_REDIRECTS
                ) as response,
            ):
                status = response.status
                detail = (await response.text())[:200]
                no_retry = response.headers.get("X-Slack-No-Retry") == "1"
            failure = None if 200 <= status < 300 else "http_error"
        except TimeoutError:
            failure, detail = "http_timeout", f"no answer within {ack_timeout:g} s"
        except aiohttp.TooManyRedirects as exc:
            failure, detail = "too_many_redirects", repr(exc)
        except aiohttp.ClientSSLError as exc:
            failure, detail = "ssl_error", repr(exc)
        except aiohttp.ClientConnectorError as exc:
            failure, detail = "connection_failed", repr(exc)
        except aiohttp.ClientError as exc:
            failure, detail = "unknown_error", repr(exc)
        return DeliveryAttempt(
            retry_num=retry_num,
            sent_at=sent_at,
            answered_at=time.time(),
            status=status,
            failure=failure,
            detail=detail,
            no_retry=no_retry and failure is not None,
        )

    def _update_delivery(self, number: int, attempt: DeliveryAttempt | None) -> None:
        """Record `attempt` of delivery `number`, or (None) that the delivery ended."""
        with self._lock:
            delivery = self._deliveries[number]
            if attempt is None:
                delivery = dataclasses.replace(delivery, finished=True)
            else:
                delivery = dataclasses.replace(delivery, attempts=(*delivery.attempts, attempt))
            self._deliveries[number] = delivery
        self._notify()

    async def url_verification(
        self, url: str, signing_secret: str | None = None, *, challenge: str | None = None
    ) -> HttpDelivery:
        """Send Slack's signed ``url_verification`` request; the app must echo the
        challenge."""
        payload = {
            "token": self.verification_token,
            "challenge": challenge or uuid.uuid4().hex,
            "type": "url_verification",
        }
        return await self.post_event(url, payload, signing_secret)

    # -- the call log -----------------------------------------------------------------

    def posted_messages(self, channel: str | None = None) -> list[Payload]:
        """The ``message`` of every successful chat.postMessage and chat.update, in order,
        each with its ``channel`` (an update shows up again, with ``edited``)."""
        posted = []
        for call in self.calls:
            if call.method in ("chat.postMessage", "chat.update") and call.ok:
                message = {**call.response["message"], "channel": call.response["channel"]}
                if channel is None or message["channel"] == channel:
                    posted.append(message)
        return posted

    # -- Web API ----------------------------------------------------------------------

    async def _not_found(self, request: web.Request) -> web.Response:
        hint = ""
        if re.fullmatch(r"/[a-z]+\.[A-Za-z.]+", request.path):
            hint = f" (a base_url without its trailing slash? use {self.api_url!r})"
        return web.Response(status=404, text=f"FakeSlack: no route {request.path}{hint}")

    async def _api(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        params = await _read_params(request)
        auth = request.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        body_token = params.pop("token", None)
        token = token or (str(body_token) if body_token else None)
        headers: dict[str, str] = {}
        try:
            known = self._methods.get(method)
            if known is None:
                raise _SlackError("unknown_method")
            self._check_token(token, known[0])
            self._raise_scripted_fault(method)
            status, body = 200, {"ok": True, **await known[1](params)}
        except _SlackError as exc:
            status, headers = exc.status, exc.headers
            body = {"ok": False, "error": exc.error}
            if exc.error == "unknown_method":
                body["req_method"] = method
        call = ApiCall(method, params, token, time.time(), status, body)
        self._log_call(call)
        return web.json_response(body, status=status, headers=headers)

    def _check_token(self, token: str | None, kind: TokenKind) -> None:
        if not token:
            raise _SlackError("not_authed")
        if token not in (self.bot_token, self.app_token):
            raise _SlackError("invalid_auth")
        if token != (self.bot_token if kind == "bot" else self.app_token):
            raise _SlackError("not_allowed_token_type")

    def _raise_scripted_fault(self, method: str) -> None:
        with self._lock:
            for i, fault in enumerate(self._faults):
                if fault.method in ("*", method):
                    del self._faults[i]
                    headers = {}
                    if fault.retry_after is not None:
                        headers["Retry-After"] = str(fault.retry_after)
                    raise _SlackError(fault.error, fault.status, headers)

    async def _auth_test(self, params: dict[str, Any]) -> Payload:
        return {
            "url": f"https://{self.team_domain}.slack.com/",
            "team": self.team_name,
            "user": self.bot_name,
            "team_id": self.team_id,
            "user_id": self.bot_user_id,
            "bot_id": self.bot_id,
            "is_enterprise_install": False,
        }

    async def _connections_open(self, params: dict[str, Any]) -> Payload:
        ticket = uuid.uuid4().hex
        with self._lock:
            self._tickets.add(ticket)
        port = self.socket_port or self._port
        return {"url": f"ws://127.0.0.1:{port}/socket?ticket={ticket}&app_id={self.app_id}"}

    async def _post_message(self, params: dict[str, Any]) -> Payload:
        channel = _channel_param(params)
        text, blocks = _content(params)
        thread_ts = params.get("thread_ts")
        if thread_ts is not None and not _TS.match(str(thread_ts)):
            raise _SlackError("invalid_thread_ts")
        ts = self._new_ts()
        message: Payload = {
            "user": self.bot_user_id,
            "type": "message",
            "ts": ts,
            "bot_id": self.bot_id,
            "app_id": self.app_id,
            "text": text,
            "team": self.team_id,
            "bot_profile": {
                "id": self.bot_id,
                "app_id": self.app_id,
                "name": self.bot_name,
                "deleted": False,
                "team_id": self.team_id,
            },
        }
        if blocks is not None:
            message["blocks"] = blocks
        with self._lock:
            if thread_ts is not None:
                message["thread_ts"] = str(thread_ts)
                parent = self._messages.get((channel, str(thread_ts)))
                if parent is not None and parent.get("user"):
                    message["parent_user_id"] = parent["user"]
            self._messages[(channel, ts)] = message
        return {"channel": channel, "ts": ts, "message": copy.deepcopy(message)}

    async def _update_message(self, params: dict[str, Any]) -> Payload:
        channel = _channel_param(params)
        ts = str(params.get("ts") or "")
        with self._lock:
            stored = self._messages.get((channel, ts))
        if stored is None:
            raise _SlackError("message_not_found")
        if stored.get("bot_id") != self.bot_id:
            raise _SlackError("cant_update_message")
        text, blocks = _content(params)
        updated = copy.deepcopy(stored)
        updated["text"] = text
        if blocks is not None:
            updated["blocks"] = blocks
        updated["edited"] = {"user": self.bot_user_id, "ts": self._new_ts()}
        with self._lock:
            self._messages[(channel, ts)] = updated
        return {"channel": channel, "ts": ts, "text": text, "message": copy.deepcopy(updated)}

    async def _conversations_info(self, params: dict[str, Any]) -> Payload:
        channel = _channel_param(params)
        kind = _channel_type(channel)
        info: Payload = {
            "id": channel,
            "created": 1700000000,
            "is_channel": kind == "channel",
            "is_group": kind == "group",
            "is_im": kind == "im",
            "is_mpim": False,
            "is_private": kind in ("group", "im"),
            "is_archived": False,
            "is_member": True,
        }
        if kind == "im":
            info["user"] = f"U{channel[1:]}"
        else:
            info.update(
                name=f"channel-{channel.lower()}", name_normalized=f"channel-{channel.lower()}"
            )
        return {"channel": info}

    async def _users_info(self, params: dict[str, Any]) -> Payload:
        user = str(params.get("user") or "")
        if not _USER_ID.match(user):
            raise _SlackError("user_not_found")
        with self._lock:
            name = self._users.get(user, user.lower())
        is_bot = user == self.bot_user_id
        return {
            "user": {
                "id": user,
                "team_id": self.team_id,
                "name": name,
                "real_name": name.title(),
                "deleted": False,
                "is_bot": is_bot,
                "is_app_user": False,
                "profile": {"display_name": name, "real_name": name.title()},
            }
        }


def _channel_type(channel: str) -> str:
    return {"D": "im", "G": "group"}.get(channel[:1], "channel")


def _channel_param(params: Mapping[str, Any]) -> str:
    channel = str(params.get("channel") or "")
    if not _CHANNEL_ID.match(channel):
        raise _SlackError("channel_not_found")
    return channel


def _content(params: Mapping[str, Any]) -> tuple[str, list[Any] | None]:
    """The text and blocks of a message, or Slack's error for a message without either,
    too long a text, or malformed blocks."""
    text = params.get("text")
    text = "" if text is None else str(text)
    blocks = params.get("blocks")
    if blocks is not None and (
        not isinstance(blocks, list)
        or len(blocks) > MAX_BLOCKS
        or not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in blocks)
    ):
        raise _SlackError("invalid_blocks")
    if not text and not blocks and not params.get("attachments"):
        raise _SlackError("no_text")
    if len(text) > MAX_TEXT_LENGTH:
        raise _SlackError("msg_too_long")
    return text, blocks


async def _read_params(request: web.Request) -> dict[str, Any]:
    """The call's parameters from the query string and a JSON, form or multipart body;
    JSON-valued form fields (blocks, attachments, metadata) are decoded."""
    params: dict[str, Any] = dict(request.query)
    if request.body_exists:
        if request.content_type == "application/json":
            with contextlib.suppress(ValueError):
                body = await request.json()
                if isinstance(body, dict):
                    params.update(body)
        else:
            form = await request.post()
            params.update({k: v for k, v in form.items() if isinstance(v, str)})
    for key in _JSON_PARAMS:
        if isinstance(params.get(key), str):
            with contextlib.suppress(ValueError):
                params[key] = json.loads(params[key])
    return params
