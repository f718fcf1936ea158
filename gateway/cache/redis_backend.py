"""The shared cache backend for replicas: Redis, through `redis.asyncio`.

Layout under the namespace `ns` (default `gateway:cache:`):

- `ns e:<key>`        the entry (JSON string), with a native TTL (`SET ... PX`)
- `ns lru`            sorted set key -> last access time; it bounds the entry count
- `ns exp`            sorted set key -> expiry time, to purge index entries of expired keys
- `ns meta`           hash key -> [model, scope, size, partition], for cleaning indexes
- `ns model:<model>`, `ns scope:<scope>`, `ns part:<partition>`  index sets
- `ns stats`          hash with hits, misses and bytes, shared by every replica

Every multi-key change runs in one Lua script, so replicas never see an entry without
its index entries or an index entry left behind by an eviction. The scripts build key
names from the namespace, so they need a single Redis (or a proxy that allows that),
not Redis Cluster.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from loguru import logger

from gateway.cache.backend import BackendCounts, CacheRecord
from gateway.cache.policy import SHARED_SCOPE

DEFAULT_NAMESPACE = "gateway:cache:"

# Shared by every script: drop one entry and everything that indexes it; 1 if it existed.
_REMOVE = """
local ns = ARGV[1]
local function remove(key)
  local meta = redis.call('HGET', ns .. 'meta', key)
  redis.call('ZREM', ns .. 'lru', key)
  redis.call('ZREM', ns .. 'exp', key)
  redis.call('DEL', ns .. 'e:' .. key)
  if not meta then return 0 end
  local m = cjson.decode(meta)
  redis.call('SREM', ns .. 'model:' .. m[1], key)
  redis.call('SREM', ns .. 'scope:' .. m[2], key)
  if m[4] ~= '' then redis.call('SREM', ns .. 'part:' .. m[4], key) end
  redis.call('HINCRBY', ns .. 'stats', 'bytes', -m[3])
  redis.call('HDEL', ns .. 'meta', key)
  return 1
end
local function purge(now, limit)
  local removed = 0
  local expired = redis.call('ZRANGEBYSCORE', ns .. 'exp', '-inf', now, 'LIMIT', 0, limit)
  for _, k in ipairs(expired) do removed = removed + remove(k) end
  return removed
end
"""

_GET = (
    _REMOVE
    + """
local key, now = ARGV[2], ARGV[3]
local expires = redis.call('ZSCORE', ns .. 'exp', key)
if not expires then return false end
if tonumber(expires) <= tonumber(now) then remove(key); return false end
local value = redis.call('GET', ns .. 'e:' .. key)
if not value then remove(key); return false end
redis.call('ZADD', ns .. 'lru', now, key)
return value
"""
)

_PUT = (
    _REMOVE
    + """
local key, now, ttl_ms, max = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local value, expires_at, model, scope = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local partition, size = ARGV[10], tonumber(ARGV[11])
remove(key)
redis.call('SET', ns .. 'e:' .. key, value, 'PX', ttl_ms)
redis.call('HSET', ns .. 'meta', key, cjson.encode({model, scope, size, partition}))
redis.call('ZADD', ns .. 'lru', now, key)
redis.call('ZADD', ns .. 'exp', expires_at, key)
redis.call('SADD', ns .. 'model:' .. model, key)
redis.call('SADD', ns .. 'scope:' .. scope, key)
if partition ~= '' then redis.call('SADD', ns .. 'part:' .. partition, key) end
redis.call('HINCRBY', ns .. 'stats', 'bytes', size)
local removed = purge(now, tonumber(ARGV[12]))
local excess = redis.call('ZCARD', ns .. 'lru') - max
if excess > 0 then
  local victims = redis.call('ZRANGE', ns .. 'lru', 0, excess)
  for _, k in ipairs(victims) do
    if excess > 0 and k ~= key then remove(k); removed = removed + 1; excess = excess - 1 end
  end
end
return removed
"""
)

_DELETE_SET = (
    _REMOVE
    + """
local members = redis.call('SMEMBERS', ns .. ARGV[2])
local removed = 0
for _, k in ipairs(members) do removed = removed + remove(k) end
return removed
"""
)

_DELETE_KEY = _REMOVE + "\nreturn remove(ARGV[2])\n"

_CLEAR = (
    _REMOVE
    + """
local removed = 0
for _, k in ipairs(redis.call('HKEYS', ns .. 'meta')) do removed = removed + remove(k) end
for _, k in ipairs(redis.call('ZRANGE', ns .. 'lru', 0, -1)) do remove(k) end
redis.call('HSET', ns .. 'stats', 'bytes', 0)
return removed
"""
)

_COUNTS = (
    _REMOVE
    + """
