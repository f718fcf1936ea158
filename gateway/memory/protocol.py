"""The memory store protocols: what the agent, consolidation, the memory tools and the CLI
need of long-term memory, whichever backend keeps it.

Two implementations: workspace files (`MemoryStore` / `MemoryManager` / `KnowledgeBase`,
the embedded default) and PostgreSQL (`gateway.memory.pg_store`, for replicas). Both
keep the same promises, checked by one conformance suite
(tests/test_memory_store_conformance.py):

- a scope's memory is only ever read or written through that scope: one scope never
  sees another's facts, history or knowledge;
- facts are `- [category] text` bullets under `### Consolidated YYYY-MM-DD` headings,
  history lines are `[YYYY-MM-DD HH:MM:SS] text` (UTC), both append-only;
- knowledge entries are deduplicated by (category, normalized content);
- every fact has a short id (`gateway.memory.facts`) that a correction keeps, and where
  it came from (session key and entry) when the writer knew it; forgetting a fact
  removes its lines and every knowledge entry saying the same, and a fact id that does
  not exist (or is another scope's) changes nothing;
- searches rank by keyword relevance (the same tokenizer, `gateway.memory.text`, for
  documents and queries), optionally filtered by category and weighted by recency
  `1 / (1 + age_hours * decay_rate)`, best `max_results` first, newer first on ties;
  a query without searchable words returns the newest entries;
- a search answers from everything the scope holds: it waits for an index still being
  built, unless its caller bounds the wait (`wait=`), and then the answer it gives from
  part of the scope says so (`Found.complete` is False).

Every method blocks (files or network): call them from a worker thread on the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import date, datetime
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gateway.memory.facts import Fact, FactInput
from gateway.memory.knowledge import KnowledgeEntry
from gateway.memory.messages import MessageHit
from gateway.memory.scopes import ScopeMode

#: Told how an index build goes: (the file indexed, bytes done, bytes to do).
IndexProgress = Callable[[str, int, int], None]


class Found(list[str]):
    """Search results, best first, and whether they are the answer over everything the
    scope holds.

    `complete` is False only for a search whose caller bounded its wait while the scope's
    index was still being built: its lines then come from the newest part of the scope.
    """

    __slots__ = ("complete",)

    def __init__(self, lines: Iterable[str] = (), *, complete: bool = True) -> None:
        super().__init__(lines)
        self.complete = complete

    def __repr__(self) -> str:
        return f"Found({list(self)!r}, complete={self.complete})"


class Knowledge(Protocol):
    """Typed knowledge entries of one scope."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KnowledgeEntry]: ...

    def get(self, entry_id: str) -> KnowledgeEntry | None: ...

    def by_category(self, category: str) -> list[KnowledgeEntry]:
        """Entries of `category`, most accessed first, then newest first."""
        ...

    def search(
        self, query: str = "", *, category: str | None = "", max_results: int = 20
    ) -> list[KnowledgeEntry]:
        """Entries by relevance to `query` (counts as an access); an empty query lists
        the most accessed."""
        ...

    def export_for_context(self, max_chars: int = 2000) -> str:
        """`[category] content` lines by category priority, at most `max_chars`."""
        ...

    def add(
        self,
        category: str,
        content: str,
        *,
        source: str = "",
        tags: Iterable[str] | None = None,
    ) -> KnowledgeEntry:
        """Add an entry, or reinforce the one with the same normalized content."""
        ...

    def flush(self) -> bool:
        """Make every change durable now; True if there was something to write."""
        ...


