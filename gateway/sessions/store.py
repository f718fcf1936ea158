"""Session persistence: one append-only JSONL file per session (and an in-memory twin).

Promises kept here:
- The transcript stays append-only: a store only ever adds whole lines at the end of
  its file; earlier bytes are never rewritten (the one exception, truncating a torn
  last line, first copies those bytes to a sidecar file, so nothing is lost).
- An acknowledged append is on disk: with ``fsync="always"`` or ``"batch"``,
  `FileSessionStore.append` returns only after the entry's bytes were fsynced, in the
  session file or (``"batch"`` with a `CommitLog`) in the commit log a restart replays
  (``"never"`` leaves that to the OS; the bytes are still in the page cache, which a
  killed process does not lose).
- A damaged file is never overwritten or deleted: bad lines are skipped and counted,
  a torn tail is set aside before the next append, a file without a valid header is
  renamed to ``<name>.corrupt-<time>``.
- The sidecar index (`gateway.sessions.index`, for sessions of `MIN_ENTRIES` entries
  and more) is only a cache of where lines start: a load uses it when it matches the
  file, parses what it does not cover, and writes a new one when it is missing, stale,
  damaged or far behind; the JSONL file is never changed for it.

Each append is one ``os.write`` of one complete line to an ``O_APPEND`` descriptor, under
``flock(LOCK_EX)`` so several processes can share a session: under the lock the store
first reads whatever other writers appended (only the new bytes) and only then chooses
the new entry's ``parent_id``; a file replaced underneath (a reset elsewhere) is reopened.

The event loop's fast path (`FileSessionStore.try_append_nowait`, `try_load_nowait`,
`aappend`): an append to a file that is open, with its locks free and little or nothing
new to read, costs a few microseconds of system calls and runs on the loop itself; the
fsync of ``"batch"`` is then a group commit (`AsyncGroupCommitter`) whose one worker
thread covers every append of the round: with a commit log, one write and one fsync of
the log; without, one fsync of each file of the round. Anything that could block (a lock held
elsewhere, a file to create or to read at length, ``"always"``) goes to a worker thread.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from math import isfinite
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, get_args

import anyio
import anyio.lowlevel
import anyio.to_thread

from gateway.logs import logger

if TYPE_CHECKING:
    from loguru import Logger

from gateway.fsutil import fsync_dir
from gateway.sessions.commitlog import CommitLog, Syncable, encoded_name, record
from gateway.sessions.entries import (
    Entry,
    MessageEntry,
    ParentSessionRef,
    SessionHeader,
    entry_from_dict,
    new_entry_id,
)
from gateway.sessions.errors import SessionError, SessionExistsError, UnsupportedVersionError
from gateway.sessions.index import (
    MIN_ENTRIES,
    FileIdentity,
    IndexDamaged,
    build_index,
    index_path,
    read_index,
    remove_index,
    write_index,
)
from gateway.sessions.keys import SUFFIX
from gateway.sessions.listing import ARCHIVE_DIR, ARCHIVE_TAG
from gateway.sessions.spares import SparePool
from gateway.sessions.tree import SessionTree

FsyncPolicy = Literal["always", "batch", "never"]
FSYNC_POLICIES: tuple[str, ...] = get_args(FsyncPolicy)

E = TypeVar("E", bound=Entry)
#: Builds the entry to append from the (synced) tree, a fresh id and the timestamp; it
#: runs under the store's locks, so it sees the current leaf and may validate ids.
EntryFactory = Callable[[SessionTree, str, float], E]

FILE_MODE = 0o600
DIR_MODE = 0o700
_OPEN_FLAGS = STORE_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
#: What the encoder writes for a str with ``ensure_ascii=False`` (its C function).
_quote: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]
_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)
_MAX_ATTEMPTS = 16  # reopen retries when other processes keep replacing the file
#: The most bytes the event loop's fast path reads from a session file (a small file
#: loads in well under a millisecond); more goes to a worker thread.
INLINE_READ_MAX = 64 * 1024


class _WouldBlock(Exception):
    """The non-blocking path met a busy lock or too much to read: use a worker thread."""


def check_fsync_policy(value: str) -> FsyncPolicy:
    if value not in FSYNC_POLICIES:
        raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {value!r}")
    return value  # type: ignore[return-value]


def _message_line(entry: MessageEntry) -> str | None:
    """`encode_line` of the common message entry (a plain message: a role and a text,
    no meta), the same characters the encoder writes, in about half its time: a turn
    on the event loop appends two of them. None for any other message."""
    m = entry.message
    content = m.content
    if (
        entry.meta is not None
        or type(content) is not str
        or m.tool_calls
        or m.tool_call_id is not None
        or m.name is not None
        or m.usage is not None
        or m.model is not None
        or type(m.role) is not str
        or (entry.parent_id is not None and type(entry.parent_id) is not str)
        or type(entry.timestamp) is not float
        or not isfinite(entry.timestamp)
    ):
        return None
    parent = "null" if entry.parent_id is None else _quote(entry.parent_id)
    return (
        f'{{"id":{_quote(entry.id)},"parent_id":{parent},"timestamp":{entry.timestamp!r},'
        f'"type":"message","message":{{"role":{_quote(m.role)},"content":{_quote(content)}}}}}\n'
    )


def encode_line(entry: Entry) -> str:
    """The one-line JSON form of an entry, newline included."""
    if type(entry) is MessageEntry and type(entry.id) is str:
        line = _message_line(entry)
        if line is not None:
            return line
    try:
        return _ENCODER.encode(entry.to_dict()) + "\n"
    except (TypeError, ValueError) as exc:
        raise SessionError(f"{entry.type} entry cannot be stored as JSON: {exc}") from None


def new_header(
    key: str,
    *,
    previous_session: str | None = None,
    parent_session: ParentSessionRef | None = None,
) -> SessionHeader:
    return SessionHeader(
        id=uuid.uuid4().hex,
        parent_id=None,
        timestamp=time.time(),
        key=key,
        previous_session=previous_session,
        parent_session=parent_session,
    )


def build_entry(tree: SessionTree, factory: EntryFactory[E]) -> E:
    entry_id = new_entry_id()
    while entry_id in tree:
        entry_id = new_entry_id()
    return factory(tree, entry_id, time.time())


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What loading a session file found. ``clean`` is True when nothing was wrong.

    ``bad_lines`` counts skipped lines and entries found damaged when first decoded;
    ``torn`` says the last line was cut off (``torn_sidecar``: where it was set aside);
    ``moved_aside`` is where a file with an invalid header went (then ``started_fresh``).
    ``index`` says how the last full load used the sidecar index (`gateway.sessions.index`):
    ``"used"``, ``"missing"``, ``"stale"``, ``"damaged"`` (the last three then parsed the
    whole file), or ``""`` (no index kept: the store has no index folder, or the
    session is too small); ``parsed_lines`` counts the lines that load parsed.
    """

    path: Path | None = None
    entries: int = 0
    bad_lines: int = 0
    bad_line_numbers: tuple[int, ...] = ()
    damaged_entry_ids: tuple[str, ...] = ()
    torn: bool = False
    torn_sidecar: Path | None = None
    moved_aside: Path | None = None
    started_fresh: bool = True
    index: str = ""
    parsed_lines: int = 0

    @property
    def clean(self) -> bool:
        return not (self.bad_lines or self.torn or self.moved_aside)


