"""WeCom's server API over aiohttp: the access token (`gettoken`, kept until it expires)
and `message/send`, every failure named by what it means for a reply (`WeComError.kind`).
No channel logic here.

What the kinds rest on (WeCom's developer documentation, "获取access_token", "发送应用消息",
"全局错误码"):

- Every answer is HTTP 200 with `errcode` and `errmsg`; `errcode` 0 is success.
- An access token lasts `expires_in` seconds (7200) and is shared by every caller of the
  app: a token that expired (42001) or is no longer valid (40014, another caller fetched
  a new one; 40082) is fetched again and the request repeated once.
- 45009 (a frequency limit: per app, and 30 messages a minute to one member) and 45033
  (too many concurrent calls) and -1 (system busy) are requests WeCom did not carry out:
  they may be repeated after a wait.
- Any other errcode is a refusal: 81013 (the user is outside the app's visible range),
  60020 (the gateway's address is not in the app's trusted IPs), 40001 / 40013 (a wrong
  secret or corp id), ...: nothing went out, and repeating cannot help.
- A 5xx or no answer (a timeout, a dropped connection) may have gone out; a connection
  never made did not.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal

import aiohttp

#: "rate_limited" (45009, 45033, -1: not carried out, wait and repeat), "refused" (any
#: other errcode: not carried out, repeating cannot help), "not_sent" (no connection),
#: "maybe_sent" (a 5xx, a timeout after the request went out).
Kind = Literal["rate_limited", "refused", "not_sent", "maybe_sent"]

TOKEN_EXPIRED = 42001
TOKEN_INVALID = 40014
TOKEN_ERRORS = frozenset({TOKEN_EXPIRED, TOKEN_INVALID, 40082})
FREQUENCY_LIMIT = 45009
CONCURRENCY_LIMIT = 45033
SYSTEM_BUSY = -1
RATE_ERRORS = frozenset({FREQUENCY_LIMIT, CONCURRENCY_LIMIT, SYSTEM_BUSY})
NOT_VISIBLE = 81013
IP_NOT_TRUSTED = 60020
#: Fetch a new token this long before the one held expires.
TOKEN_MARGIN = 300.0


class WeComError(Exception):
    """An error answer of WeCom's API, or a request that got none. Its text never holds
    the secret or the token."""

    def __init__(self, message: str, *, kind: Kind, errcode: int = 0, errmsg: str = "") -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.errcode = errcode
        self.errmsg = errmsg

    @classmethod
    def from_answer(cls, body: Mapping[str, Any]) -> WeComError:
        errcode = _int(body.get("errcode"))
        errmsg = str(body.get("errmsg") or "")
        kind: Kind = "rate_limited" if errcode in RATE_ERRORS else "refused"
        # errmsg carries a hint URL after a comma; the code and first words are enough.
        words = errmsg.split(",")[0].strip()[:200]
        return cls(f"errcode {errcode} {words}".strip(), kind=kind, errcode=errcode, errmsg=errmsg)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class WeComApi:
    """One self-built app's calls (`corp_id`, `secret`) against `api_url`, over one
    session, with its access token kept until it expires."""

    def __init__(self, api_url: str, corp_id: str, secret: str, timeout: float = 20.0) -> None:
        self.root = api_url.rstrip("/")
        self._corp_id = corp_id
        self._secret = secret
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._token = ""
        self._token_until = 0.0
        self.token_fetches = 0

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _request(
        self, method: str, path: str, params: dict[str, str], body: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        url = f"{self.root}/cgi-bin/{path}"
        try:
            async with self._http().request(method, url, params=params, json=body) as response:
                try:
                    data = await response.json(content_type=None)
                except ValueError:
                    data = None
                if response.status != 200 or not isinstance(data, dict):
                    raise WeComError(f"HTTP {response.status}", kind="maybe_sent")
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing sent
            raise WeComError(f"cannot connect ({exc.os_error})", kind="not_sent") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WeComError(f"{type(exc).__name__} {exc}".strip(), kind="maybe_sent") from None
        if _int(data.get("errcode")) != 0:
            raise WeComError.from_answer(data)
        return data

    async def token(self, *, fresh: bool = False) -> str:
        """The app's access token: the one held while it lasts, else a new one."""
        if fresh or not self._token or time.monotonic() >= self._token_until:
            params = {"corpid": self._corp_id, "corpsecret": self._secret}
            data = await self._request("GET", "gettoken", params, None)
            self.token_fetches += 1
            self._token = str(data.get("access_token") or "")
            lasts = float(data.get("expires_in") or 7200)
            self._token_until = time.monotonic() + max(lasts - TOKEN_MARGIN, lasts / 2)
        return self._token

    async def call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """One call with the access token; an expired or replaced token is fetched again
        and the call repeated once (WeCom did not carry out a call it refused so)."""
        token = await self.token()
        try:
            return await self._request(method, path, {"access_token": token}, body)
        except WeComError as exc:
            if exc.errcode not in TOKEN_ERRORS:
                raise
        token = await self.token(fresh=True)
        return await self._request(method, path, {"access_token": token}, body)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
