"""The memory search rows of bench/memory.py against PostgreSQL (`--backend postgres`).

Run `.venv/bin/python bench/memory.py --backend postgres [--pg-url URL] [--json]`. The
same seeded corpora and queries as the file rows: history and facts of 1k/10k/100k
lines, and the common-word corpus (30 words, each in ~27% of lines). The lines are
bulk-loaded (COPY) into a scratch schema, dropped afterwards; appends are timed through
`PostgresMemoryScope` itself. PostgreSQL scores every matching row (no pruning), so
the common-word rows show its worst case.
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

from bench.memory import (
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

    from gateway.storage.postgres import connect, migrate, sync_pool

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


def bench_postgres(sizes: list[int], common: int, url: str | None, rows: list[Row]) -> None:
    import time

    url = url or DEFAULT_URL
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
