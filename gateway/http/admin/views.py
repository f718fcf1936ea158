"""What the admin pages show, as pure functions: session rows, a session's tree and
transcript, live turn statistics and the safe display of hostile text."""

from __future__ import annotations

import json
import math
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from markupsafe import Markup, escape

from gateway.http.metrics import turn_outcome
from gateway.messages import OutboundMessage
from gateway.sessions import SessionInfo
from gateway.sessions.entries import (
    BranchEntry,
    CompactionEntry,
    CustomMessageEntry,
    Entry,
    LabelEntry,
    LeafEntry,
    MessageEntry,
    ModelChangeEntry,
)
from gateway.sessions.tree import TreeNode

#: Characters of one message shown before "… N more characters".
MAX_SHOWN_CHARS = 4000
#: Deepest indentation the tree view draws (deeper branches stay at this depth).
MAX_DEPTH = 12

SessionSort = Literal["recent", "oldest", "key", "size"]
SESSION_SORTS: tuple[SessionSort, ...] = ("recent", "oldest", "key", "size")


# --------------------------------------------------------------------------- text


def _visible_control(char: str) -> bool:
    """Characters shown as their code point: controls (not tab or newline) and format
    characters such as bidi overrides (U+202E), which would reorder what follows."""
    if char in "\n\t":
        return False
    return unicodedata.category(char) in ("Cc", "Cf", "Co", "Cs", "Zl", "Zp")


def show_text(text: str | None, limit: int = MAX_SHOWN_CHARS) -> Markup:
    """`text` as safe HTML: escaped, invisible and reordering characters shown as their
    code point, cut after `limit` characters with a note saying how much is left out."""
    text = text or ""
    cut = len(text) - limit if len(text) > limit else 0
    if cut:
        text = text[:limit]
    parts: list[str] = []
    plain: list[str] = []
    for char in text:
        if _visible_control(char):
            if plain:
                parts.append(str(escape("".join(plain))))
                plain = []
            parts.append(f'<span class="ctl">U+{ord(char):04X}</span>')
        else:
            plain.append(char)
    if plain:
        parts.append(str(escape("".join(plain))))
    if cut:
        parts.append(f'<span class="cut">… {cut} more characters</span>')
    return Markup("".join(parts))


# --------------------------------------------------------------------------- sessions


@dataclass(frozen=True, slots=True)
class SessionCounts:
    total: int
    matching: int
    active_hour: int
    active_day: int


def session_rows(
    infos: Iterable[SessionInfo], query: str, sort: str, now: float
) -> tuple[list[SessionInfo], SessionCounts]:
    """Sessions whose key holds `query` (case-insensitive), sorted by `sort` (one of
    `SESSION_SORTS`; anything else means "recent"), and the counts over all of them."""
    every = list(infos)
    needle = query.strip().casefold()
    rows = [i for i in every if needle in i.key.casefold()] if needle else list(every)
    if sort == "oldest":
        rows.sort(key=lambda i: i.updated_at)
    elif sort == "key":
        rows.sort(key=lambda i: i.key)
    elif sort == "size":
        rows.sort(key=lambda i: i.size_bytes, reverse=True)
    else:
        rows.sort(key=lambda i: i.updated_at, reverse=True)
    counts = SessionCounts(
        total=len(every),
        matching=len(rows),
        active_hour=sum(now - i.updated_at <= 3600 for i in every),
        active_day=sum(now - i.updated_at <= 86400 for i in every),
    )
    return rows, counts


@dataclass(frozen=True, slots=True)
class EntryView:
    """One entry as the pages show it."""

    id: str
    kind: str  # message type ("message", "compaction", ...)
    role: str  # for messages: user, assistant, tool, system; else ""
    text: str
    timestamp: float
    cache_key: str = ""  # set on an answer served from the cache


