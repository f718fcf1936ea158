"""The pages open in this process, per visitor: who to wake when their log grows, and the
passing news that is not logged (a reply being written, "typing").

The log (`channels.webchat.store`) is what a page relies on; this is only how fast it
learns. A reader woken for nothing reads nothing new; a reader never woken (its visitor's
reply was written by another replica) finds the event at its next poll.

Promises (tested in tests/test_webchat_hub.py):
- A wake-up is never lost: a reader takes its `changed` event before it reads the log, and
  every `wake` after that sets it.
- News is bounded: a reader keeps the latest draft per reply and at most `MAX_NEWS` other
  items; a reader that joins late gets the drafts in progress and who is typing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import anyio

#: News items a reader keeps at most (the oldest go first).
MAX_NEWS = 64


@dataclass(eq=False)
class Reader:
    """One open page (an event stream) of a visitor."""

    visitor: str
    changed: anyio.Event = field(default_factory=anyio.Event)
    news: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_NEWS))
    drafts: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)

    def take_changed(self) -> anyio.Event:
        """A fresh `changed`, taken before reading the log: what is woken after is seen."""
        self.changed = anyio.Event()
        return self.changed

    def take_news(self) -> list[dict[str, Any]]:
        items = list(self.news) + list(self.drafts.values())
        self.news.clear()
        self.drafts.clear()
        return items


class Hub:
    """The readers of this process, by visitor (see the module doc)."""

    def __init__(self) -> None:
        self._readers: dict[str, set[Reader]] = {}
        #: Drafts being written, per visitor and reply: what a late reader is shown.
        self._drafts: dict[str, dict[str, dict[str, Any]]] = {}
        #: Messages being answered, per visitor.
        self._typing: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return sum(len(readers) for readers in self._readers.values())

    def readers_of(self, visitor: str) -> int:
        return len(self._readers.get(visitor, ()))

    def subscribe(self, visitor: str) -> Reader:
        reader = Reader(visitor)
        self._readers.setdefault(visitor, set()).add(reader)
        for message_id in sorted(self._typing.get(visitor, ())):
            reader.news.append({"type": "typing", "message_id": message_id, "on": True})
        for reply_to, draft in self._drafts.get(visitor, {}).items():
            reader.drafts[reply_to] = draft
        return reader

    def unsubscribe(self, reader: Reader) -> None:
        readers = self._readers.get(reader.visitor)
        if readers is not None:
            readers.discard(reader)
            if not readers:
                del self._readers[reader.visitor]

    def wake(self, visitor: str) -> None:
        """The visitor's log grew: their readers read it."""
        for reader in self._readers.get(visitor, ()):
            reader.changed.set()

    def wake_all(self) -> None:
        for readers in self._readers.values():
            for reader in readers:
                reader.changed.set()

    def typing(self, visitor: str, message_id: str, on: bool) -> None:
        typing = self._typing.setdefault(visitor, set())
        if on:
            typing.add(message_id)
        else:
            typing.discard(message_id)
            if not typing:
                del self._typing[visitor]
        self._tell(visitor, {"type": "typing", "message_id": message_id, "on": on})

    def notice(self, visitor: str, reply_to: str, text: str) -> None:
        """A line about the turn answering `reply_to` (the model server still busy)."""
        self._tell(visitor, {"type": "notice", "reply_to": reply_to, "text": text})

    def draft(self, visitor: str, reply_to: str, html: str) -> None:
        """The reply to `reply_to` so far (rendered): the latest replaces the one before."""
        item = {"type": "draft", "reply_to": reply_to, "html": html}
        self._drafts.setdefault(visitor, {})[reply_to] = item
        for reader in self._readers.get(visitor, ()):
            reader.drafts[reply_to] = item
            reader.changed.set()

    def draft_done(self, visitor: str, reply_to: str) -> None:
        drafts = self._drafts.get(visitor)
        if drafts is not None:
            drafts.pop(reply_to, None)
            if not drafts:
                del self._drafts[visitor]
        for reader in self._readers.get(visitor, ()):
            reader.drafts.pop(reply_to, None)

    def _tell(self, visitor: str, item: dict[str, Any]) -> None:
        for reader in self._readers.get(visitor, ()):
            reader.news.append(item)
            reader.changed.set()
