"""The Google Chat channel: a Chat app on an HTTP endpoint. Google Chat POSTs interaction
events to `POST /googlechat/events` on the gateway's own port; replies go out
asynchronously through the Chat API as the app (a service account), never in the HTTP
answer, which is an empty `{}` once the message is journaled.

Why no Google library: a trial of google-auth 2.63 (the library Google's samples use for
both halves) against a local token endpoint and key server showed that its ID-token
check fetches Google's keys again on every verification, that its token refresh and
verification are blocking `requests` calls (a thread per webhook request), and that its
aiohttp transport is private and marked experimental ("may change in minor releases").
google-apps-chat brings gRPC for the four REST calls the channel makes, and
google-api-python-client is blocking httplib2. The channel needs keys kept per
`Cache-Control`, a token shared by concurrent sends, and to tell a request that never
went out from one that may have; so it signs and verifies with PyJWT (RS256 through
`cryptography`, the `googlechat` extra) and speaks HTTP over the gateway's aiohttp
(`channels.googlechat.auth`, `channels.googlechat.api`). Nothing here can confirm to
Google what is only in memory: the HTTP answer is the only confirmation there is, and it
is sent after the journal.

Session keys and where replies go: see `channels.googlechat.translate`.

Promises (tested in tests/test_googlechat*.py and the conformance kit):
- Every request's bearer token is checked (`channels.googlechat.auth.BearerVerifier`:
  Google's signature, the issuer, the audience, the expiry) before its body is read as an
  event: a missing or wrong one is a 401 and nothing is taken.
- Journal before the 200: the endpoint answers `{}` (HTTP 200) only once the message is
  in the journal (or settled: a duplicate, a stranger's). Google Chat sends an event
  once and never again (no retry is documented, and none happens when the endpoint
  fails): so the channel says `redelivers = False`, and a stopping gateway still
  journals what comes for its next start (`gateway.channel`). A message the gateway
  cannot take (it is starting, the journal failed) is answered, in the same HTTP
  response, with a message asking the person to send it again, rather than with an
  error Chat would show as "not responding".
- Events of one space are submitted in the order they arrive.
- A reply is never posted twice: each message of it carries a `messageId` made from the
  message it answers, its place in the reply and its text, which the Chat API refuses to
  use twice in a space (409 ALREADY_EXISTS: it went out before). So any request that
  failed may be repeated: a send rides out an unreachable API, 5xx, 429 quotas and lost
  answers with backoff for `Pacing.reply_deadline`, then raises `DeliveryFailed` and the
  dispatcher sends it again later, from the message that failed.
- Nothing the model writes notifies anyone (`channels.googlechat.format`); a reply in a
  space starts with its sender's mention, the one mention the app makes.

Replies are Chat markup (`MARKUP_SYNTAX_CHAT`, named on every request) in messages of at
most `max_message_bytes` (32,000 bytes of UTF-8); with `streaming` the first one is
posted early, as a preview with a `messageId` of its own, and edited as the text grows,
also across a restart. Files people upload become attachments (fetched with the app's
token through `media.download`); files in a reply cannot go out (the Chat API lets an
app upload only as a person), so a reply names them instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.googlechat.api import ChatApi, ChatApiError, NoAnswer, Space, Unreachable
from channels.googlechat.auth import (
    AccessTokens,
    BearerVerifier,
    KeysUnavailable,
    Refused,
    ServiceAccount,
    SetupError,
)
from channels.googlechat.format import chat_messages, client_message_id, mention_line
from channels.googlechat.settings import GoogleChatSettings
from channels.googlechat.translate import CHANNEL, Skip, target_of, translate_event
from gateway import failpoints
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_REPLY_CONTEXT,
    Attachment,
    InboundMessage,
    OutboundMessage,
)
from gateway.registry import Mount

#: Where Google Chat posts the app's events on the gateway's HTTP port.
GOOGLECHAT_WEBHOOK_PATH = "/googlechat/events"
ENV_PREFIX = "GATEWAY_CHANNELS__GOOGLECHAT__"
#: The failpoint between a message's journal commit and its HTTP 200.
BEFORE_ACK = "googlechat.before_ack"
#: What a person is told, in the HTTP answer, when their message could not be taken.
SEND_AGAIN = (
    "I could not take that message just now (I am restarting or busy). Please send it "
    "again in a minute."
)
_SEEN = 10_000
_LOCKS = 64

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to the Chat API (seconds)."""

    #: A send gives up (DeliveryFailed) after this long, under the dispatcher's 60 s.
    reply_deadline: float = 40.0
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    request_timeout: float = 15.0
    #: At most one streaming edit per this (a space takes about one write a second).
    stream_interval: float = 1.5
    turn_limit: float = 600.0  # the longest a reply is shown while it is written
    stop_timeout: float = 10.0


