"""The semantic cache the agent loop talks to: policy, keys, a backend, optional near-dups.

The promise kept here, with `policy.cache_policy` and `policy.cache_key`: **an answer
is never served to a session it would be wrong or private for.** `lookup` only reads
the one key the policy allows for this context, and rejects a record whose scope is not
the scope that context may read; `store` files an answer as shared only when the policy
calls the question standalone, and never stores an answer that involved tool calls.

The near-duplicate layer (on when its model is installed) serves a paraphrase only at
or above its entry's threshold (gateway/cache/verified.py); a candidate below it is a
miss, and `store` compares the model's answer with the candidate's to label the entry.
`lookup` takes the turn's question vector (`embed_query`) so a turn embeds it once.

The cache is an optimisation: `lookup` and `store` log and swallow backend failures
(a broken cache means misses, never a failed turn; a backend that says it is
unavailable, `CacheUnavailable`, has logged that itself and is not logged again per
turn). Administrative calls (`invalidate`, `clear`, `stats`) raise.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream
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
from gateway.cache.verified import Observation, Verdict, verdict

#: Near-duplicate candidates awaiting the model's answer for a label, at most.
MAX_PENDING_LABELS = 1024


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


#: Labels waiting for `SemanticCache.run` at most.
LABELS_WAITING = 256


@dataclass(frozen=True, slots=True)
class _PendingLabel:
    """A candidate not served: labelled when the model's answer to the turn is stored."""

    partition: str
    key: str
    similarity: float


