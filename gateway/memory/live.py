"""A search index kept in step with the Markdown files it indexes, and saved next to them.

The files stay the truth; the saved index is a cache of them. A source is a *stream*:
immutable archive files, oldest first, then one current file that grows by appends
(HISTORY.archive.*.md + HISTORY.md, or MEMORY.md alone). The saved index records what
it covers: the archives (name, size, mtime) and, after them, a byte count and CRC-32 of
the rest of the stream. Rotation moves the front of the current file into a new
archive without changing the rest's bytes, so it keeps the watermark valid.

Invariants:
- At open the saved index is checked against the files (archives' size and mtime, the
  rest's watermark) and brought up to date from the lines after the watermark. It is
  memory-mapped; its checksum is verified by a background thread, which drops it (to
  be rebuilt) if it does not match.
- A missing, stale or damaged index is rebuilt. Work of more than `sync_bytes` runs in
  a background thread while searches use a bounded scan (an index of the stream's last
  `fallback_bytes`), so a search never waits for a large build.
- Appends are not tokenized when they are written: their documents wait in a pending
  list and are indexed in one batch by the next search (or past `_PENDING_MAX`).
- A damaged index file is reported and kept as `<name>.damaged` (the last one), never
  trusted; a stale one is simply replaced by the rebuilt index.
- An index is saved only when the files still hold exactly the bytes it covers (checked
  by CRC at save time); otherwise it is dropped and rebuilt.

Callers hold `lock` (shared with the owner) around every method; the background thread
takes it only to swap the finished index in and to save it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.memory.index import IndexFileError, SearchIndex

Doc = tuple[str, str | None, float | None]
# Parse stream text into documents; the float is the timestamp carried from the line
# before (history lines without one date from it), returned updated.
Parser = Callable[[str, float | None], tuple[list[Doc], float | None]]

_PENDING_MAX = 4096


@dataclass(slots=True)
class _Coverage:
    """What an index covers: whole archives, then `rest_bytes` more of the stream."""

    archives: list[list[Any]] = field(default_factory=list)  # [name, size, mtime_ns]
    rest_bytes: int = 0
    rest_crc: int = 0
    carry: float | None = None


def _stat(path: Path) -> list[Any]:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def _read_from(paths: list[Path], start: int) -> bytes:
    """The concatenated bytes of `paths` from stream offset `start`."""
    chunks: list[bytes] = []
    for path in paths:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            continue
        if start >= size:
            start -= size
            continue
        with open(path, "rb") as handle:
            handle.seek(start)
            chunks.append(handle.read())
        start = 0
    return b"".join(chunks)


def _read_tail(paths: list[Path], limit: int) -> bytes:
    """About the last `limit` bytes of the stream, starting at a line boundary."""
    chunks: list[bytes] = []
    need = limit
    for path in reversed(paths):
        if need <= 0:
            break
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            continue
        with open(path, "rb") as handle:
            handle.seek(max(0, size - need))
            chunks.append(handle.read())
        need -= size
    data = b"".join(reversed(chunks))
    if need <= 0 and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]
    return data


class FileIndex:
    """The index of one stream of Markdown files, saved at `path`."""

    def __init__(
        self,
        path: Path,
        sources: Callable[[], list[Path]],
        parse: Parser,
        lock: threading.RLock,
        *,
        sync_bytes: int = 256 * 1024,
        fallback_bytes: int = 64 * 1024,
    ) -> None:
        self.path = path
        self._sources = sources
        self._parse = parse
        self._lock = lock
        self.sync_bytes = sync_bytes
        self.fallback_bytes = fallback_bytes
        self._index: SearchIndex | None = None
        self._cover = _Coverage()
        self._pending: list[Doc] = []
        self._unsaved = 0
        self._fallback: SearchIndex | None = None
        self._builder: threading.Thread | None = None
        self._generation = 0
        self._log = logger.bind(index=path.name)

    @property
    def ready(self) -> bool:
        return self._index is not None

    def current(self, *, wait: bool = False) -> SearchIndex:
        """The index to search now: the full one, or while it builds the bounded scan.

        With `wait`, a running build is joined with `lock` released; the caller must
        hold it exactly once (as `MemoryManager.load_indexes` does), or the build could
        not take it to finish."""
        if self._index is None and self._builder is None:
            self._open(wait=wait)
        if self._index is None and wait and self._builder is not None:
            builder = self._builder
            self._lock.release()
            try:
                builder.join()
            finally:
                self._lock.acquire()
            if self._index is None:  # the build failed: do it here
                self._open(wait=True)
        if self._index is None:
            if self._fallback is None:
                self._fallback = self._scan_index()
            return self._fallback
        if self._pending:
            self._index.add_many(self._pending)
            self._pending = []
        return self._index

    def appended(self, data: bytes, docs: list[Doc]) -> None:
        """We appended `data` (holding `docs`) to the current file."""
        if self._index is not None:
            self._cover.rest_bytes += len(data)
            self._cover.rest_crc = zlib.crc32(data, self._cover.rest_crc)
            if docs:
                self._cover.carry = docs[-1][2] if docs[-1][2] is not None else self._cover.carry
            self._pending.extend(docs)
            self._unsaved += len(docs)
            if len(self._pending) >= _PENDING_MAX:
                self.current()
            # Saved again once a quarter more is unsaved (O(1) amortized per line); a
            # crash loses only that much, caught up from the files at the next open.
            if self._unsaved >= max(4096, len(self._index) // 4):
                self.save()
        elif self._fallback is not None:
            self._fallback.add_many(docs)

    def invalidate(self) -> None:
        """The files were rewritten: forget the index (rebuilt on next use)."""
        self._index = None
        self._pending = []
        self._fallback = None
        self._builder = None
        self._generation += 1

    def save(self) -> None:
        """Write the index if it changed and the files still hold what it covers."""
        index = self._index
        if index is None or (not self._unsaved and not self._pending and self.path.exists()):
            return
        self.current()  # index the pending documents
        files = self._sources()
        archives, current = files[:-1], files[-1]
        known = {a[0] for a in self._cover.archives}
        rest = [p for p in archives if p.name not in known]
        try:
            tail = b"".join(p.read_bytes() for p in rest)
            data = current.read_bytes() if current.exists() else b""
            stats = [_stat(p) for p in archives]
        except OSError as exc:
            self._log.warning("Search index not saved: {}", exc)
            return
        whole = tail + data
        if len(whole) != self._cover.rest_bytes or zlib.crc32(whole) != self._cover.rest_crc:
            self._log.info("{} changed behind the index; rebuilding it", current.name)
            self.invalidate()
            return
        self._cover = _Coverage(stats, len(data), zlib.crc32(data), self._cover.carry)
        meta = {
            "archives": stats,
            "covered": len(data),
            "crc": self._cover.rest_crc,
            "carry": self._cover.carry,
        }
        try:
            index.save(self.path, meta)
        except OSError as exc:
            self._log.warning("Search index not saved ({}); it is rebuilt when needed", exc)
            return
        self._unsaved = 0

    # -- internals -------------------------------------------------------------------

    def _open(self, *, wait: bool) -> None:
        """Load the saved index and catch up, or (re)build it."""
        files = self._sources()
        try:
            index, meta = SearchIndex.load(self.path, verify=False)
            cover, start = self._check(meta, files)
            threading.Thread(
                target=self._verify,
                args=(index, self._generation),
                name=f"verify-{self.path.name}",
                daemon=True,
            ).start()
        except IndexFileError as exc:
            if self.path.exists():
                self._log.warning("Rebuilding the search index: {}", exc)
                if "damaged" in str(exc):
                    # Kept for a look (one copy); the index itself is rebuilt from the files.
                    os.replace(self.path, self.path.with_name(self.path.name + ".damaged"))
            index, cover, start = SearchIndex(), _Coverage(), 0
        todo = sum(os.path.getsize(p) for p in files[len(cover.archives) :] if p.exists()) - start
        if wait or todo <= self.sync_bytes:
            self._install(*self._build(index, cover, start))
            if todo > self.sync_bytes:
                self.save()  # a large build is saved at once, not by a later append
            return
        generation = self._generation
        self._builder = threading.Thread(
            target=self._background,
            args=(index, cover, start, generation),
            name=f"index-{self.path.name}",
            daemon=True,
        )
        self._builder.start()

    def _check(self, meta: dict[str, Any], files: list[Path]) -> tuple[_Coverage, int]:
        """The coverage a saved index claims, if the files still match it."""
        archives = meta.get("archives")
        covered, crc = meta.get("covered"), meta.get("crc")
        if not isinstance(archives, list) or not isinstance(covered, int):
            raise IndexFileError("no watermark")
        if len(archives) > len(files) - 1:
            raise IndexFileError("archives are gone")
        for recorded, path in zip(archives, files, strict=False):
            if recorded != _stat(path):
                raise IndexFileError(f"{path.name} changed")
        head = _read_from(files[len(archives) :], 0)[:covered]
        if len(head) != covered or zlib.crc32(head) != crc:
            raise IndexFileError(f"{files[-1].name} changed since the index was saved")
        carry = meta.get("carry")
        stamp = float(carry) if isinstance(carry, int | float) else None
        return _Coverage(archives, covered, int(crc or 0), stamp), covered

    def _build(
        self, index: SearchIndex, cover: _Coverage, start: int
    ) -> tuple[SearchIndex, _Coverage, int]:
        """Index the stream from offset `start` (after the covered archives) to its end."""
        # Listed now: a rotation since the last look made a new archive of the front
        # of the current file, which keeps the stream's bytes (and offsets) the same.
        rest = self._sources()[len(cover.archives) :]
        data = _read_from(rest, start)
        docs, carry = self._parse(data.decode("utf-8", errors="replace"), cover.carry)
        index.add_many(docs)
        crc = zlib.crc32(data, cover.rest_crc)
        return index, _Coverage(cover.archives, start + len(data), crc, carry), len(docs)

    def _background(
        self, index: SearchIndex, cover: _Coverage, start: int, generation: int
    ) -> None:
        try:
            index, cover, _ = self._build(index, cover, start)
            index.merge()
        except Exception as exc:  # a failed build leaves the bounded scan in place
            self._log.error("Building the search index failed: {}", exc)
            with self._lock:
                if generation == self._generation:
                    self._builder = None
            return
        with self._lock:
            if generation != self._generation:
                return  # the files were rewritten meanwhile; a new build follows
            # Lines appended while we built: read them from the files, now under lock.
            self._install(*self._build(index, cover, cover.rest_bytes))
            self._builder = None
            self.save()

    def _verify(self, index: SearchIndex, generation: int) -> None:
        """Check a loaded index's checksum off the search path; drop it if damaged."""
        if index.verify():
            return
        with self._lock:
            if generation != self._generation:
                return
            self._log.warning("Search index {} is damaged (checksum); rebuilding it", self.path)
            with contextlib.suppress(OSError):
                os.replace(self.path, self.path.with_name(self.path.name + ".damaged"))
            self.invalidate()

    def _install(self, index: SearchIndex, cover: _Coverage, added: int) -> None:
        self._index = index
        self._cover = cover
        self._fallback = None
        self._pending = []
        self._unsaved = added or (0 if self.path.exists() else 1)
        self._log.debug("Search index ready: {} documents", len(index))

    def _scan_index(self) -> SearchIndex:
        data = _read_tail(self._sources(), self.fallback_bytes)
        docs, _ = self._parse(data.decode("utf-8", errors="replace"), None)
        index = SearchIndex()
        index.add_many(docs)
        return index
