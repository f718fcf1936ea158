"""Sessions in PostgreSQL: the same append-only trees as the JSONL files, shared by replicas.

One row per session in ``gw_sessions`` (its header, its last sequence number) and one row
per entry in ``gw_session_entries``, whose ``body`` is the entry's JSON line verbatim (a
``json`` column keeps the text as written), so an export gives the same JSONL as a file.

Promises kept here, as the file store keeps them:
- Append-only: an entry row is only ever inserted, at ``last_seq + 1``; nothing updates or
  deletes one except an operator's explicit delete of a whole session.
- Replicas share a session safely: an entry's ``parent_id`` is chosen from the session
  as it stands under the session row's lock. `PostgresSessionStore.append` first builds
  the entry from the tree it holds and sends it with the ``(session_id, last_seq)`` that
  tree reflects to ``gw_append_entry`` (migration 0006), which locks the row and stores
  the entry only if nothing was appended since: one round trip when this replica is the
  session's only writer, as the lease makes it. Otherwise it locks the row
  (``SELECT ... FOR UPDATE``), reads what other writers appended, builds the entry again
  and commits; a session reset elsewhere (another current row for the key) is loaded
  afresh, as a file replaced underneath is reopened.
- An acknowledged append is durable: `append` returns after PostgreSQL committed it.
- Fenced: inside a turn, every write names the epoch of the turn's session lease
  (`gateway.plumbing.fence`) and is refused (`FencedOut`, nothing written) once another
  replica holds the session; the one-statement append carries it in that statement.
- A damaged row is skipped, counted in the load report and kept.

The calls block on the network: the manager runs them in worker threads, as it does
with a file store whose fast path cannot be taken. The exceptions are a turn's own steps,
when the gateway gave the sessions a connection of its event-loop pool (the inbound
journal's, `PostgresSessions.aconnect`): `aappend` (the one-round-trip append, or a new
key's session created with its first entry in one statement) and `aload_nowait` (a cached
session checked current, or a new key seen without a row) run on the loop, one round
trip each; whatever finds another writer's work to read goes to the worker thread's
locking path. A worker thread per step costs little CPU but much latency under load:
each wake-up of a thread waits for the busy event loop to hand over the GIL (up to the
5 ms switch interval, several times per round trip). Measured with `bench/replicas.py`'s
latency run (one replica, 50 turns/s): p99 45-120 ms over five runs with three thread
hops per turn, 26-39 ms with none; CPU per turn 11.8-12.0 ms, then 10.2 ms.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from gateway.logs import logger
from gateway.plumbing import fence
from gateway.sessions.entries import Entry, SessionHeader, entry_from_dict
from gateway.sessions.errors import SessionError, SessionExistsError
from gateway.sessions.outputs import HANDLE, encode_output, new_handle
from gateway.sessions.store import EntryFactory, LoadReport, build_entry, encode_line, new_header
from gateway.sessions.tree import SessionTree
from gateway.usage.pg_store import riding_rows

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

E = TypeVar("E", bound=Entry)

#: A connection of the event loop's pool, as `PostgresDedupeStore.connection` gives one.
AsyncConnect = Callable[[], AbstractAsyncContextManager["psycopg.AsyncConnection[Any]"]]

# The one-round-trip append (migrations 0006, 0010): the entry's seq, or NULL (nothing
# written) when the session moved on from the (session_id, last_seq) the tree reflects;
# behind the turn's fence (its lease's key and epoch, NULL outside a turn).
_APPEND_IF_CURRENT = (
    "SELECT gw_append_entry(%s, %s, %s, %s, %s, %s, %s::json, %s, %s, %s, %s::bigint)"
)

# A new key's session created with its first entry in one statement, behind the turn's
# fence; no row (nothing written) when the key has a current session already (another
# replica made it).
_CREATE_WITH_FIRST = """
WITH created AS (
    INSERT INTO gw_sessions (session_id, key, header, created_at, updated_at, last_seq, bytes)
    SELECT %s, %s, %s::json, %s, %s, 1, %s WHERE gw_fence(%s, %s::bigint)
    ON CONFLICT (key) WHERE archived_at IS NULL DO NOTHING
    RETURNING session_id)
