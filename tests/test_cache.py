"""The semantic cache end to end, one suite run over both backends (SQLite and Redis).

Redis tests skip when no Redis answers, except under CI=true where they fail: CI must
not go green by silently testing only half the backends.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import pytest
import redis
from loguru import logger

from gateway.cache import (
    SHARED_SCOPE,
    CacheBackend,
    CacheContext,
    CacheSettings,
    RedisCacheBackend,
    SemanticCache,
    SqliteCacheBackend,
    backend_from_url,
    digest_messages,
    partition_id,
    session_scope,
)
from gateway.cache.redis_backend import COOLOFF
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.llm.types import LLMMessage, ToolSpec
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.redis_proxy import StallingProxy
from tests.local_redis import REDIS_URL, drop_namespace, require_redis

MODEL = "gpt-test"
SYSTEM = "You are a helpful assistant."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeClock:
    """Epoch seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Store:
    """One place to keep cache entries (a SQLite file or a Redis namespace) that can hand
    out several backend objects over it, as restarts and replicas do."""

    kind: str
    path: Path
    namespace: str
    clock: FakeClock = field(default_factory=FakeClock)
    opened: list[CacheBackend] = field(default_factory=list)

    def backend(self) -> CacheBackend:
        backend: CacheBackend
        if self.kind == "sqlite":
            backend = SqliteCacheBackend(self.path)
        else:
            backend = RedisCacheBackend(REDIS_URL, namespace=self.namespace)
        self.opened.append(backend)
        return backend

    def cache(self, **settings: Any) -> SemanticCache:
        return SemanticCache(self.backend(), CacheSettings(**settings), clock=self.clock)


async def _open_store(kind: str, tmp_path: Path) -> AsyncIterator[Store]:
    if kind == "redis":
        require_redis()
    s = Store(kind, tmp_path / "cache.sqlite3", f"gateway:cache:test:{uuid.uuid4().hex}:")
    yield s
    for backend in s.opened:
        await backend.aclose()
    if kind == "redis":
        drop_namespace(s.namespace)


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async for s in _open_store(str(request.param), tmp_path):
        yield s


@pytest.fixture
async def redis_store(tmp_path: Path) -> AsyncIterator[Store]:
    async for s in _open_store("redis", tmp_path):
        yield s


def fullwidth(text: str) -> str:
    """The same ASCII letters as full-width forms (U+FF21...), which NFKC folds back."""
    return "".join(chr(ord(c) + 0xFEE0) for c in text)


def ctx(query: str, session: str = "telegram:1", **kw: Any) -> CacheContext:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("system_prompt", SYSTEM)
    return CacheContext(query=query, model=kw.pop("model", MODEL), session_key=session, **kw)


def history(*texts: str) -> str | None:
    roles = ("user", "assistant")
    return digest_messages(
        [LLMMessage(role=roles[i % 2], content=t) for i, t in enumerate(texts)]  # type: ignore[arg-type]
    )


# -- who may see an answer ------------------------------------------------------------

pytestmark = pytest.mark.anyio


async def test_standalone_question_is_shared_across_sessions_and_channels(store: Store) -> None:
    cache = store.cache()
    key = await cache.store(ctx("What is the capital of France?", "telegram:1"), "Paris.")
    assert key is not None
    answer = await cache.lookup(ctx("what is the capital of france", "slack:C42:thread:1.5"))
    assert answer is not None
    assert (answer.response, answer.scope, answer.match) == ("Paris.", SHARED_SCOPE, "exact")


async def test_personal_answer_never_reaches_another_session(store: Store) -> None:
    cache = store.cache()
    # Session A's memory says the user is Alice: the answer is private to A.
    a = ctx("What's my name?", "telegram:alice", memory_injected=True)
    assert await cache.store(a, "Your name is Alice.") is not None
    for other in ("telegram:bob", "slack:C1", "cli:direct"):
        assert await cache.lookup(replace(a, session_key=other)) is None
        # Bob without memory asks the same words: a standalone question, still no leak.
        assert await cache.lookup(ctx("What's my name?", other)) is None
    hit = await cache.lookup(a)
    assert hit is not None and hit.scope == session_scope("telegram:alice")


