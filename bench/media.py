"""Media preparation cost: images re-encoded for a vision model, and PDF text extraction.

Run `.venv/bin/python bench/media.py` (a table). The inputs are made on the spot: a
12-megapixel JPEG (a phone photo's size), an incompressible PNG, a small PNG and a
200-page PDF; each is prepared with the default `[media]` limits (2048 px, 2 MB, 20,000
characters), best of 3 runs.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image

from gateway.media.documents import document_text
from gateway.media.images import prepare_image
from tests.media_files import noisy_png, pdf

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
        return document_text(document, name="q.pdf", mime_type="application/pdf", max_chars=20_000)

    text = document_text(document, name="q.pdf", mime_type="application/pdf", max_chars=20_000)
    pages = f"{text.pages} pages"
    kept = len(text.text) // 1024
    print(
        f"{'PDF, 200 pages':26} {len(document) // 1024:8} {pages:>14} {kept:7} {best_ms(read):7.0f}"
    )


if __name__ == "__main__":
    main()
