"""The Feishu / Lark channel: Feishu's long connection (a WebSocket the bot opens) or its
event callbacks (HTTP POSTs to the gateway's port) for messages in, the open platform's IM
API for replies out, all over the gateway's own aiohttp, inside the daemon's event loop.

Why not lark-oapi, Feishu's own SDK: its long-connection client cannot keep the delivery
promise as it is. `import lark_oapi` runs `asyncio.get_event_loop()` at import time (in
`lark_oapi/ws/client.py`), so inside the daemon it takes the daemon's running loop, and
`Client.start()` then drives that loop with `run_until_complete` forever, with no way to
stop it; its endpoint discovery is a blocking `requests` call made on that loop. It writes
its acknowledgement frame as soon as a synchronous handler returns (and a `500` one when
the handler raises), and its higher-level `FeishuChannel` hands each event to a loop of
its own and returns at once, so Feishu is told the event arrived while it is only in
memory. The protocol itself is small (one discovery POST, protobuf frames of nine fields,
a ping, an answer frame per event; `channels.feishu.frames`), so the channel speaks it
itself, answering an event only once the journal holds it. The REST calls are a dozen
(`channels.feishu.api`), and the channel needs to tell a request that never went out from
one that may have; aiohttp is already the gateway's.

Inbound: every event goes through `_take`: `translate_event` (session key
`feishu:<chat_id>`, `feishu:<chat_id>:thread:<thread_id>` in a thread; message id the
message's `om_...` id; group metadata for the access policy) and `submit`.

Promises (tested in tests/test_feishu.py and the conformance kit, tests/conformance):
- Journal before confirm. Long connection: an event's answer frame (`{"code": 200}`) is
  written only once `submit` returned a taken ticket; an event that was not taken (the
  journal failed, the gateway drains) gets no answer, and Feishu pushes it again (its
  timeout re-push: about 15 s, 5 minutes, 1 hour and 6 hours later). Webhook: the `200`
  is sent only then; otherwise `503`, which Feishu retries on the same schedule.
- A message is answered once however often Feishu pushes it: its id is the message's, the
  same in every push, and the dispatcher's journal drops a message id it has (across
  restarts and replicas). An event id this process already journaled is answered at once.
- Webhook mode refuses (401) a request whose `X-Lark-Signature` is missing or wrong, an
  unencrypted body, or a Verification Token that is not the app's, before it reads the
  event; `url_verification` is answered with its challenge.
- A reply part is posted at most once: each request carries a `uuid` made of the message
  it answers, its place in the reply and its text, and Feishu keeps one message per uuid
  for an hour. So a request that got no answer, a 5xx or a rate limit (HTTP 429, codes
  99991400 and 230020, waited out as Feishu says) is repeated within `Pacing.retry_window`;
  past it `send` raises `DeliveryFailed`, the dispatcher sends the reply again later, and
  it goes on from the part that failed.
- Nothing the model writes can notify anyone: every `<at` is defused
  (`channels.feishu.format`). In a group a reply quotes the message it answers; in a
  thread it stays in the thread.
- Replies are rich text (`post` with one `md` element), in parts of `part_chars`; a part
  Feishu refuses as invalid content goes again as plain text. With `streaming`, the first
  part is sent early and edited as the text grows (Feishu allows 20 edits per message).
- Images and files people send become attachments (fetched with the app's token when the
  turn starts); a reply's files are uploaded and sent after its text, each at most once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.feishu import crypto
from channels.feishu.api import (
    BOT_NOT_IN_CHAT,
    INVALID_CONTENT,
    MESSAGE_GONE,
    FeishuApi,
    FeishuError,
    NoAnswer,
    Unreachable,
    certainly_not_sent,
)
from channels.feishu.format import feishu_parts, post_content, text_content
from channels.feishu.frames import CONTROL, DATA, Frame, FrameError
from channels.feishu.settings import FeishuSettings
from channels.feishu.translate import (
    CHANNEL,
    META_CHAT_TYPE,
    Skip,
    event_id,
    event_token,
    parse_attachment_id,
    translate_event,
)
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.messages import (
    META_IS_GROUP,
    META_REPLY_CONTEXT,
    META_SENDER_NAME,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from gateway.registry import Mount

#: Where Feishu posts its events on the gateway's HTTP port (webhook mode).
FEISHU_EVENTS_PATH = "/feishu/events"
#: The largest callback body read (Feishu's events stay far below it).
WEBHOOK_MAX_BYTES = 1024 * 1024
#: Feishu's limits for what a bot uploads.
IMAGE_LIMIT = 10 * 1024 * 1024
FILE_LIMIT = 30 * 1024 * 1024
#: Feishu allows 20 edits of a message; streaming leaves one for the final text.
EDIT_LIMIT = 20
_REMEMBERED = 10_000

_T = TypeVar("_T")


class FeishuSetupError(Exception):
    """The app's credentials were refused, or Feishu cannot be reached; says what to fix
    and never holds the App Secret."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to Feishu (seconds)."""

    # Per request, how long failures that are safe to repeat are repeated (under the
    # dispatcher's cap on one delivery, 120 s).
    retry_window: float = 50.0
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    # Feishu allows a bot 5 messages a second per chat: one request per this, per chat.
    chat_interval: float = 0.22
    stream_interval: float = 1.5  # at most one streaming edit per this
    turn_limit: float = 600.0  # a stream older than this is forgotten
    reconnect_min: float = 1.0  # the long connection's first reconnect delay
    reconnect_max: float = 30.0
    ping_interval: float = 120.0  # until Feishu's ClientConfig says otherwise
    stop_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class Target:
    """Where a reply goes: a chat, the message it answers (None: a new message), whether
    the reply stays in that message's thread, and whether the chat is a group."""

    chat_id: str
    reply_to: str | None
    in_thread: bool
    is_group: bool


