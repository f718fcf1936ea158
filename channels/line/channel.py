"""The LINE channel: a LINE Official Account through the Messaging API, its webhook in on
the gateway's own HTTP port and the API out over aiohttp (`channels.line.api`).

Why no client library: line-bot-sdk v3's async client is generated from LINE's OpenAPI
files and would run on the daemon's loop well enough, but it brings six libraries for
the five calls the channel makes (reply, push, the loading animation, a file's content,
the bot's and a sender's profile), and its errors do not tell a request that never left
from one that may have gone out, which is what decides whether a reply may be sent again
(`LineError.kind`). Checking a webhook's signature is four lines (`signature_ok`).

Inbound: LINE POSTs every event to `POST /line/webhook` (`LINE_WEBHOOK_PATH`);
`channels.line.translate` turns a request into messages (session keys `line:<userId>`,
`line:group:<groupId>`, `line:room:<roomId>`), notices and skips.

Outbound: `send` converts the reply's Markdown to plain text (`channels.line.format`),
splits it into text messages of 5,000 characters and sends them, up to five per
request: with the message's reply token while it is fresh (free), else pushed (counted
against the monthly message quota, and to every member of a group).

Promises (tested in tests/test_line*.py and by the conformance kit, tests/conformance):
- Every POST is checked against `X-Line-Signature` (base64 of the HMAC-SHA256 of the raw
  body with the channel secret, compared in constant time) before anything else is done
  with it: a missing or wrong signature is a 401 and nothing is read from the body.
- Journal before the 200: the webhook answers 200 only once every message of the
  request is in the journal (or settled: a duplicate, a refusal, a notice); otherwise
  503, and LINE delivers the events again when webhook redelivery is on. Events are
  submitted in the request's order; a redelivered event keeps its message id, which
  the dispatcher's journal answers once, across restarts and replicas.
- A reply token is used at most once, and only within `reply_token_seconds` of the
  webhook (LINE guarantees a minute). A reply whose token is too old, used, or refused
  as "Invalid reply token" is pushed instead, with an `X-Line-Retry-Key` made from the
  reply (its session, the message it answers, its text and which request of it this
  is): LINE executes a push once per key, so sending the same reply again after a
  failure or a crash never shows it twice; a resend after a crash of a reply that went
  out with its reply token is the one extra reply the promise allows.
- A request is repeated only when that cannot show a message twice: a push always
  (its retry key), a reply only when it certainly did not go out (LINE answered 429,
  which it never processes, or no connection was made). A reply still failing so when
  its time runs out raises `DeliveryFailed`: the dispatcher sends it again later and it
  goes on from the first message that did not go out.
- By name: "Invalid reply token" is pushed instead; a 429 rate limit is waited out and
  repeated; "You have reached your monthly limit." (the push quota) is repeated while
  the reply's time lasts (LINE reserves quota for a delivery in progress), then given up
  and logged, counted and listed on the admin page (since start); any other 4xx is given
  up and logged. What a person sees in each case is in docs/line.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.line.api import Answer, LineApi, LineError
from channels.line.format import MESSAGES_PER_REQUEST, line_messages
from channels.line.settings import LineSettings
from channels.line.translate import (
    CHANNEL,
    GROUP,
    ROOM,
    Inbound,
    Item,
    Notice,
    ReplyContext,
    is_group_chat,
    push_target,
    translate_request,
)
from channels.notices import NoticeCooldown
from channels.typing_indicators import TypingIndicators
from gateway import failpoints
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import META_SENDER_NAME, Attachment, InboundMessage, OutboundMessage
from gateway.registry import Mount

#: Where LINE posts its events on the gateway's HTTP port.
LINE_WEBHOOK_PATH = "/line/webhook"
SIGNATURE_HEADER = "X-Line-Signature"
ENV_PREFIX = "GATEWAY_CHANNELS__LINE__"
#: The largest webhook body read (LINE's requests stay far below it).
WEBHOOK_MAX_BYTES = 1024 * 1024
#: Retry keys of replies: a reply's keys are the same in every process (uuid5).
RETRY_KEY_NAMESPACE = uuid.UUID("5b0a6c0e-7a4e-4c38-9f63-3d1b3c0f6a11")
#: How much the channel remembers: spent reply tokens, the bot's sent message ids, ...
_REMEMBERED = 10_000
#: Replies given up for the push quota, listed on the admin page (since start).
_QUOTA_LISTED = 100
#: Why a reply was not sent, for metrics.
REFUSAL_REASONS = ("monthly_limit", "refused", "push_disabled")


class LineSetupError(Exception):
    """The Messaging API refused the token or cannot be reached; says what to fix and
    never holds the token."""


class LineRefused(Exception):
    """A reply that LINE refused, or that the channel may not send: it did not go out,
    and sending it again as it is cannot help."""


def signature_ok(channel_secret: str, body: bytes, header: str) -> bool:
    """Is `header` the base64 HMAC-SHA256 of `body` with `channel_secret`? Compared in
    constant time."""
    digest = hmac.new(channel_secret.encode(), body, hashlib.sha256).digest()
    expected = base64.b64encode(digest)
    return hmac.compare_digest(header.strip().encode("utf-8", "replace"), expected)


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to LINE (seconds). Nothing waits past
    `reply_deadline` after `send` began (under the dispatcher's 60 s cap on a delivery)."""

    reply_deadline: float = 50.0
    backoff: float = 0.5  # doubled per attempt
    max_backoff: float = 8.0
    loading_grace: float = 0.5  # no loading animation for replies faster than this
    loading_seconds: int = 20  # how long one call shows it (5-60, a multiple of 5)
    loading_refresh: float = 15.0
    loading_limit: float = 120.0
    notice_cooldown: float = 60.0  # per chat, for "cannot open" notices
    name_ttl: float = 3600.0  # how long a sender's display name is remembered


