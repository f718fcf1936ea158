"""The memory search rows of bench/memory.py against PostgreSQL (`--backend postgres`).

Run `.venv/bin/python bench/memory.py --backend postgres [--pg-url URL] [--json]`. The
same seeded corpora and queries as the file rows: history and facts of 1k/10k/100k
lines, and the common-word corpus (30 words, each in ~27% of lines). The lines are
bulk-loaded (COPY) into a scratch schema, dropped afterwards; appends are timed through
`PostgresMemoryScope` itself. PostgreSQL scores every matching row (no pruning), so
the common-word rows show its worst case.

Issue 29's rows (`--message-sizes`): a conversation's past messages, 20 a session (each
archived by `/new` but the last), COPYed into the session tables as the session API
writes them; searched through `PostgresMemoryStore` (its message index lives in the
replica's memory and asks PostgreSQL what is new at each search, one round trip).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from bench.corpus import (
    QUERIES,
    SEED,
    Corpus,
    Row,
    _median_ms,
    _ms,
    common_word_lines,
    history_lines,
    row,
)
from gateway.memory.format import CATEGORIES, history_timestamp
from gateway.memory.pg_store import PostgresMemoryScope, search_terms
from gateway.memory.scopes import scope_dirname

DEFAULT_URL = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def scratch_pool(url: str) -> Iterator[Any]:
    """A pool whose connections use a new, migrated schema (dropped at the end)."""
    import psycopg

    from gateway.plumbing.postgres import connect, migrate, sync_pool

    schema = "gwbench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in url else "?"
    scoped = f"{url}{sep}options={quote(f'-csearch_path={schema}')}"
    try:
        with connect(scoped) as conn:
            migrate(conn)
        pool = sync_pool(scoped, max_size=2)
        pool.open()
        try:
            yield pool
        finally:
            pool.close()
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def bulk_load(
    pool: Any, scope: str, table: str, columns: str, data: list[tuple[Any, ...]]
) -> float:
    """COPY rows (`columns` ... plus the document's terms, last) into a memory table,
    with their tsvectors built as the store builds them; the seconds it took."""
    import time

    key = scope_dirname(scope)
    start = time.perf_counter()
    with pool.connection() as conn, conn.transaction():
        conn.execute("INSERT INTO gw_memory_scopes VALUES (%s, 0) ON CONFLICT DO NOTHING", (key,))
        conn.execute(
            f"CREATE TEMP TABLE load ON COMMIT DROP AS SELECT {columns} FROM {table} LIMIT 0"
        )
        conn.execute("ALTER TABLE load ADD COLUMN terms text")
        with conn.cursor() as cur, cur.copy(f"COPY load ({columns}, terms) FROM STDIN") as copy:
            for values in data:
                copy.write_row(values)
        conn.execute(
            f"INSERT INTO {table} (scope, {columns}, tsv) "
            f"SELECT %s, {columns}, to_tsvector('simple', terms) FROM load",
            (key,),
        )
    with pool.connection() as conn:
        conn.execute(f"ANALYZE {table}")
    return time.perf_counter() - start


def load_history(pool: Any, scope: str, lines: list[str]) -> float:
    data = [(history_timestamp(line) or 0.0, line, search_terms(line)) for line in lines]
    return bulk_load(pool, scope, "gw_memory_history", "at, line", data)


def load_facts(pool: Any, scope: str, corpus: Corpus, n: int) -> None:
    day = datetime(2024, 1, 1, tzinfo=UTC).date()
    data = []
    for i in range(n):
        category = CATEGORIES[i % len(CATEGORIES)]
        line = f"- [{category}] {corpus.sentence(5, 12)}"
        data.append((day, category, line, 0.0, search_terms(line)))
    bulk_load(pool, scope, "gw_memory_facts", "day, category, line, created_at", data)


def load_sessions(pool: Any, key: str, corpus: Corpus, messages: int, per: int = 20) -> None:
    """`messages` messages of `key`, `per` a session, COPYed as the session store writes
    them (the header and entries as JSON lines); every session but the last archived."""
    import time

    from gateway.llm import LLMMessage
    from gateway.sessions.entries import MessageEntry, new_entry_id
    from gateway.sessions.store import encode_line, new_header

    now = time.time() - messages * 60.0
    sessions: list[tuple[Any, ...]] = []
    entries: list[tuple[Any, ...]] = []
    for first in range(0, messages, per):
        header = new_header(key)
        parent = None
        count = min(per, messages - first)
        for seq in range(1, count + 1):
            role = "user" if (first + seq) % 2 else "assistant"
            entry = MessageEntry(
                id=new_entry_id(),
                parent_id=parent,
                timestamp=now + (first + seq) * 60.0,
                message=LLMMessage(role, corpus.sentence()),
            )
            body = encode_line(entry)[:-1]
            entries.append((header.id, seq, entry.id, parent, "message", body))
            parent = entry.id
        archived = None if first + per >= messages else now + (first + count) * 60.0
        sessions.append((header.id, key, encode_line(header)[:-1], now, now, count, 0, archived))
    with pool.connection() as conn, conn.transaction():
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY gw_sessions (session_id, key, header, created_at, updated_at, last_seq,"
                " bytes, archived_at) FROM STDIN"
            ) as copy,
        ):
            for values in sessions:
                copy.write_row(values)
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY gw_session_entries (session_id, seq, entry_id, parent_id, type, body)"
                " FROM STDIN"
            ) as copy,
        ):
            for values in entries:
                copy.write_row(values)
    with pool.connection() as conn:
        conn.execute("ANALYZE gw_sessions")
        conn.execute("ANALYZE gw_session_entries")


def bench_pg_messages(sizes: list[int], url: str, rows: list[Row]) -> None:
    """Issue 29's message rows in the PostgreSQL mode (module doc)."""
    import statistics
    import time

    from gateway.llm import LLMMessage
    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.sessions import SessionManager
    from gateway.sessions.pg_store import PostgresSessions

    corpus = Corpus()
    queries = [corpus.query() for _ in range(QUERIES)]
    key = "bench:messages"
    for n in sizes:
        with scratch_pool(url) as pool:
            load_sessions(pool, key, corpus, n)
            store = PostgresMemoryStore(pool)
            memory = store.for_session(key)
            start = time.perf_counter()
            memory.search_messages("warm up", 1)
            first = _ms(time.perf_counter() - start)
            rows.append(row("pg: messages: first search (reads every session)", n, first, "ms"))
            search = lambda q, m=memory: m.search_messages(q, 8, context=False)  # noqa: E731
            med, p95 = _median_ms(search, queries)
            limit = 1 if n <= 1000 else 5 if n >= 100_000 else None
            rows.append(row("pg: messages: search median", n, med, "ms", limit))
            rows.append(row("pg: messages: search p95", n, p95, "ms"))
            sessions = SessionManager.shared(PostgresSessions(pool))
            session = sessions.get_or_create(key)
            times = []
            for query in queries:
                session.add_message(LLMMessage("user", corpus.sentence()))
                start = time.perf_counter()
                search(query)
                times.append(time.perf_counter() - start)
            after = _ms(statistics.median(times))
            rows.append(row("pg: messages: search after one append (catch-up)", n, after, "ms"))
            sessions.close()


def bench_postgres(
    sizes: list[int],
    common: int,
    url: str | None,
    rows: list[Row],
    message_sizes: list[int] | None = None,
) -> None:
    import time

    url = url or DEFAULT_URL
    if message_sizes:
        bench_pg_messages(message_sizes, url, rows)
    corpus = Corpus()
    queries = [corpus.query() for _ in range(QUERIES)]
    for n in sizes:
        with scratch_pool(url) as pool:
            scope = PostgresMemoryScope(pool, "bench:search")
            load = load_history(pool, "bench:search", history_lines(corpus, n))
            rows.append(row("pg: history bulk load (COPY + tsvector)", n, _ms(load), "ms"))
            load_facts(pool, "bench:search", corpus, n)
            med, p95 = _median_ms(scope.search_history, queries)
            rows.append(row("pg: search_history median (decay 0.001)", n, med, "ms", 5))
            rows.append(row("pg: search_history p95", n, p95, "ms"))
            med, p95 = _median_ms(scope.search_memory, queries)
            rows.append(row("pg: search_memory median", n, med, "ms", 5))
            rows.append(row("pg: search_memory p95", n, p95, "ms"))
            med, _ = _median_ms(
                lambda q, s=scope: s.search_memory(q, category="project_decision"), queries
            )
            rows.append(row("pg: search_memory +category median", n, med, "ms", 5))
            if n == max(sizes):
                start = time.perf_counter()
                for i in range(200):
                    scope.append_history(f"appended line {i} {corpus.sentence()}")
                per = (time.perf_counter() - start) / 200
                rows.append(row("pg: append_history (one commit each)", n, _ms(per), "ms"))
    rng = random.Random(SEED + 3)
    vocabulary, lines = common_word_lines(common, rng)
    rare = {rng.randrange(common): f"zq{q}rare" for q in range(QUERIES)}
    for at, word in rare.items():
        lines[at] = f"{lines[at]} {word}"
    with scratch_pool(url) as pool:
        scope = PostgresMemoryScope(pool, "bench:common")
        load_history(pool, "bench:common", lines)
        wanted = [" ".join([*rng.sample(vocabulary, 3), word]) for word in rare.values()]
        for decay in (0.0, 0.001):
            med, p95 = _median_ms(
                lambda q, d=decay, s=scope: s.search_history(q, 5, decay_rate=d), wanted
            )
            label = f"pg: common words: search_history {{}} (decay {decay})"
            rows.append(row(label.format("median"), common, med, "ms", 5))
            rows.append(row(label.format("p95"), common, p95, "ms"))
