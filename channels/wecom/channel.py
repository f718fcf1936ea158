"""The WeCom channel: a WeCom (企业微信) self-built app in callback mode, its messages in
on the gateway's own HTTP port and its replies out through `message/send` over aiohttp
(`channels.wecom.api`).

Why no client library: wechatpy's WeCom client is synchronous (requests), and the
callback's cipher is thirty lines over `cryptography` (`channels.wecom.crypto`). The
channel makes two calls (gettoken, message/send) and must tell a send that never left
from one that may have gone out.

Inbound: WeCom sends every message of the app to `WECOM_CALLBACK_PATH`: a GET with
`echostr` when the callback URL is saved in the admin console (answered with the
decrypted `echostr`), then a POST per message, encrypted XML (`channels.wecom.translate`:
session key `wecom:<UserID>`).

Outbound: `send` turns the reply's Markdown into plain text (`channels.wecom.format`),
splits it into text messages of 2,048 bytes and sends each with `message/send` to the
member (`touser`), never to `@all`.

Promises (tested in tests/test_wecom*.py and by the conformance kit, tests/conformance):
- Every request is checked against `msg_signature` (SHA-1 over the callback Token,
  `timestamp`, `nonce` and the encrypted text, compared in constant time) before it is
  decrypted, and the decrypted message must name the channel's corp id: a forged or
  misdirected request is a 401 and nothing of it is read.
- Journal before the answer: a POST is answered 200 with an empty body (WeCom's "回复空串":
  no passive reply, no retry) only once its message is in the journal (or settled: a
  duplicate, a refusal, a notice); otherwise 503, and WeCom sends it again (a request not
  answered 200 within 5 s is retried, three times). A retried callback keeps its MsgId,
  which the dispatcher's journal answers once, across restarts and replicas. The journal
  write takes milliseconds; the reply never goes in the callback's answer, so the 5 s
  window holds whatever the model takes.
- Replies are sent with WeCom's duplicate check (`enable_duplicate_check`, over
  `duplicate_check_seconds`): the same text to the same member within that time is shown
  once. So a send is repeated after any failure that cannot have shown it twice: a
  connection never made, a frequency limit (45009, 45033, -1: not carried out, waited
  out), and, with the check on, a timeout or a 5xx. A reply still failing when its time
  runs out raises `DeliveryFailed`: the dispatcher sends it again later, from the first
  part that did not go out.
- By name: an expired or replaced access token (42001, 40014) is fetched again and the
  send repeated once; 81013 (the member is outside the app's visible range), 60020 (the
  gateway's address is not a trusted IP) and any other refusal are given up, logged,
  counted and listed on the admin page. What a person sees in each case is in
  docs/wecom.md.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.notices import NoticeCooldown
from channels.wecom import crypto
from channels.wecom.api import IP_NOT_TRUSTED, NOT_VISIBLE, WeComApi, WeComError
from channels.wecom.format import wecom_texts
from channels.wecom.settings import ENV, WeComSettings
from channels.wecom.translate import (
    CHANNEL,
    BadXml,
    Inbound,
    Item,
    Notice,
    parse_fields,
    translate_message,
)
from gateway import failpoints
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.messages import OutboundMessage
from gateway.registry import Mount

#: Where WeCom sends the app's messages on the gateway's HTTP port.
WECOM_CALLBACK_PATH = "/wecom/callback"
#: The largest callback body read (WeCom's stay far below it).
CALLBACK_MAX_BYTES = 256 * 1024
_REMEMBERED = 10_000
_GIVEN_UP_LISTED = 100
#: Why a reply was not sent, for metrics.
REFUSAL_REASONS = ("not_visible", "ip_not_trusted", "refused")


class WeComSetupError(Exception):
    """WeCom refused the corp id or Secret, or cannot be reached; says what to fix and
    never holds the Secret."""


class WeComRefused(Exception):
    """A reply WeCom refused, or that may have gone out: sending it again as it is cannot
    help, or could show it twice."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to WeCom (seconds). Nothing waits past
    `reply_deadline` after `send` began (under the dispatcher's 60 s cap on a delivery)."""

    reply_deadline: float = 50.0
    backoff: float = 0.5  # doubled per attempt
    max_backoff: float = 8.0
    notice_cooldown: float = 60.0  # per member, for "text only" notices


@dataclass
class WeComStats:
    """What the channel counted since start (mirrored into /metrics)."""

    sent: int = 0  # text messages
    refused: Counter[str] = field(default_factory=Counter)  # replies, by REFUSAL_REASONS
    rate_limited: int = 0  # answers 45009 / 45033 / -1, waited out
    bad_signatures: int = 0  # requests refused: signature, or another corp's message


@dataclass(frozen=True, slots=True)
class GivenUp:
    """A reply given up (the admin page's "undeliverable" row)."""

    session_key: str
    chat: str
    text: str
    reason: str
    held_at: float


def refusal_reason(exc: WeComError) -> str:
    if exc.errcode == NOT_VISIBLE:
        return "not_visible"
    if exc.errcode == IP_NOT_TRUSTED:
        return "ip_not_trusted"
    return "refused"


class WeComChannel:
    """The WeCom adapter (Channel protocol); see the module docstring."""

    name = CHANNEL

    def __init__(
        self,
        settings: WeComSettings,
        *,
        secret: str,
        token: str,
        encoding_aes_key: str,
        pacing: Pacing | None = None,
    ) -> None:
        for value, what in (
            (settings.corp_id, "CORP_ID"),
            (settings.agent_id, "AGENT_ID"),
            (secret, "SECRET"),
            (token, "TOKEN"),
            (encoding_aes_key, "ENCODING_AES_KEY"),
        ):
            if not value:
                raise ConfigError(f"channels.wecom: set {ENV}{what}; see docs/wecom.md")
        try:
            self._key = crypto.aes_key(encoding_aes_key)
        except ValueError as exc:
            raise ConfigError(
                f"channels.wecom: {ENV}ENCODING_AES_KEY is not an EncodingAESKey ({exc}); copy "
                "it from the app's Receive Messages page"
            ) from None
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.api = WeComApi(settings.api_url, settings.corp_id, secret)
        self.stats = WeComStats()
        self._token = token
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._mounted = False
        self._notices = NoticeCooldown()
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED)
        self.given_up: deque[GivenUp] = deque(maxlen=_GIVEN_UP_LISTED)

    @classmethod
    def from_settings(cls, settings: WeComSettings) -> WeComChannel:
        return cls(
            settings,
            secret=settings.resolved_secret() or "",
            token=settings.resolved_token() or "",
            encoding_aes_key=settings.resolved_aes_key() or "",
        )

    @property
    def live(self) -> bool:
        return self._submit is not None

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> None:
        """Route WeCom's callback on the daemon's server to this channel (before it runs).
        The URL check (GET) needs only the keys: it answers while the gateway starts."""
        http.mount("GET", WECOM_CALLBACK_PATH, self._verify_url, require_ready=False)
        http.mount("POST", WECOM_CALLBACK_PATH, self._callback)
        self._mounted = True

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Fetch the app's access token (the credentials checked), then take callbacks
        until cancelled. Raises WeComSetupError when WeCom refuses them."""
        if not self._mounted:
            raise RuntimeError("wecom: mount(daemon.http) was never called")
        try:
            await self.api.token()
        except WeComError as exc:
            await self.api.aclose()
            raise WeComSetupError(setup_hint(exc, self.api.root)) from None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._submit = submit
                self._paused = False
                logger.info(
                    "wecom: app {} of corp {} is live; callback at {}",
                    self.settings.agent_id,
                    self.settings.corp_id,
                    WECOM_CALLBACK_PATH,
                )
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._submit = None
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.api.aclose()  # reopened on next use (a late send)

    def pause_intake(self) -> None:
        """Take no more callbacks (the daemon is draining): they are answered 503 and
        WeCom sends them again, within its three retries."""
        self._paused = True

    # ----------------------------------------------------------------- callback

    def _signed(self, request: web.Request, encrypted: str) -> bool:
        query = request.query
        ok = crypto.signature_valid(
            self._token,
            query.get("timestamp", ""),
            query.get("nonce", ""),
            encrypted,
            query.get("msg_signature", ""),
        )
        if not ok:
            self._refuse(
                request, "without a valid msg_signature", "TOKEN is not the callback's Token"
            )
        return ok

    def _refuse(self, request: web.Request, what: str, fix: str) -> None:
        self.stats.bad_signatures += 1
        logger.warning(
            "wecom: refused a callback {} (from {}); if WeCom sent it, {}{}",
            what,
            request.remote or "-",
            ENV,
            fix,
        )

    def _open(self, request: web.Request, encrypted: str) -> bytes | None:
        try:
            return crypto.decrypt(encrypted, self._key, self.settings.corp_id)
        except crypto.NotDecryptable as exc:
            self._refuse(
                request,
                f"that does not open for corp {self.settings.corp_id} ({exc})",
                "ENCODING_AES_KEY or CORP_ID is not the app's",
            )
            return None

    async def _verify_url(self, request: web.Request) -> web.StreamResponse:
        """The console's URL check: the decrypted `echostr`, as it is (no quotes, no
        newline), once its signature holds."""
        echostr = request.query.get("echostr", "")
        if not echostr or not self._signed(request, echostr):
            return web.Response(status=401, text="missing or wrong msg_signature")
        plain = self._open(request, echostr)
        if plain is None:
            return web.Response(status=401, text="echostr is not for this corp")
        logger.info("wecom: the callback URL was verified")
        return web.Response(body=plain, content_type="text/plain")

    async def _callback(self, request: web.Request) -> web.StreamResponse:
        """One message from WeCom; see the module docstring for what each answer means."""
        body = await _read_capped(request, CALLBACK_MAX_BYTES)
        if body is None:
            return json_error(413, f"the body is over {CALLBACK_MAX_BYTES} bytes")
        try:
            encrypted = parse_fields(body).get("Encrypt", "")
        except BadXml:
            encrypted = ""
        if not encrypted or not self._signed(request, encrypted):
            return web.Response(status=401, text="missing or wrong msg_signature")
        plain = self._open(request, encrypted)
        if plain is None:
            return web.Response(status=401, text="not encrypted for this corp")
        submit = self._submit
        if submit is None or self._paused:
            return json_error(503, "the WeCom channel is not taking messages", {"Retry-After": "5"})
        try:
            fields = parse_fields(plain)
        except BadXml as exc:
            logger.error("wecom: a signed callback whose message is not XML ({})", exc)
            return web.Response(status=400, text="the message is not XML")
        item = translate_message(fields, agent_id=self.settings.agent_id, received_at=time.time())
        if not await self._take(item, submit):
            return json_error(503, "the gateway could not keep the message", {"Retry-After": "5"})
        return web.Response(status=200, body=b"")

    async def _take(self, item: Item, submit: Submit) -> bool:
        """Keep one message; False when WeCom must send it again."""
        if isinstance(item, Inbound):
            message = item.message
            with logger.contextualize(session=message.session_key):
                ticket = await submit(message)
                if not ticket.taken:
                    return False
                # A kill here leaves the message journaled and WeCom without its 200.
                await failpoints.reach("wecom.before_ack", message.session_key)
        elif isinstance(item, Notice):
            if self._notices.allow(item.user, self.pacing.notice_cooldown):
                self._spawn(self._send_notice, item)
        else:
            logger.debug("wecom: skipped {}", item.reason)
        return True

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    async def _send_notice(self, notice: Notice) -> None:
        try:
            await self.api.call("POST", "message/send", self._text_body(notice.user, notice.text))
        except WeComError as exc:
            logger.warning("wecom: a notice to {} was not sent: {}", notice.user, exc)

    # ----------------------------------------------------------------- replies

    def _text_body(self, user: str, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "touser": user,
            "msgtype": "text",
            "agentid": self.settings.agent_id,
            "text": {"content": text},
        }
        if self.settings.duplicate_check_seconds:
            body["enable_duplicate_check"] = 1
            body["duplicate_check_interval"] = self.settings.duplicate_check_seconds
        return body

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply as text messages to the member; see the module docstring for
        what each failure does."""
        texts = wecom_texts(message.text)
        if message.files:
            names = ", ".join(f.name for f in message.files)
            texts.append(f"[{len(message.files)} file(s) not sent: {names}]")
        again = (message.session_key, message.reply_to, message.text)
        done = self._sent_parts.take(again, 0)
        deadline = time.monotonic() + self.pacing.reply_deadline
        with logger.contextualize(session=message.session_key):
            if not texts:
                logger.warning("wecom: empty reply not sent")
                return
            while done < len(texts):
                try:
                    await self._send_one(message, texts[done], deadline)
                except DeliveryFailed as exc:
                    self._remember_cut(again, done)
                    raise DeliveryFailed(
                        f"wecom: message {done + 1} of {len(texts)} not sent ({exc}); it is sent "
                        "again later",
                        sent=done,
                    ) from exc
                self.stats.sent += 1
                done += 1

    async def _send_one(self, message: OutboundMessage, text: str, deadline: float) -> None:
        """One text message: repeated while that cannot show it twice (see the module
        docstring); DeliveryFailed when it had not gone out at the deadline."""
        body = self._text_body(message.chat_id, text)
        failures = 0
        while True:
            try:
                answer = await self.api.call("POST", "message/send", body)
            except WeComError as exc:
                if exc.kind == "refused":
                    self._give_up(message, refusal_reason(exc), f"WeCom refused it: {exc}")
                    raise WeComRefused(f"wecom: WeCom refused the reply: {exc}") from None
                if exc.kind == "maybe_sent" and not self.settings.duplicate_check_seconds:
                    raise WeComRefused(
                        f"wecom: the reply may or may not have arrived ({exc}); without the "
                        "duplicate check it is not sent again, which could show it twice"
                    ) from None
                if exc.kind == "rate_limited":
                    self.stats.rate_limited += 1
                failures += 1
                delay = min(self.pacing.backoff * 2 ** (failures - 1), self.pacing.max_backoff)
                if time.monotonic() + delay > deadline:
                    raise DeliveryFailed(str(exc)) from None
                logger.warning("wecom: send failed ({}); retrying in {:g}s", exc, delay)
                await anyio.sleep(delay)
                continue
            invalid = str(answer.get("invaliduser") or "")
            if invalid:
                why = f"WeCom did not deliver it to {invalid} (invaliduser)"
                self._give_up(message, "not_visible", why)
                raise WeComRefused(f"wecom: {why}")
            return

    def _remember_cut(self, again: tuple[str, str | None, str], done: int) -> None:
        self._sent_parts.keep(again, done)

    def _give_up(self, message: OutboundMessage, reason: str, why: str) -> None:
        self.stats.refused[reason] += 1
        logger.error("wecom: reply to {} not sent: {}", message.chat_id, why)
        self.given_up.appendleft(
            GivenUp(message.session_key, message.chat_id, message.text, why, time.time())
        )

    async def undeliverable(self) -> list[GivenUp]:
        """Replies given up since start, newest first (for the admin page)."""
        return list(self.given_up)