@dataclass
class LineStats:
    """What the channel counted since start (mirrored into /metrics)."""

    sent: Counter[str] = field(default_factory=Counter)  # messages, by "reply" / "push"
    refused: Counter[str] = field(default_factory=Counter)  # replies, by REFUSAL_REASONS
    expired_tokens: int = 0  # replies pushed because their token was too old or refused
    bad_signatures: int = 0


@dataclass(frozen=True, slots=True)
class GivenUp:
    """A reply given up (the admin page's "undeliverable" row)."""

    session_key: str
    chat: str
    text: str
    reason: str
    held_at: float


def retry_key(message: OutboundMessage, first_part: int) -> str | None:
    """The `X-Line-Retry-Key` of the push that carries `message`'s parts from
    `first_part`: the same for the same reply in every process, so LINE shows it once;
    None for a reply to no message (a scheduled run), which gets a key per process."""
    if not message.reply_to:
        return None
    digest = hashlib.sha256(message.text.encode()).hexdigest()
    seed = f"{message.session_key}\n{message.reply_to}\n{digest}\n{first_part}"
    return str(uuid.uuid5(RETRY_KEY_NAMESPACE, seed))


def text_message(text: str, quote_token: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"type": "text", "text": text}
    if quote_token:
        body["quoteToken"] = quote_token
    return body


