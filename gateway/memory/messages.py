"""Every past message of a memory scope, searchable: the message index.

Consolidation keeps what the model chose to summarize; the message index keeps the
conversation's own words. It holds the user and assistant messages of every session
of a scope (the current one, its branches, those archived by `/new`), each with its
session, entry id, time and speaker, and answers a query with the best messages and
the message before and after each.

The sessions stay the truth; this index is a view of them kept in step lazily. Every
search first asks its `MessageSource` what the scope's sessions hold now (in files, two
stats per session key: its current file and its archive folder, whose sessions are one
group the index skips while the folder is unchanged; in PostgreSQL, one query) and reads
only what was appended since the last look: indexing costs a turn nothing when it is
written, and a search pays only for the messages new since the previous search (one
batch however many sessions grew). A session that is gone (deleted) has its messages
removed; one that shrank (rewritten by maintenance) is read again.

The file mode saves the index in the scope's folder (`messages.index`: the search
index, and a table of the messages with their session, entry id, time and speaker)
after a large catch-up, every `SAVE_EVERY` messages or a quarter more, and when the
store closes; a restarted scope's first search loads it (its checksum verified first)
and reads only what the sessions gained since (bench/memory.py: 100,000 messages, a
fraction of a second instead of reading them all). A scope never read before, or whose
file is damaged (reported, kept as `messages.index.damaged`) or made by another version
(another tokenizer, another way of indexing a message), reads all its sessions, in the
background when its caller bounds the wait. In PostgreSQL the index lives in memory.

Where a question's words are not its answer's (issue 41; LoCoMo's development half,
bench/results/recall-i41.md, hit@8 of an evidence message, BM25 alone 75.5):
- a message is also indexed under the facts consolidation drew from it (`fact_keys`,
  LongMemEval's fact-augmented keys): 78.8. Facts come after their message, so recording
  them indexes the message again (`add_fact_keys`, off the turn);
- dense similarity of the sentence model fused in (`gateway.memory.dense`): 80.5 with
  the fact keys. Each message is embedded by a background pass (`embed_pending`), never
  on the turn, and its code saved in `messages.vectors` beside the index (a restart
  embeds nothing again; a damaged file is reported and kept as `.damaged`, and search is
  BM25 until the pass has embedded them again);
- the time range a question names ranks the messages said in it higher (`during`,
  `gateway.memory.timewords`): 80.8.

Invariants:
- Forgotten messages never come back: `forget_entries` records their entry ids in the
  scope's tombstones (`MessageSource.forget`, durable), removes them from the index,
  and every later read skips them, whatever the transcript still holds (a fork's copy
  of a message keeps its entry id, so it is forgotten too). The message after a
  forgotten one is indexed again without its words, the saved file is written again
  without them, and tombstones recorded while a saved index was not rewritten (another
  process) are applied when it is loaded.
- A search answers only from a complete index: a loaded saved index is checked
  (checksum, layout, the tokenizer's and the documents' marks) and caught up with the
  sessions before it answers.
- Only `user` and `assistant` messages with text are indexed (tool calls and results,
  system lines and summaries are not a person's words).
- Results are the index's exact BM25 top-k (`gateway.memory.index`) over the live
  messages, best first, newer first on ties; with a dense index or a time range, those
  candidates re-ranked by a convex fusion with their dense similarity and the range's
  bonus (`MessageIndex._ranked`).
- A search never embeds a message: one not embedded yet scores as the mean of the
  others (`_ranked`), and the saved codes are used only with the index that names them.

Thread-safe: `MessageIndex` holds a lock around every method.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from loguru import logger

from gateway.memory.dense import DenseIndex
from gateway.memory.index import IndexFileError, SearchIndex, release_freed_memory
from gateway.memory.text import one_line

#: The roles whose messages are a person's or the assistant's words.
INDEXED_ROLES = frozenset({"user", "assistant"})
# Context shown around a hit, per neighbour, in characters.
CONTEXT_CHARS = 160
FORGOTTEN_FILE = "messages.forgotten"
#: Where the file mode saves a scope's message index (`MessageIndex(saved=...)`).
MESSAGE_INDEX_FILE = "messages.index"
# How many BM25 candidates the dense similarity re-ranks (and fills up to when the
# keywords find fewer).
FUSION_DEPTH = 50
#: What a message in the time range a query names adds to its score (in [0, 1]: BM25
#: over the best, fused with dense similarity; `MessageIndex._in_time`). On LoCoMo's
#: development half: messages hit@8 78.8 -> 78.9 with the fact keys, 80.5 -> 80.8 with
#: MiniLM too (few questions name a time: most temporal ones ask "when").
TIME_WEIGHT = 0.1
#: The dense similarity's share of a fused score when a dense index is given
#: (`MessageIndex._ranked`; bench/recall.py).
DENSE_WEIGHT = 0.2
# Unmerged messages past which a search first merges them into the index's segment: at
# least this many, and this share of the index (a merge at 100,000 messages takes about
# 0.2 s of CPU; every 256 messages, that was 1.5 ms a turn).
MERGE_AFTER = 256
MERGE_SHARE = 32


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message as a source reads it from a session."""

    session_key: str
    session_id: str
    entry_id: str
    timestamp: float
    role: str
    text: str


