"""The Matrix channel: a matrix-nio adapter that drives `/sync` itself, inside the
daemon's event loop.

Inbound: the channel calls `/sync` with the `since` token it stored, submits every
message of the batch in order (one room after another, each room's timeline in order),
and stores the batch's `next_batch` only after all of them are journaled. Session keys:
`matrix:<room_id>`, and `matrix:<room_id>:thread:<root event id>` inside a thread;
message id: the event id. A room with more than two members is a group (mention gating);
the sender's display name, the replied-to text (in groups) and the files of a message
travel with it. Outbound: `send` writes the model's Markdown as the plain `body` and as
HTML in `formatted_body`, split under the event size limit (`channels.matrix.format`), as
a reply to the message (a thread reply inside a thread).

Promises (each one tested in tests/test_matrix*.py against Synapse, and by the kill test):
- Journal before confirm: `/sync`'s `since` token is Matrix's confirmation. The token
  after a batch is stored (`gateway.journal.cursors`) only once `submit` returned for every
  message of the batch; a kill at any moment leaves every event either in the journal or
  still after the stored token, where the next `/sync` finds it again. A timeline the
  homeserver cut short (`limited`) is filled from `/messages` back to the stored token
  before the batch is taken, so a long downtime loses nothing either. A message that is
  not taken (the journal failed) stops the batch; the same token is asked again later.
- Dedupe: an event id seen twice in this process is submitted once, and the dispatcher
  drops a message id (the event id) it has journaled before, across restarts too.
- The bot never answers itself, nor `m.notice` messages (what bots write).
- An edit (`m.replace`) is submitted as a message of its own naming the event it changes
  (`META_EDIT_OF`); the core decides whether it re-runs a turn (docs/delivery.md).
- A reply is sent at most once: every event goes out with a transaction id derived from
  the message it answers and its own text, so a retry, or a re-send after a crash, is
  the same transaction, which the homeserver keeps once (the spec's idempotent send).
- A reply the homeserver did not take and may take later (unreachable, a 5xx, a 429
  asking to wait past the reply's deadline; also a connection dropped before the answer,
  which the transaction id makes safe to repeat) raises `DeliveryFailed`: the dispatcher
  sends it again, and it goes on from the part that failed, as the same transactions.
- Invites from people who may talk to the bot (allowlisted, paired, or anyone under an
  open policy) are accepted; others are declined with the reason (a stranger's reason
  holds their pairing code under `dm_policy = "pairing"`, at most once per resend
  interval). Every invite is decided when it comes, so a stranger approved since an
  earlier invite is joined on the next one, to the same room too. An invite is answered
  on the homeserver before the token of its batch is stored: one that cannot be answered
  yet holds the token back and is tried again (after a restart too), and is declined
  (`INVITE_FAILED`) once it kept failing for `Pacing.invite_patience`.
- End-to-end encrypted rooms (`channels.matrix.encryption`, on by default) are read and
  answered with the device's keys (`channels.matrix.crypto`): a message is decrypted
  before it is translated; a reply, an edit, a notice and a file into an encrypted room
  always go out encrypted, never in clear (another replica's reply is encrypted by the
  sync leader, through `gateway.journal.pg_relay`). A message whose room key has not come waits
  for it (`room_key_wait`), and so do the later messages of its room, in order; the
  stored token never passes a waiting message, so a restart finds it again. Past the
  wait, its sender is told once that it could not be read. The crypto state is durable
  before the token moves on (`MatrixCrypto.after_sync`), so whatever the journal took
  can be decrypted again after a restart. With encryption off, encrypted rooms are
  refused: an invite to one is declined, and in a room that turns encryption on the bot
  says once that it cannot read it, then leaves; both are logged.
- Media: images, audio and files become the message's attachments (`mxc://` references
  fetched through the authenticated content repository at turn time; an encrypted
  file's reference carries its key, and it is decrypted when fetched); a reply's files
  are uploaded to the content repository (encrypted first in an encrypted room) and sent
  after its text.
"""

from __future__ import annotations

import hashlib
import io
import re
import secrets
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from loguru import logger

from channels.matrix.crypto import (
    CryptoClosed,
    CryptoFailed,
    CryptoUnavailable,
    MatrixCrypto,
    crypto_available,
    decrypt_file,
    encrypt_file,
    encrypted_file_id,
    split_file_id,
)
from channels.matrix.format import (
    NO_MENTIONS,
    edit_content,
    notice_content,
    split_reply,
    strip_reply_fallback,
    text_content,
)
from channels.matrix.settings import MatrixSettings
from channels.notices import NoticeCooldown
from channels.typing_indicators import TypingIndicators
from gateway import failpoints
from gateway.access.policy import Allow, Challenge, Decision, Deny
from gateway.channel import DeliveryFailed, Submit, Ticket
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead, Relay
from gateway.media import MediaError
from gateway.media.download import download_capped
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_SENDER,
    META_QUOTED_TEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)

if TYPE_CHECKING:
    from nio import AsyncClient


CHANNEL = "matrix"
THREAD = "thread"
ENV_PREFIX = "GATEWAY_CHANNELS__MATRIX__"
#: Said in a room (and logged) before leaving it, and given as the reason an invite to
#: an encrypted room is declined, when encryption is off (`channels.matrix.encryption`).
ENCRYPTED_REFUSAL = (
    "I can't take part in end-to-end encrypted rooms: encryption is turned off for this "
    "gateway. Invite me to an unencrypted room instead."
)
#: The reason an invite is declined when it could not be answered: the homeserver refused
#: the join, or the join or the access check kept failing (`Pacing.invite_patience`).
INVITE_FAILED = (
    "I couldn't accept this invite: something failed on my side or on the homeserver. "
    "Please invite me again later."
)
#: Said (once) to the sender of an encrypted message whose room key never came.
UNREADABLE_NOTICE = (
    "I couldn't read your last message: it is encrypted with a key your app did not share "
    "with my device. Please send it again; if this keeps happening, check that your app "
    "has not blocked my device."
)
_SEEN_EVENTS = 10_000
#: Message types that are a person writing or sending a file.
_FILE_TYPES = frozenset({"m.image", "m.file", "m.audio"})
_UNSUPPORTED = {
    "m.video": "a video",
    "m.location": "a location",
    "m.sticker": "a sticker",
}

#: Event types the sync filter asks for; everything else stays on the homeserver.
_TIMELINE_TYPES = [
    "m.room.message",
    "m.room.encrypted",
    "m.sticker",
    "m.room.member",
    "m.room.encryption",
]


class MatrixSetupError(Exception):
    """The account cannot be used (or `gateway doctor` cannot reach it); says what to
    fix. Never carries the token."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often and how patiently the channel talks to the homeserver (seconds)."""

    retry_attempts: int = 5  # per request, for failures that may be retried
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    reply_deadline: float = 50.0  # under the dispatcher's 60 s cap on one delivery
    typing_timeout: float = 30.0  # how long one typing notification lasts
    typing_grace: float = 0.3  # no indicator for replies faster than this
    turn_limit: float = 600.0  # the longest a turn is shown as typing (or streaming)
    stream_interval: float = 1.0  # at most one streaming edit per this
    notice_cooldown: float = 60.0  # per room, for "not supported" notices
    timeline_limit: int = 50  # events per room per /sync (more are fetched by /messages)
    request_timeout: float = 30.0  # one request (besides /sync's long poll)
    stop_timeout: float = 10.0
    encryption_recheck: float = 10.0  # a standby re-asks whether a clear room is encrypted
    invite_patience: float = 60.0  # a failing invite holds the since token back this long


# --------------------------------------------------------------------------- inbound


@dataclass(frozen=True, slots=True)
class Notice:
    """Answer `event_id` in `room_id` with `text` without asking the agent."""

    room_id: str
    event_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this event (logged at debug level with `reason`)."""

    reason: str


Translation = InboundMessage | Notice | Skip


@dataclass(frozen=True, slots=True)
class RoomFacts:
    """What the channel knows about a room when it translates one of its events."""

    member_count: int
    names: Mapping[str, str] = field(default_factory=dict)  # user id -> display name

    @property
    def is_group(self) -> bool:
        """More than two members: the bot answers only when addressed (mention gating)."""
        return self.member_count > 2


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the bot is: its user id and display name."""

    user_id: str
    display_name: str = ""

    @property
    def localpart(self) -> str:
        return self.user_id[1:].split(":", 1)[0]


