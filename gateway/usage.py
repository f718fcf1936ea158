"""Token usage and its cost: every model call counted by day, conversation, channel,
model, kind (turn, heartbeat, consolidation, transcription) and the provider that
answered (`[llm.providers.NAME]`, "default" for `[llm]`'s own server), priced, and held
to optional budgets.

One seam per model server: `MeteredProvider` wraps the LLM provider, so every call the
gateway makes (a turn's, a tool round's, a heartbeat's, a consolidation's) is counted
without its caller doing anything but saying, once, what it is working for
(`usage_scope`); the voice transcriber counts its calls with `count_transcription`
under the same scope, as kind "transcription".
The promise kept here: a call the provider reports usage for is in the ledger before
its answer reaches the caller, so a budget check after it sees it. In the shared mode a
turn's calls are in the ledger before the turn answers instead (`UsageMeter.riding`):
their row rides in the statement of the turn's next session append (a CTE, see
`gateway.sessions.pg_store`), written whatever that append finds, and what no append
carried is written when the turn ends. That takes a round trip out of every turn's
dispatch slot; budget checks happen between turns, so they see the same totals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
from loguru import logger

from gateway.fsutil import open_sqlite
from gateway.llm.types import LLMMessage, LLMProvider, LLMResponse, StreamDelta, ToolSpec

UsageKind = Literal["turn", "heartbeat", "consolidation", "transcription"]
USAGE_KINDS: tuple[UsageKind, ...] = ("turn", "heartbeat", "consolidation", "transcription")
#: The file mode's ledger, in the workspace folder.
USAGE_FILE = "usage.sqlite"
#: The session key of calls made outside any conversation (none today; kept honest).
UNSCOPED = "-"


@dataclass(frozen=True, slots=True)
class UsageScope:
    """What a model call works for: the conversation, its channel, the kind of work."""

    session_key: str
    channel: str
    kind: UsageKind


_scope: ContextVar[UsageScope | None] = ContextVar("gateway_usage_scope", default=None)


@dataclass
class _Riding:
    """The rows a turn counted and has not written yet (`UsageMeter.riding`)."""

    meter: UsageMeter
    rows: dict[tuple[str, str, str, str, str, str], UsageRow]

    def hold(self, row: UsageRow) -> None:
        """Keep `row` for the next append, merged with what is held for its key."""
        key = _row_key(row)
        held = self.rows.get(key)
        self.rows[key] = row if held is None else _merged(held, row)


_riding: ContextVar[_Riding | None] = ContextVar("gateway_usage_riding", default=None)


def riding_rows() -> tuple[str, tuple[Any, ...], Callable[[bool], None]] | None:
    """For the shared session store's next append: the data-modifying statement that
    writes the current turn's pending usage rows (for a CTE), its parameters, and what
    to call with the outcome (True: committed; False: not, and the rows wait for the
    next append or the turn's end). None when nothing rides."""
    riding = _riding.get()
    if riding is None or not riding.rows:
        return None
    rows = list(riding.rows.values())
    riding.rows.clear()  # taken: a call counted meanwhile waits for the next append
    values = ", ".join([_PG_ROW] * len(rows))
    params = tuple(value for row in rows for value in _pg_params(row))

    def settle(committed: bool) -> None:
        for row in rows:
            if committed:
                riding.meter._recorded(row)
            else:
                riding.hold(row)

    return _PG_INSERT + values + _PG_UPSERT, params, settle


def _row_key(row: UsageRow) -> tuple[str, str, str, str, str, str]:
    return (row.day, row.session_key, row.channel, row.model, row.kind, row.provider)


def kind_for_channel(channel: str) -> UsageKind:
    """Scheduled jobs (the `system` channel) are heartbeats; everything else a turn."""
    return "heartbeat" if channel == "system" else "turn"


@contextlib.contextmanager
def usage_scope(session_key: str, kind: UsageKind | None = None) -> Iterator[UsageScope]:
    """Count the model calls made inside (this task and those it starts) for
    `session_key`; the kind defaults to the one its channel implies."""
    channel = session_key.split(":", 1)[0]
    scope = UsageScope(session_key, channel, kind or kind_for_channel(channel))
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def day_of(timestamp: float) -> str:
    """The UTC day a timestamp falls on, `YYYY-MM-DD` (budgets reset at 00:00 UTC)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


def next_day_start(timestamp: float) -> datetime:
    day = datetime.fromtimestamp(timestamp, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day + timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Price:
    """US dollars per million prompt and completion tokens, and per minute of audio
    (transcription models billed by duration, e.g. whisper-1)."""

    prompt: float
    completion: float
    per_minute: float = 0.0


class PriceTable:
    """Cost of a call from `usage.prices`, or from the answering provider's own prices
    first (`by_provider`, its `[llm.providers.NAME] prices`); a model without a price
    costs 0 (and `priced` says so, so a report never passes 0 off as a real price)."""

    def __init__(
        self,
        prices: Mapping[str, Price],
        by_provider: Mapping[str, Mapping[str, Price]] | None = None,
    ) -> None:
        self._prices = dict(prices)
        self._by_provider = {name: dict(table) for name, table in (by_provider or {}).items()}

    def price(self, model: str, provider: str = "") -> Price | None:
        own = self._by_provider.get(provider, {}).get(model)
        return own if own is not None else self._prices.get(model)

    def priced(self, model: str, provider: str = "") -> bool:
        return self.price(model, provider) is not None

    def cost(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        audio_seconds: float = 0.0,
        provider: str = "",
    ) -> float:
        price = self.price(model, provider)
        if price is None:
            return 0.0
        tokens = (prompt_tokens * price.prompt + completion_tokens * price.completion) / 1_000_000
        return tokens + audio_seconds / 60 * price.per_minute


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Totals of one (day, conversation, channel, model, kind, provider).

    `audio_seconds` is the audio a transcription call reported; it reaches the
    `UsageMeter.on_record` listeners (metrics) and its cost is in `cost`, but neither
    ledger keeps it (``gw_usage`` has no column for it): rows read back hold 0.
    `provider` is the provider that answered ("" for calls counted before providers
    were: rows of older ledgers, and transcriptions)."""

    day: str
    session_key: str
    channel: str
    model: str
    kind: str
    calls: int
    prompt_tokens: int
    completion_tokens: int
    cost: float
    audio_seconds: float = 0.0
    provider: str = ""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "day": self.day,
            "session_key": self.session_key,
            "channel": self.channel,
            "model": self.model,
            "kind": self.kind,
            "provider": self.provider,
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tokens": self.tokens,
            "cost_usd": round(self.cost, 6),
        }