INSERT INTO gw_session_entries (session_id, seq, entry_id, parent_id, type, body)
SELECT session_id, 1, %s, %s, %s, %s::json FROM created
RETURNING seq
"""


def _with_rider(sql: str, params: tuple[Any, ...]) -> tuple[str, tuple[Any, ...], Any]:
    """`sql` carrying the current turn's pending usage rows as a CTE of its own (written
    whatever the append finds: PostgreSQL runs every data-modifying CTE), with the
    parameters in order, and what to tell the outcome (None: nothing rides)."""
    rider = riding_rows()
    if rider is None:
        return sql, params, None
    ride_sql, ride_params, settle = rider
    body = sql.strip()
    if body.startswith("WITH "):
        body = body.removeprefix("WITH ")
        return f"WITH riding AS ({ride_sql}), {body}", ride_params + params, settle
    return f"WITH riding AS ({ride_sql}) {body}", ride_params + params, settle


_CURRENT = (
    "SELECT session_id, header::text, last_seq, bytes FROM gw_sessions "
    "WHERE key = %s AND archived_at IS NULL"
)


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A session row as a listing sees it (no entries read)."""

    key: str
    session_id: str
    created_at: float
    updated_at: float
    size_bytes: int
    entries: int
    archived_at: float | None = None


def _line(entry: Entry) -> str:
    return encode_line(entry)[:-1]  # the JSONL line without its newline


