"""What the WhatsApp channel remembers besides the journal: when each person last wrote
(the 24-hour customer-service window), every message it sent with its delivery status
(the WhatsApp outbox), and the replies it had to keep as undeliverable.

One SQL schema, two places: `whatsapp.sqlite` in the workspace (the file mode) and
PostgreSQL tables `gw_whatsapp_*` shared by every replica (migrations/NNNN_whatsapp.sql), so a reply
sent from any replica sees the window a message taken in by another opened, and a status
callback delivered to any replica updates the message wherever it was sent.

Promises (tested in tests/test_whatsapp_store.py, both modes):
- a window only moves forward: a redelivered or late old message never shortens it;
- a message's status only moves forward (accepted < sent < failed < delivered < read: a
  message delivered to one device stays delivered when another device's failure comes
  later), so a status callback Meta sends again, or out of order, changes nothing, and
  `update_status` says "changed" once per status, on whichever replica gets it first;
- a status that arrives before its message was recorded is kept and found by
  `record_sent`, which returns it (the sender then handles a failure it missed);
- a held reply is claimed for a template by one caller only (`claim_template`), and a
  part held after its reply was sent as a template is marked so, not held again.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio.to_thread

from gateway.fsutil import SqliteFile
from gateway.plumbing.backends import Backends

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

#: The store's file in the workspace (the file mode).
STORE_FILE = "whatsapp.sqlite"
#: Sent messages, windows and held replies are forgotten after this long.
RETENTION_SECONDS = 30 * 24 * 3600.0
_PURGE_EVERY = 500  # records between two purges

#: How far each status is along; a status never moves back.
STATUS_RANK = {"accepted": 0, "sent": 1, "failed": 2, "delivered": 3, "read": 4}

HELD, TEMPLATED = "held", "templated"


@dataclass(frozen=True, slots=True)
class LastInbound:
    """The person's newest message in a conversation: its platform time and id."""

    at: float
    message_id: str


@dataclass(frozen=True, slots=True)
class SentMessage:
    """A message the channel sent (or a status for one it has not recorded yet: then
    `chat` and `body` are empty). `kind` is text, template, image or document; `body` the
    text sent (a part, a caption, the template's parameter); the parts of one reply share
    `reply_id`."""

    wamid: str
    chat: str = ""
    session_key: str = ""
    kind: str = ""
    body: str = ""
    reply_id: str = ""
    part: int = 0
    sent_at: float = 0.0
    status: str = "accepted"
    error_code: int | None = None
    error: str = ""

    @property
    def recorded(self) -> bool:
        return bool(self.chat)


@dataclass(frozen=True, slots=True)
class HeldReply:
    """A reply (or a part of one) that could not be delivered and is kept, with why."""

    reply_id: str
    part: int
    chat: str
    session_key: str
    text: str
    reason: str
    held_at: float
    state: str = HELD


