"""The OpenAI-compatible LLM provider (OpenAI, Ollama, vLLM, llama.cpp, ...) on `openai`.

A whole answer (`chat`, a turn's usual request) goes out over the gateway's own aiohttp
session, not through the `openai` client: side by side (bench/llm_transport.py,
bench/results/turn-cpu-i42.md) the client's request machinery cost 0.61 ms of CPU a
request where the same request over aiohttp, its JSON read with orjson, cost 0.17 ms.
What users rely on from the client is kept, in `_post_chat`: its retries (408, 409, 429,
5xx, timeouts and failed connections; `x-should-retry`; Retry-After honoured up to two
minutes, else backoff from 0.5 s doubling to 8 s with jitter), its headers, its timeouts
(connect, and the wait between bytes) and its exceptions, built by the client itself from
the answer, so `classify_failure` reads one kind of error. Streams and the server-window
probe still go through the client. Two of the client's methods used here are private
(`_should_retry`, `_make_status_error_from_response`), and `_retry_wait` restates its
`_calculate_retry_timeout` (which wants the client's request options): an upgrade of
`openai` that changes them fails tests/test_llm_provider.py's retry and error tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import json
import math
import random
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import anyio
import httpx2
import openai
import orjson
import yarl
from aiohttp.helpers import get_env_proxy_for_url
from loguru import logger
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
)
from openai.types.completion_usage import CompletionUsage

from gateway.llm.credentials import api_key_required, check_credentials
from gateway.llm.types import (
    ContextOverflow,
    LLMConfigError,
    LLMError,
    LLMMessage,
    LLMResponse,
    ServerWindow,
    StreamDelta,
    TokenUsage,
    ToolCall,
    ToolSpec,
)
from gateway.llm.window import (
    Overflow,
    names_a_model,
    probe_server_window,
    read_overflow,
    wrong_path_detail,
)
from gateway.redaction import Redactor

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Sent when a local server needs no key: the client insists on one, servers ignore it.
PLACEHOLDER_API_KEY = "not-needed"
#: The openai client's retry schedule (`openai._constants`): a server's Retry-After is
#: honoured up to two minutes (past it the request is not retried), else the wait starts
#: at half a second and doubles up to eight, less up to a quarter of jitter.
MAX_RETRY_AFTER = 120.0
FIRST_RETRY_WAIT = 0.5
LONGEST_RETRY_WAIT = 8.0

_NAME_FORBIDDEN = re.compile(r"[^a-zA-Z0-9_-]")


# -- message conversion (pure) ------------------------------------------------------------


def to_openai_message(message: LLMMessage) -> dict[str, Any]:
    """One `LLMMessage` as an OpenAI chat message dict.

    Tool arguments become JSON strings; arguments kept as ``{"_raw": text}`` (because the
    model sent malformed JSON) are sent back verbatim. A `name` is reduced to the
    characters the API accepts, and dropped on tool messages, which take none.
    """
    result: dict[str, Any] = {"role": message.role}
    if message.role == "tool":
        if not message.tool_call_id:
            raise LLMError(
                "a tool message has no tool_call_id; cannot send it to the model",
                user_message="The gateway built an invalid request for the model.",
            )
        result["tool_call_id"] = message.tool_call_id
        result["content"] = message.content or ""
        return result
    if message.role == "assistant" and message.tool_calls:
        # No text goes as "", which OpenAI takes like null: llama.cpp's server answers
        # a null content with HTTP 500, and its chatml-function-calling template a
        # missing one too.
        result["content"] = message.content or ""
        result["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function_name, "arguments": encode_arguments(call)},
            }
            for call in message.tool_calls
        ]
    elif message.images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": message.content or ""}]
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in message.images]
        result["content"] = parts
    else:
        result["content"] = message.content or ""
    name = _api_name(message.name)
    if name:
        result["name"] = name
    return result


def _api_name(name: str | None) -> str | None:
    """`name` as the API accepts it (``^[a-zA-Z0-9_-]{1,64}$``), or None."""
    if not name:
        return None
    cleaned = _NAME_FORBIDDEN.sub("_", name)[:64]
    return cleaned if cleaned.strip("_") else None


def encode_arguments(call: ToolCall) -> str:
    """A tool call's arguments as the JSON string the API carries."""
    if set(call.arguments) == {"_raw"} and isinstance(call.arguments["_raw"], str):
        return call.arguments["_raw"]
    return json.dumps(call.arguments, ensure_ascii=False)


