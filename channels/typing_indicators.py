"""The "typing..." indicator an adapter shows while a turn runs: one loop per place,
however many turns wait there, started only for a turn slower than a grace period."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

from gateway.channel import Ticket

Where = TypeVar("Where", bound=Hashable)


@dataclass
class _Typing:
    waiting: int = 0
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class TypingIndicators(Generic[Where]):
    """Per place (a chat, a channel, a topic), "typing" repeated every `interval` while
    any turn there waits for its reply; `show` sends one indicator (and deals with its
    own errors). The loop stops when the last waiting turn's reply is ready; then `hide`
    (for a platform whose indicator lasts until told otherwise, as Matrix's does) is
    called, shielded, for at most two seconds."""

    def __init__(
        self,
        show: Callable[[Where], Awaitable[None]],
        hide: Callable[[Where], Awaitable[None]] | None = None,
    ) -> None:
        self._show = show
        self._hide = hide
        self._places: dict[Where, _Typing] = {}

    async def while_pending(
        self,
        ticket: Ticket,
        where: Where,
        *,
        spawn: Callable[..., None],
        grace: float,
        interval: float,
        limit: float,
    ) -> None:
        """Show "typing" in `where` until the ticket's reply is ready (at most `limit`
        seconds), none for a reply ready within `grace`. `spawn` starts the loop in
        the adapter's task group."""
        with anyio.move_on_after(grace):
            await ticket.reply()
            return  # refused, ignored, a duplicate, or simply fast
        state = self._places.get(where)
        if state is None:
            state = self._places[where] = _Typing()
            spawn(self._loop, where, state, interval)
        state.waiting += 1
        try:
            with anyio.move_on_after(limit):
                await ticket.reply()
        finally:
            state.waiting -= 1
            if state.waiting == 0:
                state.scope.cancel()
                if self._places.get(where) is state:
                    del self._places[where]

    async def _loop(self, where: Where, state: _Typing, interval: float) -> None:
        try:
            with state.scope:
                while True:
                    await self._show(where)
                    await anyio.sleep(interval)
        finally:
            if self._hide is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self._hide(where)
