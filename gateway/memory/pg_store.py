"""Long-term memory in PostgreSQL: the same scopes, facts, history and knowledge as the
workspace files, as rows shared by every gateway replica (`gateway.memory.protocol`).

Rows per scope (migration 0003): ``gw_memory_facts`` (a MEMORY.md line each, with the day
of its ``### Consolidated`` heading), ``gw_memory_history`` (a HISTORY.md line each, with
its timestamp) and ``gw_memory_knowledge`` (a knowledge entry each, keyed by its content
hash). A scope is stored under its file-mode folder name (`scope_dirname`: reversible,
collision-free, any bytes), so both modes agree on which names are the same scope.

Search is PostgreSQL full-text search: each row has a ``tsvector`` of its text as
`gateway.memory.text.tokenize` sees it (stemming, stopwords, negations kept), parsed with
the ``'simple'`` configuration, and a GIN index. A query is the OR of its tokens; rows
are ranked by ``ts_rank`` (normalized by document length) times the recency weight
``1 / (1 + age_hours * decay_rate)`` computed in SQL, best first, newer first on ties.
Feeding our tokenizer rather than a language configuration keeps the two modes matching
the same documents for the same query, in every language. Unlike the file mode's BM25,
``ts_rank`` has no inverse document frequency: a rare query word weighs no more than a
common one (the conformance suite asserts only what both rankings promise).

Text PostgreSQL cannot hold: a NUL character (``\\x00``) becomes U+FFFD, and so does a
lone surrogate; everything else is stored as given. A huge entry is stored whole; its
first `MAX_INDEXED_CHARS` characters of tokens are searchable (a tsvector is at most
1 MB).

Search is complete by construction: every query reads the GIN index over all the
scope's rows, which PostgreSQL keeps current in the transaction of each append (its
pending list included), so there is no build to wait for and no partial answer: a
`wait=` is accepted for the protocol and every `Found` is complete.

Promises: every statement names its scope (one scope never sees another's rows); a write
made inside a turn is behind that turn's fence (`gateway.plumbing.fence`: refused once
another replica holds the session, at the cost of one round trip per write); an
append returns once PostgreSQL committed it; `record_consolidation` stores a
consolidation's facts, knowledge and summary in one transaction (all or nothing, which
the files cannot promise). Calls block on the network: run them in worker threads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

from gateway.memory.dense import sentence_dense_index
from gateway.memory.facts import (
    ID_CHARS,
    Fact,
    FactInput,
    NewFact,
    all_facts,
    corrected,
    correction_now,
    knowledge_fact,
    new_facts,
    origin_marker,
    parse_fact_line,
    same_text,
    written_fact,
)
from gateway.memory.format import (
    format_history_line,
    history_timestamp,
    is_heading,
    normalize_category,
    render_memory,
    without_fact_comment,
)
from gateway.memory.knowledge import (
    KnowledgeEntry,
    context_export,
    entry_id,
    searchable_text,
)
from gateway.memory.manager import fact_texts, utc_now
from gateway.memory.messages import (
    MessageHit,
    MessageIndex,
    SessionMark,
    StoredMessage,
    message_text,
)
from gateway.memory.protocol import Found, IndexProgress
from gateway.memory.scopes import ScopeMode, scope_dirname, scope_for_session
from gateway.memory.text import one_line, tokenize
from gateway.people.protocol import PeopleStore, person_scope
from gateway.plumbing import fence

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import psycopg
    from psycopg_pool import ConnectionPool

#: Characters of a document's token text that go into its tsvector.
MAX_INDEXED_CHARS = 200_000

_RANK = "ts_rank(tsv, q, 1)"  # 1: divided by 1 + log(document length), as BM25 does


def pg_text(text: str) -> str:
    """`text` as PostgreSQL can store it: NUL and lone surrogates become U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


def search_terms(text: str) -> str:
    """The document text as the full-text index sees it: our tokens, space-separated."""
    terms = " ".join(tokenize(text))
    if len(terms) > MAX_INDEXED_CHARS:
        terms = terms[: terms.rfind(" ", 0, MAX_INDEXED_CHARS)]
    return terms


def search_query(query: str) -> str | None:
    """A `to_tsquery` text matching any token of `query`; None when it has none."""
    tokens = dict.fromkeys(tokenize(query))
    if not tokens:
        return None
    return " | ".join("'" + t.replace("\\", "\\\\").replace("'", "''") + "'" for t in tokens)


