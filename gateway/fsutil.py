"""Private, crash-safe file primitives: the one home for how the gateway writes files.

Invariants:
- Files created here are mode 0600 and folders 0700 (conversations, memory, caches and
  pairing records are readable by the daemon's user only).
- `atomic_write_text` never leaves a half-written file under the target name: the new
  content is written to a temp file in the same folder, fsynced, then renamed over.
- `append_text` is one `write` in append mode: O(1) whatever the file's size.
- `create_exclusive` never overwrites an existing file.
- `open_sqlite` moves a file that is not a database aside (never deletes it) and opens
  a fresh one; busy, permission or disk errors are raised for the operator instead.
  The database's `-wal` and `-shm` files are 0600 too, whatever the process's umask.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import anyio
import anyio.to_thread

from gateway.logs import logger

_T = TypeVar("_T")

FILE_MODE = 0o600
DIR_MODE = 0o700


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with mode 0700; an existing folder is kept."""
    if path.is_dir():
        return
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    # mkdir's mode is filtered by the umask; state it explicitly.
    os.chmod(path, DIR_MODE)


def fsync_dir(path: Path) -> None:
    """Make a rename or a file creation inside `path` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` via temp file + fsync + rename (+ folder fsync)."""
    atomic_write_chunks(path, (data,))


