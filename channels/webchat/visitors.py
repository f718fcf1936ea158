"""Who a browser is: the visitor cookie, its CSRF token, and the password.

A visitor is a random id (`new_visitor_id`) carried by a signed cookie, so the gateway
keeps no table of logins and every replica accepts the cookie another issued. With a
password (`[channels.web] password`) the page asks for it first, and every browser that
knows it is the same visitor, the owner.

Promises (tested in tests/test_webchat_visitors.py):
- A cookie is `v1.<visitor>.<expires>.<mac>`; one with a wrong MAC, a past expiry, another
  version or a visitor id of the wrong shape names nobody. Nobody can make a cookie for a
  visitor id of their choosing without the key (the channel's own, kept in its store).
- Changing the password changes the MAC key: every cookie issued under the old password
  names nobody any more (everyone logs in again).
- A request that changes something carries the CSRF token of its cookie (a MAC of the
  cookie, which a page of another site cannot read); it dies with the cookie.
- Every comparison is in constant time; no cookie, token or password is logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from channels.webchat.settings import VISITOR_ID

#: The cookie of the chat page, and the one of the widget's frame (SameSite=None,
#: partitioned: a third-party cookie in the embedding site's jar only).
PAGE_COOKIE = "gateway_webchat"
EMBED_COOKIE = "gateway_webchat_embed"
#: The header every request of the page carries: the cookie's CSRF token.
CSRF_HEADER = "X-CSRF-Token"
_VERSION = "v1"
_MAX_COOKIE = 300


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def new_visitor_id() -> str:
    """A fresh visitor id: 128 random bits, 22 URL-safe characters."""
    return secrets.token_urlsafe(16)


def new_key() -> str:
    """A fresh signing key (what the store keeps once for every replica)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Visitor:
    """A checked cookie: who it names, until when, and its CSRF token."""

    id: str
    expires: int
    cookie: str
    csrf: str


class VisitorKeys:
    """Cookies and CSRF tokens, from the channel's key and the password (if any)."""

    def __init__(
        self, key: str, *, password: str | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        if not key:
            raise ValueError("the web chat needs its signing key")
        self._password = password.encode("utf-8") if password else None
        # The password is part of the MAC key: a new password ends every cookie.
        mixed = b"webchat-cookie-v1\0" + hashlib.sha256(self._password or b"").digest()
        self._key = hmac.new(key.encode("utf-8"), mixed, hashlib.sha256).digest()
        self._clock = clock

    def _mac(self, message: str) -> str:
        return _b64(hmac.new(self._key, message.encode("utf-8"), hashlib.sha256).digest())

    @property
    def needs_password(self) -> bool:
        return self._password is not None

    def password_matches(self, given: str) -> bool:
        if self._password is None:
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._password)

    def issue(self, visitor: str, lifetime_seconds: int) -> Visitor:
        """A cookie naming `visitor` for `lifetime_seconds`."""
        if not VISITOR_ID.fullmatch(visitor):
            raise ValueError(f"not a visitor id: {visitor!r}")
        expires = int(self._clock()) + lifetime_seconds
        body = f"{_VERSION}.{visitor}.{expires}"
        cookie = f"{body}.{self._mac(body)}"
        return Visitor(visitor, expires, cookie, self._mac(f"csrf:{cookie}"))

    def check(self, cookie: str | None) -> Visitor | None:
        """The visitor a cookie names, or None (missing, forged, altered, expired)."""
        if not cookie or len(cookie) > _MAX_COOKIE:
            return None
        body, _, signature = cookie.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[2].isdigit():
            return None
        if not VISITOR_ID.fullmatch(parts[1]):
            return None
        if not hmac.compare_digest(signature.encode(), self._mac(body).encode()):
            return None
        expires = int(parts[2])
        if expires <= self._clock():
            return None
        return Visitor(parts[1], expires, cookie, self._mac(f"csrf:{cookie}"))

    @staticmethod
    def csrf_ok(visitor: Visitor, given: str | None) -> bool:
        """Is `given` (the request's `X-CSRF-Token`) the token of this visitor's cookie?"""
        return bool(given) and hmac.compare_digest(
            str(given).encode("utf-8", "surrogateescape"), visitor.csrf.encode()
        )
