"""The Microsoft Teams channel: the Bot Framework protocol, activities in on the gateway's
own HTTP port (`POST /api/messages`), replies out through the Bot Connector's REST API at
each activity's `serviceUrl`, both over the gateway's aiohttp.

Why no Microsoft library: the channel was tried with `microsoft-agents-hosting-aiohttp`
1.9 (the Microsoft 365 Agents SDK, the Bot Framework SDK's successor; `botbuilder-python`
4.17 is in maintenance and does the same). Its `CloudAdapter` runs the whole turn inside
the HTTP request and answers 202 afterwards; when the turn fails (the journal refused the
message) its default error handler sends the user "Exception caught : <the error>" and
still answers 202, so Teams is told it was delivered while nothing was kept. Its token
check reads the signing keys from URLs fixed per issuer (no fake issuer can stand in for
Microsoft's), does not check the key's `endorsements` for the channel, and only logs a
`serviceurl` that differs from the activity's; `botbuilder-python` reads the keys with
blocking `requests` calls on the event loop, and both fetch an outbound token (MSAL,
blocking HTTP) before an inbound activity can even be taken. The protocol itself is small:
a JWT to verify (PyJWT, `channels.teams.auth`), three REST calls (`channels.teams.
connector`) and the activity's JSON (`channels.teams.translate`); written directly, every
acknowledgement Teams gets is the gateway's own.

Session keys and where replies go: see `channels.teams.translate`.

Promises (tested in tests/test_teams*.py and the conformance kit):
- Every POST is checked before anything else is done with it (`channels.teams.auth.
  verify_activity`): no token or a bad one is a 401, a real token for another channel or
  service URL a 403, and nothing of the body is used.
- Journal before the 200: an activity is answered 200 only once `submit` returned with
  the message taken (journaled, or settled: a duplicate, a refusal, something skipped);
  otherwise 503. A stopping gateway still takes them: Teams would not send them to
  the next start, so the dispatcher journals them for it (`redelivers = False`).
- What Teams does with a 503, a refused connection or no answer within its 15 seconds:
  it sends the activity again, about once, and then never (it keeps nothing for a bot,
  and a bot cannot read back what it missed). An activity id seen twice is answered once
  (the journal dedupes `<conversation>:<activity id>`). So a message Teams handed over is
  answered; a message sent while the gateway was down longer than that retry is lost to
  it, and docs/teams.md says so.
- A part of a reply is sent at most once: a request is repeated only when it certainly
  did not take effect (no connection, 412, 429 after its Retry-After, 502, 503, 504),
  within `Pacing.retry_window`; after that `send` raises `DeliveryFailed` and the
  dispatcher sends the reply again later, from the part that failed. A request that got
  no answer is not repeated (it may have been posted).
- Nothing the model writes notifies anyone: a mention needs an entity, and the only one
  the channel adds is the sender's, at the start of a reply in a group chat or channel.

Replies are Teams Markdown in messages of at most `max_message_chars`; with `streaming`
the first is posted early and updated as the text grows. "Typing..." shows while a turn
runs. Files a person sends in a personal chat and pasted images become attachments; a
reply's images (PNG, JPEG or GIF up to 1 MB) go inline, other files are named in a line
(a bot can send a file only through a consent card the person accepts, which the gateway
does not do).
"""

from __future__ import annotations

import base64
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from loguru import logger

from channels.teams.auth import (
    AuthError,
    BotToken,
    ConnectorKeys,
    KeysUnavailable,
    TokenError,
    verify_activity,
)
from channels.teams.connector import Connector, ConnectorError
from channels.teams.format import mention_entity, mention_prefix, teams_messages
from channels.teams.settings import TOKEN_SCOPE, TeamsSettings
from channels.teams.translate import (
    CHANNEL,
    TEAMS_CHANNEL_ID,
    Skip,
    join_conversation,
    split_conversation,
    tenant_of,
    translate_activity,
)
from channels.typing_indicators import TypingIndicators
from gateway import failpoints
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_EDIT_OF,
    META_REPLY_CONTEXT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from gateway.registry import Mount