def _like_escaped(text: str) -> str:
    """`text` as a literal inside a LIKE pattern (backslash is LIKE's default escape)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def knowledge_entry(row: Sequence[Any]) -> KnowledgeEntry:
    ident, category, content, source, tags, created, accessed, count = row
    return KnowledgeEntry(
        str(ident),
        str(category),
        str(content),
        source,
        tuple(tags),
        float(created),
        float(accessed),
        int(count),
    )


ENTRY_COLUMNS = "id, category, content, source, tags, created_at, accessed_at, access_count"


def _top(
    conn: psycopg.Connection[Any],
    table: str,
    column: str,
    scope: str,
    query: str,
    limit: int,
    *,
    category: str | None = None,
    weight: tuple[str, Sequence[Any]] = ("1.0", ()),
    ties: str = "id DESC",
    latest: str = "id DESC",
) -> list[str]:
    """`column` of the best `limit` rows of `table` in `scope` for `query`: ranked by
    `_RANK` times the SQL `weight` (with its parameters), then `ties`; a query without
    words lists by `latest`. `category` filters on the row's category."""
    where = "AND category = %s" if category else ""
    filters: list[Any] = [category] if category else []
    tsquery = search_query(query)
    if tsquery is None:
        rows = conn.execute(
            f"SELECT {column} FROM {table} WHERE scope = %s {where} ORDER BY {latest} LIMIT %s",
            (scope, *filters, limit),
        ).fetchall()
    else:
        factor, factor_params = weight
        rows = conn.execute(
            f"SELECT {column} FROM {table}, to_tsquery('simple', %s) q "
            f"WHERE scope = %s AND tsv @@ q {where} "
            f"ORDER BY {_RANK} * {factor} DESC, {ties} LIMIT %s",
            (tsquery, scope, *filters, *factor_params, limit),
        ).fetchall()
    return [str(r[0]) for r in rows]


