"""Both directions of the Bot Framework's service authentication, over aiohttp and PyJWT.

Inbound ("Authenticate requests from the Bot Connector service to your bot", Bot Framework
REST API docs): every activity comes with `Authorization: Bearer <JWT>`, signed (RS256) by
a key listed at the `jwks_uri` of the Bot Framework's OpenID metadata. `verify_activity`
accepts it only when all of these hold, in this order:

1. the header is `Bearer <token>` and the token is a JWT whose `kid` names a listed key;
2. its signature verifies with that key, by an algorithm the metadata allows (RS256);
3. `iss` is the metadata's issuer (`https://api.botframework.com`), `aud` the bot's App ID,
   and it is within `exp`/`nbf`, with five minutes of clock skew;
4. the key's `endorsements` hold the activity's `channelId` (`msteams`);
5. its `serviceurl` claim is the activity's `serviceUrl`.

1-3 failing is a 401 (who sent it is unknown); 4-5 a 403 (a real token, used for another
channel or another service URL). The keys are cached for a day and read again when a
token names a key not seen yet, at most once per `REFETCH_PAUSE` (so forged tokens with
made-up key ids cannot make the gateway hammer the metadata).

Outbound ("Authenticate requests from your bot to the Bot Connector service"): the bot's
access token comes from the client-credentials flow (`BotToken`), cached until five
minutes before it expires. Errors never carry the secret or a token.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import jwt
from loguru import logger

#: How long the signing keys are trusted without reading them again (seconds).
KEYS_TTL = 24 * 3600.0
#: The least time between two reads of the keys caused by unknown key ids.
REFETCH_PAUSE = 300.0
#: Clock skew allowed on `exp` and `nbf` (the docs' "industry-standard" five minutes).
LEEWAY = 300.0
#: The algorithms the gateway verifies at all, whatever the metadata lists.
SUPPORTED_ALGORITHMS = frozenset({"RS256"})
#: A token is asked for again this long before it expires.
TOKEN_MARGIN = 300.0


class AuthError(Exception):
    """An activity refused: `status` is the HTTP answer (401 or 403)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class KeysUnavailable(Exception):
    """The OpenID metadata or its keys could not be read (the answer is a 503: the
    activity may well be genuine, and Teams may send it again)."""


class TokenError(Exception):
    """No access token. `final` when the sign-in service refused the credentials (a
    wrong App ID or secret: retrying will not help), else it could not be reached."""

    def __init__(self, message: str, *, final: bool) -> None:
        super().__init__(message)
        self.final = final


@dataclass(frozen=True, slots=True)
class SigningKey:
    kid: str
    key: Any
    endorsements: frozenset[str]


def _secret_free(text: str, *secrets: str) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


class ConnectorKeys:
    """The Bot Connector's signing keys and issuer, read from its OpenID metadata."""

    def __init__(
        self,
        metadata_url: str,
        http: Callable[[], aiohttp.ClientSession],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metadata_url = metadata_url
        self._http = http
        self._clock = clock
        self._keys: dict[str, SigningKey] = {}
        self.issuer = ""
        self.algorithms: tuple[str, ...] = ("RS256",)
        self._fetched_at: float | None = None
        self._lock = anyio.Lock()

    @property
    def loaded(self) -> bool:
        return self._fetched_at is not None

    def count(self, endorsed_for: str | None = None) -> int:
        """How many keys are known (endorsed for a channel id, when given)."""
        return sum(
            1
            for key in self._keys.values()
            if endorsed_for is None or endorsed_for in key.endorsements
        )

    async def refresh(self) -> None:
        """Read the metadata and its `jwks_uri`; KeysUnavailable when either fails."""
        async with self._lock:
            await self._fetch()

    async def _fetch(self) -> None:
        try:
            metadata = await self._get_json(self.metadata_url)
            jwks_uri = metadata.get("jwks_uri")
            issuer = metadata.get("issuer")
            if not isinstance(jwks_uri, str) or not isinstance(issuer, str) or not issuer:
                raise KeysUnavailable(
                    f"the OpenID metadata at {self.metadata_url} has no jwks_uri or issuer"
                )
            document = await self._get_json(jwks_uri)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KeysUnavailable(
                f"cannot read the Bot Framework's signing keys from {self.metadata_url} "
                f"({type(exc).__name__}: {exc})"
            ) from None
        keys: dict[str, SigningKey] = {}
        for item in document.get("keys") or ():
            if not isinstance(item, dict) or not isinstance(item.get("kid"), str):
                continue
            try:
                parsed = jwt.PyJWK(item)
            except jwt.PyJWTError as exc:
                logger.debug("teams: signing key {} skipped: {}", item.get("kid"), exc)
                continue
            endorsements = item.get("endorsements") or ()
            keys[item["kid"]] = SigningKey(
                item["kid"],
                parsed.key,
                frozenset(str(e) for e in endorsements if isinstance(e, str)),
            )
        allowed = metadata.get("id_token_signing_alg_values_supported")
        algorithms = tuple(
            a
            for a in (allowed if isinstance(allowed, list) else ["RS256"])
            if a in SUPPORTED_ALGORITHMS
        )
        self._keys = keys
        self.issuer = issuer
        self.algorithms = algorithms or ("RS256",)
        self._fetched_at = self._clock()
        logger.debug("teams: {} signing keys from {}", len(keys), jwks_uri)

    async def _get_json(self, url: str) -> dict[str, Any]:
        async with self._http().get(url) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status} from {url}")
            body = json.loads(await response.read())
        if not isinstance(body, dict):
            raise ValueError(f"{url} did not answer a JSON object")
        return body

    async def key(self, kid: str) -> SigningKey | None:
        """The key `kid`: from the cache while it is fresh, else after reading the keys
        again (at most once per `REFETCH_PAUSE` for a key still unknown)."""
        now = self._clock()
        stale = self._fetched_at is None or now - self._fetched_at > KEYS_TTL
        found = self._keys.get(kid)
        if found is not None and not stale:
            return found
        async with self._lock:
            fetched = self._fetched_at
            age = math.inf if fetched is None else self._clock() - fetched
            if age > KEYS_TTL or (kid not in self._keys and age > REFETCH_PAUSE):
                await self._fetch()
        return self._keys.get(kid)