ENV_PASSWORD = "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD"
#: The largest activity read (Teams' own stay far below it).
BODY_LIMIT = 1024 * 1024
#: Images a reply carries inline: Teams shows PNG, JPEG and GIF up to 1 MB.
INLINE_IMAGE_LIMIT = 1024 * 1024
INLINE_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif"})
_REMEMBERED = 10_000


class TeamsSetupError(Exception):
    """The bot cannot work as configured (the sign-in service refused its credentials);
    says what to fix and never carries the secret."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to Teams (seconds)."""

    retry_window: float = 45.0  # a reply rides out an outage this long, then DeliveryFailed
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    rate_limit_wait: float = 45.0  # the longest a request waits out 429s in all
    request_timeout: float = 20.0
    typing_interval: float = 3.0  # Teams shows "typing" for a few seconds
    typing_grace: float = 0.5  # no indicator for replies faster than this
    turn_limit: float = 600.0  # the longest a turn is shown as typing (or streaming)
    stream_interval: float = 1.5  # at most one streaming update per this
    stop_timeout: float = 10.0


@dataclass
class Stats:
    """What the channel counts (`gateway_teams_*` on /metrics)."""

    refused: dict[str, int] = field(default_factory=lambda: {"401": 0, "403": 0})
    throttled: int = 0  # 429s from the connector
    edits: int = 0


@dataclass(frozen=True, slots=True)
class Target:
    """Where a reply goes: the service URL, the conversation (a channel thread's id with
    `;messageid=`), the activity it answers and the sender it names in a group."""

    service_url: str
    conversation: str
    activity: str | None = None
    sender_id: str = ""
    sender_name: str = ""


@dataclass
class _Stream:
    """A reply shown while it is written: one message, updated as text arrives."""

    reply_to: str | None
    target: Target
    next_edit: float
    text: str = ""
    shown: str = ""
    activity_id: str | None = None
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


def target_of(message: OutboundMessage, known: Mapping[str, str], default_url: str) -> Target:
    """Where `message` goes: the reply context its inbound message carried (service URL,
    conversation, activity, sender), else its chat and thread at the service URL last
    seen for the conversation (or `default_url`)."""
    context = message.metadata.get(META_REPLY_CONTEXT)
    if isinstance(context, Mapping) and context.get("service_url") and context.get("conversation"):
        found = context.get("sender")
        sender: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        return Target(
            str(context["service_url"]),
            str(context["conversation"]),
            str(context.get("activity") or "") or None,
            str(sender.get("id") or ""),
            str(sender.get("name") or ""),
        )
    conversation = join_conversation(message.chat_id, message.thread_id)
    base, _ = split_conversation(conversation)
    return Target(known.get(base) or default_url, conversation)


def certainly_not_sent(exc: BaseException) -> bool:
    """A failure after which the request certainly did not take effect, and may later."""
    if isinstance(exc, TokenError):
        return not exc.final
    return isinstance(exc, ConnectorError) and exc.kind == "retry"