class UsageLedger(Protocol):
    """Durable usage totals (blocking calls: run them in a worker thread)."""

    def add(self, row: UsageRow) -> None:
        """Add one call's counts to its (day, conversation, channel, model, kind,
        provider) totals."""

    def rows(self, *, since: str | None = None, session_key: str | None = None) -> list[UsageRow]:
        """Totals from day `since` on (all days without), of one conversation or all."""

    def tokens(self, day: str, session_key: str | None = None) -> int:
        """Tokens of `day`, of one conversation or of all, for budgets (turns,
        heartbeats and the tokens a transcription was billed; consolidation is upkeep
        and never stops a conversation)."""

    def close(self) -> None: ...


USAGE_COLUMNS = (
    "day, session_key, channel, model, kind, calls, prompt_tokens, completion_tokens, cost, "
    "provider"
)
#: The columns of a total's key, in the order of `UsageRow`'s.
USAGE_KEY = "day, session_key, channel, model, kind, provider"

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,
    session_key TEXT NOT NULL,
    channel TEXT NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    calls INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    provider TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (day, session_key, channel, model, kind, provider)
)
"""
_UPSERT = (
    f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    f"ON CONFLICT ({USAGE_KEY}) DO UPDATE SET "
    "calls = calls + excluded.calls, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = completion_tokens + excluded.completion_tokens, "
    "cost = cost + excluded.cost"
)
_BUSY_TIMEOUT_MS = 5000  # open_sqlite's default


def _upsert_values(row: UsageRow) -> tuple[object, ...]:
    return (
        row.day, row.session_key, row.channel, row.model, row.kind,
        row.calls, row.prompt_tokens, row.completion_tokens, row.cost, row.provider,
    )  # fmt: skip


def usage_row(values: Sequence[Any]) -> UsageRow:
    """A row of `USAGE_COLUMNS` as read from either ledger."""
    day, key, channel, model, kind, calls, prompt, completion, cost, provider = values
    return UsageRow(
        str(day), str(key), str(channel), str(model), str(kind),
        int(calls), int(prompt), int(completion), float(cost), provider=str(provider),
    )  # fmt: skip


def has_provider_column(conn: sqlite3.Connection) -> bool:
    """Whether a usage.sqlite's table has the provider column (files written before
    providers were counted have not)."""
    columns = conn.execute("SELECT name FROM pragma_table_info('usage')").fetchall()
    return ("provider",) in columns


def _where(since: str | None, session_key: str | None, mark: str) -> tuple[str, list[Any]]:
    clauses, params = [], []
    if since is not None:
        clauses.append(f"day >= {mark}")
        params.append(since)
    if session_key is not None:
        clauses.append(f"session_key = {mark}")
        params.append(session_key)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def _budget_sql(table: str, day: str, session_key: str | None, mark: str) -> tuple[str, list[Any]]:
    sql = (
        f"SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM {table} "
        f"WHERE day = {mark} AND kind != 'consolidation'"
    )
    if session_key is None:
        return sql, [day]
    return f"{sql} AND session_key = {mark}", [day, session_key]


def _create_usage_table(conn: sqlite3.Connection) -> None:
    """The ledger's table, made or brought up to date: a file of an older version gets
    the provider column (its totals under provider "") in one transaction, as a new
    table, since the column joins the key."""
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage'").fetchone()
    if exists is None or has_provider_column(conn):
        conn.execute(_SQLITE_SCHEMA)
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not has_provider_column(conn):  # another process may have done it meanwhile
            conn.execute("ALTER TABLE usage RENAME TO usage_before_providers")
            conn.execute(_SQLITE_SCHEMA)
            old = USAGE_COLUMNS.removesuffix(", provider")
            conn.execute(
                f"INSERT INTO usage ({USAGE_COLUMNS}) SELECT {old}, '' FROM usage_before_providers"
            )
            conn.execute("DROP TABLE usage_before_providers")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SqliteUsageLedger:
    """The file mode's ledger: `usage.sqlite` in the workspace (WAL, one writer lock)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        # 0600 like every workspace database (it names conversations), and a damaged file
        # is moved aside, not overwritten.
        self._db = open_sqlite(path, what="usage ledger", init=_create_usage_table)

    def add(self, row: UsageRow) -> None:
        with self._lock:
            self._db.execute(_UPSERT, _upsert_values(row))

    def try_add_nowait(self, row: UsageRow) -> bool:
        """`add` here and now, on the event loop, when that cannot wait (the connection
        free, the file not locked by another writer); False, nothing written, else. An
        upsert in WAL mode without fsync takes microseconds: cheaper than a thread hop."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._db.execute("PRAGMA busy_timeout = 0")
            try:
                self._db.execute(_UPSERT, _upsert_values(row))
                return True
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    return False
                raise
            finally:
                self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        finally:
            self._lock.release()

    def rows(self, *, since: str | None = None, session_key: str | None = None) -> list[UsageRow]:
        where, params = _where(since, session_key, "?")
        sql = (
            f"SELECT {USAGE_COLUMNS} FROM usage{where} "
            "ORDER BY day, session_key, kind, model, provider"
        )
        with self._lock:
            return [usage_row(values) for values in self._db.execute(sql, params)]

    def tokens(self, day: str, session_key: str | None = None) -> int:
        sql, params = _budget_sql("usage", day, session_key, "?")
        with self._lock:
            (total,) = self._db.execute(sql, params).fetchone()
        return int(total)

    def close(self) -> None:
        with self._lock:
            self._db.close()


_PG_INSERT = f"INSERT INTO gw_usage ({USAGE_COLUMNS}) VALUES "
_PG_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
_PG_UPSERT = (
    f" ON CONFLICT ({USAGE_KEY}) DO UPDATE SET "
    "calls = gw_usage.calls + excluded.calls, "
    "prompt_tokens = gw_usage.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = gw_usage.completion_tokens + excluded.completion_tokens, "
    "cost = gw_usage.cost + excluded.cost"
)
_PG_ADD = _PG_INSERT + _PG_ROW + _PG_UPSERT


def _pg_params(row: UsageRow) -> tuple[Any, ...]:
    return _upsert_values(row)


def _merged(a: UsageRow, b: UsageRow) -> UsageRow:
    """Two calls' rows of one key as one (the ledger adds them up the same way)."""
    return dataclasses.replace(
        a,
        calls=a.calls + b.calls,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        cost=a.cost + b.cost,
        audio_seconds=a.audio_seconds + b.audio_seconds,
    )


