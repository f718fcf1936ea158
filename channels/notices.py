"""How often an adapter may answer a conversation with a notice of its own (a sticker,
a poll or a file it cannot read) without asking the agent."""

from __future__ import annotations

import time
from collections.abc import Hashable


class NoticeCooldown:
    """At most one notice per conversation per cooldown: someone sending ten stickers
    gets one "I can't open that", not ten. Remembers at most `remember` conversations
    (past that it forgets them all, which at worst lets one extra notice through)."""

    def __init__(self, remember: int = 10_000) -> None:
        self._remember = remember
        self._last: dict[Hashable, float] = {}

    def allow(self, conversation: Hashable, cooldown: float) -> bool:
        """True (and the notice counted) when `conversation` had none in the last
        `cooldown` seconds."""
        now = time.monotonic()
        last = self._last.get(conversation)
        if last is not None and now - last < cooldown:
            return False
        if len(self._last) > self._remember:
            self._last.clear()
        self._last[conversation] = now
        return True
