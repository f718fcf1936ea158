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
import errno
import fcntl
import json
import os
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, TypeVar

from channels.heartbeat import STATE_FILE as HEARTBEAT_STATE_FILE
from channels.heartbeat import dump_run_times, parse_run_times
from gateway.access import (
    PAIRING_FILE,
    ApprovedSender,
    PairingState,
    PendingRequest,
    dump_pairing,
    parse_pairing,
)
from gateway.fsutil import create_exclusive, ensure_private_dir, fsync_dir
from gateway.memory.format import (
    heading_day,
    history_timestamp,
    is_heading,
    parse_fact,
    render_memory,
    without_fact_comment,
)
from gateway.memory.knowledge import (
    KnowledgeEntry,
    KnowledgeFileError,
    read_knowledge_files,
    searchable_text,
    snapshot_bytes,
)
from gateway.memory.manager import ARCHIVE_GLOB, HISTORY_FILE, KNOWLEDGE_FILE, MEMORY_FILE
from gateway.memory.pg_store import (
    ENTRY_COLUMNS,
    entry_values,
    knowledge_entry,
    pg_text,
    search_terms,
)
from gateway.memory.scopes import MEMORY_DIRNAME, scope_dirname
from gateway.people import PEOPLE_FILE, dump_people, parse_people
from gateway.reminders import JOBS_FILE, ScheduledJob, dump_jobs, parse_jobs
from gateway.sessions.entries import SessionHeader, entry_from_dict
from gateway.sessions.errors import SessionError, SessionKeyError, UnsupportedVersionError
from gateway.sessions.keys import SUFFIX, decode_key, encode_key, session_path
from gateway.sessions.listing import ARCHIVE_DIR, list_archived_files, list_session_files
from gateway.sessions.outputs import HANDLE, OUTPUT_SUFFIX, OUTPUTS_DIR
from gateway.sessions.pg_store import session_lines
from gateway.sessions.store import archive_name
from gateway.storage.postgres import StorageError, StorageUnavailable, redact_url, schema_status
from gateway.usage import (
    USAGE_COLUMNS,
    USAGE_FILE,
    SqliteUsageLedger,
    UsageRow,
    has_provider_column,
    usage_row,
)

if TYPE_CHECKING:
    import psycopg

_S = TypeVar("_S")
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

    def exported_before(
        self, kind: str, item: str, same: bool, what: str, position: tuple[int, int]
    ) -> None:
        """An export found ``what`` (a file, a folder) under the item's name already:
        the item is there when it is the ``same``, a conflict (left alone) when not."""
        if same:
            self.note(kind, "present", item, "already exported", position)
        else:
            detail = f"a different {what} is there; it was not overwritten"
            self.note(kind, "conflict", item, detail, position)

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
            transfer.exported_before("sessions", item, path.read_bytes() == data, "file", position)
            continue
        # The file mode orders sessions by their file's mtime: keep the last activity.
        os.utime(path, (updated_at, updated_at))
        where = "current" if archived_at is None else "archived"
        entries = data.count(b"\n") - 1
        transfer.note(
            "sessions", "moved", item, f"{where}, {entries} entries (session {sid})", position
        )


