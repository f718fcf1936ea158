"""The one seam between the core and every platform: the `Channel` protocol.

A channel adapter translates platform events into `InboundMessage`s and hands them to
`submit` (the dispatcher); it never calls the LLM or touches storage itself. Replies
come back through `send`. The daemon supervises `run`: a channel that crashes is
restarted with backoff and reported unhealthy meanwhile.

Journal before confirm: `submit` returns once the message is durable in the gateway's
journal, and only then may a channel tell its platform it has the message (advance the
Telegram offset, answer a webhook with 200, ack a Slack event). When the ticket says the
message was not taken, the channel must leave it with the platform, which sends it
again. A channel with a `pause_intake()` method stops taking new events when the daemon
begins to drain, leaving them with the platform for the next start.

A platform that never hands a message over again (a push without a receipt, a webhook
nobody retries, a line on IRC) cannot be asked to keep one: its channel says so with
`redelivers = False`, and the dispatcher then takes its messages whatever the load and
journals them while draining, for the next start to answer. Such a channel keeps
submitting while the daemon drains (its `pause_intake`, if any, must not refuse).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.abc
from loguru import logger

from gateway.messages import InboundMessage, OutboundMessage


class Ticket(Protocol):
    """What submitting a message returns: its fate, and the reply once there is one."""

    @property
    def taken(self) -> bool:
        """True when the platform may forget the message (it is journaled, or settled);
        False when the channel must leave it with the platform to be sent again."""
        ...

    async def reply(self) -> OutboundMessage | None: ...


Submit = Callable[[InboundMessage], Awaitable[Ticket]]


class DeliveryFailed(Exception):
    """`Channel.send` could not deliver a reply, and it certainly did not go out (the
    connection was refused, the platform answered 5xx or asked to wait longer than the
    channel waits): sending it again later may succeed. The dispatcher then keeps the
    message unanswered and sends the reply again (`gateway.dispatch.dispatcher`), rather
    than marking it answered with its reply lost. Raise any other exception for a reply
    that can never be delivered (the chat is gone, the bot was blocked) or that may have
    gone out (a timeout after the request was sent): sending it again would not help, or
    could show it twice.

    A reply of several parts may fail after some went out: the channel resends only the
    rest when the same reply comes again (`sent` says how many parts went out, for the
    log)."""

    def __init__(self, message: str, *, sent: int = 0) -> None:
        super().__init__(message)
        self.sent = sent


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class PartsSent(Generic[K, V]):
    """How far each reply cut short by `DeliveryFailed` got (its parts that went out),
    so that the same reply, sent again by the dispatcher, goes on from there. Bounded:
    past `bound` replies the oldest are forgotten (such a reply would be sent whole).
    Every channel that splits replies keeps one, keyed by what identifies a reply to
    it (its session, the message it answers, its text)."""

    def __init__(self, bound: int = 1024) -> None:
        if bound < 1:
            raise ValueError("bound must be at least 1")
        self.bound = bound
        self._parts: OrderedDict[K, V] = OrderedDict()

    def take(self, key: K, default: D) -> V | D:
        """How far the reply `key` got (forgotten here: a new failure keeps it again)."""
        return self._parts.pop(key, default)

    def keep(self, key: K, value: V) -> None:
        """Remember how far the reply `key` got, as the newest."""
        self._parts[key] = value
        self._parts.move_to_end(key)
        while len(self._parts) > self.bound:
            self._parts.popitem(last=False)

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, key: object) -> bool:
        return key in self._parts


class Channel(Protocol):
    """A platform adapter. `name` is the channel part of its session keys."""

    name: str

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Receive events until cancelled; call `task_status.started()` once live."""
        ...

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply (or a notice) to the platform; raise `DeliveryFailed` when it
        certainly did not go out and may later."""
        ...


def redelivers(channel: object) -> bool:
    """Does `channel`'s platform hand over again what the gateway did not confirm? Its
    `redelivers` attribute; True when it has none (the documented contract above)."""
    return bool(getattr(channel, "redelivers", True))


@runtime_checkable
class TurnEnricher(Protocol):
    """A channel that adds, at turn time, what its edge could not know without a
    request to the platform (Slack: the text of a thread's parent message). Called
    when the message's turn begins, never before the platform is acknowledged."""

    async def enrich_for_turn(self, message: InboundMessage) -> InboundMessage: ...


async def enrich_for_turn(channel: object, message: InboundMessage) -> InboundMessage:
    """`message` as its channel enriches it; unchanged when the channel does not, or
    when enriching fails (the turn goes on without the extra context)."""
    if not isinstance(channel, TurnEnricher):
        return message
    try:
        return await channel.enrich_for_turn(message)
    except Exception as exc:  # context is a nicety: never a reason to lose the turn
        logger.warning("{}: no extra context for this turn: {!r}", message.channel, exc)
        return message
