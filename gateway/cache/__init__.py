"""Semantic response cache: a pure policy, SQLite and Redis backends, optional near-dups.

The agent loop builds a `CacheContext` for each turn, calls `SemanticCache.lookup(ctx)`
before the LLM and `SemanticCache.store(ctx, reply)` after it. See `policy` for the
rules that keep answers inside the sessions they are valid for.

The names are imported on first use: a gateway with the SQLite cache does not load the
Redis client.
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from gateway.cache.backend import BackendCounts, CacheBackend, CacheRecord, CacheUnavailable
    from gateway.cache.guard import guard_conflict
    from gateway.cache.neardup import (
        EXTRA_NAME,
        NearDuplicateIndex,
        NearDuplicateUnavailable,
        NearMatch,
        WordLlamaEmbedder,
        near_duplicates_available,
    )
    from gateway.cache.policy import (
        SHARED_SCOPE,
        CacheContext,
        CacheMode,
        CacheSettings,
        Decision,
        cache_key,
        cache_policy,
        digest_messages,
        fingerprint_system_prompt,
        fingerprint_tools,
        normalize_query,
        partition_id,
        session_scope,
        strip_nocache,
    )
    from gateway.cache.redis_backend import RedisCacheBackend
    from gateway.cache.semantic import CachedAnswer, CacheStats, SemanticCache, backend_from_url
    from gateway.cache.sqlite_backend import SqliteCacheBackend

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "backend": ("BackendCounts", "CacheBackend", "CacheRecord", "CacheUnavailable"),
        "guard": ("guard_conflict",),
        "neardup": (
            "EXTRA_NAME",
            "NearDuplicateIndex",
            "NearDuplicateUnavailable",
            "NearMatch",
            "WordLlamaEmbedder",
            "near_duplicates_available",
        ),
        "policy": (
            "SHARED_SCOPE",
            "CacheContext",
            "CacheMode",
            "CacheSettings",
            "Decision",
            "cache_key",
            "cache_policy",
            "digest_messages",
            "fingerprint_system_prompt",
            "fingerprint_tools",
            "normalize_query",
            "partition_id",
            "session_scope",
            "strip_nocache",
        ),
        "redis_backend": ("RedisCacheBackend",),
        "semantic": ("CachedAnswer", "CacheStats", "SemanticCache", "backend_from_url"),
        "sqlite_backend": ("SqliteCacheBackend",),
    },
)

__all__ = [
    "EXTRA_NAME",
    "SHARED_SCOPE",
    "BackendCounts",
    "CacheBackend",
    "CacheContext",
    "CacheMode",
    "CacheRecord",
    "CacheSettings",
    "CacheStats",
    "CacheUnavailable",
    "CachedAnswer",
    "Decision",
    "NearDuplicateIndex",
    "NearDuplicateUnavailable",
    "NearMatch",
    "RedisCacheBackend",
    "SemanticCache",
    "SqliteCacheBackend",
    "WordLlamaEmbedder",
    "backend_from_url",
    "cache_key",
    "cache_policy",
    "digest_messages",
    "fingerprint_system_prompt",
    "fingerprint_tools",
    "guard_conflict",
    "near_duplicates_available",
    "normalize_query",
    "partition_id",
    "session_scope",
    "strip_nocache",
]
