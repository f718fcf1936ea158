"""The JSON chat API's request and reply shapes, as pure functions.

`POST /api/chat` takes `{"session": "work", "text": "hello"}` and answers
`{"session": "api:work", "reply": "...", "error": false}`.

Invariants (tested in tests/test_http_auth.py and tests/test_http_namespace.py):
- The session is the caller's, by `gateway.http.namespace.resolve_session`: a bare name
  `work` means `api:work`; a key of another channel (`telegram:123`) is refused with
  400, and a name in another API client's namespace (`api:ide:...`) with 403, never
  served.
- A session name is printable text: no control, format (bidi override), separator or
  surrogate characters, which would forge log lines or break file names; and it is
  short enough for its session's file name (`MAX_NAME_CHARS` letters, digits, `.`, `_`
  or `-`; any other character takes 3 per UTF-8 byte). A name that could not be stored
  is refused here, before a turn runs.
- A request names its session: there is no default conversation that clients sharing a
  token would share by accident.
- Whatever the body holds, parsing ends in a `ChatRequest` or an `ApiError` (400, or
  403 for another client's session) saying what to fix; never in another exception.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.http.namespace import (
    API_CHANNEL,
    Caller,
    SessionRefused,
    max_name_chars,
    resolve_session,
)
from gateway.messages import InboundMessage, OutboundMessage

API_SENDER = "api"
#: The longest name of plain characters whose session key (`api:<name>`) a file name holds.
MAX_NAME_CHARS = max_name_chars(f"{API_CHANNEL}:")


class ApiError(Exception):
    """A request the API refuses; `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _has_surrogates(text: str) -> bool:
    # json.loads turns an escaped lone surrogate ("\ud800") into one; it cannot be stored.
    return any("\ud800" <= char <= "\udfff" for char in text)


#: The longest client message id accepted (`"id"` in a request).
MAX_ID_LENGTH = 200


@dataclass(frozen=True, slots=True)
class ChatRequest:
    session_key: str
    text: str
    #: The client's id for this message (``"id"``): a retry with the same id is the same
    #: message, answered once (the retry gets the first one's reply where it can).
    message_id: str | None = None

    def inbound(self) -> InboundMessage:
        """The message the core receives: channel `api`, chat id = the session name."""
        _, _, name = self.session_key.partition(":")
        return InboundMessage(
            channel=API_CHANNEL,
            chat_id=name,
            text=self.text,
            sender_id=API_SENDER,
            message_id=self.message_id,
        )


def parse_chat_request(body: bytes, caller: Caller) -> ChatRequest:
    """A request body to a ChatRequest of `caller`'s session, or ApiError saying what is
    wrong (400; 403 for a session name in another client's namespace)."""
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):  # bad JSON or UTF-8; absurd nesting
        raise ApiError(400, 'body is not valid JSON; send {"session": ..., "text": ...}') from None
    if not isinstance(data, dict):
        raise ApiError(400, 'body must be a JSON object with "session" and "text"')
    session = data.get("session")
    text = data.get("text")
    if text is None:
        raise ApiError(400, "text: required")
    if not isinstance(text, str):
        raise ApiError(400, "text: must be a string")
    if not text.strip():
        raise ApiError(400, "text: is empty")
    if _has_surrogates(text):
        raise ApiError(400, "text: holds an unpaired surrogate; send valid Unicode")
    if session is None:
        # Required: two clients sharing a token would otherwise share one conversation.
        raise ApiError(400, 'session: required; name the conversation, e.g. "session": "work"')
    if not isinstance(session, str):
        raise ApiError(400, "session: must be a string")
    message_id = data.get("id")
    if message_id is not None and (
        not isinstance(message_id, str)
        or not 0 < len(message_id) <= MAX_ID_LENGTH
        or _has_surrogates(message_id)
    ):
        raise ApiError(400, f"id: must be a string of 1 to {MAX_ID_LENGTH} characters")
    try:
        key = resolve_session(caller, session)
    except SessionRefused as exc:
        raise ApiError(exc.status, exc.message) from None
    return ChatRequest(session_key=key, text=text, message_id=message_id)


def reply_body(session_key: str, reply: OutboundMessage | None) -> dict[str, Any]:
    """The JSON answer; `reply` is null when the turn produced no message."""
    return {
        "session": session_key,
        "reply": None if reply is None else reply.text,
        "error": False if reply is None else reply.is_error,
    }
