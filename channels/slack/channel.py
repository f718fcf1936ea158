"""The Slack adapter: slack-bolt (async) events in, Web API replies out.

Events arrive over Socket Mode (the default: an app-level `xapp-` token, no public URL)
or over HTTP at the daemon's `POST /slack/events` (`mount`), where bolt checks Slack's
signature and answers url_verification. The adapter takes `app_mention` in channels
and `message` in direct messages, turns each into an `InboundMessage` with
`translate_event` and submits it; it never calls the LLM itself.

Where a conversation lives (the session key) and where its replies go:
- A direct message: `slack:<D...>`, answered in the DM itself; a message in a DM
  thread: `slack:<D...>:thread:<thread_ts>`, answered in that thread.
- A mention inside a thread: `slack:<C...>:thread:<thread_ts>`, answered in the thread.
- A top-level mention with `reply_mode = "thread"`: the answer starts a thread under
  the mention, and the mention already belongs to that thread's session
  (`slack:<C...>:thread:<mention ts>`), so a follow-up in the thread continues the
  same conversation. With `reply_mode = "channel"`: `slack:<C...>`, answered in the
  channel.
- In a channel, a reply that is not posted under its message (in a thread someone else
  opened, or in the channel itself) begins with a mention of whom it answers: Slack has
  no reply to one message inside a conversation several people share.

Promises (tested in tests/test_slack*.py):
- Journal before confirm: Slack is acknowledged once the event is submitted, and
  `submit` returns once the message is in the gateway's journal (bolt runs the listener
  before it acks, `process_before_response=True`), never after the LLM: the ack comes
  well inside Slack's 3 s, and a message Slack considers delivered survives a crash.
  An event the gateway could not journal, or that arrives while it drains
  (`pause_intake`), is not acknowledged (HTTP 503, or no Socket Mode ack), so Slack
  sends it again.
- An event is taken once: its message id is Slack's `event_id`, which a retry
  (`X-Slack-Retry-Num`, a Socket Mode `retry_attempt`) keeps, and the dispatcher
  drops ids it has seen, across restarts too.
- The bot never answers itself or another bot: messages with a `bot_id`, from the
  bot's user, or with a subtype other than file_share/thread_broadcast/message_changed
  (deletions, joins) are ignored.
- A `message_changed` in a DM whose text changed is submitted as an edit: the message
  id is the event's, `META_EDIT_OF` names the changed message (`channel:ts`), and the
  agent re-runs the latest turn from it. So is the `app_mention` Slack sends again, with
  `edited` and an event id of its own, when a mention in a channel is edited. Unfurls
  (same text) and other edits outside DMs are ignored.
- A reply is posted in order, in parts of at most `part_chars` characters (see
  `channels.slack.format`), each part at most once: a part Slack confirmed is never
  sent again; rate-limited calls wait for `Retry-After`; failures Slack did not act on
  are retried with backoff; after a failure that may have posted the part (a 5xx, a
  timeout) the conversation is read back and the part is re-sent only if it is not
  there. All of it within `RetryPolicy.reply_deadline`. A part that certainly did not
  go out by then (Slack or the network down, rate limited for longer) raises
  `DeliveryFailed`, and the dispatcher sends the reply again later, which goes on from
  that part; a part Slack refused (a channel that is gone) is logged, and the rest of
  its reply is dropped.
- With streaming on, a reply is one message posted at the first delta and edited at
  most once per `stream_interval`; `send` finalizes that message instead of posting
  the reply again.
- Files shared with a message become its attachments (references; `fetch_file`
  downloads them with the bot token when the turn starts). A reply's files are uploaded
  after its text, once (see docs/media.md). In channels, `enrich_for_turn` adds the
  sender's name and a thread's parent message when the turn starts, never before the
  ack.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from loguru import logger
from pydantic import SecretStr
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.app.async_app import AsyncApp
from slack_bolt.context.async_context import AsyncBoltContext
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from channels.slack.format import (
    DEFAULT_PART_CHARS,
    markdown_to_mrkdwn,
    preview,
    slack_to_plain,
    split_mrkdwn,
)
from channels.slack.settings import SlackSettings
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.http import json_error
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_QUOTED_SENDER,
    META_QUOTED_TEXT,
    META_REPLY_CONTEXT,
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
SLACK_EVENTS_PATH = "/slack/events"

CHANNEL = "slack"
THREAD_KIND = "thread"
DEFAULT_API_URL = "https://slack.com/api/"
ENV_PREFIX = "GATEWAY_CHANNELS__SLACK__"

#: Message subtypes that are a person writing; every other subtype is ignored.
PERSON_SUBTYPES = frozenset({"file_share", "thread_broadcast"})
#: The subtype of an edit: a person's edit of their own DM message re-runs the latest turn.
EDIT_SUBTYPE = "message_changed"
# Errors with which Slack says it did not carry the call out, and those after which
# it may have (Slack's docs: "it's possible some aspect of the operation succeeded").
_NOT_DONE_ERRORS = frozenset({"service_unavailable", "request_timeout", "ratelimited"})
_MAYBE_DONE_ERRORS = frozenset({"internal_error", "fatal_error"})
_STREAM_TTL = 600.0  # a stream whose reply never came is forgotten after this long
_USER_ID = re.compile(r"[UW][A-Z0-9]{2,20}")

ReplyMode = Literal["thread", "channel"]


class SlackCredentialsError(Exception):
    """Slack refused the tokens or could not be reached; the message says what to do."""


class EventNotTaken(Exception):
    """The gateway did not keep an event (journal failure, or draining): it is not
    acknowledged, so Slack delivers it again."""


# --------------------------------------------------------------------------- inbound


@dataclass(frozen=True, slots=True)
class Skipped:
    """An event the adapter does not submit, and why (logged at debug)."""

    reason: str


def _ts_seconds(ts: str) -> float | None:
    try:
        return float(ts)
    except ValueError:
        return None


def _edited_message(event: Mapping[str, Any]) -> Mapping[str, Any] | Skipped:
    """The message a `message_changed` event carries, when it is a person's edit of
    their text in a DM. Slack also sends `message_changed` when it unfurls a link or
    adds metadata to a message (the text stays the same): that is not an edit."""
    if event.get("channel_type") != "im":
        return Skipped("an edit outside DMs")
    message, previous = event.get("message"), event.get("previous_message")
    if not isinstance(message, Mapping) or not isinstance(message.get("ts"), str):
        return Skipped("message_changed without the message")
    if isinstance(previous, Mapping) and previous.get("text") == message.get("text"):
        return Skipped("message_changed without a change of text (an unfurl)")
    return {**message, "channel": event.get("channel"), "channel_type": "im"}


def translate_event(
    body: Mapping[str, Any], *, bot_user_id: str | None, reply_mode: ReplyMode
) -> InboundMessage | Skipped:
    """The inbound message for one Events API payload (`event_callback`), or why not.

    Pure: the whole policy of which events are answered, their session keys and
    where the replies go (see the module docstring) lives here.
    """
    event = body.get("event")
    if not isinstance(event, Mapping):
        return Skipped("no event in the payload")
    kind, channel = event.get("type"), event.get("channel")
    if not isinstance(channel, str) or not channel:
        return Skipped(f"{kind} without a channel")
    edit_of: str | None = None
    if kind == "app_mention":
        if channel.startswith("D"):
            return Skipped("a mention in a DM also arrives as message.im")
        is_dm = False
        if isinstance(event.get("edited"), Mapping) and isinstance(event.get("ts"), str):
            edit_of = f"{channel}:{event['ts']}"  # Slack sends an edited mention again
    elif kind == "message":
        if event.get("channel_type") != "im":
            return Skipped("outside DMs the bot answers mentions only")
        is_dm = True
    else:
        return Skipped(f"{kind} events are not handled")
    subtype = event.get("subtype")
    if subtype == EDIT_SUBTYPE:
        edited = _edited_message(event)
        if isinstance(edited, Skipped):
            return edited
        event, edit_of = edited, f"{channel}:{edited['ts']}"
        subtype = event.get("subtype")
    if subtype is not None and subtype not in PERSON_SUBTYPES:
        return Skipped(f"message subtype {subtype}")
    user, ts = event.get("user"), event.get("ts")
    if event.get("bot_id") or event.get("bot_profile"):
        return Skipped("posted by a bot")
    if not isinstance(user, str) or not user or (bot_user_id and user == bot_user_id):
        return Skipped("the bot's own message" if user else "no sender")
    if not isinstance(ts, str) or not ts:
        return Skipped("no message ts")
    text = slack_to_plain(str(event.get("text") or ""), bot_user_id)
    files = event_attachments(event)
    if not text and not files:
        return Skipped("no text (only a mention)")
    thread_ts = event.get("thread_ts")
    if not isinstance(thread_ts, str) or not thread_ts:
        thread_ts = ts if (not is_dm and reply_mode == "thread") else None
    metadata: dict[str, Any] = {
        META_IS_GROUP: not is_dm,
        META_MENTIONED: kind == "app_mention",
        META_REPLY_TO_BOT: bool(bot_user_id) and event.get("parent_user_id") == bot_user_id,
        "slack_ts": ts,
        "slack_team": body.get("team_id"),
    }
    if not is_dm and thread_ts != ts:
        # Not answered under the message itself: the reply names whom it answers.
        metadata[META_REPLY_CONTEXT] = {"mention": user}
    profile = event.get("user_profile")
    if isinstance(profile, Mapping):
        name = profile.get("display_name") or profile.get("real_name")
        if name:
            metadata[META_SENDER_NAME] = str(name)
    event_id = body.get("event_id")
    metadata[META_POST_ID] = f"{channel}:{ts}"
    metadata[META_SENT_AT] = _ts_seconds(ts)
    if edit_of is not None:
        metadata[META_EDIT_OF] = edit_of
        edited_at = event.get("edited")
        if isinstance(edited_at, Mapping) and isinstance(edited_at.get("ts"), str):
            metadata[META_SENT_AT] = _ts_seconds(edited_at["ts"])
    return InboundMessage(
        channel=CHANNEL,
        chat_id=channel,
        text=text,
        sender_id=user,
        message_id=str(event_id) if event_id else f"{channel}:{ts}",
        thread_kind=THREAD_KIND if thread_ts else None,
        thread_id=thread_ts,
        metadata=metadata,
        attachments=files,
    )


def event_attachments(event: Mapping[str, Any]) -> tuple[Attachment, ...]:
    """The files shared with a message, as references the agent fetches at turn time
    (an image, audio to transcribe, or a document)."""
    found = []
    for file in event.get("files") or ():
        if not isinstance(file, Mapping) or not isinstance(file.get("id"), str):
            continue
        mime = str(file.get("mimetype") or "")
        kind = (
            "image"
            if mime.startswith("image/")
            else "voice"
            if mime.startswith("audio/") or file.get("subtype") == "slack_audio"
            else "document"
        )
        size = file.get("size")
        url = file.get("url_private_download") or file.get("url_private")
        found.append(
            Attachment(
                kind,
                file["id"],
                str(file.get("name") or file.get("title") or "file"),
                mime,
                size if isinstance(size, int) else None,
                str(url) if url and file.get("file_access") != "check_file_info" else None,
            )
        )
    return tuple(found)


def _looks_like_html(data: bytes) -> bool:
    head = data[:64].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html"))


def addressee(message: OutboundMessage) -> str | None:
    """The user a reply begins by mentioning (see `translate_event`), if any."""
    context = message.metadata.get(META_REPLY_CONTEXT)
    user = context.get("mention") if isinstance(context, Mapping) else None
    return user if isinstance(user, str) and _USER_ID.fullmatch(user) else None


def address_of(message: OutboundMessage) -> tuple[str, str | None]:
    """(Slack channel, thread_ts or None) of a reply. A heartbeat's `deliver_to` may
    name a thread in the chat id: `C123:thread:1712345678.000100`."""
    chat, separator, thread_ts = message.chat_id.partition(f":{THREAD_KIND}:")
    if separator:
        return chat, thread_ts or None
    return chat, message.thread_id


# --------------------------------------------------------------------------- outbound


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard one reply tries. Rate limits wait `Retry-After` and do not count as
    attempts; other retryable failures back off from `backoff` seconds, doubling up to
    `max_backoff`, for at most `attempts` tries per call. Nothing waits past
    `reply_deadline` seconds after `send` began (keep it under the dispatcher's
    delivery timeout of 60 s, which would cancel the send)."""

    attempts: int = 4
    backoff: float = 1.0
    max_backoff: float = 8.0
    reply_deadline: float = 50.0


