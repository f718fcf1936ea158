"""Memory's part of `gateway storage import|export` (`gateway.storage.transfer`): one item
per scope (MEMORY.md facts, HISTORY.md lines, knowledge entries), every line and field
kept."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from gateway.plumbing.items import DamagedFile, Outcome, Transfer, epoch, nanoseconds
from gateway.sessions.keys import decode_key

if TYPE_CHECKING:
    import psycopg


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


def _day_start(day: date) -> float:
    return datetime.combine(day, datetime.min.time(), UTC).timestamp()


def read_memory_folder(folder: Path) -> MemoryFolder:
    """Parse and check one scope folder without changing it; `DamagedFile` says what is
    wrong. The folder's modification time stands for the scope's creation (no file
    records it; an export sets it)."""
    key = folder.name
    if scope_dirname(decode_key(key)) != key:
        raise DamagedFile("the folder name is not a memory scope's (hand-made?)")
    created_at = epoch(folder.stat().st_mtime_ns)
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
    ns = nanoseconds(folder.created_at)
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
