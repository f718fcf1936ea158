"""The web chat's own state: each visitor's conversation log (what the page shows: their
messages and the replies, in order), their conversations, the files they uploaded and the
replies' files, and the key that signs visitor cookies.

One SQL schema, two places: `webchat.sqlite` in the workspace (the file mode) and
PostgreSQL tables `gw_webchat_*` shared by every replica (created by the store on first
use), so a reply written by the replica that ran the turn is read by the one holding the
visitor's page.

The log is the browser's end of the delivery promise. Promises (tested in
tests/test_webchat_store.py, both modes):
- Each visitor's events are numbered 1, 2, 3, ... in the order they were committed
  (`seq`, taken under a lock of the visitor's row), so a page that read up to `seq` N
  and asks for what is after N gets every later event, once: a reply is never skipped by
  a reader, whatever the timing of the writers.
- A visitor's message is logged once per client id however often it is posted; a reply
  is logged once per (message it answers, text), however often it is sent (a crash
  between sending and marking sends it again: the page still shows it once).
- A reply is in the conversation of the message it answers; `/new` (or `/reset`) starts
  the visitor's next conversation, and the command is its first event.
- A file is read back only for the visitor it belongs to.
- With `durable`, a reply's commit is fsynced before `add_reply` returns (a power cut
  does not take back a reply the dispatcher then marks answered).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio.to_thread

from gateway.fsutil import SqliteFile
from gateway.plumbing.backends import Backends

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from gateway.config import PartialSettings, Settings

#: The store's file in the workspace (the file mode).
STORE_FILE = "webchat.sqlite"
#: A conversation's title: the start of its first message.
TITLE_CHARS = 80
MESSAGE, REPLY = "message", "reply"


@dataclass(frozen=True, slots=True)
class FileRef:
    """A file in the store, as a message or a reply names it."""

    id: str
    name: str
    mime: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "mime": self.mime, "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileRef:
        return cls(str(data["id"]), str(data["name"]), str(data["mime"]), int(data["size"]))


@dataclass(frozen=True, slots=True)
class StoredFile:
    ref: FileRef
    visitor: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of a visitor's log: their message (`message_id` its client id) or a reply
    (`message_id` the client id of the message it answers, "" for none)."""

    seq: int
    conversation: int
    kind: str
    message_id: str
    text: str
    at: float
    files: tuple[FileRef, ...] = ()
    error: bool = False


@dataclass(frozen=True, slots=True)
class Conversation:
    number: int
    title: str
    started_at: float


@dataclass(frozen=True, slots=True)
class VisitorState:
    """Where a visitor's log stands: its last event and current conversation."""

    last_seq: int = 0
    conversation: int = 1
    known: bool = False


@dataclass(frozen=True, slots=True)
class NewFile:
    """A file to keep with an event (a reply's image, a document)."""

    name: str
    mime: str
    data: bytes = field(repr=False)


class WebChatStore(Protocol):
    """The channel's own state; see the module docstring."""

    async def signing_key(self, fresh: str) -> str:
        """The cookie key every replica uses: `fresh` if none was kept yet."""
        ...

    async def state(self, visitor: str) -> VisitorState: ...

    async def message_event(self, visitor: str, message_id: str) -> Event | None: ...

    async def add_message(
        self,
        visitor: str,
        message_id: str,
        text: str,
        files: tuple[FileRef, ...],
        *,
        new_conversation: bool,
        title: str,
    ) -> tuple[Event, bool]:
        """Log a visitor's message (once per `message_id`); (its event, whether it is new).
        `new_conversation`: it starts the next conversation; `title` names the
        conversation when it has none yet ("" leaves it)."""
        ...

    async def add_reply(
        self,
        visitor: str,
        reply_to: str,
        text: str,
        files: tuple[NewFile, ...],
        *,
        error: bool = False,
    ) -> Event | None:
        """Log a reply; None when this reply to `reply_to` is logged already."""
        ...

    async def events_after(self, visitor: str, after: int, limit: int) -> list[Event]: ...

    async def conversation_events(self, visitor: str, conversation: int, limit: int) -> list[Event]:
        """The last `limit` events of one conversation, oldest first."""
        ...

    async def conversations(self, visitor: str, limit: int) -> list[Conversation]: ...

    async def save_file(self, visitor: str, file: NewFile) -> FileRef: ...

    async def file(self, file_id: str) -> StoredFile | None: ...

    async def file_info(self, file_id: str) -> StoredFile | None:
        """The file without its bytes (`data` empty): whose it is, what it is."""
        ...

    async def purge(self, before: float, *, visitors_before: float) -> int:
        """Forget events, conversations and files older than `before`, and visitors with
        none left not seen since `visitors_before` (a visitor's numbering goes on while a
        page of theirs may still hold a position in it)."""
        ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------- the SQL


