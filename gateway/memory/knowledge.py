"""The knowledge base: typed, deduplicated entries per scope, a snapshot plus a log.

Files: `knowledge.json` (a snapshot, `{"version": 1, "entries": [...]}`, the format
earlier versions wrote, so their workspaces load unchanged), `knowledge.json.log` (one
JSON entry per line, each replacing the entry with its id, appended since the
snapshot) and `knowledge.json.index` (the saved search index; a cache).

Invariants:
- One entry per (category, normalized content): adding the same thing again (case,
  spacing or trailing punctuation aside) reinforces the existing entry.
- `add` is O(1): it neither indexes nor writes. Changed entries are appended to the log
  in one write + fsync on `flush()`/`close()`, when the object is collected and at
  interpreter exit, and by a writer thread as soon as `flush_every` changes are pending
  (group commit: the add does not wait for the disk): an added entry is never silently
  lost short of a hard crash before the next flush. Once the log holds more records than
  the base has entries (and at least 1024), the snapshot is rewritten (temp + fsync +
  rename) and the log emptied: O(1) amortized per change. A crash between the two
  only replays entries the snapshot already holds.
- A damaged `knowledge.json` or log is never overwritten: it is moved aside to
  `<name>.corrupt-<ts>`, the problem is logged and kept in `load_error`, and any
  entries that could be read are kept. A torn last log line (a crash mid-write) is
  ignored. A damaged index is rebuilt.
- `remove_where` takes entries out for good: the snapshot is rewritten without them,
  the log emptied and the saved index (which holds their words) deleted. Another
  process's removal (`gateway memory forget`) is seen at the next call (two stats: a
  rewritten snapshot or a log grown by someone else reloads the files), and an entry
  removed there is not written back from here. Writes hold an `flock` on
  `knowledge.json.lock`.
- Search is BM25 over content, tags and source. Changed entries are (re)indexed in one
  batch by the next search. A reload reads the saved index when the snapshot and the
  log still hold what it covers (CRC-32), indexing only the entries logged after it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import queue
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from loguru import logger

from gateway.fsutil import append_text, atomic_write_bytes, ensure_private_dir, file_lock
from gateway.memory.format import CATEGORIES, normalize_category
from gateway.memory.index import IndexFileError, SearchIndex
from gateway.memory.text import normalize_text, one_line, tokenize

FORMAT_VERSION = 1
_COMPACT_AT = 1024  # log records before the snapshot may be rewritten


@dataclass(frozen=True, slots=True)
class KnowledgeEntry:
    """One typed piece of knowledge; a snapshot (the base replaces it on change)."""

    id: str
    category: str
    content: str
    source: str | None = None
    tags: tuple[str, ...] = ()
    created_at: float = 0.0
    accessed_at: float = 0.0  # seed 001's name (files of earlier versions: last_accessed)
    access_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "category": self.category,
            "content": self.content,
            "source": self.source,
            "tags": list(self.tags),
            "created_at": self.created_at,
            "accessed_at": self.accessed_at,
            "access_count": self.access_count,
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> KnowledgeEntry:
        """An entry this base wrote itself (checked by CRC): no re-validation."""
        return cls(
            data["id"],
            data["category"],
            data["content"],
            data["source"],
            tuple(data["tags"]),
            data["created_at"],
            data["accessed_at"],
            data["access_count"],
        )

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
        for name in ("created_at", "accessed_at", "access_count"):
            value = data.get(name, data.get("last_accessed", 0) if name == "accessed_at" else 0)
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
            accessed_at=float(numbers["accessed_at"]),
            access_count=int(numbers["access_count"]),
        )


def entry_id(category: str, content: str) -> str:
    """The dedup key: a hash of the category and the normalized content."""
    normalized = normalize_text(content).rstrip(" .!;,")
    return hashlib.sha256(f"{category}\n{normalized}".encode()).hexdigest()[:16]


def _popularity(entry: KnowledgeEntry) -> tuple[int, float]:
    """Most accessed first, then newest first (sort with reverse=True)."""
    return (entry.access_count, entry.created_at)


def snapshot_bytes(entries: Iterable[KnowledgeEntry]) -> bytes:
    """knowledge.json's bytes for `entries` (orjson writes the dataclasses themselves)."""
    return orjson.dumps({"version": FORMAT_VERSION, "entries": list(entries)})


