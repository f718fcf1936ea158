"""Benchmark of the memory layer: search latency, index build, appends, compaction, knowledge.

Run `.venv/bin/python bench/memory.py` (a table) or with `--json`. The corpus is
synthetic but shaped like real text: a seeded vocabulary of a few thousand words drawn
with a Zipf law, mixed with English stopwords; queries are 2-4 words drawn the same way
(so common words do appear in queries). Compaction runs in a child process so its
peak RSS is its own.

Issue 11's rows: the common-word corpus (100k history lines of 8-10 words from a
30-word vocabulary, each word in ~27% of lines, over the last 7 days; queries of 3
common words plus one rare word held by one line), the first search after a restart
(a child process opens the scope from its files and saved indexes), the knowledge
base's add and reload, and `append_history` into a fresh scope and into one with a
large index.

Issue 29's "must not get slower" rows (`--code OTHER_CHECKOUT`, repeatable): the
append, build, compaction and per-turn recall measures, each in a child process, run
against our code and each other checkout alternately (medians of three), so a noisy
machine's load falls on both alike; the table gives each and the ratio. The CPU time
(`time.process_time`) is the steadier figure; the wall time adds fsync waits. An
append row alone hides a trade: a checkout that indexes a fact only when the scope is
searched pays at its first search, so "append_to_memory, then the first search" gives
the whole cost of a fact until it can be found. `--measures` runs some of them only.

    git worktree add /tmp/before-indexes dc5b0ff     # before the indexes were saved
    git worktree add /tmp/before-messages cc4cbcb    # before messages were indexed
    .venv/bin/python bench/memory.py --only-compare \
        --code /tmp/before-indexes --code /tmp/before-messages

Issue 31's rows (item 3): every search row counts the time to the first *complete*
answer (a search waits for an index being built), and the cold-start section runs the
shape that once answered from the newest 64 kB: 20,000 lines appended to a never
searched scope (the default bound: many rotations), a word only line 17 holds searched
at once, then after a restart with and without the saved index. Each row checks the
answer was complete and found the line.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

# A child run for another checkout (--code) imports that checkout's gateway; this
# checkout's bench modules stay importable beside it (bench is a namespace package).
sys.path[:0] = [
    p for p in (os.environ.get("BENCH_CODE"), str(Path(__file__).resolve().parents[1])) if p
]

from bench.corpus import (  # noqa: E402
    QUERIES,
    SEED,
    Corpus,
    Row,
    _median_ms,
    _ms,
    at_least,
    common_word_lines,
    history_lines,
    row,
)
from gateway.memory import CATEGORIES, KnowledgeBase, MemoryManager  # noqa: E402


def write_history(folder: Path, corpus: Corpus, lines: int, archive_bytes: int = 512_000) -> None:
    """`history_lines`, split into archives + HISTORY.md."""
    chunk: list[str] = []
    size = 0
    archive = 0
    for text in history_lines(corpus, lines):
        line = text + "\n"
        chunk.append(line)
        size += len(line)
        if size > archive_bytes:
            (folder / f"HISTORY.archive.20240101T000000-{archive:04d}.md").write_text(
                "".join(chunk)
            )
            archive += 1
            chunk, size = [], 0
    (folder / "HISTORY.md").write_text("".join(chunk))


def memory_text(corpus: Corpus, facts: int, duplicates: float = 0.0) -> str:
    """MEMORY.md with `facts` bullets under daily headings, some of them redundant."""
    out: list[str] = []
    written: list[tuple[str, str]] = []
    day = datetime(2024, 1, 1).date()
    for i in range(facts):
        if i % 25 == 0:
            out.append(f"\n### Consolidated {day.isoformat()}\n")
            day += timedelta(days=1)
        if written and corpus.rng.random() < duplicates:
            category, text = corpus.rng.choice(written)
            if corpus.rng.random() < 0.5:
                text = text.upper() + "."  # equal up to case and punctuation
            else:
                text = f"{text} {corpus.rng.choice(corpus.words)}"  # contains the original
        else:
            category, text = corpus.rng.choice(CATEGORIES), corpus.sentence(5, 12)
            written.append((category, text))
        out.append(f"- [{category}] {text}\n")
    return "".join(out)


def bench_search(sizes: list[int], rows: list[Row]) -> None:
    corpus = Corpus()
    queries = [corpus.query() for _ in range(QUERIES)]
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            manager = MemoryManager(Path(tmp), "bench:search", history_max_bytes=512_000)
            write_history(manager.dir, corpus, n)
            manager.memory_path.write_text(memory_text(corpus, n))

            start = time.perf_counter()
            manager.load_indexes()
            build = time.perf_counter() - start
            rows.append(row("index build (history + memory)", n, _ms(build), "ms"))
            search_rows(manager, n, queries, rows)
            if n == max(sizes):
                append_rows(manager, corpus, n, rows)


def search_rows(manager: MemoryManager, n: int, queries: list[str], rows: list[Row]) -> None:
    med, p95 = _median_ms(manager.search_history, queries)
    rows.append(row("search_history median (decay 0.001)", n, med, "ms", 5))
    rows.append(row("search_history p95", n, p95, "ms"))
    index = manager._history_index.current()  # the bench looks inside: pruning at work
    scored = []
    for query in queries:
        manager.search_history(query)
        scored.append(index.scored_postings)
    rows.append(
        row("search_history postings scored, median", n, statistics.median(scored), "postings")
    )
    every = []
    for query in queries:
        index.search(query, 1 << 30, decay_rate=0.001)  # k = everything: no pruning possible
        every.append(index.scored_postings)
    rows.append(row("  (exhaustive scoring would score)", n, statistics.median(every), "postings"))
    med, p95 = _median_ms(manager.search_memory, queries)
    rows.append(row("search_memory median", n, med, "ms", 5))
    rows.append(row("search_memory p95", n, p95, "ms"))
    med, _ = _median_ms(lambda q: manager.search_memory(q, category="project_decision"), queries)
    rows.append(row("search_memory +category median", n, med, "ms", 5))


def append_rows(manager: MemoryManager, corpus: Corpus, n: int, rows: list[Row]) -> None:
    appends = 2000
    entries = [corpus.sentence() for _ in range(appends)]
    with tempfile.TemporaryDirectory() as tmp:  # the same appends into a fresh scope
        bare = MemoryManager(Path(tmp), "bench:bare", history_max_bytes=512_000)
        start = time.perf_counter()
        for entry in entries:
            bare.append_history(entry)
        without = (time.perf_counter() - start) / appends
    # The corpus was written past `history_max_bytes` behind the manager's back: the first
    # append rotates it once (a one-off, not the per-append cost measured here).
    manager.append_history(corpus.sentence())
    start = time.perf_counter()
    for entry in entries:
        manager.append_history(entry)
    per = (time.perf_counter() - start) / appends
    rows.append(row("append_history, fresh scope", 0, round(without * 1e6, 1), "us"))
    limit = round(without * 1e6 * 1.25, 1)  # "close to a fresh scope's cost": within 25%
    rows.append(row("append_history, large index loaded", n, round(per * 1e6, 1), "us", limit))
    start = time.perf_counter()
    manager.search_history("anything at all")
    rows.append(
        row(
            f"next search indexing those {appends} lines", n, _ms(time.perf_counter() - start), "ms"
        )
    )
    start = time.perf_counter()
    for entry in entries:
        manager.append_to_memory(f"- [learned_fact] {entry}")
    per = _ms((time.perf_counter() - start) / appends)
    rows.append(row("append_to_memory (indexed)", n, per, "ms", 0.1))


def _peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM is reset by exec (ru_maxrss on Linux is not)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _compact_child(folder: str) -> None:
    manager = MemoryManager(Path(folder), "bench:compact")
    before = _peak_rss_mb()
    start = time.perf_counter()
    removed = manager.compact_memory()
    elapsed = time.perf_counter() - start
    peak = _peak_rss_mb()
    print(
        json.dumps({"seconds": elapsed, "removed": removed, "peak_mb": peak, "before_mb": before})
    )


def _run_child(flag: str, folder: str) -> dict[str, Any]:
    """Run this file with `flag folder` in a fresh process; its last line, as JSON."""
    return _run_child_query(flag, folder, None)


def _run_child_query(flag: str, folder: str, query: str | None) -> dict[str, Any]:
    """`_run_child`, with `--query` passed on when given."""
    more = ["--query", query] if query is not None else []
    out = subprocess.run(
        [sys.executable, __file__, flag, folder, *more], check=True, capture_output=True, text=True
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def bench_compact(sizes: list[int], rows: list[Row]) -> None:
    corpus = Corpus(SEED + 1)
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            manager = MemoryManager(Path(tmp), "bench:compact")
            manager.memory_path.write_text(memory_text(corpus, n, duplicates=0.15))
            result = _run_child("--compact-child", tmp)
            seconds, peak = result["seconds"], result["peak_mb"]
            label = f"compact_memory time ({result['removed']} removed)"
            rows.append(row(label, n, _ms(seconds), "ms", 1000))
            rows.append(
                row("compact_memory peak RSS (whole process)", n, round(peak, 1), "MB", 300)
            )
            growth = round(peak - result["before_mb"], 1)
            rows.append(row("compact_memory RSS growth", n, growth, "MB"))


def bench_knowledge(n: int, rows: list[Row]) -> None:
    corpus = Corpus(SEED + 2)
    texts = [(corpus.sentence(4, 12), corpus.rng.choice(CATEGORIES)) for _ in range(n)]
    queries = [corpus.query() for _ in range(QUERIES)]
    for size in sorted({1000, n}):
        with tempfile.TemporaryDirectory() as tmp:
            base = KnowledgeBase(Path(tmp) / "knowledge.json")
            start = time.perf_counter()
            for text, category in texts[:size]:
                base.add(category, text, source="bench")
            per = (time.perf_counter() - start) / size
            rows.append(row("knowledge add (flushes incl.)", size, round(per * 1e6, 1), "us", 10))
            base.close()
    with tempfile.TemporaryDirectory() as tmp:
        base = KnowledgeBase(Path(tmp) / "knowledge.json")
        for text, category in texts:
            base.add(category, text, source="bench")
        start = time.perf_counter()
        base.add("learned_fact", "one more entry to make it dirty")
        base.flush()
        rows.append(row("knowledge flush (one change)", n, _ms(time.perf_counter() - start), "ms"))
        med, _ = _median_ms(base.search, queries)
        rows.append(row("knowledge search median", n, med, "ms", 5))
        start = time.perf_counter()
        base.export_for_context()
        rows.append(row("knowledge export_for_context", n, _ms(time.perf_counter() - start), "ms"))
        base.close()
        del base
        loads = []
        for _ in range(3):
            gc.collect()
            start = time.perf_counter()
            reopened = KnowledgeBase(Path(tmp) / "knowledge.json")
            reopened.search(queries[0])
            loads.append(time.perf_counter() - start)
            reopened.close()
            del reopened
        rows.append(
            row("knowledge reload + first search (median of 3)", n, _ms(sorted(loads)[1]), "ms", 50)
        )


def bench_common_words(n: int, rows: list[Row]) -> None:
    rng = random.Random(SEED + 3)
    vocabulary, lines = common_word_lines(n, rng)
    rare = {rng.randrange(n): f"zq{q}rare" for q in range(QUERIES)}
    for at, word in rare.items():
        lines[at] = f"{lines[at]} {word}"
    with tempfile.TemporaryDirectory() as tmp:
        manager = MemoryManager(Path(tmp), "bench:common", history_max_bytes=1 << 40)
        manager.history_path.write_text("\n".join(lines) + "\n")
        manager.load_indexes()
        queries = [
            (" ".join([*rng.sample(vocabulary, 3), word]), lines[at]) for at, word in rare.items()
        ]
        share = sum(vocabulary[0] in line for line in lines) / n
        rows.append(
            row(
                f"common-word corpus: lines holding a word ({vocabulary[0]})",
                n,
                round(share * 100, 1),
                "%",
            )
        )
        index = manager._history_index.current()  # the bench looks inside: postings scored
        for decay in (0.0, 0.001):
            med, p95 = _median_ms(
                lambda q, d=decay: manager.search_history(q, 20, decay_rate=d),
                [q for q, _ in queries],
            )
            label = "no decay" if decay == 0 else f"decay {decay}"
            rows.append(row(f"common words: search_history median ({label})", n, med, "ms", 5))
            rows.append(row(f"common words: search_history p95 ({label})", n, p95, "ms"))
            first = 0
            scored = []
            for query, line in queries:
                first += manager.search_history(query, 20, decay_rate=decay)[0] == line
                scored.append(index.scored_postings)
            rows.append(
                at_least(f"common words: rare line first ({label})", n, first, f"of {QUERIES}", 19)
            )
            rows.append(
                row(
                    f"common words: postings scored, median ({label})",
                    n,
                    statistics.median(scored),
                    "postings",
                )
            )
        terms = 3
        rows.append(
            row(
                "common words: postings of 3 common words (exhaustive)",
                n,
                round(share * n * terms),
                "postings",
            )
        )


def _restart_child(folder: str, query: str = "kel lom dansal") -> None:
    """Open the scope as a restarted gateway would; time its first searches, each to
    its first complete answer (a search waits for an index being built)."""
    from loguru import logger

    logger.remove()
    start = time.perf_counter()
    manager = MemoryManager(Path(folder), "bench:restart")
    history = manager.search_history(query)
    first_history = time.perf_counter() - start
    start = time.perf_counter()
    facts = manager.search_memory(query)
    first_memory = time.perf_counter() - start
    print(
        json.dumps(
            {
                "history": first_history,
                "memory": first_memory,
                "hits": len(history) + len(facts),
                "lines": list(history),
                "complete": history.complete and facts.complete,
            }
        )
    )


def bench_restart(n: int, rows: list[Row]) -> None:
    corpus = Corpus(SEED + 4)
    with tempfile.TemporaryDirectory() as tmp:
        manager = MemoryManager(Path(tmp), "bench:restart")
        write_history(manager.dir, corpus, n)
        manager.memory_path.write_text(memory_text(corpus, n))
        start = time.perf_counter()
        manager.load_indexes()
        rows.append(
            row(
                "index build, history + facts (once, in the background)",
                n,
                _ms(time.perf_counter() - start),
                "ms",
            )
        )
        manager.close()
        index = manager._history_index.current()
        per_line = index.memory_bytes() / max(len(index), 1)
        rows.append(row("history index memory per line", n, round(per_line), "bytes"))
        size = (manager.dir / "HISTORY.md.index").stat().st_size / max(len(index), 1)
        rows.append(row("history index file per line", n, round(size), "bytes"))

        for label, limit in (("after restart (saved index)", 50), ("no saved index", None)):
            result = _run_child("--restart-child", tmp)
            for kind in ("history", "memory"):
                metric = f"first complete search_{kind}, {label}"
                rows.append(row(metric, n, _ms(result[kind]), "ms", limit))
            rows.append(at_least(f"  answers complete, {label}", n, result["complete"], "", 1))
            for name in ("HISTORY.md.index", "MEMORY.md.index"):
                (manager.dir / name).unlink(missing_ok=True)


COLD_LINES = 20_000

COLD_EARLY = 17

COLD_WORD = "quetzalcoatl"


def bench_cold_start(rows: list[Row]) -> None:
    """Issue 31's shape: appends to a never searched scope, then a word only an early
    line holds, searched at once and after restarts; time to the first complete answer."""
    corpus = Corpus(SEED + 5)
    entries = [corpus.sentence() for _ in range(COLD_LINES)]
    entries[COLD_EARLY] += f" {COLD_WORD}"
    n = COLD_LINES
    with tempfile.TemporaryDirectory() as tmp:
        manager = MemoryManager(Path(tmp), "bench:restart")  # the default bound
        start = time.perf_counter()
        for entry in entries:
            manager.append_history(entry)
        per = (time.perf_counter() - start) / n
        rows.append(
            row(
                "append_history, never searched (indexing + saves incl.)",
                n,
                round(per * 1e6, 1),
                "us",
            )
        )
        rows.append(row("  HISTORY.md rotations", n, len(manager.history_archives()), "archives"))
        start = time.perf_counter()
        found = manager.search_history(COLD_WORD)
        elapsed = time.perf_counter() - start
        # It indexes the appends still pending (up to 4,096 lines) first.
        rows.append(row("first complete search, at once", n, _ms(elapsed), "ms", 250))
        ok = found.complete and len(found) == 1 and COLD_WORD in found[0]
        rows.append(at_least("  found the line, complete", n, ok, "", 1))
        manager.close()
        folder = str(manager.dir.parent.parent)
        for label, limit in (("after restart (saved index)", 50), ("no saved index", None)):
            result = _run_child_query("--restart-child", folder, COLD_WORD)
            rows.append(
                row(f"first complete search, {label}", n, _ms(result["history"]), "ms", limit)
            )
            ok = result["complete"] and len(result["lines"]) == 1
            rows.append(at_least(f"  found the line, complete, {label}", n, ok, "", 1))
            for name in ("HISTORY.md.index", "MEMORY.md.index"):
                (manager.dir / name).unlink(missing_ok=True)


def print_table(rows: list[Row]) -> None:
    headers = ("metric", "size", "value", "unit", "target", "pass")
    table = [
        (
            r.metric,
            f"{r.size:,}",
            f"{r.value:g}",
            r.unit,
            r.target,
            "-" if r.ok is None else ("yes" if r.ok else "NO"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for cells in table:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))


def bench_messages(sizes: list[int], rows: list[Row]) -> None:
    """Issue 29's rows: every past message searchable. Messages are written through the
    session API into session files (20 per session, as `/new` would leave them); the
    message index reads them at a scope's first search and then only what was appended
    since, so a turn's append does no indexing work (the session write path is
    unchanged: bench/sessions.py; what a turn's recall costs: the compare rows). The
    index is saved in the scope's folder: a restarted store's first search loads it and
    must answer as before the restart (checked on every query)."""
    from gateway.llm import LLMMessage
    from gateway.memory import MemoryStore
    from gateway.memory.messages import MESSAGE_INDEX_FILE
    from gateway.sessions import SessionManager

    corpus = Corpus()
    queries = [corpus.query() for _ in range(QUERIES)]
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            sessions = SessionManager(Path(tmp) / "sessions", fsync="never")
            key = "bench:messages"
            for i in range(n):
                if i and i % 20 == 0:
                    sessions.reset(key)
                role = "user" if i % 2 == 0 else "assistant"
                sessions.get_or_create(key).add_message(LLMMessage(role, corpus.sentence()))
            sessions.get_or_create(key).flush()
            store = MemoryStore(Path(tmp) / "ws", sessions_dir=Path(tmp) / "sessions")
            memory = store.for_session(key)
            start = time.perf_counter()
            memory.search_messages("warm up", 1)
            first = _ms(time.perf_counter() - start)
            rows.append(row("messages: first search, never read (every session)", n, first, "ms"))
            search = functools.partial(memory.search_messages, max_results=8, context=False)
            med, p95 = _median_ms(search, queries)
            limit = 1 if n <= 1000 else 5 if n >= 100_000 else None
            rows.append(row("messages: search median", n, med, "ms", limit))
            rows.append(row("messages: search p95", n, p95, "ms"))
            cpu = []
            for query in queries:
                start = time.process_time()
                search(query)
                cpu.append(time.process_time() - start)
            rows.append(row("messages: search median (CPU)", n, _ms(statistics.median(cpu)), "ms"))
            times = []
            session = sessions.get_or_create(key)
            for query in queries:
                session.add_message(LLMMessage("user", corpus.sentence()))
                session.flush()
                start = time.perf_counter()
                memory.search_messages(query, 8, context=False)
                times.append(time.perf_counter() - start)
            after = _ms(statistics.median(times))
            rows.append(row("messages: search after one append (catch-up)", n, after, "ms"))
            # A turn's share of everything the index does: 200 turns of two messages and
            # a search each, merges included (the mean, not the median).
            start = time.process_time()
            for i in range(200):
                session.add_message(LLMMessage("user", corpus.sentence()))
                session.add_message(LLMMessage("assistant", corpus.sentence()))
                memory.search_messages(queries[i % QUERIES], 8, context=False)
            per = _ms((time.process_time() - start) / 200)
            rows.append(row("messages: a turn (2 stored + search), mean CPU", n, per, "ms"))
            index = memory.messages
            size = index.memory_bytes() / 2**20 if index is not None else 0.0
            rows.append(row("messages: index memory (heap + mapped)", n, round(size, 2), "MB"))
            store.close()  # saves the index, merged (its impacts against the average now)
            before = [[h.entry_id for h in search(q)] for q in queries]  # what was saved
            saved = (memory.dir / MESSAGE_INDEX_FILE).stat().st_size / 2**20
            rows.append(row("messages: saved index file", n, round(saved, 2), "MB"))
            store = MemoryStore(Path(tmp) / "ws", sessions_dir=Path(tmp) / "sessions")
            memory = store.for_session(key)
            start = time.perf_counter()
            memory.search_messages("warm up", 1)
            first = _ms(time.perf_counter() - start)
            rows.append(row("messages: first search after a restart (saved)", n, first, "ms"))
            search = functools.partial(memory.search_messages, max_results=8, context=False)
            same = sum(
                [h.entry_id for h in search(q)] == b for q, b in zip(queries, before, strict=True)
            )
            rows.append(
                at_least("  same answers as before the restart", n, same, "queries", QUERIES)
            )
            store.close()
            sessions.close()


COMPARE_ROUNDS = 3

# (measure, size, what the child reports, unit, label)
COMPARED = [
    ("append_to_memory", 5_000, "us", "us", "append_to_memory, fresh scope (wall)"),
    ("append_to_memory", 5_000, "cpu_us", "us CPU", "append_to_memory, fresh scope (CPU)"),
    ("append_history", 5_000, "us", "us", "append_history, fresh scope (wall)"),
    ("append_history", 5_000, "cpu_us", "us CPU", "append_history, fresh scope (CPU)"),
    (
        "append_then_search",
        5_000,
        "cpu_us",
        "us CPU",
        "append_to_memory, then the first search (CPU a fact)",
    ),
    ("history_build", 100_000, "seconds", "s", "history index build, first search (wall)"),
    ("history_build", 100_000, "cpu", "s CPU", "history index build, first search (CPU)"),
    ("history_build", 100_000, "rss_mb", "MB", "  RSS after the build"),
    ("compact", 10_000, "ms", "ms", "compact_memory (wall)"),
    ("compact", 10_000, "cpu_ms", "ms CPU", "compact_memory (CPU)"),
    ("turn", 10_000, "ms", "ms", "a turn: 2 messages stored + memory_texts recall"),
    ("turn", 10_000, "cpu_ms", "ms CPU", "a turn: 2 messages stored + memory_texts (CPU)"),
]


def _compare_child(what: str, size: int) -> dict[str, float]:
    """One measure of `bench_compare`, in this process, on whatever gateway it imports
    (ours, or `BENCH_CODE`'s): only API every compared checkout has."""
    from loguru import logger

    logger.remove()
    corpus = Corpus(SEED + 7)
    with tempfile.TemporaryDirectory() as tmp:
        if what in ("append_to_memory", "append_history"):
            manager = MemoryManager(Path(tmp), "bench:append")
            if what == "append_to_memory":
                entries = [f"- [learned_fact] {corpus.sentence()}" for _ in range(size)]
                call: Callable[[str], object] = manager.append_to_memory
            else:
                entries = [corpus.sentence() for _ in range(size)]
                call = manager.append_history
            start, cpu = time.perf_counter(), time.process_time()
            for entry in entries:
                call(entry)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            manager.close()
            return {"us": wall / size * 1e6, "cpu_us": cpu / size * 1e6}
        if what == "append_then_search":
            # The whole cost of a fact until it can be found: an append that leaves the
            # indexing to the first search is cheap only until that search.
            manager = MemoryManager(Path(tmp), "bench:append")
            entries = [f"- [learned_fact] {corpus.sentence()}" for _ in range(size)]
            start, cpu = time.perf_counter(), time.process_time()
            for entry in entries:
                manager.append_to_memory(entry)
            found = manager.search_memory(entries[size // 2].split("] ", 1)[1], 1)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            assert found, "the first search found nothing"
            manager.close()
            return {"us": wall / size * 1e6, "cpu_us": cpu / size * 1e6}
        if what == "history_build":
            manager = MemoryManager(Path(tmp), "bench:build", history_max_bytes=512_000)
            write_history(manager.dir, corpus, size)
            gc.collect()
            start, cpu = time.perf_counter(), time.process_time()
            manager.search_history("kalo mira")
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            gc.collect()
            return {"seconds": wall, "cpu": cpu, "rss_mb": _rss_mb()}
        if what == "compact":
            manager = MemoryManager(Path(tmp), "bench:compact")
            manager.memory_path.write_text(memory_text(corpus, size, duplicates=0.15))
            manager.close()
            manager = MemoryManager(Path(tmp), "bench:compact")
            start, cpu = time.perf_counter(), time.process_time()
            manager.compact_memory()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            return {"ms": wall * 1e3, "cpu_ms": cpu * 1e3}
        if what == "turn":
            return _turn_child(Path(tmp), corpus, size)
    raise SystemExit(f"unknown measure {what}")


def _turn_child(tmp: Path, corpus: Corpus, size: int, turns: int = 200) -> dict[str, float]:
    """A conversation of `size` messages (20 a session, as `/new` leaves them) with
    facts and summaries; each turn stores its two messages and asks the per-turn
    recall (`memory_texts`), as the agent does. Where messages are not searchable yet
    (an earlier checkout) the store takes no sessions folder."""
    from gateway.agent.memory_tools import memory_texts
    from gateway.llm import LLMMessage
    from gateway.memory import MemoryStore
    from gateway.sessions import SessionManager

    key = "telegram:42"
    sessions = SessionManager(tmp / "sessions", fsync="never")
    for i in range(size):
        if i and i % 20 == 0:
            sessions.reset(key)
        role = "user" if i % 2 == 0 else "assistant"
        sessions.get_or_create(key).add_message(LLMMessage(role, corpus.sentence()))
    try:
        store = MemoryStore(tmp / "ws", sessions_dir=tmp / "sessions")  # type: ignore[call-arg]
    except TypeError:
        store = MemoryStore(tmp / "ws")
    memory = store.for_session(key)
    for _ in range(200):
        memory.append_to_memory(f"- [learned_fact] {corpus.sentence(4, 10)}")
        memory.append_history(corpus.sentence())
    queries = [corpus.sentence(4, 10) for _ in range(turns)]
    memory_texts(store, key, queries[0])  # the scope's first reading, not a turn's cost
    session = sessions.get_or_create(key)
    start, cpu = time.perf_counter(), time.process_time()
    for query in queries:
        session.add_message(LLMMessage("user", query))
        session.add_message(LLMMessage("assistant", corpus.sentence()))
        memory_texts(store, key, query)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    store.close()
    sessions.close()
    return {"ms": wall / turns * 1e3, "cpu_ms": cpu / turns * 1e3}


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def _label(code: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return code.name


def bench_compare(
    codes: list[Path],
    rows: list[Row],
    rounds: int = COMPARE_ROUNDS,
    only: frozenset[str] = frozenset(),
) -> None:
    """Issue 29's rows (module doc): each measure in child processes, ours and every
    checkout of `codes` alternately, `rounds` times; medians, and ours / theirs.
    `only`: these measures alone (all when empty)."""
    sides: list[tuple[str, Path | None]] = [("ours", None)] + [(_label(c), c) for c in codes]
    measures = sorted(
        {(what, size) for what, size, *_ in COMPARED if not only or what in only}, key=str
    )
    found: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for what, size in measures:
            for name, code in sides:
                env = dict(os.environ)
                if code is not None:
                    env["BENCH_CODE"] = str(code)
                done = subprocess.run(
                    [sys.executable, __file__, "--compare-child", what, "--size", str(size)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if done.returncode == 0:
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    found.setdefault((name, what, size), []).append(result)
    for what, size, field, unit, label in COMPARED:
        ours = [r[field] for r in found.get(("ours", what, size), [])]
        if not ours:
            continue
        mine = statistics.median(ours)
        rows.append(row(label, size, round(mine, 3), unit))
        for name, _ in sides[1:]:
            theirs = [r[field] for r in found.get((name, what, size), [])]
            if not theirs:
                rows.append(row(f"  at {name}: cannot run this measure", size, 0, "-"))
                continue
            other = statistics.median(theirs)
            rows.append(row(f"  at {name}", size, round(other, 3), unit))
            rows.append(row(f"  ours / {name}", size, round(mine / other, 3), "x"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--sizes", default="1000,10000,100000", help="search corpus sizes")
    parser.add_argument("--compact-sizes", default="1000,10000")
    parser.add_argument("--knowledge-size", type=int, default=10_000)
    parser.add_argument("--common-size", type=int, default=100_000)
    parser.add_argument("--restart-size", type=int, default=100_000)
    parser.add_argument(
        "--message-sizes", default="1000,10000,100000", help="messages in a scope ('' to skip)"
    )
    parser.add_argument(
        "--only-messages", action="store_true", help="run only the message index rows"
    )
    parser.add_argument(
        "--backend",
        choices=("files", "postgres"),
        default="files",
        help="postgres: the search rows against PostgreSQL (bench/memory_pg.py)",
    )
    parser.add_argument("--pg-url", help="PostgreSQL for --backend postgres (a scratch schema)")
    parser.add_argument(
        "--code",
        type=Path,
        action="append",
        default=[],
        help="an earlier checkout to run issue 29's compare rows against (repeatable)",
    )
    parser.add_argument(
        "--only-compare", action="store_true", help="run only issue 29's compare rows"
    )
    parser.add_argument(
        "--measures",
        default="",
        help="comma-separated compare measures to run (default all): "
        + ", ".join(sorted({what for what, *_ in COMPARED})),
    )
    parser.add_argument("--compare-child", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--compact-child", help=argparse.SUPPRESS)
    parser.add_argument("--restart-child", help=argparse.SUPPRESS)
    parser.add_argument("--query", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compare_child:
        print(json.dumps(_compare_child(args.compare_child, args.size)))
        return 0
    if args.compact_child:
        _compact_child(args.compact_child)
        return 0
    if args.restart_child:
        _restart_child(args.restart_child, args.query or "kel lom dansal")
        return 0

    from loguru import logger

    logger.remove()  # keep the table readable
    rows: list[Row] = []
    if args.backend == "postgres":
        from bench.memory_pg import bench_postgres

        message_sizes = [int(s) for s in args.message_sizes.split(",") if s.strip()]
        if args.only_messages:
            from bench.memory_pg import DEFAULT_URL, bench_pg_messages

            bench_pg_messages(message_sizes, args.pg_url or DEFAULT_URL, rows)
            return _report(rows, args.json)
        bench_postgres(
            [int(s) for s in args.sizes.split(",")],
            args.common_size,
            args.pg_url,
            rows,
            message_sizes,
        )
        return _report(rows, args.json)
    message_sizes = [int(s) for s in args.message_sizes.split(",") if s.strip()]
    only = frozenset(m.strip() for m in args.measures.split(",") if m.strip())
    if args.only_compare:
        bench_compare(args.code, rows, only=only)
        return _report(rows, args.json)
    if args.only_messages:
        bench_messages(message_sizes, rows)
        return _report(rows, args.json)
    bench_search([int(s) for s in args.sizes.split(",")], rows)
    bench_compact([int(s) for s in args.compact_sizes.split(",")], rows)
    bench_knowledge(args.knowledge_size, rows)
    bench_common_words(args.common_size, rows)
    bench_restart(args.restart_size, rows)
    bench_cold_start(rows)
    bench_messages(message_sizes, rows)
    if args.code:
        bench_compare(args.code, rows, only=only)
    return _report(rows, args.json)


def _report(rows: list[Row], as_json: bool) -> int:
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print_table(rows)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
