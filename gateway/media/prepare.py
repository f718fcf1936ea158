"""What a message's attachments become before the model sees them: images as image
parts (for a model with vision), voice notes as their transcript, documents as text.

The promise: a file that cannot be fetched or read costs the person nothing they said.
Every attachment gets a record (its platform reference and what became of it) for the
session entry, a problem becomes one readable line, and the caller persists the user's
entry whatever happened here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio
from loguru import logger

from gateway.media.document_process import DocumentReaders
from gateway.media.documents import DocumentLimits, DocumentText
from gateway.media.errors import MediaError
from gateway.media.images import PreparedImage, prepare_image
from gateway.media.transcribe import Transcriber
from gateway.messages import Attachment

#: The session entry's meta key that lists a message's attachments.
META_ATTACHMENTS = "attachments"


@runtime_checkable
class FileSource(Protocol):
    """A channel that can fetch the files people send it (Telegram, Slack)."""

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """The file's bytes. Raises MediaError (a readable line) when it cannot be had,
        or when it is larger than `max_bytes`."""
        ...


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """The `[media]` settings the agent uses."""

    enabled: bool = True
    max_download_bytes: int = 20 * 1024 * 1024
    image_max_side: int = 2048
    image_max_bytes: int = 2 * 1024 * 1024
    image_max_pixels: int = 50_000_000
    documents: DocumentLimits = field(default_factory=DocumentLimits)
    document_readers: int = 2
    vision_models: tuple[str, ...] = ("*",)

    def has_vision(self, model: str) -> bool:
        """Does `model` take image parts? (`vision_models` holds glob patterns.)"""
        name = model.lower()
        return any(fnmatch.fnmatchcase(name, p.lower()) for p in self.vision_models)


@dataclass(frozen=True, slots=True)
class PreparedInput:
    """A message with its attachments read: `text` is the user's message as stored and
    sent, `images` go to the model with it (this turn only, never stored), `records`
    go into the entry's meta, `problems` are one line per attachment that failed."""

    text: str
    images: tuple[PreparedImage, ...] = ()
    records: tuple[dict[str, Any], ...] = ()
    problems: tuple[str, ...] = ()
    usable: bool = True


@dataclass
class _Gathered:
    parts: list[str] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    usable: int = 0


def label(attachment: Attachment) -> str:
    """How an attachment is named to the person and the model."""
    default = {"image": "the image", "voice": "the voice message", "document": "the file"}
    return attachment.name or default.get(attachment.kind, "the attachment")


def _megabytes(size: int) -> str:
    return f"{size / (1024 * 1024):.1f} MB"


def _of_pages(document: DocumentText) -> str:
    return f" of {document.pages:,}" if document.pages else ""


def _cut_note(document: DocumentText, limits: DocumentLimits) -> str:
    """What the model is told of the text it does not get (empty when it gets it all)."""
    if not document.truncated:
        return ""
    kept = len(document.text)
    if document.stopped is None:
        return f"\n[... cut: {(document.total_chars or kept) - kept:,} more characters]"
    page = ""
    if document.pages_read is not None:
        page = f", on page {document.pages_read:,}{_of_pages(document)}"
    if document.stopped == "pages":
        return (
            f"\n[... cut: only the first {document.pages_read or 0:,} pages"
            f"{_of_pages(document)} were read]"
        )
    if document.stopped == "time":
        return f"\n[... cut: reading stopped after {limits.max_seconds:g} s{page}]"
    return f"\n[... cut at {kept:,} characters{page}; the rest was not read]"


def _no_text(document: DocumentText, limits: DocumentLimits) -> str:
    """Why a document gave no text, in the line the person gets."""
    if document.stopped == "pages":
        return (
            f"I found no text in its first {document.pages_read or 0:,} pages, and read no further"
        )
    if document.stopped == "time":
        return f"I found no text in it in the {limits.max_seconds:g} s reading may take"
    return "it holds no text I can read (a scan needs OCR, which I lack)"


