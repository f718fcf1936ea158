"""Feishu's open platform API (the `open-apis` root of open.feishu.cn or open.larksuite.com),
over the gateway's own aiohttp: the few calls the channel makes, and what a failure means
for sending again.

Every call but the token's carries the app's `tenant_access_token` (`Authorization:
Bearer t-...`), fetched with the App ID and App Secret (`auth/v3/tenant_access_token/
internal`) and fetched again 30 minutes before its `expire` (2 hours), or at once when
Feishu says it is invalid (99991661, 99991663, 99991664, 99991665). A failure is one of:
- `Unreachable`: no connection could be opened: the request certainly did not go out;
- `NoAnswer`: it was sent and no answer came (a timeout, a dropped connection);
- `FeishuError`: Feishu answered with an error: the HTTP status, Feishu's `code` and
  `msg`, and for a rate limit (HTTP 429, 99991400, 230020) the seconds to wait.
The App Secret and the token never reach an error or a log line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import anyio

OPEN_APIS = "/open-apis"
#: The long connection's endpoint discovery (Feishu's SDKs call it before they connect).
WS_ENDPOINT = "/callback/ws/endpoint"

#: Feishu's codes, by name (open.feishu.cn, "Server error codes" and the IM API's pages).
TOKEN_INVALID = frozenset({99991661, 99991663, 99991664, 99991665})
RATE_LIMITED = frozenset({99991400, 230020})
INVALID_CONTENT = 230001
CONTENT_TOO_LONG = frozenset({230025, 230021, 230022})
#: The message to reply to or edit is gone (recalled, deleted) or cannot be edited.
MESSAGE_GONE = frozenset({230011, 231003})
BOT_NOT_IN_CHAT = frozenset({230002, 232009})
#: Refresh the token this long before Feishu's `expire` (Feishu hands out a new one then).
TOKEN_MARGIN = 30 * 60.0


class Unreachable(Exception):
    """No connection to Feishu could be opened: the request certainly did not go out."""


class NoAnswer(Exception):
    """The request went out and no answer came back: it may have taken effect."""


class FeishuError(Exception):
    """An error answer: the HTTP status, Feishu's `code` and `msg`."""

    def __init__(
        self, status: int, code: int, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(f"HTTP {status}, code {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @property
    def rate_limited(self) -> bool:
        return self.status == 429 or self.code in RATE_LIMITED

    @property
    def server_side(self) -> bool:
        """Feishu failed (a 5xx) without acting on the request."""
        return self.status >= 500


def certainly_not_sent(exc: Exception) -> bool:
    """Whether a failed request certainly did not take effect, so that sending it again
    later may succeed: no connection, a rate limit, a 5xx."""
    if isinstance(exc, Unreachable):
        return True
    return isinstance(exc, FeishuError) and (exc.rate_limited or exc.server_side)


def _wait_of(headers: Mapping[str, str]) -> float:
    """Seconds a rate limit says to wait: `x-ogw-ratelimit-reset`, else `Retry-After`,
    else one second."""
    for name in ("x-ogw-ratelimit-reset", "Retry-After"):
        raw = headers.get(name)
        if raw is not None:
            try:
                return max(0.05, min(float(raw), 3600.0))
            except ValueError:
                continue
    return 1.0


class FeishuApi:
    """The calls the channel makes, on one aiohttp session, with the app's token."""

    def __init__(
        self, base_url: str, app_id: str, app_secret: str, session: aiohttp.ClientSession
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.app_id = app_id
        self._secret = app_secret
        self.session = session
        self._token = ""
        self._token_until = 0.0
        self._token_lock = anyio.Lock()

    # -- plumbing ------------------------------------------------------------------------

    async def _raw(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        form: aiohttp.FormData | None = None,
        token: str | None = None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with self.session.request(
                method,
                self.base_url + path,
                params=params,
                json=json_body,
                data=form,
                headers=headers,
            ) as response:
                return response.status, response.headers, await response.read()
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(f"cannot connect to {self.base_url} ({exc.os_error})") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise NoAnswer(f"{method} {path}: {type(exc).__name__}") from None

    @staticmethod
    def _answer(status: int, headers: Mapping[str, str], body: bytes) -> dict[str, Any]:
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise FeishuError(status, -1, body.decode("utf-8", "replace").strip()[:200])
        code = data.get("code", 0 if status < 400 else -1)
        code = int(code) if isinstance(code, int | str) and str(code).lstrip("-").isdigit() else -1
        if status >= 400 or code != 0:
            error = FeishuError(status, code, str(data.get("msg") or "")[:300])
            if error.rate_limited:
                error.retry_after = _wait_of(headers)
            raise error
        return data

    async def token(self, *, fresh: bool = False) -> str:
        """The tenant_access_token, fetched when there is none, it is due, or `fresh`."""
        async with self._token_lock:
            if fresh or not self._token or time.monotonic() >= self._token_until:
                status, headers, body = await self._raw(
                    "POST",
                    f"{OPEN_APIS}/auth/v3/tenant_access_token/internal",
                    json_body={"app_id": self.app_id, "app_secret": self._secret},
                )
                data = self._answer(status, headers, body)
                self._token = str(data.get("tenant_access_token") or "")
                expire = float(data.get("expire") or 7200)
                self._token_until = time.monotonic() + max(60.0, expire - TOKEN_MARGIN)
            return self._token

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        form: Any = None,
    ) -> dict[str, Any]:
        """One API call with the token (fetched again once when Feishu calls it invalid);
        its answer's `data`. `form` is a zero-argument callable making the FormData (a
        body that can be sent twice)."""
        for attempt in range(2):
            token = await self.token(fresh=attempt > 0)
            status, headers, body = await self._raw(
                method,
                OPEN_APIS + path,
                params=params,
                json_body=json_body,
                form=form() if form is not None else None,
                token=token,
            )
            try:
                data = self._answer(status, headers, body)
            except FeishuError as exc:
                if exc.code in TOKEN_INVALID and attempt == 0:
                    continue
                raise
            found = data.get("data")
            return dict(found) if isinstance(found, Mapping) else {}
        raise AssertionError("unreachable")

    async def download(self, path: str, params: Mapping[str, str], limit: int) -> bytes:
        """A resource's bytes, at most `limit` (a ValueError past it)."""
        token = await self.token()
        try:
            async with self.session.get(
                self.base_url + OPEN_APIS + path,
                params=params,
                headers={"Authorization": f"Bearer {token}"},
            ) as response:
                if response.status != 200:
                    self._answer(response.status, response.headers, await response.read())
                    raise FeishuError(response.status, -1, "no file")
                chunks, size = [], 0
                async for chunk in response.content.iter_chunked(65536):
                    size += len(chunk)
                    if size > limit:
                        raise ValueError(f"the file is larger than {limit} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(f"cannot connect to {self.base_url} ({exc.os_error})") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise NoAnswer(f"GET {path}: {type(exc).__name__}") from None

    # -- the calls -----------------------------------------------------------------------

    async def bot_info(self) -> dict[str, Any]:
        """The bot's identity: `open_id`, `app_name`, `activate_status`."""
        token = await self.token()
        status, headers, body = await self._raw("GET", f"{OPEN_APIS}/bot/v3/info", token=token)
        data = self._answer(status, headers, body)
        bot = data.get("bot")
        return dict(bot) if isinstance(bot, Mapping) else {}

    async def ws_endpoint(self) -> tuple[str, dict[str, Any]]:
        """The long connection's URL and its client config (ping and reconnect seconds)."""
        status, headers, body = await self._raw(
            "POST",
            WS_ENDPOINT,
            json_body={"AppID": self.app_id, "AppSecret": self._secret},
        )
        data = self._answer(status, headers, body).get("data") or {}
        url = str(data.get("URL") or "")
        if not url:
            raise FeishuError(status, -1, "the endpoint answer holds no URL")
        config = data.get("ClientConfig")
        return url, dict(config) if isinstance(config, Mapping) else {}

    async def create_message(
        self, chat_id: str, msg_type: str, content: str, uuid: str
    ) -> dict[str, Any]:
        """Send a message to a chat; `uuid` makes a repeat within an hour a no-op."""
        body = {"receive_id": chat_id, "msg_type": msg_type, "content": content, "uuid": uuid}
        return await self.call(
            "POST", "/im/v1/messages", params={"receive_id_type": "chat_id"}, json_body=body
        )

    async def reply_message(
        self, message_id: str, msg_type: str, content: str, uuid: str, *, in_thread: bool
    ) -> dict[str, Any]:
        """Reply to a message (quoting it; in its thread with `in_thread`)."""
        body = {
            "msg_type": msg_type,
            "content": content,
            "uuid": uuid,
            "reply_in_thread": in_thread,
        }
        return await self.call("POST", f"/im/v1/messages/{message_id}/reply", json_body=body)

    async def edit_message(self, message_id: str, msg_type: str, content: str) -> dict[str, Any]:
        """Replace a text or post message's content (20 edits per message at most)."""
        body = {"msg_type": msg_type, "content": content}
        return await self.call("PUT", f"/im/v1/messages/{message_id}", json_body=body)

    async def upload_image(self, name: str, data: bytes, mime_type: str) -> str:
        def form() -> aiohttp.FormData:
            built = aiohttp.FormData()
            built.add_field("image_type", "message")
            built.add_field("image", data, filename=name, content_type=mime_type)
            return built

        answer = await self.call("POST", "/im/v1/images", form=form)
        return str(answer.get("image_key") or "")

    async def upload_file(self, name: str, data: bytes, file_type: str) -> str:
        def form() -> aiohttp.FormData:
            built = aiohttp.FormData()
            built.add_field("file_type", file_type)
            built.add_field("file_name", name)
            built.add_field("file", data, filename=name)
            return built

        answer = await self.call("POST", "/im/v1/files", form=form)
        return str(answer.get("file_key") or "")

    async def user_name(self, open_id: str) -> str:
        """A person's name (needs the contact:user.base:readonly scope)."""
        answer = await self.call(
            "GET", f"/contact/v3/users/{open_id}", params={"user_id_type": "open_id"}
        )
        user = answer.get("user")
        return str(user.get("name") or "") if isinstance(user, Mapping) else ""
