"""Errors the sessions package raises; each message says what went wrong and what to do."""

from __future__ import annotations


class SessionError(Exception):
    """Base class for every session failure a caller may want to report to a user."""


class SessionKeyError(SessionError, ValueError):
    """A session key cannot be used (empty, not valid Unicode, or too long for a file name)."""


class EntryFormatError(SessionError, ValueError):
    """A transcript entry is malformed: unknown type, missing or mistyped field."""


class EntryNotFoundError(SessionError, LookupError):
    """An operation named an entry id that the session does not hold."""


class SessionExistsError(SessionError):
    """A new session was asked for under a key that already has one."""


class UnsupportedVersionError(SessionError):
    """A session file was written by a newer format version; it is left untouched."""
