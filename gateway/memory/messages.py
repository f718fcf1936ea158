"""Every past message of a memory scope, searchable: the message index.

Consolidation keeps what the model chose to summarize; the message index keeps the
conversation's own words. It holds the user and assistant messages of every session
of a scope (the current one, its branches, those archived by `/new`), each with its
session, entry id, time and speaker, and answers a query with the best messages and
the message before and after each.

The sessions stay the truth; this index is a view of them kept in step lazily. Every
search first asks its `MessageSource` what the scope's sessions hold now (in files, two
stats per session key: its current file and its archive folder; in PostgreSQL, one
query) and reads only what was appended since the last look: indexing costs a turn
nothing when it is written, and a search pays only for the messages new since the
previous search. A session that is gone (deleted) has its messages removed; one that
shrank (rewritten by maintenance) is read again. The index lives in memory: a scope's
first search after a start reads all its sessions (bench/memory.py times it), in the
background when its caller bounds the wait.

Invariants:
- Forgotten messages never come back: `forget_entries` records their entry ids in the
  scope's tombstones (`MessageSource.forget`, durable), removes them from the index,
  and every later read skips them, whatever the transcript still holds (a fork's copy
  of a message keeps its entry id, so it is forgotten too).
- Only `user` and `assistant` messages with text are indexed (tool calls and results,
  system lines and summaries are not a person's words).
- Results are the index's exact BM25 top-k (`gateway.memory.index`) over the live
  messages, best first, newer first on ties; with a dense index, those candidates
  re-ranked by a convex fusion with their dense similarity (`MessageIndex._ranked`).

Thread-safe: `MessageIndex` holds a lock around every method.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from loguru import logger

from gateway.memory.dense import DenseIndex
from gateway.memory.index import SearchIndex
from gateway.memory.text import one_line

#: The roles whose messages are a person's or the assistant's words.
INDEXED_ROLES = frozenset({"user", "assistant"})
# Context shown around a hit, per neighbour, in characters.
CONTEXT_CHARS = 160
FORGOTTEN_FILE = "messages.forgotten"
# How many BM25 candidates the dense similarity re-ranks (and fills up to when the
# keywords find fewer).
FUSION_DEPTH = 50
#: The dense similarity's share of a fused score when a dense index is given
#: (`MessageIndex._ranked`; bench/recall.py).
DENSE_WEIGHT = 0.2
# Unmerged messages past which a search first merges them into the index's segment.
MERGE_AFTER = 256


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
        return datetime.fromtimestamp(self.timestamp, UTC).strftime("%Y-%m-%d %H:%M")

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


class MessageSource(Protocol):
    """Where a scope's sessions live (files or PostgreSQL). Blocking: worker thread."""

    def sessions(self) -> dict[str, SessionMark]:
        """The scope's sessions now, by a handle stable for the session's life."""
        ...

    def read(self, handle: str, start: int) -> tuple[list[StoredMessage], int]:
        """The messages of session `handle` after mark `start`, and the new mark."""
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