async def test_follow_up_question_depends_on_prior_turns(store: Store) -> None:
    cache = store.cache()
    about_obama = history("Who is Barack Obama?", "The 44th US president.")
    about_biden = history("Who is Joe Biden?", "The 46th US president.")
    asked = ctx("How old is he?", "telegram:1", context_digest=about_obama)
    await cache.store(asked, "He was born in 1961.")

    assert await cache.lookup(replace(asked, context_digest=about_biden)) is None
    assert await cache.lookup(replace(asked, context_digest=None)) is None
    # The same history in another session is still another conversation.
    assert await cache.lookup(replace(asked, session_key="telegram:2")) is None
    assert await cache.lookup(asked) is not None


async def test_group_chat_members_do_not_share_personal_answers(store: Store) -> None:
    cache = store.cache()
    alice = ctx("What's my name?", "telegram:-100", memory_injected=True, sender_id="alice")
    await cache.store(alice, "Alice.")
    assert await cache.lookup(replace(alice, sender_id="bob")) is None
    assert await cache.lookup(alice) is not None


async def test_answers_that_used_tools_are_never_stored(store: Store) -> None:
    cache = store.cache()
    asked = ctx("Send the weekly report to Bob")
    assert await cache.store(replace(asked, tool_calls_made=True), "Sent.") is None
    assert await cache.lookup(asked) is None
    assert (await cache.stats()).entries == 0


async def test_model_system_prompt_and_tools_are_part_of_the_key(store: Store) -> None:
    cache = store.cache()
    tool = ToolSpec("search", "Search the web", {"type": "object", "properties": {}})
    asked = ctx("What is recursion?", tools=(tool,))
    await cache.store(asked, "A function calling itself.")
    assert await cache.lookup(replace(asked, model="other-model")) is None
    assert await cache.lookup(replace(asked, system_prompt="You are a pirate.")) is None
    assert await cache.lookup(replace(asked, tools=())) is None
    changed = ToolSpec("search", "Search the web", {"type": "object", "required": ["q"]})
    assert await cache.lookup(replace(asked, tools=(changed,))) is None
    assert await cache.lookup(asked) is not None


async def test_normalized_queries_hit(store: Store) -> None:
    cache = store.cache()
    await cache.store(ctx("What is   " + fullwidth("Python") + "?"), "A language.")
    for variant in (
        "what is python",
        "  WHAT IS PYTHON?? ",
        "What\tis\npython",
        fullwidth("WHAT") + " is Python",
    ):
        assert await cache.lookup(ctx(variant, "slack:C9")) is not None, variant
    assert await cache.lookup(ctx("what is python 3")) is None


# -- bypass ---------------------------------------------------------------------------


async def test_bypass_rules_neither_store_nor_count(store: Store) -> None:
    cache = store.cache(max_temperature=0.3)
    base = ctx("What is the speed of light?")
    for bypassed in (
        replace(base, streaming=True),
        replace(base, temperature=0.7),
        replace(base, temperature=None),  # the provider default, 1.0
        replace(base, nocache=True),
    ):
        assert await cache.store(bypassed, "299,792 km/s") is None
    assert (await cache.stats()).entries == 0
    await cache.store(base, "299,792 km/s")
    assert await cache.lookup(replace(base, streaming=True)) is None
    assert await cache.lookup(replace(base, temperature=0.31)) is None
    assert await cache.lookup(replace(base, temperature=0.3)) is not None
    stats = await cache.stats()
    assert (stats.hits, stats.misses) == (1, 0)

    disabled = store.cache(enabled=False)
    assert await disabled.lookup(base) is None
    assert await disabled.store(ctx("Another question?"), "x") is None


async def test_oversized_and_empty_responses_are_not_stored(store: Store) -> None:
    cache = store.cache(max_response_bytes=10)
    assert await cache.store(ctx("q1"), "x" * 11) is None
    assert await cache.store(ctx("q2"), "   ") is None
    assert await cache.store(ctx("q3"), "short") is not None


# -- bounds: TTL and LRU --------------------------------------------------------------


async def test_ttl_expiry(store: Store) -> None:
    cache = store.cache(ttl_seconds=60)
    await cache.store(ctx("What is DNS?"), "Names to addresses.")
    store.clock.advance(59)
    assert await cache.lookup(ctx("What is DNS?")) is not None
    store.clock.advance(1)
    assert await cache.lookup(ctx("What is DNS?")) is None
    assert (await cache.stats()).entries == 0


async def test_expired_entries_are_purged_on_put(store: Store) -> None:
    cache = store.cache(ttl_seconds=10)
    for i in range(5):
        await cache.store(ctx(f"old question {i}"), "old")
    store.clock.advance(11)
    await cache.store(ctx("new question"), "new")
    stats = await cache.stats()
    assert stats.entries == 1
    assert stats.bytes == len("new") + len("new question")