@dataclass
class Stats:
    """What the channel counts (`gateway_googlechat_*` on /metrics)."""

    events: Counter[str] = field(default_factory=Counter)  # by event type
    refused: int = 0  # requests whose bearer token did not verify
    not_taken: int = 0  # messages answered "send it again"
    retries: int = 0  # Chat API requests repeated after a transient failure


@dataclass
class _Stream:
    """A reply shown while it is written: one message, edited as text arrives."""

    reply_to: str
    space: str
    thread: str | None
    mention: str
    next_edit: float
    text: str = ""
    shown: str = ""
    created: bool = False
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


def preview_name(space: str, reply_to: str) -> str:
    """The resource name of the preview message of the reply to `reply_to` (its custom
    id: the same after a restart, so a preview left by a crash is edited, not doubled)."""
    return f"spaces/{space}/messages/{client_message_id(reply_to, 'preview', '')}"


def transient(exc: BaseException) -> bool:
    """A failure after which the same request may succeed later."""
    if isinstance(exc, Unreachable | NoAnswer):
        return True
    return isinstance(exc, ChatApiError) and exc.transient


class GoogleChatChannel:
    """The Google Chat adapter; see the module docstring for what it promises."""

    name = CHANNEL
    #: Google Chat sends an event once: the dispatcher keeps what comes while the
    #: gateway stops (`gateway.channel`).
    redelivers = False

    def __init__(
        self,
        settings: GoogleChatSettings,
        *,
        account: ServiceAccount,
        pacing: Pacing | None = None,
    ) -> None:
        if not settings.audience:
            raise ConfigError(
                "channels.googlechat.audience: set it to the Chat app's authentication "
                "audience (the project number, or the endpoint URL), as in the Google Cloud "
                "console's Chat API > Configuration > Connection settings"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.account = account
        self.tokens = AccessTokens(account)
        self.verifier = BearerVerifier(
            settings.audience,
            chat_certs_url=settings.chat_certs_url,
            google_certs_url=settings.google_certs_url,
        )
        self.stats = Stats()
        self._session: aiohttp.ClientSession | None = None
        self._api: ChatApi | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._mounted = False
        self._locks = [anyio.Lock() for _ in range(_LOCKS)]
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_SEEN)
        self._streams: dict[str, _Stream] = {}

    @classmethod
    def from_settings(cls, settings: GoogleChatSettings) -> GoogleChatChannel:
        key = settings.resolved_key()
        if not key:
            raise ConfigError(
                f"channels.googlechat: set {ENV_PREFIX}SERVICE_ACCOUNT_KEY_FILE to the service "
                "account's JSON key file (or its content in "
                f"{ENV_PREFIX}SERVICE_ACCOUNT_KEY); see docs/googlechat.md"
            )
        try:
            account = ServiceAccount.from_json(key)
        except SetupError as exc:
            raise ConfigError(f"channels.googlechat.service_account_key: {exc}") from None
        return cls(settings, account=account)

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> None:
        """Route Google Chat's events on the daemon's server to this channel; call before
        the server runs. The route answers itself while the gateway starts or drains
        (a 503 would lose the message: Chat sends it once)."""
        http.mount("POST", GOOGLECHAT_WEBHOOK_PATH, self._webhook, require_ready=False)
        self._mounted = True

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Get the app's first access token, then take events until cancelled. Raises
        SetupError when Google refuses the service account (the daemon restarts the
        channel with backoff); an unreachable token endpoint is only logged (replies
        wait for it)."""
        if not self._mounted:
            raise RuntimeError("googlechat: mount(daemon.http) was never called")
        timeout = aiohttp.ClientTimeout(total=self.pacing.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            self._api = ChatApi(
                session,
                self.settings.api_url,
                lambda: self.tokens.get(session),
                on_unauthorized=self.tokens.invalidate,
            )
            try:
                await self._warm_up(session)
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    self._submit = submit
                    logger.info(
                        "googlechat: app {} ready; events at POST {} (audience {})",
                        self.account.client_email,
                        GOOGLECHAT_WEBHOOK_PATH,
                        self.settings.audience,
                    )
                    task_status.started()
                    await anyio.sleep_forever()
            finally:
                self._submit = None
                self._tg = None
                self._api = None
                self._session = None

    async def _warm_up(self, session: aiohttp.ClientSession) -> None:
        try:
            await self.tokens.get(session)
        except (Unreachable, NoAnswer, ChatApiError) as exc:
            logger.warning(
                "googlechat: no access token yet ({}); replies wait until {} answers",
                exc,
                self.account.token_uri,
            )
        try:
            await self.verifier.prefetch(session)
        except KeysUnavailable as exc:
            logger.warning("googlechat: {}; requests cannot be checked until it works", exc)

    # ----------------------------------------------------------------- webhook

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One event from Google Chat; see the module docstring for each answer."""
        session = self._session
        if session is None:  # starting: the token is checked all the same, to answer
            timeout = aiohttp.ClientTimeout(total=self.pacing.request_timeout)
            async with aiohttp.ClientSession(timeout=timeout) as temporary:
                return await self._event(request, temporary)
        return await self._event(request, session)

    async def _event(
        self, request: web.Request, session: aiohttp.ClientSession
    ) -> web.StreamResponse:
        try:
            await self.verifier.verify(request.headers.get("Authorization", ""), session)
        except Refused as exc:
            self.stats.refused += 1
            logger.warning(
                "googlechat: refused a request to {} from {}: {}; if Google Chat sent it, "
                "channels.googlechat.audience is not the app's authentication audience",
                GOOGLECHAT_WEBHOOK_PATH,
                request.remote or "-",
                exc,
            )
            return json_error(401, f"the bearer token does not verify: {exc}")
        except KeysUnavailable as exc:
            logger.error("googlechat: cannot check a request: {}", exc)
            return json_error(503, "Google's keys cannot be fetched; the request is not checked")
        try:
            event = json.loads(await request.read())
        except ValueError:
            event = None
        if not isinstance(event, dict):
            logger.error("googlechat: a verified request whose body is not a JSON object")
            return json_error(400, "the body is not a JSON object")
        kind = str(event.get("type") or "")
        self.stats.events[kind or "unknown"] += 1
        result = translate_event(event)
        if isinstance(result, Skip):
            if kind == "REMOVED_FROM_SPACE":
                space = (event.get("space") or {}).get("name")
                logger.info("googlechat: the app was removed from {}", space)
            else:
                logger.debug("googlechat: {} skipped: {}", kind, result.reason)
            return web.json_response({})
        with logger.contextualize(session=result.session_key):
            if await self._take(result):
                return web.json_response({})
            self.stats.not_taken += 1
            return web.json_response({"text": SEND_AGAIN})

    async def _take(self, message: InboundMessage) -> bool:
        """Submit one message, in its space's order; whether it is journaled (or
        settled). Reaches the failpoint between the journal and the 200."""
        submit = self._submit
        if submit is None:
            logger.warning("googlechat: a message came while not taking any; asked to resend")
            return False
        lock = self._locks[int(hashlib.blake2b(message.chat_id.encode()).hexdigest(), 16) % _LOCKS]
        try:
            async with lock:
                ticket = await submit(message)
        except Exception as exc:  # the journal failed: the person is asked to resend
            logger.error("googlechat: message {} not journaled: {!r}", message.message_id, exc)
            return False
        if not ticket.taken:
            logger.warning("googlechat: message {} not taken; asked to resend", message.message_id)
            return False
        await failpoints.reach(BEFORE_ACK, message.session_key)
        return True

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone uploaded: `media.download` with the app's token, at most
        `max_bytes`."""
        api = self._api
        if api is None:
            raise MediaError("the Google Chat channel is not running")
        try:
            headers = await api.headers()
        except (Unreachable, NoAnswer, ChatApiError, SetupError) as exc:
            logger.warning("googlechat: no token to fetch a file: {}", exc)
            raise MediaError("the file cannot be fetched now; please send it again") from None
        return await download_capped(api.media_url(attachment.file_id), max_bytes, headers=headers)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Chat markup in messages of at most `max_message_bytes`, the
        first naming the sender in a space, in order. Raises DeliveryFailed when a
        message did not go out and may later (a reply sent again goes on from it); any
        other error when it never will (the app is not in the space)."""
        space, thread = target_of(message.chat_id, message.thread_id)
        context = message.metadata.get(META_REPLY_CONTEXT)
        mention = ""
        if isinstance(context, dict):
            mention = mention_line(str(context.get("mention") or ""))
        pieces = chat_messages(message.text, self.settings.max_message_bytes, mention=mention)
        if message.files:
            names = ", ".join(f.name for f in message.files)
            pieces.append(f"(Google Chat does not let an app send files; not sent: {names})")
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not pieces:
                logger.warning("googlechat: empty reply not sent")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            deadline = time.monotonic() + self.pacing.reply_deadline
            try:
                if done == 0 and await self._into_preview(
                    space, message, stream, pieces[0], deadline
                ):
                    done = 1
                for index in range(done, len(pieces)):
                    message_id = client_message_id(message.reply_to, f"part {index}", pieces[index])
                    await self._create(space, thread, pieces[index], message_id, deadline)
                    done = index + 1
            except (Unreachable, NoAnswer, ChatApiError, SetupError) as exc:
                if isinstance(exc, ChatApiError) and not exc.transient:
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"googlechat: {exc}", sent=done) from exc

    async def _into_preview(
        self,
        space: str,
        message: OutboundMessage,
        stream: _Stream | None,
        text: str,
        deadline: float,
    ) -> bool:
        """Turn the reply's preview (if one was shown) into its first message; False when
        there is none. Without a stream in memory (a reply sent after a restart) the
        preview's custom id is tried: a crash mid-stream leaves no second message."""
        if not self.settings.streaming or not message.reply_to:
            return False
        if stream is not None and not stream.created:
            return False
        name = preview_name(space, message.reply_to)
        try:
            await self._call(
                "edit the preview", space, lambda api: api.patch_message(name, text), deadline
            )
        except ChatApiError as exc:
            if exc.transient:
                raise
            if stream is not None:
                logger.warning("googlechat: the preview could not be edited ({}); posting", exc)
            return False
        return True

    async def _create(
        self, space: str, thread: str | None, text: str, message_id: str, deadline: float
    ) -> None:
        """Create one message, at most once (a repeat of its `messageId` is a 409)."""
        try:
            await self._call(
                "send a message",
                space,
                lambda api: api.create_message(space, text, thread=thread, message_id=message_id),
                deadline,
            )
        except ChatApiError as exc:
            if exc.status != 409:
                raise
            logger.info("googlechat: message {} had gone out already", message_id)

    async def _call(
        self,
        what: str,
        where: str,
        request: Callable[[ChatApi], Awaitable[_T]],
        deadline: float,
    ) -> _T:
        """One Chat API request, repeated after a transient failure (see `transient`)
        with backoff while `deadline` allows; the last failure raised."""
        attempt = 0
        while True:
            api = self._api
            if api is None:
                raise Unreachable("the Google Chat channel is not running")
            try:
                # A token request and an API request may each take `request_timeout`:
                # bound both to the send's deadline, under the dispatcher's 60 s.
                with anyio.fail_after(max(1.0, deadline + 5.0 - time.monotonic())):
                    return await request(api)
            except TimeoutError:  # only past the deadline: nothing is left to wait for
                raise NoAnswer(f"{what}: no answer before the reply's deadline") from None
            except (Unreachable, NoAnswer, ChatApiError) as exc:
                if not transient(exc):
                    raise
                failure: Exception = exc
            attempt += 1
            delay = min(
                self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
            )
            if time.monotonic() + delay > deadline:
                raise failure
            self.stats.retries += 1
            logger.warning(
                "googlechat: {} in {} failed ({}); retry {} in {:g}s",
                what,
                where,
                failure,
                attempt,
                delay,
            )
            await anyio.sleep(delay)

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: after `Pacing.stream_interval`
        the text so far is posted as a preview, edited at most once per interval; `send`
        with the whole reply then edits it a last time (and posts what does not fit).
        Does nothing unless `channels.googlechat.streaming` is on."""
        if not self.settings.streaming or not delta or not inbound.message_id:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            self._forget_stale_streams(now)
            space, thread = target_of(inbound.chat_id, inbound.thread_id)
            context = inbound.metadata.get(META_REPLY_CONTEXT)
            user = str(context.get("mention") or "") if isinstance(context, dict) else ""
            stream = _Stream(
                reply_to=inbound.message_id,
                space=space,
                thread=thread,
                mention=mention_line(user),
                next_edit=now + self.pacing.stream_interval,
            )
            stream.idle.set()
            self._streams[key] = stream
        stream.text += delta
        if stream.flushing or now < stream.next_edit or self._tg is None:
            return
        stream.flushing = True
        stream.idle = anyio.Event()
        self._tg.start_soon(self._flush_stream, stream)

    def _forget_stale_streams(self, now: float) -> None:
        for key, stream in list(self._streams.items()):
            if now - stream.started > self.pacing.turn_limit:
                del self._streams[key]

    async def _flush_stream(self, stream: _Stream) -> None:
        """One streaming update: a single attempt, best effort (the final `send` corrects
        whatever is shown)."""
        try:
            pieces = chat_messages(
                stream.text, self.settings.max_message_bytes, mention=stream.mention
            )
            api = self._api
            if stream.closed or not pieces or pieces[0] == stream.shown or api is None:
                return
            name = preview_name(stream.space, stream.reply_to)
            if not stream.created:
                message_id = name.rsplit("/", 1)[-1]
                try:
                    await api.create_message(
                        stream.space, pieces[0], thread=stream.thread, message_id=message_id
                    )
                except ChatApiError as exc:
                    if exc.status != 409:
                        raise
                    await api.patch_message(name, pieces[0])  # left by an earlier run
                stream.created = True
            else:
                await api.patch_message(name, pieces[0])
            stream.shown = pieces[0]
        except (Unreachable, NoAnswer, ChatApiError, SetupError) as exc:
            logger.debug("googlechat: streaming update skipped: {}", exc)
        finally:
            stream.next_edit = max(stream.next_edit, time.monotonic() + self.pacing.stream_interval)
            stream.flushing = False
            stream.idle.set()

    async def _finish_stream(self, message: OutboundMessage) -> _Stream | None:
        """The stream showing this reply, once no update of it is in flight."""
        stream = self._streams.get(message.session_key)
        if stream is None or stream.reply_to != message.reply_to:
            return None
        del self._streams[message.session_key]
        stream.closed = True
        with anyio.move_on_after(self.pacing.stop_timeout):
            await stream.idle.wait()
        return stream


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True, slots=True)
class GoogleChatCheck:
    """What `gateway doctor` learned: the service account, the spaces the app is in (or
    why they could not be listed), and whether Google's keys for the audience answer."""

    account: str
    spaces: tuple[Space, ...]
    spaces_problem: str
    keys_problem: str