# ----------------------------------------------------------------------------- tool outputs


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One stored tool output file: whose it is, its bytes and its time."""

    path: Path
    key: str
    session_id: str
    handle: str
    created_ns: int


def _output_files(sessions_dir: Path) -> tuple[list[OutputFile], list[tuple[Path, str]]]:
    """The tool output files under ``sessions/outputs`` (by key, session and handle), and
    the files there that are not one (with why)."""
    root = sessions_dir / OUTPUTS_DIR
    found: list[OutputFile] = []
    strays: list[tuple[Path, str]] = []
    if not root.is_dir():
        return found, strays
    # A dot file is a write a crash cut short (`create_exclusive`'s temp file): not one.
    for path in sorted(p for p in root.rglob("*") if not p.is_dir() and p.name[0] != "."):
        parts = path.relative_to(root).parts
        if len(parts) != 3:
            strays.append((path, "not at outputs/<key>/<session id>/<handle>.txt"))
            continue
        stem, session_id, name = parts
        handle = name.removesuffix(OUTPUT_SUFFIX)
        try:
            key = decode_key(stem)
        except SessionKeyError:
            strays.append((path, f"{stem!r} is not an encoded session key"))
            continue
        if handle == name or not HANDLE.fullmatch(handle) or not session_id.isalnum():
            strays.append((path, "not a tool output's name (out_ and 12 hex digits .txt)"))
            continue
        found.append(OutputFile(path, key, session_id, handle, path.stat().st_mtime_ns))
    return found, strays


def _store_output(conn: psycopg.Connection[Any], output: OutputFile) -> tuple[Outcome, str]:
    """Insert one tool output's row in its own transaction, unless it is there already."""
    import psycopg

    data = output.path.read_bytes()
    try:
        with conn.transaction():
            row = conn.execute(
                "INSERT INTO gw_tool_outputs "
                "(session_key, handle, session_id, created_at, content) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING handle",
                (output.key, output.handle, output.session_id, _epoch(output.created_ns), data),
            ).fetchone()
            if row is None:
                stored = conn.execute(
                    "SELECT session_id, content FROM gw_tool_outputs "
                    "WHERE session_key = %s AND handle = %s",
                    (output.key, output.handle),
                ).fetchone()
    except psycopg.errors.ForeignKeyViolation:
        return "damaged", (
            f"its session {output.session_id} is not in the database (a damaged session "
            "file is skipped with its outputs); nothing stored"
        )
    if row is not None:
        return "moved", f"{len(data)} bytes (session {output.session_id})"
    if stored is not None and stored[0] == output.session_id and bytes(stored[1]) == data:
        return "present", "already imported"
    return "conflict", (
        "the database holds another output under this handle; nothing changed on either side"
    )


