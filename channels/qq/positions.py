"""The bot's read positions: per conversation, the time of the newest message settled
there (journaled, or skipped), so a read-back after downtime starts from it. Pure data,
saved as one cursor (`gateway.journal.protocol.CursorStore`) named `qq:<bot's QQ number>`.

QQ stamps a message with its time in whole seconds, and several messages share a
second; a conversation's history is read newest page first, by message id, not by time.
So a position is a time, and a read-back takes again everything from a margin before it
(`SLACK` seconds: messages of the same second, and a clock that set one message a little
before another that came after it): the journal's dedupe drops what it holds already,
and a message never needed again costs one lookup.

A conversation first seen through a message at `T` starts at `T - 1`, saved before that
message is submitted. The watermark is a time before which everything the bot can read
had been read (None before the first): a conversation without a position (a friend who
writes for the first time while the gateway is down) is read back from it.

Promise (tested in tests/test_qq.py): a message not settled is always read back from its
conversation's position, whatever second it shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: The version of the positions' document.
VERSION = 1
#: Seconds before a position that a read-back takes again.
SLACK = 120


@dataclass(slots=True)
class Position:
    """One conversation's read position: the newest settled message's time (Unix
    seconds), and when it last moved."""

    at: int
    updated: float = 0.0

    @classmethod
    def before(cls, sent_at: int, now: float) -> Position:
        """The position of a conversation first seen through a message sent at `sent_at`."""
        return cls(at=sent_at - 1, updated=now)

    def settle(self, sent_at: int, now: float) -> bool:
        """Move past a settled message; False when it was not newer."""
        if sent_at <= self.at:
            return False
        self.at, self.updated = sent_at, now
        return True

    @property
    def read_from(self) -> int:
        """The oldest time a read-back from here takes."""
        return self.at - SLACK


@dataclass(slots=True)
class Positions:
    """Every conversation's position, and the watermark (Unix seconds)."""

    watermark: int | None = None
    conversations: dict[str, Position] = field(default_factory=dict)

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "version": VERSION,
            "watermark": self.watermark,
            "conversations": {
                name: [p.at, round(p.updated, 3)] for name, p in sorted(self.conversations.items())
            },
        }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> Positions:
        """Raises ValueError for a document this version cannot read."""
        try:
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            mark = data["watermark"]
            found = {
                str(name): Position(int(at), float(updated))
                for name, (at, updated) in data["conversations"].items()
            }
            return cls(int(mark) if mark is not None else None, found)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
