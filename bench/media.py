"""Media preparation cost: images re-encoded for a vision model, PDF text extraction,
and document bombs before and after their bounds.

Run `.venv/bin/python bench/media.py` (two tables, about two minutes). The inputs are
made on the spot: a 12-megapixel JPEG (a phone photo's size), an incompressible PNG, a
small PNG and a 200-page PDF, each prepared with the default `[media]` limits (2048 px,
2 MB, 20,000 characters), best of 3 runs; then each bomb of tests/test_media_bombs.py
once read as the gateway read documents before (pypdf over every page, python-docx, in
the process; here in a child held to 2 GB so the machine survives it) and once as it
reads them now (gateway.media.document_process, default limits). Peak memory is the
reading process's peak resident set (VmHWM), time is from start to answer; about 2,000
MB before is the cap: the old reader wanted more.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio
from PIL import Image

from gateway.media.document_process import ReaderOutcome, run_reader
from gateway.media.documents import DocumentLimits, document_text
from gateway.media.images import prepare_image
from tests.media_files import (
    docx_bomb,
    docx_with_nested_bomb,
    noisy_png,
    pdf,
    pdf_object_stream_bomb,
)

MB = 1024 * 1024


def photo_jpeg(width: int, height: int) -> bytes:
    image = Image.radial_gradient("L").resize((width, height)).convert("RGB")
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


def best_ms(run: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return min(times)


def main() -> None:
    print(f"{'input':26} {'in KB':>8} {'result':>14} {'out KB':>7} {'ms':>7}")
    for name, data in [
        ("12 MP JPEG 4000x3000", photo_jpeg(4000, 3000)),
        ("noisy PNG 1600x1200", noisy_png(1600, 1200)),
        ("small PNG 640x480", noisy_png(640, 480)),
    ]:

        def prepare(data: bytes = data) -> object:
            return prepare_image(data, max_side=2048, max_bytes=2 * MB, max_pixels=50_000_000)

        result = prepare_image(data, max_side=2048, max_bytes=2 * MB, max_pixels=50_000_000)
        size = f"{result.width}x{result.height}"
        print(
            f"{name:26} {len(data) // 1024:8} {size:>14} {len(result.data) // 1024:7} "
            f"{best_ms(prepare):7.0f}"
        )
    document = pdf(*[f"Page {i}: the quarterly numbers" for i in range(200)])

    def read() -> object:
        return document_text(
            document, name="q.pdf", mime_type="application/pdf", limits=DocumentLimits()
        )

    text = document_text(
        document, name="q.pdf", mime_type="application/pdf", limits=DocumentLimits()
    )
    pages = f"{text.pages} pages"
    kept = len(text.text) // 1024
    print(
        f"{'PDF, 200 pages':26} {len(document) // 1024:8} {pages:>14} {kept:7} {best_ms(read):7.0f}"
    )

    print()
    bombs()


TEXT = b"<w:p><w:r><w:t>more words</w:t></w:r></w:p>"
BOMBS: list[tuple[str, str, Callable[[], bytes]]] = [
    ("DOCX, 200 MB inflated", "bomb.docx", lambda: docx_bomb(200)),
    (
        "DOCX, 200 MB of text, lying",
        "lying.docx",
        lambda: docx_bomb(200, declared_size=10_000, filler=TEXT),
    ),
    ("DOCX, 40 MB (ratio 670)", "ratio.docx", lambda: docx_bomb(40)),
    ("DOCX, nested 1 GB zip", "nested.docx", lambda: docx_with_nested_bomb("Numbers")),
    (
        "PDF, 20,000 pages",
        "pages.pdf",
        lambda: pdf(*(f"Page {i}: the numbers" for i in range(20_000))),
    ),
    ("PDF, 20,000 blank pages", "blank.pdf", lambda: pdf(*([""] * 20_000))),
    ("PDF, 1 GB object stream", "stream.pdf", lambda: pdf_object_stream_bomb(1024)),
    (
        "PDF, 12 x 45 MB obj streams",
        "streams.pdf",
        lambda: pdf_object_stream_bomb(45, 12, padding=b"%"),
    ),
    ("PDF, 6 x 40 MB slow streams", "slow.pdf", lambda: pdf_object_stream_bomb(40, 6)),
]


def bombs() -> None:
    print(f"{'bomb':29} {'KB':>5} | {'before MB':>9} {'s':>5} {'':24} | {'after MB':>8} {'s':>5}")
    for label, name, make in BOMBS:
        data = make()
        before = _before(data, name)
        outcome = anyio.run(_after, data, name)
        got = outcome.error or (outcome.document and outcome.document.stopped) or "read all"
        peak = "?" if outcome.peak_rss_bytes is None else f"{outcome.peak_rss_bytes / MB:.0f}"
        print(
            f"{label:29} {len(data) // 1024:5} | {before['peak_mb']:9.0f} {before['seconds']:5.1f} "
            f"{before['outcome'][:24]:24} | {peak:>8} {outcome.seconds:5.1f} {got[:48]}",
            flush=True,
        )


async def _after(data: bytes, name: str) -> ReaderOutcome:
    return await run_reader(data, name=name, mime_type="", limits=DocumentLimits())


def _before(data: bytes, name: str) -> dict[str, object]:
    """The old reader on `data`, in a child process held to 2 GB of address space."""
    child = subprocess.run(
        [sys.executable, __file__, "--before", name], input=data, capture_output=True, check=True
    )
    return json.loads(child.stdout)


def _read_before(name: str) -> None:
    """The child: the gateway's document reader as it was (pypdf over every page,
    python-docx), on stdin's bytes; the answer on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    data = sys.stdin.buffer.read()
    started = time.perf_counter()
    try:
        if name.endswith(".pdf"):
            from pypdf import PdfReader

            reader = PdfReader(io.BytesIO(data), strict=False)
            texts = [page.extract_text() or "" for page in reader.pages]
            outcome = f"read {len(texts)} pages"
        else:
            import docx

            document = docx.Document(io.BytesIO(data))
            lines = [p.text for p in document.paragraphs]
            outcome = f"read {len(lines)} paragraphs"
    except MemoryError:
        outcome = "out of memory (2 GB)"
    except Exception as exc:  # what the gateway showed, or the traceback it logged
        outcome = type(exc).__name__
    seconds = time.perf_counter() - started
    with open("/proc/self/status", encoding="ascii") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mb": peak / 1024, "seconds": seconds, "outcome": outcome}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--before"]:
        _read_before(sys.argv[2])
    else:
        main()