def _normal_url(url: str) -> str:
    return url.strip().rstrip("/").lower()


async def verify_activity(
    authorization: str,
    activity: Mapping[str, Any],
    keys: ConnectorKeys,
    app_id: str,
) -> dict[str, Any]:
    """The verified claims of an activity's token (see the module docstring for the
    checks); AuthError (401/403) when it must be refused, KeysUnavailable (503) when the
    keys cannot be read."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise AuthError(401, "no Bearer token in the Authorization header")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise AuthError(401, "the Authorization token is not a JWT") from None
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid:
        raise AuthError(401, "the token names no signing key (kid)")
    key = await keys.key(kid)
    if key is None:
        raise AuthError(401, "the token is signed by a key the Bot Framework does not list")
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key.key,
            algorithms=list(keys.algorithms),
            audience=app_id,
            issuer=keys.issuer,
            leeway=LEEWAY,
            options={"require": ["exp", "iss", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise AuthError(401, "the token has expired") from None
    except jwt.ImmatureSignatureError:
        raise AuthError(401, "the token is not valid yet (nbf)") from None
    except jwt.InvalidAudienceError:
        raise AuthError(401, "the token is for another App ID (aud)") from None
    except jwt.InvalidIssuerError:
        raise AuthError(401, "the token has another issuer than the Bot Framework") from None
    except jwt.PyJWTError as exc:
        raise AuthError(401, f"the token does not verify ({type(exc).__name__})") from None
    channel_id = str(activity.get("channelId") or "")
    if channel_id not in key.endorsements:
        raise AuthError(403, f"the signing key is not endorsed for channel {channel_id!r}")
    service_url = activity.get("serviceUrl")
    claimed = claims.get("serviceurl") or claims.get("serviceUrl")
    if (
        not isinstance(service_url, str)
        or not isinstance(claimed, str)
        or _normal_url(service_url) != _normal_url(claimed)
    ):
        raise AuthError(403, "the activity's serviceUrl is not the one the token names")
    return claims


class BotToken:
    """The bot's access token to the Bot Connector: the client-credentials flow, cached
    until `TOKEN_MARGIN` before it expires; one request at a time."""

    def __init__(
        self,
        token_url: str,
        app_id: str,
        password: str,
        scope: str,
        http: Callable[[], aiohttp.ClientSession],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.token_url = token_url
        self._app_id = app_id
        self._password = password
        self._scope = scope
        self._http = http
        self._clock = clock
        self._token = ""
        self._valid_until = 0.0
        self._lock = anyio.Lock()

    def forget(self) -> None:
        """Drop the cached token (the connector refused it)."""
        self._token, self._valid_until = "", 0.0

    async def get(self) -> str:
        if self._token and self._clock() < self._valid_until:
            return self._token
        async with self._lock:
            if self._token and self._clock() < self._valid_until:
                return self._token
            token, lifetime = await self._request()
            self._token = token
            self._valid_until = self._clock() + max(60.0, lifetime - TOKEN_MARGIN)
            return token

    async def _request(self) -> tuple[str, float]:
        form = {
            "grant_type": "client_credentials",
            "client_id": self._app_id,
            "client_secret": self._password,
            "scope": self._scope,
        }
        try:
            async with self._http().post(self.token_url, data=form) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TokenError(
                f"cannot reach the sign-in service at {self.token_url} ({type(exc).__name__})",
                final=False,
            ) from None
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if status == 200 and isinstance(body.get("access_token"), str):
            expires = body.get("expires_in")
            lifetime = float(expires) if isinstance(expires, int | float | str) else 3600.0
            return str(body["access_token"]), lifetime
        error = str(body.get("error") or f"HTTP {status}")
        detail = _secret_free(
            str(body.get("error_description") or "").split("\r\n")[0], self._password
        )
        text = f"the sign-in service refused the bot's credentials: {error}"
        if detail:
            text += f" ({detail})"
        # 4xx: the App ID, the secret or the tenant is wrong (invalid_client,
        # unauthorized_client, invalid_request); 5xx and 429: try again later.
        final = 400 <= status < 500 and status != 429
        raise TokenError(text, final=final)
