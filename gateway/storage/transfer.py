"""`gateway storage import|export`: a file workspace into PostgreSQL and back, losslessly.

Each kind of state has one import function and one export function, registered in
`IMPORTS` and `EXPORTS` (sessions today; memory and pairing add theirs next to it). A
function gets the open connection, the workspace folder and a `Transfer` to report to,
and keeps these promises for every item it moves:
- Lossless: a session's header and entry lines are stored verbatim (the ``json`` columns
  keep the text) and written back byte for byte, archived (`/new`) sessions included.
  Two things that carry nothing the file mode reads are normalized: blank lines are
  dropped and a complete last line without its newline gets one.
- One transaction per item: a damaged or refused item leaves nothing behind.
- Safe to re-run: an item already at the destination, identical, is skipped and
  reported; one that differs is reported as a conflict and left as it is on both sides
  (nothing is ever overwritten or merged).
- Damage is reported, not imported: a session file with an unreadable line, a cut-off
  last line or a bad header is skipped whole and stays where it is.

Rows are written with their own statements instead of `PostgresSessionStore.create_with`:
that re-encodes entries from parsed objects, and an import must keep the file's bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from gateway.fsutil import create_exclusive, ensure_private_dir
from gateway.sessions.entries import SessionHeader, entry_from_dict
from gateway.sessions.errors import SessionError, SessionKeyError, UnsupportedVersionError
from gateway.sessions.keys import SUFFIX, encode_key, session_path
from gateway.sessions.manager import list_archived_files, list_session_files
from gateway.sessions.pg_store import session_lines
from gateway.sessions.store import ARCHIVE_DIR, archive_name
from gateway.storage.postgres import StorageError, StorageUnavailable, redact_url, schema_status

if TYPE_CHECKING:
    import psycopg

Outcome = Literal["moved", "present", "damaged", "conflict"]
_OUTCOMES: tuple[Outcome, ...] = ("moved", "present", "damaged", "conflict")


@dataclass(slots=True)
class Tally:
    """What happened to the items of one kind of state."""

    kind: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_OUTCOMES, 0))

    @property
    def clean(self) -> bool:
        return not (self.counts["damaged"] or self.counts["conflict"])

    def summary(self, verb: str) -> str:
        c = self.counts
        return (
            f"{self.kind}: {c['moved']} {verb}, {c['present']} already there, "
            f"{c['damaged']} damaged (skipped), {c['conflict']} conflicting (left as they are)"
        )


class Transfer:
    """Progress of one import or export: a line on ``out`` per item, tallies per kind."""

    def __init__(self, verb: str, out: TextIO | None = None) -> None:
        self.verb = verb
        self.out = out if out is not None else sys.stderr
        self.tallies: dict[str, Tally] = {}

    def note(
        self, kind: str, outcome: Outcome, item: str, detail: str, position: tuple[int, int]
    ) -> None:
        tally = self.tallies.setdefault(kind, Tally(kind))
        tally.counts[outcome] += 1
        word = {
            "moved": self.verb,
            "present": "skipped",
            "damaged": "DAMAGED",
            "conflict": "CONFLICT",
        }
        done, total = position
        line = f"{kind} [{done}/{total}] {word[outcome]} {item}: {detail}"
        print(line, file=self.out, flush=True)

    def start(self, kind: str, found: int, where: Path) -> None:
        self.tallies.setdefault(kind, Tally(kind))
        print(f"{kind}: {found} found in {where}", file=self.out, flush=True)

    @property
    def clean(self) -> bool:
        return all(t.clean for t in self.tallies.values())

    def summary(self) -> str:
        return "; ".join(t.summary(self.verb) for t in self.tallies.values())


#: An import or export of one kind of state: (connection, workspace folder, progress).
Step = Callable[["psycopg.Connection[Any]", Path, Transfer], None]


# ----------------------------------------------------------------------------- sessions


class DamagedFile(Exception):
    """A session file that cannot be imported as it is; the message says why."""


@dataclass(frozen=True, slots=True)
class SessionFile:
    """One session file, parsed and checked, its lines kept verbatim (no newlines)."""

    path: Path
    key: str
    header: SessionHeader
    header_line: str
    #: (entry id, parent id, type, line) in file order
    entries: tuple[tuple[str, str | None, str, str], ...]
    last_timestamp: float
    archived_at: float | None

    @property
    def lines(self) -> list[str]:
        """The file as an export writes it back: every line with its newline."""
        return [self.header_line + "\n", *(line + "\n" for *_, line in self.entries)]

    @property
    def entry_bytes(self) -> int:
        """What ``gw_sessions.bytes`` counts: the entry lines with their newlines."""
        return sum(len(line.encode()) + 1 for *_, line in self.entries)

    @property
    def describe(self) -> str:
        where = "current" if self.archived_at is None else "archived"
        return f"{where}, {len(self.entries)} entries"


def _read_locked(path: Path) -> bytes:
    """The file's bytes, read under a shared lock: a gateway appending to it (which holds
    the exclusive lock for each append) is never caught half-way through a line."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_session_file(path: Path, key: str, archived_at: float | None = None) -> SessionFile:
    """Parse and check a whole session file; `DamagedFile` says what is wrong with it.

    Every line is decoded in full here, unlike `SessionTree.ingest_lines`, which indexes
    message lines by a quick match and decodes them when first used: an import must find
    a damaged entry before it is stored, not when a replica first reads it."""
    data = _read_locked(path)
    if not data:
        raise DamagedFile("the file is empty (no header); a session file starts with one")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = data[: exc.start].count(b"\n") + 1
        raise DamagedFile(f"line {where} is not UTF-8 text") from None
    lines = text.split("\n")
    last = lines.pop()  # '' when the file ends with a newline
    if last:
        lines.append(last)  # complete or torn: parsing decides
    try:
        header = entry_from_dict(json.loads(lines[0]))
    except UnsupportedVersionError as exc:
        raise DamagedFile(f"{exc}; import it with a gateway that knows this version") from None
    except (ValueError, SessionError) as exc:
        raise DamagedFile(f"line 1 is not a session header ({exc})") from None
    if not isinstance(header, SessionHeader):
        raise DamagedFile(f"line 1 is a {header.type} entry, not a session header")
    entries: list[tuple[str, str | None, str, str]] = []
    seen: set[str] = set()
    bad: list[int] = []
    last_timestamp = header.timestamp
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # the file mode skips blank lines too: they hold nothing
        try:
            entry = entry_from_dict(json.loads(line))
        except (ValueError, SessionError):
            bad.append(lineno)
            continue
        if isinstance(entry, SessionHeader) or entry.id in seen:
            bad.append(lineno)
            continue
        seen.add(entry.id)
        entries.append((entry.id, entry.parent_id, entry.type, line))
        last_timestamp = entry.timestamp
    if bad:
        if bad == [len(lines)] and last:
            raise DamagedFile(
                "the last line is cut off (a crash mid-write?); open the session once with "
                "the file-mode gateway, which sets the fragment aside, then import again"
            )
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        raise DamagedFile(f"{len(bad)} unreadable line(s): {shown}")
    return SessionFile(
        path=path,
        key=key,
        header=header,
        header_line=lines[0],
        entries=tuple(entries),
        last_timestamp=max(header.timestamp, last_timestamp),
        archived_at=archived_at,
    )


