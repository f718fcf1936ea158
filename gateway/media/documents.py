"""Documents as text for the model: PDF (pypdf), DOCX (its XML, streamed) and plain
text, read within a character, size, page and time budget.

The promise: reading a document costs what its budget allows, whatever the file says
about itself, and stops as soon as the character budget is full.
- A DOCX is a zip. Each member read (the relationships and the main document part,
  nothing else) is refused on its declared size and compression ratio before it is
  inflated, then inflated 64 KB at a time through zipfile's bounded decompressor
  (deflate asked for at most that much per call) with the actual bytes counted against
  the same limits: a central directory that lies about sizes is caught by the count.
  Members packed any other way than stored or deflate are refused (zipfile inflates a
  whole read of bzip2 or lzma at once). Embedded files (a workbook in the document, a
  zip in the zip) are never opened. The XML is parsed as it streams in (lxml's pull
  parser), not built into a tree; python-docx cannot do that: it loads every part and
  the whole tree before the first paragraph can be read.
- A PDF is read page by page, each page built when it is reached (pypdf's
  `reader.pages` builds all of them at the first access: 1.7 s and 90 MB for 20,000
  pages), with pypdf's own decoding limits set to the same unpacked size, and reading
  stops at the character, page or time budget.

These budgets are checked between steps, and one step can be a call into C (zlib,
libxml2) that nothing in the process interrupts: gateway.media.document_process runs
this reader in a child process that the kernel holds to a memory limit and that is
killed at a deadline.
"""

from __future__ import annotations

import io
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from gateway.media.errors import MediaError

if TYPE_CHECKING:
    from lxml import etree
    from pypdf import PageObject, PdfReader

MB = 1024 * 1024

_TEXT_SUFFIXES = frozenset(
    [
        ".txt",
        ".md",
        ".markdown",
        ".csv",
        ".tsv",
        ".json",
        ".yaml",
        ".yml",
        ".toml",
        ".ini",
        ".log",
        ".xml",
        ".html",
        ".htm",
        ".py",
        ".js",
        ".ts",
        ".java",
        ".c",
        ".h",
        ".cpp",
        ".go",
        ".rs",
        ".rb",
        ".sh",
        ".sql",
    ]
)
_DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"

#: Why reading stopped before the end: the character, page or time budget was spent.
Stopped = Literal["chars", "pages", "time"]


@dataclass(frozen=True, slots=True)
class DocumentLimits:
    """What reading one document may cost (the `[media]` document_* settings).
    `max_memory_bytes` is kept by the child process that runs the reader."""

    max_chars: int = 20_000
    max_unpacked_bytes: int = 50 * MB
    max_ratio: float = 500.0
    max_pages: int = 500
    max_seconds: float = 10.0
    max_memory_bytes: int = 512 * MB


@dataclass(frozen=True, slots=True)
class DocumentText:
    """A document's text within the budget. `total_chars` is the whole text's length,
    None when reading stopped early (`stopped` says at which budget) and the rest is
    unknown; `pages` is a PDF's page count and `pages_read` how many were read."""

    text: str
    kind: str
    total_chars: int | None
    pages: int | None = None
    pages_read: int | None = None
    stopped: Stopped | None = None

    @property
    def truncated(self) -> bool:
        return self.stopped is not None or (self.total_chars or 0) > len(self.text)


def document_kind(name: str, mime_type: str) -> str | None:
    """ "pdf", "docx" or "text" for a file the converter reads, None for any other."""
    suffix = PurePosixPath(name.lower()).suffix
    if mime_type == "application/pdf" or suffix == ".pdf":
        return "pdf"
    if mime_type == _DOCX or suffix == ".docx":
        return "docx"
    if (
        mime_type.startswith("text/")
        or suffix in _TEXT_SUFFIXES
        or mime_type
        in (
            "application/json",
            "application/xml",
            "application/x-yaml",
        )
    ):
        return "text"
    return None


def unsupported(mime_type: str) -> MediaError:
    return MediaError(f"I can't read {mime_type or 'this kind of'} files (PDF, DOCX and text work)")


