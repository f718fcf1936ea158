"""Token usage rows and the protocol of the ledger that totals them (`UsageLedger`): per
UTC day, conversation, channel, model, kind of work and provider. The SQL both ledgers
share (their columns, the filters of a listing and of a budget) is here too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

UsageKind = Literal["turn", "heartbeat", "consolidation", "transcription"]

USAGE_KINDS: tuple[UsageKind, ...] = ("turn", "heartbeat", "consolidation", "transcription")

#: The session key of calls made outside any conversation (none today; kept honest).
UNSCOPED = "-"


def day_of(timestamp: float) -> str:
    """The UTC day a timestamp falls on, `YYYY-MM-DD` (budgets reset at 00:00 UTC)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


def next_day_start(timestamp: float) -> datetime:
    day = datetime.fromtimestamp(timestamp, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day + timedelta(days=1)


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


def usage_row(values: Sequence[Any]) -> UsageRow:
    """A row of `USAGE_COLUMNS` as read from either ledger."""
    day, key, channel, model, kind, calls, prompt, completion, cost, provider = values
    return UsageRow(
        str(day), str(key), str(channel), str(model), str(kind),
        int(calls), int(prompt), int(completion), float(cost), provider=str(provider),
    )  # fmt: skip


def where_clause(since: str | None, session_key: str | None, mark: str) -> tuple[str, list[Any]]:
    clauses, params = [], []
    if since is not None:
        clauses.append(f"day >= {mark}")
        params.append(since)
    if session_key is not None:
        clauses.append(f"session_key = {mark}")
        params.append(session_key)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def budget_sql(table: str, day: str, session_key: str | None, mark: str) -> tuple[str, list[Any]]:
    sql = (
        f"SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM {table} "
        f"WHERE day = {mark} AND kind != 'consolidation'"
    )
    if session_key is None:
        return sql, [day]
    return f"{sql} AND session_key = {mark}", [day, session_key]


def row_values(row: UsageRow) -> tuple[object, ...]:
    """A row's values in `USAGE_COLUMNS`' order."""
    return (
        row.day, row.session_key, row.channel, row.model, row.kind,
        row.calls, row.prompt_tokens, row.completion_tokens, row.cost, row.provider,
    )  # fmt: skip
