"""The commit log of ``fsync="batch"``: one fsync makes a whole round of appends durable.

Promises kept here:
- An append acknowledged under ``"batch"`` is on disk: its bytes are in the session file
  (page cache) and, fsynced, in this process's commit log; a round costs one fsync of the
  log whatever the number of session files it touched.
- A session file is never overwritten by a replay: recovery only appends the missing
  end of a logged line to the file it was written to (same name, same inode), at the
  offset it was written at; a file that holds other bytes there is reported and kept.
- The log never grows without bound: past `MAX_LOG_BYTES` or `MAX_LOG_FILES` files (4,096,
  or a quarter of the process's descriptor limit) a checkpoint fsyncs every session file
  the log covers, then empties the log.

The log is human-readable JSONL in ``<sessions>/.commit-log/<pid>-<random>.jsonl``, one
line per appended session line: ``{"file": name, "ino": inode, "at": offset, "line":
<the entry, as written>}`` (``"text"`` holds the bytes as a string when they are not
one JSON object and a newline). A live process holds ``flock`` on its log; a log nobody
holds belongs to a process that died, and the next `recover_commit_logs` (run when a
`SessionManager` opens the folder) replays and removes it.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from gateway.fsutil import fsync_dir
from gateway.logs import logger

LOG_DIR = ".commit-log"


def _max_log_files() -> int:
    """4,096 files, or a quarter of the descriptors the process may open if that is
    less: each file the log covers stays open until the checkpoint."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(64, min(4096, soft // 4))


#: A checkpoint empties the log past this many bytes ...
MAX_LOG_BYTES = 64 * 1024 * 1024
#: ... or once it covers this many session files.
MAX_LOG_FILES = _max_log_files()
_OPEN_FLAGS = os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


class Syncable(Protocol):
    """A session file's handle: `sync` fsyncs what was written to it."""

    def sync(self) -> None: ...


def record(name: bytes, ino: int, offset: int, data: bytes) -> bytes:
    """The log line for ``data`` written at ``offset`` of file ``name`` (a JSON string,
    encoded) with inode ``ino``."""
    if data.startswith(b"{") and data.endswith(b"}\n") and data.count(b"\n") == 1:
        return b'{"file":%s,"ino":%d,"at":%d,"line":%s}\n' % (name, ino, offset, data[:-1])
    text = json.dumps(data.decode("utf-8"), ensure_ascii=False).encode()
    return b'{"file":%s,"ino":%d,"at":%d,"text":%s}\n' % (name, ino, offset, text)


def encoded_name(path: Path) -> bytes:
    return json.dumps(path.name, ensure_ascii=False).encode()


