"""The JSON chat API's request and reply shapes, as pure functions.

`POST /api/chat` takes `{"session": "work", "text": "hello"}` and answers
`{"session": "api:work", "reply": "...", "error": false}`.

Invariants (tested in tests/test_http_chat_api.py):
- Every session the API touches is in the `api:` namespace: a bare name `work` means
  `api:work`, and a key of another channel (`telegram:123`) is refused, never served.
- A session name is printable text: no control, format (bidi override), separator or
  surrogate characters, which would forge log lines or break file names; and it is
  short enough for its session's file name (`MAX_NAME_CHARS` letters, digits, `.`, `_`
  or `-`; any other character takes 3 per UTF-8 byte). A name that could not be stored
  is refused here, before a turn runs.
- A request names its session: there is no default conversation that clients sharing a
  token would share by accident.
- Whatever the body holds, parsing ends in a `ChatRequest` or an `ApiError` with a 400
  message saying what to fix; never in another exception.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions.errors import SessionKeyError
from gateway.sessions.keys import MAX_STEM_BYTES, encode_key

API_CHANNEL = "api"
API_SENDER = "api"
# Unicode categories refused in a session name: control, format (e.g. U+202E), surrogate,
# private use, unassigned, line and paragraph separators.
_HOSTILE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
#: The longest name of plain characters whose session key (`api:<name>`) a file name holds.
MAX_NAME_CHARS = MAX_STEM_BYTES - len(encode_key(f"{API_CHANNEL}:"))


class ApiError(Exception):
    """A request the API refuses; `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def api_session_key(raw: str) -> str:
    """`work` -> `api:work`; `api:work` stays; anything hostile raises ApiError(400)."""
    prefix = f"{API_CHANNEL}:"
    if raw.startswith(prefix):
        name = raw[len(prefix) :]
    elif ":" in raw:
        raise ApiError(
            400,
            f"session: the chat API only reaches {API_CHANNEL}: sessions; "
            f"send a bare name or {API_CHANNEL}:<name>",
        )
    else:
        name = raw
    key = f"{API_CHANNEL}:{name}"
    check_session_name(name, key, "session", MAX_NAME_CHARS)
    return key


def check_session_name(name: str, key: str, field: str, limit: int) -> None:
    """ApiError(400) naming `field` unless `name` is printable and `key` (its session
    key) fits a file name; `limit` is the longest plain name, for the message."""
    if not name.strip():
        raise ApiError(400, f"{field}: the name is empty")
    if any(unicodedata.category(char) in _HOSTILE_CATEGORIES for char in name):
        raise ApiError(400, f"{field}: the name holds control or invisible characters")
    try:
        encode_key(key)
    except SessionKeyError:
        raise ApiError(
            400,
            f"{field}: the name is too long to store; the limit is {limit} "
            "letters, digits, '.', '_' or '-' (other characters take up to 12 each)",
        ) from None


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


def parse_chat_request(body: bytes) -> ChatRequest:
    """A request body to a ChatRequest, or ApiError(400) saying what is wrong."""
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
    return ChatRequest(session_key=api_session_key(session), text=text, message_id=message_id)


def reply_body(session_key: str, reply: OutboundMessage | None) -> dict[str, Any]:
    """The JSON answer; `reply` is null when the turn produced no message."""
    return {
        "session": session_key,
        "reply": None if reply is None else reply.text,
        "error": False if reply is None else reply.is_error,
    }