class LineChannel:
    """The LINE adapter (Channel protocol); see the module docstring."""

    name = CHANNEL

    def __init__(
        self,
        settings: LineSettings,
        *,
        token: str,
        channel_secret: str,
        pacing: Pacing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for value, what in ((token, "CHANNEL_ACCESS_TOKEN"), (channel_secret, "CHANNEL_SECRET")):
            if not value:
                raise ConfigError(
                    f"channels.line: set {ENV_PREFIX}{what} (or {what.lower()}_file); "
                    "see docs/line.md"
                )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.api = LineApi(settings.api_url, settings.data_api_url, token)
        self.stats = LineStats()
        self._secret = channel_secret
        self._clock = clock
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._mounted = False
        self.bot_user_id = ""
        self._notices = NoticeCooldown()
        self._loading = TypingIndicators[str](self._show_loading)
        #: Reply tokens used (or tried with an unknown outcome): never used again.
        self._spent: OrderedDict[str, None] = OrderedDict()
        #: Ids of the messages the bot sent: a message quoting one replies to the bot.
        self._own: OrderedDict[str, None] = OrderedDict()
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED)
        #: Retry keys of replies to no message, by (session, text, first part).
        self._keys: OrderedDict[tuple[str, str, int], str] = OrderedDict()
        self._names: dict[tuple[str, str], tuple[float, str]] = {}
        self.given_up: deque[GivenUp] = deque(maxlen=_QUOTA_LISTED)

    @classmethod
    def from_settings(cls, settings: LineSettings) -> LineChannel:
        return cls(
            settings,
            token=settings.resolved_token() or "",
            channel_secret=settings.resolved_secret() or "",
        )

    @property
    def live(self) -> bool:
        return self._submit is not None

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> None:
        """Route LINE's webhook on the daemon's server to this channel (before it runs)."""
        http.mount("POST", LINE_WEBHOOK_PATH, self._webhook)
        self._mounted = True

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Learn who the bot is, then take webhook requests until cancelled. Raises
        LineSetupError when the Messaging API refuses the token."""
        if not self._mounted:
            raise RuntimeError("line: mount(daemon.http) was never called")
        try:
            info = await self.api.call("GET", "/v2/bot/info")
        except LineError as exc:
            await self.api.aclose()
            raise LineSetupError(setup_hint(exc, self.api.root)) from None
        self.bot_user_id = str(info.body.get("userId") or "")
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                # Only now: a mention of the bot is read with its user id known.
                self._submit = submit
                self._paused = False
                logger.info(
                    "line: {} ({}) is live; webhook at POST {}",
                    info.body.get("displayName") or "the bot",
                    info.body.get("basicId") or self.bot_user_id,
                    LINE_WEBHOOK_PATH,
                )
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._submit = None
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.api.aclose()  # reopened on next use (a late send)

    def pause_intake(self) -> None:
        """Take no more requests (the daemon is draining): the webhook answers 503 and
        LINE delivers the events again (with redelivery on) to the next start."""
        self._paused = True

    # ----------------------------------------------------------------- webhook

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One request from LINE; see the module docstring for what each answer means."""
        body = await _read_capped(request, WEBHOOK_MAX_BYTES)
        if body is None:
            return json_error(413, f"the body is over {WEBHOOK_MAX_BYTES} bytes")
        if not signature_ok(self._secret, body, request.headers.get(SIGNATURE_HEADER, "")):
            self.stats.bad_signatures += 1
            logger.warning(
                "line: refused a webhook request without a valid {} (from {}); if LINE sent "
                "it, {}CHANNEL_SECRET is not the channel's secret",
                SIGNATURE_HEADER,
                request.remote or "-",
                ENV_PREFIX,
            )
            return json_error(401, f"missing or wrong {SIGNATURE_HEADER}")
        submit = self._submit
        if submit is None or self._paused:
            return json_error(503, "the LINE channel is not taking events", {"Retry-After": "5"})
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            logger.error("line: a signed webhook request whose body is not a JSON object")
            return json_error(400, "the body is not a JSON object")
        items = translate_request(
            payload,
            bot_user_id=self.bot_user_id,
            received_at=self._clock(),
            sent_by_bot=self._own.__contains__,
        )
        for item in items:
            if not await self._take(item, submit):
                return json_error(
                    503,
                    "the gateway could not keep the events; send them again",
                    {"Retry-After": "5"},
                )
        return web.json_response({})

    async def _take(self, item: Item, submit: Submit) -> bool:
        """Keep one event; False when LINE must deliver it again."""
        if isinstance(item, Inbound):
            message = item.message
            with logger.contextualize(session=message.session_key):
                ticket = await submit(message)
                if not ticket.taken:
                    return False
                # A kill here leaves the message journaled and LINE without its 200.
                await failpoints.reach("line.before_ack", message.session_key)
            if self.settings.loading_animation and not is_group_chat(message.chat_id):
                self._spawn(self._loading_while_pending, ticket, message.chat_id)
        elif isinstance(item, Notice):
            self._spawn(self._send_notice, item)
        else:
            logger.debug("line: skipped {}", item.reason)
        return True

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- loading

    async def _loading_while_pending(self, ticket: Ticket, chat: str) -> None:
        """The loading animation in a one-on-one chat until the reply is ready (LINE
        hides it when the bot's message arrives)."""
        pacing = self.pacing
        await self._loading.while_pending(
            ticket,
            chat,
            spawn=self._spawn,
            grace=pacing.loading_grace,
            interval=pacing.loading_refresh,
            limit=pacing.loading_limit,
        )

    async def _show_loading(self, chat: str) -> None:
        body = {"chatId": chat, "loadingSeconds": self.pacing.loading_seconds}
        try:
            await self.api.call("POST", "/v2/bot/chat/loading/start", json_body=body)
        except LineError as exc:
            logger.debug("line: loading animation not shown: {}", exc)

    async def _send_notice(self, notice: Notice) -> None:
        """A notice goes with its event's reply token only: a notice is never worth a
        push of the month's quota."""
        token = notice.context.reply_token
        if not token or not self._notices.allow(notice.chat, self.pacing.notice_cooldown):
            return
        self._spend(token)
        body = {"replyToken": token, "messages": [text_message(notice.text)]}
        try:
            await self.api.call("POST", "/v2/bot/message/reply", json_body=body)
        except LineError as exc:
            logger.warning("line: a notice to {} was not sent: {}", notice.chat, exc)

    # ----------------------------------------------------------------- names

    async def enrich_for_turn(self, message: InboundMessage) -> InboundMessage:
        """The sender's display name, asked of LINE when the turn begins (not before the
        webhook is answered), remembered for `Pacing.name_ttl`."""
        if message.metadata.get(META_SENDER_NAME) or not message.sender_id:
            return message
        name = await self._display_name(message.chat_id, message.sender_id)
        if not name:
            return message
        return replace(message, metadata={**message.metadata, META_SENDER_NAME: name})

    async def _display_name(self, chat: str, user: str) -> str:
        now = time.monotonic()
        cached = self._names.get((chat, user))
        if cached is not None and now - cached[0] < self.pacing.name_ttl:
            return cached[1]
        kind, _, place = chat.partition(":")
        if kind in (GROUP, ROOM):
            path = f"/v2/bot/{kind}/{place}/member/{user}"
        else:
            path = f"/v2/bot/profile/{user}"
        try:
            with anyio.fail_after(5):
                answer = await self.api.call("GET", path)
        except (LineError, TimeoutError) as exc:
            logger.debug("line: no display name for {}: {}", user, exc)
            return ""
        name = str(answer.body.get("displayName") or "")
        if len(self._names) > _REMEMBERED:
            self._names.clear()
        self._names[(chat, user)] = (now, name)
        return name

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: from the content API by its message id (or, for a file
        another service holds, its URL), at most `max_bytes`."""
        if attachment.url:
            return await download_capped(attachment.url, max_bytes)
        try:
            data, _ = await self.api.content(attachment.file_id, max_bytes=max_bytes)
        except ValueError:
            raise MediaError(f"it is larger than {max_bytes / 2**20:.0f} MB") from None
        except LineError as exc:
            logger.warning("line: content of {} not fetched: {}", attachment.file_id, exc)
            if exc.status in (404, 410):
                raise MediaError("LINE no longer has the file; please send it again") from None
            raise MediaError("LINE did not hand over the file; please send it again") from None
        return data

    # ----------------------------------------------------------------- replies

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: its reply token while fresh, else pushed with a retry key;
        see the module docstring for what each failure does."""
        texts = line_messages(message.text)
        if message.files:
            names = ", ".join(f.name for f in message.files)
            texts.append(
                f"[{len(message.files)} file(s) not sent: LINE takes files only "
                f"from a public URL: {names}]"
            )
        again = (message.session_key, message.reply_to, message.text)
        done = self._sent_parts.take(again, 0)
        context = ReplyContext.from_metadata(message.metadata)
        group = is_group_chat(message.chat_id)
        deadline = time.monotonic() + self.pacing.reply_deadline
        with logger.contextualize(session=message.session_key):
            if not texts:
                logger.warning("line: empty reply not sent")
                return
            while done < len(texts):
                batch = texts[done : done + MESSAGES_PER_REQUEST]
                quote = context.quote_token if group and done == 0 else ""
                messages = [text_message(t, quote if i == 0 else "") for i, t in enumerate(batch)]
                try:
                    how = await self._send_batch(message, context, messages, done, deadline)
                except DeliveryFailed as exc:
                    self._remember_cut(again, done)
                    raise DeliveryFailed(
                        f"line: message {done + 1} of {len(texts)} not sent ({exc}); it is sent "
                        "again later",
                        sent=done,
                    ) from exc
                self.stats.sent[how] += len(batch)
                done += len(batch)

    def _remember_cut(self, again: tuple[str, str | None, str], done: int) -> None:
        self._sent_parts.keep(again, done)

    async def _send_batch(
        self,
        message: OutboundMessage,
        context: ReplyContext,
        messages: list[dict[str, Any]],
        first: int,
        deadline: float,
    ) -> str:
        """Send one request's messages: "reply" or "push", as it went out."""
        token = context.reply_token
        age = self._clock() - context.received_at
        fresh = bool(token) and token not in self._spent and age < self.settings.reply_token_seconds
        if fresh and await self._reply(token, messages, deadline):
            return "reply"
        if token and first == 0:
            self.stats.expired_tokens += 1
        if not self.settings.push:
            self._give_up(
                message,
                "push_disabled",
                "its reply token had expired and channels.line.push is off",
            )
            raise LineRefused("line: reply token expired and push is off; reply not sent")
        await self._push(message, messages, first, deadline)
        return "push"

    async def _reply(self, token: str, messages: list[dict[str, Any]], deadline: float) -> bool:
        """Send with the reply token: True when it went out, False when LINE refused the
        token (used or expired: push instead). Repeated only while it certainly did not
        go out; raises DeliveryFailed when it still had not at the deadline."""
        body: dict[str, Any] = {"replyToken": token, "messages": messages}
        failures = 0
        while True:
            try:
                answer = await self.api.call("POST", "/v2/bot/message/reply", json_body=body)
            except LineError as exc:
                if exc.invalid_reply_token:
                    self._spend(token)
                    logger.info("line: the reply token was refused ({}); pushing instead", exc)
                    return False
                if exc.kind == "maybe_sent":
                    self._spend(token)
                    raise LineRefused(
                        f"line: the reply may or may not have arrived ({exc}); it is not sent "
                        "again, which could show it twice"
                    ) from None
                if exc.kind == "refused" and _quoting(body["messages"]):
                    logger.warning("line: LINE refused the quote ({}); replying without it", exc)
                    body["messages"] = _unquoted(body["messages"])
                    continue
                if exc.kind == "refused":
                    self._spend(token)
                    self._count_refusal("refused")
                    raise LineRefused(f"line: LINE refused the reply: {exc}") from None
                failures += 1
                delay = min(self.pacing.backoff * 2 ** (failures - 1), self.pacing.max_backoff)
                if time.monotonic() + delay > deadline:
                    raise DeliveryFailed(str(exc)) from None
                logger.warning("line: reply failed ({}); retrying in {:g}s", exc, delay)
                await anyio.sleep(delay)
                continue
            self._spend(token)
            self._note_own(answer)
            return True

    async def _push(
        self,
        message: OutboundMessage,
        messages: list[dict[str, Any]],
        first: int,
        deadline: float,
    ) -> None:
        """Push with a retry key, repeated after any failure but a refusal (LINE executes
        one key once); raises DeliveryFailed when it had not gone out at the deadline,
        LineRefused when LINE refused it (the quota, once the deadline came)."""
        key = retry_key(message, first) or self._process_key(message, first)
        body: dict[str, Any] = {"to": push_target(message.chat_id), "messages": messages}
        failures = 0
        while True:
            try:
                answer = await self.api.call(
                    "POST", "/v2/bot/message/push", json_body=body, retry_key=key
                )
            except LineError as exc:
                if exc.kind == "refused" and _quoting(body["messages"]):
                    # Not accepted: the same retry key may go again, without the quote.
                    logger.warning("line: LINE refused the quote ({}); pushing without it", exc)
                    body["messages"] = _unquoted(body["messages"])
                    continue
                if exc.kind == "refused":
                    self._give_up(message, "refused", f"LINE refused the push: {exc}")
                    raise LineRefused(f"line: LINE refused the push: {exc}") from None
                failures += 1
                delay = min(self.pacing.backoff * 2 ** (failures - 1), self.pacing.max_backoff)
                if time.monotonic() + delay > deadline:
                    if exc.kind == "quota":
                        self._give_up(
                            message,
                            "monthly_limit",
                            "the month's push messages are used up (LINE: You have reached "
                            "your monthly limit.)",
                        )
                        raise LineRefused(
                            "line: the reply's token had expired and the month's push "
                            "messages are used up; reply not sent (docs/line.md, "
                            "'The message quota')"
                        ) from None
                    raise DeliveryFailed(str(exc)) from None
                logger.warning("line: push failed ({}); retrying in {:g}s", exc, delay)
                await anyio.sleep(delay)
                continue
            if answer.status == 409:
                logger.info("line: LINE had this push already (retry key {}); not shown twice", key)
            self._note_own(answer)
            return

    def _process_key(self, message: OutboundMessage, first: int) -> str:
        """A retry key for a reply to no message, kept while this process runs (a resend
        after `DeliveryFailed` reuses it)."""
        slot = (message.session_key, message.text, first)
        key = self._keys.get(slot)
        if key is None:
            key = self._keys[slot] = str(uuid.uuid4())
            while len(self._keys) > _REMEMBERED:
                self._keys.popitem(last=False)
        return key

    def _give_up(self, message: OutboundMessage, reason: str, why: str) -> None:
        self._count_refusal(reason)
        logger.error("line: reply to {} not sent: {}", message.chat_id, why)
        self.given_up.appendleft(
            GivenUp(message.session_key, message.chat_id, message.text, why, self._clock())
        )

    def _count_refusal(self, reason: str) -> None:
        self.stats.refused[reason] += 1

    async def undeliverable(self) -> list[GivenUp]:
        """Replies given up since start, newest first (for the admin page)."""
        return list(self.given_up)

    def _spend(self, token: str) -> None:
        self._spent[token] = None
        while len(self._spent) > _REMEMBERED:
            self._spent.popitem(last=False)

    def _note_own(self, answer: Answer) -> None:
        for sent_id in answer.sent_ids:
            self._own[sent_id] = None
        while len(self._own) > _REMEMBERED:
            self._own.popitem(last=False)


