"""Fetching a file over HTTP into memory, within a size limit."""

from __future__ import annotations

import httpx
from loguru import logger

from gateway.media.errors import FileTooLarge, MediaError


async def download_capped(url: str, limit: int, headers: dict[str, str] | None = None) -> bytes:
    """GET `url` into memory, refusing more than `limit` bytes (`FileTooLarge`). Errors
    name no URL (it may hold a token)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with (
            httpx.AsyncClient(timeout=60, follow_redirects=True) as client,
            client.stream("GET", url, headers=headers) as response,
        ):
            if response.status_code != 200:
                raise MediaError(f"the download failed (HTTP {response.status_code})")
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise FileTooLarge(f"it is larger than the {limit / 2**20:.0f} MB limit")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        logger.warning("file download failed: {}", type(exc).__name__)
        raise MediaError("the download failed; please send the file again") from None
    return b"".join(chunks)
