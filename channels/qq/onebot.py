"""OneBot v11 over a forward WebSocket, on the gateway's own aiohttp: one connection to
the implementation (NapCat, Lagrange.OneBot), its API calls matched to their answers by
`echo`, the events it pushes handed on in the order they came; and the message format
(segments, CQ codes). No channel logic here.

The wire (github.com/botuniverse/onebot-11, communication/ws.md, api/README.md,
message/): the implementation is the WebSocket server. A connection to `/api` carries
API calls only; one to `/` carries the calls and every event (`/event`: events only).
A call is `{"action", "params", "echo"}`; its answer `{"status", "retcode", "data",
"echo"}` with `status` "ok" (retcode 0), "async" (retcode 1) or "failed" (1400 a bad
request, 1404 no such action, anything else the implementation's failure; NapCat says
1200 with its error in `message`/`wording`). The access token goes in the
`Authorization: Bearer` header; NapCat answers a wrong one with a 1403 frame and closes,
Lagrange.OneBot refuses the upgrade with 403.

A failed call is one of three exceptions, which the channel tells apart to decide
whether a reply may be sent again:
- `NotSent`: the request never reached the implementation (no connection): repeating it
  is always safe;
- `NoAnswer`: it went out and no answer came (the connection dropped, the wait ran
  out): the implementation may have carried it out;
- `ActionFailed`: the implementation answered "failed" (its retcode and message).
The access token never reaches an error or a log line.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import anyio

#: Retcodes of OneBot v11 (communication/ws.md): a bad request, a refused token, no such
#: action. Others are the implementation's own failure (NapCat: 1200).
BAD_REQUEST = 1400
UNAUTHORIZED = 1401
FORBIDDEN = 1403
NO_SUCH_ACTION = 1404

Segment = dict[str, Any]


class NotSent(Exception):
    """The request never went out (no connection): it certainly did not take effect."""


class NoAnswer(Exception):
    """The request went out and no answer came back: it may have taken effect."""


class ActionFailed(Exception):
    """The implementation answered `status: failed`: its retcode and what it said."""

    def __init__(self, action: str, retcode: int, message: str) -> None:
        super().__init__(f"{action}: retcode {retcode}" + (f" ({message})" if message else ""))
        self.action = action
        self.retcode = retcode
        self.message = message


class TokenRefused(Exception):
    """The implementation refused the access token (a 1403 frame, or a 401/403 upgrade)."""


def endpoint(url: str, path: str) -> str:
    """The WebSocket address of `path` (`/`, `/api`) under the configured `url`: a path in
    `url` is kept as a prefix (a reverse proxy's), a query is dropped."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"{url!r} is no WebSocket address (ws:// or wss://)")
    base = parts.path.rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, base + path, "", ""))


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass
class _Pending:
    done: anyio.Event
    answer: dict[str, Any] | None = None
    lost: str = ""


class OneBotSocket:
    """One open WebSocket to the implementation. `serve` reads it until it closes,
    answering `call`s by their echo and handing every event to `on_event`, in order;
    `call` sends an action and waits for its answer."""

    _numbers = itertools.count(1)

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        *,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        name: str = "qq",
    ) -> None:
        self.ws = ws
        self.on_event = on_event
        self.name = name
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._refused = False

    @property
    def closed(self) -> bool:
        return self._closed or self.ws.closed

    async def serve(self) -> None:
        """Read frames until the connection closes. Raises TokenRefused when the
        implementation said the token is wrong; every call still waiting then fails with
        NoAnswer."""
        try:
            while True:
                frame = await self.ws.receive()
                if frame.type in (
                    aiohttp.WSMsgType.CLOSE,
                    aiohttp.WSMsgType.CLOSING,
                    aiohttp.WSMsgType.CLOSED,
                    aiohttp.WSMsgType.ERROR,
                ):
                    break
                if frame.type is not aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    item = json.loads(frame.data)
                except ValueError:
                    continue
                if isinstance(item, dict):
                    self._take(item)
        finally:
            self._closed = True
            for pending in self._pending.values():
                pending.lost = "the connection closed before the answer came"
                pending.done.set()
        if self._refused:
            raise TokenRefused("the OneBot implementation refused the access token")

    def _take(self, item: dict[str, Any]) -> None:
        if "post_type" in item:
            if self.on_event is not None:
                self.on_event(item)
            return
        echo = item.get("echo")
        pending = self._pending.get(str(echo)) if echo is not None else None
        if pending is not None:
            pending.answer = item
            pending.done.set()
        elif item.get("status") == "failed" and item.get("retcode") in (UNAUTHORIZED, FORBIDDEN):
            self._refused = True  # NapCat's answer to a wrong token, before it closes

    async def call(
        self, action: str, params: Mapping[str, Any] | None = None, *, wait: float = 30.0
    ) -> Any:
        """Carry out `action` and return its `data`. Raises NotSent, NoAnswer or
        ActionFailed (see the module docstring)."""
        if self.closed:
            raise NotSent(f"{action}: not connected to the OneBot implementation")
        echo = f"{self.name}-{next(self._numbers)}"
        pending = _Pending(anyio.Event())
        self._pending[echo] = pending
        try:
            request = {"action": action, "params": dict(params or {}), "echo": echo}
            try:
                await self.ws.send_str(json.dumps(request, ensure_ascii=False))
            except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
                # aiohttp raises before writing anything to a closing connection.
                raise NotSent(
                    f"{action}: the connection is closed ({type(exc).__name__})"
                ) from None
            with anyio.move_on_after(wait if wait > 0 else math.inf):
                await pending.done.wait()
            answer = pending.answer
            if answer is None and self._refused:
                raise TokenRefused("the OneBot implementation refused the access token")
            if answer is None:
                why = pending.lost or f"no answer within {wait:g}s"
                raise NoAnswer(f"{action}: {why}")
        finally:
            self._pending.pop(echo, None)
        status = answer.get("status")
        if status == "failed" or (status not in ("ok", "async") and answer.get("retcode") != 0):
            retcode = answer.get("retcode")
            message = str(answer.get("message") or answer.get("wording") or answer.get("msg") or "")
            raise ActionFailed(action, int(retcode) if isinstance(retcode, int) else -1, message)
        return answer.get("data")

    async def close(self) -> None:
        self._closed = True
        await self.ws.close()