def import_tool_outputs(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every stored tool output (``sessions/outputs``) into ``gw_tool_outputs``, its bytes as
    they are; after the sessions, whose rows they belong to."""
    sessions_dir = workspace / "sessions"
    found, strays = _output_files(sessions_dir)
    total = len(found) + len(strays)
    transfer.start("tool outputs", total, sessions_dir / OUTPUTS_DIR)
    for n, output in enumerate(found, start=1):
        item = f"{output.key} {output.handle}"
        try:
            outcome, detail = _store_output(conn, output)
        except FileNotFoundError:
            outcome, detail = "damaged", "the file disappeared while importing"
        transfer.note("tool outputs", outcome, item, detail, (n, total))
    for n, (path, why) in enumerate(strays, start=len(found) + 1):
        item = str(path.relative_to(sessions_dir))
        transfer.note("tool outputs", "damaged", item, f"{why}; left as it is", (n, total))


def export_tool_outputs(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every stored tool output as the file mode keeps it, its file time its creation."""
    sessions_dir = workspace / "sessions"
    rows = conn.execute(
        "SELECT session_key, handle, session_id, created_at FROM gw_tool_outputs "
        "ORDER BY session_key, session_id, handle"
    ).fetchall()
    transfer.start("tool outputs", len(rows), sessions_dir / OUTPUTS_DIR)
    for n, (key, handle, session_id, created_at) in enumerate(rows, start=1):
        position = (n, len(rows))
        item = f"{key} {handle}"
        try:
            folder = sessions_dir / OUTPUTS_DIR / encode_key(key) / session_id
        except SessionKeyError as exc:
            transfer.note("tool outputs", "damaged", repr(key), f"{exc}; not exported", position)
            continue
        (data,) = conn.execute(
            "SELECT content FROM gw_tool_outputs WHERE session_key = %s AND handle = %s",
            (key, handle),
        ).fetchone() or (b"",)
        data = bytes(data)
        path = folder / (handle + OUTPUT_SUFFIX)
        ensure_private_dir(folder)
        try:
            create_exclusive(path, data)
        except FileExistsError:
            same = path.read_bytes() == data
            transfer.exported_before("tool outputs", item, same, "file", position)
            continue
        at = _nanoseconds(created_at)
        os.utime(path, ns=(at, at))
        detail = f"{len(data)} bytes (session {session_id})"
        transfer.note("tool outputs", "moved", item, detail, position)


# ----------------------------------------------------------------------------- memory


@dataclass(frozen=True, slots=True)
class MemoryFolder:
    """One scope's memory as the rows PostgreSQL keeps, from its folder or its rows."""

    #: the folder name, which is also the scope's name in the tables (`scope_dirname`)
    key: str
    #: MEMORY.md lines but `### Consolidated` headings: (heading day, fact category, line)
    facts: tuple[tuple[date | None, str | None, str], ...]
    #: HISTORY.md lines, archives first (oldest first): (timestamp, line)
    history: tuple[tuple[float, str], ...]
    #: knowledge entries by id
    knowledge: tuple[KnowledgeEntry, ...]
    created_at: float

    @property
    def content(self) -> tuple[object, ...]:
        """What the file mode reads back (not the times only the tables keep)."""
        return (self.facts, [line for _, line in self.history], self.knowledge)

    @property
    def describe(self) -> str:
        return (
            f"{len(self.facts)} memory lines, {len(self.history)} history lines, "
            f"{len(self.knowledge)} knowledge entries"
        )


def _strict_text(path: Path) -> str:
    """A memory file's text ('' when missing); `DamagedFile` when it is not UTF-8 (the
    file mode would read it with replacement characters, an import must not)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = data[: exc.start].count(b"\n") + 1
        raise DamagedFile(f"{path.name} line {where} is not UTF-8 text") from None


def _epoch(ns: int) -> float:
    """Nanoseconds as the float the export wrote (`_nanoseconds` inverts it exactly)."""
    return float(Fraction(ns, 1_000_000_000))


def _nanoseconds(at: float) -> int:
    return round(Fraction(at) * 1_000_000_000)


def _day_start(day: date) -> float:
    return datetime.combine(day, datetime.min.time(), UTC).timestamp()


def read_memory_folder(folder: Path) -> MemoryFolder:
    """Parse and check one scope folder without changing it; `DamagedFile` says what is
    wrong. The folder's modification time stands for the scope's creation (no file
    records it; an export sets it)."""
    key = folder.name
    if scope_dirname(decode_key(key)) != key:
        raise DamagedFile("the folder name is not a memory scope's (hand-made?)")
    created_at = _epoch(folder.stat().st_mtime_ns)
    facts: list[tuple[date | None, str | None, str]] = []
    day: date | None = None
    for raw in _strict_text(folder / MEMORY_FILE).split("\n"):
        line = pg_text(raw.strip())
        if not line:
            continue
        if is_heading(line):
            # A `### Consolidated` heading is rebuilt from its facts' day; any other
            # heading is kept as a line and ends the day (facts after it belong to it).
            day = heading_day(line)
            if day is None:
                facts.append((None, None, line))
            continue
        fact = parse_fact(line)
        facts.append((day, fact.category.lower() if fact else None, line))
    history: list[tuple[float, str]] = []
    at = created_at
    for path in [*sorted(folder.glob(ARCHIVE_GLOB)), folder / HISTORY_FILE]:
        for raw in _strict_text(path).split("\n"):
            line = pg_text(raw.strip())
            if not line:
                continue
            stamp = history_timestamp(line)
            at = stamp if stamp is not None else at  # a hand-written line: the one before
            history.append((at, line))
    try:
        entries = read_knowledge_files(folder / KNOWLEDGE_FILE)
    except KnowledgeFileError as exc:
        raise DamagedFile(str(exc)) from None
    knowledge = tuple(
        KnowledgeEntry(
            e.id,
            e.category,
            pg_text(e.content),
            None if e.source is None else pg_text(e.source),
            tuple(pg_text(t) for t in e.tags),
            e.created_at,
            e.accessed_at,
            e.access_count,
        )
        for _, e in sorted(entries.items())
    )
    return MemoryFolder(key, tuple(facts), tuple(history), knowledge, created_at)


def stored_memory(conn: psycopg.Connection[Any], key: str, created_at: float) -> MemoryFolder:
    """One scope's rows, in the shape `read_memory_folder` gives."""
    facts = conn.execute(
        "SELECT day, category, line FROM gw_memory_facts WHERE scope = %s ORDER BY id", (key,)
    ).fetchall()
    history = conn.execute(
        "SELECT at, line FROM gw_memory_history WHERE scope = %s ORDER BY id", (key,)
    ).fetchall()
    knowledge = conn.execute(
        f"SELECT {ENTRY_COLUMNS} FROM gw_memory_knowledge WHERE scope = %s ORDER BY id", (key,)
    ).fetchall()
    return MemoryFolder(
        key,
        tuple((d, c, str(line)) for d, c, line in facts),
        tuple((float(at), str(line)) for at, line in history),
        tuple(map(knowledge_entry, knowledge)),
        created_at,
    )


def _newer(stored: MemoryFolder, mine: MemoryFolder) -> str | None:
    """What the rows hold beyond the folder ('' when nothing), or None when the rows do
    not start with the folder's content (a replica wrote to the scope first)."""
    ids = {e.id: (e.category, e.content) for e in stored.knowledge}
    if (
        stored.facts[: len(mine.facts)] != mine.facts
        or [line for _, line in stored.history[: len(mine.history)]]
        != [line for _, line in mine.history]
        or any(ids.get(e.id) != (e.category, e.content) for e in mine.knowledge)
    ):
        return None
    more = {
        "memory lines": len(stored.facts) - len(mine.facts),
        "history lines": len(stored.history) - len(mine.history),
        "knowledge entries": len(stored.knowledge) - len(mine.knowledge),
    }
    return ", ".join(f"{n} {what}" for what, n in more.items() if n)


def _store_memory(conn: psycopg.Connection[Any], folder: MemoryFolder) -> tuple[Outcome, str]:
    """Insert one scope's rows in one transaction, unless the scope is there already."""
    key = folder.key
    with conn.transaction():
        created = conn.execute(
            "INSERT INTO gw_memory_scopes (scope, created_at) VALUES (%s, %s) "
            "ON CONFLICT (scope) DO NOTHING RETURNING scope",
            (key, folder.created_at),
        ).fetchone()
        if created is None:
            row = conn.execute(
                "SELECT created_at FROM gw_memory_scopes WHERE scope = %s FOR UPDATE", (key,)
            ).fetchone()
            assert row is not None  # scopes are deleted only by hand
            newer = _newer(stored_memory(conn, key, float(row[0])), folder)
            if newer is None:
                return "conflict", (
                    "the database already has other memory for this scope (a gateway in "
                    "the shared mode wrote to it); nothing changed on either side"
                )
            more = f"; the database has {newer} more" if newer else ""
            return "present", f"already imported{more}"
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO gw_memory_facts (scope, day, category, line, created_at, tsv) "
                "VALUES (%s, %s, %s, %s, %s, to_tsvector('simple', %s))",
                [
                    (
                        key,
                        day,
                        category,
                        line,
                        _day_start(day) if day else folder.created_at,
                        "" if is_heading(line) else search_terms(without_fact_comment(line)),
                    )
                    for day, category, line in folder.facts
                ],
            )
            cur.executemany(
                "INSERT INTO gw_memory_history (scope, at, line, tsv) "
                "VALUES (%s, %s, %s, to_tsvector('simple', %s))",
                [(key, at, line, search_terms(line)) for at, line in folder.history],
            )
            cur.executemany(
                f"INSERT INTO gw_memory_knowledge ({ENTRY_COLUMNS}, scope, tsv) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, to_tsvector('simple', %s))",
                [
                    (*entry_values(e), key, search_terms(searchable_text(e)))
                    for e in folder.knowledge
                ],
            )
    return "moved", folder.describe


