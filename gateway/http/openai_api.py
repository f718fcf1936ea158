"""The OpenAI-compatible API's request and reply shapes, as pure functions.

`POST /v1/chat/completions` takes OpenAI's request body and answers a `chat.completion`
object, or with `"stream": true` server-sent `chat.completion.chunk` events ending with
`data: [DONE]`. `GET /v1/models` lists the model names a request may give. The routes
that use these shapes are in `gateway.http.openai_routes`; docs/openai-api.md is the
user's page.

Invariants (tested in tests/test_openai_api.py):
- The conversation is the gateway's: only the newest user message is the turn. What the
  client sends before it is checked against the session (`history_conflict`), never
  stored in a named session.
- A named session is `api:<client>:<name>` (`gateway.http.namespace.resolve_session`):
  one client's names never reach another client's sessions, nor another channel's.
- The client's tools are refused with a 400 saying so: the agent's tools run on the
  gateway, and a tool call the client would have to answer has nowhere to go.
- Whatever the body holds, parsing ends in a `CompletionRequest` or an `OpenAIError`
  (400) saying what to fix; never in another exception.
- Every error is OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.http.chat_api import MAX_ID_LENGTH

#: The header naming the conversation, besides the body's `user` field.
SESSION_HEADER = "X-Session"
#: The header that makes a retried request the same message (answered once).
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: Roles a client's message may have; "developer" is the newer name of "system".
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_TOOL_FIELDS = ("tools", "functions")


class OpenAIError(Exception):
    """A request the API refuses, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """One earlier message of the client's list (its text only)."""

    role: Literal["user", "assistant"]
    text: str


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """What the gateway takes from a `/v1/chat/completions` body."""

    model: str
    #: The newest user message: the turn.
    text: str
    #: The user and assistant messages before it, in order (system messages dropped).
    earlier: tuple[ClientMessage, ...]
    #: The conversation's name (`user` or `X-Session`); None: a stateless call.
    session_name: str | None
    stream: bool = False
    include_usage: bool = False


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    400,
                    f"{where}: only text content is supported here, not {kind!r}; send "
                    "files through a chat platform",
                    param=where,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(400, f"{where}: a text part needs a string text", param=where)
            texts.append(text)
        return "\n".join(texts)
    raise OpenAIError(400, f"{where}: must be a string or a list of parts", param=where)


def _has_surrogates(text: str) -> bool:
    return any("\ud800" <= char <= "\udfff" for char in text)


def parse_completion_request(body: bytes, session_header: str | None) -> CompletionRequest:
    """A request body (and the `X-Session` header) to a CompletionRequest, or
    OpenAIError(400) saying what is wrong."""
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):
        raise OpenAIError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, 'the body must be a JSON object with "model" and "messages"')
    for field in _TOOL_FIELDS:
        if data.get(field):
            raise OpenAIError(
                400,
                f"{field}: the gateway's agent runs its own tools on the gateway; tools "
                "the client would answer are not supported. Send the request without "
                f"{field!r}",
                param=field,
                code="tools_not_supported",
            )
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise OpenAIError(400, "model: required, a string (see GET /v1/models)", param="model")
    n = data.get("n")
    if n not in (None, 1):
        raise OpenAIError(400, "n: the gateway answers one choice; send n = 1", param="n")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError(400, "stream: must be true or false", param="stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise OpenAIError(
                400,
                "stream_options: only allowed when stream is true",
                param="stream_options",
            )
        if not isinstance(options, dict):
            raise OpenAIError(400, "stream_options: must be an object", param="stream_options")
        include_usage = bool(options.get("include_usage"))
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages: required, a non-empty list", param="messages")
    parsed: list[ClientMessage] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise OpenAIError(400, f"{where}: must be an object", param=where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls"):
            raise OpenAIError(
                400,
                f"{where}: tool calls and results are the gateway's own; send the "
                "conversation's user and assistant messages only",
                param=where,
                code="tools_not_supported",
            )
        if role not in _ROLES:
            raise OpenAIError(400, f"{where}.role: {role!r} is not a role", param=where)
        text = _text_of(message.get("content"), f"{where}.content")
        if _has_surrogates(text):
            raise OpenAIError(400, f"{where}.content: holds an unpaired surrogate", param=where)
        if role == "user" or role == "assistant":
            parsed.append(ClientMessage(role=role, text=text))
    if not parsed or parsed[-1].role != "user" or messages[-1].get("role") != "user":
        raise OpenAIError(
            400,
            "messages: the last message must be the user's (the turn to answer)",
            param="messages",
        )
    text = parsed[-1].text
    if not text.strip():
        raise OpenAIError(400, "messages: the last user message is empty", param="messages")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError(400, "user: must be a string", param="user")
    header = session_header.strip() if session_header is not None else None
    if header and user and header != user:
        raise OpenAIError(
            400,
            f"the {SESSION_HEADER} header and the user field name different sessions; "
            "send one of them",
            param="user",
        )
    name = header or user or None
    return CompletionRequest(
        model=model,
        text=text,
        earlier=tuple(parsed[:-1]),
        session_name=name,
        stream=stream,
        include_usage=include_usage,
    )


def idempotency_id(key: str | None) -> str | None:
    """The message id an `Idempotency-Key` header gives the turn (None without one)."""
    if key is None:
        return None
    key = key.strip()
    if not 0 < len(key) <= MAX_ID_LENGTH - 4 or not key.isprintable():
        raise OpenAIError(
            400,
            f"{IDEMPOTENCY_HEADER}: must be 1 to {MAX_ID_LENGTH - 4} printable characters",
            param=IDEMPOTENCY_HEADER,
        )
    return f"oai:{key}"


def _is_command(text: str) -> bool:
    return text.lstrip().startswith("/")


def history_conflict(earlier: Sequence[ClientMessage], stored: Sequence[str]) -> str | None:
    """Why the client's earlier messages disagree with the session, or None when they
    agree. `stored` is the session's user messages, oldest first.

    They agree when the client's earlier user messages are the session's last ones, in
    order: all of them (a client that resends the whole conversation), fewer (a client
    that keeps a shorter window, or sends only the newest message), or none. Assistant
    messages are not compared (the gateway's replies are the session's), and neither are
    commands (`/new`, `/help`: the session does not store them).
    """
    said = [m.text.strip() for m in earlier if m.role == "user" and not _is_command(m.text)]
    if not said:
        return None
    held = [text.strip() for text in stored]
    if len(said) > len(held):
        return (
            f"the messages hold {len(said)} earlier user messages but the session has "
            f"{len(held)}; this conversation is not the session's. Send only the newest "
            "message, or name a new session"
        )
    tail = held[len(held) - len(said) :]
    for index, (mine, theirs) in enumerate(zip(said, tail, strict=True)):
        if mine != theirs:
            return (
                f"earlier user message {index + 1} of {len(said)} differs from the "
                "session's; the gateway keeps the conversation and cannot rewrite it. Send "
                "only the newest message, or name a new session to start over"
            )
    return None


def usage_body(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    completion_id: str, created: int, model: str, text: str, usage: dict[str, int]
) -> dict[str, Any]:
    """A `chat.completion` object with one choice."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
        "system_fingerprint": None,
    }


def chunk_body(
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    *,
    finish_reason: str | None = None,
    include_usage: bool = False,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: a delta of the one choice, or (delta None) the
    usage chunk with no choices that `stream_options.include_usage` asks for last."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        body["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
    return body


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


def models_body(names: Sequence[str], created: int) -> dict[str, Any]:
    """`GET /v1/models`: a list of model objects."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "gateway"}
            for name in dict.fromkeys(names)
        ],
    }