def _quoting(messages: Any) -> bool:
    return any(isinstance(m, dict) and m.get("quoteToken") for m in messages)


def _unquoted(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their quote tokens (a quote LINE refused: a quoted message
    that was unsent, say, must not cost the reply)."""
    return [{k: v for k, v in m.items() if k != "quoteToken"} for m in messages]


def setup_hint(exc: LineError, root: str) -> str:
    if exc.status in (401, 403):
        return (
            f"line: the Messaging API refused the channel access token ({exc}); set "
            f"{ENV_PREFIX}CHANNEL_ACCESS_TOKEN to the token of the channel's Messaging API "
            "tab (LINE Developers Console)"
        )
    return f"line: cannot reach the Messaging API at {root} ({exc}); check the network or api_url"


async def check_credentials(settings: LineSettings) -> str:
    """`gateway doctor`: who the token belongs to. Raises LineSetupError saying what to fix."""
    api = LineApi(settings.api_url, settings.data_api_url, settings.resolved_token() or "", 10)
    try:
        info = await api.call("GET", "/v2/bot/info")
    except LineError as exc:
        raise LineSetupError(setup_hint(exc, api.root)) from None
    finally:
        await api.aclose()
    body = info.body
    return f"{body.get('displayName') or 'the bot'} ({body.get('basicId') or body.get('userId')})"


async def quota_line(settings: LineSettings) -> tuple[str, str]:
    """`gateway doctor`: the month's push messages used and left, as (status, text)."""
    api = LineApi(settings.api_url, settings.data_api_url, settings.resolved_token() or "", 10)
    try:
        quota = (await api.call("GET", "/v2/bot/message/quota")).body
        used = (await api.call("GET", "/v2/bot/message/quota/consumption")).body
    finally:
        await api.aclose()
    total = int(used.get("totalUsage") or 0)
    if quota.get("type") != "limited":
        return "ok", f"line push messages this month: {total} sent, no monthly limit"
    limit = int(quota.get("value") or 0)
    status = "fail" if total >= limit else "warn" if total >= 0.8 * limit else "ok"
    return status, f"line push messages this month: {total} of {limit} used"


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
