"""Fencing tokens: a turn's writes in the shared mode carry its session lease's epoch, and
PostgreSQL refuses them once the lease has moved on (migration 0010, ``gw_fence``).

The promise kept here, with `gateway.dispatch.router` and `gateway.dispatch`: a replica whose
lease of a session went to another replica while it was paused (a stop-the-world GC, a
VM migration, a CPU quota, SIGSTOP) stores nothing and sends nothing for that session
when it wakes up. At most the one send already under way when it froze can still go out.

How:
- Each change of a lease's owner gives it a new epoch (a sequence). The router feeds a
  session's messages with the `Fence` of the lease it holds; the dispatcher runs their
  turns inside `fenced(fence)`, so every store a turn reaches (the session appends, the
  outbox, the journal's answered marks, memory, consolidation, schedules) finds it with
  `current()` and names it in the statement it already makes: no round trip is added.
- ``gw_fence`` locks the lease row FOR SHARE and raises SQLSTATE ``GWF01`` when the
  epoch is no longer there; `refusals` turns that into `FencedOut` and marks the fence
  lost, so the turn's later writes fail at once, without asking the database again.
- A reply is sent only after a fenced write for it succeeded and while the lease is
  surely still held: `Fence.fresh` says so from the local clock (the lease's expiry as
  of its last renewal, less a margin); past that the router asks the database once.

Usage rows are not fenced: the model call they count was made and paid for whoever
holds the lease now.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

#: The SQLSTATE ``gw_fence`` raises.
FENCE_SQLSTATE = "GWF01"


class FencedOut(Exception):
    """A write refused because the session's lease moved on since the turn began: the
    turn stops and sends nothing; the lease's new holder runs its message."""


@dataclass(eq=False, slots=True)
class Fence:
    """The lease of `key` at `epoch`, as the replica holding it knows it: surely still
    held until `deadline` (a `time.monotonic()` time), and `lost` once a renewal or a
    write found it gone."""

    key: str
    epoch: int
    deadline: float = 0.0
    lost: bool = False

    def fresh(self) -> bool:
        """Surely still held, by the local clock alone (no round trip)."""
        return not self.lost and time.monotonic() < self.deadline

    def refused(self) -> FencedOut:
        self.lost = True
        return FencedOut(f"the lease of {self.key} has moved on from epoch {self.epoch}")


_current: ContextVar[Fence | None] = ContextVar("gateway_fence", default=None)


@contextmanager
def fenced(fence: Fence | None) -> Iterator[None]:
    """Writes made inside (by this task, the tasks and threads it starts) carry `fence`."""
    token = _current.set(fence)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Fence | None:
    return _current.get()


def params() -> tuple[str | None, int | None]:
    """The current fence's ``(key, epoch)`` for a statement's ``gw_fence`` call, or
    ``(None, None)`` outside a turn (which ``gw_fence`` lets through). Raises
    `FencedOut` at once, without a round trip, for a fence already found lost."""
    fence = _current.get()
    if fence is None:
        return None, None
    if fence.lost:
        raise fence.refused()
    return fence.key, fence.epoch


def is_refusal(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) == FENCE_SQLSTATE


@contextmanager
def refusals() -> Iterator[None]:
    """Turn ``gw_fence``'s refusal, raised inside, into `FencedOut` (the fence lost)."""
    try:
        yield
    except Exception as exc:
        if not is_refusal(exc):
            raise
        fence = _current.get()
        if fence is None:
            raise FencedOut(str(exc).splitlines()[0]) from None
        raise fence.refused() from None


def check(conn: psycopg.Connection[Any]) -> None:
    """Inside a transaction of several statements: refuse it now (`FencedOut`) if the
    current fence no longer holds, and hold the lease's row until it commits. One round
    trip, only inside a turn; nothing outside one."""
    key, epoch = params()
    if epoch is None:
        return
    with refusals():
        conn.execute("SELECT gw_fence(%s, %s)", (key, epoch))
