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
  a background thread; `current` waits for it (with `lock` released, so appends and
  other scopes go on), or, when its caller bounded the wait, returns None once the
  bound has passed. Only then may the caller answer from `partial` (an index of the
  stream's last `partial_bytes`), and it must say that answer is incomplete.
- The first append opens the index (loading the saved one and catching up, or starting
  its build), so appends keep it current and saved whether or not anyone searches:
  the next start loads it instead of building from scratch.
- Appends are neither parsed nor tokenized when they are written: their bytes wait in a
  pending list and are indexed in one batch by the next search or save (or past
  `_PENDING_MAX` lines), so an append costs the index a checksum update.
- A damaged index file is reported and kept as `<name>.damaged` (the last one), never
  trusted; a stale one is simply replaced by the rebuilt index.
- An index is saved only when the files still hold exactly the bytes it covers (checked
  by CRC at save time); otherwise it is dropped and rebuilt.

Callers hold `lock` (shared with the owner) around every method; the background thread
takes it only to swap the finished index in and to save it.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.memory.index import IndexFileError, SearchIndex, release_freed_memory

Doc = tuple[str, str | None, float | None]
# Parse stream text into documents; the float is the timestamp carried from the line
# before (history lines without one date from it), returned updated.
Parser = Callable[[str, float | None], tuple[list[Doc], float | None]]

# Told how far it got: (bytes done, bytes to do).
Progress = Callable[[int, int], None]

_PENDING_MAX = 4096
# A build indexes this much of the stream between progress reports.
_BUILD_CHUNK = 1 << 20
# How often a waiter tells its `progress` how the build goes, in seconds.
_PROGRESS_EVERY = 0.2


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
        partial_bytes: int = 64 * 1024,
    ) -> None:
        self.path = path
        self._sources = sources
        self._parse = parse
        self._lock = lock
        # Notified (under `lock`) whenever a build ends, well or not, or is dropped.
        self._built = threading.Condition(lock)
        self.sync_bytes = sync_bytes
        self.partial_bytes = partial_bytes
        self._index: SearchIndex | None = None
        self._cover = _Coverage()
        # Appended bytes not indexed yet, and their lines (`appended`).
        self._pending: list[bytes] = []
        self._pending_lines = 0
        self._unsaved = 0
        self._partial: SearchIndex | None = None
        self._builder: threading.Thread | None = None
        self._build_failed = False
        self._progress = (0, 0)  # of the running build: (bytes done, bytes to do)
        self._generation = 0
        self._log = logger.bind(index=path.name)

    @property
    def ready(self) -> bool:
        return self._index is not None

    def current(
        self, *, wait: float | None = None, progress: Progress | None = None
    ) -> SearchIndex | None:
        """The full index with every append in it, opened or built as needed; None if
        it is still being built after `wait` seconds (None: wait as long as it takes).

        Waiting releases `lock`, however often the caller holds it, and takes it back
        before returning. While it waits, `progress` is told how the build goes."""
        deadline = None if wait is None else time.monotonic() + max(0.0, wait)
        told = -math.inf
        while self._index is None:
            if self._builder is None:
                if not self._build_failed:
                    self._open()
                elif deadline is None:
                    # The background build failed: build here, so that an error that
                    # happens again reaches the caller.
                    self._build_failed = False
                    self._open(inline=True)
                else:
                    self._build_failed = False  # retried by the next search
                    return None
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if progress is not None and now - told >= _PROGRESS_EVERY:
                progress(*self._progress)
                told = now
            pause = _PROGRESS_EVERY if deadline is None else min(_PROGRESS_EVERY, deadline - now)
            self._built.wait(pause)
        self._index_pending()
        return self._index

    def partial(self) -> SearchIndex:
        """What a search that could not wait answers from: the full index if it is ready,
        else an index of the stream's newest `partial_bytes` (kept current by appends
        until the full index is ready). Its caller must say the answer is incomplete."""
        if self._index is not None:
            return self._index
        if self._partial is None:
            self._partial = self._scan_index()
        return self._partial

    def appended(self, data: bytes) -> None:
        """We appended `data` (whole lines) to the current file. Its documents are
        parsed and indexed with the next batch (`_index_pending`), not here."""
        if self._index is None and self._builder is None:
            # Opened now, from the files (this append included), so that the index stays
            # current whether or not anyone searches. An append never fails for it.
            try:
                self._open()
            except Exception as exc:
                self._log.warning("Search index not opened (the next search tries): {}", exc)
            return
        if self._index is not None:
            self._cover.rest_bytes += len(data)
            self._cover.rest_crc = zlib.crc32(data, self._cover.rest_crc)
            self._pending.append(data)
            lines = data.count(b"\n")
            self._pending_lines += lines
            self._unsaved += lines
            if self._pending_lines >= _PENDING_MAX:
                self._index_pending()
            # Saved again once a quarter more is unsaved (O(1) amortized per line); a
            # crash loses only that much, caught up from the files at the next open.
            if self._unsaved >= max(4096, len(self._index) // 4):
                self.save()
        elif self._partial is not None:
            docs, _ = self._parse(data.decode("utf-8", errors="replace"), None)
            self._partial.add_many(docs)

    def invalidate(self) -> None:
        """The files were rewritten: forget the index (rebuilt on next use)."""
        self._index = None
        self._pending = []
        self._pending_lines = 0
        self._partial = None
        self._builder = None
        self._build_failed = False
        self._generation += 1
        self._built.notify_all()

    def save(self) -> None:
        """Write the index if it changed and the files still hold what it covers."""
        index = self._index
        if index is None or (not self._unsaved and not self._pending and self.path.exists()):
            return
        self._index_pending()
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

    def _open(self, *, inline: bool = False) -> None:
        """Load the saved index and catch up, or (re)build it: here when the work is at
        most `sync_bytes` (or `inline`), else in a background thread."""
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
        if inline or todo <= self.sync_bytes:
            self._install(*self._build(index, cover, start))
            if todo > self.sync_bytes:
                self.save()  # a large build is saved at once, not by a later append
                release_freed_memory()
            return
        generation = self._generation
        self._progress = (0, max(todo, 1))
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
        self, index: SearchIndex, cover: _Coverage, start: int, *, report: bool = False
    ) -> tuple[SearchIndex, _Coverage, int]:
        """Index the stream from offset `start` (after the covered archives) to its end;
        with `report`, the running build's progress is updated as it goes."""
        # Listed now: a rotation since the last look made a new archive of the front
        # of the current file, which keeps the stream's bytes (and offsets) the same.
        rest = self._sources()[len(cover.archives) :]
        data = _read_from(rest, start)
        carry = cover.carry

        def docs() -> Iterator[Doc]:
            nonlocal carry
            done = 0
            while done < len(data):
                # Cut at a newline: it never falls inside a UTF-8 character.
                cut = data.find(b"\n", done + _BUILD_CHUNK)
                end = len(data) if cut < 0 else cut + 1
                found, carry = self._parse(data[done:end].decode("utf-8", errors="replace"), carry)
                yield from found
                done = end
                if report:
                    self._progress = (done, max(len(data), 1))

        # One batch: the index folds it into its segment in one merge, however large.
        added = len(index.add_many(docs()))
        crc = zlib.crc32(data, cover.rest_crc)
        return index, _Coverage(cover.archives, start + len(data), crc, carry), added

    def _background(
        self, index: SearchIndex, cover: _Coverage, start: int, generation: int
    ) -> None:
        try:
            index, cover, _ = self._build(index, cover, start, report=True)
            index.merge()
        except Exception as exc:  # searches meanwhile wait, or answer as incomplete
            self._log.error("Building the search index failed: {}", exc)
            with self._lock:
                if generation == self._generation:
                    self._builder = None
                    self._build_failed = True
                    self._built.notify_all()
            return
        with self._lock:
            if generation != self._generation:
                return  # the files were rewritten meanwhile; a new build follows
            try:
                # Lines appended while we built: read them from the files, now under lock.
                self._install(*self._build(index, cover, cover.rest_bytes))
                self.save()
            except Exception as exc:
                self._log.error("Building the search index failed: {}", exc)
                self._build_failed = self._index is None
            finally:
                self._builder = None
                self._built.notify_all()
        release_freed_memory()  # the build's temporary arrays and lists are gone now

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
        self._partial = None
        self._pending = []
        self._pending_lines = 0
        self._unsaved = added or (0 if self.path.exists() else 1)
        self._log.debug("Search index ready: {} documents", len(index))

    def _index_pending(self) -> None:
        """Parse and index the appended bytes waiting in the pending list, in one batch."""
        if self._pending and self._index is not None:
            text = b"".join(self._pending).decode("utf-8", errors="replace")
            docs, self._cover.carry = self._parse(text, self._cover.carry)
            self._index.add_many(docs)
        self._pending = []
        self._pending_lines = 0

    def _scan_index(self) -> SearchIndex:
        data = _read_tail(self._sources(), self.partial_bytes)
        docs, _ = self._parse(data.decode("utf-8", errors="replace"), None)
        index = SearchIndex()
        index.add_many(docs)
        return index
