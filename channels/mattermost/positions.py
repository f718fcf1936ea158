"""The bot's read positions: per channel, how far its posts were settled (journaled, or
skipped), so a read-back after downtime starts right after them. Pure data, saved as one
cursor (`gateway.journal.protocol.CursorStore`) named `mattermost:<bot user id>`.

Mattermost's post ids are random, so a channel's order is its posts' `create_at`
(milliseconds), and two posts may share one. The REST API reads a channel forward only
strictly after a post (`GET /channels/{id}/posts?after=<post id>`: `create_at` greater
than that post's), which would skip a post written in the same millisecond as the last
one settled. So a position keeps:

- `last_at`: the `create_at` of the newest settled post, and `last_ids`, the ids of the
  settled posts of that millisecond;
- `anchor`: a settled post of an earlier millisecond (`anchor_at`), where the read-back
  starts. Everything it returns after `last_at`, and of `last_at` outside `last_ids`, is
  new; posts between the two are taken again (the journal drops what it holds).

A channel first seen through a post at `T` starts at `last_at = T - 1`, no anchor: its
read-back goes by time (newest pages first, down to `last_at`).

Promise (tested in tests/test_mattermost.py): a post settled after a position moves past
it is never needed again, and a post not settled is always read back from it, whatever
millisecond it shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

#: The version of the positions' document.
VERSION = 1


@dataclass(slots=True)
class Position:
    """One channel's read position (see the module docstring)."""

    last_at: int
    last_ids: set[str] = field(default_factory=set)
    anchor: str | None = None
    anchor_at: int = 0
    #: When it last moved (Unix seconds), to forget channels silent for months.
    updated: float = 0.0

    @classmethod
    def before(cls, create_at: int, now: float) -> Position:
        """The position of a channel first seen through a post made at `create_at`."""
        return cls(last_at=create_at - 1, updated=now)

    def settle(self, post_id: str, create_at: int, now: float) -> bool:
        """Move past a settled post; False when it was behind the position already."""
        if create_at > self.last_at:
            if self.last_ids:
                self.anchor, self.anchor_at = min(self.last_ids), self.last_at
            self.last_at, self.last_ids = create_at, {post_id}
        elif create_at == self.last_at and post_id not in self.last_ids:
            self.last_ids.add(post_id)
        else:
            return False
        self.updated = now
        return True

    def is_new(self, post_id: str, create_at: int) -> bool:
        """Whether a post read back from this position still has to be taken."""
        if create_at > self.last_at:
            return True
        if create_at == self.last_at:
            return post_id not in self.last_ids
        return create_at > self.anchor_at  # behind: taken again, the journal dedupes

    def to_json(self) -> list[Any]:
        return [
            self.last_at,
            sorted(self.last_ids),
            self.anchor,
            self.anchor_at,
            round(self.updated, 3),
        ]

    @classmethod
    def from_json(cls, data: Any) -> Position:
        last_at, ids, anchor, anchor_at, updated = data
        return cls(
            int(last_at), {str(i) for i in ids}, anchor or None, int(anchor_at), float(updated)
        )


@dataclass(slots=True)
class Positions:
    """Every channel's position, and the watermark: a `create_at` (ms) before which
    everything the bot can read had been read (None before the first)."""

    watermark: int | None = None
    channels: dict[str, Position] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": VERSION,
                "watermark": self.watermark,
                "channels": {c: p.to_json() for c, p in sorted(self.channels.items())},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str) -> Positions:
        """Raises ValueError for a document this version cannot read."""
        try:
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}")
            mark = data["watermark"]
            channels = {str(c): Position.from_json(p) for c, p in data["channels"].items()}
            return cls(int(mark) if mark is not None else None, channels)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