async def test_lru_evicts_least_recently_accessed(store: Store) -> None:
    cache = store.cache(max_entries=3)
    for name in ("a", "b", "c"):
        await cache.store(ctx(f"question {name}"), name)
        store.clock.advance(1)
    assert await cache.lookup(ctx("question a")) is not None  # a is now the freshest
    store.clock.advance(1)
    await cache.store(ctx("question d"), "d")
    assert await cache.lookup(ctx("question b")) is None
    for name in ("a", "c", "d"):
        assert await cache.lookup(ctx(f"question {name}")) is not None, name
    assert (await cache.stats()).entries == 3


async def test_rewriting_an_entry_replaces_it(store: Store) -> None:
    cache = store.cache()
    await cache.store(ctx("q"), "first")
    await cache.store(ctx("q"), "second answer")
    answer = await cache.lookup(ctx("q"))
    assert answer is not None and answer.response == "second answer"
    stats = await cache.stats()
    assert (stats.entries, stats.bytes) == (1, len("second answer") + 1)


# -- durability -----------------------------------------------------------------------


async def test_no_put_is_lost_on_restart(store: Store) -> None:
    first = store.cache()
    keys = [await first.store(ctx(f"question {i}"), f"answer {i}") for i in range(20)]
    await first.aclose()
    restarted = store.cache()
    for i, key in enumerate(keys):
        answer = await restarted.lookup(ctx(f"question {i}", "slack:C1"))
        assert answer is not None and (answer.key, answer.response) == (key, f"answer {i}")


# -- invalidation, clear, stats -------------------------------------------------------


async def test_invalidate_by_key_model_session_and_shared(store: Store) -> None:
    cache = store.cache()
    k1 = await cache.store(ctx("q1"), "a1")
    await cache.store(ctx("q2", model="other"), "a2")
    await cache.store(ctx("q3", "telegram:1", memory_injected=True), "a3")
    await cache.store(ctx("q4", "telegram:2", memory_injected=True), "a4")
    await cache.store(ctx("q5"), "a5")
    assert k1 is not None

    assert await cache.invalidate(k1) == 1
    assert await cache.invalidate(k1) == 0
    assert await cache.lookup(ctx("q1")) is None
    assert await cache.invalidate(model="other") == 1
    assert await cache.lookup(ctx("q2", model="other")) is None
    assert await cache.invalidate(session_key="telegram:1") == 1
    assert await cache.lookup(ctx("q3", "telegram:1", memory_injected=True)) is None
    assert await cache.lookup(ctx("q4", "telegram:2", memory_injected=True)) is not None
    assert await cache.invalidate(shared=True) == 1
    assert await cache.lookup(ctx("q5")) is None
    assert (await cache.stats()).entries == 1
    with pytest.raises(ValueError):
        await cache.invalidate()
    with pytest.raises(ValueError):
        await cache.invalidate(k1, model="x")


async def test_clear_and_stats(store: Store) -> None:
    cache = store.cache()
    empty = await cache.stats()
    assert (empty.entries, empty.hits, empty.misses, empty.hit_rate, empty.bytes) == (0, 0, 0, 0, 0)
    await cache.store(ctx("q1"), "abc")
    await cache.store(ctx("q2"), "de")
    await cache.lookup(ctx("q1"))
    await cache.lookup(ctx("q1"))
    await cache.lookup(ctx("q2"))
    await cache.lookup(ctx("unknown"))
    stats = await cache.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.bytes) == (2, 3, 1, 3 + 2 + 2 + 2)
    assert stats.hit_rate == pytest.approx(0.75)
    assert stats.backend == store.kind

    assert await cache.clear() == 2
    after = await cache.stats()
    assert (after.entries, after.bytes, after.hits) == (0, 0, 3)  # counters are monotonic
    assert await cache.lookup(ctx("q1")) is None


async def test_seed_surface_get_and_put(store: Store) -> None:
    cache = store.cache()
    assert await cache.get("Hello there", MODEL) is None
    await cache.put("Hello there", MODEL, "General Kenobi.")
    assert await cache.get("hello   THERE", MODEL) == "General Kenobi."
    assert await cache.get("hello there", "another-model") is None


