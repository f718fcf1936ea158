"""The LINE Messaging API over aiohttp: one session, the bearer token, and every failure
named by what it means for a reply (`LineError.kind`). No channel logic here.

What the kinds rest on (Messaging API reference, "Status codes", "Error responses";
"Retry failed API requests"; "Handle HTTP status code 429 errors"):

- LINE processes no request it answers 429: whatever the cause (a rate limit, the
  monthly message limit), the message did not go out;
- a 4xx other than 409 and 429 is a request LINE refused (a used or expired reply token,
  an unknown recipient): it did not go out, and sending it as it is cannot help;
- a 5xx or no answer (a timeout, a dropped connection) may have gone out;
- a push carrying `X-Line-Retry-Key` is executed once per key: the same request again
  is answered 409 once the first was accepted, so a push may be repeated after any
  failure, and its 409 means it went out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

#: What a failed request means: "rate_limited" (429, not processed: wait and repeat),
#: "quota" (429 "You have reached your monthly limit.": not processed), "refused" (a
#: 4xx: not processed, repeating cannot help), "not_sent" (no connection was made),
#: "maybe_sent" (a 5xx, a timeout after the request went out).
Kind = Literal["rate_limited", "quota", "refused", "not_sent", "maybe_sent"]

#: The 400 message of a reply token that was used or has expired.
INVALID_REPLY_TOKEN = "Invalid reply token"
#: The 429 message when the month's messages are used up.
MONTHLY_LIMIT = "You have reached your monthly limit."
RETRY_KEY_HEADER = "X-Line-Retry-Key"


class LineError(Exception):
    """An error answer of the Messaging API, or a request that got none. Its text never
    holds the token."""

    def __init__(self, message: str, *, status: int = 0, kind: Kind, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.kind: Kind = kind
        #: LINE's own `message` of the error, e.g. "Invalid reply token".
        self.detail = detail

    @property
    def invalid_reply_token(self) -> bool:
        return self.status == 400 and self.detail.lower().startswith(INVALID_REPLY_TOKEN.lower())

    @classmethod
    def from_answer(cls, status: int, body: Any) -> LineError:
        detail, details = "", []
        if isinstance(body, Mapping):
            detail = str(body.get("message") or "")
            details = [
                str(d.get("message") or "")
                for d in body.get("details") or ()
                if isinstance(d, Mapping) and d.get("message")
            ]
        detail_text = f"{detail}: {'; '.join(details)}" if details else detail
        kind: Kind
        if status == 429:
            kind = "quota" if detail.strip() == MONTHLY_LIMIT else "rate_limited"
        elif 400 <= status < 500:
            kind = "refused"
        else:
            kind = "maybe_sent"
        text = f"HTTP {status}" + (f" {detail_text}" if detail_text else "")
        return cls(text, status=status, kind=kind, detail=detail)


@dataclass(frozen=True, slots=True)
class Answer:
    """A successful answer: its status (200, 202, or 409 for a push whose retry key was
    accepted before), its JSON body, and the request id LINE gave it."""

    status: int
    body: dict[str, Any]
    request_id: str = ""

    @property
    def sent_ids(self) -> list[str]:
        """The ids of the messages a reply or push sent (`sentMessages`)."""
        sent = self.body.get("sentMessages")
        if not isinstance(sent, list):
            return []
        return [str(m.get("id")) for m in sent if isinstance(m, Mapping) and m.get("id")]


class LineApi:
    """The Messaging API (`api_url`) and its content API (`data_url`) over one session."""

    def __init__(self, api_url: str, data_url: str, token: str, timeout: float = 20.0) -> None:
        self.root = api_url.rstrip("/")
        self.data_root = data_url.rstrip("/")
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        retry_key: str | None = None,
    ) -> Answer:
        """One request to the Messaging API; its answer, or LineError (see `Kind`)."""
        headers = dict(self.auth)
        if retry_key is not None:
            headers[RETRY_KEY_HEADER] = retry_key
        url = f"{self.root}/{path.lstrip('/')}"
        try:
            async with self._http().request(
                method, url, json=json_body, headers=headers
            ) as response:
                try:
                    body = await response.json(content_type=None)
                except ValueError:
                    body = None
                request_id = response.headers.get("x-line-request-id", "")
                accepted = retry_key is not None and response.status == 409
                if response.status not in (200, 202) and not accepted:
                    raise LineError.from_answer(response.status, body)
                if accepted:
                    request_id = response.headers.get("x-line-accepted-request-id", request_id)
                data = body if isinstance(body, dict) else {}
                return Answer(response.status, data, request_id)
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing sent
            raise LineError(f"cannot connect ({exc.os_error})", kind="not_sent") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            text = f"{type(exc).__name__} {exc}".strip()
            raise LineError(text, kind="maybe_sent") from None

    async def content(self, message_id: str, *, max_bytes: int) -> tuple[bytes, str]:
        """The bytes and content type of a file a person sent (`GET
        /v2/bot/message/{id}/content` on the content API), at most `max_bytes`; raises
        LineError, or ValueError past `max_bytes`."""
        url = f"{self.data_root}/v2/bot/message/{message_id}/content"
        try:
            async with self._http().get(url, headers=self.auth) as response:
                if response.status != 200:
                    try:
                        body = await response.json(content_type=None)
                    except ValueError:
                        body = None
                    raise LineError.from_answer(response.status, body)
                if response.content_length is not None and response.content_length > max_bytes:
                    raise ValueError(f"{response.content_length} bytes")
                data = bytearray()
                async for chunk in response.content.iter_chunked(65536):
                    data += chunk
                    if len(data) > max_bytes:
                        raise ValueError(f"more than {max_bytes} bytes")
                return bytes(data), response.headers.get("Content-Type", "")
        except aiohttp.ClientConnectorError as exc:
            raise LineError(f"cannot connect ({exc.os_error})", kind="not_sent") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LineError(f"{type(exc).__name__} {exc}".strip(), kind="maybe_sent") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