class SessionStore(Protocol):
    """Where a session's entries live; `Session` talks to nothing else."""

    lock: threading.RLock
    key: str

    @property
    def path(self) -> Path | None: ...
    @property
    def header(self) -> SessionHeader: ...
    @property
    def tree(self) -> SessionTree: ...
    @property
    def report(self) -> LoadReport: ...
    @property
    def on_disk(self) -> bool: ...
    @property
    def persisted(self) -> bool: ...
    @property
    def size(self) -> int: ...
    def load(self) -> None: ...
    def append(self, factory: EntryFactory[E]) -> E: ...
    async def aappend(self, factory: EntryFactory[E], *, defer: bool = False) -> E:
        """``defer``: durable with the store's next commit at the latest (a store that
        commits every append at once ignores it; `FileSessionStore.aappend`)."""
        ...

    async def asettle(self) -> None:
        """Make the deferred appends durable now."""
        ...

    def create_with(self, entries: Sequence[Entry]) -> None: ...
    def refresh(self) -> None: ...
    def flush(self) -> None: ...
    def archive(self) -> Path | None: ...
    def export_jsonl(self) -> str:
        """The stored session in the JSONL format, header first ('' if not stored)."""
        ...

    def delete(self) -> bool: ...
    def close(self) -> None: ...


# -- low-level file helpers ---------------------------------------------------------


def _pread_from(fd: int, offset: int, size: int) -> bytes:
    """Bytes from ``offset`` to the end; ``size`` is the file size last seen (a hint)."""
    parts: list[bytes] = []
    while True:
        want = max(size - offset, 0) + 65536
        chunk = os.pread(fd, want, offset)
        parts.append(chunk)
        offset += len(chunk)
        if len(chunk) < want:  # short read: we are at the end
            break
    return b"".join(parts)


def _decode_lines(data: bytes) -> list[str]:
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        out: list[str] = []
        for raw in data.split(b"\n"):
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\0not utf-8")  # parses as nothing: counted as a bad line
        return out


def _timestamp_tag() -> str:
    return datetime.now(UTC).strftime(ARCHIVE_TAG)


def archive_name(session_id: str, archived_at: float) -> str:
    """The file name of an archived session: ``<time>-<session id>.jsonl`` (the time in
    UTC to the microsecond, so names sort by when `/new` replaced the session)."""
    return f"{datetime.fromtimestamp(archived_at, UTC).strftime(ARCHIVE_TAG)}-{session_id}{SUFFIX}"


def _free_name(path: Path) -> Path:
    """``path`` itself, or with ``-1``, ``-2``… added: a name that does not exist yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class _FileHandle:
    """An open session file: its descriptor, identity, and what is not fsynced yet."""

    __slots__ = ("_closed", "_lock", "_logged", "_synced", "dev", "fd", "ino", "written")

    def __init__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.fd = fd
        self.dev, self.ino = st.st_dev, st.st_ino
        self.written = 0  # writes so far (bumped under the store lock)
        self._synced = 0  # writes covered by an fsync of the file
        self._logged = 0  # writes covered by an fsync of the commit log
        self._closed = False
        self._lock = threading.Lock()

    def __del__(self) -> None:
        # A store dropped from every cache closes its file when collected.
        if not self._closed:
            self._closed = True
            _close_quietly(self.fd)

    @property
    def dirty(self) -> bool:
        """Some write is not durable yet (neither the file nor a commit log fsynced)."""
        return self.written > max(self._synced, self._logged)

    def logged(self, writes: int) -> None:
        """The first ``writes`` writes are durable in a fsynced commit log."""
        self._logged = max(self._logged, writes)

    @property
    def closed(self) -> bool:
        return self._closed

    def sync(self) -> None:
        with self._lock:
            if self._closed or self.written == self._synced:
                return
            target = self.written
            _datasync(self.fd)
            self._synced = max(self._synced, target)

    def close(self, *, sync: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if sync and self.written != self._synced:
                    _datasync(self.fd)
                    self._synced = self.written
            finally:
                _close_quietly(self.fd)


class _Pending:
    """An append waiting for its group commit: its file, and with a commit log the
    log line that makes it durable and the file's write count it covers."""

    __slots__ = ("done", "error", "folder", "handle", "log", "log_line", "writes")

    def __init__(
        self,
        handle: _FileHandle,
        log: CommitLog | None = None,
        log_line: bytes = b"",
        writes: int = 0,
        folder: Path | None = None,
    ) -> None:
        self.handle = handle
        self.log = log
        self.log_line = log_line
        self.writes = writes
        self.folder = folder  # a new file's folder, to fsync with the round
        self.done = False
        self.error: OSError | None = None


# fsyncs of one group-commit round run at most this many at a time. ext4 (and XFS)
# fold concurrent fsyncs into one journal commit: measured on the machine of
# bench/sessions.py, 500 files' fdatasyncs took 860-1670 ms one after the other and
# 57-72 ms four to sixteen at a time.
_SYNC_THREADS = 16
_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="fsync")
        return _sync_pool


def _sync_some(handles: list[_FileHandle]) -> dict[int, OSError]:
    errors: dict[int, OSError] = {}
    for handle in handles:
        try:
            handle.sync()
        except OSError as exc:
            errors[id(handle)] = exc
    return errors


def _sync_files(handles: list[_FileHandle]) -> dict[int, OSError]:
    """fsync each file, `_SYNC_THREADS` at a time (each thread a share of the files)."""
    if len(handles) <= 1:
        return _sync_some(handles)
    shares = [handles[i::_SYNC_THREADS] for i in range(min(_SYNC_THREADS, len(handles)))]
    errors: dict[int, OSError] = {}
    for found in _pool().map(_sync_some, shares):
        errors.update(found)
    return errors