def document_text(
    data: bytes,
    *,
    name: str,
    mime_type: str,
    limits: DocumentLimits,
    started: float | None = None,
) -> DocumentText:
    """The text of a PDF, DOCX or text file within `limits` (the time budget counts from
    `started`, a time.monotonic() value, by default now). Raises MediaError, whose text
    is the reason in one line, for another type, for a file its converter cannot read
    (damaged, encrypted) and for a file over a limit (a zip or stream bomb)."""
    kind = document_kind(name, mime_type)
    deadline = (time.monotonic() if started is None else started) + limits.max_seconds
    if kind == "text":
        text = data.decode("utf-8", errors="replace").replace("\x00", "").strip()
        return DocumentText(text[: limits.max_chars], kind, len(text))
    if kind == "pdf":
        budget = _Budget(limits.max_chars, "\n\n")
        pages, read, stopped = _pdf_text(data, limits, budget, deadline)
    elif kind == "docx":
        budget = _Budget(limits.max_chars, "\n")
        pages, read, stopped = None, None, _docx_text(data, limits, budget, deadline)
    else:
        raise unsupported(mime_type)
    if budget.full:
        stopped = "chars"
    text = budget.text()
    total = None if stopped else len(text)
    return DocumentText(text[: limits.max_chars], kind, total, pages, read, stopped)


@dataclass
class _Budget:
    """Text gathered until it is one character past `max_chars` (so a cut is known)."""

    max_chars: int
    separator: str
    parts: list[str] = field(default_factory=list)
    size: int = 0

    def add(self, piece: str) -> None:
        piece = piece.replace("\x00", "")
        self.size += len(piece) + (len(self.separator) if self.parts else 0)
        self.parts.append(piece)

    @property
    def full(self) -> bool:
        return self.size > self.max_chars

    def text(self) -> str:
        return self.separator.join(self.parts).strip()


class _OutOfTime(Exception):
    """The time budget ran out between two steps."""


def _megabytes(size: int) -> str:
    return f"{size / MB:.0f} MB"


def _too_big(limits: DocumentLimits) -> MediaError:
    return MediaError(
        f"it expands to more than {_megabytes(limits.max_unpacked_bytes)} when unpacked, "
        "so I did not read it"
    )


# --------------------------------------------------------------------------- PDF

# The page attributes a page takes from its ancestors when it has none of its own.
_INHERITED = ("/Resources", "/MediaBox", "/CropBox", "/Rotate")
_MAX_TREE_DEPTH = 64


def _pdf_text(
    data: bytes, limits: DocumentLimits, budget: _Budget, deadline: float
) -> tuple[int | None, int, Stopped | None]:
    """(the page count, pages read, why reading stopped early) with the text in `budget`."""
    from pypdf import PdfReader, apply_configuration
    from pypdf.errors import LimitReachedError, PdfReadError, PyPdfError
    from pypdf.generic import DictionaryObject

    unpacked = limits.max_unpacked_bytes
    # pypdf's defaults are 75 MB per stream; the document's own limit is the one we mean.
    bounds = {
        "zlib_maximum_output_length": unpacked,
        "lzw_maximum_output_length": unpacked,
        "run_length_maximum_output_length": unpacked,
        "brotli_maximum_output_length": unpacked,
        "jbig2_maximum_output_length": unpacked,
        "array_based_stream_maximum_output_length": unpacked,
    }
    read, pages = 0, None
    try:
        with apply_configuration(None, **bounds):
            reader = PdfReader(io.BytesIO(data), strict=False)
            if reader.is_encrypted:
                raise MediaError("the PDF is password-protected")
            tree = reader.root_object.get("/Pages")
            tree = tree.get_object() if tree is not None else None
            if not isinstance(tree, DictionaryObject):
                raise PdfReadError("no page tree")
            count = tree.get("/Count")
            pages = int(count) if isinstance(count, int) and 0 <= count < 10**7 else None
            for page in _pages(reader, tree, deadline):
                if read >= limits.max_pages:
                    return pages, read, "pages"
                if time.monotonic() >= deadline:
                    return pages, read, "time"
                text = (page.extract_text() or "").strip()
                read += 1
                if text:
                    budget.add(text)
                if budget.full:
                    return pages, read, "chars"
    except _OutOfTime:
        return pages, read, "time"
    except MediaError:
        raise
    except LimitReachedError as exc:
        if any(word in str(exc) for word in ("decompressing", "decoding work")):
            raise _too_big(limits) from None
        raise MediaError(
            "it is built past what I read safely (too many pages, objects or levels), "
            "so I did not read it"
        ) from None
    except (
        PdfReadError,
        PyPdfError,
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        RecursionError,
        zlib.error,
    ) as exc:
        raise MediaError(f"the PDF is damaged and cannot be read ({type(exc).__name__})") from None
    return read, read, None