class _Scoped:
    """A scope's name as stored, the pool and the clock."""

    def __init__(
        self, pool: ConnectionPool, scope: str, clock: Callable[[], datetime] = utc_now
    ) -> None:
        self._pool = pool
        self._key = scope_dirname(scope)  # raises ValueError for unusable names
        self._clock = clock

    @contextmanager
    def _writing(self) -> Iterator[psycopg.Connection[Any]]:
        """A transaction for a write, behind the current turn's fence: refused
        (`FencedOut`, nothing written) once another replica holds the session."""
        with self._pool.connection() as conn, fence.refusals(), conn.transaction():
            fence.check(conn)
            yield conn

    def _ensure_scope(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(
            "INSERT INTO gw_memory_scopes (scope, created_at) VALUES (%s, %s) "
            "ON CONFLICT (scope) DO NOTHING",
            (self._key, time.time()),
        )


class PostgresKnowledge(_Scoped):
    """The knowledge entries of one scope (`gateway.memory.protocol.Knowledge`)."""

    def __len__(self) -> int:
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT count(*) FROM gw_memory_knowledge WHERE scope = %s", (self._key,)
            ).fetchone()
        return int(row[0]) if row else 0

    def __iter__(self) -> Iterator[KnowledgeEntry]:
        return iter(self._select("", (), "ORDER BY created_at, id"))

    def _select(self, where: str, params: Sequence[Any], tail: str = "") -> list[KnowledgeEntry]:
        with self._pool.connection() as conn:
            rows = conn.execute(
                f"SELECT {ENTRY_COLUMNS} FROM gw_memory_knowledge WHERE scope = %s {where} {tail}",
                (self._key, *params),
            ).fetchall()
        return [knowledge_entry(r) for r in rows]

    def get(self, entry_id: str) -> KnowledgeEntry | None:
        found = self._select("AND id = %s", (entry_id,))
        return found[0] if found else None

    def by_category(self, category: str) -> list[KnowledgeEntry]:
        return self._select(
            "AND category = %s", (category,), "ORDER BY access_count DESC, created_at DESC"
        )

    def search(
        self, query: str = "", *, category: str | None = "", max_results: int = 20
    ) -> list[KnowledgeEntry]:
        if max_results <= 0:
            return []
        with self._pool.connection() as conn, conn.transaction():
            ids = _top(
                conn,
                "gw_memory_knowledge",
                "id",
                self._key,
                query,
                max_results,
                category=category or None,
                ties="created_at DESC, id",
                latest="access_count DESC, created_at DESC",
            )
            if not ids:
                return []
            # A search counts as an access, as in the file mode.
            touched = conn.execute(
                "UPDATE gw_memory_knowledge SET access_count = access_count + 1, "
                f"accessed_at = %s WHERE scope = %s AND id = ANY(%s) RETURNING {ENTRY_COLUMNS}",
                (self._clock().timestamp(), self._key, ids),
            ).fetchall()
        by_id = {e.id: e for e in map(knowledge_entry, touched)}
        return [by_id[i] for i in ids if i in by_id]

    def export_for_context(self, max_chars: int = 2000) -> str:
        # Only entries that fit the budget at all can be exported.
        return context_export(
            self._select("AND length(content) + length(category) + 3 <= %s", (max_chars,)),
            max_chars,
        )

    def add(
        self,
        category: str,
        content: str,
        *,
        source: str = "",
        tags: Iterable[str] | None = None,
    ) -> KnowledgeEntry:
        """Add or reinforce an entry; committed when this returns."""
        with self._writing() as conn:
            return self.add_in(conn, category, content, source=source, tags=tags)

    def add_in(
        self,
        conn: psycopg.Connection[Any],
        category: str,
        content: str,
        *,
        source: str = "",
        tags: Iterable[str] | None = None,
    ) -> KnowledgeEntry:
        """`add` inside the caller's transaction."""
        text = pg_text(one_line(content))
        if not text:
            raise ValueError("a knowledge entry needs some content")
        category = normalize_category(category)
        new_tags = tuple(dict.fromkeys(pg_text(t.strip()) for t in tags or () if t.strip()))
        origin = pg_text(source) or None
        key = entry_id(category, text)
        now = self._clock().timestamp()
        self._ensure_scope(conn)
        fresh = KnowledgeEntry(key, category, text, origin, new_tags, now, now, 0)
        inserted = conn.execute(
            f"INSERT INTO gw_memory_knowledge ({ENTRY_COLUMNS}, scope, tsv) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, to_tsvector('simple', %s)) "
            f"ON CONFLICT (scope, id) DO NOTHING RETURNING {ENTRY_COLUMNS}",
            (*entry_values(fresh), self._key, search_terms(searchable_text(fresh))),
        ).fetchone()
        if inserted is not None:
            return knowledge_entry(inserted)
        row = conn.execute(
            f"SELECT {ENTRY_COLUMNS} FROM gw_memory_knowledge "
            "WHERE scope = %s AND id = %s FOR UPDATE",
            (self._key, key),
        ).fetchone()
        if row is None:  # forgotten meanwhile (`remove_in`): add it afresh
            return self.add_in(conn, category, content, source=source, tags=tags)
        existing = knowledge_entry(row)
        merged = KnowledgeEntry(
            key,
            existing.category,
            existing.content,
            existing.source or origin,
            tuple(dict.fromkeys(existing.tags + new_tags)),
            existing.created_at,
            now,
            existing.access_count + 1,
        )
        conn.execute(
            "UPDATE gw_memory_knowledge SET source = %s, tags = %s, accessed_at = %s, "
            "access_count = %s, tsv = to_tsvector('simple', %s) WHERE scope = %s AND id = %s",
            (
                merged.source,
                list(merged.tags),
                now,
                merged.access_count,
                search_terms(searchable_text(merged)),
                self._key,
                key,
            ),
        )
        return merged

    def remove_in(self, conn: psycopg.Connection[Any], texts: set[str]) -> list[KnowledgeEntry]:
        """Delete the entries whose content says one of `texts` (`same_text`), inside
        the caller's transaction; the entries deleted."""
        rows = conn.execute(
            f"SELECT {ENTRY_COLUMNS} FROM gw_memory_knowledge WHERE scope = %s FOR UPDATE",
            (self._key,),
        ).fetchall()
        gone = [e for e in map(knowledge_entry, rows) if same_text(e.content) in texts]
        if gone:
            conn.execute(
                "DELETE FROM gw_memory_knowledge WHERE scope = %s AND id = ANY(%s)",
                (self._key, [e.id for e in gone]),
            )
        return gone

    def flush(self) -> bool:
        """Every change was committed already."""
        return False


def entry_values(entry: KnowledgeEntry) -> tuple[Any, ...]:
    return (
        entry.id,
        entry.category,
        entry.content,
        entry.source,
        list(entry.tags),
        entry.created_at,
        entry.accessed_at,
        entry.access_count,
    )


