"""A fake OpenAI-compatible HTTP server that speaks the real wire format, for tests.

The real `openai` client (and anything else that speaks HTTP) talks to it unchanged:
it is an aiohttp server on 127.0.0.1 with a random free port.

Endpoints: ``POST /v1/chat/completions`` (JSON ``chat.completion`` objects, or SSE
``chat.completion.chunk`` events with incremental tool-call deltas, a usage chunk when
``stream_options.include_usage`` is set, and ``data: [DONE]``), ``GET /v1/models`` and
``GET /v1/models/{id}``, and ``POST /v1/audio/transcriptions`` (multipart: ``file``,
``model``; answers ``{"text": ...}``). Errors use OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` shape. Requests are checked like the real API does (a bearer key when
``api_key`` is set; well-formed messages, every assistant tool call answered by a tool
message, string tool arguments, valid ``name`` fields) so provider bugs show up as 400s.

Run it in the current event loop::

    async with FakeOpenAI() as fake:
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key=fake.api_key)
        fake.add_reply("Hello!")
        fake.add_tool_call("get_weather", {"city": "Paris"})
        fake.add_error(429, retry_after=0.05)
        ...
        assert fake.last_request.messages[-1]["content"] == "hi"

or in a background thread, from sync tests or while a subprocess talks to it (every
scripting method and the request log are thread-safe)::

    with FakeOpenAI.in_thread() as fake:
        env = {"OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": fake.api_key}
        subprocess.run([...], env=env)
        fake.wait_for_requests(1)

``hold(matches)`` keeps the next matching chat request unanswered until ``release()``
(a model busy with it, while a test freezes the gateway that asked); ``held`` and
``wait_held`` show it arrived.

Scripted replies are queued and consumed in order, one per chat request (a reply added
with ``model=...`` is only consumed by a request for that model). ``fail_model`` makes
every request for one model fail, without consuming the queue. With nothing queued, the
reply comes from ``fake.responder(request_json)``, by default ``echo: <last user text>``.
Token usage is estimated as ceil(characters / 4) of each message's and the reply's text,
plus 3 tokens of framing per prompt message and 3 to start the reply, as real servers count.

Images: a user message's content may be a list of parts, ``{"type": "text", "text"}``
and ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, as in
the real API. A data URL that is not base64 of a PNG, JPEG, GIF or WebP image is the
real 400 ("You uploaded an unsupported image..."), and so is any image part sent to a
model in ``text_only_models`` ("Invalid content type. image_url is only supported by
certain models."). The echo reply names each image it got: ``[image 640x480 jpeg]``.

Transcriptions: files with an extension the real API refuses get its 400 ("Invalid file
format. Supported formats: [...]"); otherwise the text is the next one queued with
``add_transcription``, or else the bytes after a ``SPEECH:`` marker in the file (a test
makes "audio" that says what it wants), or else "". Each request is recorded with
``body = {"model": ..., "file": {"filename", "content_type", "size"}, ...}``. The answer
carries ``usage`` as the real API's does: ``{"type": "duration", "seconds": ...}`` for
models billed by the minute (whisper-1), ``{"type": "tokens", "input_tokens", ...}`` for
``gpt-*`` models (10 audio tokens a second, ceil(characters / 4) for the text). The
duration is the one given to ``add_transcription``, else the text spoken at 2.5 words a
second (at least 1 s). ``transcription_usage = False`` leaves ``usage`` out, as many
local Whisper servers do.

Flavours: ``FakeOpenAI(flavor=...)`` answers where it matters as each local server does
(read in their sources; ``tests/test_fake_openai.py`` holds the fake to it), with
``context_window`` the server's size in tokens (counted as the usage estimate counts,
tools included). Where each says its window; what a prompt over it gets; what an
unknown path (a base URL without /v1) gets:

- ``openai`` (the default): nowhere; 400 ``context_length_exceeded`` "This model's
  maximum context length is N tokens. However, your messages resulted in P tokens...";
  404 JSON "Invalid URL (POST /chat/completions)" with a null code.
- ``llama.cpp`` (llama-server): ``GET /props`` ``default_generation_settings.n_ctx``;
  at prompt >= n_ctx 400 ``exceed_context_size_error`` "request (P tokens) exceeds the
  available context size (N tokens), try increasing it" with ``n_prompt_tokens`` and
  ``n_ctx``; it serves ``/chat/completions`` and ``/models`` without /v1 too.
- ``llama-cpp-python``: nowhere; at prompt >= n_ctx 400 ``context_length_exceeded``
  "This model's maximum context length is N tokens. However, you requested M tokens
  (P in the messages, C in the completion)..."; 404 ``{"detail": "Not Found"}``.
- ``ollama``: ``GET /api/ps`` ``context_length`` once the model is loaded (by its first
  chat request), ``POST /api/show`` ``num_ctx`` in ``parameters`` only with
  ``ollama_modelfile_num_ctx`` (a Modelfile that sets it) and always
  ``model_info["llama.context_length"]`` (``trained_context``); a prompt over it is cut
  silently, the oldest messages after the system ones first (each cut in
  ``truncations``); 404 text ``404 page not found``.
- ``vllm``: ``GET /v1/models`` ``max_model_len``; 400 ``BadRequestError`` "This model's
  maximum context length is N tokens. However, your request has P input tokens..." (or
  "'max_tokens' or 'max_completion_tokens' is too large: ..." when P + max_tokens > N);
  404 ``{"detail": "Not Found"}``.

A model that does not exist is a 404 that names it (OpenAI, vLLM, Ollama: ``fail_model``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from PIL import Image, UnidentifiedImageError

from tests.fakes._serving import LocalServer, at_least

DEFAULT_API_KEY = "sk-fake-test-key"

Flavor = Literal["openai", "llama.cpp", "llama-cpp-python", "ollama", "vllm"]
#: Each flavour's window when none is given: llama-server's -c default, llama-cpp-python's
#: and older Ollama's n_ctx default, a typical vLLM max_model_len; OpenAI's: no limit.
DEFAULT_WINDOWS: dict[Flavor, int | None] = {
    "openai": None,
    "llama.cpp": 4096,
    "llama-cpp-python": 2048,
    "ollama": 2048,
    "vllm": 32768,
}

Responder = Callable[[dict[str, Any]], "Reply | str"]


@dataclass(frozen=True, slots=True)
class FakeToolCall:
    """One scripted tool call. A `str` arguments value is sent verbatim (malformed JSON
    included); a mapping is JSON-encoded."""

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """One scripted answer to a chat request: a success (`text` and/or `tool_calls`) or,
    when `status` is not 200, an error in OpenAI's error shape.

    `raw` is sent as the whole JSON body of a non-streamed success instead (a server
    whose answer is not the chat completion format, or one with fields of its own).
    `delay` waits before answering (timeouts, slow models); `chunk_delay` waits between
    streamed events; `break_after` closes the connection after that many streamed `data:`
    events (the first one carries only the assistant role), as a server killed mid-answer
    does: no last chunk, no finish_reason, no `[DONE]`; a non-streamed request with
    `break_after` set is closed without any answer (a server that crashed on it).
    `model` restricts which
    requests may consume this reply; `prompt_tokens`/`completion_tokens` override the
    usage estimate.
    """

    text: str | None = None
    tool_calls: Sequence[FakeToolCall] = ()
    status: int = 200
    error_message: str | None = None
    error_type: str | None = None
    error_code: str | None = None
    retry_after: float | None = None
    delay: float = 0.0
    chunk_delay: float = 0.0
    break_after: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model: str | None = None
    raw: bytes | None = None


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as the fake received it. `headers` keys are lower-case; `body` is the
    parsed JSON (None for GET or an unparseable body)."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any
    timestamp: float

    @property
    def model(self) -> str | None:
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages = self.body.get("messages") if isinstance(self.body, dict) else None
        return messages if isinstance(messages, list) else []

    @property
    def tools(self) -> list[dict[str, Any]]:
        tools = self.body.get("tools") if isinstance(self.body, dict) else None
        return tools if isinstance(tools, list) else []

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def last_user_text(self) -> str | None:
        for message in reversed(self.messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return content_text(message.get("content"))
        return None

    @property
    def bearer_token(self) -> str | None:
        auth = self.headers.get("authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    @property
    def retry_count(self) -> int:
        """How many retries the openai client says preceded this request."""
        try:
            return int(self.headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            return 0


def content_text(content: Any) -> str:
    """The text of a message `content`: a string, or the text parts of a parts list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def estimate_tokens(text: str) -> int:
    """The fake's token count for a text: ceil(characters / 4)."""
    return -(-len(text) // 4)


#: Tokens a real server counts around each message and to start the reply: OpenAI's own
#: count for its chat models is 3 and 3 (llama.cpp's ChatML template: 5 and 3). The
#: fake used to count the text alone, so its prompt_tokens ran below every real server's.
TOKENS_PER_MESSAGE = 3
REPLY_PRIMING_TOKENS = 3


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one request message that the usage estimate counts."""
    parts = [content_text(message.get("content"))]
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(str(function.get("name", "")))
            parts.append(str(function.get("arguments", "")))
    return "\n".join(parts)


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """The fake's prompt_tokens for a chat request: each message's text estimate plus its
    framing, plus the reply's priming, plus the tools' definitions (a chat template
    writes them into the prompt, and servers count them)."""
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    framing = TOKENS_PER_MESSAGE * len(messages) + REPLY_PRIMING_TOKENS
    tools = body.get("tools")
    offered = estimate_tokens(json.dumps(tools)) if tools else 0
    return framing + offered + sum(estimate_tokens(message_text(m)) for m in messages)


def echo_responder(body: dict[str, Any]) -> Reply | str:
    """The default reply: ``echo: <text of the last user message>``, and a
    ``[image WxH format]`` for each image part it carried."""
    for message in reversed(body.get("messages") or ()):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            seen = "".join(f" [image {d}]" for d in image_descriptions(content))
            return f"echo: {content_text(content)}{seen}"
    return "echo: "


_IMAGE_FORMATS = {"PNG", "JPEG", "GIF", "WEBP"}
UNSUPPORTED_IMAGE = (
    "You uploaded an unsupported image. Please make sure your image is below 20 MB in size "
    "and is of one the following formats: ['png', 'jpeg', 'gif', 'webp']."
)
NO_VISION = "Invalid content type. image_url is only supported by certain models."
AUDIO_FORMATS = ("flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "wav", "webm")


def image_urls(content: Any) -> list[str]:
    """The URLs of the image parts of a message content."""
    if not isinstance(content, list):
        return []
    return [
        str((part.get("image_url") or {}).get("url", ""))
        for part in content
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def decode_image_url(url: str) -> Image.Image | None:
    """The image a ``data:`` URL holds (None when it holds none the API accepts)."""
    head, _, payload = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        return None
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError):
        return None
    return image if image.format in _IMAGE_FORMATS else None


def image_descriptions(content: Any) -> list[str]:
    """``WxH format`` of each image part (``remote`` for an http(s) URL)."""
    found = []
    for url in image_urls(content):
        image = None if url.startswith(("http://", "https://")) else decode_image_url(url)
        found.append(
            "remote" if image is None else f"{image.width}x{image.height} {image.format.lower()}"
        )
    return found


_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def validate_chat_request(body: Any) -> str | None:
    """The 400 message the real API would give this request body, or None when valid.

    Checks the rules a provider most easily breaks: every assistant tool call is answered
    by a tool message before the conversation goes on, every tool message answers one,
    tool arguments are JSON strings, and `name` fields match ``^[a-zA-Z0-9_-]{1,64}$``.
    """
    if not isinstance(body, dict):
        return "The request body must be a JSON object."
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "Invalid 'messages': empty array. Expected an array with minimum length 1."
    if body.get("stream_options") is not None and not body.get("stream"):
        return "The 'stream_options' parameter is only allowed when 'stream' is enabled."
    tools = body.get("tools")
    if body.get("tool_choice") is not None and not tools:
        return (
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
            "are specified."
        )
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"Invalid value for 'tools[{i}].type': expected 'function'."
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"Missing required parameter: 'tools[{i}].function.name'."

    unanswered: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            return f"Invalid value for '{where}.role'."
        role = message["role"]
        name = message.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME_PATTERN.match(name)):
            return (
                f"Invalid '{where}.name': string does not match pattern. Expected a string "
                f"that matches the pattern '{_NAME_PATTERN.pattern}'."
            )
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                return f"Missing required parameter: '{where}.tool_call_id'."
            if call_id not in unanswered:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'."
                )
            unanswered.remove(call_id)
            continue
        if unanswered:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(unanswered)}"
            )
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    continue
                if kind != "image_url" or role != "user":
                    return f"Invalid value for '{where}.content[{j}].type'."
                url = str((part.get("image_url") or {}).get("url", ""))
                if not url.startswith(("http://", "https://")) and decode_image_url(url) is None:
                    return UNSUPPORTED_IMAGE
        tool_calls = message.get("tool_calls")
        if role == "assistant" and tool_calls:
            for j, call in enumerate(tool_calls):
                problem = _tool_call_problem(call, f"{where}.tool_calls[{j}]")
                if problem:
                    return problem
                unanswered.append(call["id"])
        elif message.get("content") is None:
            return f"Missing required parameter: '{where}.content'."
    if unanswered:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(unanswered)}"
        )
    return None


def _tool_call_problem(call: Any, where: str) -> str | None:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        return f"Missing required parameter: '{where}.id'."
    if call.get("type") != "function":
        return f"Invalid value for '{where}.type': expected 'function'."
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return f"Missing required parameter: '{where}.function.name'."
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        got = "an object" if isinstance(arguments, dict) else type(arguments).__name__
        return (
            f"Invalid type for '{where}.function.arguments': expected a string, "
            f"but got {got} instead."
        )
    return None


# Default (type, code, message) per status, as the real API words them.
_ERROR_DEFAULTS: dict[int, tuple[str, str | None, str]] = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", None, "You are not allowed to sample from this model."),
    404: ("invalid_request_error", "model_not_found", "The model does not exist."),
    408: ("server_error", None, "Request timed out."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached. Please try again later."),
    500: (
        "server_error",
        None,
        "The server had an error while processing your request. Sorry about that!",
    ),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "The engine is currently overloaded, please try again later."),
}


#: `error_body`'s code for "no code at all" (None means the status's default code).
_NO_CODE = ""


def error_body(
    status: int, message: str | None = None, error_type: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON for a status, with realistic defaults (`code=""`: null)."""
    default_type, default_code, default_message = _ERROR_DEFAULTS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None, "Error.")
    )
    chosen = default_code if code is None else code or None
    return {
        "error": {
            "message": message or default_message,
            "type": error_type or default_type,
            "param": None,
            "code": chosen,
        }
    }


