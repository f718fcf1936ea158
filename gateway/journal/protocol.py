"""The inbound journal: what a platform handed over is answered once, and never lost.

Platforms redeliver: Slack retries an event it thinks was not acknowledged, Telegram
hands out the same updates again until a later `getUpdates` confirms them. The
dispatcher asks a `DedupeStore` about every message that carries a platform id and
drops the ones it has seen; it journals the others before the channel confirms them to
the platform, and records each reply in an outbox before it is sent.

The delivery promise, in ARCHITECTURE terms ("Delivery"): a message a platform handed
us is answered exactly once; when the process dies at the worst moment, its reply is
sent at most one extra time; it is never lost. The store keeps its part of it:
- `seen_or_add(key)` is an atomic check-and-claim: of two calls with one key, exactly
  one gets False ("new: answer it"), whatever their interleaving. `release(key)` gives
  a claim back (the message could not be journaled: the platform must send it again).
- `journal(key, msg)` returns once `msg` would survive a crash of the process; a
  channel confirms a message to its platform only after that (journal before confirm).
- `record_reply(keys, reply)` returns once the reply would survive a crash; the
  dispatcher calls it before the reply is sent, so after a crash the replay re-sends
  that reply instead of running the turn again (the outbox).
- `mark_done(key)`, after the reply went out, makes the key a duplicate for good (for
  `ttl` seconds, across restarts) and drops its journal and outbox rows.
- `unanswered()` gives back what a crash left between `journal` and `mark_done`,
  oldest first, each with its recorded reply if there was one, for the replay.

`FileDedupeStore` (one SQLite file in the workspace) is the embedded default and
assumes one daemon per workspace; `MemoryDedupeStore` is for tests and one-shot runs
and journals nothing. A shared store for replicas (PostgreSQL) implements the same
protocol, with a unique key on the platform message id in place of the in-memory claims.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from loguru import logger

from gateway.messages import InboundMessage, OutboundMessage

DEFAULT_TTL = 7 * 24 * 3600.0

DEFAULT_MAX_ENTRIES = 100_000


def dedupe_key(msg: InboundMessage) -> str | None:
    """The identity of a platform message, or None when it has no id (never deduped).

    The chat id is part of it because platform ids are unique per chat only (Telegram
    message ids, Slack `ts`). Length prefixes keep the parts apart whatever they hold.
    """
    if not msg.message_id:
        return None
    channel, chat = msg.channel, msg.chat_id
    return f"{len(channel)}:{channel}:{len(chat)}:{chat}:{msg.message_id}"


class ClaimBusy(Exception):
    """`seen_or_add` cannot say yet: another process claimed the message and has not
    journaled it (a replica, for a few milliseconds). The message is not taken now; the
    platform, not told we have it, sends it again."""


@dataclass(frozen=True, slots=True)
class Unanswered:
    """A journaled message a crash left unanswered, and the reply recorded for it
    before the crash (None: the turn never finished; it has to run)."""

    message: InboundMessage
    reply: OutboundMessage | None = None
    #: One id per recorded reply: messages merged into one turn share it.
    reply_id: str | None = None

    @classmethod
    def from_stored(
        cls, raw: str, reply_id: str | None, raw_reply: str | None
    ) -> Unanswered | None:
        """A journal row as stored (the message's and the reply's JSON); None, logged,
        when the message cannot be read. An unreadable reply is dropped: the turn then
        runs again, since a second answer beats none."""
        try:
            message = InboundMessage.from_dict(json.loads(raw))
        except (ValueError, TypeError, KeyError) as exc:
            logger.error("dedupe: an unreadable journaled message is skipped: {}", exc)
            return None
        reply = None
        if raw_reply is not None:
            try:
                reply = OutboundMessage.from_dict(json.loads(raw_reply))
            except (ValueError, TypeError, KeyError) as exc:
                logger.error("dedupe: an unreadable recorded reply is skipped: {}", exc)
        return cls(message, reply, reply_id if reply is not None else None)


@runtime_checkable
class DedupeStore(Protocol):
    """Remembers which platform messages were already taken in (see the module)."""

    async def seen_or_add(self, key: str) -> bool:
        """True if `key` was seen (a duplicate); else remember it and return False.
        Raises `ClaimBusy` when another process holds a claim it has not journaled."""
        ...

    async def release(self, key: str) -> None:
        """Forget the claim `seen_or_add` made (the message was not taken in)."""
        ...

    async def mark_done(self, key: str) -> None:
        """The message of `key` was answered: a redelivery is a duplicate for good,
        also after a restart; its journal and outbox rows go."""
        ...

    async def journal(self, key: str, msg: InboundMessage) -> None:
        """Keep `msg` until `mark_done(key)`: returns once it would survive a crash."""
        ...

    async def record_reply(self, keys: Sequence[str], reply: OutboundMessage) -> None:
        """The reply to the messages of `keys`, about to be sent: returns once it would
        survive a crash (until `mark_done`)."""
        ...

    async def unanswered(self) -> list[Unanswered]:
        """Journaled messages never answered (oldest first): what a crash left."""
        ...

    async def aclose(self) -> None: ...


@dataclass
class LeaseAsk:
    """`take_in`'s request to take the message's session lease too (the shared mode's
    `gateway.dispatch.router`): for `ttl` seconds, else to kick its holder on channel
    `kicks`; with `take` False (a pump of this replica runs the session) only the look
    below. Once the message is journaled, `taken` says how the lease went (None for a
    duplicate or a claim that waited), and `others` holds the dedupe keys of the
    session's other journaled messages as the same statement saw them (None: more than
    `look`), with `entry` the message as a read of its row would give it: the router
    hands it over without that read when it knows all the others. When the lease was
    taken, `epoch` is its fencing token and `sent` the `time.monotonic()` at which the
    statement was sent (the lease runs at least `ttl` seconds from then)."""

    ttl: float
    kicks: str
    take: bool = True
    look: int = 16
    taken: bool | None = None
    others: list[str] | None = None
    entry: Unanswered | None = None
    epoch: int | None = None
    sent: float = 0.0


class CursorStore(Protocol):
    """Named cursors (`matrix:@bot:example.org` -> a since token), and named blobs of
    state that must move with them (`matrix-crypto:@bot:example.org:DEVICE` -> bytes)."""

    async def load(self, name: str) -> str | None: ...

    async def save(self, name: str, value: str) -> None: ...

    async def load_blob(self, name: str) -> bytes | None: ...

    async def save_blob(self, name: str, data: bytes) -> None: ...


#: How a channel runs its intake loop with a store: at once (one process), or once this
#: replica holds the channel's leader role, with a store that writes under it.
Lead = Callable[[Callable[[CursorStore], Awaitable[None]]], Awaitable[None]]


class RelayRefused(Exception):
    """The role holder tried and could not do it (the message says why); asking again
    will not help."""


class RelayUnanswered(Exception):
    """No answer before the deadline (no replica holds the role yet, or it is slow). The
    request stays asked: the same key later returns its answer."""


Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class Relay(Protocol):
    """Work for the replica holding a role, asked for by the others (the shared mode's
    `gateway.journal.pg_relay.PostgresRelay`, which says what it promises)."""

    async def call(self, key: str, request: dict[str, Any], *, deadline: float) -> dict[str, Any]:
        """Ask the holder to do `request`, once per `key`; its answer. `deadline` is a
        `time.monotonic()` instant. Raises RelayRefused or RelayUnanswered."""
        ...

    async def listen(self) -> None:
        """Wake `serve` for requests and `call` for answers, until cancelled."""
        ...

    async def serve(self, handle: Handler) -> None:
        """Do the requests asked of the role holder, until cancelled (call it only while
        holding the role); `handle` raises RelayRefused for one that cannot be done."""
        ...
