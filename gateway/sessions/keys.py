"""Session keys to file names: a reversible, collision-free percent-encoding.

Every UTF-8 byte outside ``[A-Za-z0-9._-]`` becomes ``%XX`` (upper-case hex), so the
encoding is injective (``telegram:1`` -> ``telegram%3A1``, ``telegram_1`` stays as is),
reversible, and can never contain ``/`` or NUL: the file of any key is a plain name
directly inside the sessions folder, whatever the key holds (``../../etc/passwd`` too).
"""

from __future__ import annotations

from pathlib import Path

from gateway.sessions.errors import SessionKeyError

#: Longest stem we accept: leaves room under the usual 255-byte file-name limit for the
#: ``.jsonl`` suffix and the ``.torn-<time>`` / ``.corrupt-<time>`` sidecar suffixes.
MAX_STEM_BYTES = 200
SUFFIX = ".jsonl"

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_TABLE = tuple(chr(b) if b in _SAFE else f"%{b:02X}" for b in range(256))
_HEX = "0123456789ABCDEF"


def encode_key(key: str) -> str:
    """Return the file stem for ``key``; raise `SessionKeyError` if it cannot be one."""
    if not isinstance(key, str) or not key:
        raise SessionKeyError("a session key must be a non-empty string")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise SessionKeyError(
            f"session key {key!r} is not valid Unicode text (it holds a lone surrogate); "
            "build keys from decoded text only"
        ) from None
    stem = "".join(map(_TABLE.__getitem__, raw))
    if len(stem) > MAX_STEM_BYTES:
        raise SessionKeyError(
            f"session key is too long: its file name would be {len(stem)} bytes, "
            f"the limit is {MAX_STEM_BYTES}; use a shorter key (e.g. hash long ids)"
        )
    return stem


def decode_key(stem: str) -> str:
    """Return the key whose `encode_key` is ``stem``; raise `SessionKeyError` otherwise.

    Only canonical stems decode (upper-case hex, no needless escapes), so decoding
    and encoding are exact inverses and a stray file name is never mistaken for a key.
    """
    out = bytearray()
    i, n = 0, len(stem)
    while i < n:
        c = stem[i]
        if c == "%":
            hi, lo = stem[i + 1 : i + 2], stem[i + 2 : i + 3]
            if not hi or not lo or hi not in _HEX or lo not in _HEX:
                raise SessionKeyError(f"{stem!r} is not an encoded session key (bad escape)")
            out.append(int(hi + lo, 16))
            i += 3
        else:
            b = ord(c)
            if b > 127 or b not in _SAFE:
                raise SessionKeyError(f"{stem!r} is not an encoded session key")
            out.append(b)
            i += 1
    try:
        key = out.decode("utf-8")
    except UnicodeDecodeError:
        raise SessionKeyError(f"{stem!r} is not an encoded session key (bad UTF-8)") from None
    if not key or encode_key(key) != stem:
        raise SessionKeyError(f"{stem!r} is not a canonical encoded session key")
    return key


def session_path(sessions_dir: Path, key: str) -> Path:
    """The current session file of ``key``: always a direct child of ``sessions_dir``."""
    return sessions_dir / (encode_key(key) + SUFFIX)


def key_from_filename(name: str) -> str | None:
    """The key of a session file name (``<stem>.jsonl``), or None for any other file."""
    if not name.endswith(SUFFIX) or len(name) == len(SUFFIX):
        return None
    try:
        return decode_key(name[: -len(SUFFIX)])
    except SessionKeyError:
        return None