class PostgresMemoryScope(_Scoped):
    """The memory of one scope in PostgreSQL (`gateway.memory.protocol.MemoryScope`)."""

    def __init__(
        self,
        pool: ConnectionPool,
        scope: str,
        clock: Callable[[], datetime] = utc_now,
        messages: MessageIndex | None = None,
    ) -> None:
        super().__init__(pool, scope, clock)
        self._scope = scope
        self._knowledge = PostgresKnowledge(pool, scope, clock)
        self.messages = messages

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
        """As the file mode's: this replica's index of the scope's messages, caught up
        from the session tables at each search."""
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

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def knowledge(self) -> PostgresKnowledge:
        return self._knowledge

    # -- facts -----------------------------------------------------------------------

    def read_memory(self) -> str:
        """The facts rendered as MEMORY.md: a heading wherever the day changes."""
        with self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT day, line FROM gw_memory_facts WHERE scope = %s ORDER BY id",
                (self._key,),
            ).fetchall()
        return render_memory((day, str(line)) for day, line in rows)

    def append_facts(self, facts: Iterable[FactInput], day: date | None = None) -> int:
        cleaned = new_facts(facts)
        with self._writing() as conn:
            written = self._append_facts(conn, cleaned, day)
        self._index_fact_keys(cleaned)
        return written

    def _index_fact_keys(self, facts: Iterable[FactInput]) -> None:
        """This replica's message index learns the facts' words for their messages (other
        replicas read them when they next index those messages)."""
        origins = [f.origin.entry_id for f in facts if isinstance(f, NewFact) and f.origin]
        if origins and self.messages is not None:
            self.messages.add_fact_keys(origins)

    def _append_facts(
        self, conn: psycopg.Connection[Any], facts: Iterable[FactInput], day: date | None
    ) -> int:
        day = day or self._clock().astimezone(UTC).date()
        rows = [
            (fact.category, pg_text(written_fact(fact, day).line())) for fact in new_facts(facts)
        ]
        return self._insert_lines(conn, rows, day)

    def _insert_lines(
        self, conn: psycopg.Connection[Any], rows: list[tuple[str, str]], day: date
    ) -> int:
        if not rows:
            return 0
        now = time.time()
        self._ensure_scope(conn)
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO gw_memory_facts (scope, day, category, line, created_at, tsv) "
                "VALUES (%s, %s, %s, %s, %s, to_tsvector('simple', %s))",
                [
                    (self._key, day, tag, line, now, search_terms(without_fact_comment(line)))
                    for tag, line in rows
                ],
            )
        return len(rows)

    def search_memory(
        self,
        query: str,
        max_results: int = 10,
        category: str | None = None,
        *,
        wait: float | None = None,
    ) -> Found:
        if max_results <= 0:
            return Found()
        tag = category.strip().lower() if category else None
        with self._pool.connection() as conn:
            lines = _top(
                conn, "gw_memory_facts", "line", self._key, query, max_results, category=tag
            )
        return Found(without_fact_comment(line) for line in lines)

    def facts_from_messages(self, entry_ids: Iterable[str]) -> dict[str, list[str]]:
        wanted = set(entry_ids)
        if not wanted:
            return {}
        if len(wanted) > _ORIGINS_BY_PATTERN:
            # A first reading of the messages asks for thousands: one pass over the
            # scope's facts with an origin, not a pattern per message.
            query = "SELECT day, line FROM gw_memory_facts WHERE scope = %s AND line LIKE %s"
            params: tuple[Any, ...] = (self._key, f"%{_like_escaped(' entry ')}%")
        else:
            query = "SELECT day, line FROM gw_memory_facts WHERE scope = %s AND line LIKE ANY(%s)"
            params = (self._key, [f"%{_like_escaped(origin_marker(e))}%" for e in sorted(wanted)])
        with self._pool.connection() as conn:
            rows = conn.execute(f"{query} ORDER BY id", params).fetchall()
        found: dict[str, list[str]] = {}
        for day, line in rows:
            fact = parse_fact_line(str(line), day)
            if fact is not None and fact.origin is not None and fact.origin.entry_id in wanted:
                found.setdefault(fact.origin.entry_id, []).append(without_fact_comment(str(line)))
        return found

    # -- seeing, correcting, forgetting facts ----------------------------------------

    def _facts(self, conn: psycopg.Connection[Any], lock: bool) -> list[tuple[int, Fact]]:
        """(row id, fact) of every fact line, in order."""
        rows = conn.execute(
            "SELECT id, day, line FROM gw_memory_facts WHERE scope = %s ORDER BY id"
            + (" FOR UPDATE" if lock else ""),
            (self._key,),
        ).fetchall()
        out: list[tuple[int, Fact]] = []
        for row_id, day, line in rows:
            fact = None if is_heading(str(line)) else parse_fact_line(str(line), day)
            if fact is not None:
                out.append((int(row_id), fact))
        return out

    def list_facts(self) -> list[Fact]:
        with self._pool.connection() as conn:
            memory = [fact for _, fact in self._facts(conn, lock=False)]
        return all_facts(memory, self._knowledge)

    def _knowledge_only(self, memory: list[Fact], ident: str) -> KnowledgeEntry | None:
        for fact in all_facts(memory, self._knowledge):
            if fact.id == ident and fact.kind == "knowledge":
                found = self._knowledge._select("AND left(id, %s) = %s", (ID_CHARS, ident))
                return found[0] if found else None
        return None

    def correct_fact(self, ident: str, text: str, *, by: str) -> Fact | None:
        """As the file mode's; in one transaction."""
        new_text = pg_text(one_line(text))
        if not new_text:
            raise ValueError("a corrected fact needs some text")
        fix = correction_now(self._clock(), pg_text(by))
        with self._writing() as conn:
            facts = self._facts(conn, lock=True)
            found = [(row, f) for row, f in facts if f.id == ident]
            if found:
                fact = corrected(found[0][1], new_text, fix)
                for row, old in found:
                    line = pg_text(corrected(old, new_text, fix).line())
                    conn.execute(
                        "UPDATE gw_memory_facts SET line = %s, tsv = to_tsvector('simple', %s) "
                        "WHERE scope = %s AND id = %s",
                        (line, search_terms(without_fact_comment(line)), self._key, row),
                    )
                olds = {same_text(f.text) for _, f in found}
                old_facts = [f for _, f in found]
            else:
                entry = self._knowledge_only([f for _, f in facts], ident)
                if entry is None:
                    return None
                today = self._clock().astimezone(UTC).date()
                fact = corrected(replace(knowledge_fact(entry), day=today), new_text, fix)
                self._insert_lines(conn, [(fact.category, pg_text(fact.line()))], today)
                olds = {same_text(entry.content)}
                old_facts = [knowledge_fact(entry)]
            for gone in self._knowledge.remove_in(conn, olds):
                self._knowledge.add_in(
                    conn, gone.category, new_text, source=gone.source or "", tags=gone.tags
                )
        if self.messages is not None:
            # As the file mode: the old words must not come back through message search.
            self.messages.forget_facts(
                (f.origin.entry_id if f.origin is not None else None, f.text) for f in old_facts
            )
        return fact

    def forget_fact(self, ident: str) -> Fact | None:
        """As the file mode's: the fact's rows and the knowledge entries saying the
        same are deleted, in one transaction."""
        with self._writing() as conn:
            facts = self._facts(conn, lock=True)
            found = [(row, f) for row, f in facts if f.id == ident]
            if found:
                conn.execute(
                    "DELETE FROM gw_memory_facts WHERE scope = %s AND id = ANY(%s)",
                    (self._key, [row for row, _ in found]),
                )
                fact = found[0][1]
            else:
                entry = self._knowledge_only([f for _, f in facts], ident)
                if entry is None:
                    return None
                fact = knowledge_fact(entry)
            texts = {same_text(f.text) for _, f in found} | {same_text(fact.text)}
            self._knowledge.remove_in(conn, texts)
        if self.messages is not None:
            # As the file mode: the messages it came from and those saying it go too.
            said = [f for _, f in found] or [fact]
            self.messages.forget_facts(
                (f.origin.entry_id if f.origin is not None else None, f.text) for f in said
            )
        return fact

    # -- history ---------------------------------------------------------------------

    def append_history(self, entry: str) -> str:
        with self._writing() as conn:
            return self._append_history(conn, entry)

    def _append_history(self, conn: psycopg.Connection[Any], entry: str) -> str:
        if not one_line(entry):
            return ""
        line = pg_text(format_history_line(entry, self._clock()).rstrip("\n"))
        stamp = history_timestamp(line)
        self._ensure_scope(conn)
        conn.execute(
            "INSERT INTO gw_memory_history (scope, at, line, tsv) "
            "VALUES (%s, %s, %s, to_tsvector('simple', %s))",
            (self._key, stamp if stamp is not None else time.time(), line, search_terms(line)),
        )
        return line

    def search_history(
        self,
        query: str,
        max_results: int = 20,
        decay_rate: float = 0.001,
        *,
        now: datetime | None = None,
        wait: float | None = None,
    ) -> Found:
        if max_results <= 0:
            return Found()
        moment = (now or self._clock()).timestamp()
        decay = "1.0 / (1.0 + greatest(0.0, %s - at) / 3600.0 * %s)"
        with self._pool.connection() as conn:
            return Found(
                _top(
                    conn,
                    "gw_memory_history",
                    "line",
                    self._key,
                    query,
                    max_results,
                    weight=(decay, (moment, max(0.0, decay_rate))),
                )
            )

    def load_indexes(self, progress: IndexProgress | None = None) -> None:
        """PostgreSQL keeps its indexes current itself: nothing to wait for."""

    # -- consolidation ---------------------------------------------------------------

    def record_consolidation(
        self,
        facts: Iterable[FactInput],
        summary: str,
        *,
        day: date | None = None,
        source: str = "consolidation",
    ) -> None:
        """Facts, knowledge entries and the summary line in one transaction."""
        cleaned = new_facts(facts)
        with self._writing() as conn:
            self._append_facts(conn, cleaned, day)
            for fact in cleaned:
                self._knowledge.add_in(conn, fact.category, fact.text, source=source)
            self._append_history(conn, summary)
        self._index_fact_keys(cleaned)

    def flush(self) -> None:
        """Every change was committed already."""

    def close(self) -> None:
        """Nothing held open: connections go back to the pool after each call."""