def _session_files(sessions_dir: Path) -> list[tuple[Path, str, float | None]]:
    """(path, key, archived at) of every session file, current ones first."""
    found: list[tuple[Path, str, float | None]] = []
    for info in sorted(list_session_files(sessions_dir), key=lambda i: i.key):
        assert info.path is not None
        found.append((info.path, info.key, None))
    for archived in list_archived_files(sessions_dir):
        found.append((archived.path, archived.key, archived.archived_at))
    return found


def _store_session(conn: psycopg.Connection[Any], session: SessionFile) -> tuple[Outcome, str]:
    """Insert one session's rows in one transaction, unless it is there already."""
    sid = session.header.id
    with conn.transaction():
        row = conn.execute(
            "SELECT key, archived_at FROM gw_sessions WHERE session_id = %s FOR UPDATE", (sid,)
        ).fetchone()
        if row is not None:
            stored = session_lines(conn, sid)
            mine = session.lines
            same_place = row[0] == session.key and (row[1] is None) == (session.archived_at is None)
            if same_place and stored[: len(mine)] == mine:
                newer = len(stored) - len(mine)
                more = f"; the database has {newer} newer entries" if newer else ""
                return "present", f"already imported (session {sid}{more})"
            return "conflict", (
                f"session {sid} is already in the database with other content "
                f"({len(stored) - 1} entries there, {len(mine) - 1} in the file); "
                "nothing changed on either side"
            )
        created = conn.execute(
            "INSERT INTO gw_sessions (session_id, key, header, created_at, updated_at, "
            "last_seq, bytes, archived_at) VALUES (%s, %s, %s::json, %s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING RETURNING session_id",
            (
                sid,
                session.key,
                session.header_line,
                session.header.timestamp,
                session.last_timestamp,
                len(session.entries),
                session.entry_bytes,
                session.archived_at,
            ),
        ).fetchone()
        if created is None:
            return "conflict", (
                f"the database already has another current session for {session.key!r} "
                "(a gateway in the shared mode started one); nothing changed on either side"
            )
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY gw_session_entries (session_id, seq, entry_id, parent_id, type, body) "
                "FROM STDIN"
            ) as copy,
        ):
            for seq, (entry_id, parent_id, kind, line) in enumerate(session.entries, start=1):
                copy.write_row((sid, seq, entry_id, parent_id, kind, line))
    return "moved", f"{session.describe} (session {sid})"