def searchable_text(message: StoredMessage, previous: str) -> str:
    """What a message is indexed under: its text, the message before it in its session,
    and its date.

    An answer often names only half of what a question asks ("Which pet?" / "Max, my
    new puppy!"): the message it answers holds the rest. Measured on LoCoMo's development
    half (bench/recall.py), an evidence message is in the top 8 for 64% of questions
    without its predecessor's words and for 74% with them; with its date too (questions
    say "in October 2023"), 76%. Only the message's own text is shown and matched when
    forgetting."""
    day = datetime.fromtimestamp(message.timestamp, UTC).strftime("%d %B %Y")
    # The own words twice: a reply that only shares its question's words ranks below it.
    own = f"{message.text}\n{message.text}"
    return f"{own}\n{previous}\n{day}" if previous else f"{own}\n{day}"


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
    """The searchable messages of one scope, caught up from its source at each search."""

    def __init__(
        self,
        source: MessageSource | None = None,
        *,
        dense: DenseIndex | None = None,
        dense_weight: float = DENSE_WEIGHT,
    ) -> None:
        """`dense`: static-embedding similarity fused with BM25, its share of the fused
        score `dense_weight` (`_ranked`)."""
        self._source = source
        self._lock = threading.RLock()
        self._index = SearchIndex()
        self._dense = dense
        self.dense_weight = dense_weight
        # Per document id: (session handle, position in the session, StoredMessage).
        self._docs: dict[int, tuple[str, int, StoredMessage]] = {}
        # Per session handle: its mark, and its document ids in session order.
        self._marks: dict[str, SessionMark] = {}
        self._seen: dict[str, SessionMark] = {}  # the source's marks at the last sync
        self._order: dict[str, list[int]] = {}
        self._forgotten: set[str] | None = None
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
        """An estimate of the memory held (the text index plus ~150 bytes a message)."""
        dense = self._dense.memory_bytes() if self._dense is not None else 0
        return self._index.memory_bytes() + 150 * len(self._docs) + dense

    # -- writing -----------------------------------------------------------------

    def add(self, handle: str, messages: Iterable[StoredMessage]) -> None:
        """Index messages of session `handle` in order (a source-less index, or a test)."""
        with self._lock:
            self._add(handle, messages)

    def _add(self, handle: str, messages: Iterable[StoredMessage]) -> None:
        forgotten = self._tombstones()
        order = self._order.setdefault(handle, [])
        previous = self._docs[order[-1]][2].text if order else ""
        kept: list[StoredMessage] = []
        texts: list[str] = []
        for message in messages:
            if message.entry_id in forgotten:
                continue
            kept.append(message)
            texts.append(searchable_text(message, previous))
            previous = message.text
        added = self._index.add_many(
            (text, None, m.timestamp) for text, m in zip(texts, kept, strict=True)
        )
        for doc, message in zip(added, kept, strict=True):
            self._docs[doc] = (handle, len(order), message)
            order.append(doc)
        if self._dense is not None:
            self._dense.add(added, texts)

    def _drop_session(self, handle: str) -> None:
        for doc in self._order.pop(handle, []):
            self._forget_doc(doc)
        self._marks.pop(handle, None)

    def sync(self) -> None:
        """Catch up with the source: new sessions and appended messages in, deleted
        sessions out, rewritten ones read again."""
        if self._source is None:
            return
        with self._lock:
            now = self._source.sessions()
            # Set operations on the dicts (in C): with thousands of sessions, only those
            # that came, went or grew are looked at. A source hands out the same mark
            # object for a session that did not change, so most compare by identity.
            for handle in self._seen.keys() - now.keys():
                self._drop_session(handle)
            for handle, mark in now.items() - self._seen.items():
                known = self._marks.get(handle)
                if known is not None and mark.mark == known.mark:
                    continue
                if known is not None and mark.mark < known.mark:
                    self._drop_session(handle)
                    known = None
                start = known.mark if known is not None else 0
                messages, end = self._source.read(handle, start)
                self._add(handle, messages)
                self._marks[handle] = SessionMark(mark.session_key, mark.session_id, end)
            self._seen = now
            self._caught_up.set()

    def _warm(self) -> None:
        try:
            self.sync()
        except Exception as exc:  # the next search tries again, and reports it
            logger.warning("reading past messages for search failed: {}", exc)
        finally:
            self._warming = None

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
        wanted = set(entry_ids)
        if not wanted:
            return 0
        with self._lock:
            if self._source is not None:
                self._source.forget(wanted)
            self._tombstones().update(wanted)
            gone = [doc for doc, (_, _, m) in self._docs.items() if m.entry_id in wanted]
            for doc in gone:
                self._forget_doc(doc)
            return len(gone)

    def forget_matching(self, text: str) -> int:
        """Forget every message that says `text` (all of its search words, e.g. a fact
        being forgotten); how many went."""
        from gateway.memory.text import tokenize

        words = set(tokenize(text))
        if not words:
            return 0
        with self._lock:
            self.sync()
            hits = self._index.search(text, max(len(self._index), 1))
            pairs = []
            for hit in hits:
                if words <= set(tokenize(self._docs[hit.doc_id][2].text)):
                    pairs.append(self._docs[hit.doc_id][2].entry_id)
            return self.forget_entries(pairs)

    def forget_facts(self, facts: Iterable[tuple[str | None, str]]) -> int:
        """Take out of search what a forgotten or corrected fact came from: for each
        (origin entry id or None, old text), the origin message and every message saying
        all of the text's words. How many messages went."""
        pairs = list(facts)
        gone = self.forget_entries(origin for origin, _ in pairs if origin)
        for _, text in pairs:
            gone += self.forget_matching(text)
        return gone

    def _forget_doc(self, doc: int) -> None:
        entry = self._docs.pop(doc, None)
        if entry is None:
            return
        self._index.remove(doc)
        if self._dense is not None:
            self._dense.remove(doc)

    def _tombstones(self) -> set[str]:
        if self._forgotten is None:
            self._forgotten = self._source.forgotten() if self._source is not None else set()
        return self._forgotten

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
    ) -> list[MessageHit]:
        """The best `max_results` messages for `query`, best first; entry ids in
        `exclude` (e.g. those already in the context window) are skipped. With `wait`,
        a scope never read yet is read in the background, and [] is the answer when that
        takes longer than `wait` seconds (the next search answers from it)."""
        if wait is not None and not self.ready(wait):
            return []
        skip = set(exclude)
        with self._lock:
            self.sync()
            want = max_results + len(skip)
            ranked = self._ranked(query, want, decay_rate)
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

    def _ranked(self, query: str, want: int, decay_rate: float) -> list[tuple[int, float]]:
        """(document, score) best first: BM25's, or fused with dense similarity.

        Fusion is convex over BM25's best `FUSION_DEPTH` (Bruch et al., "An Analysis of
        Fusion Functions for Hybrid Retrieval", 2023): each candidate scores `(1 - w) *
        bm25 / best bm25 + w * dense`, the dense similarity min-max scaled over the
        candidates, `w` = `dense_weight`. When the keywords find fewer candidates, the
        nearest by dense similarity fill up to that many, so a paraphrase sharing no word
        is still found. Reciprocal rank fusion was measured first and made LoCoMo's
        messages worse (75.5 -> 73.3 hit@8): it lets a dense rank far down the list
        count as much as a keyword rank, while scores keep how much better the first
        keyword match is than the tenth."""
        if self._index.unmerged >= MERGE_AFTER:
            # Many messages arrived at once (a scope's first search): fold them into the
            # index's segment, whose search prunes, instead of scanning them each time.
            self._index.merge()
        if self._dense is None or self.dense_weight <= 0:
            return [
                (h.doc_id, h.score) for h in self._index.search(query, want, decay_rate=decay_rate)
            ]
        depth = max(FUSION_DEPTH, want)
        keyword = {
            h.doc_id: h.score for h in self._index.search(query, depth, decay_rate=decay_rate)
        }
        code = self._dense.query_code(query)
        docs = list(keyword)
        if len(docs) < depth:
            docs += [d for d in self._dense.nearest(code, depth) if d not in keyword][
                : depth - len(docs)
            ]
        if not docs:
            return []
        similarity = self._dense.similarities(code, docs)
        low, high = min(similarity), max(similarity)
        spread = high - low
        best = max(keyword.values(), default=0.0)
        weight = self.dense_weight
        fused = [
            (
                doc,
                (1.0 - weight) * (keyword.get(doc, 0.0) / best if best > 0 else 0.0)
                + weight * ((sim - low) / spread if spread > 0 else 0.0),
            )
            for doc, sim in zip(docs, similarity, strict=True)
        ]
        fused.sort(key=lambda item: (-item[1], -item[0]))
        return [(doc, score) for doc, score in fused[:want] if doc in self._docs]

    def rank_sessions(self, query: str, max_sessions: int = 10, *, depth: int = 50) -> list[str]:
        """Session ids by their best message for `query`, best first (the sessions of the
        top `depth` messages, in the order their first message comes). Measured on
        LoCoMo (bench/recall.py) this ranks a question's sessions better than searching
        the sessions' summaries."""
        with self._lock:
            self.sync()
            found: list[str] = []
            for doc, _ in self._ranked(query, depth, 0.0):
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