class PostgresSessionStore:
    """The session of one key in PostgreSQL; all methods hold ``lock`` (reentrant)."""

    def __init__(
        self,
        pool: ConnectionPool,
        key: str,
        *,
        header: SessionHeader | None = None,
        backend: PostgresSessions | None = None,
    ) -> None:
        self.lock = threading.RLock()
        self.key = key
        self._pool = pool
        self._backend = backend  # its `aconnect`, once the gateway sets it
        self._loop_busy = False  # a call of the event loop (`aappend`...) holds `lock`
        self._bad: list[int] = []
        self._start_fresh(header=header)

    def _start_fresh(
        self, *, header: SessionHeader | None = None, previous_session: str | None = None
    ) -> None:
        self._header_value = header
        self._previous_session = previous_session
        self._tree = SessionTree(self.key, f"postgresql:{self.key}")
        self._session_id: str | None = None  # the row the tree reflects, once stored
        self._seq = 0
        self._bytes = 0
        self._bad = []

    # -- state ------------------------------------------------------------------------

    @property
    def path(self) -> None:
        return None

    @property
    def header(self) -> SessionHeader:
        if self._header_value is None:
            self._header_value = new_header(self.key, previous_session=self._previous_session)
        return self._header_value

    @property
    def tree(self) -> SessionTree:
        return self._tree

    @property
    def on_disk(self) -> bool:
        return self._session_id is not None

    @property
    def persisted(self) -> bool:
        return self._session_id is not None

    @property
    def size(self) -> int:
        return self._bytes

    @property
    def report(self) -> LoadReport:
        return LoadReport(
            entries=len(self._tree),
            bad_lines=len(self._bad),
            bad_line_numbers=tuple(self._bad),
            started_fresh=self._session_id is None,
        )

    def _not_mid_loop_call(self) -> None:
        """Raise rather than change the tree under a call of the event loop that holds
        the store (`aappend`, `aload_nowait`) and awaits its round trip. Only the loop's
        own thread gets here then (the RLock holds others off): a second user of one
        session on the loop, which the agent never is."""
        if self._loop_busy:
            raise SessionError(f"session {self.key!r} is in use by a call of the event loop")

    # -- reading ----------------------------------------------------------------------

    def _sync(self, conn: psycopg.Connection[Any], row: tuple[Any, ...] | None) -> None:
        """Bring the tree up to the current row of the key (``row`` from `_CURRENT`)."""
        if row is None:
            if self._session_id is not None:  # deleted or reset elsewhere
                self._start_fresh()
            return
        session_id, header_text, last_seq, size = row
        if session_id != self._session_id:
            header = entry_from_dict(json.loads(header_text))
            if not isinstance(header, SessionHeader):
                raise SessionError(f"session {self.key!r}: the stored header is not a header")
            self._start_fresh(header=header)
            self._session_id = session_id
        if last_seq > self._seq:
            rows = conn.execute(
                # Up to the row's last_seq: outside a transaction, entries appended
                # since that row was read are picked up by the next sync, not twice.
                "SELECT seq, body::text FROM gw_session_entries "
                "WHERE session_id = %s AND seq > %s AND seq <= %s ORDER BY seq",
                (session_id, self._seq, last_seq),
            ).fetchall()
            first = self._seq + 1
            lines = [str(body) for _, body in rows]
            # Line numbers as in the JSONL export: the header is line 1, entry n line n+1.
            bad = self._tree.ingest_lines(lines, first + 1)
            if bad:
                self._bad.extend(n - 1 for n in bad)
                logger.bind(session_key=self.key).warning(
                    "session {}: {} stored entries are damaged and skipped (kept in the "
                    "database): seq {}",
                    self.key,
                    len(bad),
                    ", ".join(str(n - 1) for n in bad[:20]),
                )
            self._seq = int(last_seq)
            self._bytes = int(size)

    def load(self) -> None:
        """Read the key's current session (if any) into the tree."""
        with self.lock, self._pool.connection() as conn:
            self._not_mid_loop_call()
            self._sync(conn, conn.execute(_CURRENT, (self.key,)).fetchone())

    def refresh(self) -> None:
        """Pick up other replicas' appends; one indexed query when nothing changed."""
        self.load()

    async def aload_nowait(self) -> bool:
        """`load` on the event loop when it is one round trip (over the loop's pool): True
        when the tree is current, the key's row being the one it reflects with nothing
        appended since, or there being no row for a tree that holds nothing. False, and
        nothing changed, when entries must be read, the store is busy or there is no
        loop pool: then `load` in a worker thread does it."""
        aconnect = self._backend.aconnect if self._backend is not None else None
        if aconnect is None or self._loop_busy or not self.lock.acquire(blocking=False):
            return False
        self._loop_busy = True
        try:
            async with aconnect() as conn:
                cur = await conn.execute(_CURRENT, (self.key,))
                row = await cur.fetchone()
        finally:
            self._loop_busy = False
            self.lock.release()
        if row is None:
            return self._session_id is None and len(self._tree) == 0
        return row[0] == self._session_id and int(row[2]) == self._seq

    # -- writing ----------------------------------------------------------------------

    def _lock_current(self, conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
        """Lock the key's current row, creating it with our header when there is none
        (inside a transaction, which the turn's fence holds first)."""
        fence.check(conn)
        for _ in range(8):
            row = conn.execute(_CURRENT + " FOR UPDATE", (self.key,)).fetchone()
            if row is not None:
                return tuple(row)
            if self._session_id is not None:
                self._start_fresh()  # deleted or reset elsewhere: a new session
            header = self.header
            now = time.time()
            created = conn.execute(
                "INSERT INTO gw_sessions (session_id, key, header, created_at, updated_at) "
                "VALUES (%s, %s, %s::json, %s, %s) "
                "ON CONFLICT (key) WHERE archived_at IS NULL DO NOTHING RETURNING session_id",
                (header.id, self.key, _line(header), header.timestamp, now),
            ).fetchone()
            if created is not None:
                return (header.id, _line(header), 0, 0)
            # Another replica created the key's session first: lock and adopt that one.
        raise SessionError(f"session {self.key!r} keeps changing; try again")

    def append(self, factory: EntryFactory[E]) -> E:
        """Append one entry built by ``factory``; return it once PostgreSQL committed it."""
        with self.lock:
            self._not_mid_loop_call()
            known = self._session_id
            try:
                entry, seq, size = self._append_locked(factory)
            except BaseException:
                if known is None and self._session_id is not None:
                    # The row this store created was rolled back with the entry.
                    self._session_id = None
                raise
            # Committed: only now does the tree show it (a failed commit leaves no trace).
            self._tree.add(entry)
            self._seq = seq
            self._bytes += size
            return entry

    def _append_locked(self, factory: EntryFactory[E]) -> tuple[E, int, int]:
        if self._session_id is not None or len(self._tree) == 0:
            entry, size, sql, params = self._one_statement(factory)
            with self._pool.connection() as conn, fence.refusals():
                row = conn.execute(sql, params).fetchone()
            done = self._stored(entry, size, row)
            if done is not None:
                return done
        with self._pool.connection() as conn, fence.refusals(), conn.transaction():
            self._sync(conn, self._lock_current(conn))
            entry = build_entry(self._tree, factory)
            line = _line(entry)
            seq = self._seq + 1
            conn.execute(
                "INSERT INTO gw_session_entries "
                "(session_id, seq, entry_id, parent_id, type, body) "
                "VALUES (%s, %s, %s, %s, %s, %s::json)",
                (self._session_id, seq, entry.id, entry.parent_id, entry.type, line),
            )
            size = len(line.encode()) + 1
            conn.execute(
                "UPDATE gw_sessions SET last_seq = %s, bytes = bytes + %s, updated_at = %s "
                "WHERE session_id = %s",
                (seq, size, entry.timestamp, self._session_id),
            )
        return entry, seq, size

    def _one_statement(self, factory: EntryFactory[E]) -> tuple[E, int, str, tuple[Any, ...]]:
        """The entry built on the tree as it is, its size, and the one statement that
        stores it unless another writer got there first: `_APPEND_IF_CURRENT` for a
        stored session, `_CREATE_WITH_FIRST` (with the session's row and our header) for
        one not stored yet."""
        fenced = fence.params()  # raises at once for a fence found lost already
        # A new session's header first: its timestamp comes before its first entry's.
        header = self.header if self._session_id is None else None
        entry = build_entry(self._tree, factory)
        line = _line(entry)
        size = len(line.encode()) + 1
        if header is not None:
            created = (header.id, self.key, _line(header), header.timestamp, entry.timestamp)
            return entry, size, _CREATE_WITH_FIRST, (
                *created, size, *fenced, entry.id, entry.parent_id, entry.type, line,
            )  # fmt: skip
        return entry, size, _APPEND_IF_CURRENT, (
            self.key, self._session_id, self._seq,
            entry.id, entry.parent_id, entry.type, line, size, entry.timestamp, *fenced,
        )  # fmt: skip

    def _stored(
        self, entry: E, size: int, row: tuple[Any, ...] | None
    ) -> tuple[E, int, int] | None:
        """`_one_statement`'s outcome: the entry, its seq and size once stored (the new
        session's row adopted), None when nothing was written."""
        if row is None or row[0] is None:
            return None
        if self._session_id is None:
            self._session_id = self.header.id
        return entry, int(row[0]), size

    async def asettle(self) -> None:
        """Nothing to do: every append commits at once."""
        return None

    async def aappend(self, factory: EntryFactory[E], *, defer: bool = False) -> E:
        """`append` for the event loop. On the loop, one round trip over the loop's pool,
        when nothing else holds the store: the entry stored if the tree is current (or,
        for a session not stored yet, with the session's row if the key has none). In a
        worker thread otherwise, or when that found another writer's work to read.
        ``defer`` changes nothing: every append is one transaction, committed before
        this returns."""
        aconnect = self._backend.aconnect if self._backend is not None else None
        if (
            aconnect is None
            or (self._session_id is None and len(self._tree) > 0)
            or self._loop_busy
            # From the loop's thread: fails while a worker thread holds the store (the
            # flag above covers the loop's own coroutines, for which the RLock is no bar).
            or not self.lock.acquire(blocking=False)
        ):
            return await anyio.to_thread.run_sync(self.append, factory)
        self._loop_busy = True
        try:
            entry, size, sql, params = self._one_statement(factory)
            sql, params, settle = _with_rider(sql, params)
            # Carried through like the worker thread's append: a turn stopped meanwhile
            # does not leave the tree unsure of what was committed.
            try:
                with anyio.CancelScope(shield=True), fence.refusals():
                    async with aconnect() as conn:
                        cur = await conn.execute(sql, params)
                        row = await cur.fetchone()
            except BaseException:
                if settle is not None:
                    settle(False)
                raise
            if settle is not None:
                settle(True)
            done = self._stored(entry, size, row)
            if done is not None:
                self._tree.add(entry)
                self._seq = done[1]
                self._bytes += size
                return entry
        finally:
            self._loop_busy = False
            self.lock.release()
        # Another writer appended since the tree was read: the locking append catches up.
        return await anyio.to_thread.run_sync(self.append, factory)

    def create_with(self, entries: Sequence[Entry]) -> None:
        """Store a new session holding ``entries`` (a fork's copied branch, an import)."""
        with self.lock:
            self._not_mid_loop_call()
            if self._session_id is not None:
                raise SessionExistsError(f"a session already exists for key {self.key!r}")
            if not entries:
                return  # like any session: it is stored with its first entry
            header = self.header
            lines = [_line(e) for e in entries]
            size = sum(len(line.encode()) + 1 for line in lines)
            with self._pool.connection() as conn, fence.refusals(), conn.transaction():
                fence.check(conn)
                created = conn.execute(
                    "INSERT INTO gw_sessions "
                    "(session_id, key, header, created_at, updated_at, last_seq, bytes) "
                    "VALUES (%s, %s, %s::json, %s, %s, %s, %s) "
                    "ON CONFLICT (key) WHERE archived_at IS NULL DO NOTHING "
                    "RETURNING session_id",
                    (
                        header.id,
                        self.key,
                        _line(header),
                        header.timestamp,
                        max(header.timestamp, entries[-1].timestamp),
                        len(entries),
                        size,
                    ),
                ).fetchone()
                if created is None:
                    raise SessionExistsError(f"a session already exists for key {self.key!r}")
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO gw_session_entries "
                        "(session_id, seq, entry_id, parent_id, type, body) "
                        "VALUES (%s, %s, %s, %s, %s, %s::json)",
                        [
                            (header.id, n, e.id, e.parent_id, e.type, line)
                            for n, (e, line) in enumerate(zip(entries, lines, strict=True), 1)
                        ],
                    )
            for entry in entries:
                self._tree.add(entry)
            self._session_id = header.id
            self._seq = len(entries)
            self._bytes = size

    def flush(self) -> None:
        """Every append was committed already."""

    def close(self) -> None:
        """Nothing held open: connections go back to the pool after each call."""

    def archive(self) -> None:
        """Keep the current session's rows as archived and start a new session whose
        header names the old one as ``previous_session`` (``/new``)."""
        with self.lock, self._pool.connection() as conn, fence.refusals(), conn.transaction():
            self._not_mid_loop_call()
            fence.check(conn)
            # To the microsecond, as an archived file's name holds it: the session
            # survives `gateway storage export` and `import` with the same row.
            row = conn.execute(
                "UPDATE gw_sessions SET archived_at = %s "
                "WHERE key = %s AND archived_at IS NULL RETURNING session_id",
                (round(time.time(), 6), self.key),
            ).fetchone()
            if row is None:  # nothing stored: just a new session id
                self._start_fresh(previous_session=self.header.previous_session)
                return
            self._start_fresh(previous_session=str(row[0]))
            logger.bind(session_key=self.key).info("archived session {}", row[0])

    def export_jsonl(self) -> str:
        with self.lock:
            if self._session_id is None:
                return ""
            return "".join(export_lines(self._pool, self._session_id))

    def delete(self) -> bool:
        """Remove the key's current session and its entries; the store starts fresh."""
        with self.lock, self._pool.connection() as conn, fence.refusals(), conn.transaction():
            self._not_mid_loop_call()
            fence.check(conn)
            cur = conn.execute(
                "DELETE FROM gw_sessions WHERE key = %s AND archived_at IS NULL", (self.key,)
            )
            removed = bool(cur.rowcount > 0)
        self._start_fresh()
        return removed