#: Replies cut short by a failure, remembered until they are sent again.
_CUT_SHORT = 1_000


class _Kind(enum.Enum):
    RATE_LIMITED = "rate limited"
    NOT_DONE = "failed"  # Slack did not carry the call out
    MAYBE_DONE = "failed, maybe after acting"
    PERMANENT = "refused"


@dataclass(frozen=True, slots=True)
class _Failure:
    kind: _Kind
    detail: str
    retry_after: float = 1.0

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


def _classify(exc: Exception) -> _Failure:
    if isinstance(exc, SlackApiError):
        response = exc.response
        data = response.data if isinstance(response.data, dict) else {}
        error = str(data.get("error") or "")
        status = response.status_code
        detail = f"{error or 'no error code'} (HTTP {status})"
        if status == 429 or error == "ratelimited":
            return _Failure(_Kind.RATE_LIMITED, detail, _retry_after(response))
        if error in _NOT_DONE_ERRORS or status == 503:
            return _Failure(_Kind.NOT_DONE, detail)
        if error in _MAYBE_DONE_ERRORS or status >= 500:
            return _Failure(_Kind.MAYBE_DONE, detail)
        return _Failure(_Kind.PERMANENT, detail)
    if isinstance(exc, aiohttp.ClientConnectorError):  # never connected: nothing sent
        return _Failure(_Kind.NOT_DONE, f"cannot connect ({exc.os_error})")
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        return _Failure(_Kind.MAYBE_DONE, f"{type(exc).__name__} {exc}".strip())
    return _Failure(_Kind.PERMANENT, f"{type(exc).__name__}: {exc}")