# -- the file mode's source ------------------------------------------------------------


class FileMessageSource:
    """The session files of one scope: each key's current file and its archived ones.

    `keys()` says which session keys belong to the scope (one for a per-conversation
    scope; for the workspace or a person, every key the store maps there). Tombstones
    are one line per forgotten message's entry id in `<scope dir>/messages.forgotten`.
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
        # A session's handle is its file's (device, inode): `/new` renames the file into
        # the archive, which keeps both, so an archived session is not read twice, and a
        # new file under the current name is a new session, read from its start.
        self._paths: dict[str, str] = {}

    def sessions(self) -> dict[str, SessionMark]:
        """Each key's current file (one stat) and archived files: `/new` moves a session
        into the key's archive folder and never changes it there, so the folder is
        listed again only when its mtime says an entry came or went (one stat)."""
        from gateway.sessions.keys import SUFFIX, encode_key
        from gateway.sessions.listing import ARCHIVE_DIR

        out: dict[str, SessionMark] = {}
        for key in self._keys():
            name = encode_key(key)
            current = os.path.join(self.sessions_dir, f"{name}{SUFFIX}")
            try:
                st = os.stat(current)
            except FileNotFoundError:
                pass
            else:
                handle = f"{st.st_dev}:{st.st_ino}"
                self._paths[handle] = current
                out[handle] = SessionMark(key, "", st.st_size)
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
            out.update(known[1])
        for handle in self._paths.keys() - out.keys():
            del self._paths[handle]
        return out

    def _list_archive(self, key: str, folder: str) -> dict[str, SessionMark]:
        from gateway.sessions.keys import SUFFIX

        found: dict[str, SessionMark] = {}
        try:
            with os.scandir(folder) as it:
                for item in it:
                    if SUFFIX not in item.name:
                        continue
                    try:
                        st = item.stat()
                    except FileNotFoundError:
                        continue
                    handle = f"{st.st_dev}:{st.st_ino}"
                    self._paths[handle] = item.path
                    found[handle] = SessionMark(key, "", st.st_size)
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
