"""LLM providers: the provider protocol and the OpenAI-compatible implementation."""

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