def _retry_after(response: AsyncSlackResponse) -> float:
    try:
        return max(0.0, float(response.headers.get("Retry-After", 1)))
    except (TypeError, ValueError):
        return 1.0


class Delivery(enum.Enum):
    POSTED = "posted"
    UNCERTAIN = "maybe posted"  # could not tell; not re-sent, so never posted twice
    FAILED = "not posted"  # certainly not, and it may be later
    REFUSED = "refused"  # Slack will never take it


@dataclass(slots=True)
class _Stream:
    """A reply being streamed into one Slack message."""

    channel: str
    thread_ts: str | None
    started: float
    text: str = ""
    ts: str | None = None
    shown: str = ""
    last_edit: float = 0.0
    broken: bool = False
    lock: anyio.Lock = field(default_factory=anyio.Lock)


@dataclass(frozen=True, slots=True)
class SlackIdentity:
    """Who the bot is, from auth.test."""

    team: str
    team_id: str
    user: str
    user_id: str
    bot_id: str

    def describe(self) -> str:
        return f"bot @{self.user} ({self.user_id}) in workspace {self.team} ({self.team_id})"


async def _auth_test(client: AsyncWebClient) -> SlackIdentity:
    """auth.test; raises SlackCredentialsError saying what to fix."""
    try:
        answer = await client.auth_test()
    except SlackApiError as exc:
        error = exc.response.get("error") if isinstance(exc.response.data, dict) else None
        hint = {
            "invalid_auth": f"the bot token was refused; check {ENV_PREFIX}BOT_TOKEN",
            "not_authed": f"no bot token; set {ENV_PREFIX}BOT_TOKEN",
            "account_inactive": "the app was uninstalled or its bot deactivated; reinstall it",
            "token_revoked": "the bot token was revoked; reinstall the app for a new one",
            "not_allowed_token_type": (
                f"{ENV_PREFIX}BOT_TOKEN must be the Bot User OAuth Token (xoxb-...)"
            ),
        }.get(str(error), f"Slack answered {error or exc.response.status_code}")
        raise SlackCredentialsError(f"slack: {hint}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise SlackCredentialsError(
            f"slack: cannot reach {client.base_url} ({type(exc).__name__}: {exc}); "
            "check the network, or channels.slack.base_url"
        ) from None
    return SlackIdentity(
        team=str(answer.get("team") or ""),
        team_id=str(answer.get("team_id") or ""),
        user=str(answer.get("user") or ""),
        user_id=str(answer.get("user_id") or ""),
        bot_id=str(answer.get("bot_id") or ""),
    )


