"""The shared cache backend for replicas: Redis, through `redis.asyncio`.

Layout under the namespace `ns` (default `gateway:cache:`):

- `ns e:<key>`        the entry (JSON string), with a native TTL (`SET ... PX`)
- `ns lru`            sorted set key -> last access time; it bounds the entry count
- `ns exp`            sorted set key -> expiry time, to purge index entries of expired keys
- `ns meta`           hash key -> [model, scope, size, partition], for cleaning indexes
- `ns model:<model>`, `ns scope:<scope>`, `ns part:<partition>`  index sets
- `ns stats`          hash with hits, misses and bytes, shared by every replica
- `ns obs:<key>`      list of the entry's near-duplicate labels ("similarity:0|1"), newest
                      last, expiring with the entry and dropped with it

Every multi-key change runs in one Lua script, so replicas never see an entry without
its index entries or an index entry left behind by an eviction. The scripts build key
names from the namespace, so they need a single Redis (or a proxy that allows that),
not Redis Cluster.

A turn never waits long for a bad Redis: the calls a turn makes (`get`, `put`,
`record_lookup`, `shared_queries`) each give up after `call_timeout` (connecting
included), and after a failure a `CircuitBreaker` skips Redis for `cooloff` seconds,
then lets one call probe it. A failed or skipped call raises `CacheUnavailable`, which
`SemanticCache` takes as a miss or an answer not stored; the breaker logs once when it
opens and once when Redis answers again. Administrative calls (`counts`, `clear`,
`delete*`) are not skipped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis
from loguru import logger
from redis.exceptions import RedisError

from gateway.cache.backend import BackendCounts, CacheRecord, CacheUnavailable
from gateway.cache.policy import SHARED_SCOPE
from gateway.cache.verified import MAX_OBSERVATIONS

DEFAULT_NAMESPACE = "gateway:cache:"
#: Seconds one call of a turn may take, connecting included, before it counts as failed.
CALL_TIMEOUT = 0.25
#: Seconds Redis is skipped after a failed call of a turn, before one call tries again.
COOLOFF = 30.0
#: Connecting is bounded by this too: a Redis that does not take the connection fails
#: fast for every caller, administrative ones included.
CONNECT_TIMEOUT = 1.0
#: Seconds an administrative call (`counts`, `clear`, ...) may wait for an answer.
ADMIN_TIMEOUT = 5.0
#: Seconds `check` waits for Redis to answer PING.
CHECK_TIMEOUT = 1.0
#: What to do about a Redis that does not answer, in every message that says so.
FIX = "start Redis, or point cache.url (GATEWAY_CACHE__URL) at a running one"

_T = TypeVar("_T")
#: What a call to an unreachable, hanging or broken Redis raises (anyio's deadline
#: raises the built-in TimeoutError).
_FAILURES = (RedisError, OSError, TimeoutError)

# Shared by every script: drop one entry and everything that indexes it; 1 if it existed.
_REMOVE = """
local ns = ARGV[1]
local function remove(key, keep_labels)
  local meta = redis.call('HGET', ns .. 'meta', key)
  if not keep_labels then redis.call('DEL', ns .. 'obs:' .. key) end
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
remove(key, true)
redis.call('SET', ns .. 'e:' .. key, value, 'PX', ttl_ms)
redis.call('PEXPIRE', ns .. 'obs:' .. key, ttl_ms)
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

_OBSERVE = """
local ns, key, label, max = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local ttl = redis.call('PTTL', ns .. 'e:' .. key)
if ttl <= 0 then return 0 end
redis.call('RPUSH', ns .. 'obs:' .. key, label)
redis.call('LTRIM', ns .. 'obs:' .. key, -max, -1)
redis.call('PEXPIRE', ns .. 'obs:' .. key, ttl)
return 1
"""

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


