"""Tool outputs kept beside their session: the whole text of a tool result too big for the
context, stored under a handle the conversation that made it reads back (files; the
PostgreSQL store is `gateway.sessions.pg_store.PostgresToolOutputs`).

Promises every store keeps (tests/test_tool_outputs.py holds them for each):
- Scoped: an output is found only under the session key that stored it; a handle made
  in another conversation is not found there, whatever its bytes.
- Whole: `get` gives back exactly the text `put` stored.
- Durable before it is referred to: `put` returns once the output is on disk (a temp
  file, fsynced, linked into place, the folder fsynced) or committed, so the session
  entry that names the handle, appended after, never points at nothing. In the shared
  mode the write is behind the turn's fence (`gateway.plumbing.fence`).
- With its session: deleting a session deletes its outputs, `/new` leaves the archived
  session's outputs with it (still readable under the key), a fork copies them.

The file layout: ``<sessions>/outputs/<encoded key>/<session id>/<handle>.txt``, each
file the output's UTF-8 text and nothing else, so a person can read it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import threading
from pathlib import Path
from typing import Protocol

from gateway.fsutil import DIR_MODE, create_exclusive, fsync_dir
from gateway.sessions.errors import SessionError
from gateway.sessions.keys import encode_key

#: The folder, inside the sessions folder, that holds the stored tool outputs.
OUTPUTS_DIR = "outputs"
OUTPUT_SUFFIX = ".txt"
#: What a handle looks like: `out_` and 12 hex digits (48 random bits).
HANDLE = re.compile(r"out_[0-9a-f]{12}")
#: A session id as a folder name (headers have 32 hex digits; nothing else gets in).
_SESSION_ID = re.compile(r"[0-9A-Za-z]{1,64}")
_ATTEMPTS = 8


def new_handle() -> str:
    return "out_" + secrets.token_hex(6)


def encode_output(text: str) -> bytes:
    """The stored bytes of an output: its UTF-8 text (a lone surrogate, which no file or
    PostgreSQL text can hold, is refused here: the caller cleans the text first)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a tool output must be valid Unicode text (no lone surrogates)") from None


class ToolOutputStore(Protocol):
    """Where the tool outputs of every session of one storage mode live."""

    def put(self, key: str, session_id: str, text: str) -> str:
        """Store `text` for session `session_id` of `key`; its new handle, once durable."""
        ...

    def get(self, key: str, handle: str) -> str | None:
        """The output `handle` of `key` (None: no such output in this conversation)."""
        ...

    def delete_session(self, key: str, session_id: str) -> int:
        """Remove the outputs of one session of `key`; how many went."""
        ...

    def copy_session(self, key: str, session_id: str, new_key: str, new_session_id: str) -> int:
        """Copy one session's outputs to another (a fork), under the same handles."""
        ...


class FileToolOutputs:
    """The file mode's tool outputs: one file per output beside the session files."""

    def __init__(self, sessions_dir: Path) -> None:
        self.root = Path(sessions_dir) / OUTPUTS_DIR

    def _folder(self, key: str, session_id: str) -> Path:
        if not _SESSION_ID.fullmatch(session_id):
            raise SessionError(f"{session_id!r} is not a session id")
        return self.root / encode_key(key) / session_id

    def _find(self, key: str, handle: str) -> Path | None:
        """The file of `handle` among the sessions of `key` (current and archived)."""
        if not HANDLE.fullmatch(handle):
            return None  # never a path built from what the model wrote
        try:
            with os.scandir(self.root / encode_key(key)) as it:
                folders = [item.path for item in it if _SESSION_ID.fullmatch(item.name)]
        except (FileNotFoundError, NotADirectoryError):
            return None
        for folder in folders:
            path = Path(folder) / (handle + OUTPUT_SUFFIX)
            if path.is_file():
                return path
        return None

    def put(self, key: str, session_id: str, text: str) -> str:
        data = encode_output(text)
        folder = self._folder(key, session_id)
        _make_dirs(folder)
        for _ in range(_ATTEMPTS):
            handle = new_handle()
            if self._find(key, handle) is not None:
                continue  # taken by another session of this key
            try:
                create_exclusive(folder / (handle + OUTPUT_SUFFIX), data)
            except FileExistsError:
                continue
            except OSError as exc:
                raise SessionError(f"could not store a tool output in {folder}: {exc}") from None
            return handle
        raise SessionError("could not find a free tool output handle; try again")

    def get(self, key: str, handle: str) -> str | None:
        path = self._find(key, handle)
        if path is None:
            return None
        try:
            return path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None

    def delete_session(self, key: str, session_id: str) -> int:
        folder = self._folder(key, session_id)
        try:
            count = sum(1 for name in os.listdir(folder) if name.endswith(OUTPUT_SUFFIX))
        except FileNotFoundError:
            return 0
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the key's folder, when that was its last session's
        fsync_dir(folder.parent if folder.parent.exists() else self.root)
        return count

    def copy_session(self, key: str, session_id: str, new_key: str, new_session_id: str) -> int:
        source = self._folder(key, session_id)
        try:
            names = sorted(n for n in os.listdir(source) if _is_output_name(n))
        except FileNotFoundError:
            return 0
        target = self._folder(new_key, new_session_id)
        _make_dirs(target)
        for name in names:
            with contextlib.suppress(FileExistsError):
                create_exclusive(target / name, (source / name).read_bytes())
        return len(names)


def _is_output_name(name: str) -> bool:
    stem = name.removesuffix(OUTPUT_SUFFIX)
    return stem != name and HANDLE.fullmatch(stem) is not None


def _make_dirs(folder: Path) -> None:
    """`folder` and its missing parents (0700), each new one's parent fsynced: a file
    made inside is not lost with a folder the disk never recorded."""
    missing: list[Path] = []
    path = folder
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=DIR_MODE)
            os.chmod(path, DIR_MODE)  # mkdir's mode is filtered by the umask
        fsync_dir(path.parent)


class MemoryToolOutputs:
    """Tool outputs of the in-memory sessions (tests, throwaway sessions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outputs: dict[tuple[str, str], tuple[str, str]] = {}  # (key, handle) -> (sid, text)

    def put(self, key: str, session_id: str, text: str) -> str:
        encode_output(text)
        with self._lock:
            handle = new_handle()
            while (key, handle) in self._outputs:
                handle = new_handle()
            self._outputs[(key, handle)] = (session_id, text)
            return handle

    def get(self, key: str, handle: str) -> str | None:
        with self._lock:
            found = self._outputs.get((key, handle))
        return found[1] if found is not None else None

    def delete_session(self, key: str, session_id: str) -> int:
        with self._lock:
            gone = [k for k, (sid, _) in self._outputs.items() if k[0] == key and sid == session_id]
            for k in gone:
                del self._outputs[k]
        return len(gone)

    def copy_session(self, key: str, session_id: str, new_key: str, new_session_id: str) -> int:
        with self._lock:
            found = [
                (handle, text)
                for (k, handle), (sid, text) in self._outputs.items()
                if k == key and sid == session_id
            ]
            for handle, text in found:
                self._outputs.setdefault((new_key, handle), (new_session_id, text))
        return len(found)
