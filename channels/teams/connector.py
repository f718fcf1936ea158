"""The Bot Connector's REST API (Bot Framework REST API reference, "Conversations"), the few
calls the channel makes, over aiohttp with the bot's access token:

- `POST {serviceUrl}/v3/conversations/{conversationId}/activities/{activityId}`: reply to
  an activity (in a channel thread the conversation id carries `;messageid=`);
- `POST {serviceUrl}/v3/conversations/{conversationId}/activities`: send to a
  conversation (a message that answers nothing, a typing indicator);
- `PUT {serviceUrl}/v3/conversations/{conversationId}/activities/{activityId}`: update a
  message the bot sent (streaming).

Every failure is classified by whether the request certainly did not take effect, after
Teams' own guidance ("Status codes from bot conversational APIs"): 412, 429 (with its
Retry-After), 502, 503 and 504 are to be retried, as is a connection that never opened;
a 500 and every other 4xx are not; a request that got no answer may have been carried
out. A 401 means the connector refused the token: it is asked for anew, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import quote

import aiohttp

from channels.teams.auth import BotToken

Kind = Literal["retry", "final", "maybe"]

#: Statuses Teams says to retry, with backoff (429 after its Retry-After).
RETRY_STATUSES = frozenset({412, 429, 502, 503, 504})


class ConnectorError(Exception):
    """A request the connector did not carry out, or that got no answer. `kind`:
    "retry" (certainly not done, may work later), "final" (refused: never will), "maybe"
    (no answer: it may have been done)."""

    def __init__(
        self,
        message: str,
        *,
        kind: Kind,
        status: int = 0,
        code: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: Kind = kind
        self.status = status
        self.code = code
        self.retry_after = retry_after


def activities_url(service_url: str, conversation_id: str, activity_id: str | None = None) -> str:
    """Where activities of a conversation go (the ids percent-encoded whole: a channel
    thread's `;messageid=` included)."""
    url = f"{service_url.rstrip('/')}/v3/conversations/{quote(conversation_id, safe='')}/activities"
    if activity_id:
        url += f"/{quote(activity_id, safe='')}"
    return url


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class Connector:
    """The Bot Connector, as the bot calls it."""

    def __init__(self, token: BotToken, http: Callable[[], aiohttp.ClientSession]) -> None:
        self.token = token
        self._http = http

    async def send(
        self,
        service_url: str,
        conversation_id: str,
        activity: dict[str, Any],
        *,
        reply_to: str | None = None,
    ) -> str:
        """Post an activity (as a reply to `reply_to` when given); the id Teams gave it
        ("" when it gave none)."""
        url = activities_url(service_url, conversation_id, reply_to)
        answer = await self.request("POST", url, activity)
        return str(answer.get("id") or "")

    async def update(
        self, service_url: str, conversation_id: str, activity_id: str, activity: dict[str, Any]
    ) -> None:
        await self.request(
            "PUT", activities_url(service_url, conversation_id, activity_id), activity
        )

    async def request(self, method: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call with the bot's token (asked for anew once when the connector refuses
        it); the JSON answer, or ConnectorError."""
        for attempt in (1, 2):
            token = await self.token.get()
            try:
                async with self._http().request(
                    method, url, json=body, headers={"Authorization": f"Bearer {token}"}
                ) as response:
                    raw = await response.read()
                    status = response.status
                    retry_after = _retry_after(response.headers.get("Retry-After"))
            except aiohttp.ClientConnectorError as exc:  # never connected: nothing sent
                raise ConnectorError(f"cannot connect ({exc.os_error})", kind="retry") from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ConnectorError(
                    f"no answer ({type(exc).__name__} {exc})".strip(), kind="maybe"
                ) from None
            try:
                answer = json.loads(raw) if raw else {}
            except ValueError:
                answer = {}
            if not isinstance(answer, dict):
                answer = {}
            if 200 <= status < 300:
                return answer
            if status == 401 and attempt == 1:
                self.token.forget()
                continue
            found = answer.get("error")
            error: dict[str, Any] = found if isinstance(found, dict) else {}
            code = str(error.get("code") or "")
            text = str(error.get("message") or "")
            message = (
                f"HTTP {status}" + (f" {code}" if code else "") + (f": {text}" if text else "")
            )
            kind: Kind = "retry" if status in RETRY_STATUSES else "final"
            raise ConnectorError(
                message, kind=kind, status=status, code=code, retry_after=retry_after
            )
        raise AssertionError("unreachable")  # pragma: no cover
