"""The sidecar index of a session file: where each entry's line starts, so a cold load
need not parse every line.

Promises kept here:
- The JSONL file stays the one source of truth, and nothing here writes to it. The index
  (``<sessions>/.index/<file name>.idx``) is a cache: it is never fsynced, and a missing,
  stale or damaged one only costs a full parse.
- An index is used only when it matches the file it describes: same device and inode,
  the same header line, the same last 4 KiB before the end it covers, a newline there,
  and (when the file is exactly that long) the same modification time; a file that grew
  since (appended by anyone) reuses the covered part and parses the rest. Anything else
  is stale: the load parses the whole file and writes a new index.
- A damaged index (unreadable, a checksum that does not match, counts that disagree) is
  reported in the log and the load report, and ignored: the session loads from its
  file, never from a half-trusted index.

Why: a 10,000-message session took 97 M instructions to load (11 ms on a quiet run of
this repository's machine, 21 ms on the issue's): splitting the text into lines and
matching each line's id prefix. With the index a load reads the file, the index's ids,
parents and offsets, and builds two dicts; message lines are decoded when first needed.

The format: one JSON line (what the index covers and how to check it, readable with
``head -1``), then the ids joined by newlines, the parent ids the same way (an empty
string for no parent, the ``roots`` of the JSON line), and the byte offsets as 64-bit
integers. An id or parent that holds a newline, or an empty parent id, gets no index.
"""

from __future__ import annotations

import array
import json
import os
import secrets
import sys
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

#: Folder (inside the sessions folder) of the index files.
INDEX_DIR = ".index"
INDEX_SUFFIX = ".idx"
FORMAT = "gateway-session-index"
VERSION = 1
#: Sessions with fewer entries load fast enough from the file alone (1,000 entries
#: parse in about 1 ms); past it, a load without a usable index writes one.
MIN_ENTRIES = 1000
#: How far before the end an index covers its check bytes reach.
TAIL_BYTES = 4096
_PREFIX = b'{"id":"'


class IndexDamaged(Exception):
    """The index file cannot be read or fails its own checks (not: it is stale)."""


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What an index is checked against: the file as it is now."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class SessionIndex:
    """An index read back: the entries of the file's first ``size`` bytes, in file order.

    ``decoded`` are the positions of entries the load decodes at once (all but plain
    message lines); ``next_lineno`` is the line number of the first byte past ``size``.
    """

    size: int
    next_lineno: int
    ids: list[str]
    parents: list[str | None]
    offsets: list[int]
    decoded: list[int]
    bad_lines: list[int]


def index_path(index_dir: Path, session_file: Path) -> Path:
    return index_dir / (session_file.name + INDEX_SUFFIX)


def _tail_crc(data: bytes, size: int) -> int:
    return zlib.crc32(data[max(size - TAIL_BYTES, 0) : size])