#: Above this many messages, `facts_from_messages` reads every fact with an origin once
#: instead of matching a pattern per message (the message index's first reading).
_ORIGINS_BY_PATTERN = 64


class PostgresMemoryStore:
    """Every scope's memory in one PostgreSQL database (`MemoryBackend`)."""

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        mode: ScopeMode = "per_session",
        clock: Callable[[], datetime] = utc_now,
        people: PeopleStore | None = None,
        dense: bool = False,
    ) -> None:
        """`dense`: fuse the sentence model into message search when its extra is
        installed (each replica embeds its scopes' messages in the background; the codes
        are not stored in PostgreSQL)."""
        scope_for_session("probe:key", mode)  # reject an unknown mode now, not per call
        self.people = people
        self._dense = dense
        self._pool = pool
        self._mode: ScopeMode = mode
        self._clock = clock
        # Each scope's message index in this replica, the most recently used kept.
        self._messages: OrderedDict[str, MessageIndex] = OrderedDict()
        self._messages_lock = threading.Lock()

    @property
    def mode(self) -> ScopeMode:
        return self._mode

    def scope_for(self, session_key: str) -> str:
        if self._mode == "person" and self.people is not None:
            return person_scope(self.people, session_key)
        return scope_for_session(session_key, self._mode)

    def exists(self, session_key: str) -> bool:
        key = scope_dirname(self.scope_for(session_key))
        with self._pool.connection() as conn:
            return (
                conn.execute("SELECT 1 FROM gw_memory_scopes WHERE scope = %s", (key,)).fetchone()
                is not None
            )

    def for_session(self, session_key: str) -> PostgresMemoryScope:
        return self.for_scope(self.scope_for(session_key))

    def for_scope(self, scope: str) -> PostgresMemoryScope:
        # Stateless but for the message index, which catches up from PostgreSQL at each
        # search, so there is no cache to keep coherent.
        return PostgresMemoryScope(self._pool, scope, self._clock, self._message_index(scope))

    def _message_index(self, scope: str) -> MessageIndex:
        with self._messages_lock:
            index = self._messages.get(scope)
            if index is None:
                source = PostgresMessageSource(self._pool, scope, self._keys_of(scope))
                reader = PostgresMemoryScope(self._pool, scope, self._clock)
                index = self._messages[scope] = MessageIndex(
                    source,
                    dense=sentence_dense_index() if self._dense else None,
                    fact_keys=functools.partial(fact_texts, reader.facts_from_messages),
                )
            self._messages.move_to_end(scope)
            while len(self._messages) > MESSAGE_INDEXES_KEPT:
                self._messages.popitem(last=False)
            return index

    def _keys_of(self, scope: str) -> Callable[[str], bool] | None:
        if self._mode == "per_session":
            return None

        def belongs(key: str) -> bool:
            try:
                return self.scope_for(key) == scope
            except ValueError:
                return False

        return belongs

    def flush(self) -> None:
        """Every change was committed already."""

    def close(self) -> None:
        """The pool belongs to `SharedStorage`, which closes it."""