def _relation(content: Mapping[str, Any]) -> Mapping[str, Any]:
    relates = content.get("m.relates_to")
    return relates if isinstance(relates, Mapping) else {}


def thread_root(content: Mapping[str, Any]) -> str | None:
    """The thread an event belongs to (its root's event id), if any."""
    relates = _relation(content)
    if relates.get("rel_type") == "m.thread" and isinstance(relates.get("event_id"), str):
        return str(relates["event_id"])
    return None


def replied_event_id(content: Mapping[str, Any]) -> str | None:
    """The event a message really replies to; a thread message's fallback reply to the
    thread's latest event (`is_falling_back`) is not one."""
    relates = _relation(content)
    if relates.get("rel_type") == "m.thread" and relates.get("is_falling_back"):
        return None
    reply = relates.get("m.in_reply_to")
    if isinstance(reply, Mapping) and isinstance(reply.get("event_id"), str):
        return str(reply["event_id"])
    return None


def edited_event_id(content: Mapping[str, Any]) -> str | None:
    """The event an `m.replace` edit changes, if this is one."""
    relates = _relation(content)
    if relates.get("rel_type") == "m.replace" and isinstance(relates.get("event_id"), str):
        return str(relates["event_id"])
    return None


def read_mention(content: Mapping[str, Any], body: str, me: Identity) -> tuple[bool, str]:
    """(is the bot mentioned, the text without the mention). A mention is the bot in
    `m.mentions` (intentional mentions), a link to the bot (a pill), its user id in the
    text, or a message starting with its display name or localpart and ':' or ','."""
    mentioned = False
    mentions = content.get("m.mentions")
    if isinstance(mentions, Mapping) and me.user_id in (mentions.get("user_ids") or ()):
        mentioned = True
    html = content.get("formatted_body")
    if isinstance(html, str) and (
        f"matrix.to/#/{me.user_id}" in html
        or f"matrix.to/#/{urllib.parse.quote(me.user_id)}" in html
    ):
        mentioned = True
    text = body
    if me.user_id in text:
        mentioned = True
        text = text.replace(me.user_id, "")
    names = [name for name in (me.display_name, me.localpart) if name]
    for name in names:
        match = re.match(rf"\s*@?{re.escape(name)}\s*[:,]\s*", text, re.IGNORECASE)
        if match:
            mentioned = True
            text = text[match.end() :]
            break
    if mentioned:
        text = re.sub(r"^[\s:,]+", "", text)
    stripped = text.strip()
    return mentioned, stripped or body.strip()


def file_attachment(content: Mapping[str, Any]) -> Attachment | None:
    """The file of an m.image / m.audio / m.file message, as a reference: its mxc URI,
    with its key in the fragment when it is encrypted (`content.file`)."""
    url = content.get("url")
    encrypted = content.get("file")
    if isinstance(encrypted, Mapping):
        url = encrypted_file_id(encrypted)
    if not isinstance(url, str) or not url.startswith("mxc://"):
        return None  # malformed
    info = content.get("info")
    info = info if isinstance(info, Mapping) else {}
    mime = str(info.get("mimetype") or "")
    msgtype = content.get("msgtype")
    if msgtype == "m.image" or (msgtype == "m.file" and mime.startswith("image/")):
        kind = "image"
    elif msgtype == "m.audio" or mime.startswith("audio/"):
        kind = "voice"
    else:
        kind = "document"
    name = content.get("filename") or content.get("body") or "file"
    size = info.get("size")
    return Attachment(
        kind, url, str(name), mime, size if isinstance(size, int) and size >= 0 else None
    )


def caption_of(content: Mapping[str, Any]) -> str:
    """A file message's caption: its body when a separate `filename` is given (Matrix
    1.10); otherwise the body is only the file's name."""
    body = content.get("body")
    filename = content.get("filename")
    if isinstance(body, str) and isinstance(filename, str) and body != filename:
        return body
    return ""


def unsupported_notice(kind: str) -> str:
    return (
        f"Sorry, I can't open {kind} yet: I can read text, images, audio and files. "
        "Please write what you'd like me to know."
    )


def _sender_label(facts: RoomFacts, sender: str) -> str:
    name = facts.names.get(sender, "")
    return f"{name} ({sender})" if name and name != sender else sender


def translate_event(
    room_id: str,
    event: Mapping[str, Any],
    *,
    me: Identity,
    facts: RoomFacts,
    related: Mapping[str, Any] | None = None,
) -> Translation:
    """The inbound message (or notice, or nothing) for one timeline event. Pure.

    `related` is the event this one refers to, when the channel could fetch it: the
    message an edit changes (for its thread), or the message a reply answers (is it the
    bot's? its text travels with a group's message).
    """
    kind = event.get("type")
    sender = event.get("sender")
    event_id = event.get("event_id")
    if not isinstance(sender, str) or not isinstance(event_id, str):
        return Skip("an event without a sender or id")
    if sender == me.user_id:
        return Skip("the bot's own event")
    content = event.get("content")
    if not isinstance(content, Mapping) or not content:
        return Skip("a redacted or empty event")
    is_group = facts.is_group
    if kind == "m.sticker":
        if is_group:
            return Skip("a sticker in a group")
        return Notice(room_id, event_id, unsupported_notice("a sticker"))
    if kind != "m.room.message":
        return Skip(f"{kind} is not a message")
    edit_of = edited_event_id(content)
    thread = thread_root(content)
    if edit_of is not None:
        new = content.get("m.new_content")
        if not isinstance(new, Mapping):
            return Skip("an edit without m.new_content")
        if related is not None:
            original = related.get("content")
            if isinstance(original, Mapping):
                thread = thread_root(original)
        content = new
    msgtype = content.get("msgtype")
    if msgtype == "m.notice":
        return Skip("an m.notice (bots write those)")
    reply_to = replied_event_id(content) if edit_of is None else None
    reply_to_bot = bool(
        reply_to is not None and related is not None and related.get("sender") == me.user_id
    )
    raw_body = content.get("body")
    body = raw_body if isinstance(raw_body, str) else ""
    if reply_to is not None:
        body = strip_reply_fallback(body)
    files: tuple[Attachment, ...] = ()
    if msgtype in _FILE_TYPES:
        attachment = file_attachment(content)
        if attachment is None:
            return Skip("a file without an mxc:// url (malformed)")
        files = (attachment,)
        body = caption_of(content)
    elif msgtype in _UNSUPPORTED:
        if is_group and not reply_to_bot:
            return Skip(f"{_UNSUPPORTED[str(msgtype)]} in a group, not addressed to the bot")
        return Notice(room_id, event_id, unsupported_notice(_UNSUPPORTED[str(msgtype)]))
    elif msgtype not in ("m.text", "m.emote"):
        return Skip(f"message type {msgtype!r} is not handled")
    mentioned, text = read_mention(content, body, me)
    if not text and not files:
        return Skip("no text")
    if files and not text and is_group and not (mentioned or reply_to_bot):
        return Skip("a file in a group, not addressed to the bot")
    if msgtype == "m.emote":
        text = f"* {facts.names.get(sender) or sender} {text}"
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_MENTIONED: mentioned,
        META_REPLY_TO_BOT: reply_to_bot,
        META_SENDER_NAME: _sender_label(facts, sender),
    }
    sent = event.get("origin_server_ts")
    if isinstance(sent, int | float):
        metadata[META_SENT_AT] = sent / 1000
    if is_group and related is not None and reply_to is not None:
        quoted = related.get("content")
        if isinstance(quoted, Mapping) and isinstance(quoted.get("body"), str):
            quoted_text = strip_reply_fallback(str(quoted["body"])).strip()
            if quoted_text:
                metadata[META_QUOTED_TEXT] = quoted_text
                metadata[META_QUOTED_SENDER] = _sender_label(facts, str(related.get("sender")))
    if edit_of is not None:
        metadata[META_EDIT_OF] = edit_of
    return InboundMessage(
        channel=CHANNEL,
        chat_id=room_id,
        text=text,
        sender_id=sender,
        message_id=event_id,
        thread_kind=THREAD if thread else None,
        thread_id=thread,
        metadata=metadata,
        attachments=files,
    )


def parse_target(chat_id: str, thread_id: str | None = None) -> tuple[str, str | None]:
    """(room id, thread root or None) of a reply. A heartbeat's `deliver_to` may name a
    thread in the chat id: `!room:example.org:thread:$event`."""
    room, sep, thread = chat_id.partition(f":{THREAD}:")
    if sep and thread_id is None:
        thread_id = thread or None
    return room, thread_id


