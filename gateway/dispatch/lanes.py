"""What the dispatcher and the replica router know of each other: a message's `Ticket`
and its `SubmitStatus`, the `Lanes` the router feeds (the dispatcher), and the `Router` the
dispatcher asks in the shared mode (`gateway.dispatch.router.SessionRouter`).

Both sides depend on this module, never on each other, so the runtime has no import
circle: the dispatcher runs alone in the file mode, and the router is added in the
shared mode by whoever assembles the two (`gateway.daemon`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc

from gateway.messages import InboundMessage, OutboundMessage

if TYPE_CHECKING:
    from gateway.journal.protocol import LeaseAsk, Unanswered
    from gateway.plumbing.fence import Fence


class SubmitStatus(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    DENIED = "denied"  # the access policy said no; the sender got its reply (or a code)
    IGNORED = "ignored"  # not for the bot (group chatter, unknown channel); no reply
    REJECTED_FULL = "rejected_full"
    REJECTED_DRAINING = "rejected_draining"
    # Not journaled (the journal failed): not taken; the platform must send it again.
    RETRY_LATER = "retry_later"
    # Journaled, not held in memory (taken): past `max_queued_total`, fed to its lane
    # when there is room; or while the gateway stops, for the next start's replay, when
    # its platform would never hand it over again.
    KEPT = "kept"


class Ticket:
    """What `submit` hands back: the status, and the reply to await if wanted.

    `reply()` returns the reply that was (or is being) delivered for this message: the
    turn's reply, an error or a refusal notice; None for a duplicate. In collect mode
    every message of a merged turn gets the one reply of that turn.
    """

    __slots__ = ("_done", "_event", "_reply", "marked", "message", "status")

    def __init__(self, message: InboundMessage) -> None:
        self.message = message
        self.status = SubmitStatus.ACCEPTED
        #: Its message is marked answered in the journal (the mark committed): a read
        #: of the journal from now on no longer finds it.
        self.marked = False
        self._event = anyio.Event()
        self._done = anyio.Event()
        self._reply: OutboundMessage | None = None

    def __repr__(self) -> str:
        return f"Ticket({self.message.session_key!r}, {self.status.value})"

    @property
    def answered(self) -> bool:
        return self._event.is_set()

    @property
    def taken(self) -> bool:
        """May the platform forget the message? True once it is journaled (or settled:
        a duplicate, refused or ignored, its sender told); False when the gateway could
        not keep it, so the channel must not confirm it."""
        return self.status is not SubmitStatus.RETRY_LATER

    async def reply(self) -> OutboundMessage | None:
        await self._event.wait()
        return self._reply

    @property
    def finished(self) -> bool:
        """Nothing more happens for this message here: its reply went out and it was
        marked answered, or it was dropped, refused or handed to another replica."""
        return self._done.is_set()

    async def wait_finished(self) -> None:
        await self._done.wait()

    def _resolve(self, reply: OutboundMessage | None) -> None:
        if not self._event.is_set():
            self._reply = reply
            self._event.set()


class Lanes(Protocol):
    """What the replica router needs of the dispatcher: to hand it journaled messages
    (`Dispatcher.feed`), to take back those whose turns have not begun, and whether it
    is draining."""

    @property
    def draining(self) -> bool: ...

    async def feed(
        self, entry: Unanswered, *, current: bool = False, fence: Fence | None = None
    ) -> Ticket: ...

    def withdraw(self, session_key: str, tickets: Sequence[Ticket]) -> int: ...


class Router(Protocol):
    """What the dispatcher asks of the replica router in the shared mode (see
    `gateway.dispatch.router.SessionRouter` for each promise)."""

    @property
    def replica_id(self) -> str: ...

    def lease_ask(self, session_key: str) -> LeaseAsk | None: ...

    def journaled_here(self, session_key: str, dedupe_key: str, ask: LeaseAsk | None) -> None: ...

    async def confirm(self, lease: Fence) -> bool: ...

    async def publish(self, dedupe_key: str, reply: OutboundMessage) -> None: ...

    async def wait_reply(
        self, dedupe_key: str, *, fresh: bool = False
    ) -> OutboundMessage | None: ...


class ReplicaRouter(Router, Protocol):
    """The replica router as the daemon runs it (`gateway.dispatch.router.SessionRouter`,
    opened by the storage seam in the shared mode)."""

    #: Called with a session key when another replica passes a /stop on to this one.
    on_stop: Callable[[str], object] | None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None: ...

    async def stop(self) -> None: ...

    async def stop_elsewhere(self, session_key: str) -> bool: ...