def merged_duplicate(existing: KnowledgeEntry, entry: KnowledgeEntry) -> KnowledgeEntry:
    """Two stored entries with one id (a hand edit made them duplicates): one entry
    with both access counts and both tags."""
    return replace(
        existing,
        access_count=existing.access_count + entry.access_count,
        tags=tuple(dict.fromkeys(existing.tags + entry.tags)),
    )


class KnowledgeFileError(ValueError):
    """A knowledge.json or its log that cannot be read as it is; the message says why."""


def read_knowledge_files(path: Path) -> dict[str, KnowledgeEntry]:
    """The entries `KnowledgeBase(path)` would load, read without changing any file (a
    base sets damaged files aside and rewrites old formats on open). Strict where the
    base salvages: a malformed entry or a torn last log line raises `KnowledgeFileError`."""
    entries: dict[str, KnowledgeEntry] = {}
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = b""
    if raw:
        try:
            data = orjson.loads(raw)
        except ValueError as exc:
            raise KnowledgeFileError(f"{path.name} is not valid JSON ({exc})") from None
        items = data.get("entries") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise KnowledgeFileError(f"{path.name}: expected an object with an 'entries' list")
        for number, item in enumerate(items, start=1):
            try:
                entry = KnowledgeEntry.from_dict(item)
            except ValueError as exc:
                raise KnowledgeFileError(f"{path.name}: entry {number}: {exc}") from None
            existing = entries.get(entry.id)
            entries[entry.id] = entry if existing is None else merged_duplicate(existing, entry)
    log = path.with_name(path.name + ".log")
    try:
        lines = log.read_bytes().split(b"\n")
    except FileNotFoundError:
        lines = [b""]
    if lines.pop():
        raise KnowledgeFileError(f"{log.name}: the last line is cut off (a crash mid-write?)")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = KnowledgeEntry.from_dict(orjson.loads(line))
        except ValueError as exc:
            raise KnowledgeFileError(f"{log.name}: line {number}: {exc}") from None
        entries[entry.id] = entry  # a logged entry replaces the stored one
    return entries


@dataclass(slots=True)
class _State:
    entries: dict[str, KnowledgeEntry] = field(default_factory=dict)
    doc_of: dict[str, int] = field(default_factory=dict)
    entry_of: dict[int, str] = field(default_factory=dict)
    index: SearchIndex = field(default_factory=SearchIndex)
    stale: set[str] = field(default_factory=set)  # entries to (re)index before a search


def searchable_text(entry: KnowledgeEntry) -> str:
    """What a knowledge search matches: the content, the tags and the source."""
    return " ".join((entry.content, *entry.tags, entry.source or ""))


