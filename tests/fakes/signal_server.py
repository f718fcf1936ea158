"""A fake signal-cli HTTP daemon (`signal-cli daemon --http`) that speaks its wire format,
for tests. Nothing here runs Java or talks to Signal: the fake plays both signal-cli and
Signal's servers behind it, for one registered account (the bot) and the people and
groups a test makes up.

Written from signal-cli's own documentation and, where the manual pages are silent, its
source (github AsamK/signal-cli, v0.14.6):

- signal-cli-jsonrpc(5) (man/signal-cli-jsonrpc.5.adoc): the three endpoints of `--http`
  (`POST /api/v1/rpc` with a single or batch JSON-RPC request, `GET /api/v1/events` as
  Server-Sent Events, `GET /api/v1/check`), camelCase parameters with a list parameter
  given as one value or a list (`attachment` / `attachments`), multi-account mode's
  `account` parameter, `receive` notifications' envelope, `--receive-mode=manual`.
- signal-cli(1) (man/signal-cli.1.adoc): `daemon` and its `--receive-mode` (on-start,
  on-connection, manual), `receive` (`--timeout`, `--max-messages`), `send` (recipients or
  `--group-id`, `--text-style start:length:STYLE` in UTF-16 units, `--mention`,
  `--quote-timestamp`/`--quote-author`, `--attachment` as a data URI, `--edit-timestamp`),
  `sendTyping` (an indicator shown for 15 seconds), `sendReceipt` (`read` or `viewed`),
  `sendReaction`, `getAttachment`, `version`, `listAccounts`, `listContacts`,
  `listGroups`.
- The source, for what the pages do not say: `http/HttpServerHandler.java` (405 for a
  wrong method, 415 without `Content-Type: application/json`, 421 for a Host header other
  than the address it listens on unless it listens on every address, 201 without a body
  for a notification; an events client registers a receive handler for as long as it
  stays connected), `manager/helper/ReceiveHelper.java` (an envelope is cached on disk,
  acknowledged to Signal's server, then decrypted and handed to the receive handlers,
  then its cache entry deleted: what no handler takes is gone), `manager/internal/
  ManagerImpl.java` (the daemon receives continuously while a strong handler is
  registered: the default stdout handler with `--receive-mode=on-start`, or an events
  client; a `receive` call is refused with "Receive command cannot be used if messages
  are already being received." meanwhile), `commands/ReceiveCommand.java` (`receive`'s
  `timeout`, default 3 seconds, per wait; `maxMessages`; the messages are collected and
  returned in the call's answer), `jsonrpc/SignalJsonRpcCommandHandler.java` (error codes
  -1 user error, -3 I/O, -4 untrusted key, -5 rate limit, -32601 "Method not
  implemented", -32602 for an unknown account; `receive`'s parameters are a strict record,
  so an `account` parameter in single-account mode is -32600 "Unrecognized field"),
  `json/*.java` (the envelope: `sourceUuid`, `sourceNumber`, `sourceName`, `timestamp`,
  `dataMessage` with `message`, `mentions`, `quote`, `attachments`, `textStyles`,
  `groupInfo`; `editMessage` with `targetSentTimestamp`; `syncMessage`, `receiptMessage`,
  `typingMessage`), `util/SendMessageResultUtils.java` (a send's `{"timestamp",
  "results"}` and its failure types), `manager/config/ServiceConfig.java` (a body over
  2,000 bytes of UTF-8 goes out truncated, with the whole text as a long-text
  attachment).

What the gateway's promise rests on, and this fake keeps (tests/test_fake_signal.py):

- Messages wait at "Signal's server" (`server_queue`) while nothing receives: with
  `--receive-mode manual` (or on-connection) and no `receive` call or events client.
- With `receive_mode="on-start"` the daemon receives by itself: a message that arrives
  while no events client is connected is handed to no one and is gone (`dropped`).
- A `receive` call takes messages from the server queue as they arrive (acknowledged at
  once), at most `maxMessages`, and answers with them; it runs to its end whatever its
  HTTP client does: a call whose client went away (killed, or the network cut) still
  takes the next message and its answer goes nowhere (`lost_in_transit`). This is what
  the real daemon does (its HTTP server does not stop a handler when the client leaves).
- Only one receiver at a time: a `receive` while another runs, or while the daemon
  receives continuously, is refused (-1, "Receive command cannot be used if messages are
  already being received.").
- Message ids are the sender's timestamps (milliseconds), unique per sender; an edit
  names the first message's timestamp (`targetSentTimestamp`).

Scripting, from any thread (`with FakeSignalCli.in_thread() as fake`)::

    alice = fake.person("Alice")
    fake.dm(alice, "hello")                          # waits at Signal's server
    group = fake.group("Team", [alice, bob])
    fake.group_message(group, bob, "hi", mention_bot=True)
    fake.fail_next("send", RATE_LIMIT)               # the next send is rate limited
    fake.sent                                        # what the bot sent, in order

Not modelled: encryption, devices, safety numbers, stories, payments, polls' votes, group
management beyond membership, real rate limits (script them with `fail_next`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import re
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from tests.fakes._serving import LocalApiServer

VERSION = "0.14.6"
#: ServiceConfig.MAX_MESSAGE_SIZE_BYTES: a longer body is sent truncated, the whole text
#: as a long-text attachment.
MAX_BODY_BYTES = 2000
LONG_TEXT = "text/x-signal-plain"
STYLES = frozenset({"BOLD", "ITALIC", "SPOILER", "STRIKETHROUGH", "MONOSPACE"})
RECEIVE_BUSY = "Receive command cannot be used if messages are already being received."
ReceiveMode = Literal["on-start", "on-connection", "manual"]

# JSON-RPC error codes (SignalJsonRpcCommandHandler, JsonRpcResponse.Error).
USER_ERROR = -1
IO_ERROR = -3
UNTRUSTED_KEY_ERROR = -4
RATELIMIT_ERROR = -5
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

_STYLE = re.compile(r"(\d+):(\d+):(.+)")
_DATA_URI = re.compile(r"data:([^;,]+)((?:;[^;,=]+=[^;,]*)*);base64,(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Person:
    """Someone on Signal: an ACI (uuid), a number, a profile name."""

    uuid: str
    number: str
    name: str

    def address(self) -> dict[str, str]:
        return {"uuid": self.uuid, "number": self.number}


@dataclass(frozen=True, slots=True)
class Group:
    """A Signal group: its id (base64 of 32 bytes, as signal-cli writes it), its name."""

    id: str
    name: str
    members: tuple[Person, ...]


@dataclass(frozen=True, slots=True)
class RpcCall:
    """One JSON-RPC request the fake answered."""

    method: str
    params: Mapping[str, Any]
    ok: bool
    at: float
    error: Mapping[str, Any] | None = None

    @property
    def timestamp(self) -> float:
        return self.at


@dataclass(frozen=True, slots=True)
class Sent:
    """A message the bot sent (a `send` that succeeded): where, its whole text, styles,
    quote, mentions, attachments; `edit_of` for an edit (`editTimestamp`)."""

    timestamp: int
    recipients: tuple[str, ...]
    group_id: str | None
    text: str
    styles: tuple[tuple[int, int, str], ...] = ()
    quote: tuple[int, str] | None = None
    mentions: tuple[tuple[int, int, str], ...] = ()
    attachments: tuple[tuple[str, str, bytes], ...] = ()
    edit_of: int | None = None
    long_text: bool = False
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Scripted:
    """A JSON-RPC error the next call of a method gets instead of its answer."""

    code: int
    message: str
    data: Any = None


def rate_limited(retry_after: int = 1) -> Scripted:
    """A send refused for Signal's rate limit (RateLimitErrorException)."""
    return Scripted(
        RATELIMIT_ERROR,
        "Failed to send message due to rate limiting",
        {"response": {"timestamp": 0, "results": [{"type": "RATE_LIMIT_FAILURE",
                                                    "retryAfterSeconds": retry_after}]}},
    )  # fmt: skip