def _describe(exc: BaseException) -> str:
    text = str(exc).rstrip(". ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _timed_out(exc: BaseException) -> bool:
    # anyio's deadline raises the built-in TimeoutError, without a message.
    return type(exc) is TimeoutError


class CircuitBreaker:
    """Whether to call a dependency that has failed: after a failure it is skipped for
    `cooloff` seconds (`allow()` is False), then one call at a time probes it; a
    success closes the breaker. Logs once when it opens and once when it closes."""

    def __init__(
        self, what: str, *, cooloff: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self.cooloff = cooloff
        self._clock = clock
        self._open_until: float | None = None  # None: closed, calls go through
        self._probing = False
        self.skipped = 0  # calls not made while open (tests, diagnostics)

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        if self._open_until is None:
            return True
        if self._probing or self._clock() < self._open_until:
            self.skipped += 1
            return False
        self._probing = True
        return True

    def succeeded(self) -> None:
        if self._open_until is not None:
            logger.info("{} answers again; using it", self.what)
        self._open_until = None
        self._probing = False

    def failed(self, problem: str) -> None:
        if self._open_until is None:
            logger.warning(
                "{} failed ({}); skipping it for {:g}s: lookups are misses, answers are not stored",
                self.what,
                problem,
                self.cooloff,
            )
        else:
            logger.debug("{} still fails ({}); next try in {:g}s", self.what, problem, self.cooloff)
        self._open_until = self._clock() + self.cooloff
        self._probing = False

    def abandoned(self) -> None:
        """A call was cancelled before it told anything: let the next one probe."""
        self._probing = False


def _where(client: aioredis.Redis) -> str:
    """Where `client` connects, without credentials, for log lines and messages."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


class RedisCacheBackend:
    """Cache entries in Redis under `namespace`; give it a URL or a `redis.asyncio` client.

    A client passed in stays the caller's to close; one made from `url` is closed by
    `aclose`. Hits and misses are counted in Redis, so every replica reports the same.
    See the module doc for how a turn is kept from waiting on a bad Redis.
    """

    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        *,
        client: aioredis.Redis | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        purge_batch: int = 1000,
        call_timeout: float = CALL_TIMEOUT,
        cooloff: float = COOLOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not namespace:
            raise ValueError("the Redis cache namespace must not be empty")
        if client is None:
            if url is None:
                raise ValueError("give RedisCacheBackend a url or a client")
            client = aioredis.from_url(
                url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=ADMIN_TIMEOUT
            )
            self._owns_client = True
        elif url is not None:
            raise ValueError("give RedisCacheBackend a url or a client, not both")
        else:
            self._owns_client = False
        self.namespace = namespace
        self._client: aioredis.Redis = client
        self._purge_batch = purge_batch
        self.call_timeout = call_timeout
        self.where = _where(client)
        self.breaker = CircuitBreaker(f"redis cache at {self.where}", cooloff=cooloff, clock=clock)
        self._get = self._client.register_script(_GET)
        self._put = self._client.register_script(_PUT)
        self._delete_set = self._client.register_script(_DELETE_SET)
        self._delete_key = self._client.register_script(_DELETE_KEY)
        self._clear = self._client.register_script(_CLEAR)
        self._counts = self._client.register_script(_COUNTS)
        self._observe = self._client.register_script(_OBSERVE)

    async def check(self) -> None:
        """Raise `CacheUnavailable` unless Redis answers PING within `CHECK_TIMEOUT`
        seconds. Independent of the breaker: it says how Redis is now."""
        try:
            with anyio.fail_after(CHECK_TIMEOUT):
                await self._client.ping()
        except _FAILURES as exc:
            problem = f"no answer to PING within {CHECK_TIMEOUT:g}s" if _timed_out(exc) else None
            raise CacheUnavailable(
                f"redis cache at {self.where}: {problem or _describe(exc)}", FIX
            ) from None

    async def _admin(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()`, with a failure of Redis turned into `CacheUnavailable`."""
        try:
            return await call()
        except _FAILURES as exc:
            raise CacheUnavailable(f"redis cache at {self.where}: {_describe(exc)}", FIX) from None

    async def _in_turn(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """`call()` within `call_timeout`; `CacheUnavailable` when the breaker is open
        or the call fails (which opens it)."""
        if not self.breaker.allow():
            raise CacheUnavailable(f"{self.breaker.what} is skipped after a failure")
        try:
            with anyio.fail_after(self.call_timeout):
                result = await call()
        except _FAILURES as exc:
            timed_out = _timed_out(exc)
            problem = f"no answer within {self.call_timeout:g}s" if timed_out else _describe(exc)
            self.breaker.failed(problem)
            raise CacheUnavailable(f"{self.breaker.what} failed ({problem})") from None
        except BaseException:
            self.breaker.abandoned()
            raise
        self.breaker.succeeded()
        return result

    async def get(self, key: str, *, now: float) -> CacheRecord | None:
        raw = await self._in_turn(lambda: self._get(args=[self.namespace, key, repr(now)]))
        return None if raw is None else _decode(key, raw)

    async def put(self, record: CacheRecord, *, now: float, max_entries: int) -> int:
        ttl_ms = max(1, int((record.expires_at - now) * 1000))
        args: list[str | int] = [
            self.namespace,
            record.key,
            repr(now),
            ttl_ms,
            max_entries,
            _encode(record),
            repr(record.expires_at),
            record.model,
            record.scope,
            # Only entries with a query are indexed for near-duplicate matching.
            record.partition if record.scope == SHARED_SCOPE and record.query else "",
            record.size,
            self._purge_batch,
        ]
        return int(await self._in_turn(lambda: self._put(args=args)))

    async def delete(self, key: str) -> bool:
        return bool(int(await self._admin(lambda: self._delete_key(args=[self.namespace, key]))))

    async def delete_model(self, model: str) -> int:
        return await self._delete_members("model:" + model)

    async def delete_scope(self, scope: str) -> int:
        return await self._delete_members("scope:" + scope)

    async def _delete_members(self, index: str) -> int:
        return int(await self._admin(lambda: self._delete_set(args=[self.namespace, index])))

    async def clear(self) -> int:
        return int(await self._admin(lambda: self._clear(args=[self.namespace])))

    async def record_lookup(self, *, hit: bool) -> None:
        field = "hits" if hit else "misses"
        await self._in_turn(lambda: self._client.hincrby(self.namespace + "stats", field, 1))

    async def counts(self, *, now: float) -> BackendCounts:
        entries, hits, misses, size = await self._admin(
            lambda: self._counts(args=[self.namespace, repr(now), self._purge_batch])
        )
        return BackendCounts(
            entries=int(entries), bytes=int(size), hits=int(hits), misses=int(misses)
        )

    async def shared_queries(self, partition: str, *, now: float) -> list[tuple[str, str]]:
        async def read() -> tuple[list[str], list[Any]]:
            members = await self._client.smembers(self.namespace + "part:" + partition)
            keys = [_text(k) for k in members]
            if not keys:
                return [], []
            return keys, await self._client.mget([self.namespace + "e:" + k for k in keys])

        keys, values = await self._in_turn(read)
        result: list[tuple[str, str]] = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None:
                continue
            record = _decode(key, raw)
            if record.expires_at > now and record.query:
                result.append((key, record.query))
        return result

    async def add_observation(
        self, key: str, similarity: float, correct: bool, *, now: float
    ) -> None:
        label = f"{similarity!r}:{int(correct)}"
        args: list[str | int] = [self.namespace, key, label, MAX_OBSERVATIONS]
        await self._in_turn(lambda: self._observe(args=args))

    async def partition_observations(
        self, partition: str, *, now: float
    ) -> dict[str, list[tuple[float, bool]]]:
        async def read() -> tuple[list[str], list[Any]]:
            members = await self._client.smembers(self.namespace + "part:" + partition)
            keys = [_text(k) for k in members]
            if not keys:
                return [], []
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.lrange(self.namespace + "obs:" + key, 0, -1)
            return keys, await pipe.execute()

        keys, lists = await self._in_turn(read)
        found: dict[str, list[tuple[float, bool]]] = {}
        for key, labels in zip(keys, lists, strict=True):
            for raw in labels or ():
                similarity, _, correct = _text(raw).partition(":")
                found.setdefault(key, []).append((float(similarity), correct == "1"))
        return found

    async def aclose(self) -> None:
        if self._owns_client:
            try:
                await self._client.aclose()
            except Exception as exc:  # closing must not hide the caller's own error
                logger.debug("closing the Redis cache client failed: {}", exc)
