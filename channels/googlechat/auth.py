"""Google's side of trust, both ways: the service account's access token for the Chat API
(the JWT bearer grant), and the check of the bearer token on every request Google Chat
makes to the app's endpoint. PyJWT signs and verifies (RS256, through `cryptography`);
the keys and tokens travel over the gateway's aiohttp.

Requests from Google Chat (developers.google.com/workspace/chat/verify-requests-from-chat)
carry `Authorization: Bearer <JWT>`, whose form follows the app's "Authentication
Audience" in the console:
- the project number: a JWT issued by chat@system.gserviceaccount.com for that number,
  signed by a key published at `chat_certs_url`;
- the endpoint URL: a Google ID token (issuer accounts.google.com) for that URL whose
  `email` is chat@system.gserviceaccount.com (verified), signed by a key published at
  `google_certs_url`.
`BearerVerifier` holds either to the letter: the signature by a published key (RS256
only), the issuer, the audience, the expiry (30 s of clock skew), the email; anything
else is refused with why.

Promises (tested in tests/test_googlechat.py):
- Keys are fetched once and kept as long as Google's `Cache-Control: max-age` says (an
  hour when it says nothing); a token signed by a key not in hand fetches them again, at
  most once every `KEY_REFETCH_SECONDS`, so forged tokens with made-up key ids cannot
  make the gateway hammer Google.
- An access token is asked for at most once at a time and used until five minutes
  before it expires (or half its life, for a short one); `invalidate` (after a 401)
  drops it.
- No token, key or assertion reaches an error message or a log line.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import anyio
import jwt
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from channels.googlechat.api import ChatApiError, call, error_from
from channels.googlechat.settings import CHAT_ISSUER

#: The scope of a Chat app acting as itself.
CHAT_BOT_SCOPE = "https://www.googleapis.com/auth/chat.bot"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
ID_TOKEN_ISSUERS = ("https://accounts.google.com", "accounts.google.com")
#: The clock skew tolerated on a token's `iat` and `exp`, in seconds.
LEEWAY = 30
#: A token signed by an unknown key fetches the keys again at most this often.
KEY_REFETCH_SECONDS = 30.0
_MAX_AGE = re.compile(r"max-age=(\d+)")


class SetupError(Exception):
    """The channel cannot work as configured (a key Google refuses, keys it cannot read);
    says what to fix, never holds a secret."""


class Refused(Exception):
    """A request's bearer token is missing or does not verify; says why (for the log)."""


class KeysUnavailable(Exception):
    """Google's keys could not be fetched: no token can be checked now."""


# --------------------------------------------------------------------------- outbound


@dataclass(frozen=True)
class ServiceAccount:
    """The parts of a service account's key file the channel uses."""

    client_email: str
    private_key: str
    private_key_id: str
    token_uri: str
    project_id: str = ""

    def __repr__(self) -> str:  # the private key never reaches a log line
        return f"ServiceAccount({self.client_email!r}, token_uri={self.token_uri!r})"

    @classmethod
    def from_json(cls, text: str) -> ServiceAccount:
        """The account of a key file's content; SetupError saying what is wrong."""
        try:
            data = json.loads(text)
        except ValueError:
            raise SetupError(
                "googlechat: the service account key is not JSON; give the content of the "
                "key file the console made (IAM > Service accounts > Keys > Add key > JSON)"
            ) from None
        if not isinstance(data, dict) or data.get("type") != "service_account":
            raise SetupError(
                'googlechat: the service account key is not a service account\'s ("type": '
                '"service_account"); make a JSON key for a service account'
            )
        missing = [k for k in ("client_email", "private_key", "token_uri") if not data.get(k)]
        if missing:
            raise SetupError(
                f"googlechat: the service account key lacks {', '.join(missing)}; make a new "
                "JSON key for the service account"
            )
        return cls(
            client_email=str(data["client_email"]),
            private_key=str(data["private_key"]),
            private_key_id=str(data.get("private_key_id") or ""),
            token_uri=str(data["token_uri"]),
            project_id=str(data.get("project_id") or ""),
        )

    def assertion(self, scope: str, now: float) -> str:
        """The signed JWT of the bearer grant: this account asking for `scope`, for an
        hour, addressed to the token endpoint."""
        issued = int(now)
        claims = {
            "iss": self.client_email,
            "scope": scope,
            "aud": self.token_uri,
            "iat": issued,
            "exp": issued + 3600,
        }
        headers = {"kid": self.private_key_id} if self.private_key_id else None
        try:
            return jwt.encode(claims, self.private_key, algorithm="RS256", headers=headers)
        except (ValueError, TypeError, jwt.PyJWTError):
            raise SetupError(
                "googlechat: the service account key's private_key cannot sign; make a new "
                "JSON key for the service account"
            ) from None


