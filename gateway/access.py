"""Access control at the edge: who may talk to the bot on each channel, and DM pairing.

The policy is one pure function, `decide(msg, policy, pairing, now)`, over a snapshot of
the pairing state. `AccessGate.check` feeds it from a `PairingStore` (a JSON file in the
workspace shared by the daemon and the operator's `gateway pairing ...` commands) and
records the pairing requests it issues.

Promises:
- Under `dm_policy = "pairing"` nothing a stranger writes reaches the LLM until an
  operator approved their code; the code is re-sent, not re-minted, while pending,
  and one code is sent to a sender at most once per `pairing_resend_interval`
  (`AccessGate`): messages in between are ignored without a reply.
- Pending requests are bounded per channel: expired ones go first, then new ones are
  refused with a message saying so.
- The pairing file is replaced atomically (temp + fsync + rename, mode 0600) under a
  file lock, so the daemon and the CLI can both write it; a damaged file is moved
  aside and reported, never overwritten.

Adapters set the metadata keys below on `InboundMessage.metadata`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import anyio.to_thread
from loguru import logger

from gateway.fsutil import atomic_write_text, ensure_private_dir
from gateway.messages import InboundMessage
from gateway.storage.postgres import StorageError

#: True when the message comes from a group chat / channel rather than a DM.
META_IS_GROUP = "is_group"
#: True when the bot was @-mentioned in the message.
META_MENTIONED = "mentioned"
#: True when the message replies to one of the bot's messages.
META_REPLY_TO_BOT = "reply_to_bot"
#: The sender's display name, shown to the operator when approving (optional).
META_SENDER_NAME = "sender_name"

DmPolicy = Literal["open", "allowlist", "pairing"]
GroupPolicy = Literal["open", "allowlist", "disabled"]

#: No 0/O, 1/I/L: a code read aloud or copied by hand survives.
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 8
FILE_VERSION = 1
#: The pairing file, in the workspace folder.
PAIRING_FILE = "pairing.json"
WILDCARD = "*"

PAIRING_FULL_TEXT = (
    "Too many people are waiting for approval right now. Please try again in an hour."
)

UNAVAILABLE_TEXT = "I can't check who may talk to me right now. Please try again later."

#: Seconds before a pending pairing code is sent again to a sender who keeps writing.
PAIRING_RESEND_INTERVAL = 300.0

_T = TypeVar("_T")


class PairingError(Exception):
    """An operator command that cannot be done; the message says why and what to do."""


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True, slots=True)
class ChannelAccessPolicy:
    """Who may talk to the bot on one channel.

    `allow_from` holds sender ids or chat ids (a group's id lets everyone in it in),
    or "*" for anyone. DMs: `open` answers everyone, `allowlist` only `allow_from`,
    `pairing` also senders an operator approved by code. Groups: `open`, `allowlist`
    (`allow_from` and approved senders) or `disabled`; with `require_mention` the bot
    answers in a group only when mentioned or replied to. A pending code is sent again
    to its sender at most once per `pairing_resend_interval` seconds.
    """

    dm_policy: DmPolicy = "pairing"
    allow_from: frozenset[str] = frozenset()
    group_policy: GroupPolicy = "allowlist"
    require_mention: bool = True
    pairing_ttl: float = 3600.0
    max_pending: int = 100
    pairing_resend_interval: float = PAIRING_RESEND_INTERVAL
    #: Domains whose every sender is listed (email: `example.com` lets in
    #: `*@example.com`, not `*@sub.example.com`); matched on the sender id's part after
    #: its last "@".
    allow_domains: frozenset[str] = frozenset()
    #: Refuse unlisted senders without a reply (`Ignore` instead of `Deny`): on email most
    #: of them are spam with a forged sender, whom a refusal would only reach as backscatter.
    silent_refusals: bool = False

    def __post_init__(self) -> None:
        if self.dm_policy not in ("open", "allowlist", "pairing"):
            raise ValueError(
                f"dm_policy must be open, allowlist or pairing, not {self.dm_policy!r}"
            )
        if self.group_policy not in ("open", "allowlist", "disabled"):
            raise ValueError(
                f"group_policy must be open, allowlist or disabled, not {self.group_policy!r}"
            )
        if not isinstance(self.allow_from, frozenset):
            object.__setattr__(self, "allow_from", frozenset(self.allow_from))
        if not isinstance(self.allow_domains, frozenset):
            object.__setattr__(self, "allow_domains", frozenset(self.allow_domains))
        if self.pairing_ttl <= 0 or self.max_pending < 1:
            raise ValueError("pairing_ttl and max_pending must be positive")
        if self.pairing_resend_interval < 0:
            raise ValueError("pairing_resend_interval must not be negative")

    def lists(self, msg: InboundMessage) -> bool:
        """Is the sender or the chat in `allow_from`?"""
        allowed = self.allow_from
        if WILDCARD in allowed or msg.sender_id in allowed or msg.chat_id in allowed:
            return True
        _, at, domain = msg.sender_id.rpartition("@")
        return bool(at and self.allow_domains and domain in self.allow_domains)


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A stranger's request to talk to the bot, waiting for an operator's approval."""

    channel: str
    sender_id: str
    code: str
    created_at: float
    expires_at: float
    chat_id: str = ""
    label: str = ""

    def live(self, now: float) -> bool:
        return self.expires_at > now


@dataclass(frozen=True, slots=True)
class ApprovedSender:
    channel: str
    sender_id: str
    approved_at: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class PairingState:
    """A snapshot of the pairing file. Treat it as read-only; stores make new ones."""

    approved: Mapping[tuple[str, str], ApprovedSender] = field(default_factory=dict)
    pending: tuple[PendingRequest, ...] = ()

    def is_approved(self, channel: str, sender_id: str) -> bool:
        return (channel, sender_id) in self.approved

    def live_pending(self, channel: str | None, now: float) -> list[PendingRequest]:
        return [
            r for r in self.pending if r.live(now) and (channel is None or r.channel == channel)
        ]

    def pending_for(self, channel: str, sender_id: str, now: float) -> PendingRequest | None:
        for request in self.pending:
            if request.channel == channel and request.sender_id == sender_id and request.live(now):
                return request
        return None


EMPTY_STATE = PairingState()


@dataclass(frozen=True, slots=True)
class Allow:
    """Hand the message to the dispatcher."""


@dataclass(frozen=True, slots=True)
class Ignore:
    """Drop the message without a reply (group chatter, unknown channel); log `reason`."""

    reason: str


@dataclass(frozen=True, slots=True)
class Deny:
    """Do not answer with the LLM; send `reply` to the sender instead."""

    reply: str
    reason: str


@dataclass(frozen=True, slots=True)
class Challenge:
    """Send `reply` (which holds `code`) to the sender; `request` is to be recorded
    when `is_new`."""

    code: str
    reply: str
    request: PendingRequest
    is_new: bool


Decision = Allow | Ignore | Deny | Challenge
ALLOW = Allow()


def new_pairing_code() -> str:
    """A one-time code: 8 characters from an unambiguous alphabet (about 40 bits)."""
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def normalize_code(code: str) -> str:
    """What an operator typed, as stored: upper case, without spaces or dashes."""
    return "".join(ch for ch in code.upper() if ch not in " -_")


def pairing_reply(request: PendingRequest, now: float) -> str:
    minutes = max(1, round((request.expires_at - now) / 60))
    return (
        "Hi! This assistant only talks to people its operator has approved. "
        f"Your pairing code is {request.code} (valid for {minutes} minutes). "
        "Send it to the operator; once they approve it, just write again."
    )


def decide(
    msg: InboundMessage,
    policy: ChannelAccessPolicy,
    pairing: PairingState,
    now: float,
    *,
    mint: Callable[[], str] = new_pairing_code,
) -> Decision:
    """The access decision for one inbound message. Pure apart from `mint`, which
    is called only when a new pairing code is needed."""
    if msg.metadata.get(META_IS_GROUP):
        return _decide_group(msg, policy, pairing)
    if policy.dm_policy == "open" or policy.lists(msg):
        return ALLOW
    if not msg.sender_id:
        return Ignore("a direct message without a sender id")
    if policy.dm_policy == "allowlist":
        if policy.silent_refusals:
            return Ignore("sender not in allow_from (refused without a reply)")
        return Deny(
            "This assistant is private. Ask its operator to add your id "
            f"({msg.sender_id}) to the allow list.",
            reason="sender not in allow_from",
        )
    if pairing.is_approved(msg.channel, msg.sender_id):
        return ALLOW
    pending = pairing.pending_for(msg.channel, msg.sender_id, now)
    if pending is not None:
        return Challenge(pending.code, pairing_reply(pending, now), pending, is_new=False)
    live = pairing.live_pending(msg.channel, now)
    if len(live) >= policy.max_pending:
        return Deny(PAIRING_FULL_TEXT, reason=f"{len(live)} pairing requests pending")
    taken = {r.code for r in live}
    code = mint()
    while code in taken:
        code = mint()
    request = PendingRequest(
        channel=msg.channel,
        sender_id=msg.sender_id,
        code=code,
        created_at=now,
        expires_at=now + policy.pairing_ttl,
        chat_id=msg.chat_id,
        label=str(msg.metadata.get(META_SENDER_NAME) or "")[:100],
    )
    return Challenge(code, pairing_reply(request, now), request, is_new=True)


def _decide_group(
    msg: InboundMessage, policy: ChannelAccessPolicy, pairing: PairingState
) -> Decision:
    if policy.group_policy == "disabled":
        return Ignore("groups are disabled on this channel")
    addressed = msg.metadata.get(META_MENTIONED) or msg.metadata.get(META_REPLY_TO_BOT)
    if policy.require_mention and not addressed:
        return Ignore("group message not addressed to the bot")
    if policy.group_policy == "open" or policy.lists(msg):
        return ALLOW
    if msg.sender_id and pairing.is_approved(msg.channel, msg.sender_id):
        return ALLOW
    return Ignore("group and sender not in allow_from")


# --------------------------------------------------------------------------- store


def _as_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _as_time(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    return float(value)


def parse_pairing(data: Any) -> tuple[PairingState, int]:
    """The state in a decoded pairing file and how many entries were unreadable.
    Raises ValueError when the file's shape is wrong as a whole."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    version = data.get("version", FILE_VERSION)
    if version != FILE_VERSION:
        raise ValueError(f"unknown version {version!r}")
    approved_raw, pending_raw = data.get("approved", []), data.get("pending", [])
    if not isinstance(approved_raw, list) or not isinstance(pending_raw, list):
        raise ValueError("'approved' and 'pending' must be lists")
    bad = 0
    approved: dict[tuple[str, str], ApprovedSender] = {}
    for item in approved_raw:
        try:
            entry = ApprovedSender(
                channel=_as_str(item.get("channel"), "channel"),
                sender_id=_as_str(item.get("sender_id"), "sender_id"),
                approved_at=_as_time(item.get("approved_at"), "approved_at"),
                label=str(item.get("label") or ""),
            )
        except (ValueError, AttributeError):
            bad += 1
            continue
        approved[(entry.channel, entry.sender_id)] = entry
    pending: list[PendingRequest] = []
    for item in pending_raw:
        try:
            pending.append(
                PendingRequest(
                    channel=_as_str(item.get("channel"), "channel"),
                    sender_id=_as_str(item.get("sender_id"), "sender_id"),
                    code=normalize_code(_as_str(item.get("code"), "code")),
                    created_at=_as_time(item.get("created_at"), "created_at"),
                    expires_at=_as_time(item.get("expires_at"), "expires_at"),
                    chat_id=str(item.get("chat_id") or ""),
                    label=str(item.get("label") or ""),
                )
            )
        except (ValueError, AttributeError):
            bad += 1
    return PairingState(approved=approved, pending=tuple(pending)), bad


def dump_pairing(state: PairingState) -> str:
    approved = sorted(state.approved.values(), key=lambda a: (a.channel, a.approved_at))
    return json.dumps(
        {
            "version": FILE_VERSION,
            "approved": [
                {
                    "channel": a.channel,
                    "sender_id": a.sender_id,
                    "approved_at": a.approved_at,
                    "label": a.label,
                }
                for a in approved
            ],
            "pending": [
                {
                    "channel": r.channel,
                    "sender_id": r.sender_id,
                    "chat_id": r.chat_id,
                    "code": r.code,
                    "created_at": r.created_at,
                    "expires_at": r.expires_at,
                    "label": r.label,
                }
                for r in state.pending
            ],
        },
        ensure_ascii=False,
        indent=1,
    )


@dataclass(frozen=True, slots=True)
class PairingListing:
    approved: tuple[ApprovedSender, ...]
    pending: tuple[PendingRequest, ...]


def pairing_listing(state: PairingState, channel: str | None, now: float) -> PairingListing:
    """Approved senders and live pending requests (of `channel`, or all), oldest first."""
    approved = sorted(
        (a for a in state.approved.values() if channel is None or a.channel == channel),
        key=lambda a: (a.channel, a.approved_at),
    )
    pending = sorted(state.live_pending(channel, now), key=lambda r: r.created_at)
    return PairingListing(tuple(approved), tuple(pending))


class PairingBackend(Protocol):
    """Where approvals and pending codes live: the workspace's pairing file
    (`PairingStore`) or PostgreSQL, shared by replicas (`gateway.access_pg`). Both
    keep the same rules: one live request per sender (an earlier one wins a race), at
    most `max_pending` live ones per channel, expired ones never count and are dropped
    on writes, a code approves only its live request. Blocking: worker threads."""

    #: A problem the operator should hear about (a damaged file set aside), or None.
    load_error: str | None

    @property
    def where(self) -> str:
        """Where the state lives, for log lines (a path, a redacted URL)."""
        ...

    def state(self) -> PairingState: ...

    def add_pending(
        self, request: PendingRequest, *, max_pending: int
    ) -> PendingRequest | None: ...

    def approve(self, channel: str, code: str) -> str | None: ...

    def revoke(self, channel: str, sender_id: str) -> bool: ...

    def is_approved(self, channel: str, sender_id: str) -> bool: ...

    def list(self, channel: str | None = None) -> PairingListing: ...


class PairingStore:
    """Approved senders and pending codes in one JSON file, shared between processes.

    Blocking file I/O: call it from a worker thread when on the event loop (as
    `AccessGate` does). Reads are served from memory while the file is unchanged
    (same inode, size and mtime), so a change made by another process is seen on the
    next read. Every change happens under an exclusive `flock` on `<file>.lock`, on a
    fresh read of the file, and is written atomically.
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._clock = clock
        self._thread_lock = threading.Lock()
        self._cached: tuple[tuple[int, int, int], PairingState] | None = None
        #: Set when a damaged file was moved aside: say it where the operator looks.
        self.load_error: str | None = None

    @property
    def where(self) -> str:
        return str(self.path)

    # -- reading -------------------------------------------------------------------

    def state(self) -> PairingState:
        """The current state (from memory when the file has not changed)."""
        identity = self._identity()
        if identity is None:
            return EMPTY_STATE
        if self._cached is not None and self._cached[0] == identity:
            return self._cached[1]
        try:
            return self._read()
        except _Damaged:
            with self._locked():
                return self._read_or_set_aside()

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> PairingState:
        """Read and parse the file; raises `_Damaged` if it cannot be used as it is."""
        identity = self._identity()
        if identity is None:
            return EMPTY_STATE
        raw = self.path.read_bytes()
        try:
            state, bad = parse_pairing(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Damaged(str(exc), EMPTY_STATE) from None
        if bad:
            raise _Damaged(f"{bad} unreadable entries", state)
        self._cached = (identity, state)
        return state

    def _read_or_set_aside(self) -> PairingState:
        """Under the lock: the state, after moving a damaged file aside (keeping what
        could be read of it)."""
        try:
            return self._read()
        except _Damaged as damage:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            counter = 1
            while aside.exists():
                aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{counter}")
                counter += 1
            self.path.rename(aside)
            self.load_error = (
                f"{self.path} was damaged ({damage.problem}); moved to {aside.name}. "
                "Approvals that could not be read must be given again."
            )
            logger.error("pairing file damaged: {}", self.load_error)
            if damage.salvaged.approved or damage.salvaged.pending:
                self._write(damage.salvaged)
            else:
                self._cached = None
            return damage.salvaged

    # -- writing -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            ensure_private_dir(self.path.parent)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _write(self, state: PairingState) -> None:
        atomic_write_text(self.path, dump_pairing(state))
        identity = self._identity()
        self._cached = (identity, state) if identity is not None else None

    def _update(self, change: Callable[[PairingState, float], tuple[PairingState, _T]]) -> _T:
        """Apply `change` to a fresh read under the lock; write if it made a new state.
        Expired requests are dropped on every write."""
        with self._locked():
            state = self._read_or_set_aside()
            now = self._clock()
            new, result = change(state, now)
            if new is not state:
                new = replace(new, pending=tuple(r for r in new.pending if r.live(now)))
                self._write(new)
            return result

    def add_pending(self, request: PendingRequest, *, max_pending: int) -> PendingRequest | None:
        """Record `request`. Returns the request on file for that sender (an earlier
        live one wins a race), or None when the channel has `max_pending` live ones."""

        def change(state: PairingState, now: float) -> tuple[PairingState, PendingRequest | None]:
            existing = state.pending_for(request.channel, request.sender_id, now)
            if existing is not None:
                return state, existing
            if len(state.live_pending(request.channel, now)) >= max_pending:
                return state, None
            return replace(state, pending=(*state.pending, request)), request

        return self._update(change)

    def approve(self, channel: str, code: str) -> str | None:
        """Approve the sender who got `code` on `channel`; their id, or None when no
        live request has that code."""
        wanted = normalize_code(code)

        def change(state: PairingState, now: float) -> tuple[PairingState, str | None]:
            for request in state.live_pending(channel, now):
                if secrets.compare_digest(request.code, wanted):
                    approved = dict(state.approved)
                    approved[(channel, request.sender_id)] = ApprovedSender(
                        channel, request.sender_id, now, request.label
                    )
                    pending = tuple(r for r in state.pending if r is not request)
                    return PairingState(approved, pending), request.sender_id
            return state, None

        return self._update(change)

    def revoke(self, channel: str, sender_id: str) -> bool:
        """Withdraw an approval (and any pending request of that sender)."""

        def change(state: PairingState, now: float) -> tuple[PairingState, bool]:
            had = (channel, sender_id) in state.approved
            pending = tuple(
                r for r in state.pending if (r.channel, r.sender_id) != (channel, sender_id)
            )
            if not had and len(pending) == len(state.pending):
                return state, False
            approved = {k: v for k, v in state.approved.items() if k != (channel, sender_id)}
            return PairingState(approved, pending), had

        return self._update(change)

    def is_approved(self, channel: str, sender_id: str) -> bool:
        return self.state().is_approved(channel, sender_id)

    def list(self, channel: str | None = None) -> PairingListing:
        """Approved senders and live pending requests, oldest first."""
        return pairing_listing(self.state(), channel, self._clock())


class _Damaged(Exception):
    def __init__(self, problem: str, salvaged: PairingState) -> None:
        super().__init__(problem)
        self.problem = problem
        self.salvaged = salvaged


# --------------------------------------------------------------------------- gate


class AccessGate:
    """The access check a channel adapter runs before `Dispatcher.submit`.

    `trusted` channels (the terminal, scheduled jobs, an authenticated API) are let
    through as they are. Other channels without a policy are closed (every message
    ignored, with a warning), so a channel added without thinking about access never
    answers strangers.

    A stranger who keeps writing gets their pending code again at most once per the
    policy's `pairing_resend_interval`; messages in between become `Ignore` (the
    dispatcher counts them as ignored). Which code went to whom when is kept in memory:
    a restart may send a code once more, never more often.
    """

    def __init__(
        self,
        policies: Mapping[str, ChannelAccessPolicy],
        store: PairingBackend,
        *,
        trusted: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policies = dict(policies)
        self.store = store
        self.trusted = trusted
        self._clock = clock
        # (channel, sender id) -> (the code last sent to them, when)
        self._codes_sent: dict[tuple[str, str], tuple[str, float]] = {}

    async def check(self, msg: InboundMessage) -> Decision:
        if msg.channel in self.trusted:
            return ALLOW
        policy = self.policies.get(msg.channel)
        if policy is None:
            logger.warning("no access policy for channel {!r}: message ignored", msg.channel)
            return Ignore(f"no access policy for channel {msg.channel!r}")
        if policy.dm_policy != "pairing" or policy.lists(msg):
            # The pairing file cannot change this decision: no I/O.
            decision = decide(msg, policy, EMPTY_STATE, self._clock())
        else:
            decision = await anyio.to_thread.run_sync(self._check_with_pairing, msg, policy)
            if isinstance(decision, Challenge):
                decision = self._throttled(msg, decision, policy.pairing_resend_interval)
        if not isinstance(decision, Allow):
            with logger.contextualize(session=msg.session_key):
                logger.info("access: {} ({})", type(decision).__name__.lower(), _reason(decision))
        return decision

    def _throttled(self, msg: InboundMessage, challenge: Challenge, interval: float) -> Decision:
        """`challenge`, or `Ignore` when its code went to this sender less than
        `interval` seconds ago. Runs on the loop: check and record are one step."""
        now = self._clock()
        sender = (msg.channel, msg.sender_id)
        sent = self._codes_sent.get(sender)
        if sent is not None and sent[0] == challenge.code and now - sent[1] < interval:
            return Ignore(f"pairing code sent {now - sent[1]:.0f}s ago; not re-sent yet")
        # Forget senders whose code could not be held back any more (bounds the dict).
        longest = max(p.pairing_resend_interval for p in self.policies.values())
        for key, (_, when) in list(self._codes_sent.items()):
            if now - when >= longest:
                del self._codes_sent[key]
        self._codes_sent[sender] = (challenge.code, now)
        return challenge

    def _check_with_pairing(self, msg: InboundMessage, policy: ChannelAccessPolicy) -> Decision:
        now = self._clock()
        try:
            decision = decide(msg, policy, self.store.state(), now)
            if not (isinstance(decision, Challenge) and decision.is_new):
                return decision
            recorded = self.store.add_pending(decision.request, max_pending=policy.max_pending)
        except OSError as exc:
            # Fail closed: without the pairing file nobody unlisted gets through.
            logger.error("pairing file {} unusable: {}", self.store.where, exc)
            return Deny(UNAVAILABLE_TEXT, reason=f"pairing file unusable ({exc.strerror})")
        except StorageError as exc:  # PostgreSQL down: closed too
            logger.error("pairing state in {} unusable: {}", self.store.where, exc)
            return Deny(UNAVAILABLE_TEXT, reason=f"pairing state unusable ({exc})")
        if recorded is None:
            return Deny(PAIRING_FULL_TEXT, reason="pairing requests full")
        if recorded is not decision.request:  # another message of theirs got there first
            return Challenge(recorded.code, pairing_reply(recorded, now), recorded, is_new=False)
        # The code itself stays out of the log: it is the sender's to hand over.
        logger.info(
            "pairing requested on {} by sender {}; `gateway pairing list` shows it",
            msg.channel,
            msg.sender_id,
        )
        return decision


def _reason(decision: Decision) -> str:
    if isinstance(decision, Ignore | Deny):
        return decision.reason
    if isinstance(decision, Challenge):
        return "pairing code re-sent" if not decision.is_new else "pairing code issued"
    return "allowed"


# --------------------------------------------------------------------------- operator


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _who(sender_id: str, label: str) -> str:
    return f"{sender_id} ({label})" if label else sender_id


def cli_pairing_approve(store: PairingBackend, channel: str, code: str) -> str:
    """`gateway pairing approve CHANNEL CODE`; raises PairingError when nothing matches."""
    pending = {r.code: r for r in store.list(channel).pending}
    sender = store.approve(channel, code)
    if sender is None:
        raise PairingError(
            f"no pending request on {channel} has code {normalize_code(code)!r} (codes expire "
            f"after an hour); run `gateway pairing list {channel}` to see the live ones"
        )
    request = pending.get(normalize_code(code))
    label = request.label if request is not None else ""
    return f"Approved {_who(sender, label)} on {channel}. They can write to the assistant now."


def cli_pairing_list(store: PairingBackend, channel: str | None = None) -> str:
    """`gateway pairing list [CHANNEL]`."""
    listing = store.list(channel)
    lines: list[str] = []
    if store.load_error:
        lines += [f"warning: {store.load_error}", ""]
    where = f" on {channel}" if channel else ""
    if listing.approved:
        lines.append(f"Approved{where}:")
        lines += [
            f"  {a.channel}  {_who(a.sender_id, a.label)}  since {_when(a.approved_at)}"
            for a in listing.approved
        ]
    else:
        lines.append(f"No approved senders{where}.")
    if listing.pending:
        lines.append(f"Pending{where} (approve with `gateway pairing approve CHANNEL CODE`):")
        lines += [
            f"  {r.channel}  {_who(r.sender_id, r.label)}  code {r.code}  "
            f"expires {_when(r.expires_at)}"
            for r in listing.pending
        ]
    else:
        lines.append(f"No pending requests{where}.")
    return "\n".join(lines)


def cli_pairing_revoke(store: PairingBackend, channel: str, sender_id: str) -> str:
    """`gateway pairing revoke CHANNEL SENDER`; raises PairingError when not approved."""
    if not store.revoke(channel, sender_id):
        raise PairingError(
            f"{sender_id} is not approved on {channel}; "
            f"`gateway pairing list {channel}` shows who is"
        )
    return f"Revoked {sender_id} on {channel}. Their next message gets a new pairing code."
