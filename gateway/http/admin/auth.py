"""Who may use the admin page: the login cookie, the bearer header and CSRF tokens.

Invariants (tested in tests/test_admin_auth.py and tests/test_admin_http.py):
- The admin page is off (503) while no HTTP token is configured: the gateway user's
  private state is never open to whoever else can reach loopback on this machine.
- The login cookie is stateless and signed with a key derived from the HTTP token, so
  every replica accepts it and changing the token logs everyone out. It expires after
  `SESSION_SECONDS`; a forged, altered or expired cookie is refused.
- A request authenticated by its cookie changes nothing without the CSRF token of that
  cookie (a hidden form field or the `X-CSRF-Token` header). A request carrying the bearer
  header needs none: a browser never attaches that header to a forged cross-site request.
- Everything is compared in constant time; neither the token nor a cookie is logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.http.auth import BearerCheck, check_bearer

COOKIE_NAME = "gateway_admin"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"
#: How long a login lasts.
SESSION_SECONDS = 12 * 3600
_VERSION = "v1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _mac(key: bytes, message: str) -> str:
    return _b64(hmac.new(key, message.encode("utf-8"), hashlib.sha256).digest())


@dataclass(frozen=True, slots=True)
class AdminLogin:
    """A verified login: how it was made and, for a cookie, its CSRF token."""

    via: str  # "cookie" or "bearer"
    csrf: str = ""

    @property
    def needs_csrf(self) -> bool:
        return self.via == "cookie"


class AdminKeys:
    """Cookies and CSRF tokens, both derived from the HTTP token (see the module doc)."""

    def __init__(self, token: str, *, clock: Callable[[], float] = time.time) -> None:
        if not token:
            raise ValueError("the admin page needs the HTTP token")
        self._token = token.encode("utf-8")
        self._key = hmac.new(self._token, b"gateway-admin-session-v1", hashlib.sha256).digest()
        self._clock = clock

    def token_matches(self, given: str) -> bool:
        """Is `given` (what the login form received) the HTTP token?"""
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._token)

    def check_authorization(self, header: str) -> AdminLogin | None:
        """The login an `Authorization: Bearer <token>` header proves, or None."""
        token = self._token.decode("utf-8")
        return AdminLogin("bearer") if check_bearer(header, token) is BearerCheck.OK else None

    def new_cookie(self) -> str:
        """A fresh login cookie value, valid for `SESSION_SECONDS`."""
        expires = int(self._clock()) + SESSION_SECONDS
        body = f"{_VERSION}.{expires}.{secrets.token_urlsafe(16)}"
        return f"{body}.{_mac(self._key, body)}"

    def check_cookie(self, value: str | None) -> AdminLogin | None:
        """The login a cookie value proves, or None (missing, forged, expired)."""
        if not value or len(value) > 200:
            return None
        body, _, signature = value.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit():
            return None
        if not hmac.compare_digest(signature.encode(), _mac(self._key, body).encode()):
            return None
        if int(parts[1]) <= self._clock():
            return None
        return AdminLogin("cookie", csrf=self.csrf_for(value))

    def csrf_for(self, cookie: str) -> str:
        """The CSRF token of one login: a MAC of its cookie, so it dies with it."""
        return _mac(self._key, f"csrf:{cookie}")

    @staticmethod
    def csrf_ok(login: AdminLogin, given: str | None) -> bool:
        """May this login change something, given the CSRF token the request sent?"""
        if not login.needs_csrf:
            return True
        return bool(given) and hmac.compare_digest(
            str(given).encode("utf-8", "surrogateescape"), login.csrf.encode()
        )