def import_memory(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every memory scope folder of ``workspace`` (facts, history with its archives,
    knowledge) into PostgreSQL, one scope per transaction."""
    import psycopg

    root = workspace / MEMORY_DIRNAME
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    transfer.start("memory", len(folders), root)
    for n, path in enumerate(folders, start=1):
        item = f"{decode_key(path.name)} ({path.name}/)"
        outcome: Outcome
        try:
            outcome, detail = _store_memory(conn, read_memory_folder(path))
        except DamagedFile as exc:
            outcome, detail = "damaged", f"{exc}; the folder stays as it is"
        except FileNotFoundError:
            outcome, detail = "damaged", "the folder disappeared while importing"
        except psycopg.DataError as exc:
            reason = str(exc).strip().splitlines()[0]
            outcome, detail = "damaged", f"PostgreSQL refused it ({reason}); nothing stored"
        transfer.note("memory", outcome, item, detail, (n, len(folders)))


def _write_memory_folder(root: Path, folder: MemoryFolder) -> None:
    """The scope's files in a new folder, built aside and renamed into place (a crash
    leaves no half-written scope under its name)."""
    ensure_private_dir(root)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    try:
        if folder.facts:
            memory = render_memory((day, line) for day, _, line in folder.facts)
            create_exclusive(staging / MEMORY_FILE, memory.encode())
        if folder.history:
            history = "".join(line + "\n" for _, line in folder.history)
            create_exclusive(staging / HISTORY_FILE, history.encode())
        if folder.knowledge:
            entries = sorted(folder.knowledge, key=lambda e: (e.created_at, e.id))
            create_exclusive(staging / KNOWLEDGE_FILE, snapshot_bytes(entries))
        target = root / folder.key
        os.rename(staging, target)  # refuses a folder that is not empty
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(root)
    ns = _nanoseconds(folder.created_at)
    os.utime(target, ns=(ns, ns))


def export_memory(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every stored scope as the file mode's memory folder: MEMORY.md (facts under
    their headings), HISTORY.md (every history line) and knowledge.json."""
    root = workspace / MEMORY_DIRNAME
    scopes = conn.execute(
        "SELECT scope, created_at FROM gw_memory_scopes ORDER BY scope"
    ).fetchall()
    transfer.start("memory", len(scopes), root)
    for n, (key, created_at) in enumerate(scopes, start=1):
        position = (n, len(scopes))
        if key in ("", ".", "..") or "/" in key or "\x00" in key:
            transfer.note(
                "memory", "damaged", repr(key), "not a folder name; not exported", position
            )
            continue
        item = f"{decode_key(key)} ({key}/)"
        stored = stored_memory(conn, key, float(created_at))
        path = root / key
        if path.exists():
            try:
                same = read_memory_folder(path).content == stored.content
            except DamagedFile:
                same = False
            transfer.exported_before("memory", item, same, "folder", position)
            continue
        try:
            _write_memory_folder(root, stored)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            transfer.note(
                "memory", "conflict", item, "a folder appeared meanwhile; not overwritten", position
            )
            continue
        transfer.note("memory", "moved", item, stored.describe, position)