class _PostgresLease:
    """A session's consolidation lease: a session-level advisory lock held on one pooled
    connection until `release` (a replica that dies releases it with its connection)."""

    def __init__(
        self, pool: ConnectionPool, conn: psycopg.Connection[Any], key: str, replica: str
    ) -> None:
        self._pool = pool
        self._conn: psycopg.Connection[Any] | None = conn
        self._key = key
        self._replica = replica

    def consolidated(self) -> tuple[str, str] | None:
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT session_id, first_kept_entry_id FROM gw_consolidations "
                "WHERE session_key = %s",
                (self._key,),
            ).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def record(
        self, session_id: str, first_kept_entry_id: str, *, summarized: int, facts: int
    ) -> None:
        with self._pool.connection() as conn, fence.refusals(), conn.transaction():
            fence.check(conn)
            conn.execute(
                "INSERT INTO gw_consolidations (session_key, session_id, first_kept_entry_id, "
                "summarized, facts, consolidated_at, replica) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (session_key) DO UPDATE SET "
                "session_id = EXCLUDED.session_id, "
                "first_kept_entry_id = EXCLUDED.first_kept_entry_id, "
                "summarized = EXCLUDED.summarized, facts = EXCLUDED.facts, "
                "consolidated_at = EXCLUDED.consolidated_at, replica = EXCLUDED.replica",
                (
                    self._key,
                    session_id,
                    first_kept_entry_id,
                    summarized,
                    facts,
                    time.time(),
                    self._replica,
                ),
            )

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.execute(_UNLOCK, (self._key,))
        except Exception:  # a broken connection released the lock with itself
            conn.close()
        _give_back(self._pool, conn)


