"""Media in and out: images for vision models, voice notes transcribed, documents as
text, and files that go out with a reply."""

from gateway.media.errors import MediaError
from gateway.media.prepare import FileSource, MediaConfig, MediaPreparer, PreparedInput

__all__ = ["FileSource", "MediaConfig", "MediaError", "MediaPreparer", "PreparedInput"]