class MediaPreparer:
    """Reads a message's attachments (see the module docstring)."""

    def __init__(self, config: MediaConfig, transcriber: Transcriber | None = None) -> None:
        self.config = config
        self.transcriber = transcriber
        self.documents = DocumentReaders(config.documents, config.document_readers)

    async def prepare(
        self,
        text: str,
        attachments: Sequence[Attachment],
        source: FileSource | None,
        *,
        model: str,
    ) -> PreparedInput:
        """`text` (the caption, possibly empty) with every attachment read in."""
        got = _Gathered()
        if text:
            got.parts.append(text)
            got.usable += 1
        vision = self.config.has_vision(model)
        for attachment in attachments:
            record: dict[str, Any] = {
                k: v for k, v in attachment.to_dict().items() if v not in (None, "") and k != "url"
            }
            try:
                await self._read_one(attachment, source, vision, got, record)
            except MediaError as exc:
                record["status"] = "failed"
                record["error"] = str(exc)
                problem = f"I could not use {label(attachment)}: {exc}."
                got.problems.append(problem)
                got.parts.append(f"[{problem}]")
                logger.warning(
                    "attachment {} ({}) not used: {}", label(attachment), attachment.kind, exc
                )
            got.records.append(record)
        return PreparedInput(
            text="\n\n".join(got.parts),
            images=tuple(got.images),
            records=tuple(got.records),
            problems=tuple(got.problems),
            usable=got.usable > 0,
        )

    async def _read_one(
        self,
        attachment: Attachment,
        source: FileSource | None,
        vision: bool,
        got: _Gathered,
        record: dict[str, Any],
    ) -> None:
        name = label(attachment)
        config = self.config
        if not config.enabled:
            raise MediaError("reading attachments is turned off here")
        if attachment.kind not in ("image", "voice", "document"):
            raise MediaError(f"I can't open {attachment.mime_type or attachment.kind} files")
        if attachment.kind == "image" and not vision:
            # Not fetched: nothing would look at it. The model says what it can't see.
            record["status"] = "skipped"
            got.parts.append(f"[The user sent an image ({name}); this model cannot see images.]")
            got.usable += 1
            return
        if attachment.kind == "voice" and self.transcriber is None:
            raise MediaError("voice messages need a transcription service, and none is set up")
        if attachment.size is not None and attachment.size > config.max_download_bytes:
            raise MediaError(
                f"it is {_megabytes(attachment.size)}; the limit is "
                f"{_megabytes(config.max_download_bytes)}"
            )
        if source is None:
            raise MediaError("files can't be fetched from this channel")
        try:
            data = await source.fetch_file(attachment, max_bytes=config.max_download_bytes)
        except MediaError:
            raise
        except Exception:  # a channel bug or a channel that is not running: one line too
            logger.exception("fetching attachment {} failed", name)
            raise MediaError("the file could not be fetched") from None
        record["bytes"] = len(data)
        if attachment.kind == "image":
            image = await anyio.to_thread.run_sync(self._image, data)
            record.update(status="ok", width=image.width, height=image.height)
            record["sent_as"] = image.mime_type
            got.images.append(image)
            got.parts.append(f"[image: {name}, {image.width}x{image.height}]")
        elif attachment.kind == "voice":
            assert self.transcriber is not None
            transcript = await self.transcriber.transcribe(
                data, name=attachment.name or "voice.ogg", mime_type=attachment.mime_type
            )
            if transcript.audio_seconds is not None:
                record["audio_seconds"] = transcript.audio_seconds
            spoken = transcript.text
            if not spoken:
                raise MediaError("no speech was recognized in it")
            record.update(status="ok", transcribed_chars=len(spoken))
            got.parts.append(spoken)
        else:
            document = await self.documents.read(
                data, name=attachment.name, mime_type=attachment.mime_type
            )
            record.update(status="ok", kept_chars=len(document.text))
            if document.total_chars is not None:
                record["chars"] = document.total_chars
            if document.pages is not None:
                record["pages"] = document.pages
            if document.stopped is not None:
                record.update(stopped=document.stopped, pages_read=document.pages_read)
            if not document.text:
                raise MediaError(_no_text(document, self.config.documents))
            cut = _cut_note(document, self.config.documents)
            got.parts.append(f"[document: {name}]\n{document.text}{cut}\n[end of {name}]")
        got.usable += 1

    def _image(self, data: bytes) -> PreparedImage:
        c = self.config
        return prepare_image(
            data,
            max_side=c.image_max_side,
            max_bytes=c.image_max_bytes,
            max_pixels=c.image_max_pixels,
        )

    async def aclose(self) -> None:
        if self.transcriber is not None:
            await self.transcriber.aclose()