# ----------------------------------------------------------------------------- pairing


def _read_state_file(path: Path, parse: Callable[[str], _S]) -> _S | None:
    """A whole-workspace state file parsed by ``parse`` (None when there is none);
    `DamagedFile` when it cannot be read as it is."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DamagedFile(f"{path.name} cannot be read ({exc})") from None


def _damaged_state_file(transfer: Transfer, kind: str, path: Path, exc: DamagedFile) -> None:
    """A state file that cannot be read: reported as one damaged item, kept as it is."""
    transfer.start(kind, 1, path)
    transfer.note(kind, "damaged", path.name, f"{exc}; the file stays as it is", (1, 1))


def _parse_pairing(text: str) -> PairingState:
    state, bad = parse_pairing(json.loads(text))
    if bad:
        raise ValueError(f"{bad} unreadable entries")
    return state


def _pairing_rows(state: PairingState) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """Every approval and pending request by (table, channel, sender)."""
    rows: dict[tuple[str, str, str], tuple[Any, ...]] = {}
    for a in state.approved.values():
        rows[("approved", a.channel, a.sender_id)] = (a.approved_at, a.label)
    for r in state.pending:
        rows.setdefault(
            ("pending", r.channel, r.sender_id),
            (r.code, r.chat_id, r.label, r.created_at, r.expires_at),
        )
    return rows


def _describe_pairing(which: tuple[str, str, str], row: tuple[Any, ...]) -> tuple[str, str]:
    table, channel, sender = which
    if table == "approved":
        return f"approved {channel}:{sender}", f"approved at {_when(row[0])}"
    return f"pending {channel}:{sender}", f"code expires {_when(row[4])}"


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


_APPROVED = (
    "SELECT approved_at, label FROM gw_pairing_approved WHERE channel = %s AND sender_id = %s"
)
_PENDING = (
    "SELECT code, chat_id, label, created_at, expires_at FROM gw_pairing_pending "
    "WHERE channel = %s AND sender_id = %s"
)


def import_pairing(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """The pairing file's approvals and pending codes (expired ones too: the next write
    on their channel drops them, as in the file) into PostgreSQL, one row per item."""
    path = workspace / PAIRING_FILE
    try:
        state = _read_state_file(path, _parse_pairing)
    except DamagedFile as exc:
        _damaged_state_file(transfer, "pairing", path, exc)
        return
    rows = _pairing_rows(state) if state is not None else {}
    transfer.start("pairing", len(rows), path)
    for n, (which, row) in enumerate(rows.items(), start=1):
        table, channel, sender = which
        item, detail = _describe_pairing(which, row)
        with conn.transaction():
            stored = conn.execute(
                (_APPROVED if table == "approved" else _PENDING) + " FOR UPDATE",
                (channel, sender),
            ).fetchone()
            outcome: Outcome
            if stored is not None:
                same = tuple(stored) == row
                outcome = "present" if same else "conflict"
                detail = (
                    "already imported"
                    if same
                    else "the database has another one; nothing changed on either side"
                )
            elif table == "approved":
                conn.execute(
                    "INSERT INTO gw_pairing_approved (channel, sender_id, approved_at, label) "
                    "VALUES (%s, %s, %s, %s)",
                    (channel, sender, *row),
                )
                outcome = "moved"
            else:
                conn.execute(
                    "INSERT INTO gw_pairing_pending (channel, sender_id, code, chat_id, label, "
                    "created_at, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    (channel, sender, *row),
                )
                outcome = "moved"
        transfer.note("pairing", outcome, item, detail, (n, len(rows)))


def _write_state_file(
    kind: str,
    path: Path,
    rows: dict[Any, Any],
    existing: dict[Any, Any] | None,
    data: bytes,
    describe: Callable[[Any, Any], tuple[str, str]],
    transfer: Transfer,
) -> None:
    """Export a whole-workspace state file: written when there is none; otherwise each
    item is reported against the file that is there, which is never changed (a
    different or missing item is a conflict: files are not merged)."""
    if existing is None:
        try:
            create_exclusive(path, data)
        except FileExistsError:
            existing = {}
        else:
            for n, (which, row) in enumerate(rows.items(), start=1):
                item, detail = describe(which, row)
                transfer.note(kind, "moved", item, detail, (n, len(rows)))
            return
    for n, (which, row) in enumerate(rows.items(), start=1):
        item, detail = describe(which, row)
        if existing.get(which) == row:
            transfer.note(kind, "present", item, "already exported", (n, len(rows)))
        else:
            transfer.note(
                kind,
                "conflict",
                item,
                f"{path.name} is there without it; the file was not changed",
                (n, len(rows)),
            )


def export_pairing(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Approvals and pending codes as the workspace's pairing file."""
    path = workspace / PAIRING_FILE
    approved = conn.execute(
        "SELECT channel, sender_id, approved_at, label FROM gw_pairing_approved "
        "ORDER BY channel, approved_at, sender_id"
    ).fetchall()
    pending = conn.execute(
        "SELECT channel, sender_id, code, created_at, expires_at, chat_id, label "
        "FROM gw_pairing_pending ORDER BY created_at, channel, sender_id"
    ).fetchall()
    state = PairingState(
        approved={
            (str(c), str(s)): ApprovedSender(str(c), str(s), float(at), str(label))
            for c, s, at, label in approved
        },
        pending=tuple(
            PendingRequest(str(c), str(s), str(code), float(made), float(ends), str(chat), str(lb))
            for c, s, code, made, ends, chat, lb in pending
        ),
    )
    rows = _pairing_rows(state)
    transfer.start("pairing", len(rows), path)
    if not rows:
        return
    try:
        there = _read_state_file(path, _parse_pairing)
        existing = _pairing_rows(there) if there is not None else None
    except DamagedFile:
        existing = {}  # every item conflicts; the damaged file stays as it is
    _write_state_file(
        "pairing", path, rows, existing, dump_pairing(state).encode(), _describe_pairing, transfer
    )


