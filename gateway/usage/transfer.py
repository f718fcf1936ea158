"""Usage's part of `gateway storage import|export` (`gateway.storage.transfer`): one item
per day, conversation, channel, model, kind and provider; usage.sqlite comes back with
the same totals."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.plumbing.items import (
    DamagedFile,
    Outcome,
    Transfer,
    rows_to_import,
    write_state_file,
)
from gateway.usage.protocol import USAGE_COLUMNS, UsageRow, usage_row
from gateway.usage.store import USAGE_FILE, SqliteUsageLedger, has_provider_column

if TYPE_CHECKING:
    import psycopg


#: (day, session_key, channel, model, kind, provider): the provider is "" in a ledger
#: written before providers were counted, whose file is read as it is.
UsageKey = tuple[str, str, str, str, str, str]

UsageCounts = tuple[int, int, int, float]


def _usage_item(row: UsageRow) -> tuple[UsageKey, UsageCounts]:
    key = (row.day, row.session_key, row.channel, row.model, row.kind, row.provider)
    return key, (row.calls, row.prompt_tokens, row.completion_tokens, row.cost)


def _read_usage_file(path: Path) -> dict[UsageKey, UsageCounts] | None:
    """Every total of a usage.sqlite (None when there is none; an empty file, as a crash
    at its creation leaves it, holds none); `DamagedFile` when it is not a readable usage
    ledger. Read from a copy (with its write-ahead log): SQLite leaves -wal and -shm
    files next to a WAL database even a read-only connection opened, and an import only
    reads. Not `SqliteUsageLedger`: that sets a damaged file aside."""
    with tempfile.TemporaryDirectory(prefix="gateway-import-") as folder:
        copy = Path(folder) / USAGE_FILE
        try:
            shutil.copyfile(path, copy)
        except FileNotFoundError:
            return None
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(f"{path}-wal", f"{copy}-wal")
        try:
            conn = sqlite3.connect(copy)
            try:
                tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if ("usage",) not in tables.fetchall():
                    return {}
                columns = USAGE_COLUMNS
                if not has_provider_column(conn):  # an older ledger: provider unknown
                    columns = USAGE_COLUMNS.removesuffix("provider") + "''"
                raw = conn.execute(f"SELECT {columns} FROM usage").fetchall()
            finally:
                conn.close()
            rows = dict(_usage_item(usage_row(values)) for values in raw)
        except (sqlite3.Error, ValueError, TypeError) as exc:
            raise DamagedFile(f"{path.name} cannot be read ({exc})") from None
    if len(rows) != len(raw):
        raise DamagedFile(f"{path.name} cannot be read (repeated totals)")
    return rows


def _describe_usage(key: UsageKey, counts: UsageCounts) -> tuple[str, str]:
    day, session_key, channel, model, kind, provider = key
    calls, prompt, completion, cost = counts
    where = session_key if session_key.startswith(channel + ":") else f"{session_key} ({channel})"
    by = f" via {provider}" if provider else ""
    return (
        f"{day} {where} {kind} {model}{by}",
        f"{calls} calls, {prompt + completion} tokens, ${cost:.6f}",
    )


def import_usage(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """The usage ledger's totals (usage.sqlite) into ``gw_usage``, one row per item.

    A total the database holds larger in every count is a counter that went on in the
    shared mode: it is there (nothing is added twice). The import cannot tell that from
    the shared mode having counted the same day, conversation, model and kind before the
    import; the detail line says how much more the database has."""
    path = workspace / USAGE_FILE
    rows = rows_to_import(transfer, "usage", path, lambda: _read_usage_file(path))
    if rows is None:
        return
    for n, (key, counts) in enumerate(sorted(rows.items()), start=1):
        item, detail = _describe_usage(key, counts)
        outcome: Outcome = "moved"
        with conn.transaction():
            created = conn.execute(
                "INSERT INTO gw_usage (day, session_key, channel, model, kind, provider, "
                "calls, prompt_tokens, completion_tokens, cost) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING day",
                (*key, *counts),
            ).fetchone()
            if created is None:
                row = conn.execute(
                    "SELECT calls, prompt_tokens, completion_tokens, cost FROM gw_usage WHERE "
                    "day = %s AND session_key = %s AND channel = %s AND model = %s AND "
                    "kind = %s AND provider = %s",
                    key,
                ).fetchone()
                assert row is not None  # totals are never deleted
                stored = (int(row[0]), int(row[1]), int(row[2]), float(row[3]))
                if stored == counts:
                    outcome, detail = "present", "already imported"
                elif all(mine <= theirs for mine, theirs in zip(counts, stored, strict=True)):
                    outcome = "present"
                    detail = (
                        f"the database has counted {stored[0] - counts[0]} more calls "
                        "since; nothing added"
                    )
                else:
                    outcome = "conflict"
                    detail = (
                        f"the database has other totals ({stored[0]} calls, "
                        f"{stored[1] + stored[2]} tokens); nothing changed on either side"
                    )
        transfer.note("usage", outcome, item, detail, (n, len(rows)))


def _usage_file_bytes(rows: dict[UsageKey, UsageCounts]) -> bytes:
    """A usage.sqlite holding ``rows``, built by the file mode's own ledger aside."""
    with tempfile.TemporaryDirectory(prefix="gateway-export-") as folder:
        path = Path(folder) / USAGE_FILE
        ledger = SqliteUsageLedger(path)
        try:
            for key, counts in rows.items():
                ledger.add(UsageRow(*key[:5], *counts, provider=key[5]))
        finally:
            ledger.close()  # the last connection checkpoints the WAL into the file
        return path.read_bytes()


def export_usage(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every usage total as the workspace's usage.sqlite."""
    path = workspace / USAGE_FILE
    raw = conn.execute(
        f"SELECT {USAGE_COLUMNS} FROM gw_usage "
        "ORDER BY day, session_key, channel, model, kind, provider"
    ).fetchall()
    rows = dict(_usage_item(usage_row(values)) for values in raw)
    transfer.start("usage", len(rows), path)
    if not rows:
        return
    try:
        existing = _read_usage_file(path)
    except DamagedFile:
        existing = {}
    data = _usage_file_bytes(rows) if existing is None else b""
    write_state_file("usage", path, rows, existing, data, _describe_usage, transfer)
