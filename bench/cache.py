"""Benchmark of the semantic cache: lookup/store latency per backend and size, and the
quality and lookup cost of the optional near-duplicate layer on public question pairs
(tests/public_pairs.py: a tuning part and the held-out part its targets are judged on)
and on tests/data/cache_pairs.json.

    .venv/bin/python bench/cache.py                  # a table
    .venv/bin/python bench/cache.py --json           # the same rows as JSON
    .venv/bin/python bench/cache.py --only-neardup   # the near-duplicate rows alone

The layer as shipped (MiniLM, thresholds kept under `near_duplicate_max_error`), its
hit rate on an FAQ-like stream and its CPU per turn: bench/cache_verified.py.

Latencies are measured through `SemanticCache.lookup/store` (policy, key hashing, the
backend round trip, and SQLite's worker-thread hop), which is what a turn pays. Each
store at full size also evicts one entry, as it would in a full cache. A Redis row is
skipped with a note when Redis does not answer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from loguru import logger  # noqa: E402

from gateway.cache import (  # noqa: E402
    CacheBackend,
    CacheContext,
    CacheSettings,
    NearDuplicateIndex,
    RedisCacheBackend,
    SemanticCache,
    SqliteCacheBackend,
    WordLlamaEmbedder,
    near_duplicates_available,
)
from gateway.cache.neardup import DEFAULT_THRESHOLD, PairScores, score_pairs  # noqa: E402
from tests.public_pairs import public_pairs, public_pairs_available  # noqa: E402

PAIRS_FILE = ROOT / "tests" / "data" / "cache_pairs.json"
HIT_TARGET_MS = {"sqlite": 0.5, "redis": 1.0}
# A wrong near-duplicate hit answers a question nobody asked: precision is the promise.
PRECISION_TARGET = 0.98
RECALL_TARGET = 0.25
SYSTEM_PROMPT = "You are a helpful assistant. " * 40  # a realistic ~1 KB system prompt
RESPONSE = "A typical answer of a few sentences. " * 20  # ~700 bytes


@dataclass
class Row:
    section: str
    backend: str
    entries: int | None
    metric: str
    median_ms: float | None = None
    p99_ms: float | None = None
    value: float | None = None
    target: str = ""
    ok: bool | None = None
    note: str = ""


def _ctx(i: int | str) -> CacheContext:
    return CacheContext(
        query=f"benchmark question number {i}?",
        model="bench-model",
        temperature=0.0,
        session_key="cli:bench",
        system_prompt=SYSTEM_PROMPT,
    )


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    ms = sorted(s / 1e6 for s in samples_ns)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return statistics.median(ms), p99


async def _redis_backend(url: str, namespace: str) -> RedisCacheBackend | None:
    backend = RedisCacheBackend(url, namespace=namespace)
    try:
        with anyio.fail_after(2):
            await backend.check()
    except Exception as exc:
        logger.debug("redis unreachable: {}", exc)
        await backend.aclose()
        return None
    return backend


async def _fill(cache: SemanticCache, size: int, concurrency: int) -> None:
    async def worker(start: int) -> None:
        for i in range(start, size, concurrency):
            await cache.store(_ctx(i), RESPONSE)

    async with anyio.create_task_group() as tg:
        for w in range(concurrency):
            tg.start_soon(worker, w)


async def bench_backend(kind: str, size: int, samples: int, redis_url: str) -> list[Row]:
    """Hit, miss and store latency with `size` entries in the cache."""
    namespace = f"gateway:cache:bench:{uuid.uuid4().hex}:"
    with tempfile.TemporaryDirectory() as tmp:
        backend: CacheBackend | None
        if kind == "sqlite":
            backend = SqliteCacheBackend(Path(tmp) / "bench.sqlite3")
        else:
            backend = await _redis_backend(redis_url, namespace)
            if backend is None:
                return [Row("latency", kind, size, "hit", note=f"skipped: no Redis at {redis_url}")]
        cache = SemanticCache(backend, CacheSettings(max_entries=size))
        try:
            started = time.perf_counter()
            await _fill(cache, size, concurrency=1 if kind == "sqlite" else 16)
            fill_s = time.perf_counter() - started
            rng = random.Random(7)
            hits: list[int] = []
            for i in rng.sample(range(size), min(samples, size)):
                t0 = time.perf_counter_ns()
                answer = await cache.lookup(_ctx(i))
                hits.append(time.perf_counter_ns() - t0)
                assert answer is not None, "benchmark entry missing"
            misses: list[int] = []
            for i in range(samples):
                t0 = time.perf_counter_ns()
                await cache.lookup(_ctx(f"absent {i}"))
                misses.append(time.perf_counter_ns() - t0)
            puts: list[int] = []
            for i in range(samples):
                t0 = time.perf_counter_ns()
                await cache.store(_ctx(f"new {i}"), RESPONSE)
                puts.append(time.perf_counter_ns() - t0)
            entries = (await cache.stats()).entries
        finally:
            if kind == "redis":
                await cache.clear()
                await backend.aclose()
                await _drop_namespace(redis_url, namespace)
            else:
                await cache.aclose()

    target = HIT_TARGET_MS[kind]
    hit_median, hit_p99 = _percentiles(hits)
    rows = [
        Row(
            "latency",
            kind,
            size,
            "hit",
            hit_median,
            hit_p99,
            target=f"median < {target} ms",
            ok=hit_median < target,
            note=f"filled in {fill_s:.1f} s",
        ),
        Row("latency", kind, size, "miss", *_percentiles(misses)),
        Row(
            "latency",
            kind,
            size,
            "put (evicts 1)",
            *_percentiles(puts),
            note=f"{entries} entries after",
        ),
    ]
    return rows


async def _drop_namespace(url: str, namespace: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=namespace + "*", count=1000)]
        for i in range(0, len(keys), 1000):
            await client.delete(*keys[i : i + 1000])
    finally:
        await client.aclose()


def _near_dup_rows(label: str, s: PairScores, targets: bool) -> list[Row]:
    """Quality and lookup cost of one scored set; `targets` marks the set the promise is
    judged on (the public held-out part)."""
    rows = [
        Row(
            "near-dup",
            label,
            None,
            "precision",
            value=s.precision,
            target=f">= {PRECISION_TARGET}" if targets else "",
            ok=s.precision >= PRECISION_TARGET if targets else None,
            note=f"{s.true_hits} right, {s.false_hits} wrong hits",
        ),
        Row(
            "near-dup",
            label,
            None,
            "recall",
            value=s.recall,
            target=f">= {RECALL_TARGET}" if targets else "",
            ok=s.recall >= RECALL_TARGET if targets else None,
            note=f"of {s.positives} same-answer pairs",
        ),
        Row(
            "near-dup",
            label,
            None,
            "near-miss false hits",
            value=s.near_miss_false_hits,
            note=f"of {s.pairs - s.positives} hard negatives",
        ),
        Row(
            "near-dup",
            label,
            None,
            "lookup (embed+search+guard)",
            s.lookup_p50_ms,
            s.lookup_p99_ms,
            note=f"mean {s.lookup_ms:.3f} ms",
        ),
    ]
    return rows


async def bench_near_duplicates() -> list[Row]:
    """Precision, recall, false hits and lookup cost of the near-duplicate layer at the
    shipped threshold with the guard: on the public pairs (tuning part, and the held-out
    part the targets are judged on) and on the project's own labelled set."""
    if not near_duplicates_available():
        return [Row("near-dup", "-", None, "quality", note="skipped: cache-neardup not installed")]
    embedder = WordLlamaEmbedder()
    started = time.perf_counter()
    embedder.embed(["warm up"])
    load_ms = (time.perf_counter() - started) * 1000
    samples: list[int] = []
    for _ in range(1000):
        t0 = time.perf_counter_ns()
        embedder.embed(["how do I reset my password on the website?"])
        samples.append(time.perf_counter_ns() - t0)
    rows = [
        Row(
            "near-dup",
            "wordllama",
            None,
            "embed one query",
            *_percentiles(samples),
            note=f"model load {load_ms:.0f} ms",
        )
    ]

    sets: list[tuple[str, list[tuple[str, str, bool]], bool]] = []
    if public_pairs_available():
        for part in ("tune", "held-out"):
            sets.append((f"public {part}", public_pairs(part), part == "held-out"))
    else:
        rows.append(Row("near-dup", "public", None, "quality", note="skipped: fow-cache missing"))
    own = json.loads(PAIRS_FILE.read_text(encoding="utf-8"))["pairs"]
    for split in ("dev", "holdout"):
        pairs = [(p["a"], p["b"], p["same"]) for p in own if p["split"] == split]
        sets.append((f"own {split}", pairs, False))
    for name, pairs, targets in sets:
        s = await score_pairs(NearDuplicateIndex(embedder, threshold=DEFAULT_THRESHOLD), pairs)
        label = f"{name} ({s.pairs} pairs)"
        rows += _near_dup_rows(label, s, targets)
    if sets:
        name, pairs, _ = sets[1] if public_pairs_available() else sets[0]
        unguarded = await score_pairs(
            NearDuplicateIndex(embedder, threshold=DEFAULT_THRESHOLD, use_guard=False), pairs
        )
        rows.append(
            Row(
                "near-dup",
                f"{name}, threshold only, no guard",
                None,
                "precision",
                value=unguarded.precision,
                note=f"recall {unguarded.recall:.3f}; why the guard exists",
            )
        )
    return rows


