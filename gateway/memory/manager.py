"""MemoryManager: the MEMORY.md / HISTORY.md / knowledge.json files of one memory scope.

Invariants:
- Appends (`append_to_memory`, `append_facts`, `append_history`) are one write in
  append mode: O(1) whatever the file's size, never a read-modify-write.
- Whole-file rewrites (`write_memory`, `compact_memory`, history rotation) go through
  temp file + fsync + rename.
- Rotation never loses a history line: the older lines go to a new, uniquely named
  `HISTORY.archive.<ts>-<n>.md` (created exclusively, never overwriting) before
  HISTORY.md is replaced by the newer lines; a crash in between can only duplicate
  lines, not drop them. Archives stay searchable.
- Searches never read the files: each index is saved next to the files it indexes
  (`MEMORY.md.index`, `HISTORY.md.index`), checked against them and caught up when a
  scope's first append or search opens it, built in the background when missing or
  stale, and every append queues its bytes for it (`gateway.memory.live`), so the
  saved index stays current whether or not the scope is searched. The past messages'
  index is saved beside them too (`messages.index`, `gateway.memory.messages`). A search answers
  from the whole scope: it waits for a build, unless its caller bounded the wait, and
  then it answers from the newest lines and says so (`Found.complete`). MEMORY.md is
  meant to be edited by people: a search notices a hand edit (by the file's size and
  mtime) and rebuilds that index.
- Forgetting or correcting a fact (`forget_fact`, `correct_fact`) rewrites MEMORY.md
  atomically and takes the text out of the knowledge entries saying the same thing, of
  `MEMORY.md.bak` and of the saved search indexes (rebuilt without it).
- A fact appended with its origin message has that message indexed again under the
  fact's words (`MessageIndex.add_fact_keys`, issue 41: LoCoMo's messages hit@8 75.5 ->
  78.8). The message index asks for facts (`fact_keys`) under its own lock, so the
  origins cache has a lock of its own (`_origins_lock`), never the manager's.
- All methods are thread-safe (one lock per manager). Changes to MEMORY.md also hold
  an `flock` on `MEMORY.md.lock`, so an operator's `gateway memory forget` in another
  process cannot lose an append of the running gateway. Keep one manager per scope per
  process (`MemoryStore` does). Hand edits of HISTORY.md or its archives while the
  history index is loaded are seen after the scope is reopened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt
from loguru import logger

from gateway.fsutil import (
    FileLock,
    append_bytes,
    atomic_write_bytes,
    atomic_write_text,
    create_exclusive,
    ensure_private_dir,
    read_text,
)
from gateway.memory.dedupe import redundant_facts
from gateway.memory.dense import sentence_dense_index
from gateway.memory.facts import (
    ID_CHARS,
    Fact,
    FactInput,
    all_facts,
    corrected,
    correction_now,
    facts_by_origin,
    knowledge_fact,
    memory_facts,
    new_facts,
    rewrite_memory,
    same_text,
    scrub_lines,
    written_fact,
)
from gateway.memory.format import (
    consolidated_heading,
    format_history_line,
    heading_day,
    history_timestamp,
    is_heading,
    memory_documents,
    parse_bullet,
    parse_fact,
)
from gateway.memory.knowledge import KnowledgeBase, KnowledgeEntry
from gateway.memory.live import Doc, FileIndex
from gateway.memory.messages import MESSAGE_INDEX_FILE, MessageHit, MessageIndex, MessageSource
from gateway.memory.protocol import Found, IndexProgress
from gateway.memory.scopes import WORKSPACE_SCOPE, scope_dir
from gateway.memory.text import one_line, tokenize

MEMORY_FILE = "MEMORY.md"
HISTORY_FILE = "HISTORY.md"
KNOWLEDGE_FILE = "knowledge.json"
MEMORY_BACKUP_FILE = "MEMORY.md.bak"
MEMORY_INDEX_FILE = "MEMORY.md.index"
MEMORY_LOCK_FILE = "MEMORY.md.lock"
HISTORY_INDEX_FILE = "HISTORY.md.index"
ARCHIVE_GLOB = "HISTORY.archive.*.md"

# How far back from the end of MEMORY.md to look for the last heading, per read.
_TAIL_CHUNK = 64 * 1024


def utc_now() -> datetime:
    return datetime.now(UTC)


class MemoryManager:
    """The memory files of one scope under `<workspace>/memory/<encoded scope>/`."""

    def __init__(
        self,
        workspace_path: Path,
        scope: str = WORKSPACE_SCOPE,
        *,
        history_max_bytes: int = 512_000,
        fsync_appends: bool = False,
        knowledge_flush_every: int = 32,
        clock: Callable[[], datetime] = utc_now,
        messages: MessageSource | None = None,
        dense: bool = False,
    ) -> None:
        """`dense`: fuse the sentence model's similarity into message search when the
        `embedding` extra is installed (`gateway.memory.dense`)."""
        if history_max_bytes < 2:
            raise ValueError("history_max_bytes must be at least 2")
        self.scope = scope
        self.dir = scope_dir(Path(workspace_path), scope)
        ensure_private_dir(self.dir.parent)
        ensure_private_dir(self.dir)
        self.memory_path = self.dir / MEMORY_FILE
        self.history_path = self.dir / HISTORY_FILE
        # As strings for the append paths (a Path costs a conversion per system call).
        self._memory_file = str(self.memory_path)
        self._history_file = str(self.history_path)
        self._history_end: tuple[int, int] | None = None  # HISTORY.md after our append
        self.history_max_bytes = history_max_bytes
        self.fsync_appends = fsync_appends
        self._clock = clock
        self._lock = threading.RLock()
        self._file_lock_depth = 0  # under `_lock`: the flock is taken by the outermost
        self._file_lock = FileLock(self.dir / MEMORY_LOCK_FILE)
        self._log = logger.bind(memory_scope=scope)
        self._memory_index = FileIndex(
            self.dir / MEMORY_INDEX_FILE, lambda: [self.memory_path], _memory_docs, self._lock
        )
        # (size, mtime_ns) of MEMORY.md after our last write: a different stat means
        # someone edited the file by hand, and the index is rebuilt.
        self._memory_seen: tuple[int, int] | None = self._memory_stat()
        # (size, mtime) at which MEMORY.md ends with a line we wrote whole: an append
        # found at that point needs no byte read back (`append_bytes`' ends_at).
        self._memory_ends: tuple[int, int] | None = None
        # MEMORY.md's fact lines by their origin message's entry id, with the file's stat
        # when read (`facts_from_messages`); appended facts keep it current.
        self._origins: tuple[tuple[int, int] | None, dict[str, list[str]]] | None = None
        # Guards `_origins` alone: the message index asks for facts under its own lock
        # (`fact_keys`), while an append holds this manager's lock and then the index's.
        self._origins_lock = threading.Lock()
        self._history_index = FileIndex(
            self.dir / HISTORY_INDEX_FILE,
            lambda: [*self.history_archives(), self.history_path],
            _history_docs,
            self._lock,
        )
        # (size, mtime_ns) of MEMORY.md when `_last_day` was known, and that day.
        self._last_day_stat: tuple[int, int] | None = None
        self._last_day: date | None = None
        self.knowledge = KnowledgeBase(
            self.dir / KNOWLEDGE_FILE,
            flush_every=knowledge_flush_every,
            clock=lambda: clock().timestamp(),
        )
        # The scope's past messages (`gateway.memory.messages`), when the store knows
        # where its sessions are.
        self.messages = (
            MessageIndex(
                messages,
                saved=self.dir / MESSAGE_INDEX_FILE,
                fact_keys=self.fact_keys,
                dense=sentence_dense_index() if dense else None,
            )
            if messages is not None
            else None
        )

    # -- MEMORY.md ---------------------------------------------------------------

    def read_memory(self) -> str:
        """The whole of MEMORY.md ('' if there is none yet)."""
        return read_text(self.memory_path)

    def write_memory(self, content: str) -> None:
        """Replace MEMORY.md atomically; the facts index is rebuilt from it when needed."""
        with self._locked():
            atomic_write_text(self.memory_path, content)
            self._memory_index.invalidate()
            self._memory_seen = self._memory_stat()
            self._memory_ends = self._memory_seen if content.endswith("\n") else None
            self._last_day_stat = None

    def append_to_memory(self, entry: str) -> None:
        """Append `entry` (one or more lines) to MEMORY.md on a line of its own. O(1)."""
        text = entry.rstrip() + "\n"
        if not text.strip():
            return
        with self._locked():
            done = append_bytes(
                self._memory_file,
                text.encode(),
                fsync=self.fsync_appends,
                ends_at=self._memory_ends,  # as we left it: no byte read back
            )
            # The file as found before the write (one look, through the descriptor):
            # not as we left it means edited by hand, and the index is rebuilt.
            if (done.before.st_size, done.before.st_mtime_ns) != self._memory_seen and (
                self._memory_seen is not None or done.before.st_size
            ):
                self._memory_index.invalidate()
            self._memory_index.appended(done.data)
            self._memory_seen = (done.after.st_size, done.after.st_mtime_ns)
            self._memory_ends = self._memory_seen
            self._last_day_stat = None

    def append_facts(self, facts: Iterable[FactInput], day: date | None = None) -> int:
        """Append `- [category] text` bullets under today's (or `day`'s) heading; a
        `NewFact` with an origin gets its fact comment (`gateway.memory.facts`).

        The `### Consolidated YYYY-MM-DD` heading is written only if the last heading
        in MEMORY.md is not already that day's. Unknown categories become
        `learned_fact`; empty texts are skipped. Returns the number of bullets written.
        """
        day = day or self._clock().astimezone(UTC).date()
        bullets = [written_fact(fact, day).line() for fact in new_facts(facts)]
        return self._append_bullets(bullets, day)

    def _append_bullets(self, bullets: list[str], day: date) -> int:
        if not bullets:
            return 0
        with self._locked():
            block = "\n".join(bullets) + "\n"
            if self._last_heading_day() != day:
                lead = "\n" if self._memory_size() > 0 else ""
                block = f"{lead}{consolidated_heading(day)}\n{block}"
            # The facts' origins, when read and current, learn the new lines too.
            added = facts_by_origin(block)
            with self._origins_lock:
                current = self._origins is not None and self._origins[0] == self._memory_stat()
                self.append_to_memory(block)
                self._remember_last_day(day)
                if current and self._origins is not None:
                    origins = self._origins[1]
                    for entry, lines in added.items():
                        origins.setdefault(entry, []).extend(lines)
                    self._origins = (self._memory_stat(), origins)
            if added and self.messages is not None:
                # Their messages are found by the facts' words too (`fact_keys`).
                self.messages.add_fact_keys(added)
        return len(bullets)

    def search_memory(
        self,
        query: str,
        max_results: int = 10,
        category: str | None = None,
        *,
        wait: float | None = None,
    ) -> Found:
        """MEMORY.md lines (stripped, headings excluded) ranked by BM25 for `query`.

        With `category`, only `- [category] ...` facts. A query without searchable
        words returns the newest lines instead. The index is waited for if it is being
        built; with `wait`, for at most that many seconds, and then the answer comes
        from the newest lines, marked incomplete.
        """
        with self._lock:
            self._notice_memory_edits()
            index = self._memory_index.current(wait=wait)
            complete = index is not None
            if index is None:
                index = self._memory_index.partial()
            tag = category.strip().lower() if category else None
            hits = index.search(query, max_results, tag=tag)
            if not hits and not _has_words(query):
                hits = index.latest(max_results, tag=tag)
            return Found((hit.text for hit in hits), complete=complete)

    def facts_from_messages(self, entry_ids: Iterable[str]) -> dict[str, list[str]]:
        """MEMORY.md's fact lines (as `search_memory` gives them) by the entry id of the
        message each came from, for these messages. MEMORY.md is read again only when
        something other than `append_facts` changed it (one stat a call)."""
        wanted = list(entry_ids)
        if not wanted:
            return {}
        with self._origins_lock:
            stat = self._memory_stat()
            if self._origins is None or self._origins[0] != stat:
                self._origins = (stat, facts_by_origin(self.read_memory()))
            found = self._origins[1]
            return {entry: list(found[entry]) for entry in wanted if entry in found}

    def fact_keys(self, entry_ids: Sequence[str]) -> dict[str, list[str]]:
        """The texts of the facts drawn from these messages, by entry id: the message
        index's `fact_keys` (a message is found by its facts' words too)."""
        return fact_texts(self.facts_from_messages, entry_ids)

    def compact_memory(self, similarity_threshold: float = 0.85) -> int:
        """Remove facts that another kept fact implies; return how many were removed.

        The rule is `gateway.memory.dedupe.redundant_facts`: same category, and equal
        up to case/punctuation/articles, or contained in a longer fact with Jaccard >=
        `similarity_threshold` and no negation among the extra words. Headings and
        non-bullet lines are never touched. When something is removed, the previous
        content is kept in `MEMORY.md.bak` (one backup, replaced by the next
        compaction) and MEMORY.md is rewritten atomically.
        """
        with self._locked():
            content = self.read_memory()
            lines = content.splitlines(keepends=True)
            positions: list[int] = []
            facts: list[tuple[str, str]] = []
            for number, line in enumerate(lines):
                if is_heading(line):
                    continue
                bullet = parse_bullet(line)
                if bullet is not None:
                    positions.append(number)
                    facts.append((bullet.category, bullet.text))
            redundant = redundant_facts(facts, similarity_threshold)
            if not redundant:
                return 0
            dropped = {positions[i] for i in redundant}
            compacted = "".join(line for n, line in enumerate(lines) if n not in dropped)
            atomic_write_text(self.dir / MEMORY_BACKUP_FILE, content)
            self.write_memory(compacted)
            self._log.info(
                "Compacted MEMORY.md: removed {} redundant facts of {}", len(dropped), len(facts)
            )
            return len(dropped)

    # -- HISTORY.md --------------------------------------------------------------

    def read_history(self) -> str:
        """The current HISTORY.md (archives not included)."""
        return read_text(self.history_path)

    def history_archives(self) -> list[Path]:
        """Archive files, oldest first."""
        return sorted(self.dir.glob(ARCHIVE_GLOB))

    def append_history(self, entry: str) -> str:
        """Append `[YYYY-MM-DD HH:MM:SS] entry` (UTC, folded to one line).

        One append-mode write: O(1). Past `history_max_bytes` HISTORY.md is rotated,
        which rewrites at most that many bytes once per half of it appended (O(1)
        amortized). Returns the line written (without newline), or '' for an empty
        entry (nothing is written).
        """
        if not entry.strip():
            return ""
        line = format_history_line(entry, self._clock())
        with self._lock:
            done = append_bytes(
                self._history_file,
                line.encode(),
                fsync=self.fsync_appends,
                ends_at=self._history_end,
            )
            self._history_end = (done.after.st_size, done.after.st_mtime_ns)
            self._history_index.appended(done.data)
            if done.after.st_size > self.history_max_bytes:
                self._rotate_history()
        return line.rstrip("\n")

    def search_history(
        self,
        query: str,
        max_results: int = 20,
        decay_rate: float = 0.001,
        *,
        now: datetime | None = None,
        wait: float | None = None,
    ) -> Found:
        """History lines (archives included) by BM25 x recency, best first.

        The score is multiplied by `1 / (1 + age_hours * decay_rate)`, the age taken
        from the line's timestamp (`decay_rate=0` ranks by relevance alone). A query
        without searchable words returns the newest lines. `wait` as for
        `search_memory`.
        """
        moment = (now or self._clock()).timestamp()
        with self._lock:
            index = self._history_index.current(wait=wait)
            complete = index is not None
            if index is None:
                index = self._history_index.partial()
            hits = index.search(query, max_results, decay_rate=decay_rate, now=moment)
            if not hits and not _has_words(query):
                hits = index.latest(max_results)
            return Found((hit.text for hit in hits), complete=complete)

    # -- past messages -----------------------------------------------------------

    def search_messages(
        self,
        query: str,
        max_results: int = 8,
        *,
        exclude: Iterable[str] = (),
        context: bool = True,
        wait: float | None = None,
        query_vector: npt.NDArray[np.float32] | None = None,
        during: tuple[float, float] | None = None,
    ) -> list[MessageHit]:
        """The scope's past user and assistant messages best matching `query`, each with
        its session, entry id, time, speaker and neighbours; entry ids in `exclude` (those
        in the context window) are skipped. [] when the scope's sessions are unknown."""
        if self.messages is None:
            return []
        return self.messages.search(
            query,
            max_results,
            exclude=exclude,
            context=context,
            wait=wait,
            query_vector=query_vector,
            during=during,
        )

    # -- consolidation -----------------------------------------------------------

    @staticmethod
    def needs_consolidation(message_count: int, memory_window: int) -> bool:
        """True when a session holds more than twice the memory window of messages."""
        return message_count > 2 * memory_window

    def record_consolidation(
        self,
        facts: Iterable[FactInput],
        summary: str,
        *,
        day: date | None = None,
        source: str = "consolidation",
    ) -> None:
        """Store one consolidation result: `(category, text)` facts to MEMORY.md (under
        the day's heading) and to the knowledge base (flushed), then the summary as one
        HISTORY.md line. Empty facts and an empty summary are skipped.

        There is no transaction across the three files: a crash in between can leave
        the facts without the summary, never half a file.
        """
        cleaned = new_facts(facts)
        with self._lock:
            written = self.append_facts(cleaned, day)
            for fact in cleaned:
                self.knowledge.add(fact.category, fact.text, source=source)
            self.knowledge.flush()
            self.append_history(summary)
        self._log.info("Recorded consolidation: {} facts, summary {}", written, bool(summary))

    # -- seeing, correcting, forgetting facts -----------------------------------

    def list_facts(self) -> list[Fact]:
        """Every fact: MEMORY.md's bullets in file order, then the knowledge entries no
        bullet says (an earlier version's `remember` stored only those)."""
        with self._lock:
            return all_facts(memory_facts(self.read_memory()), self.knowledge)

    def correct_fact(self, ident: str, text: str, *, by: str) -> Fact | None:
        """Give fact `ident` a new text (same id and origin; the correction records
        `by` and when); the knowledge entries that said the old text say the new one.
        None, and nothing changed, when there is no such fact."""
        new_text = one_line(text)
        if not new_text:
            raise ValueError("a corrected fact needs some text")
        fix = correction_now(self._clock(), by)
        with self._locked():
            rewritten, found = rewrite_memory(
                self.read_memory(), ident, lambda f: corrected(f, new_text, fix)
            )
            if found:
                self.write_memory(rewritten)
                fact = corrected(found[0], new_text, fix)
            else:
                entry = self._knowledge_only(ident)
                if entry is None:
                    return None
                found = [knowledge_fact(entry)]
                # Written as a line from now on: a knowledge entry's id is its content's.
                today = self._clock().astimezone(UTC).date()
                fact = corrected(replace(found[0], day=today), new_text, fix)
                self._append_bullets([fact.line()], today)
            old = {same_text(f.text) for f in found}
            for gone in self.knowledge.remove_where(lambda e: same_text(e.content) in old):
                source = gone.source or ""
                self.knowledge.add(gone.category, new_text, source=source, tags=gone.tags)
            self.knowledge.flush()
            self._drop_saved_indexes()
            if self.messages is not None:
                # The old words must not come back through message search either.
                self.messages.forget_facts(_said_by(found))
        self._log.info("Fact {} corrected by {}", ident, by)
        return fact

    def forget_fact(self, ident: str) -> Fact | None:
        """Remove fact `ident` for good: its MEMORY.md lines (atomic rewrite), the
        knowledge entries saying the same, its lines in `MEMORY.md.bak`, and the saved
        search indexes that held its words. None, and nothing changed, when there is
        no such fact."""
        with self._locked():
            content = self.read_memory()
            rewritten, found = rewrite_memory(content, ident, lambda _: None)
            if not found:
                entry = self._knowledge_only(ident)
                if entry is None:
                    return None
                found = [knowledge_fact(entry)]
            else:
                self.write_memory(rewritten)
            texts = {same_text(f.text) for f in found}
            self.knowledge.remove_where(lambda e: same_text(e.content) in texts)
            backup = self.dir / MEMORY_BACKUP_FILE
            old = read_text(backup)
            if old and scrub_lines(old, texts) != old:
                atomic_write_text(backup, scrub_lines(old, texts))
            self._drop_saved_indexes()
            if self.messages is not None:
                # The messages the fact came from, and every one saying it, go from
                # message search too: forgetting must not come back through them.
                self.messages.forget_facts(_said_by(found))
        self._log.info("Fact {} forgotten ({} lines)", ident, len(found))
        return found[0]

    def _knowledge_only(self, ident: str) -> KnowledgeEntry | None:
        """The knowledge entry listed as fact `ident` (one no MEMORY.md line says)."""
        said = {same_text(f.text) for f in memory_facts(self.read_memory())}
        for entry in self.knowledge:
            if entry.id[:ID_CHARS] == ident and same_text(entry.content) not in said:
                return entry
        return None

    def _drop_saved_indexes(self) -> None:
        """Delete the saved MEMORY.md index (and a kept damaged one): it holds the old
        text; it is rebuilt from the file when next searched."""
        self._memory_index.invalidate()
        for name in (MEMORY_INDEX_FILE, MEMORY_INDEX_FILE + ".damaged"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)

    # -- lifecycle ---------------------------------------------------------------

    def load_indexes(self, progress: IndexProgress | None = None) -> None:
        """Open (or build, waiting for it) both search indexes now, not on first search;
        `progress` is told how a build that has to be waited for goes."""
        with self._lock:
            self._notice_memory_edits()
            for name, index in (
                (MEMORY_FILE, self._memory_index),
                (HISTORY_FILE, self._history_index),
            ):
                told = None if progress is None else functools.partial(progress, name)
                index.current(progress=told)

    def flush(self) -> None:
        """Persist pending knowledge changes and save the search indexes that changed
        (the .md files are always on disk; the indexes can be rebuilt from them)."""
        self.knowledge.flush()
        with self._lock:
            self._memory_index.save()
            self._history_index.save()

    def close(self) -> None:
        """Flush, and save the message index (not saved by every flush: a scope of
        100,000 messages writes tens of MB; it saves itself as it grows, and a restart
        reads what it lacks from the sessions). The manager stays usable."""
        self.flush()
        self.knowledge.close()
        if self.messages is not None:
            self.messages.save()
        with self._lock:
            self._file_lock.close()

    def __enter__(self) -> MemoryManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------

    def _locked(self) -> _Locked:
        """This manager's lock and, held by the outermost caller, MEMORY.md's flock."""
        return _Locked(self)

    def _notice_memory_edits(self) -> None:
        """Drop the facts index if MEMORY.md changed behind our back (one stat)."""
        seen = self._memory_stat()
        if seen != self._memory_seen:
            self._memory_index.invalidate()
            self._memory_seen = seen

    def _rotate_history(self) -> None:
        """Move the oldest lines to a new archive so that at most half the bound stays."""
        data = self.history_path.read_bytes()
        if len(data) <= self.history_max_bytes:
            return
        lines = data.splitlines(keepends=True)
        keep_budget = self.history_max_bytes // 2
        cut, kept = len(lines), 0
        while cut > 1 and kept + len(lines[cut - 1]) <= keep_budget:
            cut -= 1
            kept += len(lines[cut])
        archive = self._create_archive(b"".join(lines[:cut]))
        atomic_write_bytes(self.history_path, b"".join(lines[cut:]))
        self._log.info("Rotated HISTORY.md: {} lines to {}", cut, archive.name)

    def _create_archive(self, data: bytes) -> Path:
        stamp = self._clock().astimezone(UTC).strftime("%Y%m%dT%H%M%S")
        counter = 0
        while True:
            path = self.dir / f"HISTORY.archive.{stamp}-{counter:04d}.md"
            try:
                create_exclusive(path, data)
                return path
            except FileExistsError:
                counter += 1

    def _memory_size(self) -> int:
        try:
            return self.memory_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _memory_stat(self) -> tuple[int, int] | None:
        try:
            st = self.memory_path.stat()
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_mtime_ns)

    def _remember_last_day(self, day: date) -> None:
        self._last_day = day
        self._last_day_stat = self._memory_stat()

    def _last_heading_day(self) -> date | None:
        """Day of MEMORY.md's last heading if it is a `### Consolidated` one, else None.

        Reads the file backwards from its end, so the cost is the distance to the last
        heading, not the file's size; cached by the file's size and mtime.
        """
        stat = self._memory_stat()
        if stat is None:
            return None
        if stat == self._last_day_stat:
            return self._last_day
        day: date | None = None
        found = False
        with self.memory_path.open("rb") as handle:
            end = stat[0]
            carry = b""
            while end > 0 and not found:
                start = max(0, end - _TAIL_CHUNK)
                handle.seek(start)
                pieces = (handle.read(end - start) + carry).split(b"\n")
                # The first piece may be a partial line unless the start was reached.
                carry, complete = (pieces[0], pieces[1:]) if start > 0 else (b"", pieces)
                for raw in reversed(complete):
                    text = raw.decode("utf-8", errors="replace")
                    if is_heading(text):  # any heading: facts after it belong to it
                        day, found = heading_day(text), True
                        break
                end = start
        self._last_day, self._last_day_stat = day, stat
        return day