def import_sessions(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every session file of ``workspace`` (current and archived) into PostgreSQL."""
    import psycopg

    sessions_dir = workspace / "sessions"
    files = _session_files(sessions_dir) if sessions_dir.is_dir() else []
    transfer.start("sessions", len(files), sessions_dir)
    for n, (path, key, archived_at) in enumerate(files, start=1):
        item = f"{key} ({path.relative_to(sessions_dir)})"
        outcome: Outcome
        try:
            if path.stat().st_size == 0:  # what the file mode calls "no session yet"
                outcome, detail = "present", "an empty file (no session yet): nothing to import"
            else:
                session = read_session_file(path, key, archived_at)
                outcome, detail = _store_session(conn, session)
        except DamagedFile as exc:
            outcome, detail = "damaged", f"{exc}; the file stays as it is"
        except FileNotFoundError:
            outcome, detail = "damaged", "the file disappeared while importing"
        except psycopg.DataError as exc:  # e.g. a JSON escape PostgreSQL does not accept
            reason = str(exc).strip().splitlines()[0]
            outcome, detail = "damaged", f"PostgreSQL refused it ({reason}); nothing stored"
        transfer.note("sessions", outcome, item, detail, (n, len(files)))


def export_sessions(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every stored session (current and archived) as the file mode's session files."""
    sessions_dir = workspace / "sessions"
    rows = conn.execute(
        "SELECT session_id, key, updated_at, archived_at FROM gw_sessions "
        "ORDER BY key, archived_at NULLS FIRST, session_id"
    ).fetchall()
    transfer.start("sessions", len(rows), sessions_dir)
    ensure_private_dir(sessions_dir)
    for n, (sid, key, updated_at, archived_at) in enumerate(rows, start=1):
        position = (n, len(rows))
        try:
            if archived_at is None:
                path = session_path(sessions_dir, key)
            else:
                folder = sessions_dir / ARCHIVE_DIR / encode_key(key)
                path = folder / archive_name(sid, archived_at)
        except SessionKeyError as exc:
            transfer.note("sessions", "damaged", repr(key), f"{exc}; not exported", position)
            continue
        item = f"{key} ({path.relative_to(sessions_dir)})"
        data = "".join(session_lines(conn, sid)).encode()
        ensure_private_dir(path.parent)
        try:
            create_exclusive(path, data)
        except FileExistsError:
            if path.read_bytes() == data:
                transfer.note("sessions", "present", item, "already exported", position)
            else:
                transfer.note(
                    "sessions",
                    "conflict",
                    item,
                    "a different file is there; it was not overwritten",
                    position,
                )
            continue
        # The file mode orders sessions by their file's mtime: keep the last activity.
        os.utime(path, (updated_at, updated_at))
        where = "current" if archived_at is None else "archived"
        entries = data.count(b"\n") - 1
        transfer.note(
            "sessions", "moved", item, f"{where}, {entries} entries (session {sid})", position
        )


#: One function per kind of state, run in this order.
IMPORTS: dict[str, Step] = {"sessions": import_sessions}
EXPORTS: dict[str, Step] = {"sessions": export_sessions}


# ----------------------------------------------------------------------------- commands


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