def _give_back(pool: ConnectionPool, conn: psycopg.Connection[Any]) -> None:
    """Return a connection taken with `getconn`, as the pool's other users expect it."""
    if not conn.closed:
        try:
            conn.autocommit = False
        except Exception:
            conn.close()
    pool.putconn(conn)


#: The advisory lock of a session's consolidation: (this schema, the session key).
_LOCK_KEYS = "hashtext(current_schema() || ':consolidation'), hashtext(%s)"
_TRY_LOCK = f"SELECT pg_try_advisory_lock({_LOCK_KEYS})"
_UNLOCK = f"SELECT pg_advisory_unlock({_LOCK_KEYS})"


class PostgresConsolidationGuard:
    """Consolidation state shared by replicas (`gateway.memory.protocol.ConsolidationGuard`):
    one replica at a time consolidates a session, and the last
    consolidated span of each session is a row in ``gw_consolidations``."""

    def __init__(self, pool: ConnectionPool, replica: str) -> None:
        self._pool = pool
        self.replica = replica

    def acquire(self, session_key: str) -> _PostgresLease | None:
        conn = self._pool.getconn()
        try:
            conn.autocommit = True  # the lock is the session's, not a transaction's
            row = conn.execute(_TRY_LOCK, (session_key,)).fetchone()
        except BaseException:
            _give_back(self._pool, conn)
            raise
        if not row or not row[0]:
            _give_back(self._pool, conn)
            return None
        return _PostgresLease(self._pool, conn, session_key, self.replica)


#: Scopes whose message index a replica keeps in memory (least recently used dropped).
MESSAGE_INDEXES_KEPT = 128