class _Locked:
    """`MemoryManager._locked`: a class, not a generator, as appends take it each time."""

    __slots__ = ("_manager",)

    def __init__(self, manager: MemoryManager) -> None:
        self._manager = manager

    def __enter__(self) -> None:
        manager = self._manager
        manager._lock.acquire()
        if manager._file_lock_depth:
            manager._file_lock_depth += 1
            return
        try:
            manager._file_lock.__enter__()
        except BaseException:
            manager._lock.release()
            raise
        manager._file_lock_depth = 1

    def __exit__(self, *exc: object) -> None:
        manager = self._manager
        manager._file_lock_depth -= 1
        try:
            if not manager._file_lock_depth:
                manager._file_lock.__exit__()
        finally:
            manager._lock.release()


def fact_texts(
    lookup: Callable[[Sequence[str]], dict[str, list[str]]], entry_ids: Sequence[str]
) -> dict[str, list[str]]:
    """The texts (without `- [category]`) of the fact lines `lookup` gives by message
    (a scope's `facts_from_messages`): what a message is indexed under besides its words."""
    out: dict[str, list[str]] = {}
    for entry, lines in lookup(entry_ids).items():
        texts = [fact.text for line in lines if (fact := parse_fact(line)) is not None]
        if texts:
            out[entry] = texts
    return out


def _said_by(facts: Iterable[Fact]) -> list[tuple[str | None, str]]:
    """(origin entry id, text) of facts, for `MessageIndex.forget_facts`."""
    return [(f.origin.entry_id if f.origin is not None else None, f.text) for f in facts]


def _has_words(query: str) -> bool:
    return bool(tokenize(query))


def _memory_docs(text: str, carry: float | None) -> tuple[list[Doc], float | None]:
    """MEMORY.md text as index documents: `(line, category, no timestamp)`."""
    return [(line, category, None) for line, category in memory_documents(text)], None


def _history_docs(text: str, carry: float | None) -> tuple[list[Doc], float | None]:
    """HISTORY.md text as index documents, one per non-empty line.

    A line without a timestamp (edited by hand) dates from the line before it: it keeps
    recency ranking and pruning meaningful.
    """
    docs: list[Doc] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        stamp = history_timestamp(line)
        carry = stamp if stamp is not None else carry
        docs.append((line, None, carry))
    return docs, carry
