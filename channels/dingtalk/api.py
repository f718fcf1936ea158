"""DingTalk's HTTP calls the channel makes: the app's access token, the stream
connection's ticket, the robot API's two sends and a message's session webhook; each
failure sorted by whether the request can have gone out.

- No connection was made: `Unreachable`; DingTalk never saw it, so it may go again.
- The request went out and no answer came (a timeout, a cut connection): `NoAnswer`; it
  may have been posted, so it never goes again.
- DingTalk answered with an error: `Refused` (the HTTP status, DingTalk's code), sorted
  by name: `rate_limited`, `token_refused`, `server_side`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

#: The robot API's markdown message template.
MARKDOWN_KEY = "sampleMarkdown"
#: Session webhook answers that mean "too many messages" (a robot may post about 20 a
#: minute to one conversation).
WEBHOOK_RATE_CODES = frozenset({130101, 410100})
#: Robot API codes of a refused token (expired, revoked) and of a rate limit.
TOKEN_CODES = frozenset(
    {"InvalidAuthentication", "Forbidden.AccessDenied.AccessTokenPermissionDenied"}
)
RATE_CODE_PREFIXES = ("Throttling", "Forbidden.AccessDenied.QpsLimit")
#: Renew the token this long before DingTalk says it expires.
TOKEN_MARGIN = 300.0


class Unreachable(Exception):
    """No connection to DingTalk was made: the request certainly did not go out."""


class NoAnswer(Exception):
    """The request went out and no answer came: it may have been carried out."""


@dataclass
class Refused(Exception):
    """DingTalk answered with an error: an HTTP status, its code and its words."""

    status: int
    code: str
    message: str
    retry_after: float | None = None

    def __str__(self) -> str:
        return f"HTTP {self.status} {self.code}: {self.message[:200]}".replace("\n", " ")

    @property
    def rate_limited(self) -> bool:
        if self.status == 429 or self.code.startswith(RATE_CODE_PREFIXES):
            return True
        return self.code.isdigit() and int(self.code) in WEBHOOK_RATE_CODES

    @property
    def token_refused(self) -> bool:
        return self.status == 401 or self.code in TOKEN_CODES

    @property
    def server_side(self) -> bool:
        return self.status >= 500


class DingTalkApi:
    """The calls, over one aiohttp session; the token cached until shortly before it
    expires."""

    def __init__(
        self, base_url: str, client_id: str, client_secret: str, session: aiohttp.ClientSession
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.client_id = client_id
        self._secret = client_secret
        self.session = session
        self._token = ""
        self._token_until = 0.0

    async def _request(
        self, url: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> Any:
        try:
            async with self.session.post(url, json=dict(body), headers=dict(headers or {})) as r:
                text = await r.text()
                status = r.status
                retry_after = r.headers.get("Retry-After")
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise NoAnswer(f"{type(exc).__name__}: {exc}") from None
        try:
            answer = json.loads(text) if text else {}
        except ValueError:
            answer = {}
        if status >= 400:
            code = str(answer.get("code") or answer.get("errcode") or status)
            message = str(answer.get("message") or answer.get("errmsg") or text)
            wait = float(retry_after) if retry_after and retry_after.isdigit() else None
            raise Refused(status, code, message, wait)
        return answer

    # -- the app's token ---------------------------------------------------------------

    async def token(self) -> str:
        """The app's access token (`POST /v1.0/oauth2/accessToken`), cached."""
        if self._token and time.monotonic() < self._token_until:
            return self._token
        answer = await self._request(
            f"{self.base_url}/v1.0/oauth2/accessToken",
            {"appKey": self.client_id, "appSecret": self._secret},
        )
        token = answer.get("accessToken") if isinstance(answer, Mapping) else None
        if not isinstance(token, str) or not token:
            raise Refused(200, "NoAccessToken", "DingTalk answered no accessToken")
        expire = float(answer.get("expireIn") or 7200)
        self._token = token
        self._token_until = time.monotonic() + max(expire - TOKEN_MARGIN, expire / 2)
        return token

    def forget_token(self) -> None:
        """Drop the cached token (DingTalk refused it): the next call gets a new one."""
        self._token = ""
        self._token_until = 0.0

    # -- the stream connection ---------------------------------------------------------

    async def open_connection(self, topics: list[str]) -> tuple[str, str]:
        """A stream connection's endpoint and single-use ticket
        (`POST /v1.0/gateway/connections/open`)."""
        answer = await self._request(
            f"{self.base_url}/v1.0/gateway/connections/open",
            {
                "clientId": self.client_id,
                "clientSecret": self._secret,
                "subscriptions": [{"type": "CALLBACK", "topic": t} for t in topics],
                "ua": "chat-gateway/dingtalk",
                "localIp": "",
            },
        )
        endpoint = answer.get("endpoint") if isinstance(answer, Mapping) else None
        ticket = answer.get("ticket") if isinstance(answer, Mapping) else None
        if not isinstance(endpoint, str) or not isinstance(ticket, str):
            raise Refused(200, "NoEndpoint", "DingTalk answered no endpoint and ticket")
        return endpoint, ticket

    # -- sends -------------------------------------------------------------------------

    async def webhook_send(self, url: str, body: Mapping[str, Any]) -> None:
        """Post through a message's session webhook; DingTalk answers `errcode` 0 or an
        error (HTTP 200 either way)."""
        answer = await self._request(url, body)
        code = answer.get("errcode", 0) if isinstance(answer, Mapping) else 0
        if code not in (0, "0"):
            raise Refused(200, str(code), str(answer.get("errmsg") or ""))

    async def robot_send(
        self, robot_code: str, markdown: Mapping[str, str], *, group: str = "", user: str = ""
    ) -> Mapping[str, Any]:
        """Post as the robot: to a group (`POST /v1.0/robot/groupMessages/send`) or to one
        person (`POST /v1.0/robot/oToMessages/batchSend`)."""
        token = await self.token()
        headers = {"x-acs-dingtalk-access-token": token}
        body: dict[str, Any] = {
            "robotCode": robot_code,
            "msgKey": MARKDOWN_KEY,
            "msgParam": json.dumps(dict(markdown), ensure_ascii=False),
        }
        if group:
            body["openConversationId"] = group
            path = "/v1.0/robot/groupMessages/send"
        else:
            body["userIds"] = [user]
            path = "/v1.0/robot/oToMessages/batchSend"
        answer = await self._request(f"{self.base_url}{path}", body, headers)
        if not group and isinstance(answer, Mapping):
            if user in (answer.get("flowControlledStaffIdList") or ()):
                raise Refused(
                    200, "Throttling.FlowControlled", "the person's messages are flow-controlled"
                )
            if user in (answer.get("invalidStaffIdList") or ()):
                raise Refused(400, "InvalidStaffId", f"{user} is no userId the robot can reach")
        return answer if isinstance(answer, Mapping) else {}
