"""The knowledge base: typed, deduplicated entries in one `knowledge.json` per scope.

Invariants:
- One entry per (category, normalized content): adding the same thing again (case,
  spacing or trailing punctuation aside) reinforces the existing entry.
- Writes are batched (a dirty flag; flushed after `flush_every` changed entries or an
  eighth of the base, whichever is more, and on `flush()`/`close()`, when the object
  is collected and at interpreter exit) and atomic (temp + fsync + rename): an added
  entry is never silently lost short of a hard crash before the next flush.
- A damaged `knowledge.json` is never overwritten: it is moved aside to
  `knowledge.json.corrupt-<ts>`, the problem is logged and kept in `load_error`, and
  any entries that could be read are kept.
- Search is BM25 over content, tags and source from an incremental index: a query
  with several words finds entries containing any of them, best matches first.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.fsutil import atomic_write_text, ensure_private_dir
from gateway.memory.format import CATEGORIES, normalize_category
from gateway.memory.index import SearchIndex
from gateway.memory.text import normalize_text, one_line, tokenize

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class KnowledgeEntry:
    """One typed piece of knowledge; a snapshot (the base replaces it on change)."""

    id: str
    category: str
    content: str
    source: str | None = None
    tags: tuple[str, ...] = ()
    created_at: float = 0.0
    last_accessed: float = 0.0
    access_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "category": self.category,
            "content": self.content,
            "source": self.source,
            "tags": list(self.tags),
            "created_at": self.created_at,
            "last_accessed": self.last_accessed,
            "access_count": self.access_count,
        }

    @classmethod
    def from_dict(cls, data: Any) -> KnowledgeEntry:
        """Parse a stored entry; ValueError if its shape is wrong."""
        if not isinstance(data, dict):
            raise ValueError("entry is not an object")
        content = data.get("content")
        category = data.get("category")
        if not isinstance(content, str) or not content.strip():
            raise ValueError("entry has no content")
        if not isinstance(category, str):
            raise ValueError("entry has no category")
        source = data.get("source")
        tags = data.get("tags", [])
        if source is not None and not isinstance(source, str):
            raise ValueError("entry source is not a string")
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ValueError("entry tags are not a list of strings")
        numbers = {}
        for name in ("created_at", "last_accessed", "access_count"):
            value = data.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"entry {name} is not a number")
            numbers[name] = value
        category = normalize_category(category)
        content = one_line(content)
        return cls(
            id=entry_id(category, content),
            category=category,
            content=content,
            source=source,
            tags=tuple(tags),
            created_at=float(numbers["created_at"]),
            last_accessed=float(numbers["last_accessed"]),
            access_count=int(numbers["access_count"]),
        )


def entry_id(category: str, content: str) -> str:
    """The dedup key: a hash of the category and the normalized content."""
    normalized = normalize_text(content).rstrip(" .!;,")
    return hashlib.sha256(f"{category}\n{normalized}".encode()).hexdigest()[:16]


def _popularity(entry: KnowledgeEntry) -> tuple[int, float]:
    """Most accessed first, then newest first (sort with reverse=True)."""
    return (entry.access_count, entry.created_at)


@dataclass(slots=True)
class _State:
    entries: dict[str, KnowledgeEntry] = field(default_factory=dict)
    doc_of: dict[str, int] = field(default_factory=dict)
    entry_of: dict[int, str] = field(default_factory=dict)
    index: SearchIndex = field(default_factory=SearchIndex)


class KnowledgeBase:
    """Typed knowledge entries of one memory scope, persisted in `path` (JSON)."""

    def __init__(
        self,
        path: Path,
        *,
        flush_every: int = 32,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        try:
            # Never accept entries that could not be saved: the folder exists (0700)
            # before the first `add`, or the base is refused here.
            ensure_private_dir(path.parent)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"knowledge base: cannot create {path.parent} ({exc.strerror}); "
                "entries could not be saved there",
            ) from None
        self.flush_every = max(1, flush_every)
        self.load_error: str | None = None
        self.corrupt_path: Path | None = None
        self._clock = clock
        self._lock = threading.RLock()
        self._state = _State()
        self._dirty = False
        self._unsaved_changes = 0
        self._load()
        _OPEN_BASES.add(self)

    # -- reading -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._state.entries)

    def __iter__(self) -> Iterator[KnowledgeEntry]:
        with self._lock:
            return iter(list(self._state.entries.values()))

    @property
    def dirty(self) -> bool:
        """True while some change is not yet on disk."""
        return self._dirty

    def get(self, entry_id: str) -> KnowledgeEntry | None:
        return self._state.entries.get(entry_id)

    def by_category(self, category: str) -> list[KnowledgeEntry]:
        """Entries of `category`, most accessed first, then newest first."""
        with self._lock:
            found = [e for e in self._state.entries.values() if e.category == category]
        found.sort(key=_popularity, reverse=True)
        return found

    def search(
        self, query: str, category: str | None = None, max_results: int = 10
    ) -> list[KnowledgeEntry]:
        """Entries matching `query` by BM25 relevance, best first; counts as an access.

        An empty query (no searchable words) lists the category's entries, most
        accessed first. Returned entries carry their updated access count.
        """
        with self._lock:
            state = self._state
            if not tokenize(query):
                pool = (
                    self.by_category(category)
                    if category
                    else sorted(state.entries.values(), key=_popularity, reverse=True)
                )
                found = pool[:max_results]
            else:
                hits = state.index.search(query, max_results, tag=category)
                found = [state.entries[state.entry_of[h.doc_id]] for h in hits]
            return [self._touch(entry) for entry in found]

    def export_for_context(self, max_chars: int = 2000) -> str:
        """`[category] content` lines for the LLM, at most `max_chars` characters.

        Categories in priority order (user preferences, project decisions, error
        patterns, system behaviour, learned facts), most accessed first within one;
        an entry too long for the remaining budget is skipped, not cut.
        """
        lines: list[str] = []
        used = 0
        with self._lock:
            buckets: dict[str, list[KnowledgeEntry]] = {c: [] for c in CATEGORIES}
            for entry in self._state.entries.values():
                buckets[entry.category].append(entry)
        for category in CATEGORIES:
            bucket = buckets[category]
            bucket.sort(key=_popularity, reverse=True)
            for entry in bucket:
                line = f"[{entry.category}] {entry.content}"
                cost = len(line) + (1 if lines else 0)
                if used + cost > max_chars:
                    continue
                lines.append(line)
                used += cost
        return "\n".join(lines)

    # -- writing -----------------------------------------------------------------

    def add(
        self,
        category: str,
        content: str,
        *,
        source: str = "",
        tags: Iterable[str] | None = None,
    ) -> KnowledgeEntry:
        """Add an entry, or reinforce the existing one with the same normalized content.

        The parameters are seed 001's, in its order (category first). Reinforcing
        counts as an access and merges the new tags. Unknown categories become
        `learned_fact` (with a warning).
        """
        text = one_line(content)
        if not text:
            raise ValueError("a knowledge entry needs some content")
        category = normalize_category(category)
        new_tags = tuple(dict.fromkeys(t.strip() for t in tags or () if t.strip()))
        origin = source or None  # an entry without a source stores none
        key = entry_id(category, text)
        now = self._clock()
        with self._lock:
            existing = self._state.entries.get(key)
            if existing is None:
                entry = KnowledgeEntry(key, category, text, origin, new_tags, now, now, 0)
                logger.debug("Knowledge entry {} added ({})", key, category)
            else:
                merged = tuple(dict.fromkeys(existing.tags + new_tags))
                entry = replace(
                    existing,
                    tags=merged,
                    source=existing.source or origin,
                    last_accessed=now,
                    access_count=existing.access_count + 1,
                )
            self._put(entry, reindex=existing is None or entry.tags != existing.tags)
            self._changed()
            return entry

    def flush(self) -> bool:
        """Write pending changes atomically; True if something was written."""
        with self._lock:
            if not self._dirty:
                return False
            payload = {
                "version": FORMAT_VERSION,
                "entries": [e.to_dict() for e in self._state.entries.values()],
            }
            atomic_write_text(self.path, json.dumps(payload, ensure_ascii=False, indent=1))
            self._dirty = False
            self._unsaved_changes = 0
            return True

    def close(self) -> None:
        """Flush; the base stays usable (closing twice is harmless)."""
        self.flush()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Safety net: an unflushed base that is garbage-collected still saves itself.
        if getattr(self, "_dirty", False):
            with contextlib.suppress(Exception):
                self.flush()

    # -- internals ---------------------------------------------------------------

    def _put(self, entry: KnowledgeEntry, *, reindex: bool) -> None:
        state = self._state
        state.entries[entry.id] = entry
        if not reindex:
            return
        old_doc = state.doc_of.pop(entry.id, None)
        if old_doc is not None:
            state.index.remove(old_doc)
            del state.entry_of[old_doc]
        text = " ".join((entry.content, *entry.tags, entry.source or ""))
        doc = state.index.add(text, tag=entry.category)
        state.doc_of[entry.id] = doc
        state.entry_of[doc] = entry.id

    def _touch(self, entry: KnowledgeEntry) -> KnowledgeEntry:
        touched = replace(entry, access_count=entry.access_count + 1, last_accessed=self._clock())
        self._state.entries[entry.id] = touched
        self._dirty = True  # saved with the next flush; accesses alone never force one
        return touched

    def _changed(self) -> None:
        self._dirty = True
        self._unsaved_changes += 1
        # The batch grows with the base (an eighth of it) so a bulk load rewrites the
        # file O(1) times per entry amortized, not once every `flush_every` entries.
        if self._unsaved_changes >= max(self.flush_every, len(self._state.entries) // 8):
            self.flush()

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self._set_aside(f"not valid JSON ({exc})")
            return
        items = data.get("entries") if isinstance(data, dict) else data
        if not isinstance(items, list):
            self._set_aside("expected an object with an 'entries' list")
            return
        bad = 0
        for item in items:
            try:
                entry = KnowledgeEntry.from_dict(item)
            except ValueError:
                bad += 1
                continue
            existing = self._state.entries.get(entry.id)
            if existing is not None:  # edited by hand into a duplicate: merge the counts
                entry = replace(
                    existing,
                    access_count=existing.access_count + entry.access_count,
                    tags=tuple(dict.fromkeys(existing.tags + entry.tags)),
                )
            self._put(entry, reindex=existing is None or entry.tags != existing.tags)
        if bad:
            self._set_aside(f"{bad} malformed entries could not be read")
            self._dirty = bool(self._state.entries)  # write back what was salvaged

    def _set_aside(self, problem: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        counter = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{counter}")
            counter += 1
        self.path.rename(target)
        self.load_error = f"{self.path} is damaged: {problem}; moved to {target.name}"
        self.corrupt_path = target
        logger.error(
            "Knowledge base {} is damaged ({}); kept it as {} and started from the "
            "entries that could be read. Fix or merge that file by hand if needed.",
            self.path,
            problem,
            target.name,
        )


_OPEN_BASES: weakref.WeakSet[KnowledgeBase] = weakref.WeakSet()


@atexit.register
def _flush_open_bases() -> None:
    """Interpreter exit: flush every base still holding unsaved entries."""
    for base in list(_OPEN_BASES):
        try:
            base.flush()
        except Exception as exc:  # keep flushing the others
            logger.error("Could not flush knowledge base {}: {}", base.path, exc)