def target_of(message: OutboundMessage) -> Target:
    """A reply's place: in a thread, a reply in the thread; in a group, a reply quoting
    the message it answers; in a direct chat (or without a message), a new message."""
    context = message.metadata.get(META_REPLY_CONTEXT)
    chat_type = context.get("chat_type") if isinstance(context, Mapping) else None
    is_group = chat_type is not None and chat_type != "p2p"
    reply_to = message.reply_to if message.reply_to and message.reply_to.startswith("om_") else None
    if message.thread_id and reply_to:
        return Target(message.chat_id, reply_to, True, is_group)
    if is_group and reply_to:
        return Target(message.chat_id, reply_to, False, True)
    return Target(message.chat_id, None, False, is_group)


def request_uuid(*parts: object) -> str:
    """A send's `uuid`: the same for the same reply part (Feishu keeps one message per
    uuid for an hour), at most 50 characters."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()
    return digest[:40]


def file_type_of(file: OutboundFile) -> str:
    """The `file_type` Feishu's file upload wants."""
    name = file.name.lower()
    for suffix, kind in ((".pdf", "pdf"), (".mp4", "mp4"), (".opus", "opus")):
        if name.endswith(suffix):
            return kind
    for suffixes, kind in (
        ((".doc", ".docx"), "doc"),
        ((".xls", ".xlsx"), "xls"),
        ((".ppt", ".pptx"), "ppt"),
    ):
        if name.endswith(suffixes):
            return kind
    return "stream"


@dataclass
class Stats:
    """Counts for /metrics (`channels.feishu.spec`)."""

    repushes: int = 0
    rate_limited: int = 0
    bad_signatures: int = 0


@dataclass
class _Stream:
    """A reply shown while it is written: one message, edited as text arrives."""

    reply_to: str | None
    target: Target
    next_edit: float
    text: str = ""
    shown: str = ""
    message_id: str | None = None
    edits: int = 0
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