async def test_shared_queries_lists_live_shared_entries_of_one_partition(store: Store) -> None:
    cache = store.cache(ttl_seconds=100)
    await cache.store(ctx("Old question?"), "a")
    store.clock.advance(50)
    k2 = await cache.store(ctx("New   QUESTION?"), "b")
    await cache.store(ctx("personal", memory_injected=True), "c")
    await cache.store(ctx("other prompt", system_prompt="S2"), "d")
    store.clock.advance(60)  # the first entry has expired
    rows = await cache.backend.shared_queries(partition_id(ctx("x")), now=store.clock())
    assert rows == [(k2, "new question")]


# -- backend specifics ----------------------------------------------------------------


def _write_many(path: str, worker: int, count: int) -> None:
    async def main() -> None:
        cache = SemanticCache(SqliteCacheBackend(path), CacheSettings(max_entries=100_000))
        for i in range(count):
            stored = await cache.store(ctx(f"worker {worker} question {i}"), f"{worker}/{i}")
            assert stored is not None
        await cache.aclose()

    anyio.run(main)


async def test_two_processes_writing_one_sqlite_file_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite3"
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_write_many, args=(str(path), w, 150)) for w in range(2)]
    for p in workers:
        p.start()
    for p in workers:
        await anyio.to_thread.run_sync(p.join, 60)
        assert p.exitcode == 0
    cache = SemanticCache(SqliteCacheBackend(path))
    assert (await cache.stats()).entries == 300
    for w in range(2):
        for i in range(150):
            answer = await cache.lookup(ctx(f"worker {w} question {i}"))
            assert answer is not None and answer.response == f"{w}/{i}"
    await cache.aclose()


async def test_sqlite_file_settings_and_index_use(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    cache = SemanticCache(SqliteCacheBackend(path))
    key = await cache.store(ctx("q"), "a")
    await cache.aclose()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    plans = [
        " ".join(str(c) for c in row)
        for sql in (
            "SELECT response FROM entries WHERE key = ?",
            "SELECT key FROM entries ORDER BY accessed_at, rowid LIMIT 1",
            "DELETE FROM entries WHERE model = ?",
            "DELETE FROM entries WHERE scope = ?",
            "SELECT key FROM entries WHERE expires_at <= ? LIMIT 10",
        )
        for row in conn.execute("EXPLAIN QUERY PLAN " + sql, (key,) * sql.count("?"))
    ]
    conn.close()
    assert plans and all("INDEX" in plan for plan in plans), plans


async def test_an_entry_filed_under_another_scope_is_never_served(tmp_path: Path) -> None:
    """Defence in depth: even if a key matched, a record's scope must be the one the
    asking context may read."""
    path = tmp_path / "c.sqlite3"
    cache = SemanticCache(SqliteCacheBackend(path))
    personal = ctx("What's my name?", memory_injected=True)
    key = await cache.store(personal, "Alice.")
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE entries SET scope = ? WHERE key = ?", ("session:telegram:2", key))
    conn.close()
    assert await cache.lookup(personal) is None
    await cache.aclose()


async def test_unreadable_sqlite_file_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    path.write_bytes(b"this is not a database, just junk" * 100)
    cache = SemanticCache(SqliteCacheBackend(path))
    assert await cache.store(ctx("q"), "a") is not None
    assert await cache.lookup(ctx("q")) is not None
    await cache.aclose()
    moved = [p async for p in anyio.Path(tmp_path).glob("c.sqlite3.broken-*")]
    assert len(moved) == 1


async def test_redis_entries_are_namespaced_with_native_ttl(redis_store: Store) -> None:
    store = redis_store
    cache = store.cache(ttl_seconds=120)
    key = await cache.store(ctx("q"), "a")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        names = [k.decode() for k in client.scan_iter(match=store.namespace + "*")]
        assert names and all(n.startswith(store.namespace) for n in names)
        ttl_ms = client.pttl(f"{store.namespace}e:{key}")
        assert 0 < ttl_ms <= 120_000
        # Another replica's counters are the same counters.
        await cache.lookup(ctx("q"))
        replica = store.cache()
        assert (await replica.stats()).hits == 1
    finally:
        client.close()


async def test_lookup_survives_a_broken_backend(tmp_path: Path) -> None:
    dead = RedisCacheBackend("redis://127.0.0.1:1/0", namespace="gateway:cache:dead:")
    cache = SemanticCache(dead)
    assert await cache.lookup(ctx("q")) is None
    assert await cache.store(ctx("q"), "a") is None
    await cache.aclose()


def test_backend_from_url(tmp_path: Path) -> None:
    assert isinstance(backend_from_url(str(tmp_path / "x.db")), SqliteCacheBackend)
    sqlite_backend = backend_from_url(f"sqlite:///{tmp_path}/y.db")
    assert isinstance(sqlite_backend, SqliteCacheBackend)
    assert sqlite_backend.path == tmp_path / "y.db"
    assert isinstance(backend_from_url("redis://localhost:6379/0"), RedisCacheBackend)


# --------------------------------------------------------------------------- a bad Redis


@pytest.fixture
async def stalling_redis() -> AsyncIterator[StallingProxy]:
    """A proxy to the test Redis that can be made to hang (see tests/fakes/redis_proxy)."""
    require_redis()
    upstream = urlparse(REDIS_URL)
    async with StallingProxy(upstream.port or 6379, upstream.hostname or "127.0.0.1") as proxy:
        yield proxy


@asynccontextmanager
async def warnings_logged() -> AsyncIterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(m.record["message"]), level="WARNING")
    try:
        yield lines
    finally:
        logger.remove(handler)