async def _bolt_request(request: web.Request) -> AsyncBoltRequest | None:
    """The request as bolt reads it, or None (logged, no traceback) when its body is
    not one: bolt parses the body while building its request, and its field lookups
    fail on JSON that is not an object."""
    try:
        return await to_bolt_request(request)
    except (ValueError, AttributeError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
        logger.warning(
            "slack: refused an events request whose body is not a JSON object ({})",
            type(exc).__name__,
        )
        return None


def _web_client(settings: SlackSettings, token: str) -> AsyncWebClient:
    # No retry handlers: `SlackChannel` decides itself what may be retried.
    base_url = settings.base_url or DEFAULT_API_URL
    return AsyncWebClient(
        token=token, base_url=base_url.rstrip("/") + "/", retry_handlers=[], timeout=20
    )


async def check_credentials(
    settings: SlackSettings, bot_token: str, *, app_token: str | None = None
) -> str:
    """For `gateway doctor`: who the bot token belongs to (auth.test), and, with an
    app token, that Socket Mode can connect (apps.connections.open). Raises
    SlackCredentialsError with what to fix."""
    if not bot_token:
        raise SlackCredentialsError(f"slack: no bot token; set {ENV_PREFIX}BOT_TOKEN")
    identity = await _auth_test(_web_client(settings, bot_token))
    description = f"Slack: {identity.describe()}"
    if app_token:
        try:
            await _web_client(settings, app_token).apps_connections_open(app_token=app_token)
        except SlackApiError as exc:
            error = exc.response.get("error") if isinstance(exc.response.data, dict) else None
            raise SlackCredentialsError(
                f"slack: the app-level token was refused ({error}); {ENV_PREFIX}APP_TOKEN "
                "must be an xapp- token with the connections:write scope, and Socket Mode "
                "must be enabled for the app"
            ) from None
        description += ", Socket Mode ok"
    return description


# --------------------------------------------------------------------------- channel


class SlackChannel:
    """The Slack platform adapter (Channel protocol); see the module docstring."""

    name = CHANNEL

    def __init__(
        self,
        settings: SlackSettings,
        *,
        bot_token: str,
        app_token: str | None = None,
        signing_secret: str | None = None,
        retry: RetryPolicy | None = None,
        part_chars: int = DEFAULT_PART_CHARS,
        stream_interval: float = 1.0,
    ) -> None:
        _check_tokens(settings, bot_token, app_token, signing_secret)
        split_mrkdwn("", part_chars)  # validates the limit
        self.settings = settings
        self.mode = settings.mode
        self.reply_mode: ReplyMode = settings.reply_mode
        self.retry = retry or RetryPolicy()
        self.part_chars = part_chars
        self.stream_interval = stream_interval
        self.client = _web_client(settings, bot_token)
        self.identity: SlackIdentity | None = None
        self._app_token = app_token
        self._signing_secret = signing_secret
        self._submit: Submit | None = None
        self._paused = False
        self._mounted = False
        self._streams: dict[str, _Stream] = {}
        #: Replies a failure cut short, by (session, reply_to, text): the parts posted.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_CUT_SHORT)
        self._bot_token = bot_token
        self._names: dict[str, str] = {}  # user id -> display name (users.info)
        self.app = AsyncApp(
            client=self.client,
            signing_secret=signing_secret or "",
            process_before_response=True,  # ack after the listener: it only submits
        )
        self.app.event("app_mention")(self._on_event)
        self.app.event("message")(self._on_event)
        self.app.error(self._on_error)

    @classmethod
    def from_settings(cls, settings: SlackSettings, **options: Any) -> SlackChannel:
        """The channel with the tokens taken from `settings`' secrets."""

        def secret(value: SecretStr | None) -> str | None:
            return (value.get_secret_value() or None) if value is not None else None

        return cls(
            settings,
            bot_token=secret(settings.bot_token) or "",
            app_token=secret(settings.app_token),
            signing_secret=secret(settings.signing_secret),
            **options,
        )

    @property
    def live(self) -> bool:
        """True while `run` is running: events that arrive are submitted."""
        return self._submit is not None

    # ----------------------------------------------------------------- intake

    def mount(self, http: Mount) -> bool:
        """HTTP mode: route Slack's Events API (`POST /slack/events`) on the daemon's
        server to this channel; call before the server runs. Socket Mode mounts
        nothing. Returns whether it mounted."""
        if self.mode != "http":
            return False
        http.mount("POST", SLACK_EVENTS_PATH, self.handle_http)
        self._mounted = True
        return True

    async def handle_http(self, request: web.Request) -> web.StreamResponse:
        """One Events API request: bolt checks the signature and its timestamp (401
        when wrong or older than 5 minutes), answers url_verification, and acks an
        event once it is journaled (see the module docstring). A body bolt cannot read
        (not UTF-8, not JSON, not an object) is a 400, before the signature is looked
        at: nothing was done."""
        if self._submit is None or self._paused:
            return json_error(
                503, "the Slack channel is not taking events; retry shortly", {"Retry-After": "5"}
            )
        bolt_request = await _bolt_request(request)
        if bolt_request is None:
            return json_error(
                400, "the body is not a JSON object (Slack sends each event as one); ignored"
            )
        response = await self.app.async_dispatch(bolt_request)
        return await to_aiohttp_response(response)

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Check the bot token, then receive events (Socket Mode: connect; HTTP: the
        mounted route) until cancelled."""
        if self.mode == "http" and not self._mounted:
            raise RuntimeError("slack: HTTP mode, but mount(daemon.http) was never called")
        self.identity = await _auth_test(self.client)
        self._submit = submit
        self._paused = False
        try:
            if self.mode == "http":
                logger.info(
                    "slack: {}; events at POST {}", self.identity.describe(), SLACK_EVENTS_PATH
                )
                task_status.started()
                await anyio.sleep_forever()
            else:
                await self._run_socket_mode(task_status)
        finally:
            self._submit = None

    async def _run_socket_mode(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        # Built here: the handler's client needs a running event loop.
        handler = AsyncSocketModeHandler(self.app, self._app_token)
        try:
            await handler.connect_async()  # type: ignore[no-untyped-call]
            assert self.identity is not None
            logger.info("slack: {}; connected over Socket Mode", self.identity.describe())
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await handler.close_async()  # type: ignore[no-untyped-call]

    def pause_intake(self) -> None:
        """Take no more events (the daemon is draining): they are not acknowledged, so
        Slack delivers them again, to the next start."""
        self._paused = True

    async def _on_event(
        self, body: dict[str, Any], context: AsyncBoltContext, request: AsyncBoltRequest
    ) -> None:
        """The bolt listener: translate and submit, nothing slow (bolt acks after it)."""
        submit = self._submit
        if submit is None or self._paused:
            raise EventNotTaken("the channel is not taking events")
        bot_user_id = context.bot_user_id or (self.identity.user_id if self.identity else None)
        message = translate_event(body, bot_user_id=bot_user_id, reply_mode=self.reply_mode)
        if isinstance(message, Skipped):
            logger.debug("slack: event {} skipped: {}", body.get("event_id"), message.reason)
            return
        with logger.contextualize(session=message.session_key):
            retry = request.headers.get("x-slack-retry-num")
            if retry and retry[0] not in ("", "0"):
                logger.info("slack: redelivery {} of event {}", retry[0], message.message_id)
            ticket = await submit(message)
            if not ticket.taken:
                raise EventNotTaken("the gateway could not keep it")

    async def _on_error(self, error: Exception, body: dict[str, Any]) -> None:
        if isinstance(error, EventNotTaken):
            logger.warning(
                "slack: event {} not acknowledged ({}); Slack sends it again",
                body.get("event_id") if body else None,
                error,
            )
            return
        logger.opt(exception=error).error(
            "slack: handling event {} failed", body.get("event_id") if body else None
        )

    # ----------------------------------------------------------------- turn time

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone shared: its url_private_download (after files.info when the
        event did not carry it), with the bot token as a bearer (needs files:read)."""
        url = attachment.url
        if url is None:
            try:
                info = await self.client.files_info(file=attachment.file_id)
            except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
                logger.warning("slack: files.info failed: {}", _classify(exc))
                raise MediaError("Slack did not hand over the file") from None
            file = info.get("file") or {}
            size = file.get("size")
            if isinstance(size, int) and size > max_bytes:
                raise MediaError(
                    f"it is {size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
                )
            url = file.get("url_private_download") or file.get("url_private")
            if not url:
                raise MediaError("Slack gave no download address for the file")
        headers = {"Authorization": f"Bearer {self._bot_token}"}
        data = await download_capped(str(url), max_bytes, headers=headers)
        if _looks_like_html(data) and "html" not in attachment.mime_type:
            # Slack's sign-in page: the token may not read files.
            logger.error("slack: a file download was refused; the app needs the files:read scope")
            raise MediaError("Slack refused to hand over the file")
        return data

    async def enrich_for_turn(self, message: InboundMessage) -> InboundMessage:
        """In a channel: the sender's display name when the event had none (users.info)
        and, for a message inside a thread, the thread's parent message
        (conversations.replies). Nothing in DMs."""
        if message.channel != CHANNEL or not message.metadata.get(META_IS_GROUP):
            return message
        metadata = dict(message.metadata)
        if not metadata.get(META_SENDER_NAME) and message.sender_id:
            metadata[META_SENDER_NAME] = await self._display_name(message.sender_id)
        own_ts = metadata.get("slack_ts")
        if message.thread_id and message.thread_id != own_ts:
            answer = await self.client.conversations_replies(
                channel=message.chat_id, ts=message.thread_id, limit=1
            )
            parents = answer.get("messages") or []
            if parents and parents[0].get("ts") == message.thread_id:
                parent = parents[0]
                text = slack_to_plain(str(parent.get("text") or ""), None)
                if text:
                    metadata[META_QUOTED_TEXT] = text
                    metadata[META_QUOTED_SENDER] = await self._author(parent)
        return dataclasses.replace(message, metadata=metadata)

    async def _author(self, message: Mapping[str, Any]) -> str:
        profile = message.get("bot_profile")
        if isinstance(profile, Mapping) and profile.get("name"):
            return str(profile["name"])
        user = message.get("user")
        return await self._display_name(str(user)) if user else ""

    async def _display_name(self, user: str) -> str:
        if user not in self._names:
            answer = await self.client.users_info(user=user)
            info = answer.get("user") or {}
            profile = info.get("profile") or {}
            self._names[user] = str(
                profile.get("display_name") or profile.get("real_name") or info.get("name") or ""
            )
        return self._names[user]

    # ----------------------------------------------------------------- replies

    async def send(self, message: OutboundMessage) -> None:
        """Post a reply in its place, converted to mrkdwn and split; finalize its
        streamed message when there is one. Raises `DeliveryFailed` when a part certainly
        did not go out, and goes on from that part when the reply comes again (see the
        module docstring)."""
        channel, thread_ts = address_of(message)
        text = markdown_to_mrkdwn(message.text)
        if text and (user := addressee(message)) is not None:
            text = f"<@{user}> {text}"
        parts = split_mrkdwn(text, self.part_chars)
        stream = self._streams.pop(message.reply_to or message.session_key, None)
        deadline = time.monotonic() + self.retry.reply_deadline
        with logger.contextualize(session=message.session_key):
            if not parts and message.files:
                await self._upload_files(channel, thread_ts, message.files)
                return
            if not parts:
                logger.warning("slack: empty reply not sent")
                return
            first = 0
            if stream is not None and stream.ts is not None:
                async with stream.lock:
                    if await self._update(stream.channel, stream.ts, parts[0], deadline):
                        first = 1
            # A reply sent again after a failure goes on where the failure stopped it.
            reply = (message.session_key, message.reply_to, message.text)
            done = self._sent_parts.take(reply, 0)
            for index in range(max(first, done), len(parts)):
                outcome, _ = await self._post_part(channel, thread_ts, parts[index], deadline)
                if outcome is Delivery.FAILED:
                    self._sent_parts.keep(reply, index)
                    raise DeliveryFailed(
                        f"slack: reply part {index + 1} of {len(parts)} to {channel} not "
                        "posted; it is sent again later",
                        sent=index,
                    )
                if outcome is Delivery.REFUSED:
                    logger.error(
                        "slack: reply part {} of {} to {} refused; {} later part(s) dropped",
                        index + 1,
                        len(parts),
                        channel,
                        len(parts) - index - 1,
                    )
                    return
            if message.files:
                await self._upload_files(channel, thread_ts, message.files)

    async def _upload_files(
        self, channel: str, thread_ts: str | None, files: tuple[OutboundFile, ...]
    ) -> None:
        """Upload a reply's files into its conversation, the way `files_upload_v2` does
        (files.getUploadURLExternal, the bytes, files.completeUploadExternal). Tried
        once: a failed upload is logged, never repeated blindly (it may have landed)."""
        uploads = [
            {"content": f.data, "filename": f.name, "title": f.caption or f.name} for f in files
        ]
        try:
            await self.client.files_upload_v2(
                channel=channel, thread_ts=thread_ts, file_uploads=uploads
            )
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            names = ", ".join(f.name for f in files)
            logger.error("slack: files {} not uploaded to {}: {}", names, channel, _classify(exc))

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """A piece of the reply to `inbound` while it is written (streaming on): the
        first piece posts the message, later ones edit it at most once per
        `stream_interval`; `send` writes the final text. Failures here are not retried:
        the final `send` still delivers the whole reply."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.message_id or inbound.session_key
        stream = self._streams.get(key)
        now = time.monotonic()
        if stream is None:
            self._forget_stale_streams(now)
            stream = self._streams[key] = _Stream(inbound.chat_id, inbound.thread_id, now)
        stream.text += delta
        if stream.broken or stream.lock.locked():
            return
        if stream.ts is not None and now - stream.last_edit < self.stream_interval:
            return
        async with stream.lock:
            shown = preview(stream.text, self.part_chars)
            if shown == stream.shown:
                return
            stream.last_edit, stream.shown = now, shown
            with logger.contextualize(session=inbound.session_key):
                if stream.ts is None:
                    _, stream.ts = await self._post_part(
                        stream.channel, stream.thread_ts, shown, deadline=None
                    )
                    stream.broken = stream.ts is None
                else:
                    await self._update(stream.channel, stream.ts, shown, deadline=None)

    def _forget_stale_streams(self, now: float) -> None:
        for key, stream in list(self._streams.items()):
            if now - stream.started > _STREAM_TTL:
                del self._streams[key]

    # ----------------------------------------------------------------- Web API calls

    async def _post_part(
        self, channel: str, thread_ts: str | None, text: str, deadline: float | None
    ) -> tuple[Delivery, str | None]:
        """Post one message, at most once (see the module docstring); with `deadline`
        None a single try. Returns how it went and the message's ts when known."""
        since = time.time()
        failures = 0
        what = f"chat.postMessage to {channel}"
        while True:
            try:
                answer = await self.client.chat_postMessage(
                    channel=channel, text=text, thread_ts=thread_ts
                )
                return Delivery.POSTED, str(answer["ts"])
            except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
                failure = _classify(exc)
            if failure.kind is _Kind.MAYBE_DONE:
                known, ts = await self._find_posted(channel, thread_ts, text, since)
                if ts is not None:
                    logger.info("slack: {} {}, but the message is there", what, failure)
                    return Delivery.POSTED, ts
                if not known:
                    logger.error(
                        "slack: {} {}; it may or may not have arrived and cannot be "
                        "checked (needs the *:history scopes), so it is not sent again",
                        what,
                        failure,
                    )
                    return Delivery.UNCERTAIN, None
            failures += failure.kind is not _Kind.RATE_LIMITED
            if not await self._wait_to_retry(what, failure, failures, deadline):
                refused = failure.kind is _Kind.PERMANENT
                return (Delivery.REFUSED if refused else Delivery.FAILED), None

    async def _update(self, channel: str, ts: str, text: str, deadline: float | None) -> bool:
        """chat.update, retried like a post (an edit can be repeated safely)."""
        failures = 0
        what = f"chat.update of {channel}/{ts}"
        while True:
            try:
                await self.client.chat_update(channel=channel, ts=ts, text=text)
                return True
            except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
                failure = _classify(exc)
            failures += failure.kind is not _Kind.RATE_LIMITED
            if not await self._wait_to_retry(what, failure, failures, deadline):
                return False

    async def _wait_to_retry(
        self, what: str, failure: _Failure, failures: int, deadline: float | None
    ) -> bool:
        """Sleep before the next try and return True, or log and return False."""
        policy = self.retry
        delay: float | None
        if failure.kind is _Kind.RATE_LIMITED:
            delay = failure.retry_after
        elif failure.kind is _Kind.PERMANENT or failures >= policy.attempts:
            delay = None
        else:
            delay = min(policy.backoff * 2 ** (failures - 1), policy.max_backoff)
        if deadline is None:
            logger.debug("slack: {} {}; not retried", what, failure)
            return False
        if delay is None or time.monotonic() + delay > deadline:
            logger.error("slack: {} {}; giving up", what, failure)
            return False
        logger.warning("slack: {} {}; retrying in {:.1f}s", what, failure, delay)
        await anyio.sleep(delay)
        return True

    async def _find_posted(
        self, channel: str, thread_ts: str | None, text: str, since: float
    ) -> tuple[bool, str | None]:
        """Did our message with `text` land after `since`? (known, its ts)."""
        try:
            if self.identity is None:
                self.identity = await _auth_test(self.client)
            # A little slack for clock skew between this host and Slack.
            oldest = f"{since - 10:.6f}"
            if thread_ts is not None:
                answer = await self.client.conversations_replies(
                    channel=channel, ts=thread_ts, oldest=oldest, limit=200
                )
            else:
                answer = await self.client.conversations_history(
                    channel=channel, oldest=oldest, limit=200
                )
        except (SlackClientError, SlackCredentialsError, aiohttp.ClientError, TimeoutError):
            return False, None
        me = self.identity
        for item in answer.get("messages") or []:
            mine = item.get("bot_id") == me.bot_id or item.get("user") == me.user_id
            if mine and item.get("text") == text and item.get("ts") != thread_ts:
                return True, str(item.get("ts"))
        return True, None


def _check_tokens(
    settings: SlackSettings, bot_token: str, app_token: str | None, signing_secret: str | None
) -> None:
    """Raise ConfigError for tokens that cannot work, saying which variable to fix."""
    if not bot_token:
        raise ConfigError(
            f"channels.slack: set the bot token (xoxb-...) in {ENV_PREFIX}BOT_TOKEN "
            "(OAuth & Permissions > Bot User OAuth Token)"
        )
    if bot_token.startswith("xapp-"):
        raise ConfigError(
            f"channels.slack: {ENV_PREFIX}BOT_TOKEN holds the app-level token (xapp-); "
            "it takes the Bot User OAuth Token (xoxb-), and the xapp- one goes in APP_TOKEN"
        )
    if settings.mode == "socket":
        if not app_token:
            raise ConfigError(
                f"channels.slack: Socket Mode needs the app-level token (xapp-...) in "
                f'{ENV_PREFIX}APP_TOKEN; or set channels.slack.mode = "http"'
            )
        if not app_token.startswith("xapp-"):
            raise ConfigError(
                f"channels.slack: {ENV_PREFIX}APP_TOKEN must be an app-level token (xapp-...) "
                "with the connections:write scope (Basic Information > App-Level Tokens)"
            )
    elif not signing_secret:
        raise ConfigError(
            f"channels.slack: HTTP mode needs the signing secret in {ENV_PREFIX}SIGNING_SECRET "
            "(Basic Information > App Credentials)"
        )
