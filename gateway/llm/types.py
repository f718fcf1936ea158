"""Provider-neutral LLM message types and the provider protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]

#: The context window assumed when neither the operator nor the model's server says one.
DEFAULT_CONTEXT_WINDOW = 32_768

#: The kinds of model server whose context window the gateway can learn, each with the
#: setting that makes it larger (`gateway.llm.window.WINDOW_SETTINGS`).
ServerKind = Literal["llama.cpp", "llama-cpp-python", "ollama", "vllm", "openai"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call requested by the model; `arguments` is the decoded JSON object."""

    id: str
    function_name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "function_name": self.function_name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        return cls(
            id=str(data["id"]),
            function_name=str(data["function_name"]),
            arguments=dict(data.get("arguments") or {}),
        )


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts as reported by the provider for one completion."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenUsage:
        return cls(
            prompt_tokens=int(data.get("prompt_tokens", 0)),
            completion_tokens=int(data.get("completion_tokens", 0)),
            total_tokens=int(data.get("total_tokens", 0)),
        )


@dataclass(frozen=True, slots=True)
class LLMMessage:
    """One chat message. Immutable: build a new one instead of editing.

    `usage` and `model` are set on assistant messages produced by a provider, so the
    session records which model answered and what it cost.

    `images` (data URLs) go to the model with a user message as image parts, on the
    turn they arrived; they are not part of `to_dict`, so a session stores the file's
    reference (the entry's meta), never its bytes.
    """

    role: Role
    content: str | None = None
    tool_calls: Sequence[ToolCall] = ()
    tool_call_id: str | None = None
    name: str | None = None
    usage: TokenUsage | None = None
    model: str | None = None
    images: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tool_calls, tuple):
            object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        if self.usage is not None:
            d["usage"] = self.usage.to_dict()
        if self.model is not None:
            d["model"] = self.model
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLMMessage:
        usage = data.get("usage")
        return cls(
            role=data["role"],
            content=data.get("content"),
            tool_calls=tuple(ToolCall.from_dict(tc) for tc in data.get("tool_calls") or ()),
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
            usage=TokenUsage.from_dict(usage) if isinstance(usage, dict) else None,
            model=data.get("model"),
        )


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool offered to the model: name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LLMResponse:
    """The result of one completion: the assistant message and why it stopped.

    `provider` names the configured provider that answered (`[llm.providers.NAME]`, or
    "default" for `[llm]`'s own server), when the answer came through the failover."""

    message: LLMMessage
    model: str
    finish_reason: str | None = None
    provider: str | None = None

    @property
    def usage(self) -> TokenUsage | None:
        return self.message.usage


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """A piece of a streamed completion: text so far arrives as `text` increments;
    the last item of a stream carries `response` (the assembled message)."""

    text: str = ""
    response: LLMResponse | None = None


class LLMError(Exception):
    """The model could not answer (after retries and fallbacks). `user_message` is safe
    to show to a chat user; `str(exc)` is for operators and may carry more detail.

    `kinds` says what failed, as the provider classified it ("unavailable", "timeout",
    "rate_limited", "auth", "denied", "quota", "wrong_path", "not_found", "bad_request";
    empty: not said), and `retry_after` the seconds a rate-limited server asked to wait
    (None: it did not say): the failover (`gateway.llm.failover`) reads both to tell a
    provider that is down from a request no provider could answer."""

    def __init__(
        self,
        detail: str,
        *,
        user_message: str | None = None,
        kinds: tuple[str, ...] = (),
        retry_after: float | None = None,
    ) -> None:
        super().__init__(detail)
        self.user_message = (
            user_message or "The model is not answering right now. Please try again."
        )
        self.kinds = kinds
        self.retry_after = retry_after


class LLMConfigError(LLMError):
    """The provider is not configured well enough to make any call (e.g. no API key)."""


class ContextOverflow(LLMError):
    """The model's server refused a request as longer than the model's context window.

    `context_tokens` is the window the server named (None: it did not say), and
    `prompt_tokens` what it counted of the refused request (None: not said); `server` is
    the kind of server that answered, when its error shows it; `provider` the configured
    provider that refused it (set by the failover; None: not through it)."""

    def __init__(
        self,
        detail: str,
        *,
        context_tokens: int | None,
        prompt_tokens: int | None,
        server: ServerKind | None,
        user_message: str | None = None,
    ) -> None:
        window = f" ({context_tokens:,} tokens)" if context_tokens else ""
        super().__init__(
            detail,
            user_message=user_message
            or f"The request was longer than the model's context window{window}.",
            kinds=("bad_request",),
        )
        self.context_tokens = context_tokens
        self.prompt_tokens = prompt_tokens
        self.server = server
        self.provider: str | None = None


@dataclass(frozen=True, slots=True)
class ServerWindow:
    """A model's context window as its server states it.

    `source` says where it said so (e.g. "llama.cpp /props n_ctx"), `server` which kind of
    server it is. `settled` is False for a size assumed, not read (Ollama's default before
    the model is loaded): it is asked again once the model has answered."""

    tokens: int
    source: str
    server: ServerKind | None = None
    settled: bool = True


@runtime_checkable
class ServerWindowProbe(Protocol):
    """A provider that can ask its server for a model's context window."""

    async def server_window(self, model: str) -> ServerWindow | None:
        """The window the server states for `model`, or None when it states none.
        Raises `WindowUnknown` when the server could not be asked (down, too slow)."""
        ...


@runtime_checkable
class WindowRoutes(Protocol):
    """A provider that answers one model name from several servers (the failover), each
    with its own context window."""

    def window_key(self, model: str, provider: str | None = None) -> str:
        """The name `model`'s window is known by on `provider` (None: on the server a
        request for it goes to first now); a `ServerWindowProbe` takes that name."""
        ...


class WindowUnknown(Exception):
    """The model's server could not be asked for its context window (it did not answer)."""


@runtime_checkable
class LLMProvider(Protocol):
    """One seam for every model server. Implementations raise `LLMError` on failure."""

    async def chat(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> LLMResponse: ...

    def stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamDelta]: ...

    async def aclose(self) -> None: ...