def _pages(reader: PdfReader, tree: Any, deadline: float) -> Iterator[PageObject]:
    """The pages in order, each built when it is reached, with the attributes it
    inherits. A /Pages node met twice (a loop, or a node shared to multiply the
    pages) is damage, as is a tree deeper than any real one."""
    from pypdf import PageObject
    from pypdf.errors import PdfReadError
    from pypdf.generic import ArrayObject, DictionaryObject, IndirectObject, NameObject

    seen: set[int] = set()
    stack: list[tuple[Iterator[Any], dict[str, Any]]] = [(iter([tree]), {})]
    while stack:
        kids, inherited = stack[-1]
        kid = next(kids, None)
        if kid is None:
            stack.pop()
            continue
        if time.monotonic() >= deadline:
            raise _OutOfTime
        node = kid.get_object()
        if not isinstance(node, DictionaryObject) or not node:
            continue  # a damaged file's stray entry: pypdf skips it too
        if node.get("/Type") == "/Pages" or ("/Type" not in node and "/Kids" in node):
            if id(node) in seen or len(stack) > _MAX_TREE_DEPTH:
                raise PdfReadError("the page tree loops or is too deep")
            seen.add(id(node))
            passed = inherited | {key: node[key] for key in _INHERITED if key in node}
            children = node.get("/Kids")
            children = children.get_object() if children is not None else None
            if isinstance(children, ArrayObject):
                stack.append((iter(children), passed))
            continue
        page = PageObject(reader, kid if isinstance(kid, IndirectObject) else None)
        page.update(node)
        for key, value in inherited.items():
            if key not in page:
                page[NameObject(key)] = value
        yield page


# --------------------------------------------------------------------------- DOCX

_CHUNK = 64 * 1024
# A member may inflate this much before its ratio counts: small XML parts of real
# documents are often very repetitive, and a bomb has to be large to matter.
_RATIO_GRACE = 1 * MB
_RELS_MAX = 1 * MB
_OFFICE_DOCUMENT = "/officeDocument"
_MAIN_PART = "word/document.xml"
_NAMESPACES = (
    "http://schemas.openxmlformats.org/wordprocessingml/2006/main",
    "http://purl.oclc.org/ooxml/wordprocessingml/main",  # ISO "strict" documents
)
_MC = "http://schemas.openxmlformats.org/markup-compatibility/2006"
# Run children that stand for a character, as python-docx reads them.
_RUN_CHARS = {"tab": "\t", "ptab": "\t", "br": "\n", "cr": "\n", "noBreakHyphen": "-"}


@dataclass
class _Unpacked:
    """Bytes inflated so far from one archive, against the document's limits."""

    limits: DocumentLimits
    total: int = 0

    def check_declared(self, info: zipfile.ZipInfo, limit: int) -> None:
        """Refuse `info` on what the archive says of it, before a byte is inflated."""
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise MediaError(
                "it is packed with a compression documents do not use, so I did not read it"
            )
        if info.flag_bits & 0x1:
            raise MediaError("the DOCX file is password-protected")
        self._check_size(info.file_size, info, limit)

    def count(self, inflated: int, info: zipfile.ZipInfo, limit: int) -> None:
        """Refuse `info` once `inflated` bytes of it have come out (whatever it declared)."""
        self._check_size(inflated, info, limit)

    def _check_size(self, inflated: int, info: zipfile.ZipInfo, limit: int) -> None:
        if self.total + inflated > self.limits.max_unpacked_bytes:
            raise _too_big(self.limits)
        if inflated > limit:
            raise MediaError(f"the DOCX file is damaged: its {info.filename} is far too large")
        self._check_ratio(inflated, info)

    def _check_ratio(self, inflated: int, info: zipfile.ZipInfo) -> None:
        ratio = inflated / max(info.compress_size, 1)
        if inflated > _RATIO_GRACE and ratio > self.limits.max_ratio:
            raise MediaError(
                f"it unpacks to over {self.limits.max_ratio:.0f} times its packed size, "
                "as zip bombs do, so I did not read it"
            )


def _inflate(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, unpacked: _Unpacked, limit: int | None = None
) -> Iterator[bytes]:
    """The member's bytes in chunks of at most 64 KB, each counted before it is used;
    `limit` is what this member may hold (by default, what the archive has left)."""
    limit = unpacked.limits.max_unpacked_bytes if limit is None else limit
    unpacked.check_declared(info, limit)
    inflated = 0
    with archive.open(info) as member:
        while chunk := member.read(_CHUNK):
            inflated += len(chunk)
            unpacked.count(inflated, info, limit)
            yield chunk
    unpacked.total += inflated