def transaction_id(*parts: str) -> str:
    """A transaction id made from what identifies one outgoing event: the same event
    sent again (a retry, a re-send after a crash) is the same transaction, which the
    homeserver keeps once."""
    digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
    return f"gw{digest}"


def reply_relation(reply_to: str | None, thread: str | None) -> dict[str, Any]:
    """`m.relates_to` of a reply: a rich reply, or inside a thread a thread reply that
    quotes the message (not a fallback)."""
    if thread is not None:
        relation: dict[str, Any] = {"rel_type": "m.thread", "event_id": thread}
        if reply_to is not None:
            relation["m.in_reply_to"] = {"event_id": reply_to}
        else:
            relation["is_falling_back"] = True
            relation["m.in_reply_to"] = {"event_id": thread}
        return {"m.relates_to": relation}
    if reply_to is not None:
        return {"m.relates_to": {"m.in_reply_to": {"event_id": reply_to}}}
    return {}


def _sync_filter(timeline_limit: int) -> dict[str, Any]:
    return {
        "presence": {"types": []},
        "account_data": {"types": []},
        "room": {
            "timeline": {"limit": timeline_limit, "types": _TIMELINE_TYPES},
            "ephemeral": {"types": []},
            "account_data": {"types": []},
        },
    }


# --------------------------------------------------------------------------- channel


@dataclass
class _Stream:
    """A reply shown while it is written: one event, edited as text arrives."""

    reply_to: str | None
    room_id: str
    thread: str | None
    next_edit: float
    text: str = ""
    shown: str = ""
    event_id: str | None = None
    flushing: bool = False
    closed: bool = False
    idle: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Pending:
    """A timeline event taken from /sync but not yet submitted: waiting for its room key,
    or behind one that does, in its room's order."""

    event: Any  # a nio event (a MegolmEvent until it is decrypted)
    since: str  # the token that delivers it again (before its batch)
    batch: int  # which batch of this run it came in (the oldest decides the token)