# ----------------------------------------------------------------------------- heartbeat


def _parse_runs(text: str) -> dict[str, datetime]:
    runs = parse_run_times(text)
    for job, when in runs.items():
        if when.tzinfo is None:
            raise ValueError(f"job {job!r}: the last run {when.isoformat()} has no time zone")
    return runs


def _describe_run(job: str, when: datetime) -> tuple[str, str]:
    return job, f"last run {when.astimezone(UTC).isoformat()}"


def import_heartbeat(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Each heartbeat job's last run into ``gw_heartbeat_runs``, so that the fleet makes
    up a missed run once instead of running every job at its first start."""
    path = workspace / HEARTBEAT_STATE_FILE
    try:
        runs = _read_state_file(path, _parse_runs) or {}
    except DamagedFile as exc:
        _damaged_state_file(transfer, "heartbeat", path, exc)
        return
    transfer.start("heartbeat", len(runs), path)
    for n, (job, when) in enumerate(sorted(runs.items()), start=1):
        item, detail = _describe_run(job, when)
        outcome: Outcome = "moved"
        with conn.transaction():
            stored = conn.execute(
                "INSERT INTO gw_heartbeat_runs (job, last_run) VALUES (%s, %s) "
                "ON CONFLICT (job) DO NOTHING RETURNING job",
                (job, when),
            ).fetchone()
            if stored is None:
                row = conn.execute(
                    "SELECT last_run FROM gw_heartbeat_runs WHERE job = %s", (job,)
                ).fetchone()
                assert row is not None
                if row[0] == when:
                    outcome, detail = "present", "already imported"
                elif row[0] > when:
                    outcome = "present"
                    detail = f"the database has a later run ({row[0].astimezone(UTC).isoformat()})"
                else:
                    outcome = "conflict"
                    detail = (
                        f"the database has an earlier run ({row[0].astimezone(UTC).isoformat()}); "
                        "nothing changed on either side"
                    )
        transfer.note("heartbeat", outcome, item, detail, (n, len(runs)))


def export_heartbeat(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Each job's last run as the workspace's heartbeat-state.json (times in UTC)."""
    path = workspace / HEARTBEAT_STATE_FILE
    rows = conn.execute("SELECT job, last_run FROM gw_heartbeat_runs ORDER BY job").fetchall()
    runs = {str(job): when.astimezone(UTC) for job, when in rows}
    transfer.start("heartbeat", len(runs), path)
    if not runs:
        return
    try:
        existing = _read_state_file(path, _parse_runs)
    except DamagedFile:
        existing = {}
    _write_state_file(
        "heartbeat", path, runs, existing, dump_run_times(runs).encode(), _describe_run, transfer
    )


# ----------------------------------------------------------------------------- usage

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
    try:
        rows = _read_usage_file(path) or {}
    except DamagedFile as exc:
        _damaged_state_file(transfer, "usage", path, exc)
        return
    transfer.start("usage", len(rows), path)
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
    _write_state_file("usage", path, rows, existing, data, _describe_usage, transfer)


# ----------------------------------------------------------------------------- schedules


def _parse_schedules(text: str) -> dict[str, ScheduledJob]:
    jobs = parse_jobs(text)
    if len(jobs) != len(json.loads(text)["jobs"]):
        raise ValueError("a job id is repeated")
    return jobs


def _describe_job(job_id: str, job: ScheduledJob) -> tuple[str, str]:
    return f"{job_id} ({job.owner})", f"{job.kind}, next {job.next_run.isoformat()}"


def _ran_since(stored: ScheduledJob, mine: ScheduledJob) -> bool:
    """Whether ``stored`` is ``mine`` moved on by its runs (a repeating job that fired)."""
    return (
        stored.runs > mine.runs
        and stored.next_run > mine.next_run
        and replace(stored, runs=mine.runs, next_run=mine.next_run) == mine
    )


def import_schedules(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Reminders and scheduled tasks (schedules.json) into ``gw_schedules``, one per job.
    The per-conversation limit is not applied: what the file holds is kept."""
    path = workspace / JOBS_FILE
    try:
        jobs = _read_state_file(path, _parse_schedules) or {}
    except DamagedFile as exc:
        _damaged_state_file(transfer, "schedules", path, exc)
        return
    transfer.start("schedules", len(jobs), path)
    for n, (job_id, job) in enumerate(sorted(jobs.items()), start=1):
        item, detail = _describe_job(job_id, job)
        outcome: Outcome = "moved"
        with conn.transaction():
            created = conn.execute(
                "INSERT INTO gw_schedules (id, owner, next_run, job) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (id) DO NOTHING RETURNING id",
                (job.id, job.owner, job.next_run, json.dumps(job.to_dict())),
            ).fetchone()
            if created is None:
                row = conn.execute("SELECT job FROM gw_schedules WHERE id = %s", (job_id,))
                stored = ScheduledJob.from_dict(_json_value(row.fetchone()))
                if stored == job:
                    outcome, detail = "present", "already imported"
                elif _ran_since(stored, job):
                    outcome = "present"
                    detail = f"the database has run it {stored.runs - job.runs} more times since"
                else:
                    outcome = "conflict"
                    detail = (
                        f"the database has another job under this id ({stored.describe()}); "
                        "nothing changed on either side"
                    )
        transfer.note("schedules", outcome, item, detail, (n, len(jobs)))


def _json_value(row: tuple[Any, ...] | None) -> Any:
    assert row is not None
    return row[0] if not isinstance(row[0], str) else json.loads(row[0])


def export_schedules(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every job as the workspace's schedules.json."""
    path = workspace / JOBS_FILE
    found = [
        ScheduledJob.from_dict(_json_value(row))
        for row in conn.execute("SELECT job FROM gw_schedules ORDER BY id").fetchall()
    ]
    jobs = {job.id: job for job in found}
    transfer.start("schedules", len(jobs), path)
    if not jobs:
        return
    try:
        existing = _read_state_file(path, _parse_schedules)
    except DamagedFile:
        existing = {}
    data = dump_jobs(jobs.values()).encode()
    _write_state_file("schedules", path, jobs, existing, data, _describe_job, transfer)


# ----------------------------------------------------------------------------- people

#: ("person", person id) -> the ids linked as that person (sorted), or
#: ("dm", session key) -> the sender whose direct conversation it is
PeopleRows = dict[tuple[str, str], tuple[str, ...] | str]


def _people_rows(data: dict[str, dict[str, str]]) -> PeopleRows:
    groups: dict[str, list[str]] = {}
    for sender, person in data["links"].items():
        groups.setdefault(person, []).append(sender)
    rows: PeopleRows = {("person", p): tuple(sorted(ids)) for p, ids in sorted(groups.items())}
    rows.update({("dm", key): sender for key, sender in sorted(data["dms"].items())})
    return rows


def _people_data(rows: PeopleRows) -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = {"links": {}, "dms": {}}
    for (_, name), value in rows.items():
        if isinstance(value, tuple):
            data["links"].update(dict.fromkeys(value, name))
        else:
            data["dms"][name] = value
    return data


def _describe_people(which: tuple[str, str], value: tuple[str, ...] | str) -> tuple[str, str]:
    name = which[1]
    if isinstance(value, tuple):
        return f"person {name}", f"linked ids {', '.join(value)}"
    return f"dm {name}", f"the direct conversation of {value}"


def _store_person(
    conn: psycopg.Connection[Any], person: str, ids: tuple[str, ...]
) -> tuple[Outcome, str]:
    conn.execute("LOCK TABLE gw_people IN SHARE ROW EXCLUSIVE MODE")  # as `link` does
    stored = dict(
        conn.execute(
            "SELECT sender_id, person FROM gw_people WHERE sender_id = ANY(%s) OR person = %s",
            (list(ids), person),
        ).fetchall()
    )
    if not stored:
        conn.cursor().executemany(
            "INSERT INTO gw_people (sender_id, person) VALUES (%s, %s)",
            [(sender, person) for sender in ids],
        )
        return "moved", f"linked ids {', '.join(ids)}"
    if set(stored.values()) == {person} and set(ids) <= set(stored):
        more = len(stored) - len(ids)
        return "present", "already imported" + (
            f"; the database links {more} more ids to them" if more else ""
        )
    there = ", ".join(f"{s} -> {p}" for s, p in sorted(stored.items()))
    return "conflict", (
        f"the database links these ids otherwise ({there}); nothing changed on either side"
    )


def import_people(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """People links and DM owners (people.json) into ``gw_people`` and ``gw_people_dms``:
    one item per person (all its ids, in one transaction: a person is never half linked)
    and one per direct conversation."""
    path = workspace / PEOPLE_FILE
    try:
        data = _read_state_file(path, parse_people)
    except DamagedFile as exc:
        _damaged_state_file(transfer, "people", path, exc)
        return
    rows = _people_rows(data) if data is not None else {}
    transfer.start("people", len(rows), path)
    for n, (which, value) in enumerate(rows.items(), start=1):
        item, detail = _describe_people(which, value)
        outcome: Outcome = "moved"
        with conn.transaction():
            if isinstance(value, tuple):
                outcome, detail = _store_person(conn, which[1], value)
            else:
                created = conn.execute(
                    "INSERT INTO gw_people_dms (session_key, sender_id) VALUES (%s, %s) "
                    "ON CONFLICT (session_key) DO NOTHING RETURNING session_key",
                    (which[1], value),
                ).fetchone()
                if created is None:
                    row = conn.execute(
                        "SELECT sender_id FROM gw_people_dms WHERE session_key = %s", (which[1],)
                    ).fetchone()
                    assert row is not None
                    if row[0] == value:
                        outcome, detail = "present", "already imported"
                    else:
                        outcome = "conflict"
                        detail = (
                            f"the database has it as {row[0]}'s; nothing changed on either side"
                        )
        transfer.note("people", outcome, item, detail, (n, len(rows)))


def export_people(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """People links and DM owners as the workspace's people.json."""
    path = workspace / PEOPLE_FILE
    links = conn.execute("SELECT sender_id, person FROM gw_people").fetchall()
    dms = conn.execute("SELECT session_key, sender_id FROM gw_people_dms").fetchall()
    data = {
        "links": {str(s): str(p) for s, p in links},
        "dms": {str(k): str(s) for k, s in dms},
    }
    rows = _people_rows(data)
    transfer.start("people", len(rows), path)
    if not rows:
        return
    try:
        there = _read_state_file(path, parse_people)
        existing = _people_rows(there) if there is not None else None
    except DamagedFile:
        existing = {}
    data_bytes = dump_people(_people_data(rows)).encode()
    _write_state_file("people", path, rows, existing, data_bytes, _describe_people, transfer)


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