def _file_create_floor_ms(folder: str, count: int = 200) -> float:
    """Median cost of creating and writing one small file in `folder`: the floor of any
    turn that opens a new session, since its first line must be on disk first."""
    samples = []
    for i in range(count):
        start = time.perf_counter_ns()
        fd = os.open(
            os.path.join(folder, f"floor-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600
        )
        os.write(fd, b"x" * 300 + b"\n")
        os.close(fd)
        samples.append(time.perf_counter_ns() - start)
    return _percentiles(samples)[0]


async def bench_agent_loop_turns(turns: int = 200, workdir: str | None = None) -> list[Row]:
    """Hit vs miss turn latency through the real agent loop: the real openai client and
    the fake OpenAI server on 127.0.0.1, sessions and the SQLite cache in a temp dir.

    A miss is a new standalone question (one round trip to the fake server); a hit is a
    question already answered, asked from a new session (shared entry). Both persist the
    user message and the reply, so the difference is the LLM call the cache saves.
    """
    from gateway.config import load_settings
    from gateway.daemon import Gateway
    from gateway.messages import InboundMessage
    from tests.fakes.openai_server import FakeOpenAI

    async def timed(gw: Gateway, text: str, chat: str) -> tuple[float, bool]:
        start = time.perf_counter()
        reply = await gw.agent.handle(
            InboundMessage(channel="bench", chat_id=chat, sender_id=chat, text=text)
        )
        return (time.perf_counter() - start) * 1000, bool(reply.metadata.get("cached"))

    async with FakeOpenAI() as fake:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            floor = _file_create_floor_ms(tmp)
            env = {
                "OPENAI_BASE_URL": fake.base_url,
                "OPENAI_API_KEY": fake.api_key or "",
                "GATEWAY_WORKSPACE": tmp,
                "GATEWAY_SESSIONS__FSYNC": "never",
                "GATEWAY_LLM__MAX_RETRIES": "0",
            }
            gw = Gateway.build(load_settings(None, environ=env))
            try:
                misses = [await timed(gw, f"question {i}?", f"m{i}") for i in range(turns)]
                hits = [await timed(gw, f"question {i}?", f"h{i}") for i in range(turns)]
            finally:
                await gw.aclose()
    if not all(hit for _, hit in hits) or any(hit for _, hit in misses):
        return [Row("agent loop", "sqlite", turns, "turn hit vs miss", note="unexpected hits")]
    miss_med, miss_p99 = _percentiles([int(ms * 1e6) for ms, _ in misses])
    hit_med, hit_p99 = _percentiles([int(ms * 1e6) for ms, _ in hits])
    speedup = miss_med / hit_med
    beyond_floor = (miss_med - floor) / max(hit_med - floor, 1e-3)
    return [
        Row("agent loop", "sqlite", turns, "turn, cache miss (fake LLM)", miss_med, miss_p99),
        Row("agent loop", "sqlite", turns, "turn, cache hit", hit_med, hit_p99),
        Row(
            "agent loop",
            "sqlite",
            turns,
            "speed-up hit vs miss",
            value=speedup,
            target=">= 10x",
            ok=speedup >= 10,
        ),
        Row(
            "agent loop",
            "disk",
            None,
            "floor: create one session file",
            floor,
            note="every turn of a new session pays it",
        ),
        Row(
            "agent loop",
            "sqlite",
            turns,
            "speed-up above that floor",
            value=beyond_floor,
            note="(miss - floor) / (hit - floor)",
        ),
    ]


async def run(args: argparse.Namespace) -> list[Row]:
    if args.only_neardup:
        return await bench_near_duplicates()
    rows: list[Row] = []
    for size in args.sizes:
        for kind in ("sqlite", "redis"):
            rows += await bench_backend(kind, size, args.samples, args.redis_url)
    if not args.skip_neardup:
        rows += await bench_near_duplicates()
    rows += await bench_agent_loop_turns(workdir=args.dir)
    return rows


def _fmt(value: float | int | None, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def print_table(rows: list[Row]) -> None:
    header = (
        "section",
        "backend/set",
        "entries",
        "metric",
        "median ms",
        "p99 ms",
        "value",
        "target",
        "pass",
        "note",
    )
    table = [header] + [
        (
            r.section,
            r.backend,
            _fmt(r.entries),
            r.metric,
            _fmt(r.median_ms),
            _fmt(r.p99_ms),
            _fmt(r.value),
            r.target,
            "" if r.ok is None else ("PASS" if r.ok else "FAIL"),
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for n, line in enumerate(table):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[500, 50_000]
    )
    parser.add_argument("--samples", type=int, default=2000, help="timed operations per row")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--skip-neardup", action="store_true")
    parser.add_argument("--only-neardup", action="store_true", help="near-duplicate rows only")
    parser.add_argument(
        "--dir", default=None, help="folder for the agent-loop workspace (default: system temp)"
    )
    args = parser.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    rows = anyio.run(run, args)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print_table(rows)
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