class RequestFailed(Exception):
    """A homeserver request that did not succeed; `retryable` when repeating it may help
    (a 429, a 5xx, a connection failure), `retry_after` what a 429 asked for; `status`
    the HTTP status when there was an answer."""

    def __init__(
        self,
        what: str,
        *,
        retryable: bool,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(what)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status


InviteCheck = Callable[[InboundMessage], Awaitable[Decision]]


class MatrixChannel:
    """The Matrix adapter; see the module docstring for what it promises.

    Build it from `settings.channels.matrix` and the resolved token; the daemon sets
    `lead` (where the since token is kept, and on which replica the sync loop runs) and
    `invite_check` (the access gate) before running it.
    """

    name = CHANNEL

    def __init__(
        self, settings: MatrixSettings, *, token: str, pacing: Pacing | None = None
    ) -> None:
        if not settings.homeserver:
            raise ConfigError(
                "channels.matrix.homeserver: set the homeserver's URL "
                f"(e.g. https://matrix.example.org) in gateway.toml or {ENV_PREFIX}HOMESERVER"
            )
        if not settings.user_id:
            raise ConfigError(
                "channels.matrix.user_id: set the bot account's Matrix id "
                f"(e.g. @gateway:example.org) in gateway.toml or {ENV_PREFIX}USER_ID"
            )
        if not token:
            raise ConfigError(
                f"channels.matrix.access_token: set {ENV_PREFIX}ACCESS_TOKEN (docs/matrix.md "
                "says how to get one) or channels.matrix.access_token_file"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.homeserver = settings.homeserver.rstrip("/")
        self.me = Identity(settings.user_id)
        self._token = token
        #: Where the since token is kept and where the sync loop runs (set by the daemon;
        #: None keeps it in memory only, for tests of a single process).
        self.lead: Lead | None = None
        #: The access decision for an inviter (the daemon's access gate); None declines
        #: every invite.
        self.invite_check: InviteCheck | None = None
        #: Several replicas: replies to encrypted rooms go through the replica that holds
        #: the device's keys (set by the daemon in the shared mode).
        self.relay: Relay | None = None
        self._client: AsyncClient | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._sync_scope: anyio.CancelScope | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()
        #: (next_batch, room id) of the invites answered: a batch the homeserver hands
        #: out again (after a rewind Synapse answers from its cache) is not answered twice.
        self._invites_answered: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._invite_failing: dict[str, float] = {}  # room id -> when its invite first failed
        self._refused: set[str] = set()
        self._noticed = NoticeCooldown()
        self._typing = TypingIndicators[str](self._typing_on, self._typing_off)
        self._streams: dict[str, _Stream] = {}
        self._edits: OrderedDict[str, str] = OrderedDict()  # edit event -> original
        #: Replies a failure cut short, by (session, reply_to, text): the key of their
        #: transaction ids and how many of their parts went out.
        self._cut_short: OrderedDict[tuple[str, str | None, str], tuple[str, int]] = OrderedDict()
        #: Why encrypted rooms are refused (None: they are served with the device's keys).
        self._encryption_off: str | None = None
        #: The device's keys, while this process holds them (it runs the /sync loop).
        self._crypto: MatrixCrypto | None = None
        self._crypto_ready = anyio.Event()
        self._held: dict[str, list[_Pending]] = {}  # room -> events not yet submitted
        self._key_wait_since: dict[str, float] = {}  # event id -> when it began to wait
        self._batches = 0
        #: A standby's answers to "is this room encrypted?": (encrypted, when asked).
        self._encryption_seen: dict[str, tuple[bool, float]] = {}
        self.live = anyio.Event()  # set once events flow (for tests and probes)
        self.since: str | None = None  # the last token stored

    # ----------------------------------------------------------------- wiring

    def _build_client(self) -> AsyncClient:
        from nio import AsyncClient, AsyncClientConfig

        # nio's own retries are off: this channel decides what may be repeated.
        # nio does not load a crypto store of its own: the sync loop attaches the
        # device's keys (`MatrixCrypto.open`) where it runs.
        config = AsyncClientConfig(
            max_limit_exceeded=0,
            max_timeouts=0,
            request_timeout=self.pacing.request_timeout,
            store_sync_tokens=False,
            encryption_enabled=False,
        )
        client = AsyncClient(self.homeserver, self.me.user_id, config=config)
        client.access_token = self._token
        client.user_id = self.me.user_id
        return client

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Sync until cancelled. Raises MatrixSetupError when the token is refused (the
        daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        client = self._build_client()
        failure: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self.relay is not None:
                    tg.start_soon(self.relay.listen)
                try:
                    await self._serve(client, task_status)
                except Exception as exc:
                    failure = exc  # raised below as itself, not inside an exception group
                finally:
                    tg.cancel_scope.cancel()  # typing notifications, streaming edits
        finally:
            self._tg = None
            self._client = None
            self._crypto = None
            self._crypto_ready = anyio.Event()
            self._held.clear()
            self.live = anyio.Event()
            with anyio.CancelScope(shield=True):
                await client.close()
        if failure is not None:
            raise failure

    def pause_intake(self) -> None:
        """Take no more events (the daemon is draining): the sync loop stops, and what
        comes after the stored token stays on the homeserver for the next start. Replies
        still go out until the channel stops."""
        self._paused = True
        if self._sync_scope is not None:
            self._sync_scope.cancel()

    async def _serve(self, client: AsyncClient, task_status: anyio.abc.TaskStatus[None]) -> None:
        self.me = await who_am_i(client, self.homeserver, self.me.user_id)
        self._client = client
        self._encryption_off = self._why_no_encryption(client)
        if self._encryption_off is not None and self.settings.encryption:
            logger.error("matrix: encrypted rooms are refused: {}", self._encryption_off)
        logger.info("matrix: {} is live on {}", self.me.user_id, self.homeserver)
        self.live.set()
        task_status.started()
        lead = self.lead
        if lead is None:
            store = _MemoryCursors()
            await self._sync_loop(client, store)
        else:
            # Several replicas: one syncs (two would answer every message twice), the
            # others stand by to take over; the token is written under that role.
            await lead(lambda store: self._sync_loop(client, store))
        await anyio.sleep_forever()

    @property
    def cursor_name(self) -> str:
        return f"{CHANNEL}:{self.me.user_id}"

    def _why_no_encryption(self, client: AsyncClient) -> str | None:
        """Why encrypted rooms cannot be served here; None when they can."""
        if not self.settings.encryption:
            return "channels.matrix.encryption is off"
        missing = crypto_available()
        if missing is not None:
            return missing
        if not client.device_id:
            return (
                "the homeserver did not say which device the access token belongs to; "
                "log in with a password to get a device token (docs/matrix.md, section 1)"
            )
        return None

    async def _open_crypto(self, client: AsyncClient, store: CursorStore) -> MatrixCrypto | None:
        """The device's keys from `store` (made on the first run), while this process
        runs the /sync loop. None when encryption is off here."""
        if self._encryption_off is not None:
            return None
        try:
            crypto = await MatrixCrypto.open(
                client,
                store,
                user_id=self.me.user_id,
                device_id=str(client.device_id),
                request=self._request,
            )
        except CryptoUnavailable as exc:
            raise MatrixSetupError(str(exc)) from None
        logger.info(
            "matrix: end-to-end encryption on, device {} ({} ed25519 key {})",
            client.device_id,
            self.me.user_id,
            crypto.olm.account.identity_keys["ed25519"],
        )
        self._crypto = crypto  # ready once the first /sync told the rooms and members
        return crypto

    async def _sync_loop(self, client: AsyncClient, store: CursorStore) -> None:
        """Long-polling `/sync` that confirms only what the journal holds, with the
        device's keys (when encryption is on) held for as long as it runs.

        The homeserver keeps every event after the `since` token the gateway hands it.
        This loop owns that token: it stores a batch's `next_batch` only once every
        message of the batch was submitted (journaled, or settled), so a crash at any
        moment leaves every event either in the journal or after the stored token. An
        encrypted message waiting for its room key holds the stored token back (the loop
        itself syncs on). The first sync of each run asks for the rooms' full state
        (members, names, encryption), which a new process does not know.
        """
        since = await store.load(self.cursor_name)
        self.since = since
        crypto = await self._open_crypto(client, store)
        try:
            async with anyio.create_task_group() as tg:
                if crypto is not None and self.relay is not None:
                    tg.start_soon(self._serve_relay, self.relay)
                await self._sync_batches(client, store, since)
                if crypto is not None and self.relay is not None:
                    # Draining: a standby takes the device over once this returns; it
                    # must find every change, and this process must not encrypt again.
                    # (One process keeps its keys while it drains: replies still go out.)
                    self._crypto = None
                    self._crypto_ready = anyio.Event()
                    await crypto.close()
                tg.cancel_scope.cancel()
        except BaseException:
            self._crypto = None  # the role is lost, or the channel stops: no keys here
            self._crypto_ready = anyio.Event()
            raise

    async def _serve_relay(self, relay: Relay) -> None:
        """Encrypt and send the other replicas' events for encrypted rooms, once the
        rooms are known here."""
        await self._crypto_ready.wait()
        await relay.serve(self._relayed_send)

    async def _sync_batches(
        self, client: AsyncClient, store: CursorStore, since: str | None
    ) -> None:
        """The /sync loop proper (see `_sync_loop`); returns when intake pauses."""
        from nio import SyncResponse

        stored = since
        first = True
        failures = 0
        taken: int | None = 0
        sync_filter = _sync_filter(self.pacing.timeline_limit)
        while not self._paused:
            response: Any = None
            with anyio.CancelScope() as scope:
                self._sync_scope = scope
                try:
                    response = await client.sync(
                        timeout=self._poll_ms() if not first else 0,
                        sync_filter=sync_filter,
                        since=since,
                        full_state=first,
                    )
                except (TimeoutError, OSError) as exc:
                    response = exc
                except Exception as exc:  # aiohttp's errors and nio's parse errors
                    response = exc
                finally:
                    self._sync_scope = None
            if scope.cancelled_caught:
                return  # paused: that batch stays after the stored token
            if not isinstance(response, SyncResponse):
                failures += 1
                self._on_sync_error(response)
                await anyio.sleep(self._backoff(failures))
                continue
            if self._crypto is not None:
                # Room keys that came in this batch, durable before the next /sync lets
                # the homeserver delete their to-device messages, and before the token.
                try:
                    await self._crypto.after_sync()
                except (RequestFailed, CryptoFailed) as exc:
                    logger.warning("matrix: encryption upkeep failed ({}); retrying", exc)
                # Rooms and members are known now: replies may be encrypted.
                self._crypto_ready.set()
            if since is None:
                # The very first run of this account here: what it missed before it
                # existed for the gateway is not answered (it may be weeks old).
                skipped = sum(len(r.timeline.events) for r in response.rooms.join.values())
                if skipped:
                    logger.info(
                        "matrix: first sync; {} earlier events in {} rooms are not answered",
                        skipped,
                        len(response.rooms.join),
                    )
                if not await self._take_invites(response):
                    failures += 1  # nothing stored yet: the first sync is made again
                    await anyio.sleep(self._backoff(failures))
                    continue
            else:
                taken = await self._take_batch(client, response, since)
                if taken is None:
                    # A message was not journaled, or an invite not answered: everything
                    # after the stored token comes again (what was journaled is
                    # recognised by its event id, an answered invite is not sent again).
                    since = self._rewind(stored)
                    failures += 1
                    await anyio.sleep(self._backoff(failures))
                    continue
                if taken:
                    await failpoints.reach("matrix.before_cursor", self.cursor_name)
            failures = 0
            first = False
            since = response.next_batch
            safe = self._safe_token(response.next_batch)
            if safe != stored:
                await store.save(self.cursor_name, safe)
                stored = self.since = safe
                if taken:
                    await failpoints.reach("matrix.after_cursor", self.cursor_name)

    def _poll_ms(self) -> int:
        """The long poll's length: shorter while a message waits for its room key, so
        the wait ends on time even when nothing else happens."""
        poll = float(self.settings.sync_timeout)
        if self._key_wait_since and self._held:
            due = min(self._key_wait_since.values()) + self.settings.room_key_wait
            poll = min(poll, max(0.5, due - time.monotonic()))
        return int(poll * 1000)

    def _safe_token(self, next_batch: str) -> str:
        """The token to store: the batch's, unless an earlier event still waits; then the
        token that delivers the oldest waiting one again."""
        oldest = min(
            (queue[0] for queue in self._held.values() if queue),
            key=lambda pending: pending.batch,
            default=None,
        )
        return oldest.since if oldest is not None else next_batch

    def _rewind(self, stored: str | None) -> str | None:
        """Forget what waits in memory (it comes again from the stored token)."""
        for queue in self._held.values():
            for pending in queue:
                self._seen.pop(str(getattr(pending.event, "event_id", "")), None)
        self._held.clear()
        return stored

    def _backoff(self, failures: int) -> float:
        delay = self.pacing.retry_backoff * 2 ** min(failures - 1, 10)
        return float(min(delay, self.pacing.retry_backoff_max))

    def _on_sync_error(self, response: object) -> None:
        status = getattr(response, "status_code", None)
        if status == "M_UNKNOWN_TOKEN":
            raise self._token_refused()
        logger.warning("matrix: /sync failed ({}); retrying", _describe(response))

    def _token_refused(self) -> MatrixSetupError:
        return MatrixSetupError(
            f"matrix: {self.homeserver} refused the access token of {self.me.user_id}; "
            f"log in again and put the new token in {ENV_PREFIX}ACCESS_TOKEN"
        )

    # ----------------------------------------------------------------- inbound

    async def _take_batch(self, client: AsyncClient, response: Any, since: str) -> int | None:
        """Take one /sync batch: invites, then each joined room's timeline in order (after
        what still waits in that room). The number of messages submitted once every one
        of them is journaled (or settled); None when one was not taken, or an invite not
        answered."""
        if not await self._take_invites(response):
            return None
        self._batches += 1
        for room_id, info in response.rooms.join.items():
            if self._paused:
                return None
            room = client.rooms.get(room_id)
            if room is not None and room.encrypted and self._crypto is None:
                await self._refuse_encrypted(client, room_id)
                continue
            events = list(info.timeline.events)
            if info.timeline.limited and info.timeline.prev_batch:
                gap = await self._fill_gap(client, room_id, info.timeline.prev_batch, since)
                if gap is None:
                    return None
                events = gap + events
            queue = self._held.setdefault(room_id, [])
            for event in events:
                event_id = getattr(event, "event_id", None)
                if not isinstance(event_id, str) or not self._first_sighting(event_id):
                    continue
                if getattr(event, "sender", None) == self.me.user_id:
                    continue  # the bot's own event (encrypted ones too: no key wait)
                queue.append(_Pending(event, since, self._batches))
        submitted = 0
        for room_id in list(self._held):
            taken = await self._drain(client, room_id)
            if taken is None:
                return None
            submitted += taken
            if not self._held.get(room_id):
                self._held.pop(room_id, None)
        return submitted

    async def _drain(self, client: AsyncClient, room_id: str) -> int | None:
        """Submit a room's events in order, up to one still waiting for its room key.
        The number submitted; None when one was not taken (it stays first)."""
        from nio import MegolmEvent

        queue = self._held[room_id]
        submitted = 0
        last_read: str | None = None
        while queue:
            event = queue[0].event
            if isinstance(event, MegolmEvent):
                decrypted = self._crypto.decrypt(event, room_id) if self._crypto else None
                if decrypted is None:
                    group = self._facts(client, room_id).is_group
                    if not self._gave_up_waiting(room_id, event, tell=not group):
                        break
                    del queue[0]
                    last_read = event.event_id
                    continue
                self._key_wait_since.pop(event.event_id, None)
                event = decrypted
            taken, read = await self._take_event(client, room_id, getattr(event, "source", {}))
            if not taken:
                return None
            del queue[0]
            submitted += read is not None
            last_read = read or last_read
        if last_read is not None:
            self._spawn(self._read_receipt, room_id, last_read)
        return submitted

    def _gave_up_waiting(self, room_id: str, event: Any, *, tell: bool = True) -> bool:
        """Has this encrypted message waited long enough for its room key? The first
        time, its key is asked of the sender; at the end, the sender is told once when
        `tell` (a DM). In a group nobody is told: an unreadable message cannot say whether
        it addressed the bot, and a notice would ping someone who may never have."""
        now = time.monotonic()
        began = self._key_wait_since.get(event.event_id)
        if began is None:
            if len(self._key_wait_since) > _SEEN_EVENTS:
                self._key_wait_since.clear()
            self._key_wait_since[event.event_id] = began = now
            logger.info(
                "matrix: {} in {} waits for its room key (session {})",
                event.event_id,
                room_id,
                event.session_id,
            )
            if self._crypto is not None:
                self._spawn(self._crypto.request_key, event)
        if now - began < self.settings.room_key_wait:
            return False
        del self._key_wait_since[event.event_id]
        with logger.contextualize(session=f"{CHANNEL}:{room_id}"):
            logger.warning(
                "matrix: {} from {} could not be decrypted: its room key did not come "
                "within {:g}s; {}",
                event.event_id,
                event.sender,
                self.settings.room_key_wait,
                "the sender is told" if tell else "skipped (a group: nobody is told)",
            )
        if tell:
            self._spawn(self._send_notice, Notice(room_id, event.event_id, UNREADABLE_NOTICE))
        return True

    async def _fill_gap(
        self, client: AsyncClient, room_id: str, prev_batch: str, since: str
    ) -> list[Any] | None:
        """The events the homeserver left out of a `limited` timeline: `/messages`
        backwards from `prev_batch` to the stored token, oldest first. None when they
        cannot be had now (the batch is then not confirmed)."""
        from nio import MessageDirection, RoomMessagesResponse

        found: list[Any] = []
        start: str | None = prev_batch
        while start:
            answer = await client.room_messages(
                room_id, start=start, end=since, direction=MessageDirection.back, limit=100
            )
            if not isinstance(answer, RoomMessagesResponse):
                logger.warning(
                    "matrix: events missed in {} cannot be fetched ({}); retrying",
                    room_id,
                    _describe(answer),
                )
                return None
            if not answer.chunk:
                break
            found.extend(answer.chunk)
            start = answer.end
        if found:
            logger.info("matrix: fetched {} events /sync left out in {}", len(found), room_id)
        return list(reversed(found))

    def _first_sighting(self, event_id: str) -> bool:
        if event_id in self._seen:
            return False
        self._seen[event_id] = None
        if len(self._seen) > _SEEN_EVENTS:
            self._seen.popitem(last=False)
        return True

    async def _take_event(
        self, client: AsyncClient, room_id: str, event: Mapping[str, Any]
    ) -> tuple[bool, str | None]:
        """Translate and submit one event (seen for the first time, decrypted if it was
        encrypted). (False, None) when it was not taken (everything after the stored
        token is fetched again); else (True, the event id to mark read, if any)."""
        event_id = event.get("event_id")
        if not isinstance(event_id, str):
            return True, None
        if event.get("type") not in ("m.room.message", "m.sticker"):
            return True, None
        if event.get("sender") == self.me.user_id:
            return True, None
        facts = self._facts(client, room_id)
        related = await self._related(client, room_id, event)
        result = translate_event(room_id, event, me=self.me, facts=facts, related=related)
        if isinstance(result, Skip):
            logger.debug("matrix: event {} skipped: {}", event_id, result.reason)
            return True, None
        if isinstance(result, Notice):
            self._spawn(self._send_notice, result)
            return True, event_id
        if self._submit is None:
            return True, None
        edit_of = result.metadata.get(META_EDIT_OF)
        if isinstance(edit_of, str):
            self._remember_edit(event_id, edit_of)
        ticket = await self._submit(result)
        if not ticket.taken:
            return False, None  # `_rewind` forgets it: taken when it comes again
        self._spawn(self._typing_while_pending, ticket, room_id)
        return True, event_id

    def _facts(self, client: AsyncClient, room_id: str) -> RoomFacts:
        room = client.rooms.get(room_id)
        if room is None:
            return RoomFacts(member_count=2)
        names = {user_id: user.display_name or "" for user_id, user in room.users.items()}
        count = room.joined_count + room.invited_count
        return RoomFacts(member_count=max(count, len(room.users)), names=names)

    async def _related(
        self, client: AsyncClient, room_id: str, event: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """The event this one refers to (the message an edit changes, or the one a reply
        answers), when the homeserver hands it over within a few seconds."""
        from nio import MegolmEvent, RoomGetEventResponse

        content = event.get("content")
        if not isinstance(content, Mapping):
            return None
        wanted = edited_event_id(content) or replied_event_id(content)
        if wanted is None:
            return None
        with anyio.move_on_after(5):
            try:
                answer = await client.room_get_event(room_id, wanted)
            except Exception as exc:  # a context nicety: never a reason to lose the message
                logger.debug("matrix: event {} not fetched: {!r}", wanted, exc)
                return None
            if isinstance(answer, RoomGetEventResponse):
                related: Any = answer.event
                if isinstance(related, MegolmEvent):
                    related = self._crypto.decrypt(related, room_id) if self._crypto else None
                source = getattr(related, "source", None)
                return source if isinstance(source, Mapping) else None
        return None

    # ----------------------------------------------------------------- invites, rooms

    async def _take_invites(self, response: Any) -> bool:
        """Answer every invite of a batch on the homeserver: join, or decline. False when
        one is not answered yet; the batch is then not confirmed, so the invite comes
        again from the stored token, after a restart too.

        Each invite is decided when it comes, by the access gate: a second invite to a
        room (from a stranger approved since the first) is answered as a first one is.
        All that is remembered is which invites of a batch were answered, for when the
        homeserver hands out that batch again (after a rewind, Synapse answers from its
        response cache); it never stands in for an answer."""
        # A failing invite comes again with every batch until it is answered; one that
        # does not was withdrawn meanwhile.
        self._invite_failing = {
            room: began
            for room, began in self._invite_failing.items()
            if room in response.rooms.invite
        }
        answered = True
        for room_id, info in response.rooms.invite.items():
            key = (str(response.next_batch), room_id)
            if key in self._invites_answered:
                continue
            if not await self._settle_invite(room_id, info):
                answered = False
                continue
            self._invites_answered[key] = None
            if len(self._invites_answered) > _SEEN_EVENTS:
                self._invites_answered.popitem(last=False)
        return answered

    async def _settle_invite(self, room_id: str, info: Any) -> bool:
        """Answer one invite. True once it is settled: joined, declined, or no longer
        there to answer (the homeserver says so); False while it is to be tried again.
        An invite still failing after `Pacing.invite_patience` is declined, saying so."""
        with logger.contextualize(session=f"{CHANNEL}:{room_id}"):
            try:
                await self._answer_invite(room_id, info)
            except MatrixSetupError:
                raise
            except RequestFailed as exc:
                if exc.retryable:
                    return await self._invite_failed(room_id, exc)
                logger.warning("matrix: the invite to {} cannot be answered: {}", room_id, exc)
            except Exception as exc:  # the access check; retried like the homeserver
                return await self._invite_failed(room_id, exc)
            self._invite_failing.pop(room_id, None)
            return True

    async def _invite_failed(self, room_id: str, exc: Exception) -> bool:
        """An invite's answer failed: False to try it again, until its patience is out;
        then decline it with `INVITE_FAILED` (True once that is done)."""
        now = time.monotonic()
        began = self._invite_failing.setdefault(room_id, now)
        if now - began < self.pacing.invite_patience:
            logger.warning(
                "matrix: the invite to {} is not answered yet ({}); retrying",
                room_id,
                _describe(exc),
            )
            return False
        logger.warning(
            "matrix: the invite to {} could not be answered for {:g}s ({}); declining it",
            room_id,
            self.pacing.invite_patience,
            _describe(exc),
        )
        try:
            await self._leave(room_id, INVITE_FAILED)
        except RequestFailed as failure:
            if failure.retryable:
                return False
            logger.warning("matrix: the invite to {} cannot be answered: {}", room_id, failure)
        self._invite_failing.pop(room_id, None)
        return True

    async def _answer_invite(self, room_id: str, info: Any) -> None:
        """Join when the inviter may talk to the bot; decline otherwise, with the reason
        (a stranger's pairing code, under `dm_policy = "pairing"`). Raises when the
        answer could not be given (RequestFailed, or what the access check raised)."""
        inviter = ""
        encrypted = False
        for item in info.invite_state:
            source = getattr(item, "source", None)
            if not isinstance(source, Mapping):
                continue
            if source.get("type") == "m.room.encryption":
                encrypted = True
            if source.get("type") == "m.room.member" and source.get("state_key") == self.me.user_id:
                inviter = str(source.get("sender") or "")
        if encrypted and self._encryption_off is not None:
            logger.warning(
                "matrix: invite from {} to encrypted room {} declined: {}",
                inviter,
                room_id,
                self._encryption_off,
            )
            await self._leave(room_id, ENCRYPTED_REFUSAL)
            return
        decision: Decision | None = None
        if self.invite_check is not None and inviter:
            probe = InboundMessage(
                channel=CHANNEL,
                chat_id=room_id,
                text="",
                sender_id=inviter,
                metadata={META_IS_GROUP: False, META_SENDER_NAME: inviter},
            )
            decision = await self.invite_check(probe)
        if isinstance(decision, Allow):
            try:
                await self._join(room_id)
            except RequestFailed as exc:
                if exc.retryable:
                    raise
                logger.warning("matrix: could not join {} ({}); declining the invite", room_id, exc)
                await self._leave(room_id, INVITE_FAILED)
                return
            logger.info("matrix: joined {} on the invite of {}", room_id, inviter)
            return
        reason = decision.reply if isinstance(decision, Challenge | Deny) else None
        logger.info(
            "matrix: invite from {} to {} declined (not paired or allowlisted)",
            inviter or "someone",
            room_id,
        )
        await self._leave(room_id, reason)

    async def _join(self, room_id: str) -> None:
        path = f"/_matrix/client/v3/join/{_quote(room_id)}"
        await self._request("POST", path, {}, what=f"join {room_id}")

    async def _leave(self, room_id: str, reason: str | None) -> None:
        """Leave a room, or decline an invite, saying why (the reason shows in the room)."""
        body: dict[str, Any] = {"reason": reason} if reason else {}
        path = f"/_matrix/client/v3/rooms/{_quote(room_id)}/leave"
        await self._request("POST", path, body, what=f"leave {room_id}")

    async def _refuse_encrypted(self, client: AsyncClient, room_id: str) -> None:
        """Encryption is off: say once that encrypted rooms are refused, then leave."""
        if room_id in self._refused:
            return
        self._refused.add(room_id)
        logger.warning(
            "matrix: room {} is end-to-end encrypted and {}; leaving it",
            room_id,
            self._encryption_off,
        )
        try:
            content = notice_content(ENCRYPTED_REFUSAL)
            # In clear, as it always was: no keys to encrypt with, and it says only that.
            await self._put_event(
                room_id, "m.room.message", content, transaction_id("refusal", room_id)
            )
            await self._leave(room_id, ENCRYPTED_REFUSAL)
        except RequestFailed as exc:
            self._refused.discard(room_id)
            logger.warning("matrix: could not leave encrypted room {}: {}", room_id, exc)

    # ----------------------------------------------------------------- requests

    async def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        *,
        what: str,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """One client-server API request, repeated while that may help (429s wait for
        `retry_after_ms`, 5xx and connection failures back off) and before `deadline`.
        Only idempotent requests come here (a send carries its transaction id)."""
        import json as jsonlib

        client = self._client
        if client is None:  # between two runs (one is restarting): it may go out later
            raise RequestFailed(f"{what}: the channel is not running", retryable=True)
        attempt = 0
        until = deadline if deadline is not None else time.monotonic() + self.pacing.reply_deadline
        data = jsonlib.dumps(body) if body is not None else None
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        while True:
            attempt += 1
            try:
                with anyio.fail_after(self.pacing.request_timeout):
                    answer = await client.send(method, path, data, headers)
                    raw = await answer.read()
                payload = jsonlib.loads(raw) if raw else {}
                status = answer.status
                if status < 300:
                    return payload if isinstance(payload, dict) else {}
                error = payload.get("errcode") if isinstance(payload, dict) else None
                message = payload.get("error") if isinstance(payload, dict) else None
                failure = RequestFailed(
                    f"{what}: HTTP {status} {error or ''} {message or ''}".strip(),
                    status=status,
                    retryable=status == 429 or status >= 500,
                    retry_after=(payload.get("retry_after_ms") or 1000) / 1000
                    if status == 429 and isinstance(payload, dict)
                    else None,
                )
                if error == "M_UNKNOWN_TOKEN":
                    raise self._token_refused()
            except (TimeoutError, OSError) as exc:
                failure = RequestFailed(f"{what}: {exc!r}", retryable=True)
            except Exception as exc:
                if isinstance(exc, MatrixSetupError):
                    raise
                failure = RequestFailed(f"{what}: {exc!r}", retryable=True)
            if not failure.retryable or attempt >= self.pacing.retry_attempts:
                raise failure
            delay = failure.retry_after or min(
                self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
            )
            if time.monotonic() + delay > until:
                raise failure
            logger.warning("matrix: {}; retry {} in {:g}s", failure, attempt, delay)
            await anyio.sleep(delay)

    async def _send_event(
        self,
        room_id: str,
        content: Mapping[str, Any],
        txn: str,
        *,
        event_type: str = "m.room.message",
        deadline: float | None = None,
    ) -> str:
        """Send one event with transaction id `txn` (repeating it is harmless: the
        homeserver keeps one event per transaction); its event id. Into an encrypted
        room it goes encrypted, or not at all."""
        if await self._room_encrypted(room_id, deadline):
            return await self._send_encrypted(room_id, event_type, content, txn, deadline)
        return await self._put_event(room_id, event_type, content, txn, deadline)

    async def _put_event(
        self,
        room_id: str,
        event_type: str,
        content: Mapping[str, Any],
        txn: str,
        deadline: float | None = None,
    ) -> str:
        path = f"/_matrix/client/v3/rooms/{_quote(room_id)}/send/{_quote(event_type)}/{_quote(txn)}"
        answer = await self._request(
            "PUT", path, content, what=f"send to {room_id}", deadline=deadline
        )
        return str(answer.get("event_id") or "")

    async def _room_encrypted(self, room_id: str, deadline: float | None = None) -> bool:
        """Is `room_id` end-to-end encrypted? The /sync loop's state says so where it
        runs; a standby replica asks the homeserver (a "yes" is kept: encryption cannot
        be turned off; a "no" for `Pacing.encryption_recheck` seconds)."""
        client = self._client
        room = client.rooms.get(room_id) if client is not None else None
        if room is not None:
            return bool(room.encrypted)
        now = time.monotonic()
        seen = self._encryption_seen.get(room_id)
        if seen is not None and (seen[0] or now - seen[1] < self.pacing.encryption_recheck):
            return seen[0]
        path = f"/_matrix/client/v3/rooms/{_quote(room_id)}/state/m.room.encryption/"
        try:
            await self._request(
                "GET", path, None, what=f"encryption of {room_id}", deadline=deadline
            )
            encrypted = True
        except RequestFailed as exc:
            if exc.status not in (403, 404):
                raise
            encrypted = False  # none set (404), or the bot is not in it: the send says so
        if len(self._encryption_seen) > _SEEN_EVENTS:
            self._encryption_seen.clear()
        self._encryption_seen[room_id] = (encrypted, now)
        return encrypted

    async def _send_encrypted(
        self,
        room_id: str,
        event_type: str,
        content: Mapping[str, Any],
        txn: str,
        deadline: float | None,
    ) -> str:
        """Encrypt and send, here when this process holds the device's keys, else through
        the replica that does (`relay`)."""
        if self._encryption_off is not None and self.relay is None:
            raise RequestFailed(
                f"send to {room_id}: the room is encrypted and {self._encryption_off}",
                retryable=False,
            )
        until = deadline if deadline is not None else time.monotonic() + self.pacing.reply_deadline
        if self._crypto is not None or self.relay is None:
            # The keys are (or, in one process, will be) here: ready after the first
            # /sync of the run, which tells the rooms' members.
            with anyio.move_on_after(max(0.0, until - time.monotonic())):
                await self._crypto_ready.wait()
        attempt = 0
        while (crypto := self._crypto) is not None and self._crypto_ready.is_set():
            try:
                payload = await crypto.encrypt(room_id, event_type, content)
            except CryptoClosed:
                break  # handed over meanwhile: the new holder encrypts it
            except CryptoFailed as exc:
                attempt += 1
                delay = min(self.pacing.retry_backoff * 2 ** (attempt - 1), 4.0)
                if attempt >= self.pacing.retry_attempts or time.monotonic() + delay > until:
                    raise RequestFailed(f"encrypt for {room_id}: {exc}", retryable=True) from None
                logger.warning("matrix: encrypt for {} failed ({}); retrying", room_id, exc)
                await anyio.sleep(delay)
            else:
                return await self._put_event(room_id, "m.room.encrypted", payload, txn, until)
        if self.relay is None:
            raise RequestFailed(
                f"send to {room_id}: the device's encryption keys are not loaded yet",
                retryable=True,
            )
        from gateway.journal.protocol import RelayRefused, RelayUnanswered

        request = {"room_id": room_id, "type": event_type, "content": dict(content), "txn": txn}
        try:
            answer = await self.relay.call(txn, request, deadline=until)
        except RelayRefused as exc:
            raise RequestFailed(f"send to {room_id}: {exc}", retryable=False) from None
        except RelayUnanswered as exc:
            raise RequestFailed(f"send to {room_id}: {exc}", retryable=True) from None
        except Exception as exc:  # the database: the delivery is tried again later
            raise RequestFailed(
                f"send to {room_id}: relay failed ({exc})", retryable=True
            ) from None
        return str(answer.get("event_id") or "")

    async def _relayed_send(self, request: dict[str, Any]) -> dict[str, Any]:
        """Another replica's event for an encrypted room, sent here (the relay's handler):
        the same transaction id, so a repeat is the same event."""
        from gateway.journal.protocol import RelayRefused

        try:
            event_id = await self._send_event(
                str(request["room_id"]),
                dict(request["content"]),
                str(request["txn"]),
                event_type=str(request.get("type") or "m.room.message"),
            )
        except RequestFailed as exc:
            if exc.retryable:
                raise
            raise RelayRefused(str(exc)) from None
        except (KeyError, TypeError) as exc:
            raise RelayRefused(f"a malformed request ({exc!r})") from None
        return {"event_id": event_id}

    # ----------------------------------------------------------------- typing, receipts

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    async def _typing_while_pending(self, ticket: Ticket, room_id: str) -> None:
        """Show "typing" in the room until the ticket's reply is ready."""
        await self._typing.while_pending(
            ticket,
            room_id,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_timeout * 2 / 3,
            limit=self.pacing.turn_limit,
        )

    async def _typing_on(self, room_id: str) -> None:
        await self._set_typing(room_id, True)

    async def _typing_off(self, room_id: str) -> None:
        await self._set_typing(room_id, False)

    async def _set_typing(self, room_id: str, typing: bool) -> None:
        client = self._client
        if client is None:
            return
        try:
            await client.room_typing(
                room_id, typing_state=typing, timeout=int(self.pacing.typing_timeout * 1000)
            )
        except Exception as exc:  # an indicator only
            logger.debug("matrix: typing notification failed: {!r}", exc)

    async def _read_receipt(self, room_id: str, event_id: str) -> None:
        """Mark the room read up to `event_id` once its messages are journaled."""
        path = f"/_matrix/client/v3/rooms/{_quote(room_id)}/receipt/m.read/{_quote(event_id)}"
        try:
            await self._request("POST", path, {}, what=f"read receipt in {room_id}")
        except RequestFailed as exc:
            logger.debug("matrix: read receipt skipped: {}", exc)

    async def _send_notice(self, notice: Notice) -> None:
        if not self._noticed.allow(notice.room_id, self.pacing.notice_cooldown):
            return
        content = notice_content(notice.text) | reply_relation(notice.event_id, None)
        try:
            await self._send_event(
                notice.room_id, content, transaction_id("notice", notice.event_id)
            )
        except RequestFailed as exc:
            logger.warning("matrix: a notice to {} was not sent: {}", notice.room_id, exc)

    # ----------------------------------------------------------------- outbound

    def _remember_edit(self, edit: str, original: str) -> None:
        self._edits[edit] = original
        if len(self._edits) > _SEEN_EVENTS:
            self._edits.popitem(last=False)

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Markdown as `body` and HTML as `formatted_body`, split under
        the event size limit, in order, as a reply (a thread reply in a thread); then its
        files. Sends none of the pieces after one that failed (they would read out of
        context).

        Raises `DeliveryFailed` when a piece did not go out and may later (the homeserver
        unreachable, a 5xx, a 429 asking to wait past the reply's deadline), also when it
        may have gone out (a connection dropped before the answer): every piece is a
        transaction the homeserver keeps once, so sending it again never shows it twice.
        The same reply sent again goes on from that piece, as the same transactions.
        Raises RequestFailed for a piece that can never go out (the bot is not in the
        room)."""
        room_id, thread = parse_target(message.chat_id, message.thread_id)
        reply_to = message.reply_to
        if reply_to is not None:
            reply_to = self._edits.get(reply_to, reply_to)
        pieces = split_reply(message.text) if message.text.strip() else []
        stream = await self._finish_stream(message)
        deadline = time.monotonic() + self.pacing.reply_deadline
        resume = (message.session_key, message.reply_to, message.text)
        key, done = self._cut_short.pop(resume, ("", 0))
        # Without the message it answers, a reply has nothing that makes it the same
        # transaction when sent again, unless a failure cut it short here (kept above).
        key = key or message.reply_to or f"unanswered:{secrets.token_hex(8)}"
        with logger.contextualize(session=message.session_key):
            if not pieces and not message.files:
                logger.warning("matrix: empty reply not sent")
                return
            if pieces and not done and stream is not None and stream.event_id is not None:
                edit = edit_content(stream.event_id, text_content(pieces[0]))
                try:
                    await self._send_event(
                        room_id, edit, transaction_id(key, "final", pieces[0]), deadline=deadline
                    )
                    done = 1
                except RequestFailed as exc:
                    logger.warning("matrix: streamed message not edited ({}); sending it", exc)
            try:
                for index in range(done, len(pieces)):
                    content = text_content(pieces[index])
                    if index == 0:
                        content |= reply_relation(reply_to, thread)
                    elif thread is not None:
                        content |= reply_relation(None, thread)
                    txn = transaction_id(key, "part", str(index), pieces[index])
                    await self._send_event(room_id, content, txn, deadline=deadline)
                    done = index + 1
                for index, file in enumerate(message.files):
                    if len(pieces) + index < done:
                        continue
                    await self._send_file(room_id, thread, file, key, index, deadline)
                    done = len(pieces) + index + 1
            except RequestFailed as exc:
                if not exc.retryable:
                    raise
                self._cut_short[resume] = (key, done)
                while len(self._cut_short) > _SEEN_EVENTS:
                    self._cut_short.popitem(last=False)
                raise DeliveryFailed(f"matrix: {exc}", sent=done) from exc

    async def _send_file(
        self,
        room_id: str,
        thread: str | None,
        file: OutboundFile,
        key: str,
        index: int,
        deadline: float,
    ) -> None:
        """Upload one file to the content repository and send it (m.image or m.file).
        Into an encrypted room the file is encrypted before it is uploaded (AES-CTR, a
        new key per file, carried inside the encrypted event)."""
        from aiohttp import ClientError
        from nio import UploadResponse

        client = self._client
        if client is None:  # between two runs (one is restarting): it may go out later
            raise RequestFailed("upload: the channel is not running", retryable=True)
        digest = hashlib.sha256(file.data).hexdigest()
        encrypted = await self._room_encrypted(room_id, deadline)
        data, keys, mime = file.data, None, file.mime_type
        if encrypted:
            data, keys = await anyio.to_thread.run_sync(encrypt_file, file.data)
            mime = "application/octet-stream"  # what the content repository may see
        try:
            uploaded, _ = await client.upload(
                io.BytesIO(data),
                content_type=mime,
                filename=None if encrypted else file.name,
                filesize=len(data),
            )
        except (TimeoutError, OSError, ClientError) as exc:  # the file never became an event
            raise RequestFailed(f"upload of {file.name}: {exc!r}", retryable=True) from None
        if not isinstance(uploaded, UploadResponse):
            answer = getattr(uploaded, "transport_response", None)
            status = getattr(answer, "status", None)
            raise RequestFailed(
                f"upload of {file.name}: {_describe(uploaded)}",
                retryable=isinstance(status, int) and (status == 429 or status >= 500),
                status=status if isinstance(status, int) else None,
            )
        content: dict[str, Any] = {
            "msgtype": "m.image" if file.is_image else "m.file",
            "body": file.caption or file.name,
            "filename": file.name,
            "info": {"mimetype": file.mime_type, "size": len(file.data)},
            **NO_MENTIONS,  # a caption's "@room" pings nobody either
        }
        if keys is not None:
            content["file"] = {"url": uploaded.content_uri, **keys}
        else:
            content["url"] = uploaded.content_uri
        content |= reply_relation(None, thread) if thread is not None else {}
        txn = transaction_id(key, "file", str(index), file.name, digest)
        await self._send_event(room_id, content, txn, deadline=deadline)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent: its mxc:// URI through the authenticated content
        repository (`/_matrix/client/v1/media/download`), at most `max_bytes`; decrypted
        (its hash checked first) when it came from an encrypted room."""
        if attachment.size is not None and attachment.size > max_bytes:
            raise MediaError(
                f"it is {attachment.size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        mxc, secret = split_file_id(attachment.file_id)
        parsed = urllib.parse.urlparse(mxc)
        if parsed.scheme != "mxc" or not parsed.netloc or not parsed.path.strip("/"):
            raise MediaError("the file's address is not an mxc:// URI")
        url = (
            f"{self.homeserver}/_matrix/client/v1/media/download/"
            f"{_quote(parsed.netloc)}/{_quote(parsed.path.strip('/'))}"
        )
        headers = {"Authorization": f"Bearer {self._token}"}
        # AES-CTR keeps the size: the cap on the ciphertext is the cap on the file.
        data = await download_capped(url, max_bytes, headers=headers)
        if secret is None:
            return data
        try:
            return await anyio.to_thread.run_sync(decrypt_file, data, secret)
        except ValueError as exc:
            raise MediaError(f"the encrypted file could not be decrypted ({exc})") from None

    # ----------------------------------------------------------------- streaming

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """Show the reply to `inbound` while it is written: the first text after
        `Pacing.stream_interval` becomes an event, replaced (`m.replace`) at most once
        per interval; `send` with the whole reply replaces it a last time. Does nothing
        unless `channels.matrix.streaming` is on."""
        if not self.settings.streaming or not delta:
            return
        key = inbound.session_key
        now = time.monotonic()
        stream = self._streams.get(key)
        if stream is None or stream.reply_to != inbound.message_id or stream.closed:
            self._forget_stale_streams(now)
            room_id, thread = parse_target(inbound.chat_id, inbound.thread_id)
            stream = _Stream(
                reply_to=inbound.message_id,
                room_id=room_id,
                thread=thread,
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
        """One streaming update: best effort (the final `send` corrects what is shown).
        The first update's transaction id comes from the message it answers, so a turn
        run again after a crash shows its preview in the same event."""
        try:
            pieces = split_reply(stream.text)
            if stream.closed or not pieces or pieces[0] == stream.shown:
                return
            preview = pieces[0]
            deadline = time.monotonic() + self.pacing.stream_interval * 5
            key = stream.reply_to or f"stream:{secrets.token_hex(8)}"
            if stream.event_id is None:
                content = text_content(preview) | reply_relation(stream.reply_to, stream.thread)
                stream.event_id = await self._send_event(
                    stream.room_id, content, transaction_id(key, "stream"), deadline=deadline
                )
            else:
                edit = edit_content(stream.event_id, text_content(preview))
                await self._send_event(
                    stream.room_id, edit, transaction_id(key, "edit", preview), deadline=deadline
                )
            stream.shown = preview
        except (RequestFailed, MatrixSetupError) as exc:
            logger.debug("matrix: streaming update skipped: {}", exc)
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


class _MemoryCursors:
    """The since token (and blobs) in memory only (a channel run without `lead`)."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._blobs: dict[str, bytes] = {}

    async def load(self, name: str) -> str | None:
        return self._values.get(name)

    async def save(self, name: str, value: str) -> None:
        self._values[name] = value

    async def load_blob(self, name: str) -> bytes | None:
        return self._blobs.get(name)

    async def save_blob(self, name: str, data: bytes) -> None:
        self._blobs[name] = data


def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _describe(response: object) -> str:
    """A failed nio response or exception, in a few words (never the token)."""
    if isinstance(response, BaseException):
        return f"{type(response).__name__}: {response}"
    status = getattr(response, "status_code", None)
    message = getattr(response, "message", None)
    return f"{status or ''} {message or type(response).__name__}".strip()


async def who_am_i(client: AsyncClient, homeserver: str, expected: str) -> Identity:
    """The account behind the token (`/account/whoami`) and its display name. Raises
    MatrixSetupError saying what to fix."""
    from nio import ProfileGetDisplayNameResponse, WhoamiResponse

    try:
        answer = await client.whoami()
    except Exception as exc:
        raise MatrixSetupError(
            f"matrix: cannot reach the homeserver at {homeserver} ({type(exc).__name__}); "
            "check channels.matrix.homeserver and the network"
        ) from None
    if not isinstance(answer, WhoamiResponse):
        if getattr(answer, "status_code", None) == "M_UNKNOWN_TOKEN":
            raise MatrixSetupError(
                f"matrix: {homeserver} refused the access token; log in again and put the "
                f"new token in {ENV_PREFIX}ACCESS_TOKEN (docs/matrix.md)"
            )
        raise MatrixSetupError(
            f"matrix: {homeserver} did not say who the token belongs to ({_describe(answer)}); "
            "check channels.matrix.homeserver (the client-server API's URL)"
        )
    if answer.user_id != expected:
        raise MatrixSetupError(
            f"matrix: the access token belongs to {answer.user_id}, not to {expected}; "
            "fix channels.matrix.user_id or the token"
        )
    name = ""
    try:
        profile = await client.get_displayname(expected)
        if isinstance(profile, ProfileGetDisplayNameResponse):
            name = profile.displayname or ""
    except Exception as exc:  # a display name is a nicety for mentions
        logger.debug("matrix: display name not read: {!r}", exc)
    return Identity(expected, name)


# --------------------------------------------------------------------------- doctor


async def check_credentials(settings: MatrixSettings, token: str) -> str:
    """`gateway doctor`: is the homeserver reachable, and is the account logged in?
    Returns "@user:server on <homeserver>"; raises MatrixSetupError saying what to fix."""
    if not token:
        raise MatrixSetupError(
            f"matrix: no access token; set {ENV_PREFIX}ACCESS_TOKEN (docs/matrix.md)"
        )
    channel = MatrixChannel(settings, token=token)
    client = channel._build_client()
    try:
        me = await who_am_i(client, channel.homeserver, channel.me.user_id)
    finally:
        await client.close()
    shown = f"{me.user_id} ({me.display_name})" if me.display_name else me.user_id
    return f"{shown} on {channel.homeserver}"