def read_index(path: Path, file: FileIdentity, data: bytes, header_end: int) -> SessionIndex | None:
    """The index at ``path`` if it describes ``data`` (the file's bytes, its header line
    ending at ``header_end``); None when there is none or it is stale. Raises
    `IndexDamaged` when the index itself is broken."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IndexDamaged(f"cannot read it: {exc.strerror}") from None
    cut = raw.find(b"\n")
    try:
        meta = json.loads(raw[:cut])
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("not an index")
        if meta.get("version") != VERSION:
            return None  # another version's: stale, rewritten in ours
        size, count = int(meta["size"]), int(meta["entries"])
        lengths = (int(meta["ids_bytes"]), int(meta["parents_bytes"]), count * 8)
        stamp = (meta["dev"], meta["ino"], meta["mtime_ns"], meta["header_crc"], meta["tail_crc"])
        roots, decoded, bad = meta["roots"], meta["decoded"], meta["bad_lines"]
        next_lineno = int(meta["next_lineno"])
        body_crc = meta["body_crc"]
    except (ValueError, KeyError, TypeError) as exc:
        raise IndexDamaged(f"its first line is not an index's ({exc})") from None
    body = raw[cut + 1 :]
    if cut < 0 or len(body) != sum(lengths) or zlib.crc32(body) != body_crc:
        raise IndexDamaged("its length or checksum does not match its contents")
    # Stale, not damaged: the file is another one, or changed where the index looked.
    if (
        (stamp[0], stamp[1]) != (file.dev, file.ino)
        or size > len(data)
        or size <= header_end
        or data[size - 1] != 10
        or (size == file.size and stamp[2] != file.mtime_ns)
        or stamp[3] != zlib.crc32(data[:header_end])
        or stamp[4] != _tail_crc(data, size)
    ):
        return None
    a, b = lengths[0], lengths[0] + lengths[1]
    ids = body[:a].decode("utf-8").split("\n") if count else []
    parents: list[str | None] = []
    if count:
        parents.extend(body[a:b].decode("utf-8").split("\n"))
    offsets = array.array("q")
    offsets.frombytes(body[b:])
    if meta.get("byteorder") != sys.byteorder:
        offsets.byteswap()
    if len(ids) != count or len(parents) != count or len(offsets) != count:
        raise IndexDamaged("its counts of ids, parents and offsets disagree")
    try:
        for i in roots:
            parents[i] = None
        checked = [int(i) for i in decoded if 0 <= i < count]
        if len(checked) != len(decoded) or not all(isinstance(n, int) for n in bad):
            raise ValueError
    except (IndexError, TypeError, ValueError):
        raise IndexDamaged("its roots or decoded positions are out of range") from None
    return SessionIndex(size, next_lineno, ids, parents, offsets.tolist(), checked, bad)


def build_index(
    data: bytes,
    size: int,
    order: list[str],
    bad_lines: Collection[int],
    lazy: Collection[str],
    line_lengths: list[int] | None = None,
) -> tuple[list[int], list[int]] | None:
    """Offsets of the entries of ``data[:size]`` (complete lines, header first) and the
    positions of those a load must decode, given what a full parse found: the entries
    of those lines in file order, the bad line numbers, and which entries are plain
    message lines.
    ``line_lengths``: the bytes of each line, when the parse knows them (no second
    split). None when the lines and the entries do not line up (no index then)."""
    every_line = not bad_lines  # then only blank lines hold no entry
    lines: list[bytes] = []
    if line_lengths is None or not every_line or len(line_lengths) - 1 != len(order):
        lines = data[:size].split(b"\n")
        if lines.pop() != b"":
            return None  # ``size`` must end a line
        line_lengths = list(map(len, lines))
    # Where each line starts (line i has number i + 1; line 0 is the header).
    starts = list(accumulate(map((1).__add__, line_lengths), initial=0))
    if starts[-1] != size:
        return None
    if every_line and len(line_lengths) - 1 == len(order):
        offsets = starts[1 : len(line_lengths)]  # no blank line: each holds an entry
    else:
        if not lines:
            lines = data[:size].split(b"\n")[:-1]
        offsets = [
            starts[i]
            for i, line in enumerate(lines)
            if i and (line.startswith(b"{") or line.strip()) and i + 1 not in bad_lines
        ]
    k = len(offsets)
    if k != len(order):
        return None
    # The lines and the entries line up: checked on 64 lines and the last (a line that
    # says its id up front), as a shift would show on every line after it.
    for j in [*range(0, k, max(k // 64, 1)), k - 1] if k else ():
        at = offsets[j]
        if data.startswith(_PREFIX, at) and not data.startswith(
            b'%s%s"' % (_PREFIX, order[j].encode()), at
        ):
            return None
    others = set(order).difference(lazy)
    decode = [j for j, eid in enumerate(order) if eid in others] if others else []
    return offsets, decode


def write_index(
    path: Path,
    file: FileIdentity,
    data: bytes,
    header_end: int,
    size: int,
    next_lineno: int,
    ids: list[str],
    parents: list[str | None],
    offsets: list[int],
    decoded: list[int],
    bad_lines: list[int],
) -> None:
    """Write the index of ``data[:size]`` (temp file and rename; not fsynced: a cache).
    Raises `OSError`, or `ValueError` for ids the format cannot hold (a newline in one,
    an empty parent id)."""
    id_text = "\n".join(ids)
    parent_text = "\n".join([p or "" for p in parents])
    if (
        id_text.count("\n") != len(ids) - 1
        or parent_text.count("\n") != len(parents) - 1
        or "" in parents
    ):
        raise ValueError("an id holds a newline, or a parent id is empty")
    id_bytes = id_text.encode("utf-8")
    parent_bytes = parent_text.encode("utf-8")
    body = id_bytes + parent_bytes + array.array("q", offsets).tobytes()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "file": path.name.removesuffix(INDEX_SUFFIX),
        "dev": file.dev,
        "ino": file.ino,
        "mtime_ns": file.mtime_ns,
        "size": size,
        "next_lineno": next_lineno,
        "entries": len(ids),
        "header_crc": zlib.crc32(data[:header_end]),
        "tail_crc": _tail_crc(data, size),
        "roots": [i for i, p in enumerate(parents) if p is None],
        "decoded": decoded,
        "bad_lines": bad_lines,
        "byteorder": sys.byteorder,
        "ids_bytes": len(id_bytes),
        "parents_bytes": len(parent_bytes),
        "body_crc": zlib.crc32(body),
    }
    path.parent.mkdir(mode=0o700, exist_ok=True)
    # Two managers of one process may write the same index at once: a name of its own.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        # Private like the session files (0600): it names every entry of the session.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            f.write(json.dumps(meta, separators=(",", ":")).encode() + b"\n" + body)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_index(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
