"""Queue modes: what a message does when it arrives while its conversation's turn runs.

| mode | the new message |
|---|---|
| `followup` | waits, then gets a turn of its own |
| `collect` | waits, merged with the others that waited into the next turn |
| `steer` | joins the running turn at its next step, as a user message the model sees |
| `interrupt` | stops the running turn (as `/stop` does); the next turn starts with it |

The mode of a conversation is its own (`/queue MODE`, kept in its session as a
`custom_info` entry of type `QUEUE_MODE_INFO`), else its channel's
(`[dispatch] channel_modes`), else `[dispatch] mode` (`QueueModes.resolve`).

A running turn and its dispatcher meet through the turn's `TurnInbox`: the dispatcher
makes one per turn and the turn finds it with `current_inbox()` (a context variable, as
`gateway.plumbing.fence` passes the lease), so the agent's turn can take the messages
that joined it without knowing the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from gateway.messages import InboundMessage

QueueMode = Literal["followup", "collect", "steer", "interrupt"]
QUEUE_MODES: tuple[QueueMode, ...] = get_args(QueueMode)
#: The `custom_type` of the session entry that keeps a conversation's `/queue` choice;
#: its data is ``{"mode": MODE}`` (``{"mode": null}``: back to the channel's default).
QUEUE_MODE_INFO = "queue_mode"

#: What each mode does, in the words `/queue` answers with.
MODE_TEXTS: dict[QueueMode, str] = {
    "followup": "a message you send while I answer waits, then gets its own answer",
    "collect": "messages you send while I answer are answered together, next",
    "steer": "a message you send while I work joins that work at its next step",
    "interrupt": "a message you send while I answer stops that answer, and I go on with it",
}


def stored_mode(data: Any) -> QueueMode | None:
    """The mode a `QUEUE_MODE_INFO` entry's data names (None: none, or not a mode)."""
    mode = data.get("mode") if isinstance(data, dict) else None
    for known in QUEUE_MODES:
        if mode == known:
            return known
    return None


@dataclass(frozen=True, slots=True)
class QueueModes:
    """The configured modes: `default` (`[dispatch] mode`) and each channel's own
    (`[dispatch] channel_modes`)."""

    default: QueueMode = "followup"
    channels: Mapping[str, QueueMode] = field(default_factory=dict)

    def for_channel(self, channel: str) -> QueueMode:
        return self.channels.get(channel, self.default)

    def resolve(self, channel: str, stored: Any) -> QueueMode:
        """A conversation's mode: its own (`stored`, the data of its session's latest
        `QUEUE_MODE_INFO` entry), else its channel's, else the default."""
        return stored_mode(stored) or self.for_channel(channel)


Accept = Callable[[InboundMessage], bool]


class TurnInbox:
    """The messages a running turn may take in (the `steer` mode), and the stop the
    `interrupt` mode asks of it. Made by the dispatcher for one turn of `session_key`;
    closed when the turn's handler returns, after which it gives nothing.

    `take(accept)` hands over the messages waiting behind the turn, oldest first, while
    `accept` takes them; the first it refuses (a command, a file) and everything after
    it stay queued, so the order of a conversation never changes. Each message taken is
    the turn's to store and answer: its reply is the turn's reply.
    """

    __slots__ = ("_take", "closed", "mode", "on_stop", "session_key", "stopping")

    def __init__(self, session_key: str, take: Callable[[Accept], list[InboundMessage]]) -> None:
        self.session_key = session_key
        self._take = take
        self.closed = False
        #: The conversation's mode as the turn read it from its session (None: not yet).
        self.mode: QueueMode | None = None
        #: A stop was asked for (`stop`); the turn stops at once if it has not begun.
        self.stopping = False
        #: What stops the turn's model and tool calls now (set while they run).
        self.on_stop: Callable[[], object] | None = None

    def take(self, accept: Accept) -> list[InboundMessage]:
        if self.closed:
            return []
        return self._take(accept)

    def stop(self) -> bool:
        """Stop the turn as `/stop` does; False when it was stopping or done already."""
        if self.closed or self.stopping:
            return False
        self.stopping = True
        if self.on_stop is not None:
            self.on_stop()
        return True

    def close(self) -> None:
        self.closed = True
        self.on_stop = None


_current: ContextVar[TurnInbox | None] = ContextVar("gateway_turn_inbox", default=None)


@contextmanager
def receiving(inbox: TurnInbox | None) -> Iterator[None]:
    """The turn run inside (by this task, and the tasks it starts) finds `inbox`."""
    token = _current.set(inbox)
    try:
        yield
    finally:
        _current.reset(token)


def current_inbox(session_key: str) -> TurnInbox | None:
    """The inbox of the running turn of `session_key`, if this task runs it (None in a
    subagent's turn, which runs in its parent's task under another key)."""
    inbox = _current.get()
    if inbox is None or inbox.closed or inbox.session_key != session_key:
        return None
    return inbox
