"""The sessions' part of `gateway storage import|export` (`gateway.storage.transfer`):
session files, archived ones included, stored verbatim in `gw_sessions` and written back
byte for byte; the tool outputs stored beside them, one item per output."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.fsutil import create_exclusive, ensure_private_dir
from gateway.plumbing.items import DamagedFile, Outcome, Transfer, epoch, nanoseconds
from gateway.sessions.entries import SessionHeader, entry_from_dict
from gateway.sessions.errors import SessionError, SessionKeyError, UnsupportedVersionError
from gateway.sessions.keys import decode_key, encode_key, session_path
from gateway.sessions.listing import ARCHIVE_DIR, list_archived_files, list_session_files
from gateway.sessions.outputs import HANDLE, OUTPUT_SUFFIX, OUTPUTS_DIR
from gateway.sessions.pg_store import session_lines
from gateway.sessions.store import archive_name

if TYPE_CHECKING:
    import psycopg


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
                (output.key, output.handle, output.session_id, epoch(output.created_ns), data),
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
        at = nanoseconds(created_at)
        os.utime(path, ns=(at, at))
        detail = f"{len(data)} bytes (session {session_id})"
        transfer.note("tool outputs", "moved", item, detail, position)
