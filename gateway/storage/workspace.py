"""The workspace's folders: made and checked in one place, so every command (and
`gateway doctor`) meets an unwritable workspace the same way `gateway run` would; and the
workspace's one-writer lock (`WorkspaceLock`).

An unwritable workspace is the operator's to fix (ownership of a volume, a read-only
mount, the immutable flag), so it is reported as one line naming the path and the fix,
with exit code 78 (EX_CONFIG) so that systemd and compose do not restart in a loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.fsutil import ensure_private_dir, probe_writable
from gateway.memory.scopes import MEMORY_DIRNAME

if TYPE_CHECKING:
    from gateway.config import PartialSettings, Settings

#: errno values that mean "this user may not write here", not a passing condition:
#: restarting cannot fix them. (A full disk can heal by itself, so ENOSPC is not one.)
WRITE_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


class WorkspaceError(Exception):
    """A workspace folder cannot be made or written; the message names it and the fix."""


def _user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry, common in containers
        return str(uid)


def _owner(path: str | os.PathLike[str]) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


def write_denied(exc: BaseException) -> bool:
    """Is `exc` a refusal to write that only the operator can lift?"""
    return isinstance(exc, OSError) and exc.errno in WRITE_DENIED


def cannot_write(path: str | os.PathLike[str], exc: OSError) -> WorkspaceError:
    """The one-line error for `exc` met while writing in `path`, with the fix."""
    elsewhere = "or choose another folder with --workspace or GATEWAY_WORKSPACE"
    if exc.errno == errno.EROFS:
        fix = f"mount it read-write, {elsewhere}"
    elif exc.errno == errno.EPERM:
        # EPERM where permissions allow it is the immutable flag (chattr +i) or a
        # security module, not the mode bits.
        fix = f"check `lsattr -d {path}` (chattr -i clears the immutable flag), {elsewhere}"
    elif _owner(path) not in (None, os.geteuid()):
        user = _user()
        fix = f"give it to user {user} (`chown -R {user} {path}`), {elsewhere}"
    else:
        fix = f"let its owner write in it (`chmod u+rwx {path}`), {elsewhere}"
    return WorkspaceError(f"cannot write in {path} ({exc.strerror or exc}): {fix}")


def workspace_folders(settings: Settings | PartialSettings) -> list[Path]:
    """The folders `gateway run` writes in, the workspace first."""
    folders = [settings.workspace_path, settings.sessions_dir]
    if settings.memory.enabled:
        folders.append(settings.workspace_path / MEMORY_DIRNAME)
    return folders


def check_workspace(settings: Settings | PartialSettings) -> None:
    """Probe every workspace folder that exists for a new file; creates nothing that
    stays. Raises WorkspaceError for the first one this user cannot write in."""
    for folder in workspace_folders(settings):
        if not folder.is_dir():
            continue
        try:
            probe_writable(folder)
        except OSError as exc:
            if write_denied(exc):
                raise cannot_write(folder, exc) from None
            raise


def make_folder(folder: Path) -> None:
    """Make `folder` (0700) where missing; WorkspaceError naming the fix if it cannot be."""
    try:
        ensure_private_dir(folder)
    except OSError as exc:
        where = exc.filename or folder
        if write_denied(exc):
            raise cannot_write(Path(where).parent, exc) from None
        raise WorkspaceError(
            f"cannot create {folder} ({exc.strerror or exc}): choose another folder "
            "with --workspace or GATEWAY_WORKSPACE"
        ) from None


def prepare_workspace(settings: Settings | PartialSettings) -> None:
    """Make the workspace's folders (0700) where missing and check each can be
    written; WorkspaceError if not. What `gateway run` and `gateway doctor` both do."""
    for folder in workspace_folders(settings):
        make_folder(folder)
    check_workspace(settings)


# -- one writer per workspace -------------------------------------------------------

#: The workspace's lock file: held (an `flock`) by the one process that writes the
#: workspace, and saying which one that is (JSON: pid, command, HTTP address, since).
LOCK_FILE = "gateway.lock"
#: Exit code of a command refused because another process writes the workspace
#: (sysexits EX_TEMPFAIL: try again once it has stopped).
EXIT_BUSY = 75


@dataclass(frozen=True, slots=True)
class Holder:
    """The process holding a workspace's lock, as its lock file says."""

    pid: int | None
    command: str
    url: str | None
    since: float | None

    def describe(self) -> str:
        parts = [f"pid {self.pid}" if self.pid else "pid unknown", f"`{self.command}`"]
        if self.url:
            parts.append(self.url)
        if self.since:
            parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)))
        return ", ".join(parts)


class WorkspaceBusy(WorkspaceError):
    """Another process writes the workspace; the message names it and what to do."""

    def __init__(self, folder: Path, holder: Holder | None, doing: str, fix: str) -> None:
        who = holder.describe() if holder is not None else "a process that just started"
        super().__init__(f"{doing}: another gateway is running on {folder} ({who}); {fix}")
        self.holder = holder


def _read_holder(fd: int) -> Holder | None:
    try:
        raw = os.pread(fd, 4096, 0)
        data = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    url = data.get("url")
    since = data.get("since")
    return Holder(
        pid=pid if isinstance(pid, int) else None,
        command=str(data.get("command") or "gateway"),
        url=url if isinstance(url, str) else None,
        since=float(since) if isinstance(since, int | float) else None,
    )


class WorkspaceLock:
    """One writer per workspace: an `flock` on ``<workspace>/gateway.lock``.

    The promise: while a `gateway run` (or `gateway chat`, or a command that changes
    the workspace) holds it, no second one writes the same files. The kernel drops the
    lock when its process ends however it ends, SIGKILL included: a stale lock cannot
    outlive its holder. The file says who holds it (for the refusal's one line and for
    `gateway doctor`); readers (`sessions list`, `memory show`, `usage`) never take it.
    The descriptor is not inherited by child processes (MCP servers), which would
    otherwise keep the lock after the gateway died.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_FILE
        self._fd: int | None = None
        self._command = ""
        self._since = 0.0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, command: str, *, doing: str, fix: str, wait: float = 1.0) -> WorkspaceLock:
        """Take the lock for `command` (e.g. ``gateway run``), or raise `WorkspaceBusy`
        saying `doing` failed, who holds it, and `fix`. Waits up to `wait` seconds: a
        reader's probe (`holder`) holds it shared for a moment."""
        make_folder(self.folder)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if write_denied(exc):
                raise cannot_write(self.folder, exc) from None
            raise
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise WorkspaceBusy(self.folder, holder, doing, fix) from None
                time.sleep(0.02)
        self._fd, self._command, self._since = fd, command, time.time()
        self._write(None)
        return self

    def announce(self, url: str) -> None:
        """Say where the holder serves (its HTTP address), once it listens."""
        self._write(url)

    def _write(self, url: str | None) -> None:
        if self._fd is None:
            return
        record = {"pid": os.getpid(), "command": self._command, "url": url, "since": self._since}
        data = json.dumps(record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # nobody holds it: no stale name in it either
            os.close(fd)  # the lock goes with the descriptor

    def __enter__(self) -> WorkspaceLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def holder(folder: Path) -> Holder | None:
    """The process writing the workspace at `folder` now, or None. A probe that takes
    the lock shared for a moment, never creating the file or changing anything."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            found = _read_holder(fd)
            if found is None:  # caught between its truncate and its write
                time.sleep(0.05)
                found = _read_holder(fd)
            return found or Holder(None, "gateway", None, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
