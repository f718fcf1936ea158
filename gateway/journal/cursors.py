"""Channel cursors: the read position a channel confirms to its platform itself (Matrix's
/sync `since` token), kept where the next start (or the next replica) finds it; and the
small state a channel must keep beside it (Matrix's end-to-end crypto store, as one blob).

A channel saves a cursor only after everything before it is in the journal, so the
cursor never runs ahead of what the gateway holds. Promises kept here:
- `save` and `save_blob` return once the new value is durable (file mode: temp file,
  fsync, rename; a crash leaves the old value or the new one, never a torn file).
- A damaged cursor file is moved aside and reported, never overwritten in silence; the
  channel then starts as on a first run.
- Blobs are private: files of mode 0600 in a 0700 folder of the workspace.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio.to_thread
from loguru import logger

from gateway.fsutil import atomic_write_bytes, atomic_write_text, ensure_private_dir
from gateway.journal.protocol import CursorStore, Lead

#: The cursor file, in the workspace folder.
CURSOR_FILE = "channel-cursors.json"
#: The folder of channel state blobs, in the workspace folder.
STATE_DIR = "channel-state"


class FileCursorStore:
    """Cursors in one small JSON file of the workspace, blobs in files of `state_dir`
    (by default `channel-state/` beside the cursor file) (`CursorStore`)."""

    def __init__(self, path: Path, state_dir: Path | None = None) -> None:
        self.path = path
        self.state_dir = state_dir if state_dir is not None else path.parent / STATE_DIR
        self._lock = threading.Lock()

    def blob_path(self, name: str) -> Path:
        """The file of blob `name` (its name percent-encoded: reversible, and never a
        path outside `state_dir`)."""
        return self.state_dir / urllib.parse.quote(name, safe="")

    async def load_blob(self, name: str) -> bytes | None:
        return await anyio.to_thread.run_sync(self._read_blob, self.blob_path(name))

    async def save_blob(self, name: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._write_blob, self.blob_path(name), data)

    @staticmethod
    def _read_blob(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def _write_blob(self, path: Path, data: bytes) -> None:
        ensure_private_dir(self.state_dir)
        atomic_write_bytes(path, data)

    async def load(self, name: str) -> str | None:
        return (await anyio.to_thread.run_sync(self._read)).get(name)

    async def save(self, name: str, value: str) -> None:
        await anyio.to_thread.run_sync(self._write, name, value)

    def _read(self) -> dict[str, str]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError("not an object of strings")
        except ValueError as exc:
            aside = self.path.with_name(f"{self.path.name}.damaged.{int(time.time())}")
            self.path.replace(aside)
            logger.error(
                "cursors: {} is damaged ({}); moved to {}, channels start as on a first run",
                self.path,
                exc,
                aside.name,
            )
            return {}
        return data

    def _write(self, name: str, value: str) -> None:
        with self._lock:
            data = self._read()
            data[name] = value
            ensure_private_dir(self.path.parent)
            atomic_write_text(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def run_with(store: CursorStore) -> Lead:
    """The one-process `Lead`: run the intake loop at once, with `store`."""

    async def lead(work: Callable[[CursorStore], Awaitable[None]]) -> None:
        await work(store)

    return lead
