"""What a sessions folder holds, from directory listings alone (no file is opened): each
key's current session and the sessions `/new` archived, and where the archive keeps them.

Light to import (neither the entries nor the stores): `gateway sessions list` reads a
folder of files through `FileSessionListing` without the rest of the package.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from gateway.sessions.errors import SessionKeyError
from gateway.sessions.keys import SUFFIX, decode_key, encode_key, key_from_filename

#: Folder (inside the sessions folder) of the sessions `/new` replaced:
#: ``archive/<stem>/<ARCHIVE_TAG time>-<session id>.jsonl``.
ARCHIVE_DIR = "archive"
ARCHIVE_TAG = "%Y%m%dT%H%M%S%fZ"


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session file as seen in a directory listing (no parsing involved)."""

    key: str
    path: Path | None
    updated_at: float
    size_bytes: int


@dataclass(frozen=True, slots=True)
class ArchivedSessionInfo:
    """A session `/new` replaced, kept in the archive. `number` counts back from the
    key's most recently archived session (1), as `sessions show KEY --archived N` does."""

    key: str
    number: int
    session_id: str
    archived_at: float
    path: Path
    size_bytes: int


# ``<time>-<session id>.jsonl``, with ``-N`` after it when the name was taken.
_ARCHIVED_NAME = re.compile(r"(\d{8}T\d{12}Z)-([0-9A-Za-z]+)" + re.escape(SUFFIX) + r"(?:-\d+)?")


def archived_session_id(name: str) -> str | None:
    """The session id an archived session's file name holds, or None when the name is
    not an archived session's."""
    match = _ARCHIVED_NAME.fullmatch(name)
    return match.group(2) if match is not None else None


def _archived_in(folder: Path, key: str) -> list[ArchivedSessionInfo]:
    """The archived sessions of `key` in its archive folder, most recent first."""
    found: list[tuple[str, str, str, int]] = []
    try:
        with os.scandir(folder) as it:
            items = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for item in items:
        match = _ARCHIVED_NAME.fullmatch(item.name)
        if match is None:
            continue
        try:
            if not item.is_file(follow_symlinks=False):
                continue
            size = item.stat(follow_symlinks=False).st_size
        except OSError:
            continue  # removed meanwhile
        found.append((match.group(1), item.name, match.group(2), size))
    found.sort(reverse=True)
    return [
        ArchivedSessionInfo(
            key=key,
            number=n,
            session_id=session_id,
            archived_at=datetime.strptime(tag, ARCHIVE_TAG).replace(tzinfo=UTC).timestamp(),
            path=folder / name,
            size_bytes=size,
        )
        for n, (tag, name, session_id, size) in enumerate(found, start=1)
    ]


def list_session_files(sessions_dir: Path) -> list[SessionInfo]:
    """The current session files in ``sessions_dir`` (unsorted), from the directory
    listing and ``stat`` alone; other files (sidecars, temp files) are not sessions."""
    infos: list[SessionInfo] = []
    with os.scandir(sessions_dir) as it:
        for item in it:
            key = key_from_filename(item.name)
            if key is None:
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            infos.append(SessionInfo(key, Path(item.path), st.st_mtime, st.st_size))
    return infos


def list_archived_files(sessions_dir: Path, key: str | None = None) -> list[ArchivedSessionInfo]:
    """The archived session files under ``sessions_dir`` (of `key`, or of every key),
    each key's most recent first."""
    archive = sessions_dir / ARCHIVE_DIR
    if key is not None:
        return _archived_in(archive / encode_key(key), key)
    infos: list[ArchivedSessionInfo] = []
    try:
        with os.scandir(archive) as it:
            folders = sorted(it, key=lambda item: item.name)
    except FileNotFoundError:
        return []
    for folder in folders:
        try:
            folder_key = decode_key(folder.name)
        except SessionKeyError:
            continue  # not ours
        infos.extend(_archived_in(Path(folder.path), folder_key))
    return infos


def most_recent_first(infos: Iterable[SessionInfo]) -> list[SessionInfo]:
    """`infos`, most recently active first."""
    return sorted(infos, key=lambda info: info.updated_at, reverse=True)


class SessionListing(Protocol):
    """The sessions of a storage, listed without opening one (`SessionManager` lists
    those of every mode; `FileSessionListing` those of a folder, importing no more)."""

    def list_sessions(self) -> list[SessionInfo]: ...

    def list_archived(self, key: str | None = None) -> list[ArchivedSessionInfo]: ...

    def close(self) -> None: ...


class FileSessionListing:
    """The sessions of the folder `sessions_dir`, as its `SessionManager` lists them."""

    def __init__(self, sessions_dir: Path) -> None:
        self.sessions_dir = sessions_dir

    def list_sessions(self) -> list[SessionInfo]:
        """Sessions with a file, most recently active first."""
        return most_recent_first(list_session_files(self.sessions_dir))

    def list_archived(self, key: str | None = None) -> list[ArchivedSessionInfo]:
        """The sessions `/new` replaced (of `key`, or of every key), each key's most
        recent first."""
        return list_archived_files(self.sessions_dir, key)

    def close(self) -> None:
        """Nothing to close: no file is held open."""