class PostgresMessageSource:
    """The sessions of one scope in PostgreSQL (`gateway.memory.messages.MessageSource`):
    a session's mark is its `last_seq`; tombstones are `gw_memory_forgotten_messages`.

    Two groups of sessions: the current ones (each search reads their marks) and the
    archived ones, which never change: one round trip reads the current marks with the
    archived sessions' count and latest archiving time, and the archived sessions are
    read again only when those change (thousands of them cost a search nothing)."""

    def __init__(
        self, pool: ConnectionPool, scope: str, belongs: Callable[[str], bool] | None = None
    ) -> None:
        """`belongs` says which session keys are the scope's (the workspace's, a
        person's); None: the scope is one conversation's key (the per-session mode)."""
        self._pool = pool
        self._scope = scope
        self._key = scope_dirname(scope)
        self._belongs = belongs
        self._current: dict[str, SessionMark] = {}
        self._archived: dict[str, SessionMark] = {}
        self._archived_seen: tuple[int, float | None] | None = None

    def sessions(self) -> list[Mapping[str, SessionMark]]:
        belongs = self._belongs
        where = "WHERE key = %s" if belongs is None else ""
        params = (self._scope,) if belongs is None else ()
        with self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT session_id, key, last_seq, NULL FROM gw_sessions "
                f"{where} {'AND' if where else 'WHERE'} archived_at IS NULL "
                "UNION ALL SELECT NULL, NULL, count(*), max(archived_at) FROM gw_sessions "
                f"{where} {'AND' if where else 'WHERE'} archived_at IS NOT NULL",
                params * 2,
            ).fetchall()
            summary = next((int(n), at) for sid, _, n, at in rows if sid is None)
            if summary != self._archived_seen:
                archived = conn.execute(
                    "SELECT session_id, key, last_seq FROM gw_sessions "
                    f"{where} {'AND' if where else 'WHERE'} archived_at IS NOT NULL",
                    params,
                ).fetchall()
                self._archived = self._group(archived, self._archived)
                self._archived_seen = summary
        current = [(sid, key, seq) for sid, key, seq, _ in rows if sid is not None]
        self._current = self._group(current, self._current)
        return [self._current, self._archived]

    def _group(
        self, rows: Iterable[tuple[Any, Any, Any]], known: dict[str, SessionMark]
    ) -> dict[str, SessionMark]:
        """The sessions of `rows` that are the scope's; `known` itself when none changed
        (the index then skips the group)."""
        belongs = self._belongs
        found = {
            str(sid): SessionMark(str(key), str(sid), int(seq))
            for sid, key, seq in rows
            if belongs is None or belongs(str(key))
        }
        same = found.keys() == known.keys() and all(
            known[sid].mark == mark.mark for sid, mark in found.items()
        )
        return known if same else found

    def read(self, handle: str, start: int) -> tuple[list[StoredMessage], int]:
        return self.read_many([(handle, start)])[handle]

    def read_many(
        self, wanted: Sequence[tuple[str, int]]
    ) -> dict[str, tuple[list[StoredMessage], int]]:
        """`read` of several sessions in one round trip (a scope's first reading is one
        query, not two per session)."""
        handles = [handle for handle, _ in wanted]
        starts = [start for _, start in wanted]
        with self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT e.session_id, s.key, e.seq, e.entry_id, "
                "CASE WHEN e.type = 'message' THEN e.body END "
                "FROM unnest(%s::text[], %s::bigint[]) AS w(session_id, start) "
                "JOIN gw_sessions s ON s.session_id = w.session_id "
                "JOIN gw_session_entries e ON e.session_id = w.session_id AND e.seq > w.start "
                "ORDER BY e.session_id, e.seq",
                (handles, starts),
            ).fetchall()
        out: dict[str, tuple[list[StoredMessage], int]] = {h: ([], s) for h, s in wanted}
        for handle, key, seq, ident, body in rows:
            messages, end = out[handle]
            out[handle] = (messages, max(end, int(seq)))
            if not isinstance(body, dict):
                continue
            found = message_text(body.get("message"))
            ts = body.get("timestamp")
            if found is None or not isinstance(ts, int | float):
                continue
            messages.append(StoredMessage(str(key), handle, str(ident), float(ts), *found))
        return out

    def forgotten(self) -> set[str]:
        with self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT entry_id FROM gw_memory_forgotten_messages WHERE scope = %s",
                (self._key,),
            ).fetchall()
        return {str(row[0]) for row in rows}

    def forget(self, entry_ids: Iterable[str]) -> None:
        ids = sorted(set(entry_ids))
        if not ids:
            return
        with self._pool.connection() as conn, conn.transaction():
            conn.execute(
                "INSERT INTO gw_memory_forgotten_messages (scope, entry_id, created_at) "
                "SELECT %s, unnest(%s::text[]), %s ON CONFLICT DO NOTHING",
                (self._key, ids, time.time()),
            )
