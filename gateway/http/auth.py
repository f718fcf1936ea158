"""Who may use the HTTP server: the binding policy and the bearer-token check.

Invariants (tested in tests/test_http_auth.py):
- The server never listens beyond loopback without a token configured: `check_bind_policy`
  raises `HttpConfigError` (a `ConfigError`, so the CLI exits 78 and systemd does not
  restart into the same mistake).
- Tokens are compared in constant time, as bytes; the token never appears in a message.
"""

from __future__ import annotations

import hmac
import ipaddress
from enum import StrEnum

from pydantic import SecretStr

from gateway.config import ConfigError

TOKEN_ENV = "GATEWAY_HTTP__TOKEN"
REALM = "gateway"


class HttpConfigError(ConfigError):
    """The HTTP settings are unsafe or unusable; the message names what to change."""


def secret_value(token: SecretStr | str | None) -> str | None:
    """The configured token as plain text; an empty one counts as not configured."""
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return value or None


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only.
    Unknown host names count as not loopback: the safe answer when unsure."""
    host = host.strip()
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_policy(host: str, token: str | None) -> None:
    """Refuse to listen on a non-loopback address without a token."""
    if token or is_loopback(host):
        return
    where = repr(host) if host.strip() else "'' (every interface)"
    raise HttpConfigError(
        f"http.host = {where} is reachable from other machines but no API token is set: "
        f"set {TOKEN_ENV} to a long random secret (e.g. the output of "
        '`python -c "import secrets; print(secrets.token_urlsafe(32))"`) '
        "or bind http.host to 127.0.0.1"
    )


class BearerCheck(StrEnum):
    OK = "ok"
    MISSING = "missing"
    INVALID = "invalid"


def bearer_credentials(authorization: str | None) -> bytes | None:
    """The token an `Authorization: Bearer <token>` header carries, as bytes to compare
    in constant time (None: no header, another scheme, or an empty token)."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip().encode("utf-8", "surrogateescape")


def check_bearer(authorization: str | None, token: str) -> BearerCheck:
    """Check an `Authorization` header against the configured token (RFC 6750 bearer)."""
    given = bearer_credentials(authorization)
    if given is None:
        return BearerCheck.MISSING
    if hmac.compare_digest(given, token.encode("utf-8")):
        return BearerCheck.OK
    return BearerCheck.INVALID


def www_authenticate(result: BearerCheck) -> str:
    """The WWW-Authenticate header for a refused request."""
    if result is BearerCheck.INVALID:
        return f'Bearer realm="{REALM}", error="invalid_token"'
    return f'Bearer realm="{REALM}"'
