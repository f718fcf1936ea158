"""The storage seam of the semantic cache: one small async protocol, one record type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class CacheRecord:
    """One stored answer.

    `scope` is `"shared"` or `"session:<key>"`; `partition` groups entries answered under
    the same model, system prompt and tools; `query` is the normalized question, kept
    for shared entries the near-duplicate layer indexes only (a scoped entry's question
    may be private and is never needed again; a paraphrase whose candidate's answer
    was right is found through that candidate). Times are epoch seconds.
    """

    key: str
    response: str
    model: str
    scope: str
    partition: str
    query: str
    created_at: float
    expires_at: float

    @property
    def size(self) -> int:
        """Bytes of payload this entry holds (response and query, UTF-8)."""
        return len(self.response.encode("utf-8")) + len(self.query.encode("utf-8"))


class CacheUnavailable(Exception):
    """The backend cannot serve now (e.g. Redis is down, or skipped after a failure):
    `problem` says what failed, `fix` (when known) what to do; the message is both."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True, slots=True)
class BackendCounts:
    """What a backend knows about its contents and the lookups it has counted."""

    entries: int
    bytes: int
    hits: int
    misses: int


@runtime_checkable
class CacheBackend(Protocol):
    """Storage for cache records. Implementations keep these promises:

    - `get` never returns a record whose `expires_at <= now`, and a record it returns
      becomes the most recently used one (SQLite: to a resolution of one second).
    - `put` is durable when it returns, replaces an entry with the same key, then drops
      expired entries and evicts the least recently used ones down to `max_entries`.
    - Counting lookups (`record_lookup`) is separate from `get`, so a layer above can
      decide what counts as a hit.
    - A call may raise `CacheUnavailable` when the backend is known not to work (a
      shared backend that is down); it has logged that already, once.
    - `check` answers quickly (a short timeout) and changes nothing: `gateway doctor`
      and the readiness probe use it.
    """

    name: str
    #: Where the entries live (a path, host:port), without credentials: for messages.
    where: str

    async def get(self, key: str, *, now: float) -> CacheRecord | None: ...

    async def put(self, record: CacheRecord, *, now: float, max_entries: int) -> int:
        """Store `record`; return how many entries were evicted or purged."""
        ...

    async def delete(self, key: str) -> bool: ...

    async def delete_model(self, model: str) -> int: ...

    async def delete_scope(self, scope: str) -> int: ...

    async def clear(self) -> int:
        """Remove every entry (lookup counters are kept: they are monotonic for metrics)."""
        ...

    async def record_lookup(self, *, hit: bool) -> None: ...

    async def counts(self, *, now: float) -> BackendCounts: ...

    async def shared_queries(self, partition: str, *, now: float) -> list[tuple[str, str]]:
        """`(key, normalized query)` of the live shared entries of one partition that
        have a query (those the near-duplicate layer indexes)."""
        ...

    async def add_observation(
        self, key: str, similarity: float, correct: bool, *, now: float
    ) -> None:
        """Keep a near-duplicate label on entry `key` (the newest `MAX_OBSERVATIONS`;
        none for an entry that is gone); the labels go when the entry goes."""
        ...

    async def partition_observations(
        self, partition: str, *, now: float
    ) -> dict[str, list[tuple[float, bool]]]:
        """`key -> [(similarity, correct), ...]` (oldest first) of the live shared
        entries of one partition that have labels."""
        ...

    async def check(self) -> None:
        """Raise `CacheUnavailable` (saying what to do) unless the backend can be used."""
        ...

    async def aclose(self) -> None: ...