def network_failure() -> Scripted:
    """A send signal-cli could not get to Signal's servers (every result NETWORK_FAILURE)."""
    return Scripted(
        USER_ERROR,
        "Failed to send message",
        {"response": {"timestamp": 0, "results": [{"type": "NETWORK_FAILURE"}]}},
    )


def untrusted_identity() -> Scripted:
    return Scripted(
        UNTRUSTED_KEY_ERROR,
        "Failed to send message due to untrusted identities",
        {"response": {"timestamp": 0, "results": [{"type": "IDENTITY_FAILURE"}]}},
    )


class RpcFailure(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def _as_list(params: Mapping[str, Any], name: str) -> list[Any] | None:
    """A list parameter as signal-cli reads it (`JsonRpcNamespace.getList`): `name` as a
    list or one value, else `name` + "s"."""
    for key in (name, name + "s"):
        if key in params and params[key] is not None:
            value = params[key]
            return list(value) if isinstance(value, list) else [value]
    return None


class FakeSignalCli(LocalApiServer[RpcCall]):
    """signal-cli's HTTP daemon for one account, on 127.0.0.1 (see the module docstring)."""

    _thread_name = "fake-signal-cli"

    def __init__(
        self,
        *,
        account: str = "+15550000001",
        account_uuid: str = "0b0b0b0b-0000-4000-8000-00000000b0b0",
        receive_mode: ReceiveMode = "manual",
        multi_account: bool = False,
        pin_host: bool = False,
    ) -> None:
        super().__init__()
        self.account = account
        self.me = Person(account_uuid, account, "Gateway Bot")
        self.receive_mode: ReceiveMode = receive_mode
        self.multi_account = multi_account
        #: True: the daemon listens on one address and answers 421 to any other Host
        #: (`--http 127.0.0.1:PORT`); False: it listens on every address (`0.0.0.0`).
        self.pin_host = pin_host
        self.people: dict[str, Person] = {}
        self.groups: dict[str, Group] = {}
        #: Envelopes waiting at Signal's server, oldest first.
        self.server_queue: deque[dict[str, Any]] = deque()
        #: Envelopes handed over: (how, envelope), how = "receive" | "events".
        self.handed: list[tuple[str, dict[str, Any]]] = []
        #: Envelopes taken from the server while nobody listened (on-start mode).
        self.dropped: list[dict[str, Any]] = []
        #: Envelopes a `receive` call took whose client was gone when it answered.
        self.lost_in_transit: list[dict[str, Any]] = []
        self.sent: list[Sent] = []
        self.receipts: list[dict[str, Any]] = []
        self.reactions: list[dict[str, Any]] = []
        self.typing: list[dict[str, Any]] = []
        self.attachments: dict[str, tuple[str, str, bytes]] = {}
        self._scripted: dict[str, deque[Scripted]] = {}
        self._receiving = False  # a `receive` call runs
        self._events: list[asyncio.Queue[dict[str, Any]]] = []
        self._pump: asyncio.Task[None] | None = None
        self._last_timestamp = 0
        self._numbers = itertools.count(1)

    # -- the app ------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/api/v1/rpc", self._rpc_endpoint)
        app.router.add_route("*", "/api/v1/events", self._events_endpoint)
        app.router.add_route("*", "/api/v1/check", self._check_endpoint)
        return app

    async def start(self) -> None:
        await super().start()
        self._pump = asyncio.get_running_loop().create_task(self._receive_continuously())

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await super().stop()

    def _host_allowed(self, request: web.Request) -> bool:
        if not self.pin_host:
            return True
        host, _, port = (request.headers.get("Host") or "").rpartition(":")
        return host in ("127.0.0.1", "localhost", "::1", "[::1]") and port == str(self._port)

    async def _check_endpoint(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET":
            return web.Response(status=405)
        return web.Response(status=200)

    async def _rpc_endpoint(self, request: web.Request) -> web.StreamResponse:
        if not self._host_allowed(request):
            return web.Response(status=421)
        if request.method != "POST":
            return web.Response(status=405)
        if not (request.headers.get("Content-Type") or "").startswith("application/json"):
            return web.Response(status=415)
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return web.json_response(_error(None, PARSE_ERROR, f"Failed to parse json: {exc}"))
        if isinstance(body, list):
            answers = [a for a in [await self._one(r, request) for r in body] if a is not None]
            return web.json_response(answers) if answers else web.Response(status=201)
        answer = await self._one(body, request)
        return web.json_response(answer) if answer is not None else web.Response(status=201)

    async def _one(self, request_body: Any, request: web.Request) -> dict[str, Any] | None:
        if not isinstance(request_body, dict):
            return _error(None, INVALID_REQUEST, "request must be an object")
        request_id = request_body.get("id")
        method = request_body.get("method")
        if not method:
            return _error(request_id, INVALID_REQUEST, "method field must be set")
        params = request_body.get("params")
        params = dict(params) if isinstance(params, dict) else {}
        try:
            result = await self._call(str(method), params, request)
        except RpcFailure as failure:
            self._log_call(RpcCall(str(method), params, False, time.time(), _err(failure)))
            if request_id is None:
                return None
            return _error(request_id, failure.code, failure.message, failure.data)
        self._log_call(RpcCall(str(method), params, True, time.time()))
        if request_id is None:
            return None
        return {"jsonrpc": "2.0", "result": result, "id": request_id}

    async def _call(self, method: str, params: dict[str, Any], request: web.Request) -> Any:
        if self.multi_account:
            if method == "listAccounts":
                return [{"number": self.account}]
            account = params.pop("account", None)
            if account is not None and account not in (self.account, self.me.uuid):
                raise RpcFailure(INVALID_PARAMS, "Specified account does not exist")
        elif method == "listAccounts":
            raise RpcFailure(METHOD_NOT_FOUND, "Method not implemented")
        scripted = self._scripted.get(method)
        if scripted:
            with self._lock:
                failure = scripted.popleft()
            raise RpcFailure(failure.code, failure.message, failure.data)
        if method == "receive":
            return await self._receive_call(params, request)
        handler = _METHODS.get(method)
        if handler is None:
            raise RpcFailure(METHOD_NOT_FOUND, "Method not implemented")
        return handler(self, params)

    # -- receiving --------------------------------------------------------------------------

    @property
    def receiving_continuously(self) -> bool:
        """The daemon receives by itself: on-start mode, or an events client connected."""
        return self.receive_mode == "on-start" or bool(self._events)

    async def _receive_continuously(self) -> None:
        """ManagerImpl's receive thread: while a strong handler is registered, every
        envelope is taken from the server, acknowledged and handed to the handlers; with
        none connected (on-start's stdout handler only) it is gone."""
        while True:
            await self._until(
                lambda: True if self.server_queue and self.receiving_continuously else None
            )
            with self._lock:
                if not (self.server_queue and self.receiving_continuously):
                    continue
                envelope = self.server_queue.popleft()
                listeners = list(self._events)
                if listeners:
                    self.handed.extend(("events", envelope) for _ in listeners)
                else:
                    self.dropped.append(envelope)
            for queue in listeners:
                queue.put_nowait(envelope)
            self._notify()

    async def _receive_call(self, params: dict[str, Any], request: web.Request) -> Any:
        unknown = set(params) - {"timeout", "maxMessages"}
        if unknown:
            name = sorted(unknown)[0]
            raise RpcFailure(
                INVALID_REQUEST,
                f'Unrecognized field "{name}" (class org.asamk.signal.commands.ReceiveCommand'
                '$ReceiveParams), not marked as ignorable (2 known properties: "timeout", '
                '"maxMessages"])',
            )
        timeout = float(params.get("timeout") if params.get("timeout") is not None else 3.0)
        most = int(params.get("maxMessages") if params.get("maxMessages") is not None else -1)
        with self._lock:
            if self._receiving or self.receiving_continuously:
                raise RpcFailure(USER_ERROR, RECEIVE_BUSY)
            self._receiving = True
        # The call runs to its end whatever the HTTP client does (signal-cli's handler
        # thread is not stopped when its client leaves): shielded from this handler.
        call = asyncio.get_running_loop().create_task(self._receive_messages(timeout, most))
        try:
            taken = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._answer_went_nowhere)
            raise
        transport = request.transport
        if transport is None or transport.is_closing():
            self._answer_went_nowhere(call)
        return [{"envelope": e, "account": self.account} for e in taken]

    def _answer_went_nowhere(self, call: asyncio.Task[list[dict[str, Any]]]) -> None:
        if not call.cancelled() and call.exception() is None:
            with self._lock:
                self.lost_in_transit.extend(call.result())
            self._notify()

    async def _receive_messages(self, wait_each: float, most: int) -> list[dict[str, Any]]:
        taken: list[dict[str, Any]] = []
        try:
            if wait_each == 0:
                return taken
            while most != len(taken):
                wait = None if wait_each < 0 else wait_each
                try:
                    await asyncio.wait_for(
                        self._until(lambda: True if self.server_queue else None), wait
                    )
                except TimeoutError:
                    return taken
                with self._lock:
                    if not self.server_queue:
                        continue
                    envelope = self.server_queue.popleft()  # acknowledged to the server
                    self.handed.append(("receive", envelope))
                taken.append(envelope)
                self._notify()
            return taken
        finally:
            with self._lock:
                self._receiving = False
            self._notify()

    async def _events_endpoint(self, request: web.Request) -> web.StreamResponse:
        if not self._host_allowed(request):
            return web.Response(status=421)
        if request.method != "GET":
            return web.Response(status=405)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        with self._lock:
            self._events.append(queue)
        self._notify()
        try:
            while True:
                try:
                    envelope = await asyncio.wait_for(queue.get(), 15)
                except TimeoutError:
                    await response.write(b":\n")
                    continue
                data = json.dumps({"account": self.account, "envelope": envelope})
                await response.write(f"event:receive\ndata:{data}\n\n".encode())
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with self._lock:
                self._events.remove(queue)
            self._notify()
        return response

    # -- people, groups, messages ---------------------------------------------------------

    def person(self, name: str, number: str | None = None) -> Person:
        """Someone new on Signal."""
        n = next(self._numbers)
        found = Person(str(uuid.uuid4()), number or f"+1555{200 + n:07d}", name)
        with self._lock:
            self.people[found.uuid] = found
        return found

    def group(self, name: str, members: Iterable[Person]) -> Group:
        """A group of `members` and the bot."""
        group_id = base64.b64encode(uuid.uuid4().bytes + uuid.uuid4().bytes).decode()
        found = Group(group_id, name, tuple(members))
        with self._lock:
            self.groups[group_id] = found
        return found

    def now(self) -> int:
        """A fresh timestamp (ms): Signal ids a message by its sender and timestamp, so the
        fake never gives one out twice."""
        with self._lock:
            self._last_timestamp = max(self._last_timestamp + 1, int(time.time() * 1000))
            return self._last_timestamp

    def _arrive(self, envelope: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.server_queue.append(envelope)
        self._notify()
        return envelope

    def envelope(self, sender: Person, timestamp: int, **content: Any) -> dict[str, Any]:
        """An envelope from `sender` as signal-cli writes it (`JsonMessageEnvelope`)."""
        return {
            "source": sender.number,
            "sourceNumber": sender.number,
            "sourceUuid": sender.uuid,
            "sourceName": sender.name,
            "sourceDevice": 1,
            "timestamp": timestamp,
            "serverReceivedTimestamp": timestamp + 5,
            "serverDeliveredTimestamp": timestamp + 9,
            **content,
        }

    def data_message(
        self,
        text: str | None,
        timestamp: int,
        *,
        group: Group | None = None,
        mentions: Iterable[tuple[int, Person]] = (),
        quote: Mapping[str, Any] | None = None,
        attachments: Iterable[Mapping[str, Any]] = (),
        sticker: bool = False,
    ) -> dict[str, Any]:
        """A `dataMessage`; each mention is (its position in `text`, who), shown there as
        U+FFFC as Signal's apps send it."""
        body = text
        listed = []
        for position, who in sorted(mentions, key=lambda m: m[0], reverse=True):
            assert body is not None
            body = body[:position] + "\ufffc" + body[position:]
            listed.append((position, who))
        message: dict[str, Any] = {
            "timestamp": timestamp,
            "message": body,
            "expiresInSeconds": 0,
            "isExpirationUpdate": False,
            "viewOnce": False,
        }
        if listed:
            assert body is not None
            message["mentions"] = [
                {
                    "name": who.number,
                    "number": who.number,
                    "uuid": who.uuid,
                    "start": utf16_len(body[:position]),
                    "length": 1,
                }
                for position, who in sorted(listed)
            ]
        if quote is not None:
            message["quote"] = dict(quote)
        files = [dict(a) for a in attachments]
        if files:
            message["attachments"] = files
        if sticker:
            message["sticker"] = {"packId": "00" * 16, "stickerId": 1}
        if group is not None:
            message["groupInfo"] = {
                "groupId": group.id,
                "groupName": group.name,
                "revision": 1,
                "type": "DELIVER",
            }
        return message

    def dm(self, sender: Person, text: str, **extra: Any) -> dict[str, Any]:
        """`sender` writes `text` to the bot; the envelope waits at Signal's server."""
        timestamp = self.now()
        data = self.data_message(text, timestamp, **extra)
        return self._arrive(self.envelope(sender, timestamp, dataMessage=data))

    def group_message(
        self,
        group: Group,
        sender: Person,
        text: str,
        *,
        mention_bot: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """`sender` writes `text` in `group`, mentioning the bot first when `mention_bot`."""
        timestamp = self.now()
        mentions = list(extra.pop("mentions", ()))
        if mention_bot:
            text = " " + text
            mentions = [(0, self.me), *((p + 1, w) for p, w in mentions)]
        data = self.data_message(text, timestamp, group=group, mentions=mentions, **extra)
        return self._arrive(self.envelope(sender, timestamp, dataMessage=data))

    def edit(self, original: Mapping[str, Any], text: str) -> dict[str, Any]:
        """The author of `original` edits it: an `editMessage` naming its first timestamp
        (mentions of the bot kept where they were)."""
        first = original.get("editMessage", {}).get("targetSentTimestamp") or original["timestamp"]
        data = original.get("dataMessage") or original["editMessage"]["dataMessage"]
        timestamp = self.now()
        sender = self.people.get(str(original["sourceUuid"])) or Person(
            str(original["sourceUuid"]), str(original["sourceNumber"]), str(original["sourceName"])
        )
        group_id = (data.get("groupInfo") or {}).get("groupId")
        mentions = [(0, self.me)] if str(data.get("message") or "").startswith("\ufffc") else []
        body = " " + text if mentions else text
        new = self.data_message(
            body, timestamp, group=self.groups.get(group_id) if group_id else None,
            mentions=mentions,
        )  # fmt: skip
        edit = {"targetSentTimestamp": first, "dataMessage": new}
        return self._arrive(self.envelope(sender, timestamp, editMessage=edit))

    def again(self, envelope: Mapping[str, Any]) -> dict[str, Any]:
        """The same envelope once more at the server (what a sender's retry, or a second
        device's copy, looks like: the same sender and timestamp)."""
        return self._arrive(json.loads(json.dumps(envelope)))

    def typing_from(self, sender: Person) -> dict[str, Any]:
        started = {"action": "STARTED", "timestamp": self.now()}
        return self._arrive(self.envelope(sender, self.now(), typingMessage=started))

    def receipt_from(self, sender: Person, timestamps: list[int]) -> dict[str, Any]:
        receipt = {
            "when": self.now(),
            "isDelivery": True,
            "isRead": False,
            "isViewed": False,
            "timestamps": timestamps,
        }
        return self._arrive(self.envelope(sender, self.now(), receiptMessage=receipt))

    def add_attachment(
        self, data: bytes, content_type: str, filename: str | None
    ) -> dict[str, Any]:
        """A file signal-cli downloaded with a message (`getAttachment` serves it): its
        `JsonAttachment`."""
        attachment_id = f"{uuid.uuid4().hex[:20]}.bin"
        with self._lock:
            self.attachments[attachment_id] = (content_type, filename or "", data)
        return {
            "contentType": content_type,
            "filename": filename,
            "id": attachment_id,
            "size": len(data),
            "width": None,
            "height": None,
            "caption": None,
            "uploadTimestamp": self.now(),
        }

    def fail_next(self, method: str, failure: Scripted, times: int = 1) -> None:
        """The next `times` calls of `method` get `failure` instead of their answer."""
        with self._lock:
            self._scripted.setdefault(method, deque()).extend([failure] * times)

    def waiting(self) -> int:
        """How many envelopes wait at Signal's server."""
        with self._lock:
            return len(self.server_queue)

    def sent_to(self, conversation: str) -> list[Sent]:
        """The bot's messages to a person (uuid or number) or a group (id)."""
        with self._lock:
            return [s for s in self.sent if conversation in (s.group_id, *s.recipients)]

    # -- methods ------------------------------------------------------------------------------

    def _recipient(self, value: str) -> Person:
        value = str(value)
        for who in [*self.people.values(), self.me]:
            if value in (who.uuid, who.number, f"PNI:{who.uuid}"):
                return who
        raise RpcFailure(USER_ERROR, f"The user {value} is not registered.")

    def _targets(self, params: Mapping[str, Any]) -> tuple[list[Person], Group | None]:
        recipients = [self._recipient(r) for r in _as_list(params, "recipient") or []]
        group_ids = _as_list(params, "groupId") or []
        group = None
        for group_id in group_ids:
            group = self.groups.get(str(group_id))
            if group is None:
                raise RpcFailure(USER_ERROR, f"Group not found: {group_id}")
        if not recipients and group is None:
            raise RpcFailure(USER_ERROR, "No recipients given")
        return recipients, group

    def _results(self, recipients: list[Person], group: Group | None) -> dict[str, Any]:
        who = list(group.members) if group is not None else recipients
        results = [{"recipientAddress": p.address(), "type": "SUCCESS"} for p in who]
        if group is not None:
            for result in results:
                result["groupId"] = group.id
        return {"timestamp": self.now(), "results": results}

    def _send(self, params: dict[str, Any]) -> dict[str, Any]:
        recipients, group = self._targets(params)
        text = str(params.get("message") or "")
        attachments = [_attachment(a) for a in _as_list(params, "attachment") or []]
        quote_ts = params.get("quoteTimestamp")
        if not text and not attachments and quote_ts is None and not params.get("sticker"):
            raise RpcFailure(
                USER_ERROR,
                "Sending empty message is not allowed, either a message, attachment or "
                "sticker must be given.",
            )
        styles = []
        for raw in _as_list(params, "textStyle") or []:
            match = _STYLE.fullmatch(str(raw))
            if match is None:
                raise RpcFailure(
                    USER_ERROR, f"Invalid textStyle syntax ({raw}) expected 'start:length:STYLE'"
                )
            if match.group(3) not in STYLES:
                raise RpcFailure(USER_ERROR, f"Invalid style: {match.group(3)}")
            styles.append((int(match.group(1)), int(match.group(2)), match.group(3)))
        mentions = []
        for raw in _as_list(params, "mention") or []:
            match = _STYLE.fullmatch(str(raw))
            if match is None:
                raise RpcFailure(
                    USER_ERROR,
                    f"Invalid mention syntax ({raw}) expected 'start:length:recipientNumber'",
                )
            who = self._recipient(match.group(3))
            mentions.append((int(match.group(1)), int(match.group(2)), who.uuid))
        quote = None
        if quote_ts is not None:
            author = params.get("quoteAuthor")
            if author is None:
                raise RpcFailure(USER_ERROR, "Quote author parameter is missing")
            quote = (int(quote_ts), self._recipient(str(author)).uuid)
        answer = self._results(recipients, group)
        edit_of = params.get("editTimestamp")
        sent = Sent(
            timestamp=answer["timestamp"],
            recipients=tuple(p.uuid for p in recipients),
            group_id=group.id if group is not None else None,
            text=text,
            styles=tuple(styles),
            quote=quote,
            mentions=tuple(mentions),
            attachments=tuple(attachments),
            edit_of=int(edit_of) if edit_of is not None else None,
            long_text=len(text.encode()) > MAX_BODY_BYTES,
        )
        with self._lock:
            self.sent.append(sent)
        self._notify()
        return answer

    def _send_typing(self, params: dict[str, Any]) -> dict[str, Any]:
        recipients, group = self._targets(params)
        with self._lock:
            self.typing.append({**params, "at": time.time()})
        return self._results(recipients, group)

    def _send_receipt(self, params: dict[str, Any]) -> dict[str, Any]:
        recipient = params.get("recipient")
        if isinstance(recipient, list):
            recipient = recipient[0] if recipient else None
        if recipient is None:
            raise RpcFailure(USER_ERROR, "No recipients given")
        who = self._recipient(str(recipient))
        stamps = _as_list(params, "targetTimestamp")
        if not stamps:
            raise RpcFailure(USER_ERROR, "Missing target timestamp")
        kind = params.get("type") or "read"
        if kind not in ("read", "viewed"):
            raise RpcFailure(USER_ERROR, f"Unknown receipt type: {kind}")
        with self._lock:
            self.receipts.append({"recipient": who.uuid, "timestamps": stamps, "type": kind})
        return self._results([who], None)

    def _send_reaction(self, params: dict[str, Any]) -> dict[str, Any]:
        recipients, group = self._targets(params)
        if not params.get("emoji") or params.get("targetTimestamp") is None:
            raise RpcFailure(USER_ERROR, "emoji and targetTimestamp are required")
        author = params.get("targetAuthor")
        if author is None:
            if group is not None or len(recipients) != 1:
                raise RpcFailure(USER_ERROR, "targetAuthor is required")
            author = recipients[0].uuid
        with self._lock:
            self.reactions.append(
                {
                    "emoji": params["emoji"],
                    "author": self._recipient(str(author)).uuid,
                    "timestamp": int(params["targetTimestamp"]),
                    "remove": bool(params.get("remove")),
                    "group": group.id if group is not None else None,
                }
            )
        return self._results(recipients, group)

    def _get_attachment(self, params: dict[str, Any]) -> dict[str, Any]:
        attachment_id = str(params.get("id") or "")
        if not attachment_id:
            raise RpcFailure(USER_ERROR, "Missing attachment id parameter")
        found = self.attachments.get(attachment_id)
        if found is None:
            raise RpcFailure(USER_ERROR, f"Could not find attachment with ID: {attachment_id}")
        return {"data": base64.b64encode(found[2]).decode()}

    def _list_contacts(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        wanted = _as_list(params, "recipient")
        everyone = [self.me, *self.people.values()]
        found = [p for p in everyone if wanted is None or {p.uuid, p.number} & set(wanted)]
        return [
            {"number": p.number, "uuid": p.uuid, "username": None, "name": "",
             "profile": {"givenName": p.name}, "isBlocked": False}
            for p in found
        ]  # fmt: skip

    def _list_groups(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "id": g.id,
                "name": g.name,
                "isMember": True,
                "isBlocked": False,
                "members": [p.address() for p in (*g.members, self.me)],
            }
            for g in self.groups.values()
        ]

    def _version(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"version": VERSION}


#: Every method but `receive` (answered by `_receive_call`).
_METHODS = {
    "send": FakeSignalCli._send,
    "sendTyping": FakeSignalCli._send_typing,
    "sendReceipt": FakeSignalCli._send_receipt,
    "sendReaction": FakeSignalCli._send_reaction,
    "getAttachment": FakeSignalCli._get_attachment,
    "listContacts": FakeSignalCli._list_contacts,
    "listGroups": FakeSignalCli._list_groups,
    "version": FakeSignalCli._version,
}


def _attachment(value: Any) -> tuple[str, str, bytes]:
    """(content type, file name, bytes) of an attachment given as a data URI (RFC 2397,
    with signal-cli's `filename=` parameter)."""
    match = _DATA_URI.fullmatch(str(value))
    if match is None:
        raise RpcFailure(USER_ERROR, f"Invalid attachment: {str(value)[:60]}")
    name = ""
    for part in match.group(2).split(";"):
        key, _, found = part.partition("=")
        if key == "filename":
            name = found
    try:
        data = base64.b64decode(match.group(3), validate=True)
    except (binascii.Error, ValueError):
        raise RpcFailure(USER_ERROR, "Invalid attachment data") from None
    return match.group(1), name, data


def _error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "error": {"code": code, "message": message, "data": data},
        "id": request_id,
    }


def _err(failure: RpcFailure) -> dict[str, Any]:
    return {"code": failure.code, "message": failure.message, "data": failure.data}
