"""Images for a vision model: decoded with Pillow, bounded in pixels and bytes, and
re-encoded (JPEG, or PNG when transparent) when too large."""

from __future__ import annotations

import base64
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.media.errors import MediaError

if TYPE_CHECKING:
    from PIL import Image

#: What a vision model accepts as is; anything else is re-encoded.
_PASS_THROUGH = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif"}


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image ready for a chat request: its bytes, type and size in pixels."""

    data: bytes
    mime_type: str
    width: int
    height: int
    reencoded: bool

    @property
    def data_url(self) -> str:
        return f"data:{self.mime_type};base64,{base64.b64encode(self.data).decode('ascii')}"


def prepare_image(data: bytes, *, max_side: int, max_bytes: int, max_pixels: int) -> PreparedImage:
    """`data` as an image a model can take: unchanged when it is a common format within
    `max_side` pixels and `max_bytes`, else scaled down and re-encoded. Raises
    MediaError for bytes that are no image and for images over `max_pixels` (a
    decompression bomb is refused before it is decoded)."""
    # Imported on first use: the daemon starts without paying for Pillow.
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(
                    f"the image is {width}x{height} pixels; the limit is "
                    f"{max_pixels / 1e6:.0f} megapixels"
                )
            kind = image.format or ""
            if (
                kind in _PASS_THROUGH
                and max(width, height) <= max_side
                and len(data) <= max_bytes
                and not getattr(image, "is_animated", False)
            ):
                image.verify()  # a truncated file is refused here, not by the model
                return PreparedImage(data, _PASS_THROUGH[kind], width, height, reencoded=False)
            image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError("the file is not an image I can read") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"the image is damaged ({type(exc).__name__})") from None
    return _reencode(image, max_side=max_side, max_bytes=max_bytes)


def _reencode(image: Image.Image, *, max_side: int, max_bytes: int) -> PreparedImage:
    """Scale to `max_side`, then lower the JPEG quality (and the size) until it fits."""
    if getattr(image, "is_animated", False):
        image.seek(0)  # the first frame stands for the animation
    transparent = image.mode in ("RGBA", "LA", "P") and "transparency" in image.info
    image = image.convert("RGBA" if transparent or image.mode == "RGBA" else "RGB")
    side = max_side
    quality = 85
    while True:
        copy = image.copy()
        copy.thumbnail((side, side))
        out = io.BytesIO()
        if copy.mode == "RGBA":
            copy.save(out, format="PNG", optimize=True)
            mime = "image/png"
        else:
            copy.save(out, format="JPEG", quality=quality, optimize=True)
            mime = "image/jpeg"
        if out.tell() <= max_bytes or side <= 256:
            return PreparedImage(out.getvalue(), mime, copy.width, copy.height, reencoded=True)
        if mime == "image/jpeg" and quality > 60:
            quality -= 15
        else:
            side = int(side * 0.75)
