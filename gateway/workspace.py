"""The workspace's folders: made and checked in one place, so every command (and
`gateway doctor`) meets an unwritable workspace the same way `gateway run` would.

An unwritable workspace is the operator's to fix (ownership of a volume, a read-only
mount, the immutable flag), so it is reported as one line naming the path and the fix,
with exit code 78 (EX_CONFIG) so that systemd and compose do not restart in a loop.
"""

from __future__ import annotations

import errno
import os
import pwd
from pathlib import Path

from gateway.config import Settings
from gateway.fsutil import ensure_private_dir, probe_writable
from gateway.memory.scopes import MEMORY_DIRNAME

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


def workspace_folders(settings: Settings) -> list[Path]:
    """The folders `gateway run` writes in, the workspace first."""
    folders = [settings.workspace_path, settings.sessions_dir]
    if settings.memory.enabled:
        folders.append(settings.workspace_path / MEMORY_DIRNAME)
    return folders


def check_workspace(settings: Settings) -> None:
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


def prepare_workspace(settings: Settings) -> None:
    """Make the workspace's folders (0700) where missing and check each can be
    written; WorkspaceError if not. What `gateway run` and `gateway doctor` both do."""
    for folder in workspace_folders(settings):
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
    check_workspace(settings)
