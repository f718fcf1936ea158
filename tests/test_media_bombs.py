"""Document bombs: each is read by the real reader in its child process, and refused (or
read only as far as the budget goes) within a bound on the child's peak memory and on
time, while the gateway's own memory does not move. The bombs are made here, small on
disk: tests/media_files.py writes their zips and PDFs by hand.

The bounds are generous (the machine may be busy); bench/media.py measures the real
figures, before and after."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from gateway.config import Settings
from gateway.media import MediaConfig, MediaPreparer
from gateway.media.build import media_config
from gateway.media.document_process import ReaderOutcome, run_reader
from gateway.media.documents import DocumentLimits, document_text
from gateway.media.errors import MediaError
from gateway.messages import Attachment
from tests.media_files import (
    docx_bomb,
    docx_file,
    docx_with_nested_bomb,
    pdf,
    pdf_object_stream_bomb,
)

MB = 1024 * 1024
DEFAULTS = DocumentLimits()
TEXT_FILLER = b"<w:p><w:r><w:t>more words</w:t></w:r></w:p>"


def pages(count: int, text: str = "Page {}: the quarterly numbers") -> bytes:
    """A PDF of `count` pages with one line each (about 300 bytes a page)."""
    return pdf(*(text.format(i) for i in range(count)))


@dataclass(frozen=True)
class Bomb:
    name: str
    make: Callable[[], bytes]
    refused: str | None  # the reason given, or None when the budget's part is read
    stopped: str | None  # where reading stopped when it was not refused
    peak_mb: int  # the child's peak resident memory stays under this
    seconds: float
    limits: DocumentLimits = DEFAULTS


BOMBS = [
    Bomb(
        "bomb.docx",  # word/document.xml inflates to 200 MB
        lambda: docx_bomb(200),
        "it expands to more than 50 MB when unpacked, so I did not read it",
        None,
        peak_mb=120,
        seconds=10,
    ),
    Bomb(
        "lying.docx",  # the headers say 10 KB; it inflates to 200 MB of text
        lambda: docx_bomb(200, declared_size=10_000, filler=TEXT_FILLER),
        "the DOCX file is damaged and cannot be read (BadZipFile)",
        None,
        peak_mb=120,
        seconds=10,
    ),
    Bomb(
        "ratio.docx",  # 40 MB (under the size limit) from 60 KB
        lambda: docx_bomb(40),
        "it unpacks to over 500 times its packed size, as zip bombs do, so I did not read it",
        None,
        peak_mb=120,
        seconds=10,
    ),
    Bomb(
        "nested.docx",  # a workbook inside that inflates to 1 GB: never opened
        lambda: docx_with_nested_bomb("Quarterly numbers", megabytes=1024),
        None,
        None,
        peak_mb=120,
        seconds=10,
    ),
    Bomb(
        "pages.pdf",  # 20,000 pages of text: reading stops when 2,000 characters are in
        lambda: pages(20_000),
        None,
        "chars",
        peak_mb=150,
        seconds=10,
        limits=replace(DEFAULTS, max_chars=2000),
    ),
    Bomb(
        "blank.pdf",  # 20,000 pages without text: reading stops at the page budget
        lambda: pages(20_000, ""),
        None,
        "pages",
        peak_mb=150,
        seconds=10,
    ),
    Bomb(
        "stream.pdf",  # one object stream that inflates to 1 GB
        lambda: pdf_object_stream_bomb(1024),
        "it expands to more than 50 MB when unpacked, so I did not read it",
        None,
        peak_mb=250,
        seconds=10,
    ),
    Bomb(
        "streams.pdf",  # 8 object streams of 45 MB: each under the limit, together not
        lambda: pdf_object_stream_bomb(45, streams=8, padding=b"%"),
        "reading it needs more than 256 MB of memory, so I stopped",
        None,
        peak_mb=256,
        seconds=10,
        limits=replace(DEFAULTS, max_memory_bytes=256 * MB),
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize("bomb", BOMBS, ids=[b.name for b in BOMBS])
async def test_each_bomb_is_bounded_in_memory_and_time(bomb: Bomb) -> None:
    data = bomb.make()
    assert len(data) < 6 * MB  # small on disk, as a bomb is
    tracemalloc.start()
    try:
        outcome = await run_reader(data, name=bomb.name, mime_type="", limits=bomb.limits)
        _, gateway_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"{bomb.name}: {_describe(outcome)}")
    assert outcome.error == bomb.refused
    assert outcome.peak_rss_bytes is not None and outcome.peak_rss_bytes < bomb.peak_mb * MB
    assert outcome.seconds < bomb.seconds
    assert gateway_peak < 2 * MB  # the gateway holds the answer, never the inflated bytes
    if bomb.refused is None:
        assert outcome.document is not None and outcome.document.stopped == bomb.stopped


def _describe(outcome: ReaderOutcome) -> str:
    peak = (outcome.peak_rss_bytes or 0) / MB
    got = outcome.error or (outcome.document and outcome.document.stopped) or "read"
    return f"{peak:.0f} MB, {outcome.seconds:.2f} s: {got}"


@pytest.mark.anyio
async def test_a_long_pdf_is_read_only_until_the_budget_is_full() -> None:
    limits = replace(DEFAULTS, max_chars=2000)
    outcome = await run_reader(pages(20_000), name="long.pdf", mime_type="", limits=limits)
    document = outcome.document
    assert document is not None
    assert (document.stopped, document.pages, document.total_chars) == ("chars", 20_000, None)
    assert len(document.text) == 2000 and document.text.startswith("Page 0: the quarterly")
    # Pages are read up to the one that fills the budget, and not one more.
    texts = [f"Page {i}: the quarterly numbers" for i in range(100)]
    full_at = next(n for n in range(1, 100) if len("\n\n".join(texts[:n])) > 2000)
    assert document.pages_read == full_at
    blank = await run_reader(pages(20_000, ""), name="blank.pdf", mime_type="", limits=DEFAULTS)
    assert blank.document is not None
    assert (blank.document.stopped, blank.document.pages_read) == ("pages", 500)


def test_a_long_docx_is_parsed_only_until_the_budget_is_full() -> None:
    tracemalloc.start()
    try:
        # 40 MB of paragraphs (declared honestly, under the size limit and the ratio).
        data = docx_bomb(40, filler=b"<w:p><w:r><w:t>many words</w:t></w:r></w:p>")
        limits = replace(DEFAULTS, max_chars=1000, max_ratio=1000)
        tracemalloc.reset_peak()
        document = document_text(data, name="long.docx", mime_type="", limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert document.stopped == "chars" and len(document.text) == 1000
    assert document.text.startswith("Before the bomb\nmany words\nmany words\n")
    assert peak < 4 * MB  # a few 64 KB chunks and the budget's text, not 40 MB of XML


def test_a_lying_zip_is_never_inflated_past_a_chunk_in_the_gateways_reader() -> None:
    data = docx_bomb(200, declared_size=10_000, filler=TEXT_FILLER)
    tracemalloc.start()
    try:
        with pytest.raises(MediaError, match="DOCX file is damaged"):
            document_text(data, name="lying.docx", mime_type="", limits=DEFAULTS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # zipfile.read(), as python-docx calls it, inflates every compressed byte in one call
    # and cuts to the declared size after: 200 MB, and 474 MB of peak memory.
    assert peak < 4 * MB


@pytest.mark.anyio
async def test_a_reader_stuck_in_one_step_is_killed_at_the_deadline() -> None:
    # pypdf skips the 40 MB of spaces a byte at a time: about 8 s inside one step.
    data = pdf_object_stream_bomb(40)
    limits = replace(DEFAULTS, max_seconds=0.5)
    outcome = await run_reader(data, name="slow.pdf", mime_type="", limits=limits, kill_after=2)
    assert outcome.error == "reading it took longer than 2 s, so I stopped"
    assert outcome.seconds < 6


@pytest.mark.anyio
async def test_the_person_gets_one_line_and_the_model_a_note_of_the_cut() -> None:
    files = {
        "BOMB": docx_bomb(200),
        "LONG": pages(20_000, ""),
        "MEMO": docx_file("Dear team,", "ship it"),
    }

    class Files:
        async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
            return files[attachment.file_id]

    preparer = MediaPreparer(MediaConfig(documents=replace(DEFAULTS, max_pages=40)))
    bomb = Attachment("document", "BOMB", "report.docx", "", 300_000)
    blank = Attachment("document", "LONG", "scan.pdf", "application/pdf", 5 * MB)
    memo = Attachment("document", "MEMO", "memo.docx", "", 40_000)
    got = await preparer.prepare("", [bomb, blank, memo], Files(), model="m")
    assert got.problems == (
        "I could not use report.docx: it expands to more than 50 MB when unpacked, so I did "
        "not read it.",
        "I could not use scan.pdf: I found no text in its first 40 pages, and read no further.",
    )
    assert got.usable and "[document: memo.docx]\nDear team,\nship it\n[end" in got.text
    assert got.records[1]["stopped"] == "pages" and got.records[1]["pages_read"] == 40
    cut = await preparer.prepare("", [memo], Files(), model="m")
    assert "cut" not in cut.text
    files["LONG"] = pages(20_000)
    read = await preparer.prepare("", [blank], Files(), model="m")
    assert read.text.endswith(
        "Page 39: the quarterly numbers\n[... cut: only the first 40 pages of 20,000 were "
        "read]\n[end of scan.pdf]"
    )


def test_the_document_limits_come_from_media_settings_with_clear_errors() -> None:
    settings = Settings.model_validate(
        {
            "media": {
                "document_max_unpacked_mb": 5,
                "document_max_pages": 10,
                "document_max_seconds": 3,
                "document_max_memory_mb": 300,
                "document_readers": 1,
            }
        }
    )
    limits = media_config(settings).documents
    assert (limits.max_unpacked_bytes, limits.max_pages, limits.max_seconds) == (5 * MB, 10, 3)
    assert (limits.max_memory_bytes, limits.max_ratio, limits.max_chars) == (300 * MB, 500, 20_000)
    with pytest.raises(ValueError, match="document_max_memory_mb = 128 is too little to read a"):
        Settings.model_validate({"media": {"document_max_memory_mb": 128}})
    with pytest.raises(ValueError, match="document_max_pages"):
        Settings.model_validate({"media": {"document_max_pages": 0}})