class AccessTokens:
    """The app's access token for the Chat API, from the token endpoint, kept until
    shortly before it expires (see the module docstring)."""

    def __init__(
        self,
        account: ServiceAccount,
        *,
        scope: str = CHAT_BOT_SCOPE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.account = account
        self.scope = scope
        self._clock = clock
        self._token: str | None = None
        self._renew_at = 0.0
        self._lock = anyio.Lock()
        self.fetched = 0  # tokens obtained (metrics, tests)

    def invalidate(self) -> None:
        """Forget the token (Google answered 401 to it)."""
        self._token = None

    async def get(self, session: aiohttp.ClientSession) -> str:
        """A token that is good for a while yet. Raises SetupError when Google refuses
        the account (fix the key), Unreachable/NoAnswer/ChatApiError when the token
        endpoint cannot answer now."""
        if self._token is not None and self._clock() < self._renew_at:
            return self._token
        async with self._lock:
            if self._token is not None and self._clock() < self._renew_at:
                return self._token
            now = self._clock()
            form = {
                "grant_type": JWT_BEARER,
                "assertion": self.account.assertion(self.scope, now),
            }
            status, body, _ = await call(session, "POST", self.account.token_uri, form=form)
            if status != 200:
                error = error_from(status, body)
                if error.transient:
                    raise error
                raise SetupError(
                    f"googlechat: Google refused the service account "
                    f"{self.account.client_email} ({error}); check that its key is current "
                    "(IAM > Service accounts > Keys) and that the Chat API is enabled"
                )
            try:
                data = json.loads(body)
                token = str(data["access_token"])
                lifetime = float(data.get("expires_in") or 3600)
            except (ValueError, KeyError, TypeError):
                raise ChatApiError(status, "", "the token endpoint answered no token") from None
            self._token = token
            self._renew_at = now + max(lifetime - 300.0, lifetime / 2)
            self.fetched += 1
            return token


# --------------------------------------------------------------------------- inbound

Form = Literal["project", "url"]


def audience_form(audience: str) -> Form:
    """Which bearer token an audience gets: a project number's JWT, or a URL's ID token."""
    return "project" if audience.isdigit() else "url"


@dataclass
class _KeySet:
    keys: dict[str, Any]
    expires: float
    fetched: float


def parse_keys(data: Any) -> dict[str, Any]:
    """Public keys by key id from Google's published forms: `{kid: PEM certificate}`
    (x509) or a JWK set `{"keys": [...]}`."""
    found: dict[str, Any] = {}
    if isinstance(data, dict) and isinstance(data.get("keys"), list):
        for item in data["keys"]:
            if isinstance(item, dict) and item.get("kid"):
                found[str(item["kid"])] = jwt.PyJWK(item).key
        return found
    if not isinstance(data, dict):
        raise ValueError("not a JSON object of keys")
    for kid, pem in data.items():
        certificate = x509.load_pem_x509_certificate(str(pem).encode())
        found[str(kid)] = certificate.public_key()
    return found


class BearerVerifier:
    """Checks the bearer token of a request from Google Chat (see the module docstring)."""

    def __init__(
        self,
        audience: str,
        *,
        chat_certs_url: str,
        google_certs_url: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.audience = audience
        self.form: Form = audience_form(audience)
        self.certs_url = chat_certs_url if self.form == "project" else google_certs_url
        self._clock = clock
        self._keys: _KeySet | None = None
        self._lock = anyio.Lock()
        self.fetches = 0  # key fetches (tests)

    async def prefetch(self, session: aiohttp.ClientSession) -> int:
        """Fetch Google's keys now (at start, and for `gateway doctor`); how many there
        are. Raises KeysUnavailable."""
        async with self._lock:
            return len((await self._fetch(session)).keys)

    async def verify(self, authorization: str, session: aiohttp.ClientSession) -> dict[str, Any]:
        """The token's claims; Refused (why) when it is missing or does not verify,
        KeysUnavailable when Google's keys cannot be had now."""
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Refused("no bearer token")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Refused("the bearer token is not a JWT") from None
        if header.get("alg") != "RS256":
            raise Refused(f"the bearer token is signed with {header.get('alg')!r}, not RS256")
        kid = str(header.get("kid") or "")
        key = await self._key(kid, session)
        if key is None:
            raise Refused("the bearer token is signed by a key Google does not publish")
        issuers = [CHAT_ISSUER] if self.form == "project" else list(ID_TOKEN_ISSUERS)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=["RS256"],
                audience=self.audience,
                issuer=issuers,
                leeway=LEEWAY,
                options={"require": ["exp", "iat", "iss", "aud"]},
            )
        except jwt.InvalidAudienceError:
            raise Refused(
                f"the bearer token is for another audience, not {self.audience}"
            ) from None
        except jwt.PyJWTError as exc:
            raise Refused(f"the bearer token does not verify ({type(exc).__name__})") from None
        if self.form == "url" and (
            claims.get("email") != CHAT_ISSUER or claims.get("email_verified") is not True
        ):
            raise Refused(
                f"the ID token is not Google Chat's (its email is not verified as {CHAT_ISSUER})"
            )
        return claims

    async def _key(self, kid: str, session: aiohttp.ClientSession) -> Any | None:
        now = self._clock()
        keys = self._keys
        if keys is not None and now < keys.expires and kid in keys.keys:
            return keys.keys[kid]
        async with self._lock:
            keys = self._keys
            fresh = keys is not None and now < keys.expires
            if fresh and keys is not None and kid in keys.keys:
                return keys.keys[kid]
            recently = keys is not None and now - keys.fetched < KEY_REFETCH_SECONDS
            if not fresh or not recently:
                try:
                    keys = await self._fetch(session)
                except KeysUnavailable:
                    if self._keys is None:
                        raise
                    keys = self._keys  # keep verifying with the keys in hand
            return keys.keys.get(kid) if keys is not None else None

    async def _fetch(self, session: aiohttp.ClientSession) -> _KeySet:
        try:
            status, body, headers = await call(session, "GET", self.certs_url)
        except Exception as exc:
            raise KeysUnavailable(f"cannot fetch Google's keys ({exc})") from None
        if status != 200:
            raise KeysUnavailable(f"Google's keys answered HTTP {status}")
        try:
            keys = parse_keys(json.loads(body))
        except (ValueError, TypeError, jwt.PyJWTError) as exc:
            raise KeysUnavailable(f"Google's keys cannot be read ({exc})") from None
        if not all(isinstance(k, RSAPublicKey) for k in keys.values()):
            keys = {kid: k for kid, k in keys.items() if isinstance(k, RSAPublicKey)}
        now = self._clock()
        self.fetches += 1
        self._keys = _KeySet(keys, now + _max_age(headers), now)
        return self._keys


def _max_age(headers: Mapping[str, str]) -> float:
    found = _MAX_AGE.search(headers.get("Cache-Control", ""))
    return float(found.group(1)) if found else 3600.0