class TeamsChannel:
    """The Teams adapter (Channel protocol); see the module docstring."""

    name = CHANNEL
    #: Teams sends an unanswered activity again about once, and never to a later start:
    #: the dispatcher keeps what comes while the gateway stops (`gateway.channel`).
    redelivers = False

    def __init__(
        self,
        settings: TeamsSettings,
        *,
        password: str,
        pacing: Pacing | None = None,
    ) -> None:
        if not settings.app_id:
            raise ConfigError(
                "channels.teams.app_id: set it to the bot's Microsoft App ID (Azure Bot > "
                "Configuration); see docs/teams.md"
            )
        if not password:
            raise ConfigError(
                f"channels.teams: set {ENV_PASSWORD} (or app_password_file) to a client secret "
                "of the bot's app registration; see docs/teams.md"
            )
        self.settings = settings
        self.app_id = settings.app_id
        self.pacing = pacing or Pacing()
        self.stats = Stats()
        self._session: aiohttp.ClientSession | None = None
        self.keys = ConnectorKeys(settings.openid_metadata_url, self._http)
        self.token = BotToken(
            settings.resolved_token_url(), settings.app_id, password, TOKEN_SCOPE, self._http
        )
        self.connector = Connector(self.token, self._http)
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._mounted = False
        #: conversation -> the service URL of its last activity (for replies to nothing)
        self._service_urls: OrderedDict[str, str] = OrderedDict()
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED)
        self._typing = TypingIndicators[tuple[str, str]](self._send_typing)
        self._streams: dict[str, _Stream] = {}

    @classmethod
    def from_settings(cls, settings: TeamsSettings) -> TeamsChannel:
        return cls(settings, password=settings.resolved_password() or "")

    @property
    def live(self) -> bool:
        return self._submit is not None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.pacing.request_timeout)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> bool:
        """Route the messaging endpoint on the daemon's server to this channel; before it
        runs."""
        # Not gated while the gateway drains: Teams would not send an activity to the
        # next start, so the channel takes it (the handler answers 503 until it runs).
        http.mount("POST", self.settings.endpoint_path, self._webhook, require_ready=False)
        self._mounted = True
        return True

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Read the signing keys and get a token, then take activities until cancelled.
        Raises TeamsSetupError when the sign-in service refuses the credentials."""
        if not self._mounted:
            raise RuntimeError("teams: mount(daemon.http) was never called")
        try:
            await self._warm_up()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._submit = submit
                logger.info(
                    "teams: bot {} takes activities at POST {}",
                    self.app_id,
                    self.settings.endpoint_path,
                )
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._submit = None
            self._tg = None
            with anyio.CancelScope(shield=True):
                if self._session is not None:
                    await self._session.close()
                    self._session = None

    async def _warm_up(self) -> None:
        """The keys and a first token, so the first activity waits for neither; what is
        unreachable now is tried again when needed (a refused secret ends the channel)."""
        try:
            await self.keys.refresh()
        except KeysUnavailable as exc:
            logger.warning("teams: {}; tried again with the first activity", exc)
        try:
            await self.token.get()
        except TokenError as exc:
            if exc.final:
                raise TeamsSetupError(_credentials_hint(str(exc), self.settings)) from None
            logger.warning("teams: no access token yet ({}); tried again with the first reply", exc)

    # ----------------------------------------------------------------- inbound

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One activity from the Bot Connector; see the module docstring for the answers."""
        authorization = request.headers.get("Authorization", "")
        if not authorization:
            self.stats.refused["401"] += 1
            return json_error(401, "no Authorization header: activities come signed by Teams")
        body = await _read_capped(request, BODY_LIMIT)
        if body is None:
            return json_error(413, f"the body is over {BODY_LIMIT} bytes")
        try:
            activity = json.loads(body)
        except ValueError:
            activity = None
        try:
            await verify_activity(
                authorization,
                activity if isinstance(activity, dict) else {},
                self.keys,
                self.app_id,
            )
        except AuthError as exc:
            self.stats.refused[str(exc.status)] = self.stats.refused.get(str(exc.status), 0) + 1
            logger.warning(
                "teams: refused an activity from {}: {} (HTTP {})",
                request.remote or "-",
                exc.reason,
                exc.status,
            )
            return json_error(exc.status, exc.reason)
        except KeysUnavailable as exc:
            logger.error("teams: {}; the activity is answered 503", exc)
            return json_error(503, "the signing keys cannot be read now", {"Retry-After": "5"})
        if not isinstance(activity, dict):
            return json_error(400, "the body is not a JSON activity")
        submit = self._submit
        if submit is None:
            return json_error(
                503, "the Teams channel is not taking activities", {"Retry-After": "5"}
            )
        self._remember_service_url(activity)
        if activity.get("type") == "invoke":
            return web.json_response({}, status=200)  # no cards that ask for anything
        tenant = self.settings.tenant_id
        if tenant and tenant_of(activity) and tenant_of(activity).lower() != tenant.lower():
            logger.warning("teams: an activity from tenant {} ignored", tenant_of(activity))
            return web.Response(status=200)
        result = translate_activity(activity)
        if isinstance(result, Skip):
            logger.debug("teams: activity {} skipped: {}", activity.get("id"), result.reason)
            return web.Response(status=200)
        with logger.contextualize(session=result.session_key):
            try:
                ticket = await submit(result)
            except Exception as exc:  # the journal failed: Teams must send it again
                logger.error("teams: an activity could not be kept ({!r}); answering 503", exc)
                return json_error(503, "the gateway could not keep the activity")
            if not ticket.taken:
                return json_error(503, "the gateway could not keep the activity; send it again")
            # A kill here leaves the message journaled and Teams without its 200.
            await failpoints.reach("teams.before_ack", result.session_key)
        if META_EDIT_OF in result.metadata:
            self.stats.edits += 1
        context = result.metadata.get(META_REPLY_CONTEXT) or {}
        where = (str(context.get("service_url") or ""), str(context.get("conversation") or ""))
        self._spawn(self._typing_while_pending, ticket, where)
        return web.Response(status=200)

    def _remember_service_url(self, activity: Mapping[str, Any]) -> None:
        """The service URL of a conversation, for messages that answer no activity."""
        url = activity.get("serviceUrl")
        conversation = (activity.get("conversation") or {}).get("id")
        if not isinstance(url, str) or not url or not isinstance(conversation, str):
            return
        base, _ = split_conversation(conversation)
        if base not in self._service_urls:
            # The id operators put in `allow_from` to let a group chat or channel in.
            kind = (activity.get("conversation") or {}).get("conversationType") or "personal"
            logger.info("teams: an activity from {} {}", kind, base)
        self._service_urls[base] = url
        self._service_urls.move_to_end(base)
        while len(self._service_urls) > _REMEMBERED:
            self._service_urls.popitem(last=False)

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- typing

    async def _typing_while_pending(self, ticket: Ticket, where: tuple[str, str]) -> None:
        if not all(where):
            return
        await self._typing.while_pending(
            ticket,
            where,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_interval,
            limit=self.pacing.turn_limit,
        )

    async def _send_typing(self, where: tuple[str, str]) -> None:
        service_url, conversation = where
        try:
            await self.connector.send(service_url, conversation, {"type": "typing"})
        except (ConnectorError, TokenError) as exc:
            logger.debug("teams: typing indicator failed: {}", exc)

    # ----------------------------------------------------------------- outbound

    def _activity(self, text: str, target: Target, *, first: bool) -> dict[str, Any]:
        activity: dict[str, Any] = {"type": "message", "text": text, "textFormat": "markdown"}
        if first and target.sender_id:
            activity["entities"] = [mention_entity(target.sender_id, target.sender_name)]
        if target.activity:
            activity["replyToId"] = target.activity
        return activity

    def _pieces(self, message: OutboundMessage, target: Target) -> list[str]:
        prefix = mention_prefix(target.sender_name) if target.sender_id else ""
        return teams_messages(message.text, self.settings.max_message_chars, mention=prefix)

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Teams Markdown in messages of at most `max_message_chars`, the
        first naming the sender in a group, in order, then its files. Raises
        DeliveryFailed when a message certainly did not go out and may later (a reply
        sent again goes on from there); TeamsSetupError or ConnectorError when it never
        will or may have gone out. No message after a failed one is sent."""
        target = target_of(message, self._service_urls, self.settings.service_url)
        pieces = self._pieces(message, target)
        stream = await self._finish_stream(message)
        with logger.contextualize(session=message.session_key):
            if not pieces and not message.files:
                logger.warning("teams: empty reply not sent")
                return
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            first = 0
            try:
                shown = stream.activity_id if stream is not None else None
                if pieces and shown is not None and done == 0:
                    await self._call(
                        "update a message",
                        lambda: self.connector.update(
                            target.service_url,
                            target.conversation,
                            shown,
                            self._activity(pieces[0], target, first=True),
                        ),
                    )
                    first = done = 1
                for index in range(max(first, done), len(pieces)):
                    activity = self._activity(pieces[index], target, first=index == 0)
                    await self._call("send a message", self._poster(target, activity))
                    done = index + 1
                for number, file in enumerate(message.files, start=len(pieces)):
                    if number < done:
                        continue
                    activity = self._file_activity(file, target)
                    await self._call("send a file", self._poster(target, activity))
                    done = number + 1
            except (ConnectorError, TokenError) as exc:
                if isinstance(exc, TokenError) and exc.final:
                    raise TeamsSetupError(_credentials_hint(str(exc), self.settings)) from None
                if not certainly_not_sent(exc):
                    raise
                self._sent_parts.keep(reply, done)
                raise DeliveryFailed(f"teams: {exc}", sent=done) from exc

    def _poster(self, target: Target, activity: dict[str, Any]) -> Callable[[], Any]:
        return lambda: self.connector.send(
            target.service_url, target.conversation, activity, reply_to=target.activity
        )

    def _file_activity(self, file: OutboundFile, target: Target) -> dict[str, Any]:
        """An image inline (as a data URL), or a line naming a file Teams cannot take."""
        if file.mime_type in INLINE_IMAGE_TYPES and len(file.data) <= INLINE_IMAGE_LIMIT:
            encoded = base64.b64encode(file.data).decode("ascii")
            activity = self._activity(file.caption, target, first=False)
            activity["attachments"] = [
                {
                    "contentType": file.mime_type,
                    "contentUrl": f"data:{file.mime_type};base64,{encoded}",
                    "name": file.name,
                }
            ]
            return activity
        why = (
            "an image larger than Teams shows inline (1 MB)"
            if file.is_image
            else "a bot sends files only through a consent card, which this gateway does not"
        )
        return self._activity(f"[{file.name} not sent: {why}]", target, first=False)

    async def _call(self, what: str, request: Callable[[], Any]) -> Any:
        """Make one connector request, repeating it while that is safe and may help: a
        failure that certainly did not take effect, for up to `retry_window`; a 429 after
        its Retry-After (up to `rate_limit_wait` in all)."""
        started = time.monotonic()
        attempt = 0
        waited = 0.0
        while True:
            try:
                return await request()
            except ConnectorError as exc:
                if exc.kind != "retry":
                    raise
                failure: Exception = exc
                if exc.status == 429:
                    self.stats.throttled += 1
                    if exc.retry_after is not None:
                        waited += exc.retry_after
                        if waited > self.pacing.rate_limit_wait:
                            raise
                        logger.warning("teams: {} throttled; again in {:g}s", what, exc.retry_after)
                        await anyio.sleep(exc.retry_after)
                        continue
            except TokenError as exc:
                if exc.final:
                    raise
                failure = exc
            attempt += 1
            if time.monotonic() - started >= self.pacing.retry_window:
                raise failure
            delay = min(
                self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
            )
            logger.warning(
                "teams: {} failed ({}); retry {} in {:g}s", what, failure, attempt, delay
            )
            await anyio.sleep(delay)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: a personal chat's pre-authorized download URL as it is; a
        pasted image on the Teams service with the bot's token. At most `max_bytes`."""
        url = attachment.url or ""
        if not url.startswith(("https://", "http://")):
            raise MediaError("Teams gave no download address for the file")
        headers = None
        host = urlsplit(url).netloc.lower()
        if any(urlsplit(known).netloc.lower() == host for known in self._service_urls.values()):
            try:
                headers = {"Authorization": f"Bearer {await self.token.get()}"}
            except TokenError as exc:
                logger.warning("teams: no token to fetch a file: {}", exc)
                raise MediaError(
                    "the gateway could not sign in to Teams to fetch the file"
                ) from None
        return await download_capped(url, max_bytes, headers=headers)

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` is sent as the reply, updated at most once per interval;
        `send` with the whole reply then updates it a last time (and sends what does not
        fit). Does nothing unless `channels.teams.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            for other, old in list(self._streams.items()):
                if now - old.started > self.pacing.turn_limit:
                    del self._streams[other]
            probe = OutboundMessage(
                CHANNEL,
                inbound.chat_id,
                "",
                key,
                thread_id=inbound.thread_id,
                metadata={META_REPLY_CONTEXT: inbound.metadata.get(META_REPLY_CONTEXT)},
            )
            stream = _Stream(
                reply_to=inbound.message_id,
                target=target_of(probe, self._service_urls, self.settings.service_url),
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

    async def _flush_stream(self, stream: _Stream) -> None:
        """One streaming update: a single attempt, best effort (the final `send`
        corrects whatever is shown)."""
        try:
            target = stream.target
            prefix = mention_prefix(target.sender_name) if target.sender_id else ""
            pieces = teams_messages(stream.text, self.settings.max_message_chars, mention=prefix)
            if stream.closed or not pieces or pieces[0] == stream.shown:
                return
            activity = self._activity(pieces[0], target, first=True)
            if stream.activity_id is None:
                stream.activity_id = (
                    await self.connector.send(
                        target.service_url, target.conversation, activity, reply_to=target.activity
                    )
                    or None
                )
            else:
                await self.connector.update(
                    target.service_url, target.conversation, stream.activity_id, activity
                )
            stream.shown = pieces[0]
        except (ConnectorError, TokenError) as exc:
            logger.debug("teams: streaming update skipped: {}", exc)
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


def _credentials_hint(error: str, settings: TeamsSettings) -> str:
    return (
        f"teams: {error}; check channels.teams.app_id (the Microsoft App ID), {ENV_PASSWORD} "
        "(a client secret of that app registration, not its ID; secrets expire) and "
        f"channels.teams.tenant_id (token URL {settings.resolved_token_url()})"
    )


async def _read_capped(request: web.Request, limit: int) -> bytes | None:
    if request.content_length is not None and request.content_length > limit:
        return None
    data = bytearray()
    while chunk := await request.content.read(65536):
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True, slots=True)
class TeamsCheck:
    """What `gateway doctor` learned: the signing keys endorsed for Teams, and whether
    the sign-in service gave the bot a token."""

    keys: int
    endorsed: int
    issuer: str
    token_url: str


async def check_credentials(settings: TeamsSettings, password: str) -> TeamsCheck:
    """`gateway doctor`: the OpenID metadata and its keys (how many are endorsed for
    msteams), then a token with the App ID and secret. Raises TeamsSetupError saying what
    to fix."""
    if not settings.app_id or not password:
        raise TeamsSetupError(f"teams: set channels.teams.app_id and {ENV_PASSWORD}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        keys = ConnectorKeys(settings.openid_metadata_url, lambda: session)
        try:
            await keys.refresh()
        except KeysUnavailable as exc:
            raise TeamsSetupError(
                f"teams: {exc}; check the network (or openid_metadata_url)"
            ) from None
        token = BotToken(
            settings.resolved_token_url(), settings.app_id, password, TOKEN_SCOPE, lambda: session
        )
        try:
            await token.get()
        except TokenError as exc:
            if exc.final:
                raise TeamsSetupError(_credentials_hint(str(exc), settings)) from None
            raise TeamsSetupError(f"teams: {exc}; check the network (or token_url)") from None
    return TeamsCheck(
        keys.count(), keys.count(TEAMS_CHANNEL_ID), keys.issuer, settings.resolved_token_url()
    )
