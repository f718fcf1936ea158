"""`gateway storage import|export`: a file workspace into PostgreSQL and back, losslessly.

Each kind of state has one import function and one export function, registered in
`IMPORTS` and `EXPORTS`: sessions, the tool outputs stored beside them (one item per
output, its bytes as they are), memory (one item per scope: facts, history and
knowledge), pairing (one item per approval or pending code), heartbeat runs (one item
per job), usage totals (one per day, conversation, channel, model, kind and provider), schedules
(one per job) and people (one per person with all its ids, one per direct
conversation's owner). A function gets the open connection, the workspace folder and a `Transfer` to
report to, and keeps these promises for every item it moves:
- Lossless: a session's header and entry lines are stored verbatim (the ``json`` columns
  keep the text) and written back byte for byte, archived (`/new`) sessions included.
  Two things that carry nothing the file mode reads are normalized: blank lines are
  dropped and a complete last line without its newline gets one. Memory keeps every
  fact line (category, `### Consolidated` day), history line (timestamp) and knowledge
  entry (every field); what no file keeps (serial ids, when a fact line was appended)
  cannot round-trip, and PostgreSQL text holds no NUL (it becomes U+FFFD). The state
  files (pairing, heartbeat, schedules, people) are written back in the file mode's own
  format, so a file the file mode wrote comes back byte for byte; usage.sqlite comes
  back with the same totals (SQLite's bytes are its own).
- One transaction per item: a damaged or refused item leaves nothing behind.
- Safe to re-run: an item already at the destination, identical, is skipped and
  reported; one that differs is reported as a conflict and left as it is on both sides
  (nothing is ever overwritten or merged; an existing pairing or heartbeat file is
  compared item by item and never rewritten).
- Damage is reported, not imported: a session file with an unreadable line, a cut-off
  last line or a bad header, a memory folder with a file that is not UTF-8 or a
  malformed knowledge record, an unreadable pairing or heartbeat file, is skipped whole
  and stays where it is. Files are only read: the file-mode stores are not opened, as
  they would set damaged files aside or rewrite old formats.

Consolidation state is not moved: the file mode keeps it as the sessions' compaction
entries (which move with the sessions); ``gw_consolidations`` only guards replicas.

Rows are written with their own statements instead of the stores' methods: those
re-encode (sessions), re-stamp (memory) or expire (pairing) what they are given, and an
import must keep what the files hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from gateway.access.transfer import export_pairing, import_pairing
from gateway.fsutil import ensure_private_dir
from gateway.memory.transfer import export_memory, import_memory
from gateway.people.transfer import export_people, import_people
from gateway.plumbing.items import Step, Transfer
from gateway.plumbing.postgres import StorageError, StorageUnavailable, schema_status
from gateway.redaction import redact_url
from gateway.schedules.transfer import (
    export_heartbeat,
    export_schedules,
    import_heartbeat,
    import_schedules,
)
from gateway.sessions.keys import SUFFIX
from gateway.sessions.transfer import (
    export_sessions,
    export_tool_outputs,
    import_sessions,
    import_tool_outputs,
)
from gateway.usage.transfer import export_usage, import_usage

if TYPE_CHECKING:
    import psycopg


#: One function per kind of state, run in this order.
IMPORTS: dict[str, Step] = {
    "sessions": import_sessions,
    "tool_outputs": import_tool_outputs,
    "memory": import_memory,
    "pairing": import_pairing,
    "heartbeat": import_heartbeat,
    "usage": import_usage,
    "schedules": import_schedules,
    "people": import_people,
}

EXPORTS: dict[str, Step] = {
    "sessions": export_sessions,
    "tool_outputs": export_tool_outputs,
    "memory": export_memory,
    "pairing": export_pairing,
    "heartbeat": export_heartbeat,
    "usage": export_usage,
    "schedules": export_schedules,
    "people": export_people,
}


def _require_current_schema(conn: psycopg.Connection[Any], url: str) -> None:
    status = schema_status(conn)
    if status.unknown:
        raise StorageError(
            f"the database at {redact_url(url)} has schema versions {list(status.unknown)} "
            "from a newer gateway; use that version for import and export"
        )
    if status.pending:
        raise StorageError(
            f"the database at {redact_url(url)} lacks {len(status.pending)} schema "
            "migration(s); run `gateway db migrate` first"
        )


def _check_workspace_folder(workspace: Path) -> None:
    if not workspace.is_dir():
        raise ValueError(f"{workspace}: no such folder; give the workspace to import")
    if not (workspace / "sessions").exists() and any(workspace.glob("*" + SUFFIX)):
        raise ValueError(
            f"{workspace} is a sessions folder; give the workspace that holds it "
            f"({workspace.parent})"
        )


def transfer_workspace(
    conn: psycopg.Connection[Any],
    url: str,
    direction: Literal["import", "export"],
    workspace: Path,
    *,
    kinds: Sequence[str] | None = None,
    out: TextIO | None = None,
) -> Transfer:
    """Import ``workspace`` into the database behind ``conn``, or export the database into
    it (from one consistent snapshot: a read-only repeatable-read transaction), running
    the step of every kind of state (or of ``kinds``) in order. The schema must be current."""
    import psycopg

    if direction == "import":
        _check_workspace_folder(workspace)
    elif workspace.exists() and not workspace.is_dir():
        raise ValueError(f"{workspace} is not a folder; give a folder to export into")
    _require_current_schema(conn, url)
    table = IMPORTS if direction == "import" else EXPORTS
    steps = [step for kind, step in table.items() if kinds is None or kind in kinds]
    transfer = Transfer(f"{direction}ed", out)
    if direction == "export":
        ensure_private_dir(workspace)
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
    # An export reads one snapshot; an import commits item by item (each its own
    # transaction), so what it reported is kept if the connection drops half-way.
    whole = conn.transaction() if direction == "export" else contextlib.nullcontext()
    try:
        with whole:
            for step in steps:
                step(conn, workspace, transfer)
    except psycopg.OperationalError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageUnavailable(
            f"PostgreSQL at {redact_url(url)} went away ({reason}); every item reported "
            f"{transfer.verb} is complete, run the command again to finish"
        ) from None
    return transfer