def context_export(entries: Iterable[KnowledgeEntry], max_chars: int) -> str:
    """`[category] content` lines for the LLM, at most `max_chars` characters.

    Categories in priority order (user preferences, project decisions, error
    patterns, system behaviour, learned facts), most accessed first within one;
    an entry too long for the remaining budget is skipped, not cut.
    """
    buckets: dict[str, list[KnowledgeEntry]] = {c: [] for c in CATEGORIES}
    for entry in entries:
        buckets.setdefault(entry.category, []).append(entry)
    lines: list[str] = []
    used = 0
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
        self.log_path = path.with_name(path.name + ".log")
        self.index_path = path.with_name(path.name + ".index")
        self.lock_path = path.with_name(path.name + ".lock")
        self._created: set[str] = set()  # added (not reinforced) since the last flush
        self._snapshot_ident: tuple[int, int, int] | None = None
        self._state = _State()
        self._unsaved: dict[str, KnowledgeEntry] = {}  # changed since the last flush
        self._log_records = 0
        self._log_bytes = 0
        self._log_crc = 0
        self._snapshot_crc = 0
        self._index_saved = False  # the saved index covers the current files
        self._flush_requested = False  # the writer thread will flush this base
        self._load()
        self._snapshot_ident = _identity(self.path)
        _OPEN_BASES.add(self)

    # -- reading -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._state.entries)

    def __iter__(self) -> Iterator[KnowledgeEntry]:
        with self._lock:
            self._notice_outside_changes()
            return iter(list(self._state.entries.values()))

    @property
    def dirty(self) -> bool:
        """True while some change is not yet on disk."""
        return bool(self._unsaved)

    def get(self, entry_id: str) -> KnowledgeEntry | None:
        with self._lock:
            self._notice_outside_changes()
            return self._state.entries.get(entry_id)

    def by_category(self, category: str) -> list[KnowledgeEntry]:
        """Entries of `category`, most accessed first, then newest first."""
        with self._lock:
            self._notice_outside_changes()
            found = [e for e in self._state.entries.values() if e.category == category]
        found.sort(key=_popularity, reverse=True)
        return found

    def search(
        self, query: str = "", *, category: str | None = "", max_results: int = 20
    ) -> list[KnowledgeEntry]:
        """Entries matching `query` by BM25 relevance, best first; counts as an access.

        Seed 001's signature: `category` "" or None means every category. An empty
        query (no searchable words) lists the category's entries, most
        accessed first. Returned entries carry their updated access count.
        """
        with self._lock:
            self._notice_outside_changes()
            state = self._state
            if not tokenize(query):
                pool = (
                    self.by_category(category)
                    if category
                    else sorted(state.entries.values(), key=_popularity, reverse=True)
                )
                found = pool[:max_results]
            else:
                index = self._index_current()
                hits = index.search(query, max_results, tag=category or None)
                found = [state.entries[state.entry_of[h.doc_id]] for h in hits]
            return [self._touch(entry) for entry in found]

    def export_for_context(self, max_chars: int = 2000) -> str:
        """`context_export` of every entry."""
        with self._lock:
            self._notice_outside_changes()
            entries = list(self._state.entries.values())
        return context_export(entries, max_chars)

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
            # No look for another process's changes here (add stays two dict operations):
            # the next flush looks, and a forgotten entry reinforced meanwhile is dropped.
            existing = self._state.entries.get(key)
            if existing is None:
                entry = KnowledgeEntry(key, category, text, origin, new_tags, now, now, 0)
                self._created.add(key)
                logger.debug("Knowledge entry {} added ({})", key, category)
            else:
                merged = tuple(dict.fromkeys(existing.tags + new_tags))
                entry = replace(
                    existing,
                    tags=merged,
                    source=existing.source or origin,
                    accessed_at=now,
                    access_count=existing.access_count + 1,
                )
            self._put(entry, reindex=existing is None or entry.tags != existing.tags)
            self._unsaved[key] = entry
            if len(self._unsaved) >= self.flush_every and not self._flush_requested:
                self._flush_requested = True
                _FLUSHER.request(self)
            return entry

    def flush(self) -> bool:
        """Append pending changes to the log and fsync it; True if there were any.

        Past `max(1024, len(base))` log records the snapshot is rewritten instead.
        The fsync runs outside the base's lock, so adds go on meanwhile.
        """
        with self._lock:
            self._flush_requested = False
            if not self._unsaved:
                return False
            with file_lock(self.lock_path):
                self._notice_outside_changes()
                if not self._unsaved:
                    return False
                if self._log_records + len(self._unsaved) >= max(_COMPACT_AT, len(self)):
                    self._write_snapshot()
                    return True
                batch = self._append_unsaved()
        try:
            fd = os.open(self.log_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            with self._lock:  # not known to be on disk: written again by the next flush
                self._unsaved = {**batch, **self._unsaved}
            raise
        return True

    def _append_unsaved(self) -> dict[str, KnowledgeEntry]:
        """Append the pending entries to the log (no fsync); the batch written."""
        # orjson writes the dataclass itself: the same object `to_dict` gives, in C.
        data = b"".join(orjson.dumps(e) + b"\n" for e in self._unsaved.values())
        batch = self._unsaved
        self._unsaved = {}
        try:
            size = append_text(self.log_path, data.decode())
        except OSError:
            self._unsaved = {**batch, **self._unsaved}
            raise
        self._log_bytes = size
        self._log_crc = zlib.crc32(data, self._log_crc)
        self._log_records += len(batch)
        self._index_saved = False
        self._created -= batch.keys()
        return batch

    def remove_where(self, doomed: Callable[[KnowledgeEntry], bool]) -> list[KnowledgeEntry]:
        """Remove every entry `doomed` accepts, for good, now: the snapshot is rewritten
        without them, the log emptied and the saved index deleted (it holds their words;
        the next search rebuilds it). The removed entries."""
        with self._lock:
            self._notice_outside_changes()
            state = self._state
            gone = [entry for entry in state.entries.values() if doomed(entry)]
            if not gone:
                return []
            for entry in gone:
                del state.entries[entry.id]
                self._unsaved.pop(entry.id, None)
                self._created.discard(entry.id)
            self._state = _State(entries=state.entries, stale=set(state.entries))
            with file_lock(self.lock_path):
                self._write_snapshot()
                damaged = self.index_path.with_name(self.index_path.name + ".damaged")
                for path in (self.index_path, damaged):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            logger.debug("Knowledge entries removed: {}", [e.id for e in gone])
            return gone

    def close(self) -> None:
        """Flush and save the search index; the base stays usable (twice is harmless)."""
        with self._lock:
            self.flush()
            self._save_index()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Safety net: an unflushed base that is garbage-collected still saves itself.
        if getattr(self, "_unsaved", None):
            with contextlib.suppress(Exception):
                self.flush()

    # -- internals ---------------------------------------------------------------

    def _notice_outside_changes(self) -> None:
        """Reload the files when another process changed them (holding `_lock`): a
        snapshot we did not write, or a log longer than ours. Pending changes are kept,
        but not for an entry the other process removed: only entries this base created
        since its last flush (the other process never saw them) come back."""
        ident = _identity(self.path)
        try:
            log_size = os.path.getsize(self.log_path)
        except FileNotFoundError:
            log_size = 0
        if ident == self._snapshot_ident and log_size == self._log_bytes:
            return
        pending, fresh = self._unsaved, self._created
        self._state = _State()
        self._unsaved, self._created = {}, set()
        self._log_records = self._log_bytes = self._log_crc = 0
        self._index_saved = False
        self._load()
        self._snapshot_ident = _identity(self.path)
        for key, entry in pending.items():
            if key in self._state.entries or key in fresh:
                self._put(entry, reindex=True)
                self._unsaved[key] = entry
                if key in fresh:
                    self._created.add(key)
        logger.debug("Knowledge base {} reloaded: changed by another process", self.path)

    def _put(self, entry: KnowledgeEntry, *, reindex: bool) -> None:
        self._state.entries[entry.id] = entry
        if reindex:
            self._state.stale.add(entry.id)

    def _index_current(self) -> SearchIndex:
        """The index with every changed entry (re)indexed, in one batch."""
        state = self._state
        if state.stale:
            for key in state.stale:
                old_doc = state.doc_of.pop(key, None)
                if old_doc is not None:
                    state.index.remove(old_doc)
                    del state.entry_of[old_doc]
            stale = [state.entries[key] for key in state.stale]
            docs = state.index.add_many((searchable_text(e), e.category, None) for e in stale)
            for entry, doc in zip(stale, docs, strict=True):
                state.doc_of[entry.id] = doc
                state.entry_of[doc] = entry.id
            state.stale = set()
            self._index_saved = False
        return state.index

    def _touch(self, entry: KnowledgeEntry) -> KnowledgeEntry:
        touched = replace(entry, access_count=entry.access_count + 1, accessed_at=self._clock())
        self._state.entries[entry.id] = touched
        self._unsaved[entry.id] = touched  # saved with the next flush; never forces one
        return touched

    def _write_snapshot(self) -> None:
        """Rewrite knowledge.json with every entry, then empty the log."""
        data = snapshot_bytes(self._state.entries.values())
        atomic_write_bytes(self.path, data)
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.log_path, 0)
        self._snapshot_crc = zlib.crc32(data)
        self._snapshot_ident = _identity(self.path)
        self._log_records = self._log_bytes = self._log_crc = 0
        self._unsaved = {}
        self._created = set()
        self._index_saved = False
        self._save_index(build=False)

    def _save_index(self, *, build: bool = True) -> None:
        """Save the search index for the files as they are now (a cache: may fail).

        Without `build`, only an index with nothing left to (re)index is saved: a
        snapshot taken by the writer thread never tokenizes the whole base."""
        if self._index_saved or self._unsaved or (self._state.stale and not build):
            return
        index = self._index_current()
        count = index.doc_count
        entry_of = self._state.entry_of
        meta = {
            "snapshot_crc": self._snapshot_crc,
            "log_bytes": self._log_bytes,
            "log_crc": self._log_crc,
            "entry_ids": [entry_of.get(doc) for doc in range(count)],
        }
        try:
            index.save(self.index_path, meta)
        except OSError as exc:
            logger.warning("Knowledge index {} not saved: {}", self.index_path, exc)
            return
        self._index_saved = True

    def _load(self) -> None:
        saved: tuple[SearchIndex, dict[str, Any]] | None = None
        try:
            saved = SearchIndex.load(self.index_path)
        except IndexFileError as exc:
            if self.index_path.exists():
                logger.warning("Knowledge index rebuilt: {}", exc)
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        self._snapshot_crc = zlib.crc32(raw)
        trusted = saved is not None and saved[1].get("snapshot_crc") == self._snapshot_crc
        if raw:
            self._load_snapshot(raw, trusted=trusted)
        self._load_log(vouched=saved[1] if trusted and saved is not None else None)
        adopted = False
        if self._unsaved:  # validated or salvaged: a snapshot this base vouches for, now
            self._write_snapshot()
        elif saved is not None:
            adopted = self._adopt_index(*saved)
            if not adopted:
                logger.info("Knowledge index of {} is stale; rebuilding it", self.path)
        if not adopted:
            self._state.stale = set(self._state.entries)  # indexed by the first search

    def _load_snapshot(self, raw: bytes, *, trusted: bool) -> None:
        try:
            data = orjson.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            self._set_aside(f"not valid JSON ({exc})")
            return
        items = data.get("entries") if isinstance(data, dict) else data
        if not isinstance(items, list):
            self._set_aside("expected an object with an 'entries' list")
            return
        if trusted:  # byte for byte what this base wrote: its ids and shapes hold
            try:
                entries = self._state.entries
                for item in items:
                    entry = KnowledgeEntry.from_snapshot(item)
                    entries[entry.id] = entry
                return
            except (KeyError, TypeError):
                self._state.entries.clear()
        bad = self._merge_items(items)
        if bad:
            self._set_aside(f"{bad} malformed entries could not be read")
        # Validated and re-keyed (an earlier version's file, a hand edit, or no index to
        # vouch for it): written back in this version's form, so the next open is fast.
        self._unsaved.update(self._state.entries)

    def _merge_items(self, items: Iterable[Any]) -> int:
        """Add stored entries (validated); return how many were malformed."""
        bad = 0
        for item in items:
            try:
                entry = KnowledgeEntry.from_dict(item)
            except ValueError:
                bad += 1
                continue
            existing = self._state.entries.get(entry.id)
            if existing is not None:  # edited by hand into a duplicate: merge the counts
                entry = merged_duplicate(existing, entry)
            self._put(entry, reindex=True)
        return bad

    def _load_log(self, vouched: dict[str, Any] | None) -> None:
        """Replay the log; the prefix a trusted saved index covers (`vouched`, by CRC)
        was written by this base and is read without re-validation."""
        try:
            raw = self.log_path.read_bytes()
        except FileNotFoundError:
            return
        start = 0
        if vouched is not None:
            covered = vouched.get("log_bytes")
            if isinstance(covered, int) and zlib.crc32(raw[:covered]) == vouched.get("log_crc"):
                start = self._load_vouched_log(raw[:covered])
        lines = raw[start:].split(b"\n")
        torn = lines.pop() if lines else b""  # no newline yet: a crash mid-write
        if torn:
            logger.warning("Knowledge log {}: ignored a torn last line", self.log_path)
        records: list[Any] = []
        bad = 0
        for line in lines:
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except ValueError:
                bad += 1
                continue
            records.append(record)
        for record in records:
            try:
                entry = KnowledgeEntry.from_dict(record)
            except ValueError:
                bad += 1
                continue
            self._put(entry, reindex=True)  # a logged entry replaces the stored one
        self._log_records += len(records)
        self._log_bytes = len(raw) - len(torn)
        self._log_crc = zlib.crc32(raw[: self._log_bytes])
        if bad or torn:
            if bad:
                self._set_aside(f"{bad} malformed log records could not be read", self.log_path)
            self._unsaved.update(self._state.entries)  # `_load` writes a new snapshot

    def _load_vouched_log(self, data: bytes) -> int:
        """Load log records this base wrote (one JSON parse); bytes used, 0 if unusable."""
        lines = [line for line in data.split(b"\n") if line.strip()]
        try:
            records = orjson.loads(b"[" + b",".join(lines) + b"]")
            entries = [KnowledgeEntry.from_snapshot(record) for record in records]
        except (ValueError, KeyError, TypeError):
            return 0
        self._state.entries.update((entry.id, entry) for entry in entries)
        self._log_records = len(entries)
        return len(data)

    def _adopt_index(self, index: SearchIndex, meta: dict[str, Any]) -> bool:
        """Use a saved index if it covers a prefix of the log; index only the rest."""
        if (
            meta.get("snapshot_crc") != self._snapshot_crc
            or not isinstance(meta.get("log_bytes"), int)
            or meta["log_bytes"] > self._log_bytes
        ):
            return False
        covered = int(meta["log_bytes"])
        try:
            with open(self.log_path, "rb") as handle:
                head = handle.read(covered)
        except FileNotFoundError:
            head = b""
        ids = meta.get("entry_ids")
        if zlib.crc32(head) != meta.get("log_crc") or not isinstance(ids, list):
            return False
        if len(ids) != index.doc_count:
            return False
        state = self._state
        doc_of: dict[str, int] = {}
        for doc, key in enumerate(ids):
            if key is not None:
                doc_of[key] = doc
        # Only entries logged after the index was saved need indexing again; every
        # other entry must be in the index, and the index must hold no other entry.
        tail = self._log_tail_ids(covered)
        if not doc_of.keys() <= state.entries.keys() or not (
            state.entries.keys() - doc_of.keys() <= tail
        ):
            return False
        state.index = index
        state.doc_of = doc_of
        state.entry_of = {doc: key for key, doc in doc_of.items()}
        state.stale = {key for key in tail if key in state.entries}
        self._index_saved = not state.stale and covered == self._log_bytes
        return True

    def _log_tail_ids(self, start: int) -> set[str]:
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(start)
                raw = handle.read(self._log_bytes - start)
        except FileNotFoundError:
            return set()
        keys: set[str] = set()
        for line in raw.splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                keys.add(KnowledgeEntry.from_dict(orjson.loads(line)).id)
        return keys

    def _set_aside(self, problem: str, path: Path | None = None) -> None:
        path = path or self.path
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = path.with_name(f"{path.name}.corrupt-{stamp}")
        counter = 1
        while target.exists():
            target = path.with_name(f"{path.name}.corrupt-{stamp}-{counter}")
            counter += 1
        path.rename(target)
        self.load_error = f"{path} is damaged: {problem}; moved to {target.name}"
        self.corrupt_path = target
        logger.error(
            "Knowledge base {} is damaged ({}); kept it as {} and started from the "
            "entries that could be read. Fix or merge that file by hand if needed.",
            path,
            problem,
            target.name,
        )


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_OPEN_BASES: weakref.WeakSet[KnowledgeBase] = weakref.WeakSet()


class _Flusher:
    """One daemon thread that flushes bases past `flush_every` changes (group commit):
    `add` never waits for the disk, and changes arriving during an fsync share the
    next one."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[weakref.ref[KnowledgeBase]] = queue.SimpleQueue()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self, base: KnowledgeBase) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="knowledge-flush", daemon=True
                )
                self._thread.start()
        self._queue.put(weakref.ref(base))

    def _run(self) -> None:
        while True:
            base = self._queue.get()()
            if base is None:
                continue
            try:
                base.flush()
            except Exception as exc:  # the changes stay pending for the next flush
                logger.error("Could not flush knowledge base {}: {}", base.path, exc)


_FLUSHER = _Flusher()


@atexit.register
def _flush_open_bases() -> None:
    """Interpreter exit: flush every base still holding unsaved entries."""
    for base in list(_OPEN_BASES):
        try:
            base.flush()
        except Exception as exc:  # keep flushing the others
            logger.error("Could not flush knowledge base {}: {}", base.path, exc)
