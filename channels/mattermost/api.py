"""Mattermost's REST API v4 and WebSocket, over the gateway's own aiohttp: the few calls
the channel makes, and what a failure means for sending again.

Every request carries the bot's access token (`Authorization: Bearer`). A failure is one
of three exceptions, which the channel's retry policy tells apart:
- `Unreachable`: the request never reached the server (no connection could be opened):
  repeating it is always safe;
- `NoAnswer`: it was sent, and no answer came (a timeout, a connection dropped): the
  server may have acted on it;
- `MattermostError`: the server answered with an error (`status`, Mattermost's error
  `id` and `message`; a 429's `retry_after`).
The token never reaches an error or a log line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

API = "/api/v4"


class Unreachable(Exception):
    """No connection to the server could be opened: the request certainly did not go out."""


class NoAnswer(Exception):
    """The request went out and no answer came back: it may have taken effect."""


class MattermostError(Exception):
    """An error answer: its HTTP status, Mattermost's error id and message."""

    def __init__(
        self, status: int, error_id: str, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{status} {error_id}: {message}" if error_id else f"{status}: {message}")
        self.status = status
        self.error_id = error_id
        self.message = message
        self.retry_after = retry_after


def retry_after(headers: Mapping[str, str]) -> float:
    """Seconds a 429 says to wait: `Retry-After`, else `X-Ratelimit-Reset` (seconds to
    the reset; an epoch second when large), else one second."""
    for name in ("Retry-After", "X-Ratelimit-Reset"):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if value > 1e9:  # an epoch second
            import time

            value -= time.time()
        return max(0.05, min(value, 3600.0))
    return 1.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the server is: `url` as people open it; the REST API and the WebSocket."""

    url: str

    @property
    def api(self) -> str:
        return self.url.rstrip("/") + API

    @property
    def websocket(self) -> str:
        base = self.api
        if base.startswith("https://"):
            base = "wss://" + base[len("https://") :]
        elif base.startswith("http://"):
            base = "ws://" + base[len("http://") :]
        return base + "/websocket"


class MattermostApi:
    """The REST calls the channel makes, on one aiohttp session."""

    def __init__(self, endpoints: Endpoints, token: str, session: aiohttp.ClientSession) -> None:
        self.endpoints = endpoints
        self._token = token
        self.session = session

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        json_body: Any = None,
        form: aiohttp.FormData | None = None,
        raw: bool = False,
    ) -> Any:
        """One request; its JSON answer (its bytes with `raw`). Raises Unreachable,
        NoAnswer or MattermostError (see the module docstring)."""
        url = self.endpoints.api + path
        try:
            async with self.session.request(
                method, url, params=params, json=json_body, data=form, headers=self.auth
            ) as response:
                body = await response.read()
                status = response.status
                headers = response.headers
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(f"cannot connect to {self.endpoints.url} ({exc.os_error})") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise NoAnswer(f"{method} {path}: {type(exc).__name__}") from None
        if status >= 400:
            error_id, message = "", body.decode("utf-8", "replace").strip()[:300]
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            if isinstance(data, dict):
                error_id = str(data.get("id") or "")
                message = str(data.get("message") or message)
            wait = retry_after(headers) if status == 429 else None
            raise MattermostError(status, error_id, message, retry_after=wait)
        if raw:
            return body
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            raise MattermostError(
                status, "", f"{method} {path}: an answer that is not JSON"
            ) from None

    # -- the calls ---------------------------------------------------------------------

    async def me(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/users/me"))

    async def user(self, user_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/users/{user_id}"))

    async def teams(self, user_id: str) -> list[dict[str, Any]]:
        return list(await self.request("GET", f"/users/{user_id}/teams"))

    async def team_channels(self, user_id: str, team_id: str) -> list[dict[str, Any]]:
        """The bot's channels of a team, its direct and group messages included."""
        return list(await self.request("GET", f"/users/{user_id}/teams/{team_id}/channels"))

    async def channel(self, channel_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/channels/{channel_id}"))

    async def post(self, post_id: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/posts/{post_id}"))

    async def channel_posts(
        self, channel_id: str, *, page: int = 0, per_page: int = 200, after: str | None = None
    ) -> list[dict[str, Any]]:
        """A page of a channel's posts, oldest first: after a post (`after`), or the
        newest ones (`page` 0 the newest `per_page`, 1 the ones before them, ...)."""
        params: dict[str, str | int] = {"page": page, "per_page": per_page}
        if after:
            params["after"] = after
        listing = await self.request("GET", f"/channels/{channel_id}/posts", params=params)
        posts = listing.get("posts") or {}
        order = [pid for pid in listing.get("order") or () if pid in posts]
        return [posts[pid] for pid in reversed(order)]  # `order` is newest first

    async def create_post(
        self,
        channel_id: str,
        message: str,
        *,
        root_id: str = "",
        pending_post_id: str = "",
        file_ids: list[str] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"channel_id": channel_id, "message": message}
        if root_id:
            body["root_id"] = root_id
        if pending_post_id:
            body["pending_post_id"] = pending_post_id
        if file_ids:
            body["file_ids"] = file_ids
        return dict(await self.request("POST", "/posts", json_body=body))

    async def patch_post(self, post_id: str, message: str) -> dict[str, Any]:
        return dict(
            await self.request("PUT", f"/posts/{post_id}/patch", json_body={"message": message})
        )

    async def typing(self, user_id: str, channel_id: str, parent_id: str = "") -> None:
        body = {"channel_id": channel_id, "parent_id": parent_id}
        await self.request("POST", f"/users/{user_id}/typing", json_body=body)

    async def upload(self, channel_id: str, name: str, data: bytes, mime_type: str) -> str:
        """Upload a file for a post in `channel_id`; its file id."""
        form = aiohttp.FormData()
        form.add_field("channel_id", channel_id)
        form.add_field("files", data, filename=name, content_type=mime_type)
        answer = await self.request("POST", "/files", form=form)
        infos = answer.get("file_infos") or []
        if not infos:
            raise MattermostError(500, "", "the upload answered no file")
        return str(infos[0]["id"])

    def file_url(self, file_id: str) -> str:
        return f"{self.endpoints.api}/files/{file_id}"

    async def client_config(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/config/client", params={"format": "old"}))