def setup_hint(exc: WeComError, root: str) -> str:
    if exc.errcode == IP_NOT_TRUSTED:
        return (
            f"wecom: WeCom refused the gateway's address ({exc}); add it to the app's Trusted "
            "IPs (App Management > the app > Trusted IP), docs/wecom.md"
        )
    if exc.errcode in (40001, 40013, 40091, 41002, 41004):
        return (
            f"wecom: WeCom refused the corp id or the app's Secret ({exc}); set {ENV}CORP_ID "
            f"and {ENV}SECRET to the app's (docs/wecom.md)"
        )
    if exc.kind == "refused":
        return f"wecom: WeCom refused the credentials ({exc}); see docs/wecom.md"
    return f"wecom: cannot reach WeCom's API at {root} ({exc}); check the network or api_url"


async def check_credentials(settings: WeComSettings) -> str:
    """`gateway doctor`: an access token fetched. Raises WeComSetupError saying what to fix."""
    api = WeComApi(settings.api_url, settings.corp_id, settings.resolved_secret() or "", 10)
    try:
        await api.token()
    except WeComError as exc:
        raise WeComSetupError(setup_hint(exc, api.root)) from None
    finally:
        await api.aclose()
    return f"app {settings.agent_id} of corp {settings.corp_id}: an access token was issued"


async def _read_capped(request: web.Request, limit: int) -> bytes | None:
    """The raw body, or None past `limit`."""
    if request.content_length is not None and request.content_length > limit:
        return None
    data = bytearray()
    while chunk := await request.content.read(65536):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)