purge(ARGV[2], tonumber(ARGV[3]))
local s = redis.call('HMGET', ns .. 'stats', 'hits', 'misses', 'bytes')
return {redis.call('ZCARD', ns .. 'lru'), s[1] or 0, s[2] or 0, s[3] or 0}
"""
)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _encode(record: CacheRecord) -> str:
    return json.dumps(
        {
            "r": record.response,
            "m": record.model,
            "s": record.scope,
            "p": record.partition,
            "q": record.query,
            "c": record.created_at,
            "x": record.expires_at,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )


def _decode(key: str, raw: Any) -> CacheRecord:
    d = json.loads(_text(raw))
    return CacheRecord(
        key=key,
        response=str(d["r"]),
        model=str(d["m"]),
        scope=str(d["s"]),
        partition=str(d["p"]),
        query=str(d["q"]),
        created_at=float(d["c"]),
        expires_at=float(d["x"]),
    )


class RedisCacheBackend:
    """Cache entries in Redis under `namespace`; give it a URL or a `redis.asyncio` client.

    A client passed in stays the caller's to close; one made from `url` is closed by
    `aclose`. Hits and misses are counted in Redis, so every replica reports the same.
    """

    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        client: aioredis.Redis | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        purge_batch: int = 1000,
    ) -> None:
        if not namespace:
            raise ValueError("the Redis cache namespace must not be empty")
        if client is None:
            if url is None:
                raise ValueError("give RedisCacheBackend a url or a client")
            client = aioredis.from_url(url)
            self._owns_client = True
        elif url is not None:
            raise ValueError("give RedisCacheBackend a url or a client, not both")
        else:
            self._owns_client = False
        self.namespace = namespace
        self._client: aioredis.Redis = client
        self._purge_batch = purge_batch
        self._get = self._client.register_script(_GET)
        self._put = self._client.register_script(_PUT)
        self._delete_set = self._client.register_script(_DELETE_SET)
        self._delete_key = self._client.register_script(_DELETE_KEY)
        self._clear = self._client.register_script(_CLEAR)
        self._counts = self._client.register_script(_COUNTS)

    async def ping(self) -> bool:
        """True when Redis answers (for readiness probes and tests)."""
        return bool(await self._client.ping())

    async def get(self, key: str, *, now: float) -> CacheRecord | None:
        raw = await self._get(args=[self.namespace, key, repr(now)])
        return None if raw is None else _decode(key, raw)

    async def put(self, record: CacheRecord, *, now: float, max_entries: int) -> int:
        ttl_ms = max(1, int((record.expires_at - now) * 1000))
        removed = await self._put(
            args=[
                self.namespace,
                record.key,
                repr(now),
                ttl_ms,
                max_entries,
                _encode(record),
                repr(record.expires_at),
                record.model,
                record.scope,
                record.partition if record.scope == SHARED_SCOPE else "",
                record.size,
                self._purge_batch,
            ]
        )
        return int(removed)

    async def delete(self, key: str) -> bool:
        return bool(int(await self._delete_key(args=[self.namespace, key])))

    async def delete_model(self, model: str) -> int:
        return int(await self._delete_set(args=[self.namespace, "model:" + model]))

    async def delete_scope(self, scope: str) -> int:
        return int(await self._delete_set(args=[self.namespace, "scope:" + scope]))

    async def clear(self) -> int:
        return int(await self._clear(args=[self.namespace]))

    async def record_lookup(self, *, hit: bool) -> None:
        await self._client.hincrby(self.namespace + "stats", "hits" if hit else "misses", 1)

    async def counts(self, *, now: float) -> BackendCounts:
        entries, hits, misses, size = await self._counts(
            args=[self.namespace, repr(now), self._purge_batch]
        )
        return BackendCounts(
            entries=int(entries), bytes=int(size), hits=int(hits), misses=int(misses)
        )

    async def shared_queries(self, partition: str, *, now: float) -> list[tuple[str, str]]:
        keys = [_text(k) for k in await self._client.smembers(self.namespace + "part:" + partition)]
        if not keys:
            return []
        values = await self._client.mget([self.namespace + "e:" + k for k in keys])
        result: list[tuple[str, str]] = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None:
                continue
            record = _decode(key, raw)
            if record.expires_at > now:
                result.append((key, record.query))
        return result

    async def aclose(self) -> None:
        if self._owns_client:
            try:
                await self._client.aclose()
            except Exception as exc:  # closing must not hide the caller's own error
                logger.debug("closing the Redis cache client failed: {}", exc)
