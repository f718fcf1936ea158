"""The one error a media step raises: what went wrong, in a line a chat user can read."""

from __future__ import annotations


class MediaError(Exception):
    """A file could not be fetched, read or transcribed. `str(exc)` is one line that is
    safe to show to the person who sent the file (no URLs, no tokens)."""


class FileTooLarge(MediaError):
    """The file is larger than the limit it was fetched under: asking again (another
    link, another try) cannot help."""
