"""Media in and out: images for vision models, voice notes transcribed, documents as
text, and files that go out with a reply."""

from typing import TYPE_CHECKING, Any

from gateway.media.errors import MediaError

if TYPE_CHECKING:
    from gateway.media.prepare import FileSource, MediaConfig, MediaPreparer, PreparedInput

__all__ = ["FileSource", "MediaConfig", "MediaError", "MediaPreparer", "PreparedInput"]


def __getattr__(name: str) -> Any:
    # The preparer (and the openai client its transcriber brings) loads on first use: a
    # document reader's child process imports this package too, and starts in 0.2 s
    # instead of 1 s.
    if name in __all__:
        from gateway.media import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