async def open_socket(
    session: aiohttp.ClientSession,
    url: str,
    token: str | None,
    *,
    heartbeat: float | None = 30.0,
) -> aiohttp.ClientWebSocketResponse:
    """Open a WebSocket to `url` with the access token. Raises TokenRefused for a refused
    upgrade (401, 403), NotSent when no connection could be made."""
    try:
        return await session.ws_connect(
            url,
            headers=auth_headers(token),
            heartbeat=heartbeat,
            max_msg_size=64 * 1024 * 1024,
            timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
        )
    except aiohttp.WSServerHandshakeError as exc:
        if exc.status in (401, 403):
            raise TokenRefused(
                f"the OneBot implementation refused the access token (HTTP {exc.status})"
            ) from None
        raise NotSent(f"the WebSocket upgrade at {url} failed (HTTP {exc.status})") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise NotSent(f"cannot connect to {url} ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------- messages

_CQ = re.compile(r"\[CQ:([A-Za-z0-9_.\-]+)((?:,[^\]]*)?)\]")


def unescape(text: str) -> str:
    """CQ-code text as it reads (message/string.md, 转义)."""
    return (
        text.replace("&#91;", "[").replace("&#93;", "]").replace("&#44;", ",").replace("&amp;", "&")
    )


def parse_cq(message: str) -> list[Segment]:
    """A message in the string format (CQ codes) as segments (message/string.md): the
    text between codes is `text`, each code its type with its parameters."""
    segments: list[Segment] = []
    position = 0
    for code in _CQ.finditer(message):
        if code.start() > position:
            segments.append(
                {"type": "text", "data": {"text": unescape(message[position : code.start()])}}
            )
        data: dict[str, str] = {}
        for pair in code.group(2).split(",")[1:]:
            key, _, value = pair.partition("=")
            data[key] = unescape(value)
        segments.append({"type": code.group(1), "data": data})
        position = code.end()
    if position < len(message):
        segments.append({"type": "text", "data": {"text": unescape(message[position:])}})
    return segments


def segments_of(message: Any) -> list[Segment]:
    """A `message` field (array, one segment object, or a CQ-code string) as segments;
    anything unreadable is dropped."""
    if isinstance(message, str):
        return parse_cq(message)
    if isinstance(message, Mapping):
        message = [message]
    if not isinstance(message, list):
        return []
    found = []
    for item in message:
        if isinstance(item, Mapping) and isinstance(item.get("type"), str):
            data = item.get("data")
            found.append(
                {"type": item["type"], "data": dict(data) if isinstance(data, Mapping) else {}}
            )
    return found


def iter_type(segments: list[Segment], kind: str) -> Iterator[dict[str, Any]]:
    """The data of each segment of type `kind`."""
    for segment in segments:
        if segment["type"] == kind:
            yield segment["data"]


def text(value: str) -> Segment:
    """A text segment: in the array format its text is the text, never parsed for codes
    (message/array.md), so nothing the model writes becomes an `at` or an image."""
    return {"type": "text", "data": {"text": value}}


def at(qq: str) -> Segment:
    """An @-mention of one person (never `all`: the channel mentions no one else)."""
    if not qq.isdigit():
        raise ValueError(f"an at segment names a QQ number, not {qq!r}")
    return {"type": "at", "data": {"qq": qq}}


def reply(message_id: str) -> Segment:
    """A quote of the message `message_id`."""
    return {"type": "reply", "data": {"id": message_id}}


def image(data: bytes) -> Segment:
    """An image sent by its bytes (`base64://`, message/segment.md)."""
    import base64

    return {"type": "image", "data": {"file": "base64://" + base64.b64encode(data).decode()}}


def file(name: str, data: bytes) -> Segment:
    """A file sent by its bytes (NapCat's and Lagrange's `file` segment; no part of
    OneBot v11 itself)."""
    import base64

    return {
        "type": "file",
        "data": {"file": "base64://" + base64.b64encode(data).decode(), "name": name},
    }