async def test_a_hanging_redis_is_skipped_after_one_short_wait_then_probed_again(
    stalling_redis: StallingProxy,
) -> None:
    namespace = f"gateway:cache:test:{uuid.uuid4().hex}:"
    breaker_clock = FakeClock()
    backend = RedisCacheBackend(stalling_redis.url, namespace=namespace, clock=breaker_clock)
    cache = SemanticCache(backend, clock=FakeClock())
    question = ctx("What is the speed of light?")
    try:
        async with warnings_logged() as warnings:
            assert await cache.store(question, "299,792 km/s") is not None
            stalling_redis.stalled = True
            started = time.monotonic()
            for n in range(5):  # five turns: lookup, then store
                assert await cache.lookup(question) is None
                assert await cache.store(ctx(f"Question {n}?"), "answer") is None
            waited = time.monotonic() - started
            connections = stalling_redis.connections
            assert await cache.lookup(question) is None
            assert stalling_redis.connections == connections  # skipped: not even connected
            assert backend.breaker.is_open and backend.breaker.skipped >= 10

            stalling_redis.stalled = False  # Redis is back; the cooling-off ends
            breaker_clock.advance(COOLOFF)
            hit = await cache.lookup(question)
        assert waited < 0.6  # one call timeout (0.25 s); every later call skipped at once
        assert hit is not None and hit.response == "299,792 km/s"
        assert not backend.breaker.is_open
        [warning] = warnings  # logged once, with what it means
        assert f"redis cache at 127.0.0.1:{stalling_redis.port} failed" in warning
        assert "skipping it for 30s" in warning and "misses" in warning
    finally:
        await cache.aclose()
        drop_namespace(namespace)


async def test_a_turn_waits_a_fraction_of_a_second_on_a_hanging_redis(
    stalling_redis: StallingProxy,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    namespace = f"gateway:cache:test:{uuid.uuid4().hex}:"
    settings = make_settings(fake_openai, cache__url=stalling_redis.url, cache__namespace=namespace)
    stalling_redis.stalled = True
    gw = Gateway.build(settings)
    turns: list[float] = []
    try:
        for n in range(3):
            started = time.monotonic()
            reply = await gw.agent.handle(
                InboundMessage(channel="telegram", chat_id="1", sender_id="1", text=f"Q{n}?")
            )
            turns.append(time.monotonic() - started)
            assert reply.text == f"echo: Q{n}?"
    finally:
        await gw.aclose()
        drop_namespace(namespace)
    assert turns[0] < 1.0 and max(turns[1:]) < 0.5, turns


async def test_a_probe_cancelled_midway_lets_the_next_call_probe(
    stalling_redis: StallingProxy,
) -> None:
    namespace = f"gateway:cache:test:{uuid.uuid4().hex}:"
    breaker_clock = FakeClock()
    backend = RedisCacheBackend(stalling_redis.url, namespace=namespace, clock=breaker_clock)
    cache = SemanticCache(backend, clock=FakeClock())
    question = ctx("What is the boiling point of water?")
    try:
        assert await cache.store(question, "100 °C at sea level") is not None
        stalling_redis.stalled = True
        assert await cache.lookup(question) is None  # fails: the breaker opens
        breaker_clock.advance(COOLOFF)
        with anyio.move_on_after(0.05):  # the turn is cancelled while its probe waits
            await cache.lookup(question)
        stalling_redis.stalled = False
        hit = await cache.lookup(question)  # probes again instead of skipping for good
        assert hit is not None and hit.response == "100 °C at sea level"
    finally:
        await cache.aclose()
        drop_namespace(namespace)
