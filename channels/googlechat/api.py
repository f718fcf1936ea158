"""The Chat API (https://chat.googleapis.com/v1) over the gateway's own aiohttp: the few
calls the channel makes, and what a failure means for sending again.

Every request carries the service account's access token (`Authorization: Bearer`, from
`channels.googlechat.auth.AccessTokens`). A failure is one of three exceptions:
- `Unreachable`: no connection could be opened: the request certainly did not go out;
- `NoAnswer`: it went out and no answer came (a timeout, a dropped connection): Google
  may have acted on it;
- `ChatApiError`: Google answered with an error (`status`, its canonical code such as
  `NOT_FOUND` or `RESOURCE_EXHAUSTED`, and its message).
A token never reaches an error or a log line.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

#: How a created message joins a thread: the one named, or a new one if it is gone.
REPLY_OR_NEW_THREAD = "REPLY_MESSAGE_FALLBACK_TO_NEW_THREAD"
#: Chat's own markup (`*bold*`, `_italic_`, `<url|text>`), named on every message so that
#: the app's console default (Markdown for apps made since 2025) does not change it.
CHAT_MARKUP = "MARKUP_SYNTAX_CHAT"


class Unreachable(Exception):
    """No connection could be opened: the request certainly did not go out."""


class NoAnswer(Exception):
    """The request went out and no answer came back: it may have taken effect."""


class ChatApiError(Exception):
    """An error answer: the HTTP status, Google's canonical code and its message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}" if code else f"{status}: {message}")
        self.status = status
        self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        """Google may take the same request later: a server error or a quota."""
        return self.status >= 500 or self.status == 429


def error_from(status: int, body: bytes) -> ChatApiError:
    """The `ChatApiError` of an error answer (`{"error": {code, message, status}}`, or an
    OAuth error `{"error": "invalid_grant", "error_description": ...}`)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(body)
    except ValueError:
        return ChatApiError(status, "", text[:300] or "no message")
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return ChatApiError(status, str(error.get("status") or ""), str(error.get("message") or ""))
    if isinstance(error, str):
        return ChatApiError(status, error, str(data.get("error_description") or error))
    return ChatApiError(status, "", text[:300])


async def call(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, str] | None = None,
    json_body: Any = None,
    form: Mapping[str, str] | None = None,
) -> tuple[int, bytes, Mapping[str, str]]:
    """One request; (status, body, headers). Raises Unreachable or NoAnswer."""
    try:
        async with session.request(
            method, url, headers=headers, params=params, json=json_body, data=form
        ) as response:
            return response.status, await response.read(), response.headers
    except aiohttp.ClientConnectorError as exc:
        raise Unreachable(f"cannot connect to {_host(url)} ({exc.os_error})") from None
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise NoAnswer(f"{method} {_host(url)}: {type(exc).__name__}") from None


def _host(url: str) -> str:
    return url.split("/", 3)[2] if "://" in url else url


@dataclass(frozen=True, slots=True)
class Space:
    """What the app knows of a space (from `GET /v1/spaces`)."""

    name: str
    kind: str
    display_name: str


TokenSource = Callable[[], Awaitable[str]]


class ChatApi:
    """The Chat API calls the channel makes, on one aiohttp session, as the app (the
    service account's token, from `token`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: TokenSource,
        on_unauthorized: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        self.root = base_url.rstrip("/") + "/v1"
        self._token = token
        self._on_unauthorized = on_unauthorized

    async def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self._token()}"}

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        raw: bool = False,
    ) -> Any:
        """One request with the app's token; its JSON answer (bytes with `raw`). A 401
        (an access token Google no longer takes) gets one more try with a new token."""
        for attempt in (1, 2):
            status, body, _ = await call(
                self.session,
                method,
                self.root + path,
                headers=await self.headers(),
                params=params,
                json_body=json_body,
            )
            if status == 401 and attempt == 1 and self._on_unauthorized is not None:
                self._on_unauthorized()
                continue
            if status >= 400:
                raise error_from(status, body)
            if raw:
                return body
            if not body:
                return {}
            try:
                return json.loads(body)
            except ValueError:
                raise ChatApiError(
                    status, "", f"{method} {path}: an answer that is not JSON"
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the calls ---------------------------------------------------------------------

    async def create_message(
        self,
        space: str,
        text: str,
        *,
        thread: str | None = None,
        message_id: str | None = None,
    ) -> dict[str, Any]:
        """`spaces.messages.create` in `spaces/<space>`: in thread `thread` (a thread's
        resource name; a new thread if Google no longer has it), else at the top level;
        `message_id` (`client-...`) makes a repeat fail with 409 ALREADY_EXISTS instead
        of posting twice."""
        body: dict[str, Any] = {"text": text, "markupSyntax": CHAT_MARKUP}
        params: dict[str, str] = {}
        if thread:
            body["thread"] = {"name": thread}
            params["messageReplyOption"] = REPLY_OR_NEW_THREAD
        if message_id:
            params["messageId"] = message_id
        answer = await self.request(
            "POST", f"/spaces/{quote(space, safe='')}/messages", params=params, json_body=body
        )
        return dict(answer)

    async def patch_message(self, name: str, text: str) -> dict[str, Any]:
        """`spaces.messages.patch` of the app's own message `name` (its text only)."""
        answer = await self.request(
            "PATCH",
            f"/{name}",
            params={"updateMask": "text"},
            json_body={"text": text, "markupSyntax": CHAT_MARKUP},
        )
        return dict(answer)

    async def get_message(self, name: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/{name}"))

    async def spaces(self, page_size: int = 100) -> list[Space]:
        """The spaces the app is a member of (the first page)."""
        answer = await self.request("GET", "/spaces", params={"pageSize": str(page_size)})
        found = []
        for item in answer.get("spaces") or ():
            if isinstance(item, dict) and item.get("name"):
                found.append(
                    Space(
                        str(item["name"]),
                        str(item.get("spaceType") or item.get("type") or ""),
                        str(item.get("displayName") or ""),
                    )
                )
        return found

    def media_url(self, resource_name: str) -> str:
        """Where an attachment's bytes are (`media.download`)."""
        return f"{self.root}/media/{quote(resource_name, safe='/')}?alt=media"