class PostgresUsageLedger:
    """The shared mode's ledger (`gw_usage`, migrations 0007 and 0014): replicas add to
    the same totals, so a budget holds across them."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        #: A connection of the event loop's pool (`PostgresDedupeStore.connection`), for
        #: `aadd`; None until the gateway gives one.
        self.aconnect: Callable[[], AbstractAsyncContextManager[Any]] | None = None

    def add(self, row: UsageRow) -> None:
        with self._pool.connection() as conn:
            conn.execute(_PG_ADD, _pg_params(row))

    async def aadd(self, row: UsageRow) -> bool:
        """`add` on the event loop over its pool (no worker thread: see
        `gateway.sessions.pg_store` on what a thread hop per call costs a turn's
        latency); False, nothing added, when the gateway gave no loop pool."""
        if self.aconnect is None:
            return False
        with anyio.CancelScope(shield=True):  # a stopped turn's call still counts
            async with self.aconnect() as conn:
                await conn.execute(_PG_ADD, _pg_params(row))
        return True

    def rows(self, *, since: str | None = None, session_key: str | None = None) -> list[UsageRow]:
        where, params = _where(since, session_key, "%s")
        sql = (
            f"SELECT {USAGE_COLUMNS} FROM gw_usage{where} "
            "ORDER BY day, session_key, kind, model, provider"
        )
        with self._pool.connection() as conn:
            return [usage_row(values) for values in conn.execute(sql, params).fetchall()]

    def tokens(self, day: str, session_key: str | None = None) -> int:
        sql, params = _budget_sql("gw_usage", day, session_key, "%s")
        with self._pool.connection() as conn:
            row = conn.execute(sql, params).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        pass  # the pool belongs to the shared storage


@dataclass(frozen=True, slots=True)
class Budgets:
    """Tokens a conversation may use per UTC day, and all conversations together
    (None: no limit). Consolidation does not count against them."""

    conversation_per_day: int | None = None
    total_per_day: int | None = None

    @property
    def any(self) -> bool:
        return self.conversation_per_day is not None or self.total_per_day is not None


Recorder = Callable[[UsageRow], None]


class UsageMeter:
    """The ledger, the price table and the budgets together; what the agent, the
    metered provider, /status and `gateway usage` use."""

    def __init__(
        self,
        ledger: UsageLedger,
        prices: PriceTable,
        budgets: Budgets | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ledger = ledger
        self.prices = prices
        self.budgets = budgets or Budgets()
        self.clock = clock
        self._listeners: list[Recorder] = []

    def on_record(self, listener: Recorder) -> None:
        """Call `listener` with each recorded call (metrics)."""
        self._listeners.append(listener)

    def record(
        self,
        scope: UsageScope | None,
        model: str,
        prompt: int,
        completion: int,
        *,
        kind: UsageKind | None = None,
        audio_seconds: float = 0.0,
        provider: str = "",
    ) -> UsageRow:
        """Add one call to the ledger (blocking), as `kind` (default: the scope's)."""
        row = self._row(scope, model, prompt, completion, kind, audio_seconds, provider)
        self.ledger.add(row)
        self._recorded(row)
        return row

    def try_record_nowait(
        self,
        scope: UsageScope | None,
        model: str,
        prompt: int,
        completion: int,
        provider: str = "",
    ) -> bool:
        """`record` on the event loop when the ledger can add without waiting (the
        file mode's, mostly); False, nothing recorded, when it would block."""
        add = getattr(self.ledger, "try_add_nowait", None)
        if add is None:
            return False
        row = self._row(scope, model, prompt, completion, None, 0.0, provider)
        if not add(row):
            return False
        self._recorded(row)
        return True

    @contextlib.asynccontextmanager
    async def riding(self) -> AsyncIterator[None]:
        """A turn (the shared mode's ledger only; elsewhere nothing changes): calls
        counted inside ride in the turn's next session append (`riding_rows`), and
        what none carried is written on the way out, whichever way that is."""
        if getattr(self.ledger, "aconnect", None) is None:
            yield
            return
        riding = _Riding(self, {})
        token = _riding.set(riding)
        try:
            yield
        finally:
            _riding.reset(token)
            if riding.rows:
                with anyio.CancelScope(shield=True):
                    for row in list(riding.rows.values()):
                        await self._aadd_row(row)

    async def _aadd_row(self, row: UsageRow) -> None:
        try:
            aadd = getattr(self.ledger, "aadd", None)
            if aadd is None or not await aadd(row):
                await anyio.to_thread.run_sync(self.ledger.add, row)
            self._recorded(row)
        except Exception as exc:
            logger.error("usage of a model call could not be recorded: {}", exc)

    async def arecord(
        self,
        scope: UsageScope | None,
        model: str,
        prompt: int,
        completion: int,
        provider: str = "",
    ) -> None:
        """`record` for the event loop: in a turn of the shared mode it rides with the
        turn's next session append (`riding`); else on the loop when the ledger can (the
        file mode's when `usage.sqlite` is free, the shared mode's over the loop's pool),
        else in a worker thread."""
        riding = _riding.get()
        if riding is not None and riding.meter is self:
            riding.hold(self._row(scope, model, prompt, completion, None, 0.0, provider))
            return
        if self.try_record_nowait(scope, model, prompt, completion, provider):
            return
        aadd = getattr(self.ledger, "aadd", None)
        if aadd is not None:
            row = self._row(scope, model, prompt, completion, None, 0.0, provider)
            if await aadd(row):
                self._recorded(row)
                return
        record = functools.partial(self.record, provider=provider)
        await anyio.to_thread.run_sync(record, scope, model, prompt, completion)

    def _row(
        self,
        scope: UsageScope | None,
        model: str,
        prompt: int,
        completion: int,
        kind: UsageKind | None,
        audio_seconds: float,
        provider: str = "",
    ) -> UsageRow:
        scope = scope or UsageScope(UNSCOPED, "none", "turn")
        return UsageRow(
            day=day_of(self.clock()),
            session_key=scope.session_key,
            channel=scope.channel,
            model=model,
            kind=kind or scope.kind,
            calls=1,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost=self.prices.cost(model, prompt, completion, audio_seconds, provider),
            audio_seconds=audio_seconds,
            provider=provider,
        )

    def _recorded(self, row: UsageRow) -> None:
        for listener in self._listeners:
            try:
                listener(row)
            except Exception as exc:
                logger.warning("usage listener failed: {}", exc)

    def budget_notice(self, session_key: str) -> str | None:
        """The answer when a budget of today is used up (None: go on). Blocking."""
        if not self.budgets.any:
            return None
        now = self.clock()
        day = day_of(now)
        resumes = next_day_start(now).strftime("%H:%M UTC")
        limit = self.budgets.conversation_per_day
        if limit is not None:
            used = self.ledger.tokens(day, session_key)
            if used >= limit:
                return (
                    f"This conversation has used its token budget for today ({used:,} of "
                    f"{limit:,} tokens), so I am not asking the model until the budget "
                    f"renews at {resumes}."
                )
        limit = self.budgets.total_per_day
        if limit is not None:
            used = self.ledger.tokens(day)
            if used >= limit:
                return (
                    f"I have used today's token budget ({used:,} of {limit:,} tokens across "
                    f"all conversations), so I am not asking the model until it renews at "
                    f"{resumes}."
                )
        return None

    def today(self, session_key: str) -> tuple[int, str]:
        """Tokens of `session_key` today, every kind included, and their cost as a person
        reads it: ``$0.001234``, ``unpriced`` when no model used has a price (a cost of
        $0 would pass for a real price), or ``$0.001234 + unpriced`` for a mix. Blocking."""
        rows = self.ledger.rows(since=day_of(self.clock()), session_key=session_key)
        priced = [r for r in rows if self.prices.priced(r.model, r.provider)]
        cost = f"${sum(r.cost for r in priced):.6f}"
        if len(priced) < len(rows):
            cost = f"{cost} + unpriced" if priced else "unpriced"
        return sum(r.tokens for r in rows), cost


async def count_transcription(
    meter: UsageMeter,
    model: str,
    *,
    audio_seconds: float | None,
    input_tokens: int = 0,
    output_tokens: int = 0,
) -> None:
    """Count one transcription call under the current `usage_scope`, as kind
    "transcription": the audio's duration (priced per minute) or the tokens the server
    billed (priced like a model's). A server that reports neither (many local Whisper
    servers) is counted as a call with no duration."""
    scope = _scope.get()
    try:
        await anyio.to_thread.run_sync(
            functools.partial(
                meter.record,
                scope,
                model,
                input_tokens,
                output_tokens,
                kind="transcription",
                audio_seconds=audio_seconds or 0.0,
            )
        )
    except Exception as exc:
        # Counting must not cost the person their message; the loss is logged.
        logger.error("usage of a transcription could not be recorded: {}", exc)


class MeteredProvider:
    """An `LLMProvider` that counts every call's usage in `meter` under the current
    `usage_scope`, with the provider that answered, before handing the answer back (see
    the module docstring)."""

    def __init__(self, inner: LLMProvider, meter: UsageMeter) -> None:
        self.inner = inner
        self.meter = meter

    def __getattr__(self, name: str) -> Any:
        # Everything else (default model, fallbacks, ...) is the inner provider's.
        return getattr(self.inner, name)

    async def _count(self, response: LLMResponse, model: str | None) -> None:
        usage = response.usage
        if usage is None:
            return
        name = response.message.model or model or "unknown"
        scope = _scope.get()
        try:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            provider = response.provider or ""
            await self.meter.arecord(scope, name, prompt, completion, provider)
        except Exception as exc:
            # Counting must not cost the person their answer; the loss is logged.
            logger.error("usage of a model call could not be recorded: {}", exc)

    async def chat(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> LLMResponse:
        response = await self.inner.chat(
            messages,
            model=model,
            tools=tools,
            temperature=temperature,
            max_tokens=max_tokens,
            tool_choice=tool_choice,
        )
        await self._count(response, model)
        return response

    async def stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamDelta]:
        async for delta in self.inner.stream(
            messages, model=model, tools=tools, temperature=temperature, max_tokens=max_tokens
        ):
            if delta.response is not None:
                await self._count(delta.response, model)
            yield delta

    async def aclose(self) -> None:
        await self.inner.aclose()


def usage_table(rows: Sequence[UsageRow], prices: PriceTable, *, since: str) -> str:
    """`gateway usage` as a person reads it: a line per day, conversation, kind, model
    and provider ("-": counted before providers were, or a transcription), then the
    totals per day and of everything; unpriced models are marked."""
    if not rows:
        return f"No model usage recorded since {since}."
    header = (
        "day", "conversation", "kind", "model", "provider", "calls", "prompt", "completion",
        "cost",
    )  # fmt: skip
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        cost = f"${r.cost:.6f}" if prices.priced(r.model, r.provider) else "unpriced"
        lines.append(
            (
                r.day, r.session_key, r.kind, r.model, r.provider or "-", str(r.calls),
                f"{r.prompt_tokens:,}", f"{r.completion_tokens:,}", cost,
            )
        )  # fmt: skip
    days: dict[str, list[UsageRow]] = {}
    for r in rows:
        days.setdefault(r.day, []).append(r)
    for day, of_day in days.items():
        lines.append(_total_line(day, "all conversations", of_day))
    if len(days) > 1:
        lines.append(_total_line("total", "", rows))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _total_line(day: str, what: str, rows: Sequence[UsageRow]) -> tuple[str, ...]:
    return (
        day, what, "", "", "", str(sum(r.calls for r in rows)),
        f"{sum(r.prompt_tokens for r in rows):,}",
        f"{sum(r.completion_tokens for r in rows):,}",
        f"${sum(r.cost for r in rows):.6f}",
    )  # fmt: skip
