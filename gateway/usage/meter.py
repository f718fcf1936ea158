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
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from gateway.llm.types import LLMMessage, LLMProvider, LLMResponse, StreamDelta, ToolSpec
from gateway.logs import logger
from gateway.usage.protocol import (
    UNSCOPED,
    UsageKind,
    UsageLedger,
    UsageRow,
    day_of,
    next_day_start,
)


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


def take_riding() -> tuple[list[UsageRow], Callable[[bool], None]] | None:
    """The rows the current turn counted and has not written yet, taken (a call counted
    meanwhile waits for the next append), and what to call with the outcome of their
    write (True: committed and recorded; False: not, and they wait for the next append
    or the turn's end). None when nothing rides (`gateway.usage.pg_store.riding_rows`)."""
    riding = _riding.get()
    if riding is None or not riding.rows:
        return None
    rows = list(riding.rows.values())
    riding.rows.clear()

    def settle(committed: bool) -> None:
        for row in rows:
            if committed:
                riding.meter._recorded(row)
            else:
                riding.hold(row)

    return rows, settle


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