def _text_pieces(text: str) -> list[str]:
    """Split text into word-sized stream increments whose concatenation is the text."""
    return re.findall(r"\S+\s*|\s+", text)


def _argument_pieces(arguments: str, size: int = 8) -> list[str]:
    return [arguments[i : i + size] for i in range(0, len(arguments), size)] or [""]


class FakeOpenAI(LocalServer):
    """A scriptable OpenAI-compatible server; see the module docstring for usage.

    Every chat request gets exactly one reply: the model's failure rule if any, else the
    first queued reply it may consume, else the responder's answer. In thread mode the
    responder is called in the fake's thread.
    """

    _thread_name = "fake-openai"

    def __init__(
        self,
        *,
        api_key: str | None = DEFAULT_API_KEY,
        models: Sequence[str] = ("gpt-4o-mini",),
        responder: Responder | None = None,
        validate: bool = True,
        text_only_models: Sequence[str] = (),
        flavor: Flavor = "openai",
        context_window: int | None = None,
        trained_context: int = 131072,
        ollama_modelfile_num_ctx: bool = False,
        one_at_a_time: bool = False,
    ) -> None:
        """`api_key=None` accepts any or no Authorization header (like a local server);
        `validate=False` skips the request checks of `validate_chat_request`;
        `text_only_models` refuse image parts, as models without vision do. `flavor`
        answers as that server does (the module docstring's table), with
        `context_window` its size (default: the flavour's, `DEFAULT_WINDOWS`) and
        `trained_context` the model's own; `ollama_modelfile_num_ctx` makes Ollama's
        /api/show list ``num_ctx`` (a Modelfile that sets it). `one_at_a_time` answers
        one chat request at a time and finishes a request whose client went away before
        taking the next, as llama-cpp-python's server does (docs/real-llm.md, row 9)."""
        super().__init__()
        self.flavor: Flavor = flavor
        self.context_window = context_window if context_window else DEFAULT_WINDOWS[flavor]
        self.trained_context = trained_context
        self.ollama_modelfile_num_ctx = ollama_modelfile_num_ctx
        #: Ollama's silent cuts: (prompt tokens asked, tokens kept), one per cut request.
        self.truncations: list[tuple[int, int]] = []
        self._loaded: set[str] = set()  # Ollama: models a chat request has loaded
        self.text_only_models = set(text_only_models)
        self._transcripts: list[tuple[str, float | None]] = []
        self.transcription_usage = True
        self.api_key = api_key
        self.models = list(models)
        self.responder: Responder = responder or echo_responder
        self.validate = validate
        self._queue: list[Reply] = []
        # Requests to hold unanswered (`hold`): the rule, and how many it still takes.
        self._holds: list[tuple[Callable[[dict[str, Any]], bool], list[int]]] = []
        self._held: list[RecordedRequest] = []
        self._disconnected: list[RecordedRequest] = []
        self.one_at_a_time = one_at_a_time
        self._slot: asyncio.Lock | None = None
        self._released = False
        self._model_failures: dict[str, Reply] = {}
        self._requests: list[RecordedRequest] = []
        self._ids = itertools.count(1)

    # -- running ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The URL to give an OpenAI client, e.g. ``http://127.0.0.1:41234/v1``."""
        return f"{self.url}/v1"

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{model_id}", self._get_model)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        if self.flavor == "llama.cpp":
            # llama-server routes the OpenAI paths with and without /v1.
            app.router.add_post("/chat/completions", self._chat_completions)
            app.router.add_get("/models", self._list_models)
            app.router.add_get("/props", self._props)
        if self.flavor == "ollama":
            app.router.add_get("/", self._ollama_root)
            app.router.add_get("/api/ps", self._ollama_ps)
            app.router.add_post("/api/show", self._ollama_show)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        return app

    # -- scripting --------------------------------------------------------------------

    def add(self, reply: Reply) -> None:
        """Queue any scripted reply."""
        with self._lock:
            self._queue.append(reply)

    def add_transcription(self, text: str, *, seconds: float | None = None) -> None:
        """Queue the text of the next transcription request (and its audio's duration)."""
        with self._lock:
            self._transcripts.append((text, seconds))

    @property
    def transcription_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == "/v1/audio/transcriptions"]

    def add_reply(
        self,
        text: str,
        *,
        delay: float = 0.0,
        chunk_delay: float = 0.0,
        finish_reason: str | None = None,
        model: str | None = None,
    ) -> None:
        """Queue a plain text answer."""
        self.add(
            Reply(
                text=text,
                delay=delay,
                chunk_delay=chunk_delay,
                finish_reason=finish_reason,
                model=model,
            )
        )

    def add_tool_call(
        self,
        name: str,
        arguments: Mapping[str, Any] | str | None = None,
        call_id: str | None = None,
        *,
        text: str | None = None,
        delay: float = 0.0,
        model: str | None = None,
    ) -> None:
        """Queue an answer with one tool call (`arguments` as a str is sent verbatim)."""
        call = FakeToolCall(name, {} if arguments is None else arguments, call_id)
        self.add(Reply(text=text, tool_calls=(call,), delay=delay, model=model))

    def add_tool_calls(
        self,
        calls: Sequence[FakeToolCall | tuple[str, Mapping[str, Any] | str]],
        *,
        text: str | None = None,
        delay: float = 0.0,
        model: str | None = None,
    ) -> None:
        """Queue one answer with several (parallel) tool calls."""
        scripted = tuple(c if isinstance(c, FakeToolCall) else FakeToolCall(*c) for c in calls)
        self.add(Reply(text=text, tool_calls=scripted, delay=delay, model=model))

    def add_error(
        self,
        status: int,
        message: str | None = None,
        *,
        retry_after: float | None = None,
        error_type: str | None = None,
        code: str | None = None,
        delay: float = 0.0,
        model: str | None = None,
    ) -> None:
        """Queue an error answer. `retry_after` (seconds, may be fractional) is sent as
        ``retry-after`` and ``retry-after-ms`` headers."""
        self.add(
            Reply(
                status=status,
                error_message=message,
                error_type=error_type,
                error_code=code,
                retry_after=retry_after,
                delay=delay,
                model=model,
            )
        )

    def add_delay(
        self, seconds: float, text: str | None = None, *, model: str | None = None
    ) -> None:
        """Queue an answer that comes after `seconds` (the responder's, unless `text`)."""
        self.add(Reply(text=text, delay=seconds, model=model))

    def fail_model(
        self,
        model: str,
        status: int = 404,
        message: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        """Make every request for `model` fail with `status` until `reset()`. A 404 is
        worded as the flavour's server words a model it does not have."""
        error_type = code = None
        if status == 404 and message is None:
            message = f"The model `{model}` does not exist or you do not have access to it."
            if self.flavor == "ollama":
                message = f'model "{model}" not found, try pulling it first'
                error_type, code = "api_error", _NO_CODE
            elif self.flavor == "vllm":
                message = f"The model `{model}` does not exist."
                error_type, code = "NotFoundError", "404"
        with self._lock:
            self._model_failures[model] = Reply(
                status=status,
                error_message=message,
                error_type=error_type,
                error_code=code,
                retry_after=retry_after,
            )

    def hold(self, matches: Callable[[dict[str, Any]], bool], count: int = 1) -> None:
        """Hold the next `count` chat requests whose JSON body `matches`: they get no
        answer until `release` (a model busy with them, while a test freezes the
        gateway that asked). `held` lists them as they arrive."""
        with self._lock:
            self._holds.append((matches, [count]))
            self._released = False

    def release(self) -> None:
        """Answer every held request now (and stop holding new ones)."""
        with self._lock:
            self._released = True
            self._holds.clear()
        self._notify()

    @property
    def held(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._held)

    def wait_held(self, count: int = 1, timeout: float = 10.0) -> list[RecordedRequest]:
        """Block until `count` requests are held (thread mode)."""
        return self._wait_blocking(
            at_least(count, lambda: self.held),
            timeout,
            async_method="wait_held_async",
            describe_timeout=lambda: f"{len(self._held)} of {count} held after {timeout}s",
        )

    async def wait_held_async(self, count: int = 1) -> list[RecordedRequest]:
        return await self._until(at_least(count, lambda: self.held))

    def _to_hold(self, body: dict[str, Any]) -> bool:
        with self._lock:
            for matches, left in self._holds:
                if left[0] > 0 and matches(body):
                    left[0] -= 1
                    return True
        return False

    @property
    def disconnected(self) -> list[RecordedRequest]:
        """Chat requests whose client closed the connection before the answer."""
        with self._lock:
            return list(self._disconnected)

    async def wait_disconnected_async(self, count: int = 1) -> list[RecordedRequest]:
        return await self._until(at_least(count, lambda: self.disconnected))

    def reset(self) -> None:
        """Forget queued replies, model failure rules, the request log and Ollama's cuts."""
        with self._lock:
            self._queue.clear()
            self._model_failures.clear()
            self._requests.clear()
            self.truncations.clear()

    @property
    def queued(self) -> int:
        """How many scripted replies are still waiting to be consumed."""
        with self._lock:
            return len(self._queue)

    # -- the request log --------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, oldest first (a snapshot)."""
        with self._lock:
            return list(self._requests)

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    @property
    def last_request(self) -> RecordedRequest:
        with self._lock:
            if not self._requests:
                raise AssertionError("FakeOpenAI has received no request")
            return self._requests[-1]

    def wait_for_requests(self, count: int, timeout: float = 5.0) -> list[RecordedRequest]:
        """Block until at least `count` chat requests arrived (for thread mode): the
        gateway's other requests (its probe of the context window) do not count."""
        return self._wait_blocking(
            at_least(count, lambda: self.chat_requests),
            timeout,
            async_method="wait_for_requests_async",
            describe_timeout=lambda: (
                f"{len(self.chat_requests)} of {count} chat requests after {timeout}s"
            ),
        )

    async def wait_for_requests_async(self, count: int) -> list[RecordedRequest]:
        """Wait, without blocking the event loop, until at least `count` chat requests
        arrived. Bound it with ``anyio.fail_after(...)``. For the event-loop mode only."""
        if self._loop is None or asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("the fake is not serving in this event loop; use wait_for_requests")
        return await self._until(at_least(count, lambda: self.chat_requests))

    # -- handlers ---------------------------------------------------------------------

    async def _record(self, request: web.Request) -> RecordedRequest:
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        recorded = RecordedRequest(
            method=request.method,
            path=request.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            timestamp=time.time(),
        )
        with self._lock:
            self._requests.append(recorded)
        self._notify()
        return recorded

    def _auth_error(self, recorded: RecordedRequest) -> web.Response | None:
        if self.api_key is None:
            return None
        if "authorization" not in recorded.headers:
            return _error_response(
                401,
                error_body(
                    401,
                    "You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                ),
            )
        if recorded.bearer_token != self.api_key:
            return _error_response(401, error_body(401))
        return None

    async def _not_found(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.flavor == "ollama":  # Go's gin router
            return web.Response(status=404, text="404 page not found")
        if self.flavor in ("vllm", "llama-cpp-python"):  # FastAPI
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.flavor == "llama.cpp":
            return web.Response(status=404, text="File Not Found")
        message = f"Invalid URL ({request.method} {request.path})"
        return _error_response(404, error_body(404, message, code=_NO_CODE))

    async def _list_models(self, request: web.Request) -> web.Response:
        recorded = await self._record(request)
        if (denied := self._auth_error(recorded)) is not None:
            return denied
        data = [self._model_object(m) for m in self.models]
        return web.json_response({"object": "list", "data": data})

    def _model_object(self, model: str) -> dict[str, Any]:
        """A /v1/models entry as the flavour's server writes it."""
        if self.flavor == "vllm":
            return {
                "id": model,
                "object": "model",
                "created": 1700000000,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": self.context_window,
                "permission": [],
            }
        if self.flavor == "llama.cpp":
            meta = {"vocab_type": 2, "n_ctx_train": self.trained_context, "n_params": 135000000}
            return {
                "id": model,
                "object": "model",
                "created": 1700000000,
                "owned_by": "llamacpp",
                "meta": meta,
            }
        if self.flavor == "llama-cpp-python":
            return {"id": model, "object": "model", "owned_by": "me", "permissions": []}
        if self.flavor == "ollama":
            return {"id": model, "object": "model", "created": 1700000000, "owned_by": "library"}
        return _model_object(model)

    async def _props(self, request: web.Request) -> web.Response:
        """llama-server's GET /props (the parts clients read)."""
        recorded = await self._record(request)
        if (denied := self._auth_error(recorded)) is not None:
            return denied
        model = self.models[0] if self.models else "model"
        return web.json_response(
            {
                "default_generation_settings": {
                    "id": 0,
                    "n_ctx": self.context_window,
                    "speculative": False,
                    "is_processing": False,
                    "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40},
                },
                "total_slots": 1,
                "model_alias": model,
                "model_path": f"/models/{model}.gguf",
                "modalities": {"vision": False, "audio": False},
                "chat_template": "{% for message in messages %}...{% endfor %}",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "build_info": "b6000-fake",
            }
        )

    async def _ollama_root(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.Response(text="Ollama is running")

    def _ollama_details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "1.2B",
            "quantization_level": "Q4_K_M",
        }

    async def _ollama_ps(self, request: web.Request) -> web.Response:
        """Ollama's GET /api/ps: the models loaded, with the context each was loaded with."""
        await self._record(request)
        with self._lock:
            loaded = sorted(self._loaded)
        models = [
            {
                "name": name,
                "model": name,
                "size": 1_300_000_000,
                "digest": "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
                "details": self._ollama_details(),
                "expires_at": "2030-01-01T00:05:00Z",
                "size_vram": 1_300_000_000,
                "context_length": self.context_window,
            }
            for name in loaded
        ]
        return web.json_response({"models": models})

    async def _ollama_show(self, request: web.Request) -> web.Response:
        """Ollama's POST /api/show {"model": name} (older clients send "name")."""
        recorded = await self._record(request)
        body = recorded.body if isinstance(recorded.body, dict) else {}
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or self._ollama_name(name) is None:
            return web.json_response({"error": f"model '{name}' not found"}, status=404)
        parameters = 'stop                           "<|eot_id|>"'
        if self.ollama_modelfile_num_ctx:
            parameters = f"num_ctx                        {self.context_window}\n{parameters}"
        return web.json_response(
            {
                "license": "...",
                "modelfile": f"FROM {name}\n",
                "parameters": parameters,
                "template": "{{ .Prompt }}",
                "details": self._ollama_details(),
                "model_info": {
                    "general.architecture": "llama",
                    "general.parameter_count": 1235814432,
                    "llama.context_length": self.trained_context,
                    "llama.embedding_length": 2048,
                },
                "capabilities": ["completion", "tools"],
                "modified_at": "2025-01-01T00:00:00Z",
            }
        )

    def _ollama_name(self, name: str) -> str | None:
        """The listed model `name` means ("llama3.2" is "llama3.2:latest"), or None."""
        for model in self.models:
            if name in (model, f"{model}:latest") or model == f"{name}:latest":
                return model
        return None

    def _overflow(self, body: dict[str, Any]) -> web.Response | None:
        """The flavour's refusal of a prompt longer than its window (None: it fits, or
        the flavour cuts it instead)."""
        window = self.context_window
        if window is None or self.flavor == "ollama":
            return None
        prompt = estimate_prompt_tokens(body)
        max_tokens = body.get("max_tokens")
        if self.flavor == "llama.cpp":
            if prompt < window:
                return None
            message = (
                f"request ({prompt} tokens) exceeds the available context size "
                f"({window} tokens), try increasing it"
            )
            error = {
                "code": 400,
                "message": message,
                "type": "exceed_context_size_error",
                "n_prompt_tokens": prompt,
                "n_ctx": window,
            }
            return _error_response(400, {"error": error})
        if self.flavor == "llama-cpp-python":
            if prompt < window:
                return None
            message = (
                f"This model's maximum context length is {window} tokens. However, you "
                f"requested {prompt + (max_tokens or 0)} tokens ({prompt} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
            return _error_response(
                400, error_body(400, message, "invalid_request_error", "context_length_exceeded")
            )
        if self.flavor == "vllm":
            if isinstance(max_tokens, int) and prompt + max_tokens > window:
                message = (
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                    f"This model's maximum context length is {window} tokens and your request "
                    f"has {prompt} input tokens ({max_tokens} > {window} - {prompt})."
                )
            elif prompt >= window:
                message = (
                    f"This model's maximum context length is {window} tokens. However, your "
                    f"request has {prompt} input tokens. Please reduce the length of the input "
                    "messages."
                )
            else:
                return None
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return _error_response(400, {"error": error})
        if prompt <= window:
            return None
        message = (
            f"This model's maximum context length is {window} tokens. However, your messages "
            f"resulted in {prompt} tokens. Please reduce the length of the messages."
        )
        return _error_response(
            400, error_body(400, message, "invalid_request_error", "context_length_exceeded")
        )

    def _ollama_cut(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` as Ollama's model sees it: while the prompt is longer than num_ctx, the
        oldest message after the system ones is dropped (the last one stays), silently."""
        window = self.context_window
        messages = list(body["messages"])
        asked = estimate_prompt_tokens(body)
        if window is None or asked <= window:
            return body
        cut = dict(body)
        while estimate_prompt_tokens(cut) > window:
            droppable = [
                i
                for i, m in enumerate(messages[:-1])
                if not (isinstance(m, dict) and m.get("role") == "system")
            ]
            if not droppable:
                break
            del messages[droppable[0]]
            cut["messages"] = list(messages)
        with self._lock:
            self.truncations.append((asked, estimate_prompt_tokens(cut)))
        return cut

    async def _get_model(self, request: web.Request) -> web.Response:
        recorded = await self._record(request)
        if (denied := self._auth_error(recorded)) is not None:
            return denied
        model_id = request.match_info["model_id"]
        if model_id not in self.models:
            message = f"The model '{model_id}' does not exist"
            return _error_response(404, error_body(404, message))
        return web.json_response(_model_object(model_id))

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request)
        try:
            if not self.one_at_a_time:
                return await self._answer_chat(request, recorded)
            if self._slot is None:
                self._slot = asyncio.Lock()
            slot = self._slot

            async def in_the_slot() -> web.StreamResponse:
                async with slot:
                    return await self._answer_chat(request, recorded)

            # Shielded: a request whose client went away is still worked to its end,
            # holding the slot, as llama-cpp-python's server does.
            work = asyncio.ensure_future(in_the_slot())
            work.add_done_callback(lambda done: done.cancelled() or done.exception())
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The client closed the connection before the answer (aiohttp cancels the
            # handler): a server that stops on disconnect stops here.
            with self._lock:
                self._disconnected.append(recorded)
            self._notify()
            raise

    async def _answer_chat(
        self, request: web.Request, recorded: RecordedRequest
    ) -> web.StreamResponse:
        if (denied := self._auth_error(recorded)) is not None:
            return denied
        body = recorded.body
        if body is None:
            message = "We could not parse the JSON body of your request."
            return _error_response(400, error_body(400, message))
        if self.validate and (problem := validate_chat_request(body)) is not None:
            return _error_response(400, error_body(400, problem))
        if body.get("model") in self.text_only_models and any(
            image_urls(m.get("content")) for m in body["messages"] if isinstance(m, dict)
        ):
            return _error_response(400, error_body(400, NO_VISION))
        if (refused := self._overflow(body)) is not None:
            return refused
        if self.flavor == "ollama":
            body = self._ollama_cut(body)
            with self._lock:
                self._loaded.add(self._ollama_name(str(body.get("model"))) or str(body["model"]))
        if self._to_hold(body):
            with self._lock:
                self._held.append(recorded)
            self._notify()
            closing = self._closing
            assert closing is not None
            await self._until(lambda: self._released or closing.is_set() or None)
        reply = self._next_reply(body)
        if reply.delay:
            await self._sleep(reply.delay)
        if reply.status != 200:
            return self._error_reply(reply)
        if body.get("stream"):
            return await self._stream(request, body, reply)
        if reply.break_after is not None:
            if request.transport is not None:
                request.transport.abort()  # no status line, nothing: the process died
            return web.Response()
        if reply.raw is not None:
            return web.Response(
                body=reply.raw, content_type="application/json", headers=self._id_header()
            )
        return web.json_response(self._completion(body, reply), headers=self._id_header())

    async def _transcriptions(self, request: web.Request) -> web.Response:
        fields: dict[str, Any] = {}
        data = b""
        if request.content_type == "multipart/form-data":
            form = await request.post()
            for key, value in form.items():
                if isinstance(value, web.FileField):
                    data = value.file.read()
                    fields[key] = {
                        "filename": value.filename,
                        "content_type": value.content_type,
                        "size": len(data),
                    }
                else:
                    fields[key] = value
        recorded = RecordedRequest(
            method=request.method,
            path=request.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=fields,
            timestamp=time.time(),
        )
        with self._lock:
            self._requests.append(recorded)
        self._notify()
        if (denied := self._auth_error(recorded)) is not None:
            return denied
        file = fields.get("file")
        if not isinstance(file, dict) or not fields.get("model"):
            missing = "file" if not isinstance(file, dict) else "model"
            return _error_response(
                400, error_body(400, f"Missing required parameter: '{missing}'.")
            )
        suffix = str(file.get("filename") or "").rpartition(".")[2].lower()
        if suffix not in AUDIO_FORMATS:
            message = f"Invalid file format. Supported formats: {list(AUDIO_FORMATS)}"
            return _error_response(400, error_body(400, message))
        with self._lock:
            queued = self._transcripts.pop(0) if self._transcripts else None
        if queued is None:
            _, marker, spoken = data.partition(b"SPEECH:")
            queued = (spoken.decode("utf-8", errors="replace") if marker else "", None)
        text, seconds = queued
        answer: dict[str, Any] = {"text": text}
        if self.transcription_usage:
            answer["usage"] = transcription_usage(str(fields["model"]), text, seconds)
        return web.json_response(answer, headers=self._id_header())

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        model = body.get("model")
        with self._lock:
            failure = self._model_failures.get(model) if isinstance(model, str) else None
            if failure is not None:
                return failure
            for i, reply in enumerate(self._queue):
                if reply.model is None or reply.model == model:
                    del self._queue[i]
                    return reply
            responder = self.responder
        try:
            answer = responder(body)
        except Exception as exc:
            return Reply(status=500, error_message=f"FakeOpenAI responder raised {exc!r}")
        return Reply(text=answer) if isinstance(answer, str) else answer

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake up early when the server stops."""
        assert self._closing is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)

    def _id_header(self) -> dict[str, str]:
        return {"x-request-id": f"req_fake{next(self._ids):06d}"}

    def _error_reply(self, reply: Reply) -> web.Response:
        headers = self._id_header()
        if reply.retry_after is not None:
            headers["retry-after"] = str(max(0, round(reply.retry_after)))
            headers["retry-after-ms"] = str(int(reply.retry_after * 1000))
        body = error_body(reply.status, reply.error_message, reply.error_type, reply.error_code)
        return _error_response(reply.status, body, headers)

    def _tool_call_objects(self, reply: Reply) -> list[dict[str, Any]]:
        calls = []
        for call in reply.tool_calls:
            arguments = (
                call.arguments
                if isinstance(call.arguments, str)
                else json.dumps(dict(call.arguments), ensure_ascii=False)
            )
            calls.append(
                {
                    "id": call.call_id or f"call_fake{next(self._ids):06d}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        return calls

    def _usage(
        self, body: Mapping[str, Any], reply: Reply, calls: list[dict[str, Any]]
    ) -> dict[str, int]:
        prompt = (
            reply.prompt_tokens if reply.prompt_tokens is not None else estimate_prompt_tokens(body)
        )
        if reply.completion_tokens is not None:
            completion = reply.completion_tokens
        else:
            produced = (reply.text or "") + "".join(
                c["function"]["name"] + c["function"]["arguments"] for c in calls
            )
            completion = estimate_tokens(produced)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _completion(self, body: Mapping[str, Any], reply: Reply) -> dict[str, Any]:
        calls = self._tool_call_objects(reply)
        message: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        elif reply.text is None:
            message["content"] = ""
        return {
            "id": f"chatcmpl-fake{next(self._ids):06d}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": "fp_fake",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.finish_reason or ("tool_calls" if calls else "stop"),
                }
            ],
            "usage": self._usage(body, reply, calls),
        }

    def _stream_chunks(self, body: Mapping[str, Any], reply: Reply) -> list[dict[str, Any]]:
        calls = self._tool_call_objects(reply)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {
            "id": f"chatcmpl-fake{next(self._ids):06d}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": "fp_fake",
        }

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            extra = {"usage": None} if include_usage else {}
            return {**base, "choices": [choice], **extra}

        chunks = [chunk({"role": "assistant", "content": "", "refusal": None})]
        chunks += [chunk({"content": piece}) for piece in _text_pieces(reply.text or "")]
        for index, call in enumerate(calls):
            function = call["function"]
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }
            chunks.append(chunk({"tool_calls": [head]}))
            for piece in _argument_pieces(function["arguments"]):
                if piece:
                    delta = {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                    chunks.append(chunk(delta))
        chunks.append(chunk({}, reply.finish_reason or ("tool_calls" if calls else "stop")))
        if include_usage:
            chunks.append({**base, "choices": [], "usage": self._usage(body, reply, calls)})
        return chunks

    async def _stream(
        self, request: web.Request, body: Mapping[str, Any], reply: Reply
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **self._id_header(),
            }
        )
        await response.prepare(request)
        for sent, chunk in enumerate(self._stream_chunks(body, reply)):
            if reply.break_after is not None and sent >= reply.break_after:
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
            if reply.chunk_delay:
                await self._sleep(reply.chunk_delay)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 1700000000, "owned_by": "fake-openai"}


def transcription_usage(model: str, text: str, seconds: float | None) -> dict[str, Any]:
    """The ``usage`` of a transcription, as the real API reports it for ``model``."""
    if seconds is None:
        seconds = max(1.0, math.ceil(len(text.split()) / 2.5))
    if not model.startswith("gpt-"):
        return {"type": "duration", "seconds": seconds}
    audio, out = math.ceil(seconds * 10), math.ceil(len(text) / 4)
    return {
        "type": "tokens",
        "input_tokens": audio,
        "input_token_details": {"audio_tokens": audio, "text_tokens": 0},
        "output_tokens": out,
        "total_tokens": audio + out,
    }


def _error_response(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response(body, status=status, headers=dict(headers or {}))