@dataclass(slots=True)
class NearDuplicateCounts:
    """This process's near-duplicate lookups (sum them over replicas): `hits` served,
    `explorations` candidates below their threshold answered by the model, `audits`
    servable ones answered by the model, `labels_correct`/`labels_wrong` what the
    comparisons of answers found."""

    hits: int = 0
    explorations: int = 0
    audits: int = 0
    labels_correct: int = 0
    labels_wrong: int = 0


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
        self._servable = 0
        self._near: NearDuplicateIndex | None = None
        self._pending: OrderedDict[tuple[str, str, str], _PendingLabel] = OrderedDict()
        #: Labels waiting for `run` (comparing two answers embeds both, ~10 ms: never on
        #: a turn); None while no `run` takes them, and `store` labels in place.
        self._labels: MemoryObjectSendStream[tuple[_PendingLabel, str]] | None = None
        self.labels_dropped = 0
        self.near_counts = NearDuplicateCounts()
        if self.settings.near_duplicates:
            self._near = near_duplicates or NearDuplicateIndex(
                near_duplicate_embedder(self.settings.near_duplicate_model),
                threshold=self.settings.near_duplicate_floor,
                prior=self.settings.near_duplicate_cutoff,
                max_error=self.settings.near_duplicate_max_error,
            )

    async def warm_up(self) -> None:
        """Get the near-duplicate layer's model ready (the daemon's start, `gateway
        doctor`); a failure is logged, and turns load it later."""
        if self._near is None:
            return
        started = time.perf_counter()
        try:
            await self._near.warm_up()
        except Exception as exc:
            logger.warning(
                "cache: near-duplicate model not loaded: {}: {}", type(exc).__name__, exc
            )
            return
        logger.debug("cache: near-duplicate model ready in {:.1f} s", time.perf_counter() - started)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Label explored candidates in the background until cancelled (the daemon's
        services): `store` hands them over and returns, so a turn that explored pays
        none of the comparison. At most `LABELS_WAITING` wait; past that a label is
        dropped (counted): a label is evidence, and one fewer only keeps a threshold
        where it is."""
        send, receive = anyio.create_memory_object_stream[tuple[_PendingLabel, str]](LABELS_WAITING)
        self._labels = send
        task_status.started()
        try:
            async with receive:
                async for pending, response in receive:
                    try:
                        await self._record_label(pending, response)
                    except Exception as exc:
                        logger.warning(
                            "near-duplicate label failed: {}: {}", type(exc).__name__, exc
                        )
        finally:
            self._labels = None
            send.close()

    @property
    def near_duplicates_on(self) -> bool:
        """Whether the near-duplicate layer runs (its model is there and it is on)."""
        return self._near is not None

    async def embed_query(self, query: str) -> object | None:
        """The vector of `query` as the near-duplicate layer reads it (normalized), in a
        worker thread; None without the layer. A turn computes it once, for the cache
        lookup (`lookup(query_vector=...)`) and the memory recall."""
        if self._near is None:
            return None
        if not self._near.ready:
            self._near.load_in_background()
            return None  # no turn waits for the model
        return await self._near.embed_query(normalize_query(query))

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

    async def lookup(
        self, ctx: CacheContext, *, query_vector: object | None = None
    ) -> CachedAnswer | None:
        """The stored answer valid for `ctx`, or None (miss, bypass or backend failure).
        `query_vector`: `embed_query(ctx.query)` when the turn has it already."""
        decision = self.decide(ctx)
        if not decision.cacheable:
            self._log(ctx).debug("cache bypass: {}", decision.reason)
            return None
        try:
            answer = await self._lookup(ctx, decision, query_vector)
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

    async def _lookup(
        self, ctx: CacheContext, decision: Decision, query_vector: object | None
    ) -> CachedAnswer | None:
        now = self._clock()
        key = cache_key(ctx, decision)
        record = await self.backend.get(key, now=now)
        if record is not None:
            return self._answer(record, decision, now, "exact", 1.0)
        if decision.mode is not CacheMode.SHARED or self._near is None:
            return None
        if not self._near.ready:
            self._near.load_in_background()
            return None  # exact questions only until the model is loaded: no turn waits
        partition = partition_id(ctx)
        query = normalize_query(ctx.query)
        match = await self._near.find(
            partition,
            query,
            lambda: self.backend.shared_queries(partition, now=now),
            vector=query_vector,
            load_observations=lambda: self.backend.partition_observations(partition, now=now),
        )
        if match is None:
            return None
        record = await self.backend.get(match.key, now=now)
        if record is None or record.partition != partition:
            self._near.discard(match.key)
            return None
        self._servable += match.similarity >= match.threshold
        chosen = verdict(
            match.similarity,
            match.threshold,
            servable_seen=self._servable,
            audit_rate=self.settings.near_duplicate_audit_rate,
        )
        if chosen is Verdict.SERVE:
            self.near_counts.hits += 1
            return self._answer(record, decision, now, "near", match.similarity)
        if chosen is Verdict.AUDIT:
            self.near_counts.audits += 1
        else:
            self.near_counts.explorations += 1
        self._log(ctx).debug(
            "near-duplicate {:.12} not served ({}): similarity {:.3f}, threshold {:.3f}",
            match.key,
            chosen.value,
            match.similarity,
            match.threshold,
        )
        tag = (ctx.session_key, partition, query)
        # The candidate's answer is read again when labelled: a pending label holds no
        # response (a thousand of them would otherwise hold up to 256 MB).
        self._pending[tag] = _PendingLabel(partition, match.key, match.similarity)
        self._pending.move_to_end(tag)
        while len(self._pending) > MAX_PENDING_LABELS:
            self._pending.popitem(last=False)
        return None

    async def _label(self, ctx: CacheContext, response: str) -> bool | None:
        """Whether the candidate this turn's lookup did not serve had the right answer
        (the model's `response`), recorded on its entry; None when there was none. A
        turn that called tools gives no label: its answer is not the stored kind."""
        if self._near is None:
            return None
        pending = self._pending.pop(
            (ctx.session_key, partition_id(ctx), normalize_query(ctx.query)), None
        )
        if pending is None or ctx.tool_calls_made or not response.strip():
            return None
        if self._labels is not None:
            try:
                self._labels.send_nowait((pending, response))
            except anyio.WouldBlock:
                self.labels_dropped += 1
                logger.debug("near-duplicate label dropped: {} waiting", LABELS_WAITING)
            return None  # known later; meanwhile the answer is indexed as its own
        return await self._record_label(pending, response)

    async def _record_label(self, pending: _PendingLabel, response: str) -> bool | None:
        """Compare the model's `response` with the candidate's stored answer and record
        the outcome on the candidate's entry; None when the entry is gone."""
        assert self._near is not None
        stored = await self.backend.get(pending.key, now=self._clock())
        if stored is None:
            return None  # gone meanwhile: its labels went with it
        correct = await self._near.answers_agree(
            response, stored.response, agreement=self.settings.near_duplicate_answer_agreement
        )
        await self.backend.add_observation(
            pending.key, pending.similarity, correct, now=self._clock()
        )
        self._near.observe(pending.partition, pending.key, Observation(pending.similarity, correct))
        if correct:
            self.near_counts.labels_correct += 1
        else:
            self.near_counts.labels_wrong += 1
        return correct

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

    async def store(
        self, ctx: CacheContext, response: str, *, query_vector: Any = None
    ) -> str | None:
        """Store `response` as the answer for `ctx` if the policy allows; return its key.

        Pass the context as it stands after the turn: `tool_calls_made=True` if the
        model called any tool (such answers are not stored). `query_vector`: the turn's
        `embed_query(ctx.query)`, so the question is not embedded twice.
        """
        decision = self.decide(ctx)
        log = logger.bind(session_key=ctx.session_key)
        try:
            agreed = await self._label(ctx, response)
        except CacheUnavailable as exc:
            log.debug("near-duplicate label not recorded: {}", exc)
            agreed = None
        except Exception as exc:
            log.warning("near-duplicate label failed: {}: {}", type(exc).__name__, exc)
            agreed = None
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
            # A paraphrase whose answer matched its candidate's is found through that
            # entry: it is stored for exact repeats, not indexed as a question of its own.
            indexed = shared and not agreed
            query = normalize_query(ctx.query)
            record = CacheRecord(
                key=key,
                response=response,
                model=ctx.model,
                scope=decision.scope,
                partition=partition,
                query=query if indexed else "",
                created_at=now,
                expires_at=now + self.settings.ttl_seconds,
            )
            removed = await self.backend.put(record, now=now, max_entries=self.settings.max_entries)
            if indexed and self._near is not None and self._near.ready:
                await self._near.add(partition, key, query, vector=query_vector)
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