class MemoryScope(Protocol):
    """The memory of one scope: facts (MEMORY.md), history lines, knowledge."""

    @property
    def scope(self) -> str: ...

    @property
    def knowledge(self) -> Knowledge: ...

    def read_memory(self) -> str:
        """The facts as MEMORY.md text ('' when there are none)."""
        ...

    def append_facts(self, facts: Iterable[FactInput], day: date | None = None) -> int:
        """`(category, text)` or `NewFact` bullets under the day's heading; how many
        were written."""
        ...

    def search_memory(
        self,
        query: str,
        max_results: int = 10,
        category: str | None = None,
        *,
        wait: float | None = None,
    ) -> Found:
        """Fact lines (`- [category] text`, free text as written) best first. `wait`:
        seconds to wait for an index being built before answering from part of the
        scope (None: as long as the build takes)."""
        ...

    def append_history(self, entry: str) -> str:
        """Append one timestamped history line; the line ('' for an empty entry)."""
        ...

    def search_history(
        self,
        query: str,
        max_results: int = 20,
        decay_rate: float = 0.001,
        *,
        now: datetime | None = None,
        wait: float | None = None,
    ) -> Found:
        """History lines by relevance x recency, best first (`wait` as for facts)."""
        ...

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
        """Past user and assistant messages of every session of the scope, best first,
        each with session, entry id, time, speaker and (with `context`) neighbours; entry
        ids in `exclude` are skipped. Forgotten messages are never returned. `wait`:
        seconds to wait for a scope's first reading of its sessions, then [] (None: as
        long as it takes). `query_vector`: the query's unit vector from the sentence
        model (computed once a turn), for the dense part of the ranking; `during`: a time
        range (epoch seconds) the query names, whose messages rank higher."""
        ...

    def facts_from_messages(self, entry_ids: Iterable[str]) -> dict[str, list[str]]:
        """The fact lines (as `search_memory` gives them) that came from each of these
        past messages, by the message's entry id: the origin consolidation recorded for
        each fact. A message that gave no fact is left out."""
        ...

    def load_indexes(self, progress: IndexProgress | None = None) -> None:
        """Have the scope's search indexes ready now, waiting for any build (told to
        `progress` as it goes), so that searches answer at once and complete."""
        ...

    def list_facts(self) -> list[Fact]:
        """Every fact with its id and origin: MEMORY.md's in order, then knowledge
        entries no fact line says."""
        ...

    def correct_fact(self, ident: str, text: str, *, by: str) -> Fact | None:
        """The fact with a new text, same id, marked corrected by `by`; None (nothing
        changed) when the scope has no fact `ident`. ValueError for an empty text."""
        ...

    def forget_fact(self, ident: str) -> Fact | None:
        """Remove fact `ident` and the knowledge saying the same; the fact forgotten,
        or None (nothing changed) when the scope has no such fact."""
        ...

    def record_consolidation(
        self,
        facts: Iterable[FactInput],
        summary: str,
        *,
        day: date | None = None,
        source: str = "consolidation",
    ) -> None:
        """One consolidation's facts (to the facts and the knowledge) and summary."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class MemoryBackend(Protocol):
    """Where every scope's memory lives; hands out one `MemoryScope` per scope."""

    @property
    def mode(self) -> ScopeMode: ...

    def scope_for(self, session_key: str) -> str: ...

    def exists(self, session_key: str) -> bool:
        """Has the key's scope any memory yet? Creates nothing."""
        ...

    def for_session(self, session_key: str) -> MemoryScope: ...

    def for_scope(self, scope: str) -> MemoryScope: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class ConsolidationLease(Protocol):
    """A session's consolidation held by this process (`ConsolidationGuard.acquire`)."""

    def consolidated(self) -> tuple[str, str] | None:
        """`(session_id, first_kept_entry_id)` of the session's last recorded
        consolidation, or None."""
        ...

    def record(
        self, session_id: str, first_kept_entry_id: str, *, summarized: int, facts: int
    ) -> None:
        """Store how far the session is consolidated now."""
        ...

    def release(self) -> None: ...


class ConsolidationGuard(Protocol):
    """Consolidation state shared by replicas: who runs a session's consolidation now,
    and how far it went (`gateway.memory.pg_store.PostgresConsolidationGuard`, opened by the
    storage seam). Blocking:
    called in worker threads. Without one (the file mode: one process owns the
    workspace) the consolidator's per-session lock is enough."""

    def acquire(self, session_key: str) -> ConsolidationLease | None:
        """The session's lease, or None while another replica holds it."""
        ...