def checkpoint_files(handles: list[Syncable]) -> None:
    """A commit log's checkpoint: every file it covers fsynced, or `OSError`."""
    errors = _sync_files(handles)  # type: ignore[arg-type]
    if errors:
        raise next(iter(errors.values()))


def _sync_handles(batch: list[_Pending]) -> dict[int, OSError]:
    """Make a round durable, and only then does the round end: no append is acknowledged
    before its bytes are on disk. Appends with a commit log: their lines written to the
    log, one fsync per log. Others: each file fsynced once (`_sync_files`)."""
    errors: dict[int, OSError] = {}
    logs: dict[int, list[_Pending]] = {}
    plain: dict[int, _FileHandle] = {}
    for p in batch:
        if p.log is not None:
            logs.setdefault(id(p.log), []).append(p)
        elif p.handle.dirty:
            plain[id(p.handle)] = p.handle
    for folder in {p.folder for group in logs.values() for p in group if p.folder}:
        fsync_dir(folder)  # new files' names, once per folder and round
    for pending in logs.values():
        log = pending[0].log
        assert log is not None
        try:
            log.commit(
                [p.log_line for p in pending],
                {id(p.handle): p.handle for p in pending}.values(),
                checkpoint_files,
            )
        except OSError as exc:
            for p in pending:
                errors[id(p.handle)] = exc
        else:
            for p in pending:
                p.handle.logged(p.writes)
    if plain:
        errors.update(_sync_files(list(plain.values())))
    return errors