class CommitLog:
    """This process's log for one sessions folder; thread-safe, created at first use."""

    def __init__(self, sessions_dir: Path) -> None:
        self._dir = sessions_dir / LOG_DIR
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0
        self._covered: dict[int, Syncable] = {}  # files with lines in the log
        self.checkpoints = 0  # for tests and the benchmark

    def _open(self) -> int:
        if self._fd is None:
            self._dir.mkdir(mode=0o700, exist_ok=True)
            path = self._dir / f"{os.getpid()}-{os.urandom(6).hex()}.jsonl"
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # alive: nobody replays it
            fsync_dir(self._dir)  # a log that vanished in a crash would cover nothing
            self._fd, self._path, self._size = fd, path, 0
        return self._fd

    def commit(
        self,
        lines: list[bytes],
        files: Iterable[Syncable],
        sync_files: Callable[[list[Syncable]], None],
    ) -> None:
        """Write ``lines`` and fsync the log: when this returns they are durable. Raises
        `OSError` (the log then holds none of them) if the disk refused."""
        data = b"".join(lines)
        with self._lock:
            fd = self._open()
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(28, "short write to the commit log")
                _datasync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, self._size)  # no half line for the next round to extend
                except OSError:
                    pass
                raise
            self._size += written
            for handle in files:
                self._covered[id(handle)] = handle
            if self._size > MAX_LOG_BYTES or len(self._covered) > MAX_LOG_FILES:
                self._checkpoint_locked(sync_files)

    def _checkpoint_locked(self, sync_files: Callable[[list[Syncable]], None]) -> None:
        sync_files(list(self._covered.values()))  # raises if one cannot be fsynced
        self._covered.clear()
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a lost truncation only replays matching bytes
            self._size = 0
        self.checkpoints += 1

    def close(self, sync_files: Callable[[list[Syncable]], None]) -> None:
        """Checkpoint and remove the log (the owner closes the folder)."""
        with self._lock:
            if self._fd is None:
                return
            self._checkpoint_locked(sync_files)
            assert self._path is not None
            try:
                os.unlink(self._path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = self._path = None


# -- recovery -------------------------------------------------------------------------


def _parse(line: bytes) -> tuple[str, int, int, bytes] | None:
    try:
        row = json.loads(line)
        name, ino, at = row["file"], row["ino"], row["at"]
        if not (isinstance(name, str) and isinstance(ino, int) and isinstance(at, int)):
            return None
        if "text" in row:
            return name, ino, at, str(row["text"]).encode()
        prefix = b'{"file":%s,"ino":%d,"at":%d,"line":' % (
            json.dumps(name, ensure_ascii=False).encode(),
            ino,
            at,
        )
        if not line.startswith(prefix) or not line.endswith(b"}"):
            return None
        return name, ino, at, line[len(prefix) : -1] + b"\n"
    except (ValueError, KeyError, TypeError):
        return None


def _replay_file(path: Path, ino: int, rows: list[tuple[int, bytes]]) -> int:
    """Append the missing ends of ``rows`` (offset, bytes) to ``path``; lines restored."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return 0  # removed or archived since: its lines were fsynced before that
    restored = 0
    try:
        if os.fstat(fd).st_ino != ino:
            return 0  # another file under the name now (a reset): not ours to extend
        fcntl.flock(fd, fcntl.LOCK_EX)
        for at, data in sorted(rows, key=lambda r: r[0]):
            size = os.fstat(fd).st_size
            have = os.pread(fd, min(len(data), max(size - at, 0)), at) if size > at else b""
            if not data.startswith(have):
                logger.warning(
                    "session file {}: bytes at offset {} differ from the commit log; "
                    "kept as they are",
                    path,
                    at,
                )
                continue
            if len(have) == len(data):
                continue  # already there (the usual case: only the process died)
            if size != at + len(have):
                logger.warning(
                    "session file {}: a logged line at offset {} cannot be restored "
                    "(the file ends at {}); kept as it is",
                    path,
                    at,
                    size,
                )
                continue
            os.write(fd, data[len(have) :])
            restored += 1
        # Also when every line was there already (the process was killed, the machine
        # stayed up): they may still be only in the page cache, and once the log is
        # removed nothing else would restore them after a power cut.
        _datasync(fd)
    finally:
        os.close(fd)
    return restored


def recover_commit_logs(sessions_dir: Path) -> int:
    """Replay and remove the logs of processes that died; the lines restored. Every
    file a log covers is fsynced before the log is removed."""
    folder = sessions_dir / LOG_DIR
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return 0
    rows: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
    dead: list[tuple[Path, int]] = []
    for name in names:
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live process's log
        dead.append((path, fd))
        with open(fd, "rb", closefd=False) as f:
            for line in f.read().split(b"\n"):
                parsed = _parse(line) if line.strip() else None
                if parsed is None:
                    continue  # a torn last line: its round was never acknowledged
                file, ino, at, data = parsed
                if Path(file).name != file or file.startswith("."):
                    continue  # never outside the folder
                rows.setdefault((file, ino), []).append((at, data))
    restored = 0
    try:
        for (file, ino), file_rows in rows.items():
            restored += _replay_file(sessions_dir / file, ino, file_rows)
        for path, _fd in dead:
            os.unlink(path)
        if dead:
            fsync_dir(folder)
    finally:
        for _path, fd in dead:
            os.close(fd)
    if restored:
        logger.warning(
            "restored {} session line(s) from the commit log of a process that stopped "
            "(a crash or power cut lost them from the session files)",
            restored,
        )
    return restored