def schema(blob: str) -> tuple[str, ...]:
    """The tables, with the binary type of the database (`BLOB`, `bytea`)."""
    return (
        """CREATE TABLE IF NOT EXISTS gw_webchat_keys (
            name text PRIMARY KEY,
            value text NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS gw_webchat_visitors (
            visitor text PRIMARY KEY,
            last_seq bigint NOT NULL DEFAULT 0,
            conversation integer NOT NULL DEFAULT 1,
            seen_at double precision NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS gw_webchat_events (
            visitor text NOT NULL,
            seq bigint NOT NULL,
            conversation integer NOT NULL,
            kind text NOT NULL,
            dedupe text,
            message_id text NOT NULL,
            body text NOT NULL,
            at double precision NOT NULL,
            PRIMARY KEY (visitor, seq),
            UNIQUE (visitor, dedupe)
        )""",
        "CREATE INDEX IF NOT EXISTS gw_webchat_events_at ON gw_webchat_events (at)",
        """CREATE TABLE IF NOT EXISTS gw_webchat_conversations (
            visitor text NOT NULL,
            conversation integer NOT NULL,
            title text NOT NULL,
            started_at double precision NOT NULL,
            PRIMARY KEY (visitor, conversation)
        )""",
        f"""CREATE TABLE IF NOT EXISTS gw_webchat_files (
            id text PRIMARY KEY,
            visitor text NOT NULL,
            name text NOT NULL,
            mime text NOT NULL,
            size integer NOT NULL,
            data {blob} NOT NULL,
            at double precision NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS gw_webchat_files_at ON gw_webchat_files (at)",
    )


_EVENT_COLUMNS = "seq, conversation, kind, message_id, body, at"


def _event(row: Any) -> Event:
    seq, conversation, kind, message_id, body, at = row
    data = json.loads(body)
    return Event(
        seq=int(seq),
        conversation=int(conversation),
        kind=str(kind),
        message_id=str(message_id),
        text=str(data.get("text", "")),
        at=float(at),
        files=tuple(FileRef.from_json(f) for f in data.get("files") or ()),
        error=bool(data.get("error")),
    )


def reply_key(reply_to: str, text: str, files: tuple[NewFile, ...]) -> str | None:
    """What makes a reply the same reply: the message it answers and what it says."""
    if not reply_to:
        return None  # a notice that answers nothing (an approval): logged each time
    digest = hashlib.sha256(text.encode("utf-8"))
    for file in files:
        digest.update(
            b"\0" + file.name.encode("utf-8") + b"\0" + hashlib.sha256(file.data).digest()
        )
    return f"r:{reply_to}:{digest.hexdigest()[:32]}"


class _Statements:
    """The store's operations on one connection, whatever the database: SQLite's `?`
    placeholders become PostgreSQL's `%s`, and the visitor's row is locked with
    `FOR UPDATE` there (SQLite's write transaction already holds the whole file)."""

    def __init__(self, postgres: bool, clock: Any) -> None:
        self._postgres = postgres
        self._clock = clock

    def sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self._postgres else statement

    def signing_key(self, conn: Any, fresh: str) -> str:
        conn.execute(
            self.sql(
                "INSERT INTO gw_webchat_keys (name, value) VALUES ('cookie', ?) "
                "ON CONFLICT (name) DO NOTHING"
            ),
            (fresh,),
        )
        row = conn.execute("SELECT value FROM gw_webchat_keys WHERE name = 'cookie'").fetchone()
        return str(row[0])

    def state(self, conn: Any, visitor: str) -> VisitorState:
        row = conn.execute(
            self.sql("SELECT last_seq, conversation FROM gw_webchat_visitors WHERE visitor = ?"),
            (visitor,),
        ).fetchone()
        if row is None:
            return VisitorState()
        return VisitorState(int(row[0]), int(row[1]), known=True)

    def _lock_visitor(self, conn: Any, visitor: str) -> tuple[int, int]:
        """The visitor's (last seq, conversation), its row locked until the commit."""
        now = self._clock()
        conn.execute(
            self.sql(
                "INSERT INTO gw_webchat_visitors (visitor, last_seq, conversation, seen_at) "
                "VALUES (?, 0, 1, ?) ON CONFLICT (visitor) DO NOTHING"
            ),
            (visitor, now),
        )
        lock = " FOR UPDATE" if self._postgres else ""
        row = conn.execute(
            self.sql(
                f"SELECT last_seq, conversation FROM gw_webchat_visitors WHERE visitor = ?{lock}"
            ),
            (visitor,),
        ).fetchone()
        return int(row[0]), int(row[1])

    def _by_dedupe(self, conn: Any, visitor: str, dedupe: str) -> Event | None:
        row = conn.execute(
            self.sql(
                f"SELECT {_EVENT_COLUMNS} FROM gw_webchat_events WHERE visitor = ? AND dedupe = ?"
            ),
            (visitor, dedupe),
        ).fetchone()
        return _event(row) if row is not None else None

    def message_event(self, conn: Any, visitor: str, message_id: str) -> Event | None:
        return self._by_dedupe(conn, visitor, f"m:{message_id}")

    def _append(
        self,
        conn: Any,
        visitor: str,
        seq: int,
        conversation: int,
        kind: str,
        dedupe: str | None,
        message_id: str,
        body: dict[str, Any],
        *,
        current: int,
    ) -> Event:
        """Log one event in `conversation`; the visitor's current one is then `current`."""
        now = self._clock()
        conn.execute(
            self.sql(
                "UPDATE gw_webchat_visitors SET last_seq = ?, conversation = ?, seen_at = ? "
                "WHERE visitor = ?"
            ),
            (seq, current, now, visitor),
        )
        conn.execute(
            self.sql(
                "INSERT INTO gw_webchat_events (visitor, seq, conversation, kind, dedupe, "
                "message_id, body, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            ),
            (visitor, seq, conversation, kind, dedupe, message_id, json.dumps(body), now),
        )
        conn.execute(
            self.sql(
                "INSERT INTO gw_webchat_conversations (visitor, conversation, title, started_at) "
                "VALUES (?, ?, '', ?) ON CONFLICT (visitor, conversation) DO NOTHING"
            ),
            (visitor, conversation, now),
        )
        return _event((seq, conversation, kind, message_id, json.dumps(body), now))

    def add_message(
        self,
        conn: Any,
        visitor: str,
        message_id: str,
        text: str,
        files: tuple[FileRef, ...],
        new_conversation: bool,
        title: str,
    ) -> tuple[Event, bool]:
        last, conversation = self._lock_visitor(conn, visitor)
        found = self.message_event(conn, visitor, message_id)
        if found is not None:
            return found, False
        if new_conversation:
            conversation += 1
        body = {"text": text, "files": [f.to_json() for f in files]}
        event = self._append(
            conn,
            visitor,
            last + 1,
            conversation,
            MESSAGE,
            f"m:{message_id}",
            message_id,
            body,
            current=conversation,
        )
        if title:
            conn.execute(
                self.sql(
                    "UPDATE gw_webchat_conversations SET title = ? "
                    "WHERE visitor = ? AND conversation = ? AND title = ''"
                ),
                (title[:TITLE_CHARS], visitor, conversation),
            )
        return event, True

    def add_reply(
        self,
        conn: Any,
        visitor: str,
        reply_to: str,
        text: str,
        files: tuple[NewFile, ...],
        error: bool,
    ) -> Event | None:
        last, current = self._lock_visitor(conn, visitor)
        dedupe = reply_key(reply_to, text, files)
        if dedupe is not None and self._by_dedupe(conn, visitor, dedupe) is not None:
            return None
        conversation = current
        if reply_to:
            asked = self.message_event(conn, visitor, reply_to)
            if asked is not None:
                conversation = asked.conversation
        refs = [self.save_file(conn, visitor, file) for file in files]
        body = {"text": text, "files": [r.to_json() for r in refs], "error": error}
        return self._append(
            conn, visitor, last + 1, conversation, REPLY, dedupe, reply_to, body, current=current
        )

    def events_after(self, conn: Any, visitor: str, after: int, limit: int) -> list[Event]:
        rows = conn.execute(
            self.sql(
                f"SELECT {_EVENT_COLUMNS} FROM gw_webchat_events WHERE visitor = ? AND seq > ? "
                "ORDER BY seq LIMIT ?"
            ),
            (visitor, after, limit),
        ).fetchall()
        return [_event(r) for r in rows]

    def conversation_events(
        self, conn: Any, visitor: str, conversation: int, limit: int
    ) -> list[Event]:
        rows = conn.execute(
            self.sql(
                f"SELECT {_EVENT_COLUMNS} FROM gw_webchat_events "
                "WHERE visitor = ? AND conversation = ? ORDER BY seq DESC LIMIT ?"
            ),
            (visitor, conversation, limit),
        ).fetchall()
        return [_event(r) for r in reversed(rows)]

    def conversations(self, conn: Any, visitor: str, limit: int) -> list[Conversation]:
        rows = conn.execute(
            self.sql(
                "SELECT conversation, title, started_at FROM gw_webchat_conversations "
                "WHERE visitor = ? ORDER BY conversation DESC LIMIT ?"
            ),
            (visitor, limit),
        ).fetchall()
        return [Conversation(int(n), str(title), float(at)) for n, title, at in rows]

    def save_file(self, conn: Any, visitor: str, file: NewFile) -> FileRef:
        ref = FileRef(secrets.token_urlsafe(16), file.name, file.mime, len(file.data))
        conn.execute(
            self.sql(
                "INSERT INTO gw_webchat_files (id, visitor, name, mime, size, data, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)"
            ),
            (ref.id, visitor, ref.name, ref.mime, ref.size, file.data, self._clock()),
        )
        return ref

    def file(self, conn: Any, file_id: str) -> StoredFile | None:
        row = conn.execute(
            self.sql("SELECT visitor, name, mime, size, data FROM gw_webchat_files WHERE id = ?"),
            (file_id,),
        ).fetchone()
        if row is None:
            return None
        visitor, name, mime, size, data = row
        return StoredFile(
            FileRef(file_id, str(name), str(mime), int(size)), str(visitor), bytes(data)
        )

    def file_info(self, conn: Any, file_id: str) -> StoredFile | None:
        row = conn.execute(
            self.sql("SELECT visitor, name, mime, size FROM gw_webchat_files WHERE id = ?"),
            (file_id,),
        ).fetchone()
        if row is None:
            return None
        visitor, name, mime, size = row
        return StoredFile(FileRef(file_id, str(name), str(mime), int(size)), str(visitor), b"")

    def purge(self, conn: Any, before: float, visitors_before: float) -> int:
        removed = 0
        for statement in (
            "DELETE FROM gw_webchat_events WHERE at < ?",
            "DELETE FROM gw_webchat_files WHERE at < ?",
            "DELETE FROM gw_webchat_conversations WHERE started_at < ? AND NOT EXISTS ("
            "SELECT 1 FROM gw_webchat_events e WHERE e.visitor = gw_webchat_conversations.visitor "
            "AND e.conversation = gw_webchat_conversations.conversation)",
        ):
            removed += conn.execute(self.sql(statement), (before,)).rowcount or 0
        # A visitor's numbering starts again at 1 only once no cookie of theirs can be
        # alive: a page open since may still hold a position in the old one.
        conn.execute(
            self.sql(
                "DELETE FROM gw_webchat_visitors WHERE seen_at < ? AND NOT EXISTS ("
                "SELECT 1 FROM gw_webchat_events e WHERE e.visitor = gw_webchat_visitors.visitor)"
            ),
            (visitors_before,),
        )
        return removed


def _create_schema(conn: sqlite3.Connection) -> None:
    for statement in schema("BLOB"):
        conn.execute(statement)


class FileWebChatStore:
    """The store in a SQLite file of the workspace (WAL; a commit survives a crash, and
    with `durable` a reply's commit is fsynced)."""

    def __init__(
        self,
        path: Path,
        *,
        durable: bool = True,
        io_on_loop: bool = True,
        clock: Any = time.time,
    ) -> None:
        self.path = path
        self._durable = durable
        self._db = SqliteFile(path, what="webchat", init=_create_schema, io_on_loop=io_on_loop)
        self._q = _Statements(postgres=False, clock=clock)

    async def _write(self, fn: Any) -> Any:
        ran, result = self._db.try_transaction_nowait(fn)
        return result if ran else await self._db.transaction(fn)

    async def _read(self, fn: Any) -> Any:
        ran, result = self._db.try_run_nowait(fn)
        return result if ran else await self._db.run(fn)

    async def signing_key(self, fresh: str) -> str:
        return str(await self._db.transaction(lambda c: self._q.signing_key(c, fresh)))

    async def state(self, visitor: str) -> VisitorState:
        found: VisitorState = await self._read(lambda c: self._q.state(c, visitor))
        return found

    async def message_event(self, visitor: str, message_id: str) -> Event | None:
        found: Event | None = await self._read(
            lambda c: self._q.message_event(c, visitor, message_id)
        )
        return found

    async def add_message(
        self,
        visitor: str,
        message_id: str,
        text: str,
        files: tuple[FileRef, ...],
        *,
        new_conversation: bool,
        title: str,
    ) -> tuple[Event, bool]:
        done: tuple[Event, bool] = await self._write(
            lambda c: self._q.add_message(
                c, visitor, message_id, text, files, new_conversation, title
            )
        )
        return done

    async def add_reply(
        self,
        visitor: str,
        reply_to: str,
        text: str,
        files: tuple[NewFile, ...],
        *,
        error: bool = False,
    ) -> Event | None:
        def add(conn: sqlite3.Connection) -> Event | None:
            return self._q.add_reply(conn, visitor, reply_to, text, files, error)

        if self._durable or files:
            found: Event | None = await self._db.transaction(add, durable=self._durable)
            return found
        found = await self._write(add)
        return found

    async def events_after(self, visitor: str, after: int, limit: int) -> list[Event]:
        found: list[Event] = await self._read(
            lambda c: self._q.events_after(c, visitor, after, limit)
        )
        return found

    async def conversation_events(self, visitor: str, conversation: int, limit: int) -> list[Event]:
        found: list[Event] = await self._read(
            lambda c: self._q.conversation_events(c, visitor, conversation, limit)
        )
        return found

    async def conversations(self, visitor: str, limit: int) -> list[Conversation]:
        found: list[Conversation] = await self._read(
            lambda c: self._q.conversations(c, visitor, limit)
        )
        return found

    async def save_file(self, visitor: str, file: NewFile) -> FileRef:
        # In a worker thread: a file of megabytes must not hold up the loop.
        ref: FileRef = await self._db.transaction(lambda c: self._q.save_file(c, visitor, file))
        return ref

    async def file(self, file_id: str) -> StoredFile | None:
        found: StoredFile | None = await self._db.run(lambda c: self._q.file(c, file_id))
        return found

    async def file_info(self, file_id: str) -> StoredFile | None:
        found: StoredFile | None = await self._read(lambda c: self._q.file_info(c, file_id))
        return found

    async def purge(self, before: float, *, visitors_before: float) -> int:
        return int(await self._db.transaction(lambda c: self._q.purge(c, before, visitors_before)))

    async def aclose(self) -> None:
        await self._db.aclose()


class PostgresWebChatStore:
    """The store in PostgreSQL (`gw_webchat_*`), shared by every replica; each call is one
    transaction in a worker thread. The tables are made on first use (under an advisory
    lock, so replicas starting together do not race)."""

    def __init__(self, pool: ConnectionPool, *, clock: Any = time.time) -> None:
        self._pool = pool
        self._q = _Statements(postgres=True, clock=clock)
        self._ready = False

    def _run(self, fn: Any) -> Any:
        import psycopg
        from psycopg_pool import PoolTimeout

        from gateway.plumbing.postgres import StorageUnavailable

        try:
            with self._pool.connection() as conn:
                if not self._ready:
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(hashtext('gw_webchat_schema'))")
                        for statement in schema("bytea"):
                            conn.execute(statement)
                    self._ready = True
                with conn.transaction():
                    return fn(conn)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise StorageUnavailable(f"PostgreSQL does not answer ({exc})") from None

    async def _call(self, fn: Any) -> Any:
        return await anyio.to_thread.run_sync(self._run, fn)

    async def signing_key(self, fresh: str) -> str:
        return str(await self._call(lambda c: self._q.signing_key(c, fresh)))

    async def state(self, visitor: str) -> VisitorState:
        found: VisitorState = await self._call(lambda c: self._q.state(c, visitor))
        return found

    async def message_event(self, visitor: str, message_id: str) -> Event | None:
        found: Event | None = await self._call(
            lambda c: self._q.message_event(c, visitor, message_id)
        )
        return found

    async def add_message(
        self,
        visitor: str,
        message_id: str,
        text: str,
        files: tuple[FileRef, ...],
        *,
        new_conversation: bool,
        title: str,
    ) -> tuple[Event, bool]:
        done: tuple[Event, bool] = await self._call(
            lambda c: self._q.add_message(
                c, visitor, message_id, text, files, new_conversation, title
            )
        )
        return done

    async def add_reply(
        self,
        visitor: str,
        reply_to: str,
        text: str,
        files: tuple[NewFile, ...],
        *,
        error: bool = False,
    ) -> Event | None:
        found: Event | None = await self._call(
            lambda c: self._q.add_reply(c, visitor, reply_to, text, files, error)
        )
        return found

    async def events_after(self, visitor: str, after: int, limit: int) -> list[Event]:
        found: list[Event] = await self._call(
            lambda c: self._q.events_after(c, visitor, after, limit)
        )
        return found

    async def conversation_events(self, visitor: str, conversation: int, limit: int) -> list[Event]:
        found: list[Event] = await self._call(
            lambda c: self._q.conversation_events(c, visitor, conversation, limit)
        )
        return found

    async def conversations(self, visitor: str, limit: int) -> list[Conversation]:
        found: list[Conversation] = await self._call(
            lambda c: self._q.conversations(c, visitor, limit)
        )
        return found

    async def save_file(self, visitor: str, file: NewFile) -> FileRef:
        ref: FileRef = await self._call(lambda c: self._q.save_file(c, visitor, file))
        return ref

    async def file(self, file_id: str) -> StoredFile | None:
        found: StoredFile | None = await self._call(lambda c: self._q.file(c, file_id))
        return found

    async def file_info(self, file_id: str) -> StoredFile | None:
        found: StoredFile | None = await self._call(lambda c: self._q.file_info(c, file_id))
        return found

    async def purge(self, before: float, *, visitors_before: float) -> int:
        return int(await self._call(lambda c: self._q.purge(c, before, visitors_before)))

    async def aclose(self) -> None:
        return None  # the pool is the process's (`gateway.storage.shared.shared_connections`)


def _durable(settings: Settings | PartialSettings) -> bool:
    """A reply's commit is fsynced unless the sessions' own appends are not either."""
    try:
        return str(settings.sessions.fsync) != "never"
    except AttributeError:  # a command that did not load [sessions]
        return True


#: Both of the channel's stores, for the storage seam to open the one of its mode
#: (`gateway.storage.seam.Storage.open`).
BACKENDS: Backends[WebChatStore] = Backends(
    files=lambda settings: FileWebChatStore(
        settings.workspace_path / STORE_FILE,
        durable=_durable(settings),
        io_on_loop=settings.io_on_loop,
    ),
    postgresql=lambda db: PostgresWebChatStore(db.sync),
)