class WhatsAppStore(Protocol):
    """The channel's own state; see the module docstring."""

    async def note_inbound(self, chat: str, message_id: str, at: float) -> None: ...

    async def last_inbound(self, chat: str) -> LastInbound | None: ...

    async def record_sent(self, sent: SentMessage) -> SentMessage:
        """Keep `sent`; the row as stored (its status may be a later one that came first)."""
        ...

    async def update_status(
        self, wamid: str, status: str, error_code: int | None, error: str
    ) -> SentMessage | None:
        """Move `wamid` on to `status`: the row when that changed it, else None."""
        ...

    async def sent(self, wamid: str) -> SentMessage | None: ...

    async def hold(self, held: HeldReply) -> None: ...

    async def claim_template(self, reply_id: str) -> bool:
        """True for the one caller that may send the reply's template now."""
        ...

    async def release_template(self, reply_id: str, why: str) -> None:
        """The template could not be sent: the reply is held again, `why` added."""
        ...

    async def held(self, limit: int = 100) -> list[HeldReply]:
        """Held replies (not sent as a template), newest first."""
        ...

    async def held_count(self) -> int: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------- the SQL

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS gw_whatsapp_windows (
        chat text PRIMARY KEY,
        last_inbound double precision NOT NULL,
        message_id text NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS gw_whatsapp_sent (
        wamid text PRIMARY KEY,
        chat text NOT NULL DEFAULT '',
        session_key text NOT NULL DEFAULT '',
        kind text NOT NULL DEFAULT '',
        body text NOT NULL DEFAULT '',
        reply_id text NOT NULL DEFAULT '',
        part integer NOT NULL DEFAULT 0,
        sent_at double precision NOT NULL DEFAULT 0,
        status text NOT NULL,
        status_rank integer NOT NULL,
        error_code integer,
        error text NOT NULL DEFAULT '',
        updated_at double precision NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS gw_whatsapp_sent_updated ON gw_whatsapp_sent (updated_at)",
    """CREATE TABLE IF NOT EXISTS gw_whatsapp_held (
        reply_id text NOT NULL,
        part integer NOT NULL,
        chat text NOT NULL,
        session_key text NOT NULL,
        text text NOT NULL,
        reason text NOT NULL,
        held_at double precision NOT NULL,
        state text NOT NULL,
        PRIMARY KEY (reply_id, part)
    )""",
    "CREATE INDEX IF NOT EXISTS gw_whatsapp_held_state ON gw_whatsapp_held (state, held_at)",
)

_SENT_COLUMNS = (
    "wamid, chat, session_key, kind, body, reply_id, part, sent_at, status, error_code, error"
)
_HELD_COLUMNS = "reply_id, part, chat, session_key, text, reason, held_at, state"

_NOTE_INBOUND = (
    "INSERT INTO gw_whatsapp_windows (chat, last_inbound, message_id) VALUES (?, ?, ?) "
    "ON CONFLICT (chat) DO UPDATE SET last_inbound = excluded.last_inbound, "
    "message_id = excluded.message_id "
    "WHERE excluded.last_inbound >= gw_whatsapp_windows.last_inbound"
)
_LAST_INBOUND = "SELECT last_inbound, message_id FROM gw_whatsapp_windows WHERE chat = ?"
_RECORD_SENT = (
    "INSERT INTO gw_whatsapp_sent (wamid, chat, session_key, kind, body, reply_id, part, "
    "sent_at, status, status_rank, error_code, error, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'accepted', 0, NULL, '', ?) "
    "ON CONFLICT (wamid) DO UPDATE SET chat = excluded.chat, "
    "session_key = excluded.session_key, kind = excluded.kind, body = excluded.body, "
    "reply_id = excluded.reply_id, part = excluded.part, sent_at = excluded.sent_at "
    f"RETURNING {_SENT_COLUMNS}"
)
_UPDATE_STATUS = (
    "INSERT INTO gw_whatsapp_sent (wamid, status, status_rank, error_code, error, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (wamid) DO UPDATE SET status = excluded.status, "
    "status_rank = excluded.status_rank, error_code = excluded.error_code, "
    "error = excluded.error, updated_at = excluded.updated_at "
    "WHERE excluded.status_rank > gw_whatsapp_sent.status_rank "
    f"RETURNING {_SENT_COLUMNS}"
)
_SENT = f"SELECT {_SENT_COLUMNS} FROM gw_whatsapp_sent WHERE wamid = ?"
_HOLD = (
    f"INSERT INTO gw_whatsapp_held ({_HELD_COLUMNS}) "
    "SELECT ?, ?, ?, ?, ?, ?, ?, CASE WHEN EXISTS (SELECT 1 FROM gw_whatsapp_held "
    f"WHERE reply_id = ? AND state = '{TEMPLATED}') THEN '{TEMPLATED}' ELSE '{HELD}' END "
    # SQLite needs a WHERE in an INSERT ... SELECT before ON CONFLICT (a parsing rule).
    "WHERE true ON CONFLICT (reply_id, part) DO NOTHING"
)
_CLAIM = (
    f"UPDATE gw_whatsapp_held SET state = '{TEMPLATED}' "
    f"WHERE reply_id = ? AND state = '{HELD}' RETURNING part"
)
_RELEASE = f"UPDATE gw_whatsapp_held SET state = '{HELD}', reason = reason || ? WHERE reply_id = ?"
_HELD_LIST = (
    f"SELECT {_HELD_COLUMNS} FROM gw_whatsapp_held WHERE state = '{HELD}' "
    "ORDER BY held_at DESC, part LIMIT ?"
)
_HELD_COUNT = f"SELECT count(*) FROM gw_whatsapp_held WHERE state = '{HELD}'"
_PURGE = (
    "DELETE FROM gw_whatsapp_sent WHERE updated_at < ?",
    "DELETE FROM gw_whatsapp_held WHERE held_at < ?",
    "DELETE FROM gw_whatsapp_windows WHERE last_inbound < ?",
)


def _sent(row: Any) -> SentMessage:
    wamid, chat, key, kind, body, reply_id, part, sent_at, status, code, error = row
    return SentMessage(
        str(wamid),
        str(chat),
        str(key),
        str(kind),
        str(body),
        str(reply_id),
        int(part),
        float(sent_at),
        str(status),
        int(code) if code is not None else None,
        str(error),
    )


def _held(row: Any) -> HeldReply:
    reply_id, part, chat, key, text, reason, held_at, state = row
    return HeldReply(
        str(reply_id), int(part), str(chat), str(key), str(text), str(reason), float(held_at), state
    )


class _Statements:
    """The store's operations over one connection-running function, whatever the
    database: SQLite's `?` placeholders become PostgreSQL's `%s`."""

    def __init__(self, postgres: bool, clock: Any) -> None:
        self._postgres = postgres
        self._clock = clock
        self._records = 0

    def sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self._postgres else statement

    def note_inbound(self, conn: Any, chat: str, message_id: str, at: float) -> None:
        conn.execute(self.sql(_NOTE_INBOUND), (chat, at, message_id))

    def last_inbound(self, conn: Any, chat: str) -> LastInbound | None:
        row = conn.execute(self.sql(_LAST_INBOUND), (chat,)).fetchone()
        return LastInbound(float(row[0]), str(row[1])) if row is not None else None

    def record_sent(self, conn: Any, s: SentMessage) -> SentMessage:
        now = self._clock()
        row = conn.execute(
            self.sql(_RECORD_SENT),
            (s.wamid, s.chat, s.session_key, s.kind, s.body, s.reply_id, s.part, s.sent_at, now),
        ).fetchone()
        self._records += 1
        if self._records % _PURGE_EVERY == 0:
            for statement in _PURGE:
                conn.execute(self.sql(statement), (now - RETENTION_SECONDS,))
        return _sent(row)

    def update_status(
        self, conn: Any, wamid: str, status: str, code: int | None, error: str
    ) -> SentMessage | None:
        rank = STATUS_RANK.get(status)
        if rank is None:
            return None
        row = conn.execute(
            self.sql(_UPDATE_STATUS), (wamid, status, rank, code, error, self._clock())
        ).fetchone()
        return _sent(row) if row is not None else None

    def sent(self, conn: Any, wamid: str) -> SentMessage | None:
        row = conn.execute(self.sql(_SENT), (wamid,)).fetchone()
        return _sent(row) if row is not None else None

    def hold(self, conn: Any, h: HeldReply) -> None:
        conn.execute(
            self.sql(_HOLD),
            (h.reply_id, h.part, h.chat, h.session_key, h.text, h.reason, h.held_at, h.reply_id),
        )

    def claim(self, conn: Any, reply_id: str) -> bool:
        return bool(conn.execute(self.sql(_CLAIM), (reply_id,)).fetchall())

    def release(self, conn: Any, reply_id: str, why: str) -> None:
        conn.execute(self.sql(_RELEASE), (f"; {why}", reply_id))

    def held(self, conn: Any, limit: int) -> list[HeldReply]:
        return [_held(r) for r in conn.execute(self.sql(_HELD_LIST), (limit,)).fetchall()]

    def held_count(self, conn: Any) -> int:
        return int(conn.execute(self.sql(_HELD_COUNT)).fetchone()[0])


def _create_schema(conn: sqlite3.Connection) -> None:
    for statement in SCHEMA:
        conn.execute(statement)


class FileWhatsAppStore:
    """The store in a SQLite file of the workspace (WAL; a commit survives a crash)."""

    def __init__(self, path: Path, *, io_on_loop: bool = True, clock: Any = time.time) -> None:
        self.path = path
        self._db = SqliteFile(path, what="whatsapp", init=_create_schema, io_on_loop=io_on_loop)
        self._q = _Statements(postgres=False, clock=clock)

    async def _write(self, fn: Any) -> Any:
        ran, result = self._db.try_transaction_nowait(fn)
        return result if ran else await self._db.transaction(fn)

    async def _read(self, fn: Any) -> Any:
        ran, result = self._db.try_run_nowait(fn)
        return result if ran else await self._db.run(fn)

    async def note_inbound(self, chat: str, message_id: str, at: float) -> None:
        await self._write(lambda c: self._q.note_inbound(c, chat, message_id, at))

    async def last_inbound(self, chat: str) -> LastInbound | None:
        found: LastInbound | None = await self._read(lambda c: self._q.last_inbound(c, chat))
        return found

    async def record_sent(self, sent: SentMessage) -> SentMessage:
        row: SentMessage = await self._write(lambda c: self._q.record_sent(c, sent))
        return row

    async def update_status(
        self, wamid: str, status: str, error_code: int | None, error: str
    ) -> SentMessage | None:
        row: SentMessage | None = await self._write(
            lambda c: self._q.update_status(c, wamid, status, error_code, error)
        )
        return row

    async def sent(self, wamid: str) -> SentMessage | None:
        row: SentMessage | None = await self._read(lambda c: self._q.sent(c, wamid))
        return row

    async def hold(self, held: HeldReply) -> None:
        await self._write(lambda c: self._q.hold(c, held))

    async def claim_template(self, reply_id: str) -> bool:
        return bool(await self._write(lambda c: self._q.claim(c, reply_id)))

    async def release_template(self, reply_id: str, why: str) -> None:
        await self._write(lambda c: self._q.release(c, reply_id, why))

    async def held(self, limit: int = 100) -> list[HeldReply]:
        rows: list[HeldReply] = await self._db.run(lambda c: self._q.held(c, limit))
        return rows

    async def held_count(self) -> int:
        return int(await self._db.run(self._q.held_count))

    async def aclose(self) -> None:
        await self._db.aclose()


class PostgresWhatsAppStore:
    """The store in PostgreSQL (`gw_whatsapp_*`), shared by every replica; each call is
    one transaction in a worker thread."""

    def __init__(self, pool: ConnectionPool, *, clock: Any = time.time) -> None:
        self._pool = pool
        self._q = _Statements(postgres=True, clock=clock)

    def _run(self, fn: Any) -> Any:
        import psycopg
        from psycopg_pool import PoolTimeout

        from gateway.plumbing.postgres import StorageUnavailable

        try:
            with self._pool.connection() as conn, conn.transaction():
                return fn(conn)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise StorageUnavailable(f"PostgreSQL does not answer ({exc})") from None

    async def _call(self, fn: Any) -> Any:
        return await anyio.to_thread.run_sync(self._run, fn)

    async def note_inbound(self, chat: str, message_id: str, at: float) -> None:
        await self._call(lambda c: self._q.note_inbound(c, chat, message_id, at))

    async def last_inbound(self, chat: str) -> LastInbound | None:
        found: LastInbound | None = await self._call(lambda c: self._q.last_inbound(c, chat))
        return found

    async def record_sent(self, sent: SentMessage) -> SentMessage:
        row: SentMessage = await self._call(lambda c: self._q.record_sent(c, sent))
        return row

    async def update_status(
        self, wamid: str, status: str, error_code: int | None, error: str
    ) -> SentMessage | None:
        row: SentMessage | None = await self._call(
            lambda c: self._q.update_status(c, wamid, status, error_code, error)
        )
        return row

    async def sent(self, wamid: str) -> SentMessage | None:
        row: SentMessage | None = await self._call(lambda c: self._q.sent(c, wamid))
        return row

    async def hold(self, held: HeldReply) -> None:
        await self._call(lambda c: self._q.hold(c, held))

    async def claim_template(self, reply_id: str) -> bool:
        return bool(await self._call(lambda c: self._q.claim(c, reply_id)))

    async def release_template(self, reply_id: str, why: str) -> None:
        await self._call(lambda c: self._q.release(c, reply_id, why))

    async def held(self, limit: int = 100) -> list[HeldReply]:
        rows: list[HeldReply] = await self._call(lambda c: self._q.held(c, limit))
        return rows

    async def held_count(self) -> int:
        return int(await self._call(self._q.held_count))

    async def aclose(self) -> None:
        return None  # the pool is the process's (`gateway.storage.shared.shared_connections`)


#: Both of the channel's stores, for the storage seam to open the one of its mode
#: (`gateway.storage.seam.Storage.open`).
BACKENDS: Backends[WhatsAppStore] = Backends(
    files=lambda settings: FileWhatsAppStore(
        settings.workspace_path / STORE_FILE, io_on_loop=settings.io_on_loop
    ),
    postgresql=lambda db: PostgresWhatsAppStore(db.sync),
)
