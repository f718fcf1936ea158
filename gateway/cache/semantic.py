"""The semantic cache the agent loop talks to: policy, keys, a backend, optional near-dups.

The promise kept here, with `policy.cache_policy` and `policy.cache_key`: **an answer
is never served to a session it would be wrong or private for.** `lookup` only reads
the one key the policy allows for this context, and rejects a record whose scope is not
the scope that context may read; `store` files an answer as shared only when the policy
calls the question standalone, and never stores an answer that involved tool calls.

The cache is an optimisation: `lookup` and `store` log and swallow backend failures
(a broken cache means misses, never a failed turn; a backend that says it is
unavailable, `CacheUnavailable`, has logged that itself and is not logged again per
turn). Administrative calls (`invalidate`, `clear`, `stats`) raise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from loguru import logger

if TYPE_CHECKING:
    from loguru import Logger

from gateway.cache.backend import CacheBackend, CacheRecord, CacheUnavailable
from gateway.cache.neardup import NearDuplicateIndex, near_duplicate_embedder
from gateway.cache.policy import (
    SHARED_SCOPE,
    CacheContext,
    CacheMode,
    CacheSettings,
    Decision,
    cache_key,
    cache_policy,
    normalize_query,
    partition_id,
    session_scope,
)


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """A hit: the stored response and where it came from.

    `key` identifies the entry (for `invalidate(key)`, e.g. after a thumbs-down);
    `match` is "near" when the near-duplicate layer mapped the question onto a stored
    one, with the cosine `similarity` it scored.
    """

    response: str
    key: str
    scope: str
    created_at: float
    age_seconds: float
    match: Literal["exact", "near"] = "exact"
    similarity: float = 1.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters for metrics. Lookups the policy bypassed are not counted. The counters
    are shared by every process using the backend (Redis: live; SQLite: as of each
    process's last `stats` call or close), so aggregate replicas with max(), not sum()."""

    entries: int
    hits: int
    misses: int
    hit_rate: float
    bytes: int
    backend: str