def atomic_write_chunks(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """`atomic_write_bytes` of the chunks' concatenation, written one after the other
    (a large file made of arrays is never joined into one more copy in memory)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, FILE_MODE)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def append_text(path: Path, text: str, *, fsync: bool = False) -> int:
    """Append `text` in one write, creating the file (0600) if needed.

    If the file is non-empty and does not end with a newline, a newline is written
    first so the appended text starts on its own line. Returns the file's new size.
    """
    return append_bytes(path, text.encode("utf-8"), fsync=fsync).after.st_size


@dataclass(frozen=True, slots=True)
class Appended:
    """What `append_bytes` did: the file's status just before and just after the write
    (from its open descriptor: the file written, whatever its name points to now), and
    the bytes written."""

    before: os.stat_result
    after: os.stat_result
    data: bytes


def append_bytes(
    path: str | Path,
    data: bytes,
    *,
    fsync: bool = False,
    ends_at: tuple[int, int] | None = None,
) -> Appended:
    """`append_text` for bytes, saying what it did (`Appended`): a caller that keeps
    the file's size and mtime learns them without a second look at the path.
    `ends_at`: the (size, mtime_ns) at which the caller knows the file ends with a
    newline (it wrote the last line itself); found so, no byte is read back to check."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        before = os.fstat(fd)
        size = before.st_size
        known = ends_at == (size, before.st_mtime_ns)
        if size > 0 and not known and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        if fsync:
            os.fsync(fd)
        return Appended(before, os.fstat(fd), data)
    finally:
        os.close(fd)


class FileLock:
    """An exclusive `flock` on `path` (created 0600 if missing), held by `with lock:`:
    how processes sharing a workspace file take turns changing it. The descriptor stays
    open between uses (opening the file costs several times the lock) until `close` or
    the object's end. Not reentrant: pair it with a thread lock taken first. The lock
    file itself must never be deleted (a process holding it open would lock a file
    others no longer see)."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def __enter__(self) -> None:
        if self._file is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            self._file = os.fdopen(fd, "r+b", buffering=0)
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the descriptor (releasing the lock if held); the next use reopens it."""
        if self._file is not None:
            self._file.close()
            self._file = None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold a `FileLock` on `path` for one block, its descriptor closed after."""
    lock = FileLock(path)
    try:
        with lock:
            yield
    finally:
        lock.close()


def create_exclusive(path: Path, data: bytes) -> None:
    """Write a new file that must not exist yet (FileExistsError otherwise), fsynced.

    The data goes to a temp file first, which is then hard-linked to `path`: a crash
    never leaves a half-written file under the name, and a file that appeared meanwhile
    is never replaced (a link, unlike a rename, refuses an existing name)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, FILE_MODE)
        try:
            os.link(tmp_name, path)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            # A file system without hard links: exclusive creation is still refused.
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
            os.rename(tmp_name, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
    fsync_dir(path.parent)


def probe_writable(folder: Path) -> None:
    """Create, write and remove a small file in `folder`; raises the OSError a new file
    there meets now (read-only file system, permissions, no space, folder gone)."""
    fd, name = tempfile.mkstemp(prefix=".probe-", suffix=".tmp", dir=folder)
    try:
        os.write(fd, b"probe\n")
    finally:
        os.close(fd)
        os.unlink(name)


def read_text(path: Path) -> str:
    """The file's UTF-8 text ('' if it does not exist); undecodable bytes are replaced."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def open_sqlite(
    path: Path,
    *,
    what: str,
    init: Callable[[sqlite3.Connection], None],
    busy_timeout_ms: int = 5000,
) -> sqlite3.Connection:
    """A WAL-mode connection to the SQLite file `path` (0600, folder 0700), with `init`
    (schema creation or migration) run on it. `what` names the file in log lines.

    Only a file whose bytes are not a database is moved aside (`<name>.broken-<time>`)
    and replaced by a fresh one; busy, permission or missing-folder errors are raised.
    """
    ensure_private_dir(path.parent)
    companions = [Path(f"{path}{suffix}") for suffix in ("-wal", "-shm")]

    def connect() -> sqlite3.Connection:
        # SQLite creates the -wal and -shm files with the database file's mode: make
        # that 0600 before it opens it (a process-wide umask would race other threads).
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)
        conn = sqlite3.connect(
            path, timeout=busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            init(conn)
            for companion in companions:  # left by an older version or another tool
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(companion, FILE_MODE)
        except BaseException:
            conn.close()
            raise
        return conn

    try:
        return connect()
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError) or not path.exists():
            raise
        aside = path.with_name(f"{path.name}.broken-{int(time.time())}")
        logger.warning("{} file {} is unreadable ({}); moved to {}", what, path, exc, aside)
        path.rename(aside)
        for companion in companions:
            companion.unlink(missing_ok=True)
        return connect()


def immediate(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], _T]) -> _T:
    """Run `fn` in one write transaction taken up front (BEGIN IMMEDIATE), so two
    processes never deadlock upgrading a read lock; rolled back if `fn` raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


#: Commits between two WAL checkpoints of a `SqliteFile` (SQLite's own default is
#: about 1,000 pages; ours run in a background thread, never in a commit).
CHECKPOINT_EVERY = 1000
#: ... or this many, after a checkpoint during which commits came (see `_behind`).
CHECKPOINT_CHASE_EVERY = 8
#: The size a `SqliteFile`'s WAL is cut back to when SQLite starts it over after a
#: checkpoint (its ``journal_size_limit``): a WAL that grew large once (a burst, or a
#: version that did not checkpoint) does not keep its size on disk.
WAL_SIZE_LIMIT = 16 * 1024 * 1024
_BUSY_CODES = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Locked by another connection, extended codes included (SQLITE_BUSY_RECOVERY,
    _SNAPSHOT, ...: the primary code is the low byte)."""
    code = exc.sqlite_errorcode
    return code is not None and code & 0xFF in _BUSY_CODES


class SqliteFile:
    """One SQLite file used from an event loop: the connection is opened lazily by
    `open_sqlite`, and calls run one at a time on it (never two at once).

    `run` and `transaction` run in a worker thread. `try_run_nowait` and
    `try_transaction_nowait` run on the caller's thread (the loop) when that cannot
    block: the connection is open, no worker is using it, no checkpoint is running,
    and SQLite's lock is free (the connection's busy timeout is 0 except during a
    worker's call); otherwise they report that nothing ran. A short
    transaction costs tens of microseconds there, less than a thread hop: WAL commits
    do not fsync (``synchronous = NORMAL``) and the connection never checkpoints in a
    commit: every `CHECKPOINT_EVERY` commits a background thread does, on its own
    connection, while writers go on.
    """

    def __init__(
        self,
        path: Path,
        *,
        what: str,
        init: Callable[[sqlite3.Connection], None],
        busy_timeout_ms: int = 5000,
        io_on_loop: bool = True,
    ) -> None:
        self.path = path
        self._io_on_loop = io_on_loop  # False: the *_nowait calls never run here
        self._what = what
        self._init = init
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # the loop only ever tries it (never waits)
        self._limiter: anyio.CapacityLimiter | None = None
        self._commits = 0  # since the last checkpoint
        # A commit came while a checkpoint ran: SQLite starts the WAL over (cut back to
        # `WAL_SIZE_LIMIT`) only at a write that finds all of it copied, so the next
        # checkpoint comes after `CHECKPOINT_CHASE_EVERY` commits, not a thousand: short
        # ones chase the WAL's end until one ends between two commits. Measured with
        # the cache's puts 2 ms apart: the WAL grew past 175 MB with a checkpoint every
        # thousand commits (each took long enough for a commit to come meanwhile), and
        # stayed under 40 MB chasing.
        self._behind = False
        self._checkpointer: threading.Thread | None = None
        self.checkpoints = 0  # background checkpoints started (tests, benchmarks)

    def _init_connection(self, conn: sqlite3.Connection) -> None:
        self._init(conn)
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # see `_committed`
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        # Never wait for another connection's lock by default: the loop's calls must
        # not; a worker thread's call sets the timeout for its own duration.
        conn.execute("PRAGMA busy_timeout = 0")

    def _checkpointing(self) -> bool:
        """A checkpoint is running: it fsyncs, and on some file systems (ext4's journal)
        writes wait for that; the loop then leaves this file to the worker thread."""
        return self._checkpointer is not None and self._checkpointer.is_alive()

    def _committed(self) -> None:
        self._commits += 1
        if self._checkpointing():
            self._behind = True
            return
        if self._commits < (CHECKPOINT_CHASE_EVERY if self._behind else CHECKPOINT_EVERY):
            return
        self._behind = False
        self._commits = 0
        self.checkpoints += 1
        self._checkpointer = threading.Thread(
            target=self._checkpoint, name=f"{self._what}-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def _checkpoint(self) -> None:
        try:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout_ms / 1000)
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            finally:
                conn.close()
        except sqlite3.Error as exc:
            logger.warning("{} file {}: checkpoint failed: {}", self._what, self.path, exc)

    def try_run_nowait(self, fn: Callable[[sqlite3.Connection], _T]) -> tuple[bool, _T | None]:
        """``(True, fn(connection))`` run here and now, or ``(False, None)`` when that
        would wait (connection not open yet, in use, or the database locked)."""
        conn = self._conn
        if (
            conn is None
            or not self._io_on_loop
            or self._checkpointing()
            or not self._lock.acquire(blocking=False)
        ):
            return False, None
        try:
            changes = conn.total_changes
            result = fn(conn)  # busy timeout 0: a held lock raises at once
            self._count_writes(conn, changes)
            return True, result
        except sqlite3.OperationalError as exc:
            if _is_busy(exc):
                return False, None
            raise
        finally:
            self._lock.release()

    def _count_writes(self, conn: sqlite3.Connection, changes_before: int) -> None:
        """Count a call that wrote (under `_lock`) towards the next checkpoint: every
        call that changed a row, in a transaction or autocommitted, whichever the
        caller used (a file whose writes went uncounted never checkpointed, and its WAL
        grew without bound: the cache's, 35 kB a stored answer, before this)."""
        if conn.total_changes != changes_before:
            self._committed()

    def try_transaction_nowait(
        self, fn: Callable[[sqlite3.Connection], _T]
    ) -> tuple[bool, _T | None]:
        """`try_run_nowait` of one immediate write transaction."""
        return self.try_run_nowait(lambda conn: immediate(conn, fn))

    async def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """`fn(connection)` in a worker thread."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(self.call, fn, limiter=self._limiter)

    def call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """`fn(connection)` in this (worker) thread, which may wait: for another
        connection's lock up to the busy timeout, also where SQLite answers "locked" at
        once instead of waiting (two processes creating the file and switching it to
        WAL, a WAL being recovered). `fn` must be safe to run again after such an error
        (a transaction is rolled back; reads and idempotent statements are)."""
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        with self._lock:
            while True:
                try:
                    return self._call_once(fn)
                except sqlite3.OperationalError as exc:
                    if not _is_busy(exc) or time.monotonic() >= deadline:
                        raise
                time.sleep(0.01)

    def _call_once(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        if self._conn is None:
            self._conn = open_sqlite(
                self.path,
                what=self._what,
                init=self._init_connection,
                busy_timeout_ms=self._busy_timeout_ms,
            )
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        try:
            changes = conn.total_changes
            result = fn(conn)
            self._count_writes(conn, changes)
            return result
        finally:
            conn.execute("PRAGMA busy_timeout = 0")

    async def transaction(
        self, fn: Callable[[sqlite3.Connection], _T], *, durable: bool = False
    ) -> _T:
        """`fn(connection)` inside one immediate write transaction. `durable`: this
        commit is fsynced (``synchronous = FULL``), so it survives a power cut, not only
        a crashed process (it also makes every earlier commit durable)."""

        def run(conn: sqlite3.Connection) -> _T:
            if not durable:
                return immediate(conn, fn)
            conn.execute("PRAGMA synchronous = FULL")  # not allowed inside a transaction
            try:
                return immediate(conn, fn)
            finally:
                conn.execute("PRAGMA synchronous = NORMAL")

        return await self.run(run)  # counted towards the checkpoint by `call`

    async def aclose(self, last_write: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """Close the connection (if open), after `last_write` in a final transaction;
        a failing last write is logged, the file is closed anyway."""

        def close() -> None:
            if self._checkpointer is not None:
                self._checkpointer.join()
            with self._lock:
                if self._conn is None:
                    return
                try:
                    if last_write is not None:
                        self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                        immediate(self._conn, last_write)
                except sqlite3.Error as exc:
                    logger.warning("{} file {}: last write failed: {}", self._what, self.path, exc)
                finally:
                    self._conn.close()
                    self._conn = None

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        await anyio.to_thread.run_sync(close, limiter=self._limiter)