def entry_view(entry: Entry) -> EntryView:
    """What one entry says, in a line or a paragraph."""
    kind = entry.type
    if isinstance(entry, MessageEntry):
        message = entry.message
        text = message.content or ""
        if message.tool_calls:
            calls = ", ".join(
                f"{c.function_name}({json.dumps(c.arguments, ensure_ascii=False)})"
                for c in message.tool_calls
            )
            text = f"{text}\n→ {calls}" if text else f"→ {calls}"
        meta = entry.meta or {}
        key = meta.get("cache_key") if meta.get("cached") else None
        role = message.role if message.role != "tool" else f"tool {message.name or ''}".strip()
        return EntryView(entry.id, kind, role, text, entry.timestamp, str(key) if key else "")
    if isinstance(entry, CompactionEntry | BranchEntry):
        text = entry.summary
    elif isinstance(entry, LeafEntry):
        text = f"leaf moved to {entry.target_id or '(root)'}"
    elif isinstance(entry, LabelEntry):
        text = f"label {entry.label!r} on {entry.target_id}" if entry.label else "label removed"
    elif isinstance(entry, ModelChangeEntry):
        text = f"model: {entry.model}"
    elif isinstance(entry, CustomMessageEntry):
        text = entry.content
    else:
        data = entry.to_dict()
        skip = ("type", "id", "parent_id", "timestamp")
        text = json.dumps({k: v for k, v in data.items() if k not in skip}, ensure_ascii=False)
    return EntryView(entry.id, kind, "", text, entry.timestamp)


@dataclass(frozen=True, slots=True)
class TreeRow:
    """One line of the tree view: an entry, how deep it is drawn and what it is."""

    entry: EntryView
    depth: int
    label: str | None
    on_branch: bool  # on the current branch (root to leaf)
    is_leaf: bool
    forks: int  # children beyond the first: >0 where the conversation branched


def tree_rows(
    roots: Sequence[TreeNode], leaf_id: str | None, branch_ids: set[str]
) -> list[TreeRow]:
    """The tree in reading order (depth first, file order). The depth grows only where
    the conversation branched, so a long single thread stays flat; it is capped at
    `MAX_DEPTH`. Iterative: a session of any length renders without recursion."""
    rows: list[TreeRow] = []
    stack: list[tuple[TreeNode, int]] = [(root, 0) for root in reversed(roots)]
    while stack:
        node, depth = stack.pop()
        entry = node.entry
        kids = node.children
        rows.append(
            TreeRow(
                entry=entry_view(entry),
                depth=min(depth, MAX_DEPTH),
                label=node.label,
                on_branch=entry.id in branch_ids,
                is_leaf=entry.id == leaf_id,
                forks=max(0, len(kids) - 1),
            )
        )
        child_depth = depth + 1 if len(kids) > 1 else depth
        stack.extend((kid, child_depth) for kid in reversed(kids))
    return rows


_TRANSCRIPT_KINDS = frozenset({"message", "compaction", "branch", "custom_message"})


def transcript(branch: Iterable[Entry]) -> list[EntryView]:
    """The current branch as a conversation: messages, compaction and branch summaries."""
    return [entry_view(e) for e in branch if e.type in _TRANSCRIPT_KINDS]


# --------------------------------------------------------------------------- live


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """Turns of the last `window` seconds: rate, latency percentiles, errors."""

    window: float
    turns: int
    turns_per_second: float
    p50_seconds: float | None
    p95_seconds: float | None
    errors: int
    by_channel: dict[str, int]
    total_turns: int


def percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


class TurnWindow:
    """Finished turns of the last `window` seconds, for the live view. Recording is
    O(1); old turns are dropped as new ones come and when a snapshot is taken."""

    def __init__(
        self, window: float = 60.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self._clock = clock
        self._started = self._clock()
        self._turns: deque[tuple[float, float, str, str]] = deque()
        self._lock = threading.Lock()
        self._total = 0

    def record(self, reply: OutboundMessage, seconds: float) -> None:
        """One finished turn (its reply) that took `seconds`."""
        now = self._clock()
        with self._lock:
            self._turns.append((now, seconds, reply.channel, turn_outcome(reply)))
            self._total += 1
            self._drop_old(now)

    def _drop_old(self, now: float) -> None:
        while self._turns and now - self._turns[0][0] > self.window:
            self._turns.popleft()

    def snapshot(self) -> LiveSnapshot:
        now = self._clock()
        with self._lock:
            self._drop_old(now)
            turns = list(self._turns)
            total = self._total
        # Right after start-up the window is not full yet: divide by what has passed.
        span = max(1.0, min(self.window, now - self._started))
        latencies = sorted(t[1] for t in turns)
        by_channel: dict[str, int] = {}
        for _, _, channel, _ in turns:
            by_channel[channel] = by_channel.get(channel, 0) + 1
        return LiveSnapshot(
            window=self.window,
            turns=len(turns),
            turns_per_second=len(turns) / span,
            p50_seconds=percentile(latencies, 0.5),
            p95_seconds=percentile(latencies, 0.95),
            errors=sum(t[3] == "error" for t in turns),
            by_channel=dict(sorted(by_channel.items())),
            total_turns=total,
        )
