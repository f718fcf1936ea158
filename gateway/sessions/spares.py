"""Spare session files: new sessions start without waiting for the file system.

Creating a file (an inode) can take hundreds of microseconds on a busy disk, and every
new conversation needs one before its first message is acknowledged. A `SparePool`
keeps a few empty, private (0600) files ready in ``<sessions>/.spares/``; a background
thread tops it up. A new session then *links* a spare to its
own name, which is a directory entry only (``link`` fails if the name exists, so a
session file is never replaced), and drops the spare name. An empty file is what every
reader already treats as "no session yet", so a crash at any step leaves nothing
wrong: at worst an empty session file, or a stale spare that the next pool removes.

Everything falls back to a plain ``O_CREAT | O_EXCL`` create when no spare is at hand.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

from gateway.logs import logger

SPARE_PREFIX = "spare-"
#: The pool's folder inside the sessions folder (same file system, so links work).
SPARES_DIR = ".spares"


class Spare:
    """One spare file: its open descriptor and its hidden name."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path


class SparePool:
    """Up to `size` empty files ready in `folder`, opened with `flags` and `mode`."""

    def __init__(
        self, folder: Path, *, flags: int, mode: int, dir_mode: int = 0o700, size: int = 16
    ) -> None:
        self._folder = folder
        self._dir_mode = dir_mode
        self._flags = flags
        self._mode = mode
        self._size = size
        self._spares: deque[Spare] = deque()
        self._retired: list[Path] = []  # names of spares now in use, to unlink
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.taken = 0  # spares handed out (tests, benchmarks)
        self._remove_stale()

    def take(self) -> Spare | None:
        """A spare (the caller owns it now), or None if none is ready."""
        with self._lock:
            spare = self._spares.popleft() if self._spares else None
            if spare is not None:
                self.taken += 1
            self._start_locked()
        self._wanted.set()
        return spare

    def retire(self, spare: Spare) -> None:
        """`spare` is linked under its session's name now: its own name is dropped by
        the top-up thread (off the caller's path; a crash first leaves a second name
        that the next pool removes)."""
        with self._lock:
            if not self._closed:
                self._retired.append(spare.path)
                self._start_locked()
                retire_now = None
            else:
                retire_now = spare.path
        if retire_now is not None:
            _unlink_quietly(retire_now)
        else:
            self._wanted.set()

    def discard(self, spare: Spare) -> None:
        """Drop a spare that cannot be used (its file and descriptor)."""
        _discard(spare)

    def give_back(self, spare: Spare) -> None:
        """Return a spare that was not used (e.g. its target name existed)."""
        with self._lock:
            if not self._closed:
                self._spares.appendleft(spare)
                return
        _discard(spare)

    def close(self) -> None:
        """Stop topping up and remove the spares not handed out."""
        with self._lock:
            self._closed = True
            spares, self._spares = list(self._spares), deque()
            thread = self._thread
        self._wanted.set()
        if thread is not None:
            thread.join()
        for spare in spares:
            _discard(spare)
        with self._lock:
            retired, self._retired = self._retired, []
        for path in retired:
            _unlink_quietly(path)

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._top_up, name="session-spares", daemon=True)
            self._thread.start()

    def _top_up(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            while True:
                with self._lock:
                    retired, self._retired = self._retired, []
                for path in retired:
                    _unlink_quietly(path)
                with self._lock:
                    if self._closed:
                        return
                    if len(self._spares) >= self._size:
                        break
                spare = self._create()
                if spare is None:
                    break  # the folder refuses: takers fall back to a plain create
                with self._lock:
                    if self._closed:
                        _discard(spare)
                        return
                    self._spares.append(spare)

    def _create(self) -> Spare | None:
        path = self._folder / f"{SPARE_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        try:
            self._folder.mkdir(mode=self._dir_mode, exist_ok=True)
            fd = os.open(path, self._flags | os.O_CREAT | os.O_EXCL, self._mode)
        except OSError as exc:
            logger.warning("cannot prepare a spare session file in {}: {}", self._folder, exc)
            return None
        return Spare(fd, path)

    def _remove_stale(self) -> None:
        """Remove the spares of processes that are gone."""
        try:
            with os.scandir(self._folder) as it:
                names = [e for e in it if e.name.startswith(SPARE_PREFIX)]
            for entry in names:
                try:
                    if _pid_gone(entry.name):
                        # Harmless even if a crash left it linked as a session file
                        # too: that name keeps the file.
                        os.unlink(entry.path)
                except OSError:
                    pass
        except OSError:
            pass


def _pid_gone(name: str) -> bool:
    """True if the spare's creator (the pid in its name) is not running."""
    try:
        pid = int(name[len(SPARE_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _discard(spare: Spare) -> None:
    _unlink_quietly(spare.path)
    try:
        os.close(spare.fd)
    except OSError:
        pass