class GroupCommitter:
    """Group commit for ``fsync="batch"``: one fsync round covers every append that was
    waiting when it started, across all sessions of the process.

    Appenders write first, then call `commit`; the first waiter becomes the leader,
    takes the whole queue, fsyncs each file in it once and wakes everyone; appends that
    arrive meanwhile form the next round. `commit` returns only when the caller's
    bytes are on disk (or raises if their file's fsync failed).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Pending] = []
        self._leader_busy = False
        self.rounds = 0  # fsync rounds so far (for tests and the benchmark)

    def commit(self, requests: Sequence[_Pending]) -> None:
        """Make ``requests`` durable, in one round (a store's deferred appends first,
        `FileSessionStore.aappend`, then the one that commits them)."""
        request = requests[-1]  # queued last, done with the round that takes them all
        with self._cond:
            self._queue.extend(requests)
            while not request.done:
                if self._leader_busy:
                    self._cond.wait()
                    continue
                self._leader_busy = True
                batch, self._queue = self._queue, []
                errors: dict[int, OSError] = {}
                self._cond.release()
                try:
                    errors = _sync_handles(batch)
                finally:
                    self._cond.acquire()
                    for p in batch:
                        p.error = errors.get(id(p.handle))
                        p.done = True
                    self.rounds += 1
                    self._leader_busy = False
                    self._cond.notify_all()
        _raise_unsynced(requests)


DEFAULT_COMMITTER = GroupCommitter()


def _raise_unsynced(requests: Sequence[_Pending]) -> None:
    for request in requests:
        if request.error is not None:
            raise SessionError(
                f"the session entry was written but could not be fsynced: "
                f"{request.error.strerror}; check the disk"
            )


class AsyncGroupCommitter:
    """`GroupCommitter` for appends made on the event loop: a round makes every append
    queued so far durable in one worker-thread hop (shielded from cancellation, so a
    round always completes); appends that arrive meanwhile form the next round. One per
    event loop user (a `SessionManager`).

    The first append queued for a round leads it: it waits for the running round to
    end, then runs its own. Every other append waits once, for the end of its round
    (a wake-up per append, not one per round it sat through).
    """

    def __init__(self) -> None:
        self._queue: list[_Pending] = []  # the next round's appends; [0] leads it
        self._next_done: anyio.Event | None = None  # set when the next round ends
        self._running: anyio.Event | None = None  # set when the running round ends
        self.rounds = 0  # fsync rounds so far (for tests and the benchmark)

    async def commit(self, requests: Sequence[_Pending]) -> None:
        """Make ``requests`` durable, in one round (`GroupCommitter.commit`)."""
        first = not self._queue
        self._queue.extend(requests)
        if not first:
            done = self._next_done
            assert done is not None
            await done.wait()  # a cancelled wait leaves the append in its round
        else:
            with anyio.CancelScope(shield=True):  # followers count on their leader
                await self._lead()
        _raise_unsynced(requests)

    async def _lead(self) -> None:
        self._next_done = done = anyio.Event()
        running = self._running
        if running is not None:
            await running.wait()
        # One pass of the loop first: the turns woken with us append too and join this
        # round (else a round of one, then one of all the others, each its own fsync).
        await anyio.lowlevel.checkpoint()
        batch, self._queue = self._queue, []
        self._next_done, self._running = None, done
        errors: dict[int, OSError] = {}
        try:
            errors = await anyio.to_thread.run_sync(_sync_handles, batch)
        finally:
            for p in batch:
                p.error = errors.get(id(p.handle))
                p.done = True
            self.rounds += 1
            if self._running is done:
                self._running = None
            done.set()


# -- the file store ------------------------------------------------------------------


class FileSessionStore:
    """The JSONL file of one session key; all methods hold ``lock`` (reentrant)."""

    def __init__(
        self,
        path: Path,
        key: str,
        *,
        fsync: FsyncPolicy = "batch",
        committer: GroupCommitter | None = None,
        async_committer: AsyncGroupCommitter | None = None,
        spares: SparePool | None = None,
        io_on_loop: bool = True,
        header: SessionHeader | None = None,
        commit_log: CommitLog | None = None,
        index_dir: Path | None = None,
        index_min_entries: int = MIN_ENTRIES,
    ) -> None:
        self.lock = threading.RLock()
        self.key = key
        self._path = path
        # Appends written with ``defer=True`` whose group commit is still to come: the
        # store's next commit takes them into its round, before its own (`aappend`).
        self._deferred: list[_Pending] = []
        # Another process appended to the file since our last commit: our next append
        # fsyncs the file itself rather than only logging its own line, since the log
        # could not restore our line after theirs if a power cut lost theirs.
        self._foreign = False
        self._fspath = os.fspath(path)  # for the stat of every append: no Path call
        self._policy = fsync
        # Under "batch", a commit log makes a round durable in one fsync (`commitlog`).
        self._commit_log = commit_log if fsync == "batch" else None
        self._log_name = encoded_name(path) if self._commit_log is not None else b""
        self._committer = committer or DEFAULT_COMMITTER
        self._async_committer = async_committer or AsyncGroupCommitter()
        self._spares = spares
        self._io_on_loop = io_on_loop
        self._handle: _FileHandle | None = None
        self._ident: tuple[int, int] | None = None  # (dev, ino) of the file the tree reflects
        self._dir_dirty = False  # a name was created but the folder is not fsynced
        self._bad_lines: list[int] = []
        self._torn_sidecar: Path | None = None
        self._moved_aside: Path | None = None
        # The sidecar index (`gateway.sessions.index`): None keeps none.
        self._index = None if index_dir is None else index_path(index_dir, path)
        self._index_min = max(index_min_entries, 1)
        self._index_state = ""
        self._parsed_lines = 0
        self._start_fresh(header=header)

    # -- state ------------------------------------------------------------------------

    @property
    def _log(self) -> Logger:
        return logger.bind(session_key=self.key)

    def _start_fresh(
        self, *, header: SessionHeader | None = None, previous_session: str | None = None
    ) -> None:
        """Forget the file: an empty tree under a new (not yet written) header."""
        self._header_value = header  # made on first use: a load replaces it anyway
        self._previous_session = previous_session
        self._tree = SessionTree(self.key, str(self._path))
        self._size = 0  # bytes of the file reflected in the tree
        self._seen_size = 0  # file size at the last sync (> _size: a torn tail)
        self._next_lineno = 1
        self._unterminated = False  # the last consumed line has no newline yet
        self._torn = False
        self._on_disk = False
        self._ident = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def header(self) -> SessionHeader:
        return self._header

    @property
    def _header(self) -> SessionHeader:
        if self._header_value is None:
            self._header_value = new_header(self.key, previous_session=self._previous_session)
        return self._header_value

    @property
    def tree(self) -> SessionTree:
        return self._tree

    @property
    def on_disk(self) -> bool:
        return self._on_disk

    @property
    def persisted(self) -> bool:
        """True once the session has a file (its entries survive this process)."""
        return self._on_disk

    @property
    def size(self) -> int:
        """Bytes of the file the tree reflects (what the session costs in memory,
        roughly)."""
        return self._size

    @property
    def report(self) -> LoadReport:
        damaged = tuple(self._tree.damaged)
        return LoadReport(
            path=self._path,
            entries=len(self._tree),
            bad_lines=len(self._bad_lines) + len(damaged),
            bad_line_numbers=tuple(self._bad_lines),
            damaged_entry_ids=damaged,
            torn=self._torn or self._torn_sidecar is not None,
            torn_sidecar=self._torn_sidecar,
            moved_aside=self._moved_aside,
            started_fresh=not self._on_disk,
            index=self._index_state,
            parsed_lines=self._parsed_lines,
        )

    # -- syncing with the file ----------------------------------------------------------

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.close(sync=self._policy != "never")
            self._handle = None
            # The file's fsync covered the appends deferred to it.
            self._deferred = [p for p in self._deferred if not p.handle.closed]

    def _current_size(self, handle: _FileHandle) -> int | None:
        """Size of the file at our path if it is still ``handle``'s file, else None."""
        try:
            st = os.stat(self._fspath)
        except FileNotFoundError:
            return None
        if st.st_ino != handle.ino or st.st_dev != handle.dev:
            return None
        return st.st_size

    def _vanished(self) -> None:
        """Our file is gone from the path (reset or deleted elsewhere): start over."""
        self._close_handle()
        if self._on_disk:
            self._log.info("session file {} was replaced or removed; reloading", self._path)
            self._start_fresh(previous_session=self._header.id)

    def _acquire_current(self, *, wait: bool = True) -> _FileHandle | None:
        """Lock (EX) the file now at our path and sync the tree with it.

        Returns the locked handle (the caller unlocks), or None when the path holds no
        file. Handles files replaced underneath and moves aside a file with a bad header.
        With ``wait=False`` raises `_WouldBlock` instead of waiting for another
        process's lock or reading more than `INLINE_READ_MAX` bytes.
        """
        lock_op = fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB
        for _ in range(_MAX_ATTEMPTS):
            handle = self._handle
            if handle is None:
                try:
                    fd = os.open(self._fspath, _OPEN_FLAGS)
                except FileNotFoundError:
                    self._vanished()
                    return None
                except OSError as exc:
                    raise SessionError(
                        f"cannot open session file {self._path}: {exc.strerror}"
                    ) from None
                handle = self._handle = _FileHandle(fd)
            try:
                fcntl.flock(handle.fd, lock_op)
            except BlockingIOError:
                raise _WouldBlock from None
            ok = False
            try:
                size = self._current_size(handle)
                if not wait and size is not None and self._to_read(handle, size) > INLINE_READ_MAX:
                    raise _WouldBlock
                if size is not None and self._sync_locked(handle, size):
                    ok = True
                    return handle
            finally:
                if not ok:
                    fcntl.flock(handle.fd, fcntl.LOCK_UN)
            if self._handle is handle:
                self._vanished()
        raise SessionError(f"session file {self._path} keeps changing; try again")

    def _to_read(self, handle: _FileHandle, size: int) -> int:
        """How many bytes `_sync_locked` would read for a file of ``size`` bytes."""
        if self._ident != (handle.dev, handle.ino) or size < self._size or self._size == 0:
            return size
        return size - self._size

    def _sync_locked(self, handle: _FileHandle, size: int) -> bool:
        """Apply bytes other writers appended (the file is ``size`` bytes now, and we
        hold its lock). False if the file was moved aside."""
        if (
            self._ident != (handle.dev, handle.ino)
            or size < self._size
            or (self._size == 0 and size > 0)
        ):
            return self._load_whole(handle, size)  # another file, or rewritten: read it all
        if size == self._seen_size:
            return True
        self._ingest_appended(_pread_from(handle.fd, self._size, size))
        self._foreign = True
        return True

    def _ingest_appended(self, data: bytes) -> None:
        """Apply ``data``, the file's bytes from `_size` on (complete lines and maybe a
        last line without its newline yet)."""
        lines = _decode_lines(data)
        tail = lines.pop()
        if self._unterminated and lines:
            # The writer that ended our last line put a newline first; anything else
            # glued onto that line is garbage.
            if lines[0].strip():
                self._bad_lines.append(self._next_lineno - 1)
            lines = lines[1:]
            self._unterminated = False
        if lines:
            bad = self._tree.ingest_lines(lines, self._next_lineno)
            self._note_bad(bad)
            self._next_lineno += len(lines)
        tail_bytes = len(data) - (data.rfind(b"\n") + 1)
        self._size += len(data) - tail_bytes
        self._seen_size = self._size + tail_bytes
        self._torn = False  # a torn tail seen before may have been repaired by another writer
        if tail_bytes:
            self._take_tail(tail)

    def _load_whole(self, handle: _FileHandle, size: int) -> bool:
        data = _pread_from(handle.fd, 0, size)
        if not data:  # an empty file counts as no session yet; we write the header
            if self._on_disk:
                self._start_fresh(previous_session=self._header.id)
            self._ident = (handle.dev, handle.ino)
            return True
        header_end = data.find(b"\n")
        first = _decode_lines(data[:header_end] if header_end >= 0 else data)[0]
        try:
            header = entry_from_dict(json.loads(first))
            if not isinstance(header, SessionHeader):
                raise SessionError(f"first line is a {header.type} entry, not a header")
        except UnsupportedVersionError as exc:
            raise UnsupportedVersionError(f"{self._path}: {exc}") from None
        except (ValueError, SessionError) as exc:
            self._move_aside(handle, str(exc))
            return False
        if header.key != self.key:
            self._log.warning(
                "session file {} names key {!r} in its header; using {!r} from its file name",
                self._path,
                header.key,
                self.key,
            )
        self._start_fresh(header=header)
        self._bad_lines = []
        self._torn_sidecar = None
        self._on_disk = True
        self._ident = (handle.dev, handle.ino)
        self._foreign = True  # bytes read, not written here: not known to be durable
        self._index_state = ""
        self._parsed_lines = 0
        if header_end < 0:  # a header without its newline
            self._size = self._seen_size = len(data)
            self._unterminated = True
            self._next_lineno = 2
            return True
        covered = self._load_from_index(handle, data, header_end)
        if covered:
            self._size = self._seen_size = covered
            if covered < len(data):
                lines_before = self._next_lineno
                self._ingest_appended(data[covered:])
                self._parsed_lines = self._next_lineno - lines_before
                if self._parsed_lines >= self._index_min:
                    self._write_index(handle, data, header_end)
            return True
        lines = _decode_lines(data)
        tail = lines.pop()
        # An ASCII file's characters are its bytes: the index needs no second split.
        lengths = list(map(len, lines)) if self._index_state and data.isascii() else None
        body = lines[1:]
        self._note_bad(self._tree.ingest_lines(body, 2))
        self._parsed_lines = len(body) + (1 if tail else 0)
        self._next_lineno = 2 + len(body)
        tail_bytes = len(data) - (data.rfind(b"\n") + 1)
        self._size = len(data) - tail_bytes
        self._seen_size = len(data)
        if tail_bytes:
            self._take_tail(tail)
        if self._index_state and len(self._tree) >= self._index_min:
            self._write_index(handle, data, header_end, lengths)
        elif self._index is not None and self._index_state in ("stale", "damaged"):
            remove_index(self._index)  # a small session keeps none
        return True

    def _identity(self, handle: _FileHandle, size: int) -> FileIdentity:
        st = os.fstat(handle.fd)
        return FileIdentity(handle.dev, handle.ino, size, st.st_mtime_ns)

    def _load_from_index(self, handle: _FileHandle, data: bytes, header_end: int) -> int:
        """Fill the fresh tree from the sidecar index; the bytes it covers (0: not used,
        `_index_state` says why). Message lines stay undecoded in ``data``."""
        if self._index is None:
            return 0
        try:
            index = read_index(self._index, self._identity(handle, len(data)), data, header_end)
        except IndexDamaged as exc:
            self._index_state = "damaged"
            self._log.warning(
                "session index {} is damaged ({}); ignoring it: the session loads from its "
                "file, and the index is written anew",
                self._index,
                exc,
            )
            return 0
        if index is None:
            self._index_state = "missing" if not self._index.exists() else "stale"
            return 0
        ids, offsets = index.ids, index.offsets
        lazy = dict(zip(ids, offsets, strict=True))
        decoded: list[Entry] = []
        find = data.find
        try:
            for k in index.decoded:
                start = offsets[k]
                line = data[start : find(b"\n", start)].decode("utf-8")
                entry = entry_from_dict(json.loads(line))
                if isinstance(entry, SessionHeader) or entry.id != ids[k]:
                    raise SessionError("not the entry the index names")
                decoded.append(entry)
                del lazy[ids[k]]
            self._tree.ingest_index(ids, index.parents, lazy, data, decoded)
        except (ValueError, KeyError, SessionError):
            # The file changed where the index looked (a hand edit): parse it all.
            self._tree = SessionTree(self.key, str(self._path))
            self._index_state = "stale"
            return 0
        self._index_state = "used"
        self._next_lineno = index.next_lineno
        self._note_bad(index.bad_lines)
        return index.size

    def _write_index(
        self,
        handle: _FileHandle,
        data: bytes,
        header_end: int,
        line_lengths: list[int] | None = None,
    ) -> None:
        """Index the complete lines of ``data`` (just loaded into the tree); a failure
        only costs the next load a full parse."""
        assert self._index is not None
        covered = data.rfind(b"\n") + 1
        order, parents, plain = self._tree.index_rows()
        bad = set(self._bad_lines)
        if self._unterminated:  # the last entry's line has no newline: not covered
            order = order[:-1]
        built = build_index(data, covered, order, bad, plain, line_lengths)
        if built is None:
            self._log.debug("session file {}: its lines do not fit an index", self._path)
            return
        offsets, decode = built
        ids = order
        next_lineno = self._next_lineno - (1 if self._unterminated else 0)
        try:
            write_index(
                self._index,
                self._identity(handle, len(data)),
                data,
                header_end,
                covered,
                next_lineno,
                ids,
                [parents[eid] for eid in ids],
                offsets,
                decode,
                sorted(n for n in bad if n < next_lineno),
            )
        except (OSError, ValueError) as exc:
            self._log.debug("could not write session index {}: {}", self._index, exc)

    def _take_tail(self, tail: str) -> None:
        """A last line without newline: a complete entry (keep it) or torn (set aside later)."""
        tail_bytes = self._seen_size - self._size
        try:
            entry = entry_from_dict(json.loads(tail))
            if isinstance(entry, SessionHeader):
                raise SessionError("a second header")
            self._tree.add(entry)
        except (ValueError, SessionError):
            self._torn = True
            self._log.warning(
                "session file {}: the last line ({} bytes) is incomplete, probably cut off "
                "by a crash; it is ignored and will be moved to a sidecar file before the "
                "next append",
                self._path,
                tail_bytes,
            )
            return
        self._size = self._seen_size
        self._next_lineno += 1
        self._unterminated = True
        self._torn = False

    def _note_bad(self, bad: list[int]) -> None:
        if bad:
            self._bad_lines.extend(bad)
            shown = ", ".join(map(str, bad[:20])) + (" …" if len(bad) > 20 else "")
            self._log.warning(
                "session file {}: skipped {} unreadable line(s): {}", self._path, len(bad), shown
            )

    def _move_aside(self, handle: _FileHandle, reason: str) -> None:
        """Rename a file whose header is invalid; never overwrite, never delete it."""
        target = _free_name(self._path.with_name(f"{self._path.name}.corrupt-{_timestamp_tag()}"))
        try:
            os.rename(self._path, target)
        except OSError as exc:
            raise SessionError(
                f"session file {self._path} has no valid header ({reason}) and could not be "
                f"moved aside: {exc.strerror}; move it away by hand"
            ) from None
        if self._policy != "never":
            fsync_dir(self._path.parent)
        self._log.error(
            "session file {} has no valid header ({}); moved it to {} and started a new "
            "session for this key",
            self._path,
            reason,
            target.name,
        )
        self._start_fresh()
        self._bad_lines = []
        self._moved_aside = target

    def _repair_torn(self, handle: _FileHandle) -> None:
        """Copy the torn tail to ``<file>.torn-<time>``, then cut the file back to it."""
        fragment = os.pread(handle.fd, self._seen_size - self._size, self._size)
        sidecar = _free_name(self._path.with_name(f"{self._path.name}.torn-{_timestamp_tag()}"))
        try:
            fd = os.open(sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                if os.write(fd, fragment) != len(fragment):
                    raise OSError(errno.ENOSPC, "short write")
                if self._policy != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.ftruncate(handle.fd, self._size)
            if self._policy != "never":
                _datasync(handle.fd)
                fsync_dir(self._path.parent)
        except OSError as exc:
            raise SessionError(
                f"session file {self._path} ends with a torn line that could not be set "
                f"aside ({exc.strerror}); not appending so nothing is glued to it"
            ) from None
        self._seen_size = self._size
        self._torn = False
        self._torn_sidecar = sidecar
        self._log.warning(
            "session file {}: moved the {}-byte torn last line to {}",
            self._path,
            len(fragment),
            sidecar.name,
        )

    # -- public operations ----------------------------------------------------------------

    def load(self) -> None:
        """Read the file (if any) into the tree; a missing file means a fresh session."""
        with self.lock:
            handle = self._acquire_current()
            if handle is not None:
                fcntl.flock(handle.fd, fcntl.LOCK_UN)

    def refresh(self) -> None:
        """Pick up other writers' changes; costs one ``stat`` when nothing changed."""
        with self.lock:
            try:
                st = os.stat(self._fspath)
            except FileNotFoundError:
                self._vanished()
                return
            except OSError:
                return
            handle = self._handle
            if (
                handle is not None
                and (st.st_dev, st.st_ino) == (handle.dev, handle.ino)
                and st.st_size == self._seen_size
            ):
                return
            handle = self._acquire_current()
            if handle is not None:
                fcntl.flock(handle.fd, fcntl.LOCK_UN)

    def append(self, factory: EntryFactory[E]) -> E:
        """Append one entry built by ``factory`` under the locks; return it once durable
        (with every deferred append before it)."""
        with self.lock:
            entry, pending = self._append_locked(factory)
            requests = [] if pending is None else [*self._take_deferred(), pending]
        if requests:
            self._committer.commit(requests)
        return entry

    def _take_deferred(self) -> list[_Pending]:
        """The deferred appends still to commit (under `lock`). Closing or deleting
        their file drops them (`_close_handle`, `delete`): its fsync covered them, or
        they went with it."""
        deferred, self._deferred = self._deferred, []
        return deferred

    def try_append_nowait(
        self, factory: EntryFactory[E], *, defer: bool = False
    ) -> tuple[E, list[_Pending]] | None:
        """`append` without blocking: the entry is written (not yet fsynced) and
        returned with what its group commit must cover (under ``"batch"``: its own
        append and the deferred ones before it; nothing with ``defer``, which keeps it
        for the next commit), or None (nothing written) when appending would wait for a
        lock, create the file, read much, or fsync (``"always"``)."""
        if (
            self._policy == "always"
            or not self._io_on_loop
            or not self.lock.acquire(blocking=False)
        ):
            return None
        try:
            entry, pending = self._append_locked(factory, wait=False)
            if pending is None:
                return entry, []
            if defer:
                self._deferred.append(pending)
                return entry, []
            return entry, [*self._take_deferred(), pending]
        except _WouldBlock:
            return None
        finally:
            self.lock.release()

    async def aappend(self, factory: EntryFactory[E], *, defer: bool = False) -> E:
        """`append` for the event loop: on the loop when that cannot block (then
        awaiting the group commit under ``"batch"``), else in a worker thread.

        With ``defer`` (``"batch"`` on the loop's path), the entry is written to the
        file, where a killed process does not lose it, but not yet fsynced: the store's
        next commit (any append without ``defer``, `settle`, `asettle`, closing the
        file) makes it durable in the same round as its own, so a turn's user message
        and its reply cost one round. A power cut before then loses it from the file;
        a caller defers only what is kept elsewhere until then (the inbound journal) or
        not yet acknowledged to anyone, and settles when it ends without appending."""
        done = self.try_append_nowait(factory, defer=defer)
        if done is None:
            return await anyio.to_thread.run_sync(self.append, factory)
        entry, pending = done
        if pending:
            await self._async_committer.commit(pending)
        return entry

    @property
    def unsettled(self) -> bool:
        """Some append was deferred and is not durable yet."""
        return bool(self._deferred)

    def settle(self) -> None:
        """Make the deferred appends durable now (one group-commit round)."""
        with self.lock:
            pending = self._take_deferred()
        if pending:
            self._committer.commit(pending)

    async def asettle(self) -> None:
        """`settle` for the event loop."""
        if not self._deferred:
            return
        if not self.lock.acquire(blocking=False):
            await anyio.to_thread.run_sync(self.settle)
            return
        try:
            pending = self._take_deferred()
        finally:
            self.lock.release()
        if pending:
            await self._async_committer.commit(pending)

    def try_load_nowait(self) -> bool:
        """`load` without blocking: False (nothing loaded) when it would wait for a
        lock or read more than `INLINE_READ_MAX` bytes."""
        if not self._io_on_loop or not self.lock.acquire(blocking=False):
            return False
        try:
            handle = self._acquire_current(wait=False)
        except _WouldBlock:
            return False
        finally:
            self.lock.release()
        if handle is not None:
            fcntl.flock(handle.fd, fcntl.LOCK_UN)
        return True

    def is_current_nowait(self) -> bool:
        """True when the tree reflects the file (one ``stat``); False when a `refresh`
        is due or the store is busy."""
        if not self._io_on_loop or not self.lock.acquire(blocking=False):
            return False
        try:
            try:
                st = os.stat(self._fspath)
            except FileNotFoundError:
                return not self._on_disk
            except OSError:
                return False
            handle = self._handle
            return (
                handle is not None
                and (st.st_dev, st.st_ino) == (handle.dev, handle.ino)
                and st.st_size == self._seen_size
            )
        finally:
            self.lock.release()

    def _append_locked(
        self, factory: EntryFactory[E], *, wait: bool = True
    ) -> tuple[E, _Pending | None]:
        """Write the entry (under the locks); with it, what its group commit needs under
        ``"batch"`` (None otherwise: ``"always"`` fsynced it here, ``"never"`` does not)."""
        for _ in range(_MAX_ATTEMPTS):
            handle = self._acquire_current(wait=wait)
            if handle is None:
                entry = build_entry(self._tree, factory)
                head = encode_line(self._header).encode()
                first = encode_line(entry).encode()
                log = self._commit_log
                if self._create_file(head + first, wait=wait, logged=log is not None):
                    self._tree.add(entry)
                    new = self._handle
                    assert new is not None
                    if log is None:  # fsynced here unless "never"
                        return entry, _Pending(new) if self._policy == "batch" else None
                    # The round fsyncs the folder (the name) and the log (the bytes).
                    lines = record(self._log_name, new.ino, 0, head) + record(
                        self._log_name, new.ino, len(head), first
                    )
                    return entry, _Pending(new, log, lines, new.written, self._path.parent)
                continue  # another writer created it first: adopt that file
            try:
                if self._torn:
                    self._repair_torn(handle)
                entry = build_entry(self._tree, factory)
                line = encode_line(entry)
                if self._size == 0:  # an empty file: our header goes first
                    line = encode_line(self._header) + line
                elif self._unterminated:
                    line = "\n" + line
                data = line.encode()
                self._write(handle, data)
                self._tree.add(entry)
                self._on_disk = True
                self._unterminated = False
                pending = None
                if self._commit_log is not None and self._foreign:
                    # Another writer's lines come before ours and may not be durable:
                    # the round fsyncs the file, theirs with ours.
                    pending = _Pending(handle)
                    self._foreign = False
                elif self._commit_log is not None:
                    # O_APPEND left the file offset at the end of our bytes.
                    at = os.lseek(handle.fd, 0, os.SEEK_CUR) - len(data)
                    pending = _Pending(
                        handle,
                        self._commit_log,
                        record(self._log_name, handle.ino, at, data),
                        handle.written,
                    )
                elif self._policy == "batch":
                    pending = _Pending(handle)
            finally:
                fcntl.flock(handle.fd, fcntl.LOCK_UN)
            if self._policy == "always":
                self._sync_now(handle)
            return entry, pending
        raise SessionError(f"session file {self._path} keeps changing; try again")

    def _write(self, handle: _FileHandle, data: bytes) -> None:
        try:
            written = os.write(handle.fd, data)
        except OSError as exc:
            self._truncate_quietly(handle)
            raise SessionError(
                f"could not append to session file {self._path}: {exc.strerror}; "
                "check free disk space and permissions"
            ) from None
        if written != len(data):
            self._truncate_quietly(handle)
            raise SessionError(
                f"could not append to session file {self._path}: short write "
                f"({written} of {len(data)} bytes); check free disk space"
            )
        handle.written += 1
        self._size += written
        self._seen_size = self._size
        self._next_lineno += data.count(b"\n")

    def _truncate_quietly(self, handle: _FileHandle) -> None:
        try:
            os.ftruncate(handle.fd, self._size)
        except OSError:
            pass

    def _sync_now(self, handle: _FileHandle) -> None:
        try:
            handle.sync()
        except OSError as exc:
            raise SessionError(
                f"the session entry was written but could not be fsynced: {exc.strerror}"
            ) from None

    def _open_new(self, *, wait: bool, logged: bool = False) -> int | None:
        """A descriptor of a new, empty file at our path (a linked spare, or an
        ``O_EXCL`` create), or None if the path exists. With ``wait=False`` raises
        `_WouldBlock` unless a spare is at hand and nothing must be fsynced here
        (``"never"``, or ``logged``: the group commit fsyncs the folder)."""
        pool = self._spares
        no_fsync = self._policy == "never" or logged
        spare = pool.take() if pool is not None and (wait or no_fsync) else None
        if pool is not None and spare is not None:
            try:
                os.link(spare.path, self._path)  # never replaces an existing name
            except FileExistsError:
                pool.give_back(spare)
                return None
            except OSError:
                pool.discard(spare)  # unusable (removed, another file system): create
            else:
                pool.retire(spare)  # its spare name goes, off this path
                return spare.fd
        if not wait:
            raise _WouldBlock
        try:
            return os.open(self._path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            return None
        except OSError as exc:
            raise SessionError(
                f"could not create session file {self._path}: {exc.strerror}"
            ) from None

    def _create_file(self, data: bytes, *, wait: bool = True, logged: bool = False) -> bool:
        """Create the file holding ``data`` (header first); False if it already exists.
        Durable when this returns unless ``"never"`` or ``logged`` (the caller's group
        commit then fsyncs the folder and logs the bytes).

        A new empty file (see `_open_new`), then the write under the lock. Until the
        write lands the file is empty, which every reader treats as "no session yet";
        a writer that took the lock first has written its own header, so we back off
        and adopt its file. A crash in between leaves an empty file, which the next
        append fills.
        """
        fd = self._open_new(wait=wait, logged=logged)
        if fd is None:
            return False
        handle = _FileHandle(fd)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size:
                handle.close(sync=False)
                return False
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                if self._policy != "never" and not logged:
                    _datasync(fd)
            except OSError as exc:
                try:
                    os.ftruncate(fd, 0)  # back to "no session yet"
                except OSError:
                    pass
                handle.close(sync=False)
                raise SessionError(
                    f"could not write session file {self._path}: {exc.strerror}; "
                    "check free disk space"
                ) from None
        finally:
            if not handle.closed:
                fcntl.flock(fd, fcntl.LOCK_UN)
        if self._policy == "never" or logged:
            handle.written += 1  # not fsynced yet: flush() or the group commit will
        self._adopt_new_file(handle, len(data), data.count(b"\n"), sync_dir=not logged)
        return True

    def _adopt_new_file(
        self, handle: _FileHandle, size: int, lines: int, *, sync_dir: bool = True
    ) -> None:
        self._close_handle()
        self._handle = handle
        self._ident = (handle.dev, handle.ino)
        self._size = self._seen_size = size
        self._next_lineno = lines + 1
        self._unterminated = False
        self._torn = False
        self._on_disk = True
        if self._policy == "never":
            self._dir_dirty = True
        elif sync_dir:
            fsync_dir(self._path.parent)

    def create_with(self, entries: Sequence[Entry]) -> None:
        """Write a new file holding the header and ``entries`` (a fork's copied branch)."""
        with self.lock:
            if self._on_disk or self._path.exists():
                raise SessionExistsError(f"a session already exists at {self._path}")
            if not entries:
                return  # like any session: the file appears with the first entry
            data = "".join([encode_line(self._header), *map(encode_line, entries)]).encode()
            if not self._create_file(data):
                raise SessionExistsError(f"a session already exists at {self._path}")
            for entry in entries:
                self._tree.add(entry)

    def flush(self) -> None:
        """Under ``fsync="never"`` fsync now; otherwise every append already was, but
        the deferred ones (`settle`)."""
        with self.lock:
            if self._policy != "never":
                self.settle()
                return
            if self._handle is not None:
                self._sync_now(self._handle)
            if self._dir_dirty:
                fsync_dir(self._path.parent)
                self._dir_dirty = False

    def archive(self) -> Path | None:
        """Move the current file to ``archive/<stem>/<time>-<session id>.jsonl`` and start
        a fresh session whose header will name the old one as ``previous_session``.

        Done under the file lock, so no other writer appends half-way through.
        """
        with self.lock:
            handle = self._acquire_current()
            if handle is None:  # nothing on disk: just a new session id
                self._start_fresh(previous_session=self._header.previous_session)
                return None
            old_id = self._header.id
            try:
                if self._commit_log is not None:  # its lines leave the log's reach with the name
                    handle.sync()
                stem = self._path.name[: -len(SUFFIX)]
                archive = self._path.parent / ARCHIVE_DIR
                archive.mkdir(mode=DIR_MODE, exist_ok=True)
                folder = archive / stem
                folder.mkdir(mode=DIR_MODE, exist_ok=True)
                target = _free_name(folder / archive_name(old_id, time.time()))
                os.rename(self._path, target)
                if self._policy != "never":
                    fsync_dir(folder)
                    fsync_dir(self._path.parent)
            except OSError as exc:
                raise SessionError(
                    f"could not archive session file {self._path}: {exc.strerror}"
                ) from None
            finally:
                fcntl.flock(handle.fd, fcntl.LOCK_UN)
            self._close_handle()
            self._start_fresh(previous_session=old_id)
            if self._index is not None:
                remove_index(self._index)
            self._log.info("archived session {} to {}", old_id, target)
            return target

    def export_jsonl(self) -> str:
        with self.lock:
            try:
                return self._path.read_text(encoding="utf-8")
            except FileNotFoundError:
                return ""
            except OSError as exc:
                raise SessionError(f"cannot read {self._path}: {exc.strerror}") from None

    def delete(self) -> bool:
        """Remove the current file (under its lock); the store starts fresh."""
        with self.lock:
            handle = self._acquire_current()
            removed = False
            if handle is not None:
                try:
                    os.unlink(self._path)
                    removed = True
                    if self._policy != "never":
                        fsync_dir(self._path.parent)
                finally:
                    fcntl.flock(handle.fd, fcntl.LOCK_UN)
                self._handle = None
                handle.close(sync=False)
                self._deferred = []  # their file is gone
            if self._index is not None:
                remove_index(self._index)
            self._start_fresh()
            return removed

    def close(self) -> None:
        """Close the descriptor (fsyncing unless ``never``); the next use reopens it."""
        with self.lock:
            self._close_handle()


class MemorySessionStore:
    """The same contract with no disk at all (tests, ephemeral sessions)."""

    def __init__(self, key: str, *, header: SessionHeader | None = None) -> None:
        self.lock = threading.RLock()
        self.key = key
        self._header = header or new_header(key)
        self._tree = SessionTree(key)

    @property
    def path(self) -> None:
        return None

    @property
    def header(self) -> SessionHeader:
        return self._header

    @property
    def tree(self) -> SessionTree:
        return self._tree

    @property
    def on_disk(self) -> bool:
        return False

    @property
    def persisted(self) -> bool:
        """True once an entry was added (the in-memory stand-in for "has a file")."""
        return len(self._tree) > 0

    @property
    def size(self) -> int:
        return 0

    @property
    def report(self) -> LoadReport:
        return LoadReport(entries=len(self._tree))

    def append(self, factory: EntryFactory[E]) -> E:
        with self.lock:
            entry = build_entry(self._tree, factory)
            encode_line(entry)  # same JSON rules as on disk
            self._tree.add(entry)
            return entry

    async def aappend(self, factory: EntryFactory[E], *, defer: bool = False) -> E:
        return self.append(factory)

    async def asettle(self) -> None:
        return None

    def create_with(self, entries: Sequence[Entry]) -> None:
        with self.lock:
            if len(self._tree):
                raise SessionExistsError(f"a session already exists for key {self.key!r}")
            for entry in entries:
                self._tree.add(entry)

    def load(self) -> None:
        pass

    def refresh(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def export_jsonl(self) -> str:
        with self.lock:
            if not len(self._tree):
                return ""
            return "".join([encode_line(self._header), *map(encode_line, self._tree.entries())])

    def archive(self) -> None:
        with self.lock:
            previous = self._header.id if len(self._tree) else None
            self._header = new_header(self.key, previous_session=previous)
            self._tree = SessionTree(self.key)

    def delete(self) -> bool:
        with self.lock:
            had = len(self._tree) > 0
            self._header = new_header(self.key)
            self._tree = SessionTree(self.key)
            return had