class PostgresToolOutputs:
    """The shared mode's tool outputs (`gateway.sessions.outputs`): rows of
    ``gw_tool_outputs`` (migration 0016), the UTF-8 bytes of each output as they are (a
    ``bytea`` column: NUL and all), keyed by session key and handle. A row belongs to its
    session's row: deleting the session deletes it (ON DELETE CASCADE); archiving keeps it.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def put(self, key: str, session_id: str, text: str) -> str:
        """Store `text` behind the turn's fence (`FencedOut`, nothing stored, once
        another replica holds the session); its handle once committed."""
        import psycopg

        data = encode_output(text)
        for _ in range(8):
            handle = new_handle()
            try:
                with self._pool.connection() as conn, fence.refusals(), conn.transaction():
                    fence.check(conn)
                    row = conn.execute(
                        "INSERT INTO gw_tool_outputs "
                        "(session_key, handle, session_id, created_at, content) "
                        "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING handle",
                        (key, handle, session_id, time.time(), data),
                    ).fetchone()
            except psycopg.errors.ForeignKeyViolation:
                raise SessionError(
                    f"session {session_id} of {key!r} is not stored (deleted meanwhile?); "
                    "its tool output was not kept"
                ) from None
            if row is not None:
                return handle
        raise SessionError("could not find a free tool output handle; try again")

    def get(self, key: str, handle: str) -> str | None:
        if not HANDLE.fullmatch(handle):
            return None
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT content FROM gw_tool_outputs WHERE session_key = %s AND handle = %s",
                (key, handle),
            ).fetchone()
        return bytes(row[0]).decode("utf-8", errors="replace") if row is not None else None

    def delete_session(self, key: str, session_id: str) -> int:
        with self._pool.connection() as conn, fence.refusals(), conn.transaction():
            fence.check(conn)
            cur = conn.execute(
                "DELETE FROM gw_tool_outputs WHERE session_key = %s AND session_id = %s",
                (key, session_id),
            )
            return int(cur.rowcount)

    def copy_session(self, key: str, session_id: str, new_key: str, new_session_id: str) -> int:
        with self._pool.connection() as conn, fence.refusals(), conn.transaction():
            fence.check(conn)
            cur = conn.execute(
                "INSERT INTO gw_tool_outputs "
                "(session_key, handle, session_id, created_at, content) "
                "SELECT %s, handle, %s, created_at, content FROM gw_tool_outputs "
                "WHERE session_key = %s AND session_id = %s ON CONFLICT DO NOTHING",
                (new_key, new_session_id, key, session_id),
            )
            return int(cur.rowcount)


class PostgresSessions:
    """All sessions in one PostgreSQL database: opens stores, lists, exports."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        #: A connection of the event loop's pool for the turns' appends (`aappend`);
        #: None (every call in a worker thread) until the gateway gives one.
        self.aconnect: AsyncConnect | None = None

    def store(self, key: str, header: SessionHeader | None = None) -> PostgresSessionStore:
        return PostgresSessionStore(self.pool, key, header=header, backend=self)

    def outputs(self) -> PostgresToolOutputs:
        """The tool outputs kept beside these sessions."""
        return PostgresToolOutputs(self.pool)

    def ping(self) -> None:
        """One round trip; `StorageUnavailable` when PostgreSQL does not answer."""
        import psycopg
        from psycopg_pool import PoolTimeout

        from gateway.plumbing.postgres import StorageUnavailable

        try:
            with self.pool.connection(timeout=5.0) as conn:
                conn.execute("SELECT 1")
        except (psycopg.Error, PoolTimeout) as exc:
            raise StorageUnavailable(f"PostgreSQL does not answer ({exc})") from None

    def exists(self, key: str) -> bool:
        with self.pool.connection() as conn:
            return conn.execute(_CURRENT, (key,)).fetchone() is not None

    def list_sessions(self, *, archived: bool = False) -> list[StoredSession]:
        """Current sessions (with ``archived``, also the archived ones), most recently
        active first."""
        where = "" if archived else "WHERE archived_at IS NULL "
        with self.pool.connection() as conn:
            rows = conn.execute(
                "SELECT key, session_id, created_at, updated_at, bytes, last_seq, archived_at "
                f"FROM gw_sessions {where}ORDER BY updated_at DESC"
            ).fetchall()
        return [
            StoredSession(str(k), str(s), float(c), float(u), int(b), int(n), a)
            for k, s, c, u, b, n, a in rows
        ]

    def export_lines(self, session_id: str) -> list[str]:
        return export_lines(self.pool, session_id)


def export_lines(pool: ConnectionPool, session_id: str) -> list[str]:
    """A stored session's JSONL lines (header first), exactly as a session file holds them."""
    with pool.connection() as conn:
        return session_lines(conn, session_id)


def session_lines(conn: psycopg.Connection[Any], session_id: str) -> list[str]:
    """`export_lines` on one connection (inside the caller's transaction, its snapshot)."""
    header = conn.execute(
        "SELECT header::text FROM gw_sessions WHERE session_id = %s", (session_id,)
    ).fetchone()
    if header is None:
        raise SessionError(f"there is no stored session {session_id!r}")
    rows = conn.execute(
        "SELECT body::text FROM gw_session_entries WHERE session_id = %s ORDER BY seq",
        (session_id,),
    ).fetchall()
    return [str(header[0]) + "\n", *(str(body) + "\n" for (body,) in rows)]
