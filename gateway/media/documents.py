"""Documents as text for the model: PDF (pypdf), DOCX (python-docx) and plain text,
cut to a character budget."""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import PurePosixPath

from gateway.media.errors import MediaError

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


@dataclass(frozen=True, slots=True)
class DocumentText:
    """A document's text within the budget; `total_chars` is the whole text's length."""

    text: str
    kind: str
    total_chars: int
    pages: int | None = None

    @property
    def truncated(self) -> bool:
        return self.total_chars > len(self.text)


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


def document_text(data: bytes, *, name: str, mime_type: str, max_chars: int) -> DocumentText:
    """The text of a PDF, DOCX or text file, cut to `max_chars`. Raises MediaError for
    another type, and for a file its converter cannot read (damaged, encrypted)."""
    kind = document_kind(name, mime_type)
    pages: int | None = None
    if kind == "pdf":
        text, pages = _pdf_text(data)
    elif kind == "docx":
        text = _docx_text(data)
    elif kind == "text":
        text = data.decode("utf-8", errors="replace")
    else:
        raise MediaError(
            f"I can't read {mime_type or 'this kind of'} files (PDF, DOCX and text work)"
        )
    text = text.replace("\x00", "").strip()
    return DocumentText(text[:max_chars], kind, len(text), pages)


def _pdf_text(data: bytes) -> tuple[str, int]:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            raise MediaError("the PDF is password-protected")
        texts = [page.extract_text() or "" for page in reader.pages]
    except MediaError:
        raise
    except (PdfReadError, PyPdfError, OSError, ValueError, KeyError, TypeError) as exc:
        raise MediaError(f"the PDF is damaged and cannot be read ({type(exc).__name__})") from None
    return "\n\n".join(t.strip() for t in texts if t.strip()), len(texts)


def _docx_text(data: bytes) -> str:
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = docx.Document(io.BytesIO(data))
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        raise MediaError(
            f"the DOCX file is damaged and cannot be read ({type(exc).__name__})"
        ) from None
    lines = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            lines.append(" | ".join(cell.text for cell in row.cells))
    return "\n".join(lines)