async def check_credentials(settings: GoogleChatSettings) -> GoogleChatCheck:
    """`gateway doctor`: the key parsed, an access token obtained, the app's spaces listed
    (`GET /v1/spaces`: the Chat API enabled and the app configured), Google's keys for
    the audience fetched. Raises SetupError saying what to fix."""
    key = settings.resolved_key()
    if not key:
        raise SetupError(f"googlechat: set {ENV_PREFIX}SERVICE_ACCOUNT_KEY_FILE")
    account = ServiceAccount.from_json(key)
    tokens = AccessTokens(account)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        try:
            await tokens.get(session)
        except (Unreachable, NoAnswer, ChatApiError) as exc:
            raise SetupError(
                f"googlechat: cannot get an access token from {account.token_uri} ({exc})"
            ) from None
        api = ChatApi(session, settings.api_url, lambda: tokens.get(session))
        spaces: tuple[Space, ...] = ()
        problem = ""
        try:
            spaces = tuple(await api.spaces())
        except ChatApiError as exc:
            problem = str(exc)
        except (Unreachable, NoAnswer) as exc:
            problem = f"cannot reach the Chat API at {settings.api_url} ({exc})"
        verifier = BearerVerifier(
            settings.audience or "0",
            chat_certs_url=settings.chat_certs_url,
            google_certs_url=settings.google_certs_url,
        )
        keys_problem = ""
        try:
            await verifier.prefetch(session)
        except KeysUnavailable as exc:
            keys_problem = str(exc)
    return GoogleChatCheck(account.client_email, spaces, problem, keys_problem)