def decode_arguments(raw: str | None) -> dict[str, Any]:
    """A tool call's JSON arguments as a dict; anything else is kept as ``{"_raw": raw}``."""
    if raw is None or not raw.strip():
        return {}
    try:
        decoded = json.loads(raw)
    except ValueError:
        return {"_raw": raw}
    return decoded if isinstance(decoded, dict) else {"_raw": raw}


def to_openai_tool(spec: ToolSpec) -> dict[str, Any]:
    """A `ToolSpec` as an OpenAI function tool."""
    return {
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters,
        },
    }


def display_url(base_url: str) -> str:
    """`base_url` without any user:password part or query, fit for logs and errors."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _new_call_id() -> str:
    # Some local servers omit tool call ids; the transcript needs one to pair results.
    return f"call_{uuid.uuid4().hex[:24]}"


def _token_usage(usage: CompletionUsage | None) -> TokenUsage | None:
    if usage is None:
        return None
    return TokenUsage(
        prompt_tokens=usage.prompt_tokens or 0,
        completion_tokens=usage.completion_tokens or 0,
        total_tokens=usage.total_tokens or 0,
    )


class UnreadableAnswer(ValueError):
    """A completion's JSON body that is not the chat completion format: what is wrong."""


def _field(value: Any, kind: type, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise UnreadableAnswer(f"{what} is {type(value).__name__}, not {kind.__name__}")
    return value


def _count(usage: dict[str, Any], name: str) -> int:
    """A token count of `usage`: a number (some servers send 12.0), else 0. An odd
    count does not cost the person the answer."""
    value = usage.get(name)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if value is not None:
        logger.warning("LLM answer's usage.{} is {!r}, not a number: counted as 0", name, value)
    return 0


def response_from_wire(body: bytes, requested_model: str) -> LLMResponse | None:
    """An `LLMResponse` from a non-streamed completion's JSON body (its first choice);
    None when it has no choice. `UnreadableAnswer` says what is malformed.

    Read from the wire, not through the SDK's `ChatCompletion`: with its recursive
    model construction and the stdlib JSON encoder, the client's CPU per call was a
    median 1.63 ms against 1.12 ms (five alternating runs of 1,000 calls, docs/scaling.md).
    The SDK constructs without validating, so both read the same fields and skip the
    same unknown ones; the answer's text and tool calls must have their types, the rest
    (model, finish reason, token counts) falls back when odd."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UnreadableAnswer(f"not JSON ({exc})") from None
    data = _field(data, dict, "the answer")
    choices = _field(data.get("choices"), list, "choices")
    if not choices:
        return None
    choice = _field(choices[0], dict, "choices[0]") or {}
    reply = _field(choice.get("message"), dict, "the message") or {}
    calls = []
    for call in _field(reply.get("tool_calls"), list, "tool_calls") or ():
        call = _field(call, dict, "a tool call") or {}
        if call.get("type", "function") != "function":
            continue
        function = _field(call.get("function"), dict, "a tool call's function") or {}
        name = _field(function.get("name"), str, "a tool's name")
        if not name:
            raise UnreadableAnswer("a tool call has no function name")
        calls.append(
            ToolCall(
                id=_field(call.get("id"), str, "a tool call's id") or _new_call_id(),
                function_name=name,
                arguments=decode_arguments(_field(function.get("arguments"), str, "arguments")),
            )
        )
    model = data.get("model")
    answered_by = model if isinstance(model, str) and model else requested_model
    content = _field(reply.get("content"), str, "content")
    usage = data.get("usage")
    message = LLMMessage(
        role="assistant",
        content="" if content is None and not calls else content,
        tool_calls=tuple(calls),
        usage=None
        if not isinstance(usage, dict)
        else TokenUsage(
            prompt_tokens=_count(usage, "prompt_tokens"),
            completion_tokens=_count(usage, "completion_tokens"),
            total_tokens=_count(usage, "total_tokens"),
        ),
        model=answered_by,
    )
    finish = choice.get("finish_reason")
    return LLMResponse(
        message=message,
        model=answered_by,
        finish_reason=finish if isinstance(finish, str) else None,
    )


@dataclass(slots=True)
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StreamAssembly:
    """Collects the chunks of one streamed completion into the final `LLMResponse`.

    Tool-call deltas are merged by their `index`: the first delta of a call carries its
    id and name, later ones append argument text.
    """

    text: list[str] = field(default_factory=list)
    calls: dict[int, _PartialCall] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: TokenUsage | None = None
    model: str | None = None

    def add(self, chunk: ChatCompletionChunk) -> str:
        """Take one chunk in; return its text increment ("" if none)."""
        self.model = chunk.model or self.model
        if chunk.usage is not None:
            self.usage = _token_usage(chunk.usage)
        increment = ""
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            delta = choice.delta
            if delta.content:
                increment += delta.content
            for position, call_delta in enumerate(delta.tool_calls or ()):
                index = getattr(call_delta, "index", None)
                partial = self.calls.setdefault(
                    position if index is None else index, _PartialCall()
                )
                if call_delta.id:
                    partial.id = call_delta.id
                function = call_delta.function
                if function is not None:
                    partial.name += function.name or ""
                    if function.arguments:
                        partial.arguments.append(function.arguments)
        if increment:
            self.text.append(increment)
        return increment

    def response(self, requested_model: str) -> LLMResponse:
        calls = tuple(
            ToolCall(
                id=partial.id or _new_call_id(),
                function_name=partial.name,
                arguments=decode_arguments("".join(partial.arguments)),
            )
            for _, partial in sorted(self.calls.items())
        )
        answered_by = self.model or requested_model
        text = "".join(self.text)
        message = LLMMessage(
            role="assistant",
            content=text if text or not calls else None,
            tool_calls=calls,
            usage=self.usage,
            model=answered_by,
        )
        return LLMResponse(message=message, model=answered_by, finish_reason=self.finish_reason)


# -- failures -----------------------------------------------------------------------------

FailureKind = Literal[
    "auth",
    "denied",
    "quota",
    "bad_request",
    "not_found",
    "wrong_path",
    "rate_limited",
    "timeout",
    "unavailable",
]

#: The path of every chat request under the base URL.
CHAT_PATH = "/chat/completions"


@dataclass(frozen=True, slots=True)
class ModelFailure:
    """Why one model could not answer, and whether another model might."""

    model: str
    kind: FailureKind
    detail: str
    status: int | None = None
    code: str | None = None
    #: What the server said when it refused the request as too long for the model.
    overflow: Overflow | None = None
    #: Seconds a rate-limited server asked to wait (its Retry-After), if it said.
    retry_after: float | None = None
    #: The server could not be connected to at all (refused, no such host).
    unreachable: bool = False

    @property
    def try_next_model(self) -> bool:
        # A rejected key, an account out of credit, a malformed request, a wrong URL or
        # a server that cannot be reached fails the same way on every model.
        if self.unreachable:
            return False
        return self.kind not in ("auth", "denied", "quota", "bad_request", "wrong_path")


def _refused_connection(exc: BaseException) -> OSError | None:
    """The refused or failed connect behind `exc`, if any: the SDK's aiohttp transport
    reports a refused connection as a connect *timeout*, which would tell an operator
    the model is slow when its server is down."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionError | socket.gaierror):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def retry_after_seconds(headers: Any) -> float | None:
    """The wait a response's headers ask for, in seconds: ``retry-after-ms``, else
    ``retry-after`` as seconds or as an HTTP date, as the openai client reads them; None
    when they say nothing readable."""
    if headers is None:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            continue
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


def classify_failure(exc: openai.APIError, model: str, base_url: str) -> ModelFailure:
    """A `ModelFailure` for an error the openai client raised after its own retries.

    A 404 that does not name the model is the chat path missing, as a base URL without
    its /v1 gets from Ollama, vLLM and OpenAI ("wrong_path"), not a model that does not
    exist ("not_found"); a 400 saying the request is longer than the model's context
    window carries what the server said of its size (`overflow`). An account out of
    credit is "quota": HTTP 402 (OpenRouter, several others) or OpenAI's 429
    ``insufficient_quota``. A 429 carries the Retry-After it was given."""
    refused = _refused_connection(exc)
    if isinstance(exc, openai.APITimeoutError) and refused is None:
        return ModelFailure(model, "timeout", f"model {model!r}: no answer in time ({base_url})")
    if isinstance(exc, openai.APIConnectionError):
        cause = refused or exc.__cause__ or exc
        return ModelFailure(
            model,
            "unavailable",
            f"model {model!r}: cannot reach {base_url}: {cause}",
            unreachable=refused is not None,
        )
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        code = exc.code
        detail = f"model {model!r}: HTTP {status} from {base_url}"
        if code:
            detail += f" ({code})"
        detail += f": {exc.message}"
        kind: FailureKind
        retry_after = None
        if status == 401:
            kind = "auth"
        elif status == 402 or (status == 429 and code == "insufficient_quota"):
            kind = "quota"
        elif status == 403:
            kind = "denied"
        elif status == 404 and not names_a_model(exc.body, exc.message):
            detail = f"model {model!r}: " + wrong_path_detail(base_url, CHAT_PATH)
            return ModelFailure(model, "wrong_path", detail, status=status, code=code)
        elif status == 404:
            kind = "not_found"
            detail += " (check the model name)"
        elif status == 429:
            kind = "rate_limited"
            retry_after = retry_after_seconds(exc.response.headers)
        elif status in (408, 409) or status >= 500:
            kind = "unavailable"
        else:
            kind = "bad_request"
        overflow = read_overflow(status, exc.body, exc.message)
        return ModelFailure(
            model,
            kind,
            detail,
            status=status,
            code=code,
            overflow=overflow,
            retry_after=retry_after,
        )
    # An error event inside a stream, or an unparseable response.
    return ModelFailure(model, "unavailable", f"model {model!r}: {exc.message}")


_USER_MESSAGES: dict[FailureKind, str] = {
    "auth": (
        "The gateway's API key for the language model was rejected. "
        "The operator should check OPENAI_API_KEY."
    ),
    "denied": (
        "The gateway's API key is not allowed to use this model. "
        "The operator should check the model name and the account's access."
    ),
    "quota": (
        "The gateway's account with the model provider is out of credit. "
        "The operator should check its billing."
    ),
    "bad_request": "The model could not process this request. The operator can see why in the log.",
    "not_found": (
        "The configured model does not exist on the model server. "
        "The operator should check the model name."
    ),
    "wrong_path": (
        f"The model server answered 404 for {CHAT_PATH}: its address is probably "
        "missing /v1 (OpenAI-compatible base URLs usually end in /v1). The operator "
        "should check llm.base_url (OPENAI_BASE_URL); gateway doctor prints the fix."
    ),
    "rate_limited": "The model is busy right now. Please try again in a minute.",
    "timeout": "The model took too long to answer. Please try again.",
    "unavailable": "The model is not answering right now. Please try again.",
}


def error_for_failures(failures: Sequence[ModelFailure]) -> LLMError:
    """The `LLMError` to raise once no model is left to try.

    The user message names the common cause when every model failed the same way. A
    request refused as too long is a `ContextOverflow` with what the server said, for
    the agent loop to fit the request to it (only it knows what the request held).
    """
    detail = "LLM request failed: " + "; ".join(f.detail for f in failures)
    each = tuple(dict.fromkeys(f.kind for f in failures))
    kind: FailureKind = each[0] if len(each) == 1 else "unavailable"
    overflow = failures[-1].overflow
    if overflow is not None:
        return ContextOverflow(
            detail,
            context_tokens=overflow.context_tokens,
            prompt_tokens=overflow.prompt_tokens,
            server=overflow.server,
        )
    waits = [f.retry_after for f in failures if f.retry_after is not None]
    error_class = (
        LLMConfigError
        if kind in ("auth", "denied", "quota", "not_found", "wrong_path")
        else LLMError
    )
    return error_class(
        detail,
        user_message=_USER_MESSAGES[kind],
        kinds=each,
        retry_after=max(waits) if waits else None,
    )


# -- the provider -------------------------------------------------------------------------


def _retry_wait(attempt: int, retry_after: float | None) -> float:
    """The wait before retry `attempt + 1`, as the openai client computes it."""
    if retry_after is not None and 0 < retry_after <= MAX_RETRY_AFTER:
        return retry_after
    return min(FIRST_RETRY_WAIT * 2.0**attempt, LONGEST_RETRY_WAIT) * (1 - 0.25 * random.random())


def _not_waited_out(seconds: float) -> Callable[[Any], Awaitable[None]]:
    """An HTTP client response hook: an answer asking to wait at least `seconds`
    (Retry-After) is marked ``x-should-retry: false``, the openai client's own switch,
    so it fails at once instead of being retried after the wait."""

    async def mark(response: Any) -> None:
        wait = retry_after_seconds(response.headers)
        if wait is not None and wait >= seconds:
            response.headers["x-should-retry"] = "false"

    return mark


class OpenAIProvider:
    """`LLMProvider` for any server speaking OpenAI's chat completions API.

    Each model gets the openai client's retries (429, 5xx, timeouts, connection
    errors; backoff honouring ``retry-after``; `chat` keeps them over its own aiohttp
    request, see the module docstring). When a model still fails and another
    model could succeed, the next fallback model is tried, in order. Errors say which
    model failed and why, through `redactor`: a server that quotes a secret in its
    error (its own API key, or any other the settings hold) has it replaced.
    """

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        model: str,
        fallback_models: Sequence[str] = (),
        timeout: float = 60.0,
        connect_timeout: float | None = None,
        max_retries: int = 2,
        long_retry_after: float | None = None,
        default_temperature: float | None = None,
        default_max_tokens: int | None = None,
        default_tool_choice: str | None = None,
        falls_back_to_model: bool = True,
        redactor: Redactor | None = None,
    ) -> None:
        """`default_tool_choice` goes with every `chat` that offers tools and names no
        tool_choice of its own (None: the server's default). `falls_back_to_model`
        False: a request for another model never falls back to `model` (in a failover
        chain the next provider comes first). `connect_timeout` bounds
        the connect alone (None: `timeout`). An answer whose Retry-After is at least
        `long_retry_after` seconds is not retried by the client (None: the client waits
        up to its own bound of two minutes): the failover asks another provider instead
        of keeping the person waiting. `redactor` is the settings' (None: one of this
        provider's API key alone)."""
        check_credentials(base_url, api_key)
        if not model.strip():
            raise LLMConfigError(
                "No LLM model name configured",
                user_message="The gateway has no language model configured.",
            )
        self.base_url = base_url.strip() if base_url else DEFAULT_BASE_URL
        self._display_url = display_url(self.base_url)
        self.model = model
        self.fallback_models = tuple(m for m in dict.fromkeys(fallback_models) if m and m != model)
        self.default_temperature = default_temperature
        self.default_max_tokens = default_max_tokens
        self.default_tool_choice = default_tool_choice
        self.falls_back_to_model = falls_back_to_model
        key = api_key.strip() if api_key and api_key.strip() else PLACEHOLDER_API_KEY
        self._redactor = redactor or Redactor([key] if key != PLACEHOLDER_API_KEY else [])
        limits: openai.Timeout | float = timeout
        if connect_timeout is not None:
            limits = openai.Timeout(timeout, connect=min(connect_timeout, timeout))
        hooks: dict[str, list[Any]] = {}
        if long_retry_after is not None:
            hooks["response"] = [_not_waited_out(long_retry_after)]
        # base_url is always passed, so OPENAI_BASE_URL in the environment cannot make the
        # client talk to a server other than the one check_credentials approved.
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=key,
            timeout=limits,
            max_retries=max_retries,
            # The SDK's documented aiohttp transport: httpcore's connection pool (a
            # health check of the socket before each request, its pool bookkeeping) was a
            # third of the client's CPU per call; aiohttp is a dependency anyway.
            http_client=openai.DefaultAioHttpClient(timeout=limits, event_hooks=hooks),
        )
        # `chat`'s own requests (see the module docstring): the client's headers and
        # timeouts, on an aiohttp session made in the loop that first asks.
        self._chat_url = self.base_url.rstrip("/") + CHAT_PATH
        self._headers = {
            name: value
            for name, value in {**self._client.default_headers, **self._client.auth_headers}.items()
            if isinstance(value, str)
        }
        self._timeouts = aiohttp.ClientTimeout(
            total=None,
            sock_connect=min(connect_timeout, timeout) if connect_timeout is not None else timeout,
            sock_read=timeout,
        )
        self._max_retries = max_retries
        self._long_retry_after = long_retry_after
        self._http: aiohttp.ClientSession | None = None
        # The proxy the environment names for the server (HTTPS_PROXY, NO_PROXY), read
        # once: aiohttp's trust_env reads it, and netrc, in worker threads per request.
        self._proxy: Any = None
        self._proxy_auth: aiohttp.BasicAuth | None = None
        with contextlib.suppress(LookupError, ValueError):
            self._proxy, self._proxy_auth = get_env_proxy_for_url(yarl.URL(self._chat_url))

    async def server_window(self, model: str) -> ServerWindow | None:
        """The context window the server states for `model` (`probe_server_window`),
        asked with this provider's client and a short timeout. The hosted OpenAI APIs
        are not asked: they state it nowhere (their overflow error does)."""
        if api_key_required(self.base_url):
            return None
        return await probe_server_window(self._client, self.base_url, model)

    def candidate_models(self, model: str | None = None) -> list[str]:
        """The models to try in order: the requested (or configured) one, the configured
        one (unless `falls_back_to_model` is off), then fallbacks."""
        default = (self.model,) if self.falls_back_to_model else ()
        return list(dict.fromkeys((model or self.model, *default, *self.fallback_models)))

    async def chat(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> LLMResponse:
        wire_messages = self._wire_messages(messages)
        failures: list[ModelFailure] = []
        for candidate in self.candidate_models(model):
            body = self._request_body(
                candidate,
                wire_messages,
                tools,
                temperature,
                max_tokens,
                tool_choice if tool_choice is not None else self.default_tool_choice,
            )
            try:
                answer = await self._post_chat(orjson.dumps(body))
                response = response_from_wire(answer, candidate)
            except openai.APIError as exc:
                failure = classify_failure(exc, candidate, self._display_url)
            except UnreadableAnswer as exc:
                failure = ModelFailure(
                    candidate, "unavailable", f"model {candidate!r}: answer unreadable: {exc}"
                )
            else:
                if response is not None:
                    return response
                failure = ModelFailure(
                    candidate, "unavailable", f"model {candidate!r}: answer had no choices"
                )
            failures.append(self._log_failure(failure))
            if not failure.try_next_model:
                break
        raise self._error(failures)

    async def stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Yield text increments, then one `StreamDelta` whose `response` is the whole
        answer with tool calls and usage. A fallback model is tried only while nothing
        has been yielded: text a user may have seen is never mixed with another model's.
        No tool_choice is sent (not even `default_tool_choice`): llama-cpp-python answers a
        streamed "auto" with HTTP 500 whenever the model picks a tool."""
        wire_messages = self._wire_messages(messages)
        failures: list[ModelFailure] = []
        for candidate in self.candidate_models(model):
            assembly = StreamAssembly()
            yielded = False
            try:
                body = self._request_body(
                    candidate, wire_messages, tools, temperature, max_tokens, None
                )
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
                chunks = await self._client.post(
                    "/chat/completions",
                    body=body,
                    cast_to=ChatCompletion,
                    stream=True,
                    stream_cls=openai.AsyncStream[ChatCompletionChunk],
                )
                async with chunks:
                    async for chunk in chunks:
                        increment = assembly.add(chunk)
                        if increment:
                            yielded = True
                            yield StreamDelta(text=increment)
            except openai.APIError as exc:
                failure = self._log_failure(classify_failure(exc, candidate, self._display_url))
                if yielded:
                    raise LLMError(
                        f"LLM stream broke off: {failure.detail}",
                        user_message="The model's answer was cut off. Please try again.",
                        kinds=(failure.kind,),
                    ) from None
                failures.append(failure)
                if not failure.try_next_model:
                    break
                continue
            yield StreamDelta(response=assembly.response(candidate))
            return
        raise self._error(failures)

    async def aclose(self) -> None:
        await self._client.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _http_session(self) -> aiohttp.ClientSession:
        """The aiohttp session of the running loop (one made in another loop, as a test
        that runs twice makes, is left to that loop)."""
        session = self._http
        loop = asyncio.get_running_loop()
        if session is None or session.closed or getattr(session, "_loop", loop) is not loop:
            session = self._http = aiohttp.ClientSession(timeout=self._timeouts)
        return session

    async def _post_chat(self, body: bytes) -> bytes:
        """POST `body` to the chat path and return the answer's bytes, retried as the
        `openai` client retries (see the module docstring). Raises what the client
        raises: `openai.APITimeoutError`, `openai.APIConnectionError` (the failed
        connect as its cause), or the client's own status error for the answer."""
        session = self._http_session()
        url = self._chat_url
        for attempt in range(self._max_retries + 1):
            retries_left = self._max_retries - attempt
            headers = self._headers
            if attempt:
                headers = {**headers, "X-Stainless-Retry-Count": str(attempt)}
            try:
                async with session.post(
                    url, data=body, headers=headers, proxy=self._proxy, proxy_auth=self._proxy_auth
                ) as answer:
                    raw = await answer.read()
                    status, answer_headers = answer.status, answer.headers
            except TimeoutError as exc:
                if retries_left:
                    await anyio.sleep(_retry_wait(attempt, None))
                    continue
                raise openai.APITimeoutError(request=httpx2.Request("POST", url)) from exc
            except (aiohttp.ClientError, OSError) as exc:
                if retries_left:
                    await anyio.sleep(_retry_wait(attempt, None))
                    continue
                raise openai.APIConnectionError(request=httpx2.Request("POST", url)) from exc
            if 200 <= status < 300:
                return raw
            response = httpx2.Response(
                status,
                headers=list(answer_headers.items()),
                content=raw,
                request=httpx2.Request("POST", url),
            )
            wait = retry_after_seconds(response.headers)
            long_wait = self._long_retry_after
            if long_wait is not None and wait is not None and wait >= long_wait:
                response.headers["x-should-retry"] = "false"  # failover asks another provider
            if retries_left and self._client._should_retry(response):
                await anyio.sleep(_retry_wait(attempt, wait))
                continue
            raise self._client._make_status_error_from_response(response)
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- helpers --------------------------------------------------------------------------

    def _wire_messages(self, messages: Sequence[LLMMessage]) -> list[dict[str, Any]]:
        return [to_openai_message(m) for m in messages]

    def _request_body(
        self,
        model: str,
        wire_messages: list[dict[str, Any]],
        tools: Sequence[ToolSpec],
        temperature: float | None,
        max_tokens: int | None,
        tool_choice: str | dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The JSON body of one chat completions request.

        It goes to the client's documented low-level `post`, not through
        `chat.completions.create`: the body is already in wire form, and create()'s
        recursive TypedDict transform of every message cost half the gateway's CPU per
        turn (bench/replicas.py, "CPU per turn"), for a body it returned unchanged. The
        client still does auth, retries, timeouts, errors and response parsing."""
        body: dict[str, Any] = {"model": model, "messages": wire_messages}
        if tools:
            body["tools"] = [to_openai_tool(t) for t in tools]
            # The API rejects tool_choice without tools.
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        temperature = temperature if temperature is not None else self.default_temperature
        if temperature is not None:
            body["temperature"] = temperature
        max_tokens = max_tokens if max_tokens is not None else self.default_max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return body

    def _log_failure(self, failure: ModelFailure) -> ModelFailure:
        failure = dataclasses.replace(failure, detail=self._redactor.redact(failure.detail))
        logger.warning("LLM call failed ({}): {}", failure.kind, failure.detail)
        return failure

    def _error(self, failures: Sequence[ModelFailure]) -> LLMError:
        if not failures:  # pragma: no cover - candidate_models is never empty
            return LLMError("no model to try")
        return error_for_failures(failures)