@dataclass(frozen=True, slots=True)
class MessageHit:
    """A message found by a search, with the messages around it in its session."""

    session_key: str
    session_id: str
    entry_id: str
    timestamp: float
    role: str
    text: str
    score: float
    before: str = ""
    after: str = ""

    @property
    def when(self) -> str:
        """The message's time as `YYYY-MM-DD HH:MM` (UTC)."""
        t = datetime.fromtimestamp(self.timestamp, UTC)  # f-string: strftime costs 3x
        return f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t.hour:02d}:{t.minute:02d}"

    def describe(self, *, context: bool = True) -> str:
        """`[time, session key, speaker, entry id] text`, and the neighbours indented."""
        head = f"[{self.when} UTC, {self.session_key}, {self.role}, entry {self.entry_id}]"
        lines = [f"{head} {self.text}"]
        if context and self.before:
            lines.insert(0, f"    before: {self.before}")
        if context and self.after:
            lines.append(f"    after: {self.after}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True, eq=False)
class SessionMark:
    """What a source knows of one session: its key, id, and how far it goes (bytes of a
    file, the last sequence number of a table); a smaller mark than before means the
    session was rewritten. Compared by identity (hashed in C): a source hands out the
    same object while a session does not change, and `MessageIndex.sync` skips those
    among thousands without a Python-level comparison each."""

    session_key: str
    session_id: str
    mark: int


#: The texts of the facts consolidation drew from messages, by the messages' entry ids
#: (`MemoryManager.fact_keys`): a message is indexed under them too.
FactKeys = Callable[[Sequence[str]], Mapping[str, Sequence[str]]]

#: What `MessageSource.sessions` returns: the sessions by handle, whole or in groups.
Sessions = Mapping[str, SessionMark] | Sequence[Mapping[str, SessionMark]]


class MessageSource(Protocol):
    """Where a scope's sessions live (files or PostgreSQL). Blocking: worker thread."""

    def sessions(self) -> Sessions:
        """The scope's sessions now, by a handle stable for the session's life: one
        mapping, or several (e.g. each key's current session, and its archived ones).
        A group handed out again as the very same object has not changed since, and
        `MessageIndex.sync` skips it: thousands of archived sessions cost nothing."""
        ...

    def read(self, handle: str, start: int) -> tuple[list[StoredMessage], int]:
        """The messages of session `handle` after mark `start`, and the new mark. (A
        source may also offer `read_many([(handle, start), ...])` -> {handle: (messages,
        mark)}, reading several in one go: the index then uses it.)"""
        ...

    def forgotten(self) -> set[str]:
        """The entry ids of the messages forgotten in this scope."""
        ...

    def forget(self, entry_ids: Iterable[str]) -> None:
        """Record forgotten messages' entry ids durably."""
        ...


def _clip(text: str, limit: int = CONTEXT_CHARS) -> str:
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def searchable_text(message: StoredMessage, previous: str, facts: Sequence[str] = ()) -> str:
    """What a message is indexed under: its text, the message before it in its session,
    the facts consolidation extracted from it (`facts`), and its date.

    The facts' words: LoCoMo's development half, an evidence message in the top 8 for
    75.5% of questions without them, 78.8% with them (multi-hop 60.6 -> 64.8, single-hop
    81.1 -> 84.9; bench/recall.py --trials facts).

    An answer often names only half of what a question asks ("Which pet?" / "Max, my
    new puppy!"): the message it answers holds the rest. Measured on LoCoMo's development
    half (bench/recall.py), an evidence message is in the top 8 for 64% of questions
    without its predecessor's words and for 74% with them; with its date too (questions
    say "in October 2023"), 76%. Only the message's own text is shown and matched when
    forgetting."""
    day = datetime.fromtimestamp(message.timestamp, UTC).strftime("%d %B %Y")
    # The own words twice: a reply that only shares its question's words ranks below it.
    parts = [message.text, message.text]
    if previous:
        parts.append(previous)
    parts.extend(facts)
    parts.append(day)
    return "\n".join(parts)


def _documents_mark() -> str:
    """What `searchable_text` makes of a probe message: a saved message index whose
    documents were made another way is rebuilt, not trusted (`_Docs.load`)."""
    probe = StoredMessage("k", "s", "e", 1_700_000_000.0, "user", "Probe: what is indexed?")
    text = searchable_text(probe, "The message before.", ["A fact drawn from it."])
    return f"{zlib.crc32(text.encode()):08x}"


#: The mark of how messages are indexed (`_documents_mark`), saved with the index.
DOCUMENTS = _documents_mark()


def message_text(raw: object) -> tuple[str, str] | None:
    """(role, text) of a stored message entry's `message` object, or None when it is not
    a user or assistant message with text."""
    if not isinstance(raw, dict):
        return None
    role = raw.get("role")
    if role not in INDEXED_ROLES:
        return None
    content = raw.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        return None
    return str(role), content


class MessageIndex:
    """The searchable messages of one scope, caught up from its source at each search.

    With `saved` (the file mode: `<scope dir>/messages.index`), the index is saved
    there after a large catch-up, every `max(SAVE_EVERY, a quarter)` messages after,
    and at `save` (the owner's close), and a restarted scope starts from it: its first
    search reads only what the sessions gained since (`_load`)."""

    def __init__(
        self,
        source: MessageSource | None = None,
        *,
        dense: DenseIndex | None = None,
        dense_weight: float = DENSE_WEIGHT,
        saved: Path | None = None,
        fact_keys: FactKeys | None = None,
    ) -> None:
        """`dense`: embedding similarity fused with BM25, its share of the fused score
        `dense_weight` (`_ranked`); its codes are saved beside `saved` in
        `messages.vectors`. `fact_keys`: the facts drawn from messages, by entry id: a
        message is indexed under their words too (`searchable_text`)."""
        self._source = source
        self._fact_keys = fact_keys
        self._lock = threading.RLock()
        self._index = SearchIndex()
        self._dense = dense
        self.dense_weight = dense_weight
        self.time_weight = TIME_WEIGHT
        # Per document id: (session handle, position in the session, StoredMessage).
        self._docs = _Docs()
        # Per session handle: its mark, and its document ids in session order.
        self._marks: dict[str, SessionMark] = {}
        self._groups: list[Mapping[str, SessionMark]] = []  # the source's at the last sync
        self._order: dict[str, list[int]] = {}
        self._forgotten: set[str] | None = None
        self._saved = saved
        # Messages indexed but not embedded yet, by document id: embedded off the turn
        # (`embed_pending`, in a background thread), as MiniLM takes 2.8-10 ms a message.
        self._pending: dict[int, str] = {}
        self._embed_lock = threading.Lock()  # one embedding pass at a time
        self._embedding: threading.Thread | None = None
        self.embed_in_background = True
        self._unsaved = 0  # messages added or removed since the index was saved
        self._opened = saved is None  # the saved index was looked for
        # Set once the first catch-up (which reads every session: seconds for a scope of
        # 100,000 messages) is done; a caller that cannot wait that long has it done in
        # a background thread meanwhile (`search(wait=...)`).
        self._caught_up = threading.Event()
        self._warming: threading.Thread | None = None
        self._start_lock = threading.Lock()
        if source is None:
            self._caught_up.set()

    def __len__(self) -> int:
        with self._lock:
            self.sync()
            return len(self._index)

    def memory_bytes(self) -> int:
        """An estimate of the memory held (the text index, the messages loaded from a
        saved index, ~150 bytes a message added since)."""
        dense = self._dense.memory_bytes() if self._dense is not None else 0
        return self._index.memory_bytes() + self._docs.memory_bytes() + dense

    # -- writing -----------------------------------------------------------------

    def add(self, handle: str, messages: Iterable[StoredMessage]) -> None:
        """Index messages of session `handle` in order (a source-less index, or a test);
        a source-less index embeds them at once (no turn waits on it)."""
        with self._lock:
            self._add([(handle, list(messages))])
        if self._source is None:
            self.embed_pending()

    def _add(self, batches: list[tuple[str, list[StoredMessage]]]) -> None:
        """Index the messages of several sessions, each in order, as one batch (the
        search index folds a large one into its segment in one merge)."""
        forgotten = self._tombstones()
        kept: list[tuple[str, StoredMessage]] = []
        previous_of: list[str] = []
        for handle, messages in batches:
            order = self._order.setdefault(handle, [])
            previous = self._last_text(order)
            for message in messages:
                if message.entry_id in forgotten:
                    continue
                kept.append((handle, message))
                previous_of.append(previous)
                previous = message.text
        facts = self._facts_of([m.entry_id for _, m in kept])
        texts = [
            searchable_text(m, previous, facts.get(m.entry_id, ()))
            for (_, m), previous in zip(kept, previous_of, strict=True)
        ]
        added = self._index.add_many(
            (text, None, m.timestamp) for text, (_, m) in zip(texts, kept, strict=True)
        )
        for doc, (handle, message) in zip(added, kept, strict=True):
            order = self._order[handle]
            self._docs[doc] = (handle, len(order), message)
            order.append(doc)
        if self._dense is not None:
            self._pending.update(zip(added, texts, strict=True))
            self._embed_soon()
        self._unsaved += len(added)

    def _facts_of(self, entry_ids: Sequence[str]) -> Mapping[str, Sequence[str]]:
        """The texts of the facts drawn from these messages (`fact_keys`), by entry id."""
        if self._fact_keys is None or not entry_ids:
            return {}
        try:
            return self._fact_keys(entry_ids)
        except Exception as exc:  # a message is still found by its own words
            logger.warning("facts of past messages not read for search: {}", exc)
            return {}

    def add_fact_keys(self, entry_ids: Iterable[str]) -> int:
        """Index these messages again under the facts now drawn from them (`fact_keys`):
        consolidation calls it after recording facts with their origins, off the turn.
        How many messages were indexed again."""
        wanted = set(entry_ids)
        if not wanted or self._fact_keys is None or not self._caught_up.is_set():
            return 0  # the first catch-up reads the facts with the messages
        with self._lock:
            docs = self._docs.with_entry_ids(wanted)
            for doc in docs:
                self._reindex(doc)
        if self._source is None:
            self.embed_pending()
        return len(docs)

    def _reindex(self, doc: int) -> None:
        """Index a live message again (its neighbour, its facts may have changed)."""
        row = self._forget_doc(doc)
        if row is None:
            return
        handle, at, message = row
        order = self._order[handle]
        facts = self._facts_of([message.entry_id]).get(message.entry_id, ())
        text = searchable_text(message, self._last_text(order[:at]), facts)
        [new] = self._index.add_many([(text, None, message.timestamp)])
        self._docs[new] = (handle, at, message)
        order[at] = new
        if self._dense is not None:
            self._pending[new] = text
            self._embed_soon()

    # -- dense vectors, off the turn ------------------------------------------------

    def _embed_soon(self) -> None:
        """Start the background pass that embeds pending messages (unless running)."""
        if not self.embed_in_background or not self._pending or self._source is None:
            return
        with self._start_lock:
            if self._embedding is None and not _EXITING.is_set():
                self._embedding = threading.Thread(
                    target=self._embed_all, name="message-embedding", daemon=True
                )
                _EMBEDDING.add(self._embedding)
                self._embedding.start()

    def _embed_all(self) -> None:
        try:
            self.embed_pending()
        except Exception as exc:  # BM25 still finds them; the next message tries again
            logger.warning("past messages not embedded for search: {}", exc)
        finally:
            with self._start_lock:
                _EMBEDDING.discard(threading.current_thread())
                self._embedding = None

    def embed_pending(self, batch: int = 8) -> int:
        """Embed every message not embedded yet (a background thread does it after each
        catch-up; a caller may too): the model runs outside the index's lock, so a
        search never waits for it. How many were embedded."""
        dense = self._dense
        if dense is None:
            return 0
        done = 0
        with self._embed_lock:
            while not _EXITING.is_set():
                with self._lock:
                    work = list(itertools.islice(self._pending.items(), batch))
                if not work:
                    return done
                codes = dense.codes_of([text for _, text in work])
                with self._lock:
                    fresh = [
                        i for i, (doc, text) in enumerate(work) if self._pending.get(doc) == text
                    ]
                    dense.add_codes([work[i][0] for i in fresh], codes[fresh])
                    for i in fresh:
                        del self._pending[work[i][0]]
                    self._unsaved += len(fresh)
                done += len(fresh)
        return done

    @property
    def pending(self) -> int:
        """Messages indexed but not embedded yet."""
        return len(self._pending)

    def _last_text(self, order: list[int]) -> str:
        """The text of a session's last message still indexed ('' if none)."""
        for doc in reversed(order):
            entry = self._docs.get(doc)
            if entry is not None:
                return entry[2].text
        return ""

    def _drop_session(self, handle: str) -> None:
        for doc in self._order.pop(handle, []):
            self._forget_doc(doc)
        self._marks.pop(handle, None)

    def sync(self) -> None:
        """Catch up with the source: new sessions and appended messages in, deleted
        sessions out, rewritten ones read again."""
        if self._source is None:
            with self._lock:
                self._merge_if_due()
            return
        with self._lock:
            self._open_saved()
            found = self._source.sessions()
            groups = [found] if isinstance(found, Mapping) else list(found)
            before = {id(group) for group in self._groups}
            fresh = [group for group in groups if id(group) not in before]
            if fresh or len(groups) != len(self._groups):
                self._catch_up(groups, fresh)
            self._groups = groups
            self._merge_if_due()
            self._caught_up.set()
            if self._saved is not None and self._unsaved >= max(SAVE_EVERY, len(self._index) // 4):
                self._save_and_map()

    def _catch_up(
        self, groups: list[Mapping[str, SessionMark]], fresh: list[Mapping[str, SessionMark]]
    ) -> None:
        """Sessions of groups gone out; those of new groups read where they grew."""
        now = {id(group) for group in groups}
        gone = [group for group in self._groups if id(group) not in now]
        if not self._groups and self._marks:
            # The first look since a saved index was loaded: its sessions are the past.
            gone = [self._marks]
        if gone:
            if len(groups) == 1:  # one mapping each time: a set difference, in C
                vanished = set().union(*gone) - groups[0].keys()
            else:
                vanished = {h for g in gone for h in g if not any(h in n for n in groups)}
            for handle in vanished:
                self._drop_session(handle)
        wanted: list[tuple[str, int]] = []
        grown: list[SessionMark] = []
        for group in fresh:
            for handle, mark in group.items():
                known = self._marks.get(handle)
                if known is mark or (known is not None and mark.mark == known.mark):
                    continue
                if known is not None and mark.mark < known.mark:
                    self._drop_session(handle)
                    known = None
                wanted.append((handle, known.mark if known is not None else 0))
                grown.append(mark)
        if not wanted:
            return
        source = self._source
        assert source is not None
        read_many = getattr(source, "read_many", None)  # a source may read all at once
        found = read_many(wanted) if read_many is not None else None
        batches: list[tuple[str, list[StoredMessage]]] = []
        for (handle, start), mark in zip(wanted, grown, strict=True):
            messages, end = found[handle] if found is not None else source.read(handle, start)
            batches.append((handle, messages))
            self._marks[handle] = SessionMark(mark.session_key, mark.session_id, end)
        self._add(batches)

    def _merge_if_due(self) -> None:
        """The messages since the last merge are scanned by every search: they are
        folded into the segment (whose search prunes) once they are this many. A merge
        costs O(index): merging at a share of it keeps that O(1) a message."""
        if self._index.unmerged >= max(MERGE_AFTER, len(self._index) // MERGE_SHARE):
            self._index.merge()

    def _warm(self) -> None:
        try:
            self.sync()
        except Exception as exc:  # the next search tries again, and reports it
            logger.warning("reading past messages for search failed: {}", exc)
        finally:
            self._warming = None
            release_freed_memory()  # a scope's first reading leaves much garbage

    def ready(self, wait: float | None = None) -> bool:
        """Has the first catch-up been done? With `wait`, it is started in a background
        thread (if it is not running) and waited for at most `wait` seconds."""
        if self._caught_up.is_set() or wait is None:
            return self._caught_up.is_set()
        with self._start_lock:
            if self._warming is None and not self._caught_up.is_set():
                self._warming = threading.Thread(
                    target=self._warm, name="message-index", daemon=True
                )
                self._warming.start()
        return self._caught_up.wait(max(0.0, wait))

    def forget_entries(self, entry_ids: Iterable[str]) -> int:
        """Forget messages by entry id: out of the index now and skipped by every later
        read. How many indexed messages went."""
        with self._lock:
            gone = self._forget_entries(entry_ids)
            if gone:
                self._save_forgetting()
            return gone

    def _forget_entries(self, entry_ids: Iterable[str]) -> int:
        wanted = set(entry_ids)
        if not wanted:
            return 0
        self._open_saved()  # so that the saved file is written again without them
        if self._source is not None:
            self._source.forget(wanted)
        self._tombstones().update(wanted)
        return self._forget_docs(self._docs.with_entry_ids(wanted))

    def _forget_docs(self, docs: list[int]) -> int:
        """Take documents out, and index again the message after each (it was indexed
        with the words of the one before it: `searchable_text`), so that no forgotten
        word is found through its neighbour. How many went."""
        rows = [row for row in map(self._forget_doc, docs) if row is not None]
        after: dict[tuple[str, int], int] = {}
        for handle, pos, _ in rows:
            order = self._order.get(handle, [])
            for at in range(pos + 1, len(order)):
                if order[at] in self._docs:
                    after[(handle, at)] = order[at]
                    break
        for _, doc in sorted(after.items()):
            self._reindex(doc)
        return len(rows)

    def forget_matching(self, text: str) -> int:
        """Forget every message that says `text` (all of its search words, e.g. a fact
        being forgotten); how many went."""
        with self._lock:
            gone = self._forget_matching(text)
            if gone:
                self._save_forgetting()
            return gone

    def _forget_matching(self, text: str) -> int:
        from gateway.memory.text import tokenize

        words = set(tokenize(text))
        if not words:
            return 0
        self.sync()
        hits = self._index.search(text, max(len(self._index), 1))
        pairs = []
        for hit in hits:
            if words <= set(tokenize(self._docs[hit.doc_id][2].text)):
                pairs.append(self._docs[hit.doc_id][2].entry_id)
        return self._forget_entries(pairs)

    def forget_facts(self, facts: Iterable[tuple[str | None, str]]) -> int:
        """Take out of search what a forgotten or corrected fact came from: for each
        (origin entry id or None, old text), the origin message and every message saying
        all of the text's words. How many messages went."""
        pairs = list(facts)
        with self._lock:
            gone = self._forget_entries(origin for origin, _ in pairs if origin)
            for _, text in pairs:
                gone += self._forget_matching(text)
            if gone:
                self._save_forgetting()
            return gone

    def _forget_doc(self, doc: int) -> Row | None:
        entry = self._docs.pop(doc, None)
        if entry is None:
            return None
        self._index.remove(doc)
        if self._dense is not None:
            self._dense.remove(doc)
            self._pending.pop(doc, None)
        self._unsaved += 1
        return entry

    def _tombstones(self) -> set[str]:
        if self._forgotten is None:
            self._forgotten = self._source.forgotten() if self._source is not None else set()
        return self._forgotten

    # -- saving and loading ----------------------------------------------------------

    def save(self) -> None:
        """Write the index to its file if it changed (no-op without one); the file holds
        no text of a forgotten message (see `_save_forgetting`)."""
        with self._lock:
            path = self._saved
            if path is None or not self._opened or not (self._unsaved or not path.exists()):
                return
            meta: dict[str, object] = {
                "format": _SAVED_FORMAT,
                "documents": DOCUMENTS,
                "tombstones": _tombstone_mark(self._tombstones()),
            }
            handles = list(self._order)
            meta["sessions"] = [[h, *_mark_row(self._marks.get(h))] for h in handles]
            if self._dense is not None:
                # The vectors first, under a token the index then names: a crash between
                # the two leaves vectors no index names (embedded again), never vectors
                # matched to another index's documents.
                token = uuid.uuid4().hex
                try:
                    self._save_vectors(path.with_name(MESSAGE_VECTORS_FILE), token)
                    meta["vectors"] = token
                except OSError as exc:
                    logger.warning("message vectors not saved ({}); embedded again", exc)
            self._index.merge()  # doc_count is final: the table covers every id
            attached = self._docs.arrays(self._index.doc_count, handles, self._order)
            try:
                self._index.save(path, meta, attached)
            except OSError as exc:
                logger.warning("message index not saved ({}); rebuilt when needed", exc)
                return
            self._unsaved = 0

    def _save_and_map(self) -> None:
        """Save, then answer from the file just written: the messages added since the
        last save leave the heap for the mapped file (a scope's first reading of 100,000
        messages holds ~170 MB of objects; mapped, the pages are the page cache's)."""
        self.save()
        path = self._saved
        if self._unsaved or path is None:
            return  # not saved: keep what is in memory
        try:
            index, meta = SearchIndex.load(path, verify=False)  # written just now
            docs, marks, order = _Docs.load(index, meta)
        except IndexFileError as exc:
            logger.warning("message index kept in memory: {}", exc)
            return
        self._index, self._docs, self._marks, self._order = index, docs, marks, order
        release_freed_memory()

    def _save_forgetting(self) -> None:
        """After forgetting: the saved index is written again at once, so its file no
        longer holds the forgotten messages' words (the session files still do: they
        are the transcript); it is deleted if it cannot be."""
        if self._saved is None:
            return
        self.save()
        if self._unsaved and self._saved.exists():
            with contextlib.suppress(OSError):
                os.unlink(self._saved)
            with contextlib.suppress(OSError):
                os.unlink(self._saved.with_name(MESSAGE_VECTORS_FILE))

    def _open_saved(self) -> None:
        if not self._opened:
            self._opened = True
            self._load()

    def _load(self) -> None:
        """Start from the saved index if it is whole and of this version: its checksum
        is verified here, before a search answers from it. A damaged file is reported
        and kept as `<name>.damaged`; a stale or foreign one is rebuilt from the
        sessions. Messages forgotten since it was saved are taken out."""
        path = self._saved
        if path is None or self._index.doc_count:
            return
        try:
            index, meta = SearchIndex.load(path)
            docs, marks, order = _Docs.load(index, meta)
        except IndexFileError as exc:
            if path.exists():
                logger.warning("message index rebuilt from the sessions: {}", exc)
                if "damaged" in str(exc):
                    with contextlib.suppress(OSError):
                        os.replace(path, path.with_name(path.name + ".damaged"))
            return
        self._index, self._docs, self._marks, self._order = index, docs, marks, order
        forgotten = self._tombstones()
        if meta.get("tombstones") != _tombstone_mark(forgotten):
            self._forget_docs(self._docs.with_entry_ids(forgotten))
        if self._dense is not None:
            self._load_vectors(path.with_name(MESSAGE_VECTORS_FILE), meta.get("vectors"))
        logger.debug("message index loaded: {} messages", len(index))

    def _save_vectors(self, path: Path, token: str) -> None:
        """Write the embedded messages' codes (`_VECTORS_MAGIC`, a JSON line, the ids,
        the codes, a CRC-32 of all before it), atomically."""
        from gateway.fsutil import atomic_write_bytes

        assert self._dense is not None
        ids, codes = self._dense.export()
        head = json.dumps({"token": token, "model": self._dense.model, "count": len(ids)})
        body = _VECTORS_MAGIC + head.encode() + b"\n"
        body += ids.astype("<i8").tobytes() + codes.astype("<u8").tobytes()
        atomic_write_bytes(path, body + zlib.crc32(body).to_bytes(4, "little"))

    def _load_vectors(self, path: Path, token: object) -> None:
        """Take the saved codes of the loaded index's messages (no message embedded
        again); the others wait for the background pass. A damaged file is reported
        and kept as `<name>.damaged` (search is BM25 alone until they are embedded
        again); one of another index or model is ignored."""
        assert self._dense is not None
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            logger.warning("message vectors not read ({}); embedded again", exc)
            data = b""
        if data:
            try:
                ids, codes, head = _parse_vectors(data, self._dense)
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("message vectors damaged ({}): kept as {}.damaged", exc, path.name)
                with contextlib.suppress(OSError):
                    os.replace(path, path.with_name(path.name + ".damaged"))
            else:
                if head.get("token") == token and head.get("model") == self._dense.model:
                    live = [i for i, doc in enumerate(ids.tolist()) if doc in self._docs]
                    self._dense.add_codes(ids[live].tolist(), codes[live])
                else:
                    logger.info("message vectors of another index or model: embedded again")
        for doc in self._docs.ids():
            if doc not in self._dense:
                self._pending[doc] = self._index.text(doc)
        self._embed_soon()

    # -- reading -----------------------------------------------------------------

    def search(
        self,
        query: str,
        max_results: int = 8,
        *,
        exclude: Iterable[str] = (),
        decay_rate: float = 0.0,
        context: bool = True,
        wait: float | None = None,
        query_vector: npt.NDArray[np.float32] | None = None,
        during: tuple[float, float] | None = None,
    ) -> list[MessageHit]:
        """The best `max_results` messages for `query`, best first; entry ids in
        `exclude` (e.g. those already in the context window) are skipped. With `wait`,
        a scope never read yet is read in the background, and [] is the answer when that
        takes longer than `wait` seconds (the next search answers from it).
        `query_vector`: the query's unit vector from the sentence model, computed once a
        turn (without it, an index with a dense part embeds the query itself).
        `during`: a time range (epoch seconds, `gateway.memory.timewords`) the query
        names: the messages in it rank higher (`TIME_WEIGHT`)."""
        if wait is not None and not self.ready(wait):
            return []
        skip = set(exclude)
        with self._lock:
            self.sync()
            want = max_results + len(skip)
            ranked = self._ranked(query, want, decay_rate, query_vector, during)
            out: list[MessageHit] = []
            for doc, score in ranked:
                handle, pos, m = self._docs[doc]
                if m.entry_id in skip:
                    continue
                before = after = ""
                if context:
                    before = self._neighbour(handle, pos - 1)
                    after = self._neighbour(handle, pos + 1)
                out.append(
                    MessageHit(
                        m.session_key,
                        m.session_id,
                        m.entry_id,
                        m.timestamp,
                        m.role,
                        m.text,
                        score,
                        before,
                        after,
                    )
                )
                if len(out) >= max_results:
                    break
            return out

    def _ranked(
        self,
        query: str,
        want: int,
        decay_rate: float,
        query_vector: npt.NDArray[np.float32] | None = None,
        during: tuple[float, float] | None = None,
    ) -> list[tuple[int, float]]:
        """(document, score) best first: BM25's, or fused with dense similarity.

        Fusion is convex over BM25's best `FUSION_DEPTH` (Bruch et al., "An Analysis of
        Fusion Functions for Hybrid Retrieval", 2023): each candidate scores `(1 - w) *
        bm25 / best bm25 + w * dense`, the dense similarity min-max scaled over the
        candidates, `w` = `dense_weight`. When the keywords find fewer candidates, the
        nearest by dense similarity fill up to that many, so a paraphrase sharing no word
        is still found. Reciprocal rank fusion was measured first and made LoCoMo's
        messages worse (75.5 -> 73.3 hit@8): it lets a dense rank far down the list
        count as much as a keyword rank, while scores keep how much better the first
        keyword match is than the tenth. A candidate not embedded yet takes the mean of
        the others' scaled similarity (neither helped nor hurt by it); with none
        embedded, BM25 alone ranks."""
        dense = self._dense
        if dense is None or self.dense_weight <= 0 or not len(dense):
            if during is None:
                return [
                    (h.doc_id, h.score)
                    for h in self._index.search(query, want, decay_rate=decay_rate, texts=False)
                ]
            dense = None
        depth = max(FUSION_DEPTH, want)
        keyword = {
            h.doc_id: h.score
            for h in self._index.search(query, depth, decay_rate=decay_rate, texts=False)
        }
        best = max(keyword.values(), default=0.0)
        if dense is None:
            ranked = [(doc, score / best) for doc, score in keyword.items()]
            return self._in_time(ranked, during)[:want]
        code = dense.code_of(query_vector) if query_vector is not None else dense.query_code(query)
        docs = list(keyword)
        if len(docs) < depth:
            near = [d for d in dense.nearest(code, depth) if d not in keyword]
            close = dense.similarities(code, near)
            docs += [d for d, sim in zip(near, close, strict=True) if sim >= dense.floor][
                : depth - len(docs)
            ]
        if not docs:
            return []
        similarity = dense.similarities(code, docs)
        coded = [sim for doc, sim in zip(docs, similarity, strict=True) if doc in dense]
        low, high = min(coded, default=0.0), max(coded, default=0.0)
        spread = high - low
        scaled = [_scaled(sim, low, spread) for sim in coded]
        neutral = sum(scaled) / len(scaled) if scaled else 0.0
        weight = self.dense_weight
        fused = [
            (
                doc,
                (1.0 - weight) * (keyword.get(doc, 0.0) / best if best > 0 else 0.0)
                + weight * (_scaled(sim, low, spread) if doc in dense else neutral),
            )
            for doc, sim in zip(docs, similarity, strict=True)
        ]
        if during is not None:
            return self._in_time(fused, during)[:want]
        fused.sort(key=lambda item: (-item[1], -item[0]))
        return [(doc, score) for doc, score in fused[:want] if doc in self._docs]

    def _in_time(
        self, scored: list[tuple[int, float]], during: tuple[float, float] | None
    ) -> list[tuple[int, float]]:
        """Candidates best first, those whose message is in `during` raised by
        `time_weight` (scores in [0, 1])."""
        out: list[tuple[int, float]] = []
        for doc, score in scored:
            row = self._docs.get(doc)
            if row is None:
                continue
            if during is not None and during[0] <= row[2].timestamp < during[1]:
                score += self.time_weight
            out.append((doc, score))
        out.sort(key=lambda item: (-item[1], -item[0]))
        return out

    def rank_sessions(
        self,
        query: str,
        max_sessions: int = 10,
        *,
        depth: int = 50,
        query_vector: npt.NDArray[np.float32] | None = None,
    ) -> list[str]:
        """Session ids by their best message for `query`, best first (the sessions of the
        top `depth` messages, in the order their first message comes). Measured on
        LoCoMo (bench/recall.py) this ranks a question's sessions better than searching
        the sessions' summaries."""
        with self._lock:
            self.sync()
            found: list[str] = []
            for doc, _ in self._ranked(query, depth, 0.0, query_vector):
                session_id = self._docs[doc][2].session_id
                if session_id not in found:
                    found.append(session_id)
                    if len(found) >= max_sessions:
                        break
            return found

    def _neighbour(self, handle: str, pos: int) -> str:
        order = self._order.get(handle, [])
        if not 0 <= pos < len(order):
            return ""
        entry = self._docs.get(order[pos])
        if entry is None:
            return ""
        return f"{entry[2].role}: {_clip(entry[2].text)}"


# -- the messages behind document ids -------------------------------------------------

# Background embedding passes running, and the flag that stops them at exit: a thread
# killed inside onnxruntime when the interpreter finalizes aborts the process ("terminate
# called without an active exception"), so exit waits for the text being embedded.
_EMBEDDING: set[threading.Thread] = set()
_EXITING = threading.Event()


@atexit.register
def _stop_embedding() -> None:
    _EXITING.set()
    for thread in list(_EMBEDDING):
        thread.join(timeout=5.0)


#: The file beside `messages.index` holding its messages' dense codes.
MESSAGE_VECTORS_FILE = "messages.vectors"
_VECTORS_MAGIC = b"gateway-message-vectors 1\n"


def _parse_vectors(
    data: bytes, dense: DenseIndex
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64], dict[str, Any]]:
    """(ids, codes, header) of a vectors file; ValueError when it does not hold together."""
    if len(data) < len(_VECTORS_MAGIC) + 4 or not data.startswith(_VECTORS_MAGIC):
        raise ValueError("not a vectors file")
    body, crc = data[:-4], int.from_bytes(data[-4:], "little")
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    end = body.index(b"\n", len(_VECTORS_MAGIC))
    head = json.loads(body[len(_VECTORS_MAGIC) : end])
    if not isinstance(head, dict):
        raise ValueError("no header")
    count = int(head["count"])
    words = dense.words
    start = end + 1
    if len(body) - start != count * 8 * (1 + words):
        raise ValueError("size does not match the count")
    ids = np.frombuffer(body, "<i8", count, start).astype(np.int64)
    codes = np.frombuffer(body, "<u8", count * words, start + 8 * count).astype(np.uint64)
    return ids, codes.reshape(count, words), head


_ROLES = ("user", "assistant")  # INDEXED_ROLES, numbered in a saved index
# The saved message index's own layout (its search index has its own checks).
_SAVED_FORMAT = 1
#: Messages added or removed after which a saved message index is written again (and
#: at least a quarter of the index: O(1) amortized per message).
SAVE_EVERY = 4096

Row = tuple[str, int, StoredMessage]


class _Docs:
    """Document id -> (session handle, position in the session, StoredMessage): the
    messages added since start in a dict, and those of a loaded saved index read from
    its mapped arrays when asked (no Python object per message until then)."""

    __slots__ = (
        "_alive",
        "_count",
        "_eid",
        "_eid_off",
        "_extra",
        "_n",
        "_pos",
        "_role",
        "_sess",
        "_sessions",
        "_ts",
        "_txt",
        "_txt_off",
    )

    def __init__(self) -> None:
        self._extra: dict[int, Row] = {}
        self._n = 0  # rows of the loaded table: document ids below it
        self._count = 0  # of those, still indexed
        self._alive = np.zeros(0, np.bool_)
        self._sessions: list[tuple[str, str, str]] = []  # (handle, key, session id)
        empty_i = np.zeros(0, np.int32)
        self._sess, self._pos = empty_i, empty_i
        self._role = np.zeros(0, np.int8)
        self._ts = np.zeros(0, np.float64)
        self._eid_off = self._txt_off = np.zeros(1, np.int64)
        self._eid = self._txt = np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return self._count + len(self._extra)

    def __contains__(self, doc: object) -> bool:
        if doc in self._extra:
            return True
        return isinstance(doc, int) and 0 <= doc < self._n and bool(self._alive[doc])

    def __getitem__(self, doc: int) -> Row:
        row = self.get(doc)
        if row is None:
            raise KeyError(doc)
        return row

    def __setitem__(self, doc: int, row: Row) -> None:
        self._extra[doc] = row

    def get(self, doc: int, default: Row | None = None) -> Row | None:
        row = self._extra.get(doc)
        if row is not None:
            return row
        if not (0 <= doc < self._n and self._alive[doc]):
            return default
        handle, key, session_id = self._sessions[int(self._sess[doc])]
        message = StoredMessage(
            key,
            session_id,
            _decode(self._eid, self._eid_off, doc),
            float(self._ts[doc]),
            _ROLES[int(self._role[doc])],
            _decode(self._txt, self._txt_off, doc),
        )
        return handle, int(self._pos[doc]), message

    def pop(self, doc: int, default: Row | None = None) -> Row | None:
        row = self._extra.pop(doc, None)
        if row is not None:
            return row
        row = self.get(doc)
        if row is None:
            return default
        self._alive[doc] = False
        self._count -= 1
        return row

    def ids(self) -> list[int]:
        """Every live document id."""
        return [*np.flatnonzero(self._alive[: self._n]).tolist(), *self._extra]

    def with_entry_ids(self, wanted: set[str]) -> list[int]:
        """The documents whose message has one of these entry ids."""
        found = [doc for doc, (_, _, m) in self._extra.items() if m.entry_id in wanted]
        if self._count and wanted:
            keys = {e.encode() for e in wanted}
            blob, off = self._eid.tobytes(), self._eid_off
            for doc in np.flatnonzero(self._alive).tolist():
                if blob[off[doc] : off[doc + 1]] in keys:
                    found.append(doc)
        return found

    def memory_bytes(self) -> int:
        arrays = (self._alive, self._sess, self._pos, self._role, self._ts)
        mapped = (self._eid_off, self._eid, self._txt_off, self._txt)
        return 150 * len(self._extra) + sum(a.nbytes for a in (*arrays, *mapped))

    def arrays(
        self, n: int, handles: list[str], order: dict[str, list[int]]
    ) -> dict[str, npt.NDArray[Any]]:
        """The table of documents 0 .. n-1 to save with the search index: per document
        its session's row in `handles`, position, role, time, entry id and text (a
        removed document: row -1, no text), and each session's documents in order."""
        row_of = {handle: i for i, handle in enumerate(handles)}
        sess = np.full(n, -1, np.int32)
        pos = np.zeros(n, np.int32)
        role = np.zeros(n, np.int8)
        ts = np.zeros(n, np.float64)
        b = self._n
        eid_sizes = np.zeros(n, np.int64)
        txt_sizes = np.zeros(n, np.int64)
        eid_parts: list[bytes | npt.NDArray[np.uint8]] = []
        txt_parts: list[bytes | npt.NDArray[np.uint8]] = []
        if b:
            alive = self._alive
            remap = np.array([row_of.get(h, -1) for h, _, _ in self._sessions] + [-1], np.int32)
            sess[:b] = np.where(alive, remap[self._sess], -1)
            pos[:b], role[:b], ts[:b] = self._pos, self._role, self._ts
            for sizes, blob, off, parts in (
                (eid_sizes, self._eid, self._eid_off, eid_parts),
                (txt_sizes, self._txt, self._txt_off, txt_parts),
            ):
                own = np.diff(off)
                parts.append(blob[np.repeat(alive, own)])  # a removed message's text goes
                sizes[:b] = np.where(alive, own, 0)
        eids: list[bytes] = []
        texts: list[bytes] = []
        for doc in range(b, n):
            row = self._extra.get(doc)
            if row is None:
                eids.append(b"")
                texts.append(b"")
                continue
            handle, at, message = row
            sess[doc], pos[doc] = row_of[handle], at
            role[doc], ts[doc] = _ROLES.index(message.role), message.timestamp
            eids.append(message.entry_id.encode())
            texts.append(message.text.encode())
        eid_sizes[b:] = [len(e) for e in eids]
        txt_sizes[b:] = [len(t) for t in texts]
        eid_parts.append(b"".join(eids))
        txt_parts.append(b"".join(texts))
        runs = [order[h] for h in handles]
        return {
            "sess": sess,
            "pos": pos,
            "role": role,
            "ts": ts,
            "eid_off": np.concatenate(([0], np.cumsum(eid_sizes))).astype(np.int64),
            "eid": _joined(eid_parts),
            "txt_off": np.concatenate(([0], np.cumsum(txt_sizes))).astype(np.int64),
            "txt": _joined(txt_parts),
            "order_off": np.concatenate(([0], np.cumsum([len(r) for r in runs]))).astype(np.int64),
            "order": np.fromiter(itertools.chain.from_iterable(runs), np.int32),
        }

    @classmethod
    def load(
        cls, index: SearchIndex, meta: dict[str, Any]
    ) -> tuple[_Docs, dict[str, SessionMark], dict[str, list[int]]]:
        """The table saved with `index` (`arrays`), its sessions' marks and orders;
        `IndexFileError` when it is of another version or does not hold together."""
        if meta.get("format") != _SAVED_FORMAT or meta.get("documents") != DOCUMENTS:
            raise IndexFileError("out of date (another layout or document text)")
        try:
            return cls._parse(index, meta)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise IndexFileError(f"damaged ({exc})") from None

    @classmethod
    def _parse(
        cls, index: SearchIndex, meta: dict[str, Any]
    ) -> tuple[_Docs, dict[str, SessionMark], dict[str, list[int]]]:
        a = index.attached
        n = index.doc_count
        rows = [(str(h), str(k), str(s), int(m)) for h, k, s, m in meta["sessions"]]
        order_off, order_docs = a["order_off"], a["order"]
        sess = a["sess"]
        checks = (
            len(sess) == len(a["pos"]) == len(a["role"]) == len(a["ts"]) == n,
            len(a["eid_off"]) == len(a["txt_off"]) == n + 1,
            int(a["eid_off"][-1]) == len(a["eid"]) and int(a["txt_off"][-1]) == len(a["txt"]),
            bool(np.all(np.diff(a["eid_off"]) >= 0) and np.all(np.diff(a["txt_off"]) >= 0)),
            len(order_off) == len(rows) + 1 and int(order_off[-1]) == len(order_docs),
            bool(np.all(np.diff(order_off) >= 0)),
            n == 0 or (int(sess.max()) < len(rows) and int(sess.min()) >= -1),
            len(order_docs) == 0 or (int(order_docs.min()) >= 0 and int(order_docs.max()) < n),
            int(a["role"].max(initial=0)) < len(_ROLES) and int(a["role"].min(initial=0)) >= 0,
            int((sess >= 0).sum()) == len(index),
        )
        if not all(checks):
            raise ValueError("inconsistent arrays")
        docs = cls()
        docs._n = n
        docs._alive = sess >= 0
        docs._count = int(docs._alive.sum())
        docs._sessions = [(h, k, s) for h, k, s, _ in rows]
        docs._sess, docs._pos, docs._role, docs._ts = sess, a["pos"], a["role"], a["ts"]
        docs._eid_off, docs._eid = a["eid_off"], a["eid"]
        docs._txt_off, docs._txt = a["txt_off"], a["txt"]
        marks = {h: SessionMark(k, s, m) for h, k, s, m in rows}
        bounds = order_off.tolist()
        order = {
            row[0]: order_docs[bounds[i] : bounds[i + 1]].tolist() for i, row in enumerate(rows)
        }
        return docs, marks, order


def _scaled(value: float, low: float, spread: float) -> float:
    return (value - low) / spread if spread > 0 else 0.0


def _decode(blob: npt.NDArray[np.uint8], off: npt.NDArray[np.int64], doc: int) -> str:
    return blob[int(off[doc]) : int(off[doc + 1])].tobytes().decode()


def _joined(parts: list[bytes | npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    return np.concatenate(
        [np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p for p in parts]
    )


def _mark_row(mark: SessionMark | None) -> list[Any]:
    if mark is None:
        return ["", "", 0]
    return [mark.session_key, mark.session_id, mark.mark]


def _tombstone_mark(forgotten: set[str]) -> list[int]:
    """What a saved index records of the tombstones it has applied."""
    return [len(forgotten), zlib.crc32("\n".join(sorted(forgotten)).encode())]


# -- the file mode's source ------------------------------------------------------------


class FileMessageSource:
    """The session files of one scope: each key's current file and its archived ones.

    A session's handle is its id, which its file's header holds and an archived file's
    name repeats: `/new` renames a session into the archive under the same id, so it is
    neither read twice nor missed, and the new file under the current name is a new
    session, read from its start. `keys()` says which session keys belong to the scope
    (one for a per-conversation scope; for the workspace or a person, every key the
    store maps there). Tombstones are one line per forgotten message's entry id in
    `<scope dir>/messages.forgotten`.
    """

    def __init__(
        self,
        sessions_dir: Path,
        scope_dir: Path,
        keys: Callable[[], Iterable[str]],
    ) -> None:
        self.sessions_dir = Path(sessions_dir)
        self.scope_dir = Path(scope_dir)
        self._keys = keys
        # Per archive folder: its mtime when listed, and its sessions then.
        self._archives: dict[str, tuple[int, dict[str, SessionMark]]] = {}
        # Per key: its current file's (device, inode), size, session id, and group.
        self._current: dict[str, tuple[tuple[int, int], int, str, dict[str, SessionMark]]] = {}
        self._paths: dict[str, str] = {}  # session id -> its file

    def sessions(self) -> list[Mapping[str, SessionMark]]:
        """Per key two groups: its current file (one stat; its header read once per
        file) and its archived files. `/new` moves a session into the key's archive
        folder and never changes it there, so the folder is listed again only when its
        mtime says an entry came or went (one stat), and the group is the same object
        meanwhile."""
        from gateway.sessions.keys import SUFFIX, encode_key
        from gateway.sessions.listing import ARCHIVE_DIR

        groups: list[Mapping[str, SessionMark]] = []
        for key in self._keys():
            name = encode_key(key)
            current = self._current_group(key, os.path.join(self.sessions_dir, f"{name}{SUFFIX}"))
            if current is not None:
                groups.append(current)
            folder = os.path.join(self.sessions_dir, ARCHIVE_DIR, name)
            try:
                stamp = os.stat(folder).st_mtime_ns
            except (FileNotFoundError, NotADirectoryError):
                self._archives.pop(folder, None)
                continue
            known = self._archives.get(folder)
            if known is None or known[0] != stamp:
                known = (stamp, self._list_archive(key, folder))
                self._archives[folder] = known
            groups.append(known[1])
        return groups

    def _current_group(self, key: str, path: str) -> dict[str, SessionMark] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._current.pop(key, None)
            return None
        file = (st.st_dev, st.st_ino)
        known = self._current.get(key)
        if known is not None and known[0] == file:
            if known[1] == st.st_size:
                return known[3]
            session_id = known[2]
        else:
            read_id = _header_id(path)
            if read_id is None:
                return None  # no whole header yet (or a damaged one the store reports)
            session_id = read_id
        group = {session_id: SessionMark(key, session_id, st.st_size)}
        self._current[key] = (file, st.st_size, session_id, group)
        self._paths[session_id] = path
        return group

    def _list_archive(self, key: str, folder: str) -> dict[str, SessionMark]:
        from gateway.sessions.keys import SUFFIX
        from gateway.sessions.listing import archived_session_id

        found: dict[str, SessionMark] = {}
        try:
            with os.scandir(folder) as it:
                for item in it:
                    if SUFFIX not in item.name:
                        continue
                    session_id = archived_session_id(item.name) or _header_id(item.path)
                    if session_id is None:
                        continue
                    try:
                        size = item.stat().st_size
                    except FileNotFoundError:
                        continue
                    self._paths[session_id] = item.path
                    found[session_id] = SessionMark(key, session_id, size)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return found

    def read(self, handle: str, start: int) -> tuple[list[StoredMessage], int]:
        path = self._paths.get(handle)
        if path is None:
            return [], start
        try:
            with open(path, "rb") as f:
                head = f.readline()
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return [], start
        try:
            header = json.loads(head)
            session_id, key = str(header["id"]), str(header["key"])
        except (ValueError, KeyError, TypeError):
            return [], start  # a damaged header: the session store reports it
        if session_id != handle:
            return [], start  # the file holds another session now: the next look finds it
        cut = data.rfind(b"\n")
        if cut < 0:
            return [], start  # only a torn line so far: read it when it is whole
        out: list[StoredMessage] = []
        for line in data[: cut + 1].splitlines():
            if b'"message"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not isinstance(entry, dict) or entry.get("type") != "message":
                continue
            found = message_text(entry.get("message"))
            ts = entry.get("timestamp")
            if found is None or not isinstance(ts, int | float):
                continue
            out.append(StoredMessage(key, session_id, str(entry.get("id")), float(ts), *found))
        return out, start + cut + 1

    def forgotten(self) -> set[str]:
        try:
            text = (self.scope_dir / FORGOTTEN_FILE).read_text(encoding="utf-8")
        except FileNotFoundError:
            return set()
        return {line.strip() for line in text.splitlines() if line.strip()}

    def forget(self, entry_ids: Iterable[str]) -> None:
        from gateway.fsutil import append_text, ensure_private_dir

        lines = "".join(f"{one_line(e)}\n" for e in sorted(entry_ids) if one_line(e))
        if lines:
            ensure_private_dir(self.scope_dir)
            append_text(self.scope_dir / FORGOTTEN_FILE, lines, fsync=True)


def _header_id(path: str) -> str | None:
    """The session id in a session file's header line, or None (none, or damaged)."""
    try:
        with open(path, "rb") as f:
            head = f.readline(1 << 16)
        header = json.loads(head)
        return str(header["id"]) if isinstance(header, dict) and "id" in header else None
    except (OSError, ValueError):
        return None
