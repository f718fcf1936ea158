"""The media preparer from `[media]` and `[llm]` settings."""

from __future__ import annotations

from gateway.config import Settings, reveal
from gateway.llm.openai_provider import DEFAULT_BASE_URL
from gateway.media.documents import DocumentLimits
from gateway.media.prepare import MediaConfig, MediaPreparer
from gateway.media.transcribe import Transcriber
from gateway.usage.meter import UsageMeter

_MB = 1024 * 1024


def media_config(settings: Settings) -> MediaConfig:
    media = settings.media
    return MediaConfig(
        enabled=media.enabled,
        max_download_bytes=int(media.max_download_mb * _MB),
        image_max_side=media.image_max_side,
        image_max_bytes=media.image_max_kb * 1024,
        image_max_pixels=int(media.image_max_megapixels * 1_000_000),
        documents=DocumentLimits(
            max_chars=media.document_max_chars,
            max_unpacked_bytes=int(media.document_max_unpacked_mb * _MB),
            max_ratio=media.document_max_ratio,
            max_pages=media.document_max_pages,
            max_seconds=media.document_max_seconds,
            max_memory_bytes=media.document_max_memory_mb * _MB,
        ),
        document_readers=media.document_readers,
        vision_models=tuple(media.vision_models),
    )


def build_media(settings: Settings, usage: UsageMeter | None = None) -> MediaPreparer | None:
    """The preparer, with a transcriber on the configured server that counts its calls
    in `usage`; None when media is off. The LLM's key goes only to the LLM's own server:
    a separate transcription server gets `transcription_api_key` or no key."""
    media = settings.media
    if not media.enabled:
        return None
    own_server = media.transcription_base_url is None
    base_url = (settings.llm.base_url if own_server else media.transcription_base_url) or (
        DEFAULT_BASE_URL
    )
    api_key = reveal(media.transcription_api_key) or (
        settings.llm.resolved_api_key() if own_server else None
    )
    transcriber = Transcriber(
        base_url=base_url,
        api_key=api_key,
        model=media.transcription_model,
        timeout=media.transcription_timeout,
        meter=usage,
    )
    return MediaPreparer(media_config(settings), transcriber)