class FeishuChannel:
    """The Feishu / Lark adapter; see the module docstring for what it promises."""

    name = CHANNEL

    def __init__(
        self, settings: FeishuSettings, *, app_secret: str, pacing: Pacing | None = None
    ) -> None:
        if not settings.app_id or not app_secret:
            raise ConfigError(
                "channels.feishu: set channels.feishu.app_id and GATEWAY_CHANNELS__FEISHU__"
                "APP_SECRET (the app's Credentials & Basic Info page)"
            )
        self._encrypt_key = crypto_secret(settings.encrypt_key)
        self._verification_token = crypto_secret(settings.verification_token)
        if settings.mode == "webhook" and not (self._encrypt_key and self._verification_token):
            raise ConfigError(
                "channels.feishu: webhook mode needs GATEWAY_CHANNELS__FEISHU__ENCRYPT_KEY "
                "and GATEWAY_CHANNELS__FEISHU__VERIFICATION_TOKEN (Events & Callbacks > "
                'Encryption Strategy), so every event is signed; or use mode = "websocket"'
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.stats = Stats()
        self._secret = app_secret
        self._api: FeishuApi | None = None
        self._submit: Submit | None = None
        self._paused = False
        self._tg: anyio.abc.TaskGroup | None = None
        self.bot_open_id = ""
        self.bot_name = ""
        #: Events this process journaled (a re-push of one is answered at once).
        self._taken: OrderedDict[str, None] = OrderedDict()
        #: Messages the bot sent (a reply to one addresses the bot).
        self._sent_ids: OrderedDict[str, None] = OrderedDict()
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED)
        self._names: OrderedDict[str, str] = OrderedDict()
        self._chat_next: dict[str, float] = {}
        self._streams: dict[str, _Stream] = {}
        self._parts: dict[str, tuple[int, list[bytes]]] = {}
        self._ping_interval = self.pacing.ping_interval
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self.live = anyio.Event()  # set once events flow (for tests and probes)

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> bool:
        """Webhook mode: route `POST /feishu/events` to this channel (before the server
        runs). The long connection mounts nothing. Returns whether it mounted."""
        if self.settings.mode != "webhook":
            return False
        http.mount("POST", FEISHU_EVENTS_PATH, self._webhook)
        return True

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Receive events until cancelled. Raises FeishuSetupError when the credentials
        are refused or the bot cannot be found (the daemon restarts the channel)."""
        self._paused = False
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._api = FeishuApi(
                self.settings.base_url(), self.settings.app_id, self._secret, session
            )
            try:
                await self._identify()
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    if self.settings.mode == "webhook":
                        self._submit = submit  # the webhook takes events from now on
                        self._went_live("webhook")
                        task_status.started()
                        await anyio.sleep_forever()
                    else:
                        await self._long_connection(submit, task_status)
            finally:
                self._tg = None
                self._submit = None
                self._api = None
                self.live = anyio.Event()

    def pause_intake(self) -> None:
        """Take no more events (the daemon is draining): they are left unanswered, and
        Feishu pushes them again to the next start. Replies still go out."""
        self._paused = True

    async def _identify(self) -> None:
        api = self._require_api()
        try:
            bot = await api.bot_info()
        except FeishuError as exc:
            raise FeishuSetupError(
                f"feishu: {api.base_url} refused the app's credentials or has no bot for it "
                f"({exc}); check channels.feishu.app_id, GATEWAY_CHANNELS__FEISHU__APP_SECRET "
                "and that the app's Bot feature is on"
            ) from None
        except (Unreachable, NoAnswer) as exc:
            raise FeishuSetupError(f"feishu: cannot reach {api.base_url} ({exc})") from None
        self.bot_open_id = str(bot.get("open_id") or "")
        self.bot_name = str(bot.get("app_name") or "")
        if not self.bot_open_id:
            raise FeishuSetupError(
                "feishu: the app has no bot (turn on the Bot feature under Features)"
            )

    def _went_live(self, how: str) -> None:
        logger.info("feishu: {} ({}) is live ({})", self.bot_name, self.bot_open_id, how)
        self.live.set()

    # ----------------------------------------------------------------- long connection

    async def _long_connection(
        self, submit: Submit, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Hold the long connection, reconnecting with backoff when it drops. Every
        replica may hold one: Feishu pushes each event to one connection of the app."""
        api = self._require_api()
        started = False
        delay = self.pacing.reconnect_min
        while True:
            try:
                url, config = await api.ws_endpoint()
            except FeishuError as exc:
                if not started and not exc.server_side:
                    raise FeishuSetupError(
                        f"feishu: the long connection was refused ({exc}); check the app's "
                        "credentials, that it is a self-built app, and under Events & "
                        'Callbacks that events are received "using long connection"'
                    ) from None
                logger.warning("feishu: no long connection endpoint ({}); retrying", exc)
                url = ""
            except (Unreachable, NoAnswer) as exc:
                logger.warning("feishu: no long connection endpoint ({}); retrying", exc)
                url = ""
            if url:
                self._configure(config)
                try:
                    async with api.session.ws_connect(
                        url, autoping=True, heartbeat=None, max_msg_size=16 * 1024 * 1024
                    ) as socket:
                        self._socket = socket
                        self._submit = submit
                        delay = self.pacing.reconnect_min
                        if not started:
                            self._went_live("long connection")
                            task_status.started()
                            started = True
                        await self._serve_socket(socket, _service_id(url))
                    logger.warning("feishu: the long connection closed; reconnecting")
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    logger.warning("feishu: the long connection failed ({!r}); reconnecting", exc)
                finally:
                    self._socket = None
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.pacing.reconnect_max)

    def _configure(self, config: Mapping[str, Any]) -> None:
        interval = config.get("PingInterval")
        if isinstance(interval, int | float) and interval > 0:
            self._ping_interval = float(interval)

    async def _serve_socket(self, socket: aiohttp.ClientWebSocketResponse, service: int) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ping, socket, service)
            async for message in socket:
                if message.type == aiohttp.WSMsgType.BINARY:
                    try:
                        frame = Frame.decode(message.data)
                    except FrameError as exc:
                        logger.warning("feishu: an unreadable frame skipped ({})", exc)
                        continue
                    await self._on_frame(socket, frame)
                elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR):
                    break
            tg.cancel_scope.cancel()

    async def _ping(self, socket: aiohttp.ClientWebSocketResponse, service: int) -> None:
        ping = Frame(service=service, method=CONTROL, headers=(("type", "ping"),))
        while not socket.closed:
            try:
                await socket.send_bytes(ping.encode())
            except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
                logger.debug("feishu: ping failed ({})", exc)
                return
            await anyio.sleep(self._ping_interval)

    async def _on_frame(self, socket: aiohttp.ClientWebSocketResponse, frame: Frame) -> None:
        kind = frame.header("type")
        if frame.method == CONTROL:
            if kind == "pong" and frame.payload:
                try:
                    config = json.loads(frame.payload)
                except ValueError:
                    return
                if isinstance(config, Mapping):
                    self._configure(config)
            return
        if frame.method != DATA:
            return
        payload = self._whole_payload(frame)
        if payload is None:
            return  # more parts to come
        started = time.monotonic()
        if kind == "event":
            try:
                envelope = json.loads(payload)
            except ValueError:
                envelope = None
            if not isinstance(envelope, Mapping):
                logger.warning("feishu: an event that is no JSON object; confirmed and skipped")
            elif not await self._take(envelope):
                return  # not answered: Feishu pushes it again
        answer = frame.with_header("biz_rt", str(int((time.monotonic() - started) * 1000)))
        body = json.dumps({"code": 200, "headers": None, "data": None}).encode()
        answer = Frame(
            seq_id=answer.seq_id,
            log_id=answer.log_id,
            service=answer.service,
            method=answer.method,
            headers=answer.headers,
            payload_encoding=answer.payload_encoding,
            payload_type=answer.payload_type,
            payload=body,
            log_id_new=answer.log_id_new,
        )
        try:
            await socket.send_bytes(answer.encode())
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            logger.warning("feishu: an event's answer was not sent ({}); it comes again", exc)

    def _whole_payload(self, frame: Frame) -> bytes | None:
        """A data frame's payload, once all `sum` parts of it arrived."""
        try:
            total, seq = int(frame.header("sum", "1")), int(frame.header("seq", "0"))
        except ValueError:
            return frame.payload
        if total <= 1:
            return frame.payload
        key = frame.header("message_id")
        count, parts = self._parts.get(key, (total, [b""] * total))
        if 0 <= seq < count:
            parts[seq] = frame.payload
        if any(not part for part in parts):
            self._parts[key] = (count, parts)
            while len(self._parts) > 100:
                self._parts.pop(next(iter(self._parts)))
            return None
        self._parts.pop(key, None)
        return b"".join(parts)

    # ----------------------------------------------------------------- webhook

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One event from Feishu: 401 unless signed, encrypted and carrying the app's
        Verification Token; 200 only once it is journaled (or settled); 503 otherwise,
        and Feishu pushes it again."""
        body = await request.content.read(WEBHOOK_MAX_BYTES + 1)
        if len(body) > WEBHOOK_MAX_BYTES:
            return json_error(413, "the body is larger than an event can be")
        key, token = self._encrypt_key, self._verification_token
        signed = request.headers.get(crypto.SIGNATURE_HEADER)
        if signed is not None and not crypto.signature_valid(
            request.headers.get(crypto.TIMESTAMP_HEADER, ""),
            request.headers.get(crypto.NONCE_HEADER, ""),
            signed,
            key,
            body,
        ):
            return self._refuse("a wrong X-Lark-Signature")
        try:
            outer = json.loads(body)
            encrypted = outer.get("encrypt") if isinstance(outer, dict) else None
            if not isinstance(encrypted, str):
                return self._refuse("an unencrypted body (the app's Encrypt Key encrypts all)")
            envelope = json.loads(crypto.decrypt(encrypted, key))
        except (ValueError, crypto.NotDecryptable):
            return self._refuse("a body the Encrypt Key does not open")
        if not isinstance(envelope, dict):
            return json_error(400, "the body is no Feishu event")
        if not _same(event_token(envelope), token):
            return self._refuse("a wrong Verification Token")
        if envelope.get("type") == "url_verification":
            return web.json_response({"challenge": envelope.get("challenge")})
        if signed is None:
            return self._refuse("no X-Lark-Signature")
        if self._submit is None or self._paused:
            return json_error(503, "the Feishu channel is not taking events", {"Retry-After": "5"})
        if not await self._take(envelope):
            return json_error(
                503, "the gateway could not keep the event; send it again", {"Retry-After": "5"}
            )
        return web.json_response({"msg": "success"})

    def _refuse(self, why: str) -> web.Response:
        self.stats.bad_signatures += 1
        logger.warning("feishu: an event refused: {}", why)
        return json_error(401, f"refused: {why}")

    # ----------------------------------------------------------------- inbound

    async def _take(self, envelope: Mapping[str, Any]) -> bool:
        """Translate and submit one event. True when Feishu may forget it: it is in the
        journal, or settled (skipped, a re-push of one already journaled here)."""
        if self._submit is None or self._paused:
            return False
        eid = event_id(envelope)
        if eid and eid in self._taken:
            self.stats.repushes += 1
            logger.debug("feishu: event {} pushed again; confirmed", eid)
            return True
        result = translate_event(
            envelope, bot_open_id=self.bot_open_id, sent_by_bot=self._sent_ids.__contains__
        )
        if isinstance(result, Skip):
            logger.debug("feishu: event {} skipped: {}", eid, result.reason)
            return True
        context = {"chat_type": result.metadata.get(META_CHAT_TYPE, "")}
        result.metadata[META_REPLY_CONTEXT] = context
        ticket = await self._submit(result)
        if not ticket.taken:
            return False
        if eid:
            _remember(self._taken, eid)
        return True

    async def enrich_for_turn(self, message: InboundMessage) -> InboundMessage:
        """A group message's sender name, looked up when its turn starts (never before
        Feishu is answered); the open_id stays when the lookup is not allowed."""
        if not (self.settings.read_sender_names and message.metadata.get(META_IS_GROUP)):
            return message
        name = await self._name_of(message.sender_id)
        if not name:
            return message
        return replace(message, metadata={**message.metadata, META_SENDER_NAME: name})

    async def _name_of(self, open_id: str) -> str:
        if not open_id or self._api is None:
            return ""
        if open_id in self._names:
            return self._names[open_id]
        try:
            name = await self._api.user_name(open_id)
        except (FeishuError, Unreachable, NoAnswer) as exc:
            logger.debug("feishu: no name for {} ({})", open_id, exc)
            name = ""
        self._names[open_id] = name
        while len(self._names) > _REMEMBERED:
            self._names.popitem(last=False)
        return name

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: the message's resource, with the app's token."""
        api = self._require_api()
        try:
            message_id, kind, key = parse_attachment_id(attachment.file_id)
        except ValueError:
            raise MediaError("the file's reference is not Feishu's") from None
        try:
            return await api.download(
                f"/im/v1/messages/{message_id}/resources/{key}", {"type": kind}, max_bytes
            )
        except ValueError:
            raise MediaError(f"it is larger than {max_bytes / 2**20:.0f} MB") from None
        except (FeishuError, Unreachable, NoAnswer) as exc:
            logger.warning("feishu: a file was not downloaded: {}", exc)
            raise MediaError("Feishu did not hand over the file; please send it again") from None

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: rich text in parts of `part_chars`, in order, then its files.
        Raises DeliveryFailed when a part did not go out and may later (a reply sent
        again goes on from that part); any other error when it never will. No part after
        a failed one is sent (it would read out of context)."""
        target = target_of(message)
        parts = feishu_parts(message.text, self.settings.part_chars)
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not parts and not message.files:
                logger.warning("feishu: empty reply not sent")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            first = 0
            try:
                if (
                    parts
                    and stream is not None
                    and stream.message_id is not None
                    and done == 0
                    and await self._edit(stream.message_id, parts[0])
                ):
                    first = done = 1
                for index in range(max(first, done), len(parts)):
                    uuid = request_uuid(message.session_key, message.reply_to, index, parts[index])
                    await self._post(target, parts[index], uuid, quote=index == 0)
                    done = index + 1
                for number, file in enumerate(message.files, start=len(parts)):
                    if number < done:
                        continue
                    await self._send_file(target, file, message, number)
                    done = number + 1
            except (Unreachable, NoAnswer, FeishuError, FeishuSetupError) as exc:
                # A request without an answer is sent again with the same uuid, which
                # Feishu keeps once: as safe to repeat as one that never went out.
                repeatable = isinstance(exc, FeishuSetupError | NoAnswer) or certainly_not_sent(exc)
                if not repeatable:
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"feishu: {exc}", sent=done) from exc

    async def _post(self, target: Target, text: str, uuid: str, *, quote: bool) -> str:
        """One part as rich text (as plain text when Feishu refuses the rich text)."""
        try:
            return await self._deliver(target, "post", post_content(text), uuid, quote=quote)
        except FeishuError as exc:
            if exc.code != INVALID_CONTENT:
                raise
            logger.warning("feishu refused the rich text ({}); sending plain text", exc)
        return await self._deliver(target, "text", text_content(text), uuid + "t", quote=quote)

    async def _deliver(
        self, target: Target, msg_type: str, content: str, uuid: str, *, quote: bool
    ) -> str:
        """Create the message (a reply when the target says so), repeating what is safe
        to repeat; its message id."""
        api = self._require_api()
        if target.reply_to and (quote or target.in_thread):
            reply_to = target.reply_to
            try:
                sent = await self._call(
                    target.chat_id,
                    lambda: api.reply_message(
                        reply_to, msg_type, content, uuid, in_thread=target.in_thread
                    ),
                )
            except FeishuError as exc:
                if exc.code not in MESSAGE_GONE:
                    raise
                logger.info("feishu: the message answered is gone; sending to the chat")
                sent = await self._call(
                    target.chat_id,
                    lambda: api.create_message(target.chat_id, msg_type, content, uuid),
                )
        else:
            sent = await self._call(
                target.chat_id, lambda: api.create_message(target.chat_id, msg_type, content, uuid)
            )
        message_id = str(sent.get("message_id") or "")
        if message_id:
            _remember(self._sent_ids, message_id)
        return message_id

    async def _send_file(
        self, target: Target, file: OutboundFile, message: OutboundMessage, number: int
    ) -> None:
        """One file of a reply, uploaded (repeatable: a key no message names is never
        shown) and sent as an image or a file message, at most once."""
        api = self._require_api()
        digest = hashlib.blake2b(file.data, digest_size=8).hexdigest()
        uuid = request_uuid(message.session_key, message.reply_to, number, digest)
        if file.is_image and len(file.data) <= IMAGE_LIMIT:
            key = await self._call(
                target.chat_id, lambda: api.upload_image(file.name, file.data, file.mime_type)
            )
            content = json.dumps({"image_key": key})
            await self._deliver(target, "image", content, uuid, quote=False)
        elif len(file.data) <= FILE_LIMIT:
            kind = file_type_of(file)
            key = await self._call(
                target.chat_id, lambda: api.upload_file(file.name, file.data, kind)
            )
            content = json.dumps({"file_key": key})
            await self._deliver(target, "file", content, uuid, quote=False)
        else:
            logger.warning("feishu: {} is larger than Feishu's 30 MB; not sent", file.name)
            return
        if file.caption:
            for index, part in enumerate(feishu_parts(file.caption, self.settings.part_chars)):
                await self._post(target, part, uuid + f"c{index}", quote=False)

    async def _edit(self, message_id: str, text: str) -> bool:
        """Replace a streamed message's text; False when it cannot be edited any more
        (the caller sends the part as a new message instead)."""
        api = self._require_api()
        try:
            content = post_content(text)
            await self._call(message_id, lambda: api.edit_message(message_id, "post", content))
            return True
        except FeishuError as exc:
            if exc.rate_limited or exc.server_side:
                raise
            logger.warning("feishu: streamed message {} not edited: {}", message_id, exc)
            return False

    async def _call(self, chat: str, request: Callable[[], Awaitable[_T]]) -> _T:
        """Make one request, paced per chat (Feishu allows 5 a second), repeating it while
        it is safe and within `Pacing.retry_window`: no connection, no answer (every send
        carries its uuid), a 5xx, a rate limit (waited out)."""
        started = time.monotonic()
        attempt = 0
        while True:
            await self._pace(chat)
            try:
                return await request()
            except (Unreachable, NoAnswer, FeishuError) as exc:
                if isinstance(exc, FeishuError) and exc.code in BOT_NOT_IN_CHAT:
                    logger.error("feishu: the bot is not in chat {} (or may not post there)", chat)
                if not (isinstance(exc, NoAnswer) or certainly_not_sent(exc)):
                    raise
                attempt += 1
                if isinstance(exc, FeishuError) and exc.rate_limited:
                    self.stats.rate_limited += 1
                    wait = exc.retry_after or 1.0
                    self._chat_next[chat] = time.monotonic() + wait
                else:
                    wait = min(
                        self.pacing.retry_backoff * 2 ** (attempt - 1),
                        self.pacing.retry_backoff_max,
                    )
                if time.monotonic() - started + wait > self.pacing.retry_window:
                    raise
                logger.warning(
                    "feishu: a request to {} failed ({}); again in {:g}s", chat, exc, wait
                )
                await anyio.sleep(wait)

    async def _pace(self, chat: str) -> None:
        now = time.monotonic()
        due = max(now, self._chat_next.get(chat, 0.0))
        self._chat_next[chat] = due + self.pacing.chat_interval
        if len(self._chat_next) > _REMEMBERED:
            self._chat_next = {k: v for k, v in self._chat_next.items() if v > now}
        if due > now:
            await anyio.sleep(due - now)

    def _require_api(self) -> FeishuApi:
        api = self._api
        if api is None:
            raise FeishuSetupError("feishu: the channel is not running; reply not sent")
        return api

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` becomes a message, edited at most once per interval
        (and at most `EDIT_LIMIT` - 1 times); `send` with the whole reply then edits it a
        last time. Does nothing unless `channels.feishu.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            for old, value in list(self._streams.items()):
                if now - value.started > self.pacing.turn_limit:
                    del self._streams[old]
            context = inbound.metadata.get(META_CHAT_TYPE)
            outbound = OutboundMessage(
                channel=CHANNEL,
                chat_id=inbound.chat_id,
                text="",
                session_key=key,
                reply_to=inbound.message_id,
                thread_id=inbound.thread_id,
                metadata={META_REPLY_CONTEXT: {"chat_type": context or ""}},
            )
            due = now + self.pacing.stream_interval
            stream = _Stream(inbound.message_id, target_of(outbound), due)
            stream.idle.set()
            self._streams[key] = stream
        stream.text += delta
        if stream.flushing or now < stream.next_edit or self._tg is None:
            return
        stream.flushing = True
        stream.idle = anyio.Event()
        self._tg.start_soon(self._flush_stream, stream)

    async def _flush_stream(self, stream: _Stream) -> None:
        """One streaming update: best effort (the final `send` corrects what is shown)."""
        try:
            parts = feishu_parts(stream.text, self.settings.part_chars)
            if stream.closed or not parts or parts[0] == stream.shown:
                return
            if stream.message_id is None:
                uuid = request_uuid("stream", stream.target.chat_id, stream.reply_to)
                stream.message_id = await self._deliver(
                    stream.target, "post", post_content(parts[0]), uuid, quote=True
                )
            elif stream.edits < EDIT_LIMIT - 2:
                api = self._require_api()
                message_id = stream.message_id
                await api.edit_message(message_id, "post", post_content(parts[0]))
                stream.edits += 1
            stream.shown = parts[0]
        except (FeishuError, Unreachable, NoAnswer, FeishuSetupError) as exc:
            logger.debug("feishu: streaming update skipped: {}", exc)
        finally:
            stream.next_edit = time.monotonic() + self.pacing.stream_interval
            stream.flushing = False
            stream.idle.set()

    async def _finish_stream(self, message: OutboundMessage) -> _Stream | None:
        stream = self._streams.get(message.session_key)
        if stream is None or stream.reply_to != message.reply_to:
            return None
        del self._streams[message.session_key]
        stream.closed = True
        with anyio.move_on_after(self.pacing.stop_timeout):
            await stream.idle.wait()
        return stream


# --------------------------------------------------------------------------- helpers


def crypto_secret(value: Any) -> str:
    return value.get_secret_value() if value is not None else ""


def _same(given: str, wanted: str) -> bool:
    return bool(wanted) and hmac.compare_digest(given.encode(), wanted.encode())


def _service_id(url: str) -> int:
    found = parse_qs(urlparse(url).query).get("service_id", ["0"])[0]
    return int(found) if found.lstrip("-").isdigit() else 0


def _remember(seen: OrderedDict[str, None], key: str) -> None:
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > _REMEMBERED:
        seen.popitem(last=False)


# --------------------------------------------------------------------------- doctor


async def check_credentials(settings: FeishuSettings, app_secret: str) -> str:
    """`gateway doctor`: fetch a tenant token and the bot's identity. Returns "<name>
    (<open_id>) on <domain>"; raises FeishuSetupError saying what to fix."""
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        api = FeishuApi(settings.base_url(), settings.app_id, app_secret, session)
        try:
            bot = await api.bot_info()
        except FeishuError as exc:
            raise FeishuSetupError(
                f"{api.base_url} refused the app ({exc}); check channels.feishu.app_id, the "
                "App Secret and that the Bot feature is on"
            ) from None
        except (Unreachable, NoAnswer) as exc:
            raise FeishuSetupError(f"cannot reach {api.base_url} ({exc})") from None
    if not bot.get("open_id"):
        raise FeishuSetupError("the app has no bot: turn on the Bot feature under Features")
    return f"{bot.get('app_name') or 'the bot'} ({bot['open_id']}) on {api.base_url}"
