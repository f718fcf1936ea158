"""The one seam between the core and every platform: the `Channel` protocol.

A channel adapter translates platform events into `InboundMessage`s and hands them to
`submit` (the dispatcher); it never calls the LLM or touches storage itself. Replies
come back through `send`. The daemon supervises `run`: a channel that crashes is
restarted with backoff and reported unhealthy meanwhile.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import anyio.abc

from gateway.messages import InboundMessage, OutboundMessage


class Ticket(Protocol):
    """What submitting a message returns: its fate, and the reply once there is one."""

    async def reply(self) -> OutboundMessage | None: ...


Submit = Callable[[InboundMessage], Awaitable[Ticket]]


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
        """Deliver a reply (or a notice) to the platform."""
        ...