def _docx_text(
    data: bytes, limits: DocumentLimits, budget: _Budget, deadline: float
) -> Stopped | None:
    """The main document part's text into `budget`; why reading stopped early, if it did."""
    from lxml import etree

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            unpacked = _Unpacked(limits)
            part = _main_part(archive, unpacked)
            try:
                info = archive.getinfo(part)
            except KeyError:
                raise MediaError("the DOCX file is damaged: it has no document in it") from None
            words = _WordText(budget)
            for chunk in _inflate(archive, info, unpacked):
                words.feed(chunk)
                if budget.full:
                    return "chars"
                if time.monotonic() >= deadline:
                    return "time"
            words.close()
    except MediaError:
        raise
    except RuntimeError as exc:  # zipfile: "File ... is encrypted, password required"
        if "encrypted" in str(exc):
            raise MediaError("the DOCX file is password-protected") from None
        raise
    except (
        zipfile.BadZipFile,
        zlib.error,
        EOFError,
        NotImplementedError,
        etree.LxmlError,
        ValueError,
        OSError,
    ) as exc:
        raise MediaError(
            f"the DOCX file is damaged and cannot be read ({type(exc).__name__})"
        ) from None
    return None


def _main_part(archive: zipfile.ZipFile, unpacked: _Unpacked) -> str:
    """The main document part's name, from the package relationships (`_rels/.rels`),
    as Word and python-docx find it; word/document.xml when they do not say."""
    from lxml import etree

    try:
        info = archive.getinfo("_rels/.rels")
    except KeyError:
        return _MAIN_PART
    data = b"".join(_inflate(archive, info, unpacked, _RELS_MAX))
    root = etree.fromstring(data, _parser())
    for relation in root:
        if str(relation.get("Type", "")).endswith(_OFFICE_DOCUMENT):
            target = str(relation.get("Target", "")).lstrip("/")
            return target or _MAIN_PART
    return _MAIN_PART


def _parser() -> etree.XMLParser:
    from lxml import etree

    return etree.XMLParser(
        resolve_entities=False, no_network=True, load_dtd=False, remove_comments=True
    )


class _WordText:
    """The text of a WordprocessingML document as its XML streams in: each paragraph a
    line, each table row its cells joined with " | " (as python-docx reads a table),
    in document order. Parsed elements are dropped as soon as they are read, so memory
    does not grow with the document. Text a Word shape keeps twice (its
    `mc:Fallback` copy) and deleted text are left out."""

    def __init__(self, budget: _Budget) -> None:
        from lxml import etree

        tags = [
            f"{{{ns}}}{tag}" for ns in _NAMESPACES for tag in ("p", "t", "tc", "tr", *_RUN_CHARS)
        ]
        self._parser = etree.XMLPullParser(
            events=("start", "end"),
            tag=[*tags, f"{{{_MC}}}Fallback"],
            resolve_entities=False,
            no_network=True,
            load_dtd=False,
            remove_comments=True,
            remove_pis=True,
        )
        self._budget = budget
        self._paragraphs: list[list[str]] = []  # the open paragraphs' pieces (text boxes nest)
        self._rows: list[list[str]] = []  # the open table rows' cells
        self._cells: list[list[str]] = []  # the open cells' paragraphs
        self._fallback = 0

    def feed(self, chunk: bytes) -> None:
        self._parser.feed(chunk)
        self._read_events()

    def close(self) -> None:
        self._parser.close()
        self._read_events()

    def _read_events(self) -> None:
        for event, element in self._parser.read_events():
            tag = element.tag
            local = tag[tag.rindex("}") + 1 :] if isinstance(tag, str) else ""
            if local == "Fallback":
                self._fallback += 1 if event == "start" else -1
            elif event == "start":
                if local == "p":
                    self._paragraphs.append([])
                elif local == "tr":
                    self._rows.append([])
                elif local == "tc":
                    self._cells.append([])
            else:
                self._end(local, element)

    def _end(self, local: str, element: Any) -> None:
        if local == "t" or local in _RUN_CHARS:
            parent = element.getparent()
            in_run = parent is not None and str(parent.tag).endswith("}r")
            if self._paragraphs and not self._fallback and (local == "t" or in_run):
                piece = (element.text or "") if local == "t" else _RUN_CHARS[local]
                self._paragraphs[-1].append(piece)
            return
        if local == "p" and self._paragraphs:
            # A paragraph in a text box (inside another paragraph) is a line of its own.
            line = "".join(self._paragraphs.pop())
            if self._fallback:
                pass
            elif self._cells:
                self._cells[-1].append(line)
            else:
                self._budget.add(line)
        elif local == "tc" and self._cells:
            cell = "\n".join(self._cells.pop())
            if self._rows:
                self._rows[-1].append(cell)
        elif local == "tr" and self._rows:
            row = " | ".join(self._rows.pop())
            if self._fallback:
                pass
            elif self._cells:  # a table in a cell: its rows are lines of that cell
                self._cells[-1].append(row)
            else:
                self._budget.add(row)
        else:
            return
        # Read: drop it and what came before it in its parent, so the tree stays small.
        element.clear()
        parent = element.getparent()
        while parent is not None and element.getprevious() is not None:
            del parent[0]