class SemanticCache:
    """Response cache keyed by everything that makes an answer valid (see module doc)."""

    def __init__(
        self,
        backend: CacheBackend,
        settings: CacheSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        near_duplicates: NearDuplicateIndex | None = None,
    ) -> None:
        self.backend = backend
        self.settings = settings or CacheSettings()
        self._clock = clock
        self._near: NearDuplicateIndex | None = None
        if self.settings.near_duplicates:
            self._near = near_duplicates or NearDuplicateIndex(
                near_duplicate_embedder(self.settings.near_duplicate_model),
                threshold=self.settings.near_duplicate_cutoff,
            )

    async def __aenter__(self) -> SemanticCache:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def decide(self, ctx: CacheContext) -> Decision:
        """The policy's verdict for `ctx` under this cache's settings."""
        return cache_policy(ctx, self.settings)

    # -- the agent loop's API -----------------------------------------------------

    async def lookup(self, ctx: CacheContext) -> CachedAnswer | None:
        """The stored answer valid for `ctx`, or None (miss, bypass or backend failure)."""
        decision = self.decide(ctx)
        if not decision.cacheable:
            self._log(ctx).debug("cache bypass: {}", decision.reason)
            return None
        try:
            answer = await self._lookup(ctx, decision)
            await self.backend.record_lookup(hit=answer is not None)
        except CacheUnavailable as exc:
            self._log(ctx).debug("cache lookup skipped, a miss: {}", exc)
            return None
        except Exception as exc:
            self._log(ctx).warning(
                "cache lookup failed, treating as a miss: {}: {}", type(exc).__name__, exc
            )
            return None
        if answer is not None:
            self._log(ctx).debug(
                "cache {} hit {:.12} ({})", answer.match, answer.key, decision.mode.value
            )
        return answer

    @staticmethod
    def _log(ctx: CacheContext) -> Logger:
        return logger.bind(session_key=ctx.session_key)

    async def _lookup(self, ctx: CacheContext, decision: Decision) -> CachedAnswer | None:
        now = self._clock()
        key = cache_key(ctx, decision)
        record = await self.backend.get(key, now=now)
        if record is not None:
            return self._answer(record, decision, now, "exact", 1.0)
        if decision.mode is not CacheMode.SHARED or self._near is None:
            return None
        partition = partition_id(ctx)
        match = await self._near.find(
            partition,
            normalize_query(ctx.query),
            lambda: self.backend.shared_queries(partition, now=now),
        )
        if match is None:
            return None
        record = await self.backend.get(match.key, now=now)
        if record is None or record.partition != partition:
            self._near.discard(match.key)
            return None
        return self._answer(record, decision, now, "near", match.similarity)

    @staticmethod
    def _answer(
        record: CacheRecord,
        decision: Decision,
        now: float,
        match: Literal["exact", "near"],
        similarity: float,
    ) -> CachedAnswer | None:
        if record.scope != decision.scope:
            # Unreachable unless SHA-256 collides or the store was edited by hand; the
            # check is cheap and keeps the invariant independent of the key function.
            logger.error(
                "cache entry {:.12} has scope {!r}; refusing to serve it", record.key, record.scope
            )
            return None
        return CachedAnswer(
            response=record.response,
            key=record.key,
            scope=record.scope,
            created_at=record.created_at,
            age_seconds=max(0.0, now - record.created_at),
            match=match,
            similarity=similarity,
        )

    async def store(self, ctx: CacheContext, response: str) -> str | None:
        """Store `response` as the answer for `ctx` if the policy allows; return its key.

        Pass the context as it stands after the turn: `tool_calls_made=True` if the
        model called any tool (such answers are not stored).
        """
        decision = self.decide(ctx)
        log = logger.bind(session_key=ctx.session_key)
        if not decision.cacheable:
            log.debug("cache store skipped: {}", decision.reason)
            return None
        if not response.strip():
            return None
        if len(response.encode("utf-8")) > self.settings.max_response_bytes:
            log.debug(
                "cache store skipped: response over {} bytes", self.settings.max_response_bytes
            )
            return None
        try:
            now = self._clock()
            key = cache_key(ctx, decision)
            partition = partition_id(ctx)
            shared = decision.mode is CacheMode.SHARED
            query = normalize_query(ctx.query)
            record = CacheRecord(
                key=key,
                response=response,
                model=ctx.model,
                scope=decision.scope,
                partition=partition,
                query=query if shared else "",
                created_at=now,
                expires_at=now + self.settings.ttl_seconds,
            )
            removed = await self.backend.put(record, now=now, max_entries=self.settings.max_entries)
            if shared and self._near is not None:
                await self._near.add(partition, key, query)
        except CacheUnavailable as exc:
            log.debug("cache store skipped: {}", exc)
            return None
        except Exception as exc:
            log.warning("cache store failed: {}: {}", type(exc).__name__, exc)
            return None
        log.debug("cache stored {:.12} ({}, {} evicted)", key, decision.mode.value, removed)
        return key

    # -- the seed's surface: standalone questions ------------------------------------

    async def get(self, message: str, model: str) -> str | None:
        """The shared answer to a standalone `message` (no system prompt, tools, history)."""
        answer = await self.lookup(_standalone(message, model))
        return None if answer is None else answer.response

    async def put(self, message: str, model: str, response: str) -> None:
        """Store the answer to a standalone `message` (see `get`)."""
        await self.store(_standalone(message, model), response)

    # -- administration ---------------------------------------------------------------

    async def invalidate(
        self,
        key: str | None = None,
        *,
        model: str | None = None,
        session_key: str | None = None,
        shared: bool = False,
    ) -> int:
        """Drop one entry by key, all entries of a model, all entries scoped to one
        session, or all shared entries (exactly one selector); return how many went."""
        chosen = [key is not None, model is not None, session_key is not None, shared]
        if sum(chosen) != 1:
            raise ValueError("invalidate takes exactly one of key, model, session_key, shared")
        if key is not None:
            removed = int(await self.backend.delete(key))
            if self._near is not None:
                self._near.discard(key)
        else:
            if model is not None:
                removed = await self.backend.delete_model(model)
            elif session_key is not None:
                removed = await self.backend.delete_scope(session_scope(session_key))
            else:
                removed = await self.backend.delete_scope(SHARED_SCOPE)
            if self._near is not None and (model is not None or shared):
                self._near.reset()
        logger.info("cache invalidated {} entries", removed)
        return removed

    async def clear(self) -> int:
        """Remove every entry; lookup counters are kept."""
        removed = await self.backend.clear()
        if self._near is not None:
            self._near.reset()
        logger.info("cache cleared ({} entries)", removed)
        return removed

    async def stats(self) -> CacheStats:
        counts = await self.backend.counts(now=self._clock())
        lookups = counts.hits + counts.misses
        return CacheStats(
            entries=counts.entries,
            hits=counts.hits,
            misses=counts.misses,
            hit_rate=counts.hits / lookups if lookups else 0.0,
            bytes=counts.bytes,
            backend=self.backend.name,
        )

    async def check(self) -> None:
        """Raise `CacheUnavailable` (saying what to do) unless the backend can be used."""
        await self.backend.check()

    async def aclose(self) -> None:
        await self.backend.aclose()


def _standalone(message: str, model: str) -> CacheContext:
    return CacheContext(query=message, model=model, temperature=0.0)


def backend_from_url(
    url: str, *, namespace: str | None = None, io_on_loop: bool = True
) -> CacheBackend:
    """`redis://`, `rediss://` or `unix://` URLs give a Redis backend; anything else a
    SQLite file: a path, or `sqlite:///relative/path`, `sqlite:////absolute/path`."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.cache.redis_backend import DEFAULT_NAMESPACE, RedisCacheBackend

        return RedisCacheBackend(url, namespace=namespace or DEFAULT_NAMESPACE)
    from gateway.cache.sqlite_backend import SqliteCacheBackend

    path = url.removeprefix("sqlite:///")
    return SqliteCacheBackend(Path(path), io_on_loop=io_on_loop)
