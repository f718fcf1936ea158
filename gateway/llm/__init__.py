"""LLM providers: the provider protocol, the OpenAI-compatible implementation, and the
failover across providers (`gateway.llm.failover`, `gateway.llm.breaker`)."""

from gateway.llm.types import (
    ContextOverflow,
    LLMConfigError,
    LLMError,
    LLMMessage,
    LLMProvider,
    LLMResponse,
    StreamDelta,
    TokenUsage,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "ContextOverflow",
    "LLMConfigError",
    "LLMError",
    "LLMMessage",
    "LLMProvider",
    "LLMResponse",
    "StreamDelta",
    "TokenUsage",
    "ToolCall",
    "ToolSpec",
]
